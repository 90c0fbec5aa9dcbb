"""`Guarded`: any speculative strategy under the guard, which keeps decoding at AR's speed where speculation
cannot pay (`jspec.parts.controllers.guard`; its costs per device: `jspec.engine.costs`)."""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable

import numpy as np

from jspec.engine import costs as CO
from jspec.engine.costs import CostTable
from jspec.engine.strategy import Run, Speculative, Strategy
from jspec.parts.controllers.guard import Guard
from jspec.strategies.standard import AR

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Guarded(Strategy):
    """`strategy` (any speculative strategy) under the guard (`jspec.parts.controllers.guard`): each round, per row
    and per batch, it picks the depth that maximises expected tokens per measured second, down to no draft at all
    (an AR step), from the acceptance the rounds so far verified and `costs` (a `jspec.costs.CostTable`; None:
    `decode` measures it on the first call and caches it on disk). The strategy's own controller still runs; the guard
    only lowers its depth. `rate`: the least weight of a new round in the acceptance estimates (they average about
    the last 1 / rate rounds); `prior`: their starting value, worth `prior_rounds` rounds; `drift`: their pull back
    towards it where a drafting row's rounds do not look; `retry`: rounds without drafts before a row that stopped
    tries again (each try waits twice as long, up to `max_wait`, until one holds for `retry` rounds;
    `jspec.parts.controllers.guard`). `force` >= 0 drafts every row to that depth (what the cost measurement
    times). `defer`: AR rounds in a row whose tokens a drafter with a feed of its own (EAGLE heads, EESD, a draft
    model) may leave unread, so that they cost the target's step alone; the next drafting round reads them all."""

    strategy: Any
    costs: Any = None
    rate: float = 0.1
    prior: float = 0.5
    drift: float = 0.01
    force: int = -1
    defer: int = 24
    prior_rounds: float = 2.0
    retry: int = 16
    max_wait: int = 256

    def __post_init__(self):
        if not isinstance(self.defer, int) or self.defer < 0:
            raise ValueError(f"Guarded defer must be an int >= 0 (AR rounds a drafter may leave unread), got "
                             f"{self.defer!r}")
        if isinstance(self.strategy, (Guarded, AR)) or not isinstance(self.strategy, Strategy):
            raise ValueError(f"Guarded wraps a speculative strategy (Chain, Tree, PromptLookup, EESD, ...), got "
                             f"{type(self.strategy).__name__}")
        for name in ("rate", "prior", "drift"):
            v = getattr(self, name)
            if not 0.0 <= float(v) <= 1.0:
                raise ValueError(f"Guarded {name} must be in [0, 1], got {v!r}")
        if not float(self.prior_rounds) > 0.0:
            raise ValueError(f"Guarded prior_rounds must be > 0 (the rounds the prior counts as), got "
                             f"{self.prior_rounds!r}")
        for name in ("retry", "max_wait"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"Guarded {name} must be an int >= 1 (rounds), got {v!r}")
        if self.max_wait < self.retry:
            raise ValueError(f"Guarded max_wait ({self.max_wait}) must be at least retry ({self.retry})")

    def parts(self) -> Speculative:
        if self.costs is None:
            raise ValueError("Guarded has no cost table yet: jspec.decode measures one on its first call, or pass "
                             "costs=jspec.costs.measure(target, strategy, batch=..., prompt_len=...)")
        inner = self.strategy.parts()
        D = inner.plan.max_depth
        if self.costs.max_depth != D:
            raise ValueError(f"the cost table covers depths 0 .. {self.costs.max_depth}; the strategy drafts to depth "
                             f"{D} (measure its own table)")
        guard = Guard(np.asarray(self.costs.step_s, np.float32), inner.controller, self.rate, self.prior, self.drift,
                      self.force, self.defer, self.prior_rounds, self.retry, self.max_wait)
        return inner.replace(controller=guard)

    def drafts(self) -> bool:
        """Whether the guard can ever draft under its cost table: False when no depth's measured round costs less
        than the k + 1 tokens it could at best commit (`CostTable.drafting_can_pay`). The guard would then pick
        depth 0 in every round whatever it observes (E(k) <= k + 1 for every estimate), so `decode` runs the AR
        program instead: the same greedy tokens, exact sampling, and neither the drafter's compile nor its
        prefill. A guard with `force` >= 0 always drafts."""
        if self.costs is None:
            raise ValueError("Guarded has no cost table yet (`resolve` measures one)")
        return int(self.force) >= 0 or self.costs.drafting_can_pay()

    def check(self, target) -> None:
        self.strategy.check(target)
        if self.costs is not None:
            self.parts().check(target)

    def resolve(self, target, batch: int, prompt_len: int, start: Callable) -> Run:
        """The guarded parts, with the cost table for `target` at this batch and prompt length (measured, or from
        the disk cache); AR's program where no depth's measured round can pay (`drafts`)."""
        guarded = self if self.costs is not None else \
            dataclasses.replace(self, costs=self.measure_costs(target, batch, prompt_len, start))
        if guarded.drafts():
            return Run(guarded.parts())
        D = guarded.costs.max_depth
        log.info("Guarded %s: no round drafting to depth 1 .. %d costs less than the tokens it could commit here "
                 "(%s AR steps); decoding as AR", type(self.strategy).__name__, D,
                 ", ".join(f"{x:.2f}" for x in guarded.costs.relative()[1:]))
        return Run(None, idle_depth=D)

    def measure_costs(self, target, batch: int, prompt_len: int, start: Callable, **kw) -> CostTable:
        """The cost table of the guarded strategy on `target` (`jspec.engine.costs.measure`, with this guard's
        `defer`); `start` is `jspec.start`. Keywords: `measure`'s (`cache`, `reps`, `runs`, `progress`)."""
        self.strategy.check(target)
        return CO.measure(target, self.strategy.parts(), start, batch=batch, prompt_len=prompt_len, defer=self.defer,
                          **kw)

    @classmethod
    def of(cls, strategy) -> "Guarded":
        """`strategy` if it is guarded already, else the strategy under a default guard."""
        return strategy if isinstance(strategy, Guarded) else cls(strategy)
