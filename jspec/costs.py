"""`jspec.costs`: what a decode step costs on this device, measured for a strategy and cached on disk (the guard's
input). The table and its cache are `jspec.engine.costs`'; `measure` here takes a strategy as users name it."""
from __future__ import annotations

from jspec import api
from jspec.engine.costs import CostTable, costs_dir, probe_prompt, rounds_for, table_key
from jspec.strategies.guarded import Guarded


def measure(target, strategy, batch: int = 1, prompt_len: int = 128, cache: bool = True, reps=(4, 16),
            runs: int = 5, progress=None) -> CostTable:
    """The cost table of `strategy` (any speculative strategy, or a `Guarded` one, whose `defer` it measures with;
    a bare strategy is measured as `Guarded` guards it by default) on `target` at this batch and prompt length,
    measured on this device or read from the disk cache (`jspec.engine.costs.measure` says how)."""
    return Guarded.of(strategy).measure_costs(target, batch, prompt_len, api.start, cache=cache, reps=reps,
                                              runs=runs, progress=progress)


__all__ = ["CostTable", "costs_dir", "measure", "probe_prompt", "rounds_for", "table_key"]
