"""The search that picks which layers a layer-skipping draft leaves out (`jspec.parts.drafters.layer_skip`).

`search(target, batches, n_skip)` works by greedy backward elimination: starting from the full model, each round
drops the layer whose removal keeps the reduced model's top-1 next token equal to the target's on the most
held-in positions (teacher-forced over token sequences the target wrote), until `n_skip` layers are gone; the
record of every round (the agreement of each candidate) comes back with the set.
"""
from __future__ import annotations

from typing import Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jspec.parts.drafters.layer_skip import check_target, skip_layers
from jspec.tools.train import trainer as jt


@jax.jit
def _top1(model, batch):
    """The model's top-1 next token at every position of a packed batch (teacher-forced, fresh cache)."""
    from ports.core import cache as kvc

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
    n = check_target(target)
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
