"""TABED: one draft LVLM drafts over several views of its prompt at once (multimodal M, text-only T, pooled P,
captioned C), their next-token probabilities mixed with weights re-picked every block from how each candidate
mixture matched the target at the verified positions so far. A multi-view drafter (`jspec.parts.drafters.views`) and
a weight controller (`jspec.parts.controllers.ensemble`) on the one engine; verification reads the mixture q, so
greedy output equals AR and sampled output is the target's distribution for any weights.

Metrics as the paper reports them: `block_efficiency` (pooled tau = 1 + mean accepted drafts over all blocks)
and `expected_speedup` (Eq. 1: tau / (gamma T_q / T_p + 1)) with the paper's measured T_q / T_p (`TQ_TP`).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from jspec.parts.controllers.ensemble import CRITERIA, EnsembleWeights
from jspec.parts.drafters.views import VIEWS, MultiViewDrafter
from jspec.strategies import preset
from jspec.parts.plans import StaticPlan
from jspec.engine.strategy import Speculative, Strategy
from jspec.parts.trees import chain
from jspec.parts.rules import as_rule

# The paper's method names (Table 1 rows): views and weight policy.
METHODS = {"M": (("M",), "static"), "T": (("T",), "static"), "C": (("C",), "static"), "P": (("P",), "static"),
           "MT": (("M", "T"), "static"), "MT*": (("M", "T"), "grid"), "MTCP": (("M", "T", "C", "P"), "static"),
           "MTCP*": (("M", "T", "C", "P"), "inverse")}

# T_q / T_p measured by the paper (Table 6, one A6000, fp16): (target, draft) -> ratio.
TQ_TP = {("7b", "68m"): 0.063, ("7b", "160m"): 0.206, ("13b", "68m"): 0.042, ("13b", "160m"): 0.137}

# The paper's pairs (shipped target configs): the draft checkpoint (LLaVA-1.5 layout: a LLaMA-68M LM, the CLIP-L/336
# tower, an MLP projector), the T view's newline id (LLaMA tokenizer) and the T_q / T_p preset.
PRESETS = {
    "llava-1.5-7b": {"draft": "mjbooo/lvlm68m", "newline_id": 13, "tq_tp": TQ_TP[("7b", "68m")]},
}


def preset_settings(name: str) -> dict:
    """The paper's settings for a shipped target config name (ValueError for one without a preset)."""
    return preset(PRESETS, name, "TABED", "pass the draft and newline_id yourself")


@dataclasses.dataclass(frozen=True)
class TABED(Strategy):
    """TABED over one draft model.

    views: some of "M", "T", "P", "C" (rows of one draft batch). weights: "grid" (MT*: candidates [1 - j/n, j/n],
    j = 0..n, a simplex grid for m > 2, picked by `criterion`), "inverse" (MTCP*: w_k from the inverse of view k's
    summed `distance`; `inverse` "normalized" (the code) or "softmax" (the paper), temperature `tau`), "static"
    (uniform), or m numbers (fixed weights). window: verified positions the policies look back over (None: the
    whole decode). gamma: the chain's length; tree: a static tree (a name or child-rank paths) instead of the
    chain. newline_id: the draft tokenizer's id of "\\n" (the T view). pool: the P view's pooling factor.
    captioner: the C view's (`jspec.ModelCaptioner` or any callable `images -> [ids per image]`). rule: as
    `Chain`'s (exact for any weights).
    """

    draft: Any
    views: Sequence[str] = ("M", "T")
    weights: Any = "grid"
    gamma: int = 5
    n: int = 10
    criterion: str = "num-accepted-kld"
    window: int | None = None
    captioner: Any = None
    pool: int = 2
    newline_id: int | None = None
    tree: Any = None
    distance: str = "kld"
    inverse: str = "normalized"
    tau: float = 1.0
    rule: Any = "residual"

    def __post_init__(self):
        object.__setattr__(self, "views", tuple(self.views))
        if isinstance(self.gamma, bool) or not isinstance(self.gamma, (int, np.integer)) or not 1 <= self.gamma <= 64:
            raise ValueError(f"gamma must be an integer in [1, 64], got {self.gamma!r}")
        if not self.views or len(set(self.views)) != len(self.views) or any(v not in VIEWS for v in self.views):
            raise ValueError(f"views must be distinct entries of {VIEWS}, got {self.views!r}")
        if isinstance(self.weights, str) and self.weights not in ("grid", "inverse", "static"):
            raise ValueError(f"unknown weight policy {self.weights!r}; expected 'grid', 'inverse', 'static' or "
                             f"{len(self.views)} numbers")
        if self.criterion not in CRITERIA:
            raise ValueError(f"unknown criterion {self.criterion!r}; expected one of {CRITERIA}")
        self.controller()  # the rest of the weight settings fail here, before any compute

    @classmethod
    def method(cls, name: str, draft, **kw) -> "TABED":
        """The paper's method `name` (a row of Table 1: "M", "T", "C", "P", "MT", "MT*", "MTCP", "MTCP*")."""
        if name not in METHODS:
            raise ValueError(f"unknown TABED method {name!r}; expected one of {list(METHODS)}")
        views, policy = METHODS[name]
        return cls(draft, views=views, weights=policy, **kw)

    def controller(self) -> EnsembleWeights:
        policy, fixed = (self.weights, None) if isinstance(self.weights, str) else ("static", self.weights)
        return EnsembleWeights.make(len(self.views), policy, self.n, self.criterion, self.distance, self.inverse,
                                    float(self.tau), self.window, fixed)

    def drafter(self) -> MultiViewDrafter:
        """The multi-view drafter alone, mixing with TABED's static (uniform or given) weights. An adaptive policy
        ("grid", "inverse") lives in TABED's controller, so this raises for one: put the strategy itself under the
        other method (`jspec.SAGE(TABED(...))` runs the weight controller beside SAGE's) to keep it."""
        c = self.controller()
        if isinstance(self.weights, str) and self.weights != "static":
            raise ValueError(f"TABED's {self.weights!r} weights are re-picked by its controller, which the drafter "
                             "alone does not carry: pass the TABED strategy itself (jspec.SAGE(TABED(...)) keeps "
                             "them), or weights='static' / fixed numbers for the drafter alone")
        return self._views(c)

    def _views(self, c: EnsembleWeights) -> MultiViewDrafter:
        return MultiViewDrafter(self.draft, self.views, c.fixed, self.newline_id, int(self.pool), self.captioner)

    def parts(self) -> Speculative:
        paths = chain(int(self.gamma)) if self.tree is None else self.tree
        c = self.controller()
        return Speculative(self._views(c), StaticPlan.from_paths(paths), as_rule(self.rule), c)


# ------------------------------------------------------------------------------------------------------ metrics


def block_efficiency(outputs) -> float:
    """Pooled tau over decode outputs: tokens committed per target step, i.e. 1 + mean accepted drafts, over all
    blocks of all rows (the paper's code pools blocks, not per-sample ratios)."""
    outputs = outputs if isinstance(outputs, (list, tuple)) else [outputs]
    acc = np.concatenate([np.asarray(o.stats["accepted"]).ravel() for o in outputs])
    acc = acc[acc > 0]
    return float(acc.mean()) if acc.size else float("nan")


def expected_speedup(tau: float, gamma: int, tq_tp: float) -> float:
    """The paper's Eq. (1): expected walltime speedup over AR of block efficiency tau with a chain of gamma drafts
    and a draft step costing tq_tp target steps (a verify costs about one target step)."""
    return float(tau) / (gamma * float(tq_tp) + 1.0)
