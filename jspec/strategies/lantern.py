"""LANTERN and LANTERN++: relaxed speculative decoding for visual AR models over latent-neighbour image tokens.

A strategy here is the engine's parts: a drafter (an EAGLE-1 feature head, `jspec.parts.drafters.eagle`, or a separate
draft model), a tree plan (the static EAGLE-1 trees with drafts sampled without replacement, or EAGLE-2's dynamic
tree with deterministic drafts) and a relaxed acceptance rule (`jspec.parts.rules.LanternPPRule`: the neighbours' target
mass may raise a draft's up to lambda times its own; `jspec.parts.rules.LanternRule`: by at most delta). The neighbour
table (`jspec.parts.neighbours.NeighbourTable`, from the VQ codebook) and lambda, delta and k are data: new values do not
recompile. lambda = 1 or delta = 0 (or k = 0) is exact speculative sampling; greedy decoding is never relaxed.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from jspec.parts.drafters import Drafter
from jspec.parts.drafters.eagle import EagleHead
from jspec.strategies import preset
from jspec.parts.neighbours import NeighbourTable
from jspec.parts.plans import DynamicPlan, StaticPlan
from jspec.engine.strategy import Speculative, Strategy
from jspec.strategies.standard import as_drafter
from jspec.parts.rules import RESIDUAL_MODES, LanternPPRule, LanternRule

# EAGLE-2's dynamic tree as LANTERN++'s baseline runs it (spec 2.6): top_k 10, 5 levels, 58 drafts kept
DYNAMIC = dict(depth=5, top_k=10, total=58)

# Lumina-mGPT-7B-768 as LANTERN++ runs it (Table 2): k = 10, lambda = 3, CFG 3, top-k 2000, the extended tree; a
# 768 px image is 48 x 48 codes (Chameleon's VQGAN downsamples 16x), each row followed by an end-of-row token
PRESETS = {
    "lumina-mgpt-7b-768": dict(k=10, lam=3.0, tree="naive_extend_57", cfg_scale=3.0, top_k=2000, temperature=1.0,
                               rows=48, cols=48, prompt=("Generate an image of 768x768 according to the following "
                                                         "prompt:\n{caption}")),
}


def lumina_preset(name: str = "lumina-mgpt-7b-768") -> dict:
    """LANTERN++'s settings for a shipped config name (ValueError for one without a preset)."""
    return dict(preset(PRESETS, name, "LANTERN++", "pass k=, lam=, tree= yourself"))


def lantern_budget(config_name: str) -> tuple[int, int, str]:
    """(verify width, streams per row, a note) of LANTERN++ on `config_name` for `jspec memory`: its preset's tree
    and CFG (the extended tree and two streams without a preset)."""
    from jspec.parts.trees import build_tree

    try:
        p = lumina_preset(config_name)
    except ValueError:
        p = dict(tree="naive_extend_57", cfg_scale=3.0, rows=None)
    n = int(build_tree(p["tree"]).valid.sum())
    streams = 2 if p.get("cfg_scale") else 1
    grid = f", a {p['rows']} x {p['cols']} grid = {p['rows'] * (p['cols'] + 1) + 1} generated tokens" if p["rows"] else ""
    return n, streams, (f"LANTERN++: tree {p['tree']} ({n} nodes verified per step), CFG {p['cfg_scale']} "
                        f"({streams} streams){grid}")


def _drafter(draft):
    """`jspec.strategies.standard.as_drafter` of an EAGLE head, a drafter or a draft model; anything else is refused."""
    if isinstance(draft, (EagleHead, Drafter)) or (hasattr(draft, "config") and hasattr(draft, "params")):
        return as_drafter(draft)
    raise ValueError(f"draft must be an EagleHead (jspec.parts.drafters.eagle_io.load_head), a draft model or a drafter, "
                     f"got {type(draft).__name__}")


@dataclasses.dataclass(frozen=True)
class _RelaxedStrategy(Strategy):
    draft: Any
    table: NeighbourTable | None
    k: int
    tree: Any
    residual: str

    def _rule(self, drafts: str):
        """The relaxed rule with drafts "sampled" or "deterministic" (each strategy builds its own)."""
        raise NotImplementedError(f"{type(self).__name__} builds no rule (use LanternPP or Lantern)")

    def _checked_table(self) -> NeighbourTable:
        if not isinstance(self.table, NeighbourTable):
            raise ValueError(f"{type(self).__name__} needs table= a jspec.parts.neighbours.NeighbourTable built from the "
                             "target's VQ codebook (NeighbourTable.for_chameleon(cfg, codebook, k)); got "
                             f"{type(self.table).__name__}")
        return self.table

    def parts(self) -> Speculative:
        self._checked_table()
        drafter = _drafter(self.draft)
        if self.tree == "dynamic":
            return Speculative(drafter, DynamicPlan(**DYNAMIC), self._rule("deterministic"))
        return Speculative(drafter, StaticPlan.from_paths(self.tree), self._rule("sampled"))

    def check(self, target) -> None:
        if self.residual not in RESIDUAL_MODES:
            raise ValueError(f"unknown residual mode {self.residual!r}; use one of {RESIDUAL_MODES}")
        parts = self.parts()
        parts.rule.check(vocab_size=target.config.vocab_size)
        parts.check(target)


@dataclasses.dataclass(frozen=True)
class LanternPP(_RelaxedStrategy):
    """LANTERN++: accept a drafted image token x with probability min(1, q~(x) / p~(x)), where q~(x) adds to the
    target's q(x) the mass of x's nearest latent neighbours (a prefix of its k nearest) while the sum stays within
    lam * q(x). draft: an `EagleHead` (the paper's drafter) or a draft model of the target's vocabulary. table: the
    neighbour table of the target's VQ codebook. tree: "naive_extend_57" (the paper's), "mc_sim_7b_63", any
    child-rank paths, or "dynamic" (EAGLE-2's tree with deterministic drafts). residual: "principled" (the residual
    of q~), "lumina_code" or "llamagen_code" (the authors' code; see `jspec.parts.rules`). lam = 1 is exact."""

    draft: Any
    table: NeighbourTable | None = None
    k: int = 10
    lam: float = 3.0
    tree: Any = "naive_extend_57"
    residual: str = "principled"

    def _rule(self, drafts: str):
        return LanternPPRule(self.table, self.k, float(self.lam), self.residual, drafts)


@dataclasses.dataclass(frozen=True)
class Lantern(_RelaxedStrategy):
    """LANTERN: `LanternPP`'s relaxation with an additive bound, the neighbours' mass at most `delta` (the total
    variation it moves). delta = 0 is exact."""

    draft: Any
    table: NeighbourTable | None = None
    k: int = 10
    delta: float = 0.1
    tree: Any = "naive_extend_57"
    residual: str = "principled"

    def _rule(self, drafts: str):
        return LanternRule(self.table, self.k, float(self.delta), self.residual, drafts)
