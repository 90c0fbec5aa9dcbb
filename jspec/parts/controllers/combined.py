"""Two controllers as one, each deciding its own fields of the step's `Decision` (e.g. SAGE's per-row trees and
TABED's ensemble weights on the same steps)."""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
from flax import struct

from jspec.core import rowkeys as RK
from jspec.parts.controllers import Asks, Controller, Decision, Record, asks_of


@struct.dataclass
class Both(Controller):
    """Runs `a` and `b` side by side: their states are a pair, their decisions are merged (a field decided by both,
    e.g. two depth limits, is an error; `info` entries are united), both observe every step, and `start`, `stop`
    and `check` run for both, in order (`stop` for those that stop)."""

    a: Any
    b: Any

    @property
    def asks(self) -> Asks:
        x, y = asks_of(self.a), asks_of(self.b)
        return Asks(**{f.name: max(getattr(x, f.name), getattr(y, f.name)) for f in dataclasses.fields(Asks)})

    @property
    def stops(self) -> bool:
        return self.a.stops or self.b.stops

    def init(self, batch: int, max_depth: int):
        return self.a.init(batch, max_depth), self.b.init(batch, max_depth)

    def decide(self, state, key) -> Decision:
        ks = None if key is None else RK.split(key, 2)
        ka, kb = (None, None) if ks is None else (ks[:, 0], ks[:, 1])
        da, db = self.a.decide(state[0], ka), self.b.decide(state[1], kb)
        merged = {}
        for f in Decision._fields:
            x, y = getattr(da, f), getattr(db, f)
            if f == "info":
                merged[f] = {**(x or {}), **(y or {})} or None
            elif x is not None and y is not None:
                raise ValueError(f"both controllers decide {f!r}: {type(self.a).__name__} and {type(self.b).__name__}")
            else:
                merged[f] = x if x is not None else y
        return Decision(**merged)

    def observe(self, state, record: Record):
        return self.a.observe(state[0], record), self.b.observe(state[1], record)

    def start(self, state, prefill):
        return self.a.start(state[0], prefill), self.b.start(state[1], prefill)

    def stop(self, state, level, aux, limit, key):
        for i, c in enumerate((self.a, self.b)):
            if c.stops:
                limit = c.stop(state[i], level, aux, limit, RK.fold(key, i))
        return limit

    def check(self, target, drafter) -> None:
        self.a.check(target, drafter)
        self.b.check(target, drafter)
