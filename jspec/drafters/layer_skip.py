"""Layer skipping: the target with some of its decoder layers left out, as its own draft model (the "Self-SD"
baseline of EESD, after Zhang et al.'s Draft & Verify), and the search that picks which layers.

`skip_layers(target, skip)` is an ordinary `ports.Model` whose layers are the target's own arrays (nothing is
copied), so it drafts through any strategy that takes a draft model (`jspec.Chain(skip_layers(t, s), gamma=4)`):
it keeps its own KV cache of the layers it runs, filled by its own prefill, so every draft is exactly the
reduced model's prediction. No training.

`search(target, batches, n_skip)` picks the layers by greedy backward elimination: starting from the full model,
each round drops the layer whose removal keeps the reduced model's top-1 next token equal to the target's on the
most held-in positions (teacher-forced over token sequences the target wrote), until `n_skip` layers are gone;
the record of every round (the agreement of each candidate) comes back with the set.
"""
from __future__ import annotations

import dataclasses
from typing import Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

FAMILIES = ("llama", "qwen2")


def _check(target) -> int:
    cfg = target.config
    if getattr(cfg, "model_type", None) not in FAMILIES or not isinstance(target.params.get("layers"), list):
        raise ValueError(f"layer skipping needs a text model of {FAMILIES} with a list of layers; got "
                         f"{getattr(cfg, 'model_type', type(target).__name__)}")
    return cfg.num_layers


def skip_layers(target, skip: Iterable[int]):
    """`target` without the decoder layers `skip` (0-based indices): a model of the remaining layers, in order,
    sharing the target's arrays. ValueError for an index out of range, a repeated one, or skipping every layer."""
    import ports

    n = _check(target)
    skip = [int(i) for i in skip]
    bad = [i for i in skip if not 0 <= i < n]
    if bad or len(set(skip)) != len(skip) or len(skip) >= n:
        raise ValueError(f"cannot skip layers {skip} of a {n}-layer model: "
                         + (f"{bad} out of range" if bad else "repeated indices" if len(set(skip)) != len(skip)
                            else "at least one layer must remain"))
    keep = [i for i in range(n) if i not in set(skip)]
    params = {**target.params, "layers": [target.params["layers"][i] for i in keep]}
    hf = dict(target.hf_config or {})
    if "num_hidden_layers" in hf:
        hf["num_hidden_layers"] = len(keep)
    return ports.Model(dataclasses.replace(target.config, num_layers=len(keep)), params, hf)


@jax.jit
def _top1(model, batch):
    """The model's top-1 next token at every position of a packed batch (teacher-forced, fresh cache)."""
    from ports import cache as kvc
    from jspec import train as jt

    cfg, ids = model.config, batch["input_ids"]
    B, T = ids.shape
    cache = kvc.init_cache(cfg.num_layers, B, cfg.num_kv_heads, T, cfg.head_dim, model.params["embed"].dtype)
    out = model.forward(ids, batch["positions"], cache, jt.segment_mask(batch["segment_ids"]), fresh=True)
    return jnp.argmax(out.logits, -1)


def reference_top1(target, batches: Sequence[dict]) -> list[dict]:
    """Each batch with "reference": the full target's top-1 next token at every position."""
    return [{**b, "reference": _top1(target, {k: b[k] for k in ("input_ids", "positions", "segment_ids")})}
            for b in batches]


def agreement(target, skip: Iterable[int], batches: Sequence[dict]) -> float:
    """The share of weighted positions where `skip_layers(target, skip)`'s top-1 equals the full target's
    (`batches` from `reference_top1`)."""
    small = skip_layers(target, skip)
    hit = tot = 0.0
    for b in batches:
        pred = _top1(small, {k: b[k] for k in ("input_ids", "positions", "segment_ids")})
        w = np.asarray(b["weights"])
        hit += float(((np.asarray(pred) == np.asarray(b["reference"])) * w).sum())
        tot += float(w.sum())
    return hit / max(tot, 1.0)


def search(target, batches: Sequence[dict], n_skip: int, protect: Sequence[int] = (0,), progress=None):
    """Greedy backward elimination of `n_skip` layers (see the module docstring); `protect`: layers never skipped
    (the first, by default: every draft token's embedding goes through it). Returns (the skipped layers in the
    order they were dropped, rounds: [{"skip": set so far, "agreement": of it, "candidates": {layer: agreement}}]).
    """
    n = _check(target)
    if not 0 < n_skip < n - len(set(protect)) + 1:
        raise ValueError(f"n_skip must be in [1, {n - len(set(protect))}] for a {n}-layer model protecting "
                         f"{sorted(set(protect))}, got {n_skip}")
    batches = reference_top1(target, batches)
    skipped: list[int] = []
    rounds = []
    for r in range(n_skip):
        cands = {i: agreement(target, skipped + [i], batches) for i in range(n)
                 if i not in skipped and i not in protect}
        best = max(cands, key=lambda i: (cands[i], i))  # ties: the later layer
        skipped.append(best)
        rounds.append({"skip": list(skipped), "agreement": cands[best], "candidates": cands})
        if progress is not None:
            progress(r, best, cands[best])
    return skipped, rounds


def draft_cost(target, n_skip: int) -> float:
    """The reduced model's share of the target's multiply-adds per token (layers + LM head; attention over the
    cache left out): what skipping saves when the LM head is large."""
    cfg = target.config
    layer = sum(a.size for a in jax.tree.leaves(target.params["layers"][0]) if a.ndim >= 2)  # fused: 3-4 dims
    head = cfg.vocab_size * cfg.hidden_size
    return float(((cfg.num_layers - n_skip) * layer + head) / (cfg.num_layers * layer + head))
