"""What a strategy is to the engine: a composition of parts, and the one hook by which a strategy becomes them.

`Speculative(drafter, plan, rule, controller, prefill)` is the general strategy (see `jspec.parts.drafters`,
`jspec.parts.plans`, `jspec.parts.rules`, `jspec.parts.controllers`; `prefill` is an optional hook over the target
prefill's by-products, below). The presets users name (`Chain`, `Tree`, `PromptLookup`, `Guarded`, the paper
methods) are in `jspec.strategies`; `parts()` turns any strategy into its `Speculative`, and parts swap with
`dataclasses.replace` on either form. `Strategy.resolve` is what a decode calls: the parts it runs on this target
at this shape (default: `parts()`); a strategy that must first measure something (the guard's cost table) or may
run as plain AR says so there, and nothing above it asks what type a strategy is.

Prefill hook protocol: `asks(tokens, lengths, inputs) -> dict` of forward options for the target's prefill
(e.g. `attn_query_weights`, `hidden_layers`), then `draft_prompt(prefill: TargetPrefill, prompt) -> prompt`
picks the drafter's prompt from what the prefill returned, inside the same program (SpecVLM's pruning).
Optional: `prepare(setup, prepared) -> hook` on the host before any compute (checks of the prompts, static
widths), `draft_len(max_len) -> int`, the drafter's cache length when the hook shortens its prompt, and
`info(prefill) -> dict` of per-row facts [B, ...] that `out.stats` reports (in program).

Inside the jitted programs a strategy travels as `split(parts)`: its array and number leaves are arguments (new
values do not recompile), everything else (shapes, layouts, flags, plain objects) is the static key.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import numpy as np
from flax import struct

from jspec.parts.controllers import Controller, asks_of
from jspec.parts.drafters import Drafter
from jspec.parts.plans import Plan
from jspec.parts.protocols import Needs, PrefillHook
from jspec.parts.rules import Rule, as_rule


class Run(NamedTuple):
    """How a decode runs a strategy (`Strategy.resolve`): its parts, or None for the target's AR program."""

    parts: "Speculative | None"
    idle_depth: int | None = None  # AR's program standing in for a strategy that would draft to this depth but
    # would not draft here (a guard whose measured costs say no draft pays): its stats report depth 0 each step


class Strategy:
    """Base of every strategy: `parts()` (None for AR), `check(target)` (host-side validation) and `resolve`."""

    def parts(self) -> "Speculative | None":
        raise TypeError(f"strategy {type(self).__name__} defines no `parts()` (its drafter, plan, rule, controller)")

    def check(self, target) -> None:
        self.parts().check(target)

    def resolve(self, target, batch: int, prompt_len: int, start: Callable) -> Run:
        """The parts a decode of `batch` prompts of up to `prompt_len` tokens runs on `target` (checked already).
        `start` is `jspec.start`, for a strategy that must time decodes first (the guard's cost table)."""
        return Run(self.parts())


def _defines(cls, name: str) -> bool:
    """Whether a part's own class (not the protocol's base) defines `name`."""
    bases = {b for b, _ in _BASES.values()} | {Rule, object}
    return any(name in vars(c) for c in cls.__mro__ if c not in bases)


_BASES = {"drafter": (Drafter, "jspec.parts.drafters.Drafter"), "plan": (Plan, "jspec.parts.plans.Plan"),
          "controller": (Controller, "jspec.parts.controllers.Controller"), "prefill": (PrefillHook, "jspec.PrefillHook")}


@struct.dataclass
class Speculative(Strategy):
    """The general speculative strategy: its parts (see the module docstring)."""

    drafter: Any
    plan: Any
    rule: Any = "residual"
    controller: Any = None
    prefill: Any = None

    def parts(self) -> "Speculative":
        return self if isinstance(self.rule, Rule) else self.replace(rule=as_rule(self.rule))

    @property
    def needs(self) -> Needs:
        asks = asks_of(self.controller)
        plan = self.plan
        defer = int(getattr(self.controller, "defers", 0) or 0)
        return Needs(asks, bool(as_rule(self.rule).draws), asks.hidden or bool(self.drafter.verify_hidden),
                     asks.hidden, self.controller is not None and self.controller.stops, plan.max_depth,
                     plan.scratch, plan.pending_width + defer, plan.scratch + plan.max_depth + 1 + defer, defer)

    def check(self, target) -> None:
        for name, (base, called) in _BASES.items():
            part = getattr(self, name)
            if (part is None and name in ("drafter", "plan")) or (part is not None and not isinstance(part, base)):
                raise ValueError(f"the strategy's {name} must be a {called} (a subclass holds the protocol and its "
                                 f"defaults), got {type(part).__name__}")
        renamed = [(part, old, new) for part, old, new in ((self.controller, "plan", "decide"),
                                                            (as_rule(self.rule), "verify", "accept"))
                   if part is not None and hasattr(type(part), old) and not _defines(type(part), new)]
        if renamed:
            part, old, new = renamed[0]
            raise ValueError(f"{type(part).__name__} defines `{old}`, which the engine no longer calls: the method is "
                             f"now `{new}` (same arguments{'' if new == 'decide' else ': key, proposal, logits, ...'})")
        rule = as_rule(self.rule)
        rule.check()
        self.drafter.check(target)
        self.plan.check(rule)
        if self.controller is not None and self.controller.stops and not self.plan.stops:
            raise ValueError(f"the controller {type(self.controller).__name__} ends drafts level by level; the plan "
                             f"{type(self.plan).__name__} cannot stop there (use a chain or a static tree)")
        if self.needs.asks.node_topk and not self.plan.node_outputs:
            raise ValueError(f"the controller {type(self.controller).__name__} reads every drafted node's "
                             f"distribution; the plan {type(self.plan).__name__} does not keep them (use a static "
                             "tree)")
        if self.controller is not None:
            self.controller.check(target, self.drafter)


@dataclasses.dataclass(frozen=True)
class Static:
    """The static half of a split strategy: its tree structure, the class of every node, and its non-array leaves
    (hashable: a jit key). The classes are kept apart because JAX's treedef equality does not tell two dataclass
    node types with equal metadata apart (two rules of different classes would share a program)."""

    treedef: Any
    types: tuple
    leaves: tuple


def _node_types(treedef) -> tuple:
    data = treedef.node_data()
    if data is None:
        return ()
    return (data[0],) + tuple(t for c in treedef.children() for t in _node_types(c))


def _is_number(x) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic, bool, int, float, complex))


def split(parts) -> tuple[Static, list]:
    """(static, dynamic leaves) of a pytree of parts: arrays and Python / NumPy numbers are dynamic."""
    leaves, treedef = jax.tree.flatten(parts)
    dyn = [np.asarray(x) if isinstance(x, (bool, int, float, complex)) else x if _is_number(x) else None
           for x in leaves]
    static = Static(treedef, _node_types(treedef), tuple(None if _is_number(x) else x for x in leaves))
    return static, dyn


def merge(static: Static, dyn: list):
    """Inverse of `split`."""
    return jax.tree.unflatten(static.treedef, [d if s is None else s for s, d in zip(static.leaves, dyn)])
