"""Layer skipping: the target with some of its decoder layers left out, as its own draft model (the "Self-SD"
baseline of EESD, after Zhang et al.'s Draft & Verify).

`skip_layers(target, skip)` is an ordinary `ports.Model` whose layers are the target's own arrays (nothing is
copied), so it drafts through any strategy that takes a draft model (`jspec.Chain(skip_layers(t, s), gamma=4)`):
it keeps its own KV cache of the layers it runs, filled by its own prefill, so every draft is exactly the
reduced model's prediction. No training.

Which layers to skip is searched offline (`jspec.tools.train.layer_skip.search`).
"""
from __future__ import annotations

import dataclasses
from typing import Iterable

import jax

FAMILIES = ("llama", "qwen2", "mistral")


def check_target(target) -> int:
    cfg = target.config
    if getattr(cfg, "model_type", None) not in FAMILIES or not isinstance(target.params.get("layers"), list):
        raise ValueError(f"layer skipping needs a text model of {FAMILIES} with a list of layers; got "
                         f"{getattr(cfg, 'model_type', type(target).__name__)}")
    return cfg.num_layers


def skip_layers(target, skip: Iterable[int]):
    """`target` without the decoder layers `skip` (0-based indices): a model of the remaining layers, in order,
    sharing the target's arrays. ValueError for an index out of range, a repeated one, or skipping every layer."""
    import ports

    n = check_target(target)
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


def draft_cost(target, n_skip: int) -> float:
    """The reduced model's share of the target's multiply-adds per token (layers + LM head; attention over the
    cache left out): what skipping saves when the LM head is large."""
    cfg = target.config
    layer = sum(a.size for a in jax.tree.leaves(target.params["layers"][0]) if a.ndim >= 2)  # fused: 3-4 dims
    head = cfg.vocab_size * cfg.hidden_size
    return float(((cfg.num_layers - n_skip) * layer + head) / (cfg.num_layers * layer + head))
