"""Controllers: what to draft next step, learned from what verification said.

A controller is a pytree object (its numbers are leaves: changing them does not recompile) with
- `asks`: an `Asks` (static) naming what the per-step `Record` must carry beyond the basics;
- `init(batch, max_depth) -> state`: its state, a pytree of fixed shape;
- `decide(state, key) -> Decision`: before each draft phase, per row: the draft depth limit, ensemble weights for a
  multi-view drafter, a per-row tree for plans that take one;
- `observe(state, record) -> state`: after each verification.
and optionally (`Controller`, the base every controller subclasses, does nothing in each)
- `start(state, prefill: TargetPrefill) -> state`: after the target's prefill (with `Asks.hidden` the prefill
  keeps the target's last-layer hidden states);
- `stop(state, level, aux, limit [B], key) -> limit` with `stops = True`: after each drafted level (plans with
  `stops`), from the
  drafter's per-node outputs `aux` [B, K, ...] at the level-1 nodes whose forward drafted `level`: lower a row's
  depth limit to end its draft there;
- `check(target, drafter)`: host-side validation (ValueError) before any compute.
All but `check` run on device inside the decode loop. The depth and weights a controller decided are kept per row and step
and returned in `out.stats` ("depth" [B, steps], "weights" [B, steps, m]), and so is each entry of its
`Decision.info` (e.g. SAGE's confidence and tree size).
"""
from __future__ import annotations

from jspec.parts.protocols import Asks, Controller, Decision, Record, asks_of

__all__ = ["Asks", "Controller", "Decision", "Record", "asks_of"]
