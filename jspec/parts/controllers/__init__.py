"""Controllers: what to draft next step, learned from what verification said.

A controller is a pytree object (its numbers are leaves: changing them does not recompile) with
- `asks`: an `Asks` (static) naming what the per-step `Record` must carry beyond the basics;
- `init(batch, max_depth) -> state`: its state, a pytree of fixed shape;
- `plan(state, key) -> Decision`: before each draft phase, per row: the draft depth limit, ensemble weights for a
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

import dataclasses
from typing import Any, NamedTuple

import jax


@dataclasses.dataclass(frozen=True)
class Asks:
    """What a controller reads from each step beyond the basics of `Record` (all off by default: nothing is
    computed that no one reads)."""

    target_logits: bool = False  # the target's logits at the accepted path's nodes
    draft_probs: bool = False  # the drafter's distribution at the accepted path's nodes
    draft_aux: bool = False  # the drafter's own per-node outputs (e.g. per-view probabilities) along the path
    root_topk: int = 0  # the drafter's k largest root probabilities
    node_topk: int = 0  # the drafter's k largest probabilities at every drafted node (plans with `node_outputs`)
    hidden: bool = False  # the target's last hidden state at the node the bonus token follows


class Decision(NamedTuple):
    """A controller's plan for one step (fields it does not set stay None)."""

    depth: jax.Array | None = None  # [B] int32 depth limit (clipped to [1, plan depth])
    weights: jax.Array | None = None  # [B, m] ensemble weights of a multi-view drafter
    tree: Any = None  # a per-row tree for plans that take one (`plans.LayeredTree` arrays [B, N])
    info: dict | None = None  # per-row numbers [B, ...] to keep per step in `out.stats` under their names


class Record(NamedTuple):
    """What one step did, per row. Arrays by depth have D+1 entries: node j of the accepted path (j = 0 the root)
    is the position whose target distribution decided token j+1 of `tokens`."""

    accepted: jax.Array  # [B] drafts accepted (bonus excluded)
    committed: jax.Array  # [B] tokens committed this step (after EOS / max_new_tokens cuts; 0 for finished rows)
    active: jax.Array  # [B] the row was decoding this step
    depth: jax.Array  # [B] the depth limit the step ran with
    drafted: jax.Array  # [B] draft nodes offered to the target
    path: jax.Array  # [B, D+1] node ids of the accepted path (entries past `accepted` are 0)
    on_path: jax.Array  # [B, N] bool: per-node verdict (node accepted; the root included)
    tokens: jax.Array  # [B, D+1] [accepted drafts..., bonus, 0...]
    target_logits: jax.Array | None = None  # [B, D+1, V] when asked
    draft_probs: jax.Array | None = None  # [B, D+1, V] when asked (zero past the drafted depth)
    draft_known: jax.Array | None = None  # [B, D+1] bool: draft_probs exist there (the node's level was drafted)
    draft_aux: Any = None  # the drafter's aux gathered along the path [B, D+1, ...] when asked
    root_topk: jax.Array | None = None  # [B, k] when asked
    node_topk: jax.Array | None = None  # [B, N, k] when asked (every node of the drafted tree)
    node_known: jax.Array | None = None  # [B, N] bool: node_topk exists there
    hidden: jax.Array | None = None  # [B, D_model] when asked


class Controller:
    """Base of controllers: the protocol's defaults (no state, no decision, nothing observed; no `start`, no
    per-level `stop`, nothing to check). A controller that ends drafts level by level sets `stops = True`."""

    asks = Asks()
    stops = False

    def init(self, batch: int, max_depth: int) -> Any:
        return None

    def plan(self, state, key) -> Decision:
        return Decision()

    def observe(self, state, record: Record):
        return state

    def start(self, state, prefill):
        return state

    def stop(self, state, level, aux, limit, key):
        return limit

    def check(self, target, drafter) -> None:
        pass


def asks_of(controller) -> Asks:
    return getattr(controller, "asks", Asks()) if controller is not None else Asks()


__all__ = ["Asks", "Controller", "Decision", "Record", "asks_of"]
