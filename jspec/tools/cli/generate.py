"""`jspec decode` and `jspec chat`: speculative decoding from the command line. Models by directory, Hub id,
`jspec convert` output or .gguf file; a strategy by name; the chat template when the tokenizer has one; images
or video for VLMs through the model's processor; text streamed as it is committed; a closing line with the
throughput, tokens per target step and acceptance."""
from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

STRATEGIES = ("ar", "chain", "tree", "dynamic", "sage", "eesd", "pld")


def add_args(p, chat: bool = False) -> None:
    p.add_argument("--model", required=True, help="HF checkpoint dir, Hub id (org/name), `jspec convert` output, "
                                                  ".gguf file or a registered name (`jspec fetch`'s)")
    p.add_argument("--draft", help="draft model (same forms); for --strategy eesd an early-exit head directory")
    p.add_argument("--strategy", choices=STRATEGIES, help="default: chain with --draft, else ar")
    p.add_argument("--gamma", type=int, default=5, help="draft length (chain, pld) or depth (dynamic)")
    p.add_argument("--tree", default="mc_sim_7b_63", help="tree: a named tree or JSON child-rank paths (tree, sage)")
    p.add_argument("--guard", action="store_true", help="run the strategy under jspec.Guarded: each round drafts only "
                                                        "as deep as pays on this device, down to AR steps (its costs "
                                                        "are measured on the first call and cached)")
    p.add_argument("--revision", help="Hub revision of --model / --draft")
    p.add_argument("--max-new-tokens", type=int, default=256 if chat else 32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int)
    p.add_argument("--top-p", type=float)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default=None)
    p.add_argument("--every", type=int, default=4, help="target steps between streamed pieces")
    p.add_argument("--image", action="append", default=[], help="an image file for a VLM (repeatable)")
    p.add_argument("--video", help="a video for a VLM: a directory of frame images or a .npy [T, H, W, 3] array")
    p.add_argument("--video-fps", type=float, help="the rate the --video frames were sampled at (Qwen2.5-VL's "
                                                   "temporal positions; default: the processor's, 2)")
    if not chat:
        p.add_argument("--prompt-ids", help="token ids, comma or space separated")
        p.add_argument("--prompt", help="text (needs a tokenizer beside the model)")
        p.add_argument("--chat", action="store_true", help="wrap --prompt in the tokenizer's chat template")


def load_model(name: str, dtype=None, revision=None):
    """(model, local directory or file) of a checkpoint given as a directory, Hub id, orbax output, .gguf or a
    registered name (`jspec fetch` names: fetched on first use, then loaded as `jspec.models.load` does)."""
    import ports
    from jspec.tools import models

    if name in models.REGISTRY and not os.path.exists(name):
        path = models.fetch(name)
        return models.load(name, dtype)[0], path
    if name.endswith(".gguf") and os.path.isfile(name):
        return ports.load_gguf(name, dtype=dtype, progress=True), name
    path = ports.io.hub.resolve(name, revision)
    if os.path.isdir(os.path.join(path, "params")):
        return ports.load(path, dtype=dtype), path
    return ports.load_hf(path, dtype=dtype, progress=True), path


def load_tokenizer(path: str, processor: bool = False, fps: float | None = None):
    """The tokenizer (or, for images / video, the processor) saved beside checkpoint `path`; SystemExit naming
    the directory when there is none. Qwen2-VL / Qwen2.5-VL checkpoints get `QwenVLInputs` where transformers'
    processor cannot load (its video processor needs torchvision) or a video frame rate is given."""
    try:
        if path.endswith(".gguf") and os.path.isfile(path):
            import ports

            return ports.tokenizer_from_gguf(path)
        from transformers import AutoProcessor, AutoTokenizer

        from jspec.tools.cli import qwen_inputs

        if not processor:
            return AutoTokenizer.from_pretrained(path, local_files_only=True)
        if qwen_inputs.family_of(path) and fps is not None:
            return qwen_inputs.QwenVLInputs(path, fps=fps)
        try:
            return AutoProcessor.from_pretrained(path, local_files_only=True)
        except ImportError:
            if not qwen_inputs.family_of(path):
                raise
            return qwen_inputs.QwenVLInputs(path)
    except Exception as e:  # noqa: BLE001 - report which directory lacks one
        kind = "a processor (for --image / --video)" if processor else "a tokenizer"
        raise SystemExit(f"this needs {kind} in {path}: {e}")


def make_strategy(args, target, draft_path):
    """The strategy `args.strategy` names, over the draft at `draft_path` (under the guard with `--guard`)."""
    import jspec

    strategy = _named_strategy(args, target, draft_path)
    if getattr(args, "guard", False):
        if strategy is None:
            raise SystemExit("--guard needs a speculative --strategy (AR has nothing to guard)")
        return jspec.Guarded(strategy)
    return strategy


def _named_strategy(args, target, draft_path):
    import jspec

    name = args.strategy or ("chain" if draft_path else "ar")
    if name in ("ar", "pld"):
        if draft_path:
            raise SystemExit(f"--strategy {name} takes no --draft")
        return None if name == "ar" else jspec.PromptLookup(gamma=args.gamma)
    if not draft_path:
        raise SystemExit(f"--strategy {name} needs --draft")
    if name == "eesd":
        from jspec.parts.drafters.early_exit import load_head

        return jspec.EESD(load_head(draft_path, target, dtype=args.dtype))
    draft, _ = load_model(draft_path, args.dtype, args.revision)
    tree = json.loads(args.tree) if args.tree.lstrip().startswith("[") else args.tree
    if name == "chain":
        return jspec.Chain(draft, gamma=args.gamma)
    if name == "tree":
        return jspec.Tree(draft, tree=tree)
    if name == "dynamic":
        return jspec.DynamicTree(draft, depth=args.gamma)
    return jspec.SAGE(draft, init_tree=tree)


def _vision_inputs(args) -> dict:
    from PIL import Image

    out = {}
    if args.image:
        out["images"] = [Image.open(p).convert("RGB") for p in args.image]
    if args.video:
        if os.path.isdir(args.video):
            frames = [np.asarray(Image.open(os.path.join(args.video, f)).convert("RGB"))
                      for f in sorted(os.listdir(args.video))]
            out["videos"] = [np.stack(frames)]
        else:
            out["videos"] = [np.load(args.video)]
    return out


def build_prompt(args, tok, text: str | None, messages: list | None = None):
    """What `jspec.decode` takes: token ids, or the processor's arrays when images or video are given."""
    vision = _vision_inputs(args) if (args.image or args.video) else {}
    if messages is not None:
        if getattr(tok, "chat_template", None) is None:
            raise SystemExit(f"{args.model}'s tokenizer has no chat template: use `jspec decode --prompt` instead")
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if vision:
        batch = tok(text=[text], return_tensors="np", **vision)
        return {k: np.asarray(v) for k, v in batch.items() if k != "attention_mask"}
    kw = {"add_special_tokens": False} if messages is not None else {}
    return np.asarray(tok(text, **kw)["input_ids"], np.int32)


def generate(model, prompt, strategy, args, tok, out=None):
    """Stream one reply to `out` (default stdout; text when `tok` is given); returns (token ids, the DecodeOutput,
    seconds)."""
    import jax
    import jspec

    out = sys.stdout if out is None else out
    t0 = time.perf_counter()
    s = jspec.stream(model, prompt, strategy, max_new_tokens=args.max_new_tokens, every=args.every,
                     temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, key=jax.random.key(args.seed))
    from tqdm import tqdm

    ids, shown = [], ""
    bar = tqdm(total=args.max_new_tokens, desc="decoding", unit="tok", disable=tok is not None, leave=False)
    for pieces in s:  # without a tokenizer the ids come at the end, and a progress bar shows on stderr meanwhile
        ids.extend(int(t) for t in pieces[0])
        bar.update(len(pieces[0]))
        if tok is not None and len(pieces[0]):
            text = tok.decode(ids, skip_special_tokens=True)
            if text.startswith(shown):  # a multi-token character is shown once it is whole
                out.write(text[len(shown):])
                out.flush()
                shown = text
    bar.close()
    if tok is not None:
        text = tok.decode(ids, skip_special_tokens=True)
        out.write(text[len(shown):] + "\n")
    return ids, s.output, time.perf_counter() - t0


def summary(out, seconds: float, strategy) -> str:
    """The closing line: tokens, throughput, tokens per target step and acceptance."""
    st = out.stats
    n = int(out.lengths[0])
    line = f"[jspec] {n} tokens in {seconds:.2f} s ({n / max(seconds, 1e-9):.1f} tokens/s incl. prefill)"
    line += f", {float(st['mean_accepted'][0]):.2f} tokens per target step"
    if strategy is not None:
        line += f", acceptance {float(st['acceptance_rate'][0]):.2f}"
    if "speculated_share" in st:
        line += f", speculated in {float(st['speculated_share'][0]):.0%} of its rounds"
    return line


def tokenizer_for(args, path: str, text_needed: bool):
    if not text_needed:
        return None
    return load_tokenizer(path, processor=bool(args.image or args.video), fps=args.video_fps)


def cmd_decode(args) -> int:
    model, path = load_model(args.model, args.dtype, args.revision)
    strategy = make_strategy(args, model, args.draft)
    tok = tokenizer_for(args, path, args.prompt is not None)
    if args.prompt is not None:
        prompt = build_prompt(args, tok, args.prompt, [{"role": "user", "content": args.prompt}] if args.chat
                              else None)
        text_tok = getattr(tok, "tokenizer", tok)
    elif args.prompt_ids is not None:
        prompt, text_tok = np.asarray([int(t) for t in args.prompt_ids.replace(",", " ").split()], np.int32), None
    else:
        raise SystemExit("give --prompt-ids or --prompt")
    ids, out, seconds = generate(model, prompt, strategy, args, text_tok)
    print(summary(out, seconds, strategy))
    print(json.dumps({"tokens": ids, "decode_s": round(out.stats["decode_s"], 4),
                      "tokens_per_step": round(float(out.stats["mean_accepted"][0]), 4)}))
    return 0


def cmd_costs(args) -> int:
    """`jspec costs`: the strategy's cost table on this device (measured, or read from the cache), and its plot."""
    import jspec

    model, _ = load_model(args.model, args.dtype, args.revision)
    strategy = _named_strategy(args, model, args.draft)
    if strategy is None:
        raise SystemExit("jspec costs measures a speculative --strategy (with --draft where it needs one)")
    table = jspec.costs.measure(model, strategy, batch=args.batch, prompt_len=args.prompt_len, cache=not args.fresh,
                                progress=lambda s: print(f"[jspec] measuring {s}", file=sys.stderr, flush=True))
    print(table.format())
    print(f"table: {jspec.costs.costs_dir() / (table.key + '.json')} (with its provenance)")
    from jspec.tools.report import cost_plot

    print(f"plot: {cost_plot(table, args.plot)}")
    return 0


def cmd_chat(args, stdin=None) -> int:
    """A multi-turn session: each line read is a user turn; the reply streams; an empty line or EOF ends it."""
    stdin = sys.stdin if stdin is None else stdin
    model, path = load_model(args.model, args.dtype, args.revision)
    strategy = make_strategy(args, model, args.draft)
    tok = load_tokenizer(path, processor=bool(args.image or args.video), fps=args.video_fps)
    text_tok = getattr(tok, "tokenizer", tok)
    messages: list[dict] = []
    while True:
        sys.stdout.write("> ")
        sys.stdout.flush()
        line = stdin.readline()
        if not line or not line.strip():
            return 0
        messages.append({"role": "user", "content": line.strip()})
        prompt = build_prompt(args, tok, None, messages)
        ids, out, seconds = generate(model, prompt, strategy, args, text_tok)
        messages.append({"role": "assistant", "content": text_tok.decode(ids, skip_special_tokens=True)})
        print(summary(out, seconds, strategy))
