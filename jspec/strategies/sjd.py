"""Speculative Jacobi decoding: SJD (Teng et al., arXiv 2410.01699) and its maximal-coupling form MC-SJD (So et al.,
arXiv 2510.24211). Training-free self-speculation: the target drafts a window of its own next tokens by Jacobi
iteration (`jspec.parts.drafters.jacobi`), verified as a chain with the lossless rule (`jspec.parts.plans.WindowPlan`,
`jspec.parts.rules.Residual`). For text (`jspec.decode`) and images (`jspec.generate_image`, under CFG and the image
grammar as every strategy)."""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jspec.engine.strategy import Speculative, Strategy
from jspec.parts.drafters.jacobi import COUPLINGS, INITS, JacobiDrafter
from jspec.parts.plans import WindowPlan
from jspec.parts.rules import as_rule


@dataclasses.dataclass(frozen=True)
class SJD(Strategy):
    """Speculative Jacobi decoding with a window of `window` draft tokens per round (the papers use 16 to 32 on
    image targets). coupling: "maximal" (MC-SJD: each position's new draft coupled maximally with its previous one,
    the default) or "independent" (SJD: drawn afresh). init: the window's new positions, "random" (SJD's code: a
    uniform token among those allowed there, offered with a one-hot q) or "uniform" (offered with the uniform q it
    was drawn from). Both couplings and both inits sample the target's distribution exactly; greedy equals AR.
    rule / controller: as `Chain`'s (the rule must compare with q: "residual")."""

    window: int = 16
    coupling: str = "maximal"
    init: str = "random"
    rule: Any = "residual"
    controller: Any = None

    def __post_init__(self):
        w = self.window
        if isinstance(w, bool) or not isinstance(w, (int, np.integer)) or not 1 <= w <= 128:
            raise ValueError(f"SJD window must be an integer in [1, 128], got {w!r}")
        if self.coupling not in COUPLINGS:
            raise ValueError(f"SJD coupling must be one of {COUPLINGS}, got {self.coupling!r}")
        if self.init not in INITS:
            raise ValueError(f"SJD init must be one of {INITS}, got {self.init!r}")

    def parts(self) -> Speculative:
        return Speculative(JacobiDrafter(self.coupling, self.init), WindowPlan(int(self.window)), as_rule(self.rule),
                           self.controller)
