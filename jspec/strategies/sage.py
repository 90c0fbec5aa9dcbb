"""SAGE (entropy-guided adaptive speculative decoding): the draft tree is re-planned every round from the draft's
confidence (`jspec.parts.controllers.entropy_tree`), drafted in a static slot budget and verified packed into
n_max + 1 tokens. A tree plan and a controller on the one engine; any drafter fits under it."""
from __future__ import annotations

import dataclasses
from typing import Any

from jspec.parts.controllers.combined import Both
from jspec.parts.controllers.entropy_tree import EntropyTree, TreeSpec
from jspec.parts.drafters.early_exit import EarlyExitDrafter, EarlyExitHead
from jspec.strategies import preset
from jspec.parts.plans import StaticPlan
from jspec.engine.strategy import Speculative, Strategy
from jspec.strategies.standard import as_drafter as strategy_drafter
from jspec.parts.trees import build_tree, cached_tree
from jspec.parts.rules import as_rule

# The paper's pairs (SAGE Tables 1-2; shipped configs), its settings (greedy, defaults of `SAGE`; the draft's video
# tokens pruned 90%, images 80%) and the 8-GPU plan of each target.
PRESETS = {
    "llava-onevision-qwen2-72b": {"draft": "llava-onevision-qwen2-7b", "prune_video": 0.9, "prune_image": 0.8,
                                  "memory": "jspec memory --config llava-onevision-qwen2-72b --sage --mesh tensor=8 "
                                          "--max-len 9216 --prompt-len 8192 --device-memory 80GB"},
    "qwen2.5-vl-72b": {"draft": "qwen2.5-vl-7b", "prune_video": 0.9, "prune_image": 0.8,
                       "memory": "jspec memory --config qwen2.5-vl-72b --sage --mesh tensor=8 --max-len 9216 "
                               "--prompt-len 8192 --device-memory 80GB"},
}


def preset_draft(name: str) -> str:
    """The paper's draft for a shipped target config name (ValueError for one without a preset)."""
    return preset(PRESETS, name, "SAGE", "pass --draft")["draft"]


def sage_budget(**settings) -> tuple[int, str]:
    """(tokens the target verifies per step, a note on the draft's slots) of `SAGE(**settings)`'s plan."""
    sage = SAGE(None, **settings)
    spec, plan = sage.spec(), sage.parts().plan
    lay = spec.layout
    return spec.n_max + 1, (f"SAGE: trees of <= {spec.n_max} drafts verified in {spec.n_max + 1} slots; the draft "
                            f"feeds <= {max(lay.widths)} tokens per level over {lay.max_depth - 1} levels into "
                            f"{plan.scratch} scratch slots (max-len must hold them)")


def as_drafter(draft):
    """An `EarlyExitHead` as its drafter; otherwise as `jspec.strategies.standard.as_drafter` (a drafter as is, an EAGLE head
    over the target's features, a model as a separate draft model)."""
    if isinstance(draft, EarlyExitHead):
        return EarlyExitDrafter(draft.replace(calibration=None))
    return strategy_drafter(draft)


@dataclasses.dataclass(frozen=True)
class SAGE(Strategy):
    """SAGE over any drafter.

    draft: a draft model, an `EarlyExitHead`, any drafter object (`jspec.parts.drafters`), or a speculative strategy
    whose drafter drafts SAGE's trees and whose controller (e.g. TABED's adaptive weights) runs beside SAGE's
    (`SAGE(TABED(...))`). d_min, d_max, w_min, w_max, k, n_max, theta0: the paper's Eq. 10-12 and threshold (d_max
    is the history rule's ceiling). history: the sliding-window rule on d_max (`window`, `low`, `high`), starting
    at `d_start` (None: d_max). force_alpha: plan every tree from this confidence instead of the draft's (an
    ablation: p~ still comes from the draft). confidence: "root" (the round's root distribution) or
    "mean_nodes" (the mean over its drafted nodes). threshold: "cumulative" (a path's proxy probability) or "local"
    (each candidate's own). adaptive_tree=False drafts `init_tree` every round (SD-Tree on SAGE's program).
    rule: "q1" (default; greedy decoding uses the longest match under any rule) or "residual": both are exact,
    since a round's tree depends only on earlier rounds. prefill: a draft-prefill hook (`jspec.engine.strategy`), e.g.
    `jspec.VisionPruning`. prune_ratio: the paper's setting, SpecVLM's pruning of the draft's `prune_modality`
    tokens ("video", "image" or "vision") at this ratio (a shorthand for that prefill hook).
    """

    draft: Any
    d_min: int = 3
    d_max: int = 8
    w_min: int = 2
    w_max: int = 10
    k: int = 10
    n_max: int = 64
    history: bool = True
    confidence: str = "root"
    threshold: str = "cumulative"
    theta0: float = 0.1
    adaptive_tree: bool = True
    init_tree: Any = "mc_sim_7b_63"
    window: int = 10
    low: float = 2.0
    high: float = 3.0
    alpha0: float = 0.5
    rule: Any = "q1"
    prefill: Any = None
    prune_ratio: float | None = None
    prune_modality: str = "video"
    force_alpha: float | None = None
    d_start: int | None = None

    def spec(self) -> TreeSpec:
        init = tuple(build_tree(self.init_tree if isinstance(self.init_tree, str) else
                                [list(p) for p in self.init_tree]).paths)
        return TreeSpec(self.d_min, self.d_max, self.w_min, self.w_max, self.k, self.n_max, self.theta0,
                        self.threshold, init)

    def __post_init__(self):
        self.spec()  # bad settings fail here, before any compute
        self.controller()
        if self.prune_ratio is not None and self.prefill is not None:
            raise ValueError("SAGE takes prune_ratio or a prefill hook, not both")
        self.hook()

    def hook(self):
        """The draft-prefill hook: `prefill`, or the pruning that `prune_ratio` asks for (None: neither)."""
        if self.prune_ratio is None:
            return self.prefill
        from jspec.strategies.specvlm import VisionPruning

        return VisionPruning(float(self.prune_ratio), modality=self.prune_modality)

    def controller(self) -> EntropyTree:
        return EntropyTree(self.spec(), self.confidence, self.adaptive_tree, self.history, self.window,
                           float(self.low), float(self.high), float(self.alpha0),
                           None if self.force_alpha is None else float(self.force_alpha), self.d_start)

    def parts(self) -> Speculative:
        spec = self.spec()
        plan = StaticPlan.of(_plan_tree(spec), verify_nodes=spec.n_max + 1, level_buckets=True)
        controller = self.controller()
        if isinstance(self.draft, Strategy):
            inner = self.draft.parts()
            if inner is None:
                raise ValueError("SAGE's draft cannot be autoregressive decoding (AR has no drafter)")
            if inner.prefill is not None:
                raise ValueError(f"SAGE over {type(self.draft).__name__}: its draft-prefill hook would be dropped; "
                                 "pass the hook to SAGE (prefill=) and the drafter alone")
            if inner.controller is not None:
                controller = Both(controller, inner.controller)
            return Speculative(inner.drafter, plan, as_rule(self.rule), controller, self.hook())
        return Speculative(as_drafter(self.draft), plan, as_rule(self.rule), controller, self.hook())


def _plan_tree(spec: TreeSpec):
    """The plan's own tree (the initial one) in the spec's layout."""
    return cached_tree(spec.init_tree, spec.layout)
