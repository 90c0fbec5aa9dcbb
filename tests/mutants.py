"""Mutants: each switches one method's own mechanism off while its output stays lossless, so that tests proving
only losslessness cannot tell it from the real method. `tests/test_mutants.py` (slow) runs each mutant's test files
under it and asserts that they fail; a default test asserts that each patch really replaces what it names.

Set `JSPEC_MUTANT=<name>` to run any pytest command under a mutant (tests/conftest.py applies it at start-up, in
pytest-xdist workers too).
"""
from __future__ import annotations

import dataclasses
import os
from typing import Callable


@dataclasses.dataclass(frozen=True)
class Mutant:
    """`owner.attr` is replaced by `make(original)`; `files` are the default-suite test files that must notice."""

    owner: Callable[[], object]  # imported lazily: the conftest applies a mutant before the tests import jspec
    attr: str
    make: Callable
    files: tuple[str, ...]
    why: str


def _tabed_owner():
    from jspec.parts.drafters.views import MultiViewDrafter

    return MultiViewDrafter


def _uniform_weights(original):
    import jax.numpy as jnp

    def _weights(self, env, batch):
        return jnp.full((batch, self.m), 1.0 / self.m, jnp.float32)

    return _weights


def _pruning_owner():
    from jspec.strategies.specvlm import VisionPruning

    return VisionPruning


def _uniform_keep(original):
    import jax

    from jspec.strategies import pruning as PR

    def keep(self, prefill):
        a, n = self.scores(prefill)
        return PR.select(a, n, self.ratio, "uniform", self.top_p, jax.random.key(self.seed), self.frame_tokens)

    return keep


def _sage_owner():
    from jspec.parts.controllers.entropy_tree import EntropyTree

    return EntropyTree


def _initial_tree_every_round(original):
    import jax.numpy as jnp

    from jspec.parts.protocols import LayeredTree

    def decide(self, state, key):
        d = original(self, state, key)
        B = d.depth.shape[0]
        init = [jnp.broadcast_to(jnp.asarray(a), (B,) + jnp.shape(a)) for a in self.spec.initial()]
        return d._replace(tree=LayeredTree(*init))  # the planned depth and the reported plan are kept

    return decide


def _beta_owner():
    from jspec.parts.controllers.draft_length import BetaTS

    return BetaTS


def _frozen_posterior(original):
    def observe(self, state, record):
        return state

    return observe


def _lantern_owner():
    from jspec.parts.rules import LanternPPRule

    return LanternPPRule


def _no_neighbour_mass(original):
    import jax.numpy as jnp

    def bound(self, rx):
        return jnp.full(rx.shape, -1.0, rx.dtype)  # no neighbour fits: q~(x) = q(x), the exact rule

    return bound


def _block_tree_owner():
    from jspec.parts.plans import BlockTreePlan

    return BlockTreePlan


def _argmax_chain(original):
    import jax.numpy as jnp

    from jspec.parts import plans as PL

    def propose(self, env, drafter, ds, key, decision):
        best_paths = PL.best_paths

        def chain_only(logp, top_k, total, limit=None):  # every token but each position's best scores -inf
            return best_paths(jnp.where(logp >= logp.max(-1, keepdims=True), logp, -jnp.inf), top_k, total, limit)

        PL.best_paths = chain_only  # for this trace only
        try:
            return original(self, env, drafter, ds, key, decision)
        finally:
            PL.best_paths = best_paths

    return propose


def _guard_owner():
    from jspec.parts.controllers.guard import Guard

    return Guard


def _guard_depth(depth_of):
    """A Guard.decide whose depths are `depth_of(guard, state, decided depths)`."""
    def make(original):
        def decide(self, state, key):
            d = original(self, state, key)
            depth = depth_of(self, state, d.depth)
            return d._replace(depth=depth, info={**d.info, "speculated": depth > 0})

        return decide

    return make


def _always_ar(original):  # every round an AR step; the cost measurement's forced depth stays
    import jax.numpy as jnp

    return _guard_depth(lambda g, s, d: jnp.where(jnp.asarray(g.force) >= 0, d, 0))(original)


def _never_ar(original):  # every row drafts to the plan's full depth
    import jax.numpy as jnp

    return _guard_depth(lambda g, s, d: jnp.full_like(d, s.alpha.shape[1]))(original)


def _dflash_owner():
    from jspec.parts.drafters import dflash

    return dflash


def _blind_positions(original):
    import jax.numpy as jnp

    def block_visibility(head, cache, width):
        vis = original(head, cache, width)  # the anchor keeps the context; the mask positions see only the block
        return vis._replace(old=vis.old & (jnp.arange(width) == 0)[None, :, None])

    return block_visibility


def _jacobi_owner():
    from jspec.parts.drafters import jacobi

    return jacobi


def _independent_coupling(original):
    from jspec.parts.drafters import jacobi

    return jacobi.independent_draw  # each new draft drawn afresh: SJD, still exact


def _residual_from_p(original):
    import jax.numpy as jnp

    from jspec.core import rowkeys as RK

    def maximal_coupling(key, p, x, q, has_x):  # keeps x as the coupling does, else draws p, not norm(max(0, p - q))
        at = lambda d: jnp.take_along_axis(d, x[..., None], axis=-1)[..., 0]  # noqa: E731
        keep = has_x & (RK.uniform(RK.split(key, 2)[:, 0], x.shape[1:]) * at(q) <= at(p))
        logp = jnp.where(p > 0, jnp.log(jnp.maximum(p, 1e-38)), -jnp.inf)
        return jnp.where(keep, x, RK.categorical(RK.split(key, 2)[:, 1], logp)).astype(jnp.int32)

    return maximal_coupling


def _feed_owner():
    from jspec.parts.drafters.feed import FeedDrafter

    return FeedDrafter


def _reads_at_once(original):  # the protocol's catch_up: a round without drafts runs the drafter's forward
    from jspec.parts.protocols import Drafter

    return Drafter.catch_up


def _recurrent_owner():
    from ports.core import recurrent

    return recurrent


def _whole_draft(original):  # every forward's tokens committed to the recurrent state, accepted or not
    import jax.numpy as jnp

    def advance(state, new, src, n):
        return original(state, new, src, jnp.where(n > 0, src.shape[1], 0))

    return advance


MUTANTS = {
    "tabed-uniform-weights": Mutant(_tabed_owner, "_weights", _uniform_weights, ("tests/test_tabed.py",),
                                    "the multi-view drafter mixes its views uniformly, whatever the weights"),
    "specvlm-uniform-keep": Mutant(_pruning_owner, "keep", _uniform_keep,
                                   ("tests/test_specvlm.py", "tests/test_pruning.py"),
                                   "the draft keeps a uniform stride of vision tokens, ignoring the attention"),
    "sage-initial-tree": Mutant(_sage_owner, "decide", _initial_tree_every_round, ("tests/test_sage.py",),
                                "the engine drafts SAGE's initial tree every round (the planned depth kept)"),
    "beta-ts-frozen": Mutant(_beta_owner, "observe", _frozen_posterior, ("tests/test_eesd.py",),
                             "Beta-TS's posterior never moves"),
    "lanternpp-no-neighbour-mass": Mutant(_lantern_owner, "bound", _no_neighbour_mass,
                                          ("tests/test_lantern_rules.py",),
                                          "LANTERN++ admits no neighbour mass (the exact rule)"),
    "ddtree-chain": Mutant(_block_tree_owner, "propose", _argmax_chain, ("tests/test_ddtree.py",),
                           "DDTree verifies only each position's argmax token: a chain padded to the tree's size"),
    "guard-always-ar": Mutant(_guard_owner, "decide", _always_ar, ("tests/test_guard.py",),
                              "the guard never lets a row draft: every round is an AR step"),
    "guard-never-ar": Mutant(_guard_owner, "decide", _never_ar, ("tests/test_guard.py",),
                             "the guard never stops a row: every round drafts to the full depth"),
    "sjd-independent-coupling": Mutant(_jacobi_owner, "maximal_coupling", _independent_coupling,
                                       ("tests/test_sjd.py",),
                                       "MC-SJD's maximal coupling drafts afresh each round (SJD): lossless, fewer kept"),
    "sjd-residual-from-p": Mutant(_jacobi_owner, "maximal_coupling", _residual_from_p, ("tests/test_sjd.py",),
                                  "MC-SJD's coupling draws p instead of norm(max(0, p - q)) after not keeping the "
                                  "old draft: the drafts no longer follow the q the rule reads (lossy)"),
    "feed-reads-at-once": Mutant(_feed_owner, "catch_up", _reads_at_once, ("tests/test_guard.py",),
                                 "a drafter with a feed reads it in every round without drafts (no deferral)"),
    "dflash-blind-positions": Mutant(_dflash_owner, "block_visibility", _blind_positions,
                                     ("tests/test_dflash.py", "tests/test_dflash_train.py"),
                                     "a block drafter's mask positions cannot attend to the context entries"),
    "recurrent-whole-draft": Mutant(_recurrent_owner, "advance", _whole_draft, ("tests/test_qwen3_5.py",),
                                    "a hybrid target's recurrent state takes every token a forward fed (the whole "
                                    "draft), not the accepted path"),
}


def apply(name: str) -> Callable[[], None]:
    """Patch mutant `name` in; returns the function that undoes it."""
    if name not in MUTANTS:
        raise ValueError(f"unknown mutant {name!r}; choose one of {sorted(MUTANTS)}")
    m = MUTANTS[name]
    owner = m.owner()
    original = owner.__dict__[m.attr]
    setattr(owner, m.attr, m.make(original))
    return lambda: setattr(owner, m.attr, original)


def apply_from_env() -> str | None:
    name = os.environ.get("JSPEC_MUTANT")
    if name:
        apply(name)
    return name
