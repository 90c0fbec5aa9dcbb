"""Prompt lookup: drafts copied from the text itself, no draft model."""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jspec.engine.strategy import Speculative, Strategy
from jspec.parts.drafters.ngram import NgramDrafter
from jspec.parts.plans import StaticPlan
from jspec.parts.rules import as_rule


def _branches(gamma: int, branches: int) -> tuple:
    """`branches` chains of `gamma` drafts below one root, as child-rank paths."""
    return tuple(tuple([b] + [0] * d) for d in range(gamma) for b in range(branches))


@dataclasses.dataclass(frozen=True)
class PromptLookup(Strategy):
    """Prompt-lookup decoding: drafts copied from earlier occurrences of the text's last `max_ngram` (down to
    `min_ngram`) tokens in the prompt and the tokens generated so far (`jspec.parts.drafters.ngram`); no draft model.
    `gamma` drafts per branch; `branches` > 1 drafts that many distinct continuations side by side (a tree). The
    target verifies only as deep as some row found a copy (a step without one costs an AR step). `depths`: the
    deepest draft after a match of 1, 2, ..., max_ngram tokens (each <= gamma; default gamma for all), so that a
    weak one-token match drafts little and a long match a long copy."""

    max_ngram: int = 3
    gamma: int = 10
    branches: int = 1
    min_ngram: int = 1
    rule: Any = "residual"
    controller: Any = None
    depths: tuple | None = None

    def __post_init__(self):
        for name, top in (("gamma", 64), ("branches", 16), ("max_ngram", 64), ("min_ngram", 64)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not 1 <= v <= top:
                raise ValueError(f"PromptLookup {name} must be an integer in [1, {top}], got {v!r}")
        if self.min_ngram > self.max_ngram:
            raise ValueError(f"PromptLookup min_ngram={self.min_ngram} exceeds max_ngram={self.max_ngram}")
        if self.depths is not None:
            d = tuple(self.depths)
            if len(d) != self.max_ngram or any(isinstance(x, bool) or not isinstance(x, (int, np.integer)) or
                                               not 1 <= x <= self.gamma for x in d):
                raise ValueError(f"PromptLookup depths must give a draft depth in [1, gamma={self.gamma}] for each "
                                 f"match length 1 .. max_ngram={self.max_ngram}, got {self.depths!r}")

    @property
    def tree(self) -> tuple:
        return _branches(int(self.gamma), int(self.branches))

    def parts(self) -> Speculative:
        depths = None if self.depths is None else tuple(int(x) for x in self.depths)
        return Speculative(NgramDrafter(int(self.max_ngram), int(self.min_ngram), depths),
                           StaticPlan.from_paths(self.tree, trim=True), as_rule(self.rule),
                           self.controller)
