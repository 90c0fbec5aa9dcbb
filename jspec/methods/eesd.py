"""EESD (early-exiting speculative decoding): the target's first N layers + a trained head draft, a Thompson-sampling
controller picks each round's draft length (`jspec.controllers.draft_length`)."""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jspec.controllers.draft_length import as_controller
from jspec.drafters.early_exit import EarlyExitDrafter, EarlyExitHead
from jspec.plans import StaticPlan
from jspec.strategy import Speculative, Strategy, _cached_tree, _paths_key
from jspec.trees import chain
from jspec.verify import as_rule


@dataclasses.dataclass(frozen=True)
class EESD(Strategy):
    """Early-exit self-speculative decoding.

    head: an `EarlyExitHead` (`jspec.drafters.early_exit.load_head` / `init_head`; it names the target layer N it
    exits at and is checked against the target). controller: "beta" (`BetaTS()`), "cali" (`CaliTS` with the
    head's own calibration predictor), an int k (`FixedK(k)`) or any controller object. k_max: the longest draft (the static buffer). tree: None drafts a chain; a tree (a name or
    child-rank paths, as `Tree` takes) drafts that tree down to the controller's depth (greedy: the longest
    matching path wins). rule: as `Chain`'s.
    """

    head: EarlyExitHead
    controller: Any = "beta"
    k_max: int = 32
    tree: Any = None
    rule: Any = "residual"

    def __post_init__(self):
        if isinstance(self.k_max, bool) or not isinstance(self.k_max, (int, np.integer)) or not 1 <= self.k_max <= 64:
            raise ValueError(f"k_max must be an integer in [1, 64], got {self.k_max!r}")
        if not isinstance(self.head, EarlyExitHead):
            raise ValueError(f"head must be an EarlyExitHead (jspec.drafters.early_exit.load_head), got "
                             f"{type(self.head).__name__}")

    def parts(self) -> Speculative:
        paths = tuple(tuple(p) for p in chain(int(self.k_max))) if self.tree is None else _paths_key(self.tree)
        controller = as_controller(self.controller, self.head.calibration)
        return Speculative(EarlyExitDrafter(self.head.replace(calibration=None)), StaticPlan.of(_cached_tree(paths, None)),
                           as_rule(self.rule), controller)
