"""Measuring the shipped zoo pairs on held-out examples: exact match per task, and what greedy speculative decoding
gains per scenario, with the draft reading the image (TABED's M view) or a text stand-in for it (T view).

Used by scripts/eval_zoo.py, `jspec demo` and `jspec bench sd`:

    from jspec.tools.zoo import evaluate as ZE
    pair = ZE.load_pair("image")                       # target, draft, tokenizer, encoder of the shipped pair
    exs = ZE.scenario_examples("image", 20)["vqa"]
    ZE.exact_match(pair.target, pair, exs)             # [bool] per example
    ZE.sd_scenario(pair, exs, views=("M", "T"))        # per draft view: mean accepted, speedup over AR, ...
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np

from jspec.tools.zoo import data as ZD
from jspec.tools.zoo import world as ZW

PAIRS = {"text": ("text-target", "text-draft"), "image": ("image-target", "image-draft")}


class Pair(NamedTuple):
    name: str  # "text" | "image"
    target: object  # ports.Model
    draft: object
    tokenizer: object
    encoder: ZD.Encoder  # the target's view: T for the text pair, M for the image pair

    @property
    def view(self) -> str:
        return self.encoder.view

    @property
    def draft_views(self) -> tuple[str, ...]:
        """The views the draft can read: an image draft reads either; a text draft only text."""
        return ("M", "T") if self.view == "M" else ("T",)


def load_pair(name: str) -> Pair:
    """The shipped pair `name` ("text" or "image"); ValueError naming the shipped models if it is not installed."""
    from jspec.tools import zoo

    if name not in PAIRS:
        raise ValueError(f"unknown zoo pair {name!r}; expected one of {sorted(PAIRS)}")
    t_name, d_name = PAIRS[name]
    target, draft = zoo.load(t_name), zoo.load(d_name)
    tok = zoo.load_tokenizer(t_name)
    if name == "image":
        enc = ZD.Encoder(tok, image_tokens=target.config.tokens_per_image,
                        image_size=target.config.vision.image_size, view="M")
    else:
        enc = ZD.Encoder(tok, view="T")
    return Pair(name, target, draft, tok, enc)


def exact_match_tasks(pair: str) -> tuple[str, ...]:
    """The tasks whose exact match is reported for a pair (the image pair includes the OOD tasks)."""
    ZD.register_described_tasks()
    if pair == "text":
        return ZD.TEXT_PAIR_TASKS + ZW.tasks_of("second_turn")
    return ZD.TARGET_TASKS


def scenario_examples(pair: str, n: int, seed: int = 0) -> dict[str, list[ZW.Example]]:
    """n held-out examples per evaluation scenario of a pair. Image pair: the world's scenarios (caption, VQA,
    second turn, two images, OOD, text). Text pair: text chats, the described-scene versions of VQA / captions /
    image-grounded second turns, and the world's second turns in the T view."""
    ZD.register_described_tasks()
    if pair == "image":
        return {s: ZD.eval_set(s, n, seed) for s in ("caption", "vqa", "second_turn", "two_image", "ood", "text")}
    held = lambda task: [ZW.example("heldout", i, seed, [task]) for i in range(n)]
    return {"text": ZD.eval_set("text", n, seed, tasks=list(ZD.TEXT_TASKS)), "described_vqa": held("described_vqa"),
            "described_caption": held("described_caption"), "described_turn2": held("described_turn2"),
            "second_turn": ZD.eval_set("second_turn", n, seed)}


def answer_text(tokenizer, ids) -> str:
    """Decoded answer up to the first EOS, special tokens dropped."""
    from jspec.tools.zoo import tokenizer as TK

    ids = [int(i) for i in ids]
    if TK.EOS_ID in ids:
        ids = ids[:ids.index(TK.EOS_ID)]
    return tokenizer.decode(ids, skip_special_tokens=True)


def captioner(pair: Pair, max_new_tokens: int = 48):
    """The image pair's draft as a captioner (TABED's C view): asked for a short caption of each image, its answer
    put after "image: "."""
    import jspec
    from jspec.tools.zoo import tokenizer as TK

    ids = pair.encoder.text_ids
    return jspec.ModelCaptioner(pair.draft, [TK.BOS_ID, TK.USER_ID], ids("\nGive a short caption.") + [TK.ASSISTANT_ID],
                                prefix=ids("image: "), max_new_tokens=max_new_tokens, eos_token_id=TK.EOS_ID)


def batch_prompt(enc: ZD.Encoder, examples: Sequence[ZW.Example], view: str | None = None) -> dict:
    """One ragged batch prompt for `jspec.decode`: input_ids rows and the rows' images in row order."""
    ps = [enc.prompt(ex, view=view) for ex in examples]
    out = {"input_ids": [p["input_ids"][0] for p in ps]}
    pv = [p["pixel_values"] for p in ps if "pixel_values" in p]
    if pv:
        out["pixel_values"] = np.concatenate(pv)
    return out


def exact_match(model, pair: Pair, examples: Sequence[ZW.Example], view: str | None = None, max_new: int = 64,
                batch: int = 16) -> list[bool]:
    """Greedy answer == reference, per example (`view`: the prompt's view; default the pair's)."""
    import jspec

    hits = []
    for i in range(0, len(examples), batch):
        chunk = examples[i:i + batch]
        out = jspec.decode(model, batch_prompt(pair.encoder, chunk, view), max_new_tokens=max_new)
        hits += [answer_text(pair.tokenizer, out.tokens[b, :out.lengths[b]]) == ex.answer
                 for b, ex in enumerate(chunk)]
    return hits


SHAPE_VQA = ("vqa_colour", "vqa_shape", "vqa_count", "vqa_position", "vqa_size", "vqa_exists")


def described_example(ex: ZW.Example, seed: int = 0) -> ZW.Example:
    """The same example with each image replaced by its detailed description (what the text pair reads)."""
    import random

    turns = ZD.described(ex.turns, ex.images, random.Random(f"described/{seed}/{ex.split}/{ex.index}"))
    return ZW.Example(ex.task, ex.scenario, ex.split, ex.index, tuple(turns), ())


def by_objects(examples: Sequence[ZW.Example], hits: Sequence[bool]) -> dict[int, dict]:
    """Exact match grouped by the number of objects in each example's first image: {n: {"n": count, "exact_match":
    mean}} (shape scenes only; other examples are left out)."""
    groups: dict[int, list[bool]] = {}
    for ex, h in zip(examples, hits, strict=True):
        if ex.images and ex.images[0].kind == "shapes":
            groups.setdefault(len(ex.images[0].objects), []).append(bool(h))
    return {k: {"n": len(v), "exact_match": float(np.mean(v))} for k, v in sorted(groups.items())}


def binding(pair: Pair, n: int, seed: int = 0) -> dict[int, dict]:
    """The pair's target on n held-out examples of each shape-scene VQA task, grouped by the number of objects in
    the scene: one object needs no lookup, several need the asked-about object found first. The text pair reads
    each scene as its description."""
    exs = [ZW.example("heldout", i, seed, [t]) for t in SHAPE_VQA for i in range(n)]
    prompts = exs if pair.view == "M" else [described_example(e, seed) for e in exs]
    return by_objects(exs, exact_match(pair.target, pair, prompts))


def sd_scenario(pair: Pair, examples: Sequence[ZW.Example], views: Sequence[str] | None = None, runs: int = 3,
                gamma: int = 5, max_new: int = 64) -> dict[str, dict]:
    """Greedy AR vs greedy Chain(gamma) at batch 1 over the examples, for each draft view.

    Per view: mean accepted length (bonus included, pooled over all steps), whether every row equals AR, the
    per-step accepted lengths of the first run, and the speedup (median over runs of summed AR decode time /
    summed SD decode time; every prompt compiled before timing)."""
    import jspec

    views = tuple(views or pair.draft_views)
    strat = jspec.Chain(pair.draft, gamma=gamma)
    enc = pair.encoder
    prompts = [enc.prompt(ex) for ex in examples]
    d_prompts = {v: [None if v == pair.view else enc.prompt(ex, view=v) for ex in examples] for v in views}

    def run_all():
        ar_s, sd_s = 0.0, {v: 0.0 for v in views}
        outs = {v: [] for v in views}
        ar_toks = []
        for i, pr in enumerate(prompts):
            a = jspec.decode(pair.target, pr, max_new_tokens=max_new)
            ar_s += a.stats["decode_s"]
            ar_toks.append(a.tokens[0, :a.lengths[0]])
            for v in views:
                s = jspec.decode(pair.target, pr, strategy=strat, max_new_tokens=max_new, draft_prompt=d_prompts[v][i])
                sd_s[v] += s.stats["decode_s"]
                outs[v].append(s)
        return ar_s, sd_s, outs, ar_toks

    run_all()  # compile every prompt shape
    timed = [run_all() for _ in range(runs)]
    res = {}
    for v in views:
        outs, ar_toks = timed[0][2][v], timed[0][3]
        acc = np.concatenate([o.stats["accepted"][0][o.stats["accepted"][0] > 0] for o in outs])
        same = all(np.array_equal(o.tokens[0, :o.lengths[0]], a) for o, a in zip(outs, ar_toks))
        res[v] = {"prompts": len(examples), "mean_accepted": float(acc.mean()), "same_tokens": bool(same),
                  "accepted_per_step": acc.tolist(),
                  "speedup": float(np.median([t[0] / t[1][v] for t in timed])),
                  "ar_decode_s": [t[0] for t in timed], "sd_decode_s": [t[1][v] for t in timed]}
    return res
