"""EESD (early-exiting speculative decoding): the target's first N layers + a trained head draft, a Thompson-sampling
controller picks each round's draft length (`jspec.parts.controllers.draft_length`)."""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jspec.parts.controllers.draft_length import as_controller
from jspec.strategies import preset
from jspec.parts.drafters.early_exit import EarlyExitDrafter, EarlyExitHead
from jspec.parts.plans import StaticPlan
from jspec.engine.strategy import Speculative, Strategy
from jspec.parts.trees import chain
from jspec.parts.rules import as_rule


# The paper's exit layers (EESD Sec. 4.1: N = 3 of LLaMA-2-13B's 40 layers, 5 of 70B's 80) and the training
# command for each (`jspec train eesd` on a GPU machine; Table 9's LR 1e-3, batch 64, 2k / 4k tokens).
PRESETS = {
    "llama-2-13b": {"exit_layer": 3, "layers": 1, "command":
                    "jspec train eesd --target CKPT_DIR --texts open.jsonl --exit-layer 3 --batch 64 "
                    "--seq-len 2048 --lr 1e-3 --gen-share 0.5 --steps 20000"},
    "llama-2-70b": {"exit_layer": 5, "layers": 1, "command":
                    "jspec train eesd --target CKPT_DIR --texts open.jsonl --exit-layer 5 --batch 64 "
                    "--seq-len 4096 --lr 1e-3 --gen-share 0.5 --steps 20000"},
}


def preset_exit_layer(name: str) -> int:
    """The paper's exit layer for a shipped config name (ValueError for one without a preset)."""
    return preset(PRESETS, name, "EESD", "pass --eesd N")["exit_layer"]


@dataclasses.dataclass(frozen=True)
class EESD(Strategy):
    """Early-exit self-speculative decoding.

    head: an `EarlyExitHead` (`jspec.parts.drafters.early_exit.load_head` / `init_head`; it names the target layer N it
    exits at and is checked against the target). controller: "beta" (`BetaTS()`), "cali" (`CaliTS` with the
    head's own calibration predictor), an int k (`FixedK(k)`), any controller object, or None (no controller:
    every round drafts k_max). k_max: the longest draft (the static buffer). tree: None drafts a chain; a tree (a
    name or child-rank paths, as `Tree` takes) drafts that tree down to the controller's depth (greedy: the
    longest matching path wins). rule: as `Chain`'s.
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
            raise ValueError(f"head must be an EarlyExitHead (jspec.parts.drafters.early_exit.load_head), got "
                             f"{type(self.head).__name__}")

    def parts(self) -> Speculative:
        paths = chain(int(self.k_max)) if self.tree is None else self.tree
        controller = as_controller(self.controller, self.head.calibration)
        return Speculative(EarlyExitDrafter(self.head.replace(calibration=None)), StaticPlan.from_paths(paths),
                           as_rule(self.rule), controller)
