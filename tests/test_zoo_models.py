"""The shipped zoo models (assets/zoo/jspec_zoo/<name>/, trained by scripts/train_zoo.py): transformers loads each one and its
greedy `generate` equals jspec's greedy decode; the text target answers held-out text chats and the image target
answers VQA questions from the image; greedy Chain SD with either draft equals AR and accepts well above one token
per step; unknown names list the available ones."""
from __future__ import annotations

import dataclasses
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import numpy as np
import pytest
import torch
import transformers

import jspec
from jspec.tools import zoo
from jspec.tools.zoo import data as ZD
from jspec.tools.zoo.evaluate import answer_text as _answer
from jspec.tools.zoo import tokenizer as TK
from jspec.tools.zoo import world as ZW

# Measured on the shipped text pair (README, "Zoo models"), 20 held-out text-chat / story prompts: target exact
# match 1.00 (20/20; 0.95 over 40 + 40 held-out chats and stories), greedy Chain SD gamma=5 mean accepted length
# 4.94 (pooled over the batch's steps).
MIN_EXACT_MATCH = 0.85
MIN_MEAN_ACCEPTED = 4.0
# Image pair, the batch of test_image_pair_chain_sd_both_views: pooled over its VQA and caption rows (the draft's own
# distribution) the M-view draft is accepted 2.90 tokens per step (the draft shipped before its text prior, until
# 2026-11-24: 3.22; with image-target-base 3.11); its two-image rows are out of the draft's distribution and not
# counted.
MIN_IMAGE_MEAN_ACCEPTED = 2.5
# test_image_pair_views_differ_as_tabed_needs, pooled over 6 prompts each: captions M 4.69 / T 2.59, five-image
# stories M 1.53 / T 2.15 (the draft shipped before its text prior: stories M 1.44 / T 1.22, failing this test)
MIN_VIEW_GAP = 0.3
# Measured on the shipped image target (trained with the focus losses), the 32 held-out VQA prompts of
# ZD.eval_set("vqa", 32): exact match 0.94 with each prompt's own image, 0.44 with a same-task prompt's image
# (0.69 / 0.41 with image-target-base, shipped until 2026-11-24). Issue 8's bar, 0.90, is on 24 prompts per task
# (scripts/eval_zoo.py; measured 0.906).
N_VQA = 32
MIN_IMAGE_VQA_EXACT_MATCH = 0.85
MIN_IMAGE_VQA_GAIN = 0.30
N_PROMPTS = 20
MAX_NEW = 64



@pytest.fixture(scope="module")
def text_pair():
    return zoo.load("text-target"), zoo.load("text-draft")


@pytest.fixture(scope="module")
def text_prompts():
    tok = zoo.load_tokenizer("text-target")
    exs = ZD.eval_set("text", N_PROMPTS, tasks=list(ZD.TEXT_TASKS))   # not the described_* tasks, which another
                                                                    # test module's import may have registered
    enc = ZD.Encoder(tok, view="T")
    return tok, exs, [enc.prompt(ex)["input_ids"][0] for ex in exs]


@pytest.fixture(scope="module")
def text_ar(text_pair, text_prompts):
    return jspec.decode(text_pair[0], text_prompts[2], max_new_tokens=MAX_NEW)


def test_text_pair_shipped():
    assert {"text-target", "text-draft"} <= set(zoo.available())
    for name in ("text-target", "text-draft"):
        d = zoo.model_dir(name)
        assert (d / "tokenizer.json").exists() and (d / "config.json").exists()


def test_unknown_name_lists_available():
    with pytest.raises(ValueError, match=r"'nope' is not a zoo model; available: .*text-target.*text-draft"):
        zoo.load("nope")
    with pytest.raises(ValueError, match=r"available: .*text-target"):
        zoo.load_tokenizer("nope")
    assert zoo.load_tokenizer("text-target").eos_token_id == TK.EOS_ID
    with pytest.raises(ValueError, match="text model"):
        zoo.load_processor("text-target")


def _hf_prompt(name: str, proc_or_tok):
    """A held-out prompt for the model: a text chat (T view) for LLaMA, a VQA question with its image for LLaVA."""
    if name.startswith("text"):
        ex = ZD.eval_set("text", 4, tasks=list(ZD.TEXT_TASKS))[3]
        return dict(ZD.Encoder(proc_or_tok, view="T").prompt(ex))
    ex = ZD.eval_set("vqa", 4)[3]
    text = proc_or_tok.apply_chat_template(ex.messages(upto_last_answer=True), add_generation_prompt=True)
    size = zoo.load(name).config.vision.image_size
    return dict(proc_or_tok(text=[text], images=[ZW.render(ex.images[0], size)], return_tensors="np"))


# (the video pair, Qwen2.5-VL with its own prompts, is checked in test_zoo_video.py)
@pytest.mark.parametrize("name", [n for n in zoo.available() if not n.startswith("video")])
def test_transformers_loads_and_matches_greedy(name):
    d = str(zoo.model_dir(name))
    if name.startswith("text"):
        hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
        proc = transformers.AutoTokenizer.from_pretrained(d)
    else:
        hf = transformers.LlavaForConditionalGeneration.from_pretrained(d, dtype=torch.float32).eval()
        proc = transformers.AutoProcessor.from_pretrained(d)
    prompt = _hf_prompt(name, proc)
    with torch.no_grad():
        out = hf.generate(**{k: torch.tensor(v) for k, v in prompt.items()}, max_new_tokens=32, do_sample=False)
    want = out[0, prompt["input_ids"].shape[1]:].numpy()
    got = jspec.decode(zoo.load(name), prompt, max_new_tokens=32)
    np.testing.assert_array_equal(got.tokens[0, :got.lengths[0]], want)
    assert want[-1] == TK.EOS_ID                         # a trained model ends its answer


def test_text_target_exact_match(text_ar, text_prompts):
    tok, exs, _ = text_prompts
    hits = [_answer(tok, text_ar.tokens[b, :text_ar.lengths[b]]) == ex.answer for b, ex in enumerate(exs)]
    assert np.mean(hits) >= MIN_EXACT_MATCH, [(ex.answer, _answer(tok, text_ar.tokens[b]))
                                              for b, ex in enumerate(exs) if not hits[b]]


def test_text_pair_chain_sd(text_pair, text_prompts, text_ar):
    target, draft = text_pair
    sd = jspec.decode(target, text_prompts[2], strategy=jspec.Chain(draft, gamma=5), max_new_tokens=MAX_NEW)
    np.testing.assert_array_equal(sd.tokens, text_ar.tokens)
    np.testing.assert_array_equal(sd.lengths, text_ar.lengths)
    pooled = sd.stats["accepted"].sum() / sd.stats["steps"].sum()
    assert pooled >= MIN_MEAN_ACCEPTED, pooled


needs_image_pair = pytest.mark.skipif(not {"image-target", "image-draft"} <= set(zoo.available()),
                                      reason="the zoo image pair is not shipped in this install")


@needs_image_pair
def test_image_pair_chain_sd_both_views():
    """Greedy Chain SD with the image draft equals AR whether the draft reads the images (M view, the default) or a
    text stand-in (T view, `draft_prompt=`), on a ragged batch of VQA, caption and two-image prompts; on the
    single-image rows the M-view drafts are accepted well above one token per step."""
    from jspec.tools.zoo import evaluate as ZE

    pair = ZE.load_pair("image")
    exs = ZD.eval_set("vqa", 4) + ZD.eval_set("caption", 2) + ZD.eval_set("two_image", 2)
    prompt = ZE.batch_prompt(pair.encoder, exs)
    ar = jspec.decode(pair.target, prompt, max_new_tokens=32)
    strat = jspec.Chain(pair.draft, gamma=5)
    m = jspec.decode(pair.target, prompt, strategy=strat, max_new_tokens=32)
    t = jspec.decode(pair.target, prompt, strategy=strat, max_new_tokens=32,
                     draft_prompt=ZE.batch_prompt(pair.encoder, exs, view="T"))
    for sd in (m, t):
        np.testing.assert_array_equal(sd.tokens, ar.tokens)
        np.testing.assert_array_equal(sd.lengths, ar.lengths)
    single = slice(0, 6)  # the VQA and caption rows; two-image prompts are outside the draft's training
    pooled = m.stats["accepted"][single].sum() / m.stats["steps"][single].sum()
    assert pooled >= MIN_IMAGE_MEAN_ACCEPTED, pooled


@needs_image_pair
@pytest.mark.slow
def test_image_pair_views_differ_as_tabed_needs():
    """TABED's premise on the shipped pair, in small: the draft reading the images (M view) is accepted more on
    single-image captions, and its text-only view (T) more on five-image stories, which it never saw. Its text prior
    knows the story form; five images pull the M view to the endings of its single-image answers."""
    from jspec.tools.zoo import evaluate as ZE

    pair = ZE.load_pair("image")
    strat = jspec.Chain(pair.draft, gamma=5)

    def tau(exs, view):
        kw = {} if view == "M" else {"draft_prompt": ZE.batch_prompt(pair.encoder, exs, view="T")}
        sd = jspec.decode(pair.target, ZE.batch_prompt(pair.encoder, exs), strategy=strat, max_new_tokens=48, **kw)
        return sd.stats["accepted"].sum() / sd.stats["steps"].sum()

    captions = ZD.eval_set("caption", 6)
    stories = [ZW.example("heldout", i, 0, ["ood_story"]) for i in range(6)]
    cap_m, cap_t, story_m, story_t = tau(captions, "M"), tau(captions, "T"), tau(stories, "M"), tau(stories, "T")
    assert cap_m > cap_t + MIN_VIEW_GAP, (cap_m, cap_t)
    assert story_t > story_m + MIN_VIEW_GAP, (story_m, story_t)


@needs_image_pair
def test_image_target_answers_from_the_image():
    """The image target answers held-out VQA questions from the image: its greedy exact match with each prompt's own
    image is well above that with the image of another prompt asking the same kind of question (the same answer
    format, a different scene)."""
    from jspec.tools.zoo import evaluate as ZE

    pair = ZE.load_pair("image")
    exs = ZD.eval_set("vqa", N_VQA)
    k = len(ZW.tasks_of("vqa"))       # eval_set is round-robin over the VQA tasks: i and i + k share a task
    swapped = [dataclasses.replace(ex, images=exs[(i + k) % len(exs)].images) for i, ex in enumerate(exs)]
    own, other = np.mean(ZE.exact_match(pair.target, pair, exs)), np.mean(ZE.exact_match(pair.target, pair, swapped))
    assert own >= MIN_IMAGE_VQA_EXACT_MATCH and own - other >= MIN_IMAGE_VQA_GAIN, (own, other)


@needs_image_pair
def test_image_processor_shipped():
    proc = zoo.load_processor("image-target")
    ex = ZD.eval_set("vqa", 1)[0]
    text = proc.apply_chat_template(ex.messages(upto_last_answer=True), add_generation_prompt=True)
    cfg = zoo.load("image-target").config
    out = proc(text=[text], images=[ZW.render(ex.images[0], cfg.vision.image_size)], return_tensors="np")
    assert int((out["input_ids"] == TK.IMAGE_ID).sum()) == cfg.tokens_per_image
