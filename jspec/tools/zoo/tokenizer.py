"""The zoo's tokenizer: a small byte-level BPE trained on the world's text, and the chat format around it.

Special tokens (fixed ids): <pad>=0, <s>=1 (BOS), </s>=2 (EOS, ends every assistant answer), <image>=3 (one image
placeholder), <|user|>=4, <|assistant|>=5. The tokenizer adds no special tokens by itself: the chat format does.

Chat format (`chat_text`, and the same string from `CHAT_TEMPLATE` through `apply_chat_template`):
    <s><|user|><image>\\nWhat colour is the circle?<|assistant|>red</s><|user|>What is 2 plus 3?<|assistant|>5</s>
Each image of a user turn is '<image>\\n' before its text; a generation prompt ends with '<|assistant|>'.

    tok = load_tokenizer()                        # the shipped one (jspec/tools/zoo/assets/tokenizer), a
                                                  # transformers PreTrainedTokenizerFast with the chat template
    proc = make_processor(tok, image_size=64, patch_size=16)    # LlavaProcessor: '<image>' -> 16 placeholders
    proc.apply_chat_template(example.messages(upto_last_answer=True), add_generation_prompt=True)

Rebuild the shipped files (deterministic): `python -m jspec.tools.zoo.tokenizer [OUT_DIR]`.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Iterator

from jspec.tools.zoo import world as ZW

PAD, BOS, EOS, IMAGE, USER, ASSISTANT = "<pad>", "<s>", "</s>", "<image>", "<|user|>", "<|assistant|>"
SPECIAL_TOKENS = (PAD, BOS, EOS, IMAGE, USER, ASSISTANT)          # ids 0..5 in this order
PAD_ID, BOS_ID, EOS_ID, IMAGE_ID, USER_ID, ASSISTANT_ID = range(6)
VOCAB_SIZE = 1024
CORPUS_EXAMPLES = 30_000
ASSET_DIR = Path(__file__).parent / "assets" / "tokenizer"

CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}{{- '<|user|>' -}}"
    "{%- elif message['role'] == 'assistant' -%}{{- '<|assistant|>' -}}"
    "{%- else -%}{{- raise_exception('unknown chat role ' + message['role']) -}}{%- endif -%}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' -%}{{- '<image>\\n' -}}"
    "{%- elif item['type'] == 'text' -%}{{- item['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- if message['role'] == 'assistant' -%}{{- eos_token -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>' -}}{%- endif -%}"
)


def turn_text(turn: ZW.Turn) -> str:
    """A turn's content as the template renders it ('<image>\\n' per image, then the text)."""
    return f"{IMAGE}\n" * turn.n_images + turn.text


def chat_text(example: ZW.Example, upto_last_answer: bool = False) -> str:
    """The example in the chat format; with upto_last_answer=True, the generation prompt for its final answer."""
    turns = example.turns[:-1] if upto_last_answer else example.turns
    out = [BOS]
    for t in turns:
        if t.role == "user":
            out.append(USER + turn_text(t))
        elif t.role == "assistant":
            out.append(ASSISTANT + t.text + EOS)
        else:
            raise ValueError(f"unknown chat role {t.role!r}")
    if upto_last_answer:
        out.append(ASSISTANT)
    return "".join(out)


def corpus(n_examples: int = CORPUS_EXAMPLES, seed: int = 0) -> Iterator[str]:
    """Training text for the BPE: the turn texts of `n_examples` training examples (text between special tokens)
    plus every knowledge-base entry and every word of the world's vocabulary."""
    for ex in ZW.examples("train", n_examples, seed=seed):
        for t in ex.turns:
            yield ("\n" * t.n_images) + t.text
    for country, capital in ZW.KB_COUNTRIES.items():
        yield f"The capital of {country} is {capital}."
    for name, (colour, legs, food) in ZW.KB_CREATURES.items():
        yield f"A {name} is {colour}, has {legs} legs and eats {food}."
    yield " ".join(list(ZW.COLOURS) + list(ZW.SHAPES) + list(ZW.PLURAL.values()) + list(ZW.POSITIONS.values()))


def train_tokenizer(vocab_size: int = VOCAB_SIZE, n_examples: int = CORPUS_EXAMPLES, seed: int = 0):
    """A byte-level BPE (`tokenizers.Tokenizer`) trained on `corpus(n_examples, seed)`; deterministic."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus(n_examples, seed), trainer=trainer)
    for i, s in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(s) != i:
            raise RuntimeError(f"special token {s!r} got id {tok.token_to_id(s)}, expected {i}")
    return tok


def to_transformers(tok):
    """Wrap a `tokenizers.Tokenizer` as a transformers PreTrainedTokenizerFast with our special tokens and template."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
        extra_special_tokens={"image_token": IMAGE, "user_token": USER, "assistant_token": ASSISTANT},
        chat_template=CHAT_TEMPLATE, model_max_length=4096, padding_side="right", add_bos_token=False,
        add_eos_token=False, clean_up_tokenization_spaces=False)


def save_tokenizer(tok, out_dir: str | os.PathLike) -> Path:
    """Write tokenizer.json, tokenizer_config.json, chat_template.jinja and special_tokens_map.json to out_dir."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    to_transformers(tok).save_pretrained(out)
    special = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD,
               "additional_special_tokens": [IMAGE, USER, ASSISTANT]}
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    return out


def load_tokenizer(path: str | os.PathLike | None = None):
    """transformers.AutoTokenizer for `path` (default: the shipped tokenizer)."""
    from transformers import AutoTokenizer

    path = Path(path) if path is not None else ASSET_DIR
    if not (path / "tokenizer.json").exists():
        raise FileNotFoundError(f"no tokenizer.json in {path}; build one with `python -m jspec.tools.zoo.tokenizer {path}`")
    return AutoTokenizer.from_pretrained(str(path))


def image_tokens(image_size: int, patch_size: int, vision_feature_select_strategy: str = "default") -> int:
    """Placeholders per image for a CLIP tower (with a CLS token): LLaVA's 'default' drops CLS, 'full' keeps it."""
    if image_size % patch_size:
        raise ValueError(f"image_size {image_size} is not a multiple of patch_size {patch_size}")
    n = (image_size // patch_size) ** 2
    if vision_feature_select_strategy == "full":
        return n + 1
    if vision_feature_select_strategy == "default":
        return n
    raise ValueError(f"unknown vision_feature_select_strategy {vision_feature_select_strategy!r}")


def make_image_processor(image_size: int = 64):
    """A CLIP image processor for size x size images (CLIP mean/std; our renders pass through resize/crop as is).
    The PIL backend when torchvision is missing (the same class transformers would fall back to)."""
    import importlib.util

    import transformers
    has_torchvision = importlib.util.find_spec("torchvision") is not None
    cls = transformers.CLIPImageProcessor if has_torchvision else transformers.CLIPImageProcessorPil
    return cls(size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size})


def make_processor(tokenizer=None, image_size: int = 64, patch_size: int = 16,
                   vision_feature_select_strategy: str = "default"):
    """transformers.LlavaProcessor over the zoo tokenizer: expands each '<image>' to
    image_tokens(image_size, patch_size, strategy) placeholders."""
    from transformers import LlavaProcessor

    tok = tokenizer if tokenizer is not None else load_tokenizer()
    image_tokens(image_size, patch_size, vision_feature_select_strategy)   # validates the arguments
    return LlavaProcessor(image_processor=make_image_processor(image_size), tokenizer=tok, patch_size=patch_size,
                          vision_feature_select_strategy=vision_feature_select_strategy, chat_template=CHAT_TEMPLATE,
                          image_token=IMAGE, num_additional_image_tokens=1)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    out = Path(argv[0]) if argv else ASSET_DIR
    tok = train_tokenizer()
    save_tokenizer(tok, out)
    print(f"wrote {out} (vocab {tok.get_vocab_size()})")


if __name__ == "__main__":
    main()
