"""SAGE's entropy-guided draft trees (Tong et al. 2026): each round's draft confidence shapes the next round's tree.

- `confidence(topk)`: alpha = 1 - H(p~) / log k over the k largest draft probabilities renormalised (Eq. 7-9):
  1 for a one-hot distribution, 0 for k equal probabilities.
- `TreeSpec.plan(p, alpha, d_max)`: the tree for one row, pure and jitted (Eq. 10-12 and the threshold rule):
  D = round(D_min + alpha (d_max - D_min)), W = round(W_min + (1 - alpha)(W_max - W_min)); level 1 takes ranks
  < W, level l >= 2 ranks < W_l = round(W (0.5 + P_parent) / l) (clipped to [1, k]) under each parent; a node is
  kept when its probability passes theta_l = theta0 l / D, and the tree stops at depth D and at `n_max` nodes in
  depth-first rank order (the paper's recursive expansion). The planner has no per-node distributions (it plans
  before drafting), so every level uses the sorted p~ of the round's draft distribution as a per-rank proxy:
  a path's probability is the product of its ranks' p~ ("cumulative", the default; P_parent = the parent's
  product) or the candidate's own p~ ("local": bigger trees). Rounding is half up.
- `TreeSpec.layout`: the static slot budget every reachable tree fits: the most nodes each level can hold over
  every (D, W) pair that some alpha and d_max in [D_min, d_cap] reach (a level's nodes have disjoint paths, so
  under the cumulative threshold at most 1 / theta_l of them pass), with the initial static tree. The target
  verifies the planned nodes packed into `n_max + 1` slots, not the layout.
- `EntropyTree`: the controller. Round 1 drafts the initial static tree (`mc_sim_7b_63`); the stats keep each round's
  planned depth D ("depth"), width W, nodes, alpha, d_max and "reach", the deepest level the threshold left a node
  at (D caps it; a path whose proxy probability falls under theta_l ends sooner); every round's root
  distribution ("root", the default) or the mean over its drafted nodes ("mean_nodes") gives alpha and p~ for
  the next round. The history rule moves d_max by one within [D_min, d_cap] when the mean accepted length of the
  last `window` rounds is below `low` or above `high` (hysteresis between them; acting on full windows, no reset).
The tree depends only on what earlier rounds drafted, never on this round's drafts, so every acceptance rule
stays exact over it.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from fractions import Fraction
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jspec.parts.controllers import Asks, Controller, Decision, Record
from jspec.parts.protocols import LayeredTree
from jspec.parts.trees import Layout, build_tree, layout_of


def confidence(topk: jax.Array) -> jax.Array:
    """[..., k] probabilities (any scale) -> alpha [...] = 1 - H(renormalised) / log k, in [0, 1]."""
    k = topk.shape[-1]
    p = topk / jnp.maximum(jnp.sum(topk, axis=-1, keepdims=True), 1e-30)
    h = -jnp.sum(jnp.where(p > 0, p * jnp.log(jnp.where(p > 0, p, 1.0)), 0.0), axis=-1)
    return jnp.clip(1.0 - h / math.log(k), 0.0, 1.0)


def _half_up(x):
    return jnp.floor(x + 0.5).astype(jnp.int32)


def _round(x: float) -> int:
    return int(math.floor(x + 0.5))


class PlannedTree(NamedTuple):
    tree: LayeredTree  # parent, rank, valid [N] over the layout
    depth: jax.Array  # D, int32
    width: jax.Array  # W, int32
    nodes: jax.Array  # draft nodes in the tree (the root excluded)


@dataclasses.dataclass(frozen=True)
class TreeSpec:
    """SAGE's planner settings (static) and the layout they imply (see the module docstring)."""

    d_min: int = 3
    d_cap: int = 8  # the deepest d_max the history rule may reach (the paper's D_max)
    w_min: int = 2
    w_max: int = 10
    k: int = 10
    n_max: int = 64
    theta0: float = 0.1
    threshold: str = "cumulative"
    init_tree: tuple = ()

    def __post_init__(self):
        for name in ("d_min", "d_cap", "w_min", "w_max", "k", "n_max"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise ValueError(f"SAGE {name} must be an integer, got {v!r}")
        if self.k < 2:
            raise ValueError(f"SAGE needs k >= 2 (alpha divides by log k), got k={self.k}")
        if not 1 <= self.d_min <= self.d_cap:
            raise ValueError(f"SAGE needs 1 <= d_min <= d_max, got d_min={self.d_min}, d_max={self.d_cap}")
        if self.d_cap > 16:
            raise ValueError(f"SAGE d_max must be <= 16 (one draft forward per level), got {self.d_cap}")
        if not 1 <= self.w_min <= self.w_max <= self.k:
            raise ValueError(f"SAGE needs 1 <= w_min <= w_max <= k, got w_min={self.w_min}, w_max={self.w_max}, "
                             f"k={self.k}")
        if not self.theta0 > 0:
            raise ValueError(f"SAGE theta0 must be > 0, got {self.theta0}")
        if self.threshold not in ("cumulative", "local"):
            raise ValueError(f"SAGE threshold must be 'cumulative' or 'local', got {self.threshold!r}")
        init = len(self.init_tree)
        if not init <= self.n_max <= 256:
            raise ValueError(f"SAGE n_max={self.n_max} must hold the initial tree ({init} drafts) and be <= 256 "
                             "(the target verifies n_max + 1 tokens per step)")
        if init and layout_of([list(p) for p in self.init_tree]).max_depth > self.d_cap:
            raise ValueError(f"SAGE's initial tree is deeper than d_max={self.d_cap}")

    def reachable(self) -> list[tuple[int, int, int]]:
        """Every (d_max, D, W) some alpha in [0, 1] gives, for d_max in [d_min, d_cap]: the rounding breakpoints
        and the midpoints between them."""
        out = set()
        for dm in range(self.d_min, self.d_cap + 1):
            marks = {0.0, 1.0}
            if dm > self.d_min:
                marks |= {(d + 0.5 - self.d_min) / (dm - self.d_min) for d in range(self.d_min, dm)}
            if self.w_max > self.w_min:
                marks |= {1 - (w + 0.5 - self.w_min) / (self.w_max - self.w_min) for w in range(self.w_min, self.w_max)}
            marks = sorted(m for m in marks if 0.0 <= m <= 1.0)
            for a in marks + [(x + y) / 2 for x, y in zip(marks, marks[1:])]:
                D = min(max(_round(self.d_min + a * (dm - self.d_min)), self.d_min), dm)
                W = min(max(_round(self.w_min + (1 - a) * (self.w_max - self.w_min)), 1), self.k)
                out.add((dm, D, W))
        return sorted(out)

    def _bounds(self, D: int, W: int) -> tuple[list[int], list[int]]:
        """Most nodes at each level 1..D, and most children per parent there, of a tree planned with (D, W)."""
        counts, kids, prev = [], [], 1
        for lvl in range(1, D + 1):
            per = W if lvl == 1 else min(max(_round(W * 1.5 / lvl), 1), self.k)
            passing = int(math.floor(Fraction(D) / (Fraction(self.theta0) * lvl)))  # p > theta_l: < 1 / theta_l
            if self.threshold == "local":
                per = min(per, passing)
            c = prev * per if self.threshold == "local" else min(prev * per, passing)
            counts.append(max(c, 0))
            kids.append(max(per, 1))
            prev = max(c, 0)
        return counts, kids

    @functools.cached_property
    def caps(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(nodes, children) per level 1..d_cap before the n_max cut, over every reachable (D, W)."""
        nodes, kids = [0] * self.d_cap, [1] * self.d_cap
        for _, D, W in self.reachable():
            c, k = self._bounds(D, W)
            for i in range(D):
                nodes[i], kids[i] = max(nodes[i], c[i]), max(kids[i], k[i])
        if self.threshold == "local":  # per-parent widths multiply: the n_max cut is what bounds a level
            nodes = [min(n, self.n_max) for n in nodes]
        return tuple(max(n, 1) for n in nodes), tuple(kids)

    @functools.cached_property
    def layout(self) -> Layout:
        """The slot budget of every planned tree (after the n_max cut) and of the initial tree."""
        nodes, kids = self.caps
        widths = [min(n, self.n_max - i) for i, n in enumerate(nodes)]
        children = list(kids)
        if self.init_tree:
            own = layout_of([list(p) for p in self.init_tree])
            for i, (w, c) in enumerate(zip(own.widths, own.children)):
                widths[i], children[i] = max(widths[i], w), max(children[i], c)
        return Layout(tuple(max(w, 1) for w in widths), tuple(children))

    def initial(self) -> LayeredTree:
        """The initial static tree's arrays [N] over the layout."""
        t = build_tree([list(p) for p in self.init_tree], self.layout)
        return LayeredTree(t.parent, t.rank, t.valid)

    def plan(self, p: jax.Array, alpha: jax.Array, d_max: jax.Array) -> PlannedTree:
        """One row's tree from the sorted renormalised top-k p [k], alpha and the current d_max (jit-able). The
        levels are three `lax.scan`s (grow, subtree sizes bottom-up, pre-order and slots), each over every level
        held in `C` = the widest level's slots (a level's slots past its own cap stay empty), so the program does
        not grow with d_max."""
        k, caps, L = self.k, self.caps[0], self.d_cap
        C = max(caps)
        i32, f32 = jnp.int32, jnp.float32
        D = jnp.clip(_half_up(self.d_min + alpha * (d_max - self.d_min)), self.d_min, d_max)
        W = jnp.clip(_half_up(self.w_min + (1.0 - alpha) * (self.w_max - self.w_min)), 1, k)
        cumulative = self.threshold == "cumulative"
        ranks = jnp.arange(k, dtype=i32)
        flat = jnp.arange(C * k, dtype=i32)
        lvls = jnp.arange(1, L + 1, dtype=i32)
        # theta_l's numerator as the unrolled planner computed it: theta0 * l in double precision, then float32
        theta_num = jnp.asarray([self.theta0 * lvl for lvl in range(1, L + 1)], f32)
        first = lambda x, fill: jnp.full((C,), fill, x.dtype).at[0].set(x)  # noqa: E731  the root as a level

        def grow(carry, x):
            """Level lvl's nodes from level lvl - 1's: (valid, parent index, rank) in `C` slots each."""
            valid_p, cum_p, loc_p = carry
            lvl, cap, tnum = x
            theta = tnum / D.astype(f32)
            pp = cum_p if cumulative else loc_p
            wl = jnp.where(lvl == 1, jnp.broadcast_to(W, pp.shape),
                           jnp.clip(_half_up(W * (0.5 + pp) / lvl.astype(f32)), 1, k))
            c = cum_p[:, None] * p[None, :]
            crit = c if cumulative else jnp.broadcast_to(p[None, :], c.shape)
            ok = (valid_p[:, None] & (ranks[None, :] < wl[:, None]) & (crit > theta) & (lvl <= D)).reshape(-1)
            at = jnp.cumsum(ok) - 1  # in order: parents in order, then ranks
            slot = jnp.where(ok & (at < cap), at, C)
            put = lambda v: jnp.zeros((C,), v.dtype).at[slot].set(v, mode="drop")  # noqa: E731
            valid = put(ok)
            return (valid, put(c.reshape(-1)), put(jnp.broadcast_to(p[None, :], c.shape).reshape(-1))), \
                (valid, put(flat // k), put(flat % k))

        root = (first(jnp.asarray(True), False), first(jnp.asarray(1.0, f32), 0.0), first(jnp.asarray(1.0, f32), 0.0))
        _, (valid, par, rank) = jax.lax.scan(grow, root, (lvls, jnp.asarray(caps, i32), theta_num))  # [L, C]
        valid0 = root[0]

        # depth-first (pre-order) index: subtree sizes bottom-up, then parent's index + 1 + earlier siblings' sizes
        def up(size_child, x):
            v_child, par_child, v_parent = x
            add = jnp.zeros((C,), i32).at[par_child].add(jnp.where(v_child, size_child, 0))
            return v_parent.astype(i32) + add, size_child

        parents_valid = jnp.concatenate([valid0[None], valid[:-1]])
        _, sizes = jax.lax.scan(up, valid[-1].astype(i32), (valid, par, parents_valid), reverse=True)  # [L, C]

        def order(pre_p, x):
            v, pa, rk, size = x
            same = (pa[:, None] == pa[None, :]) & (rk[None, :] < rk[:, None]) & v[None, :]
            before = jnp.sum(jnp.where(same, size[None, :], 0), axis=1)
            pre = jnp.take(pre_p, pa) + 1 + before
            return pre, pre

        _, pre = jax.lax.scan(order, jnp.zeros((C,), i32), (valid, par, rank, sizes))
        layout = self.layout
        N = layout.num_nodes
        starts = jnp.asarray([layout.levels[lvl][0] for lvl in range(1, L + 1)], i32)
        ends = jnp.asarray([layout.levels[lvl][1] for lvl in range(1, L + 1)], i32)

        def place(carry, x):
            parent, out_rank, out_valid, at_p = carry
            v, pa, rk, pr, start, end = x
            keep = v & (pr <= self.n_max)
            slot = jnp.where(keep, start + jnp.cumsum(keep) - 1, N)
            slot = jnp.where(slot < end, slot, N)  # never binds: the layout holds every kept level
            parent = parent.at[slot].set(jnp.take(at_p, pa), mode="drop")
            out_rank = out_rank.at[slot].set(rk, mode="drop")
            out_valid = out_valid.at[slot].set(True, mode="drop")
            return (parent, out_rank, out_valid, slot), None

        init = (jnp.full((N,), -1, i32), jnp.zeros((N,), i32), jnp.zeros((N,), bool).at[0].set(True),
                jnp.zeros((C,), i32))
        (parent, out_rank, out_valid, _), _ = jax.lax.scan(place, init, (valid, par, rank, pre, starts, ends))
        return PlannedTree(LayeredTree(parent, out_rank, out_valid), D, W, jnp.sum(out_valid) - 1)


class SageState(struct.PyTreeNode):
    alpha: jax.Array  # [B] the confidence the next tree is planned from
    p: jax.Array  # [B, k] its sorted renormalised top-k draft probabilities
    d_max: jax.Array  # [B] int32 the history rule's current D_max
    history: jax.Array  # [B, window] the last rounds' accepted drafts (ring buffer)
    seen: jax.Array  # [B] int32 rounds observed
    first: jax.Array  # [B] bool: no round observed yet (the initial static tree)


@struct.dataclass
class EntropyTree(Controller):
    """SAGE's controller (module docstring): per row, a tree planned from the last round's draft confidence, and
    the history rule on d_max. `adaptive=False` drafts the initial tree every round (SD-Tree on the same
    program); `force_alpha` plans every round with that alpha (p~ still comes from the draft: an ablation and a test
    hook); `d_start` is the history rule's first d_max (None: its cap); alpha0, force_alpha, low and high are
    data."""

    spec: TreeSpec = struct.field(pytree_node=False)
    confidence_from: str = struct.field(pytree_node=False, default="root")
    adaptive: bool = struct.field(pytree_node=False, default=True)
    history: bool = struct.field(pytree_node=False, default=True)
    window: int = struct.field(pytree_node=False, default=10)
    low: float = 2.0
    high: float = 3.0
    alpha0: float = 0.5
    force_alpha: float | None = None
    d_start: int | None = struct.field(pytree_node=False, default=None)

    def __post_init__(self):
        if self.confidence_from not in ("root", "mean_nodes"):
            raise ValueError(f"SAGE confidence must be 'root' or 'mean_nodes', got {self.confidence_from!r}")
        if not self.window >= 1:
            raise ValueError(f"SAGE's history window must be >= 1, got {self.window}")
        if self.d_start is not None and not self.spec.d_min <= self.d_start <= self.spec.d_cap:
            raise ValueError(f"SAGE d_start={self.d_start} must lie in [d_min, d_max] = "
                             f"[{self.spec.d_min}, {self.spec.d_cap}]")
        if isinstance(self.force_alpha, (int, float)) and not 0.0 <= float(self.force_alpha) <= 1.0:
            raise ValueError(f"SAGE force_alpha must be in [0, 1], got {self.force_alpha}")

    @property
    def asks(self) -> Asks:
        k = self.spec.k
        return Asks(root_topk=k) if self.confidence_from == "root" else Asks(node_topk=k)

    def check(self, target, drafter) -> None:
        V = getattr(target, "vocab_size", None)
        if V is not None and self.spec.k > V:
            raise ValueError(f"SAGE k={self.spec.k} exceeds the vocabulary ({V})")

    def init(self, batch: int, max_depth: int) -> SageState:
        if max_depth != self.spec.d_cap:
            raise ValueError(f"SAGE's controller plans trees of depth <= {self.spec.d_cap}; its plan is {max_depth} "
                             "deep (build both from one TreeSpec: jspec.SAGE does)")
        k = self.spec.k
        return SageState(jnp.full((batch,), self.alpha0, jnp.float32), jnp.full((batch, k), 1.0 / k, jnp.float32),
                         jnp.full((batch,), self.spec.d_cap if self.d_start is None else self.d_start, jnp.int32),
                         jnp.zeros((batch, self.window), jnp.float32),
                         jnp.zeros((batch,), jnp.int32), jnp.ones((batch,), bool))

    def decide(self, state: SageState, key) -> Decision:
        spec = self.spec
        B = state.alpha.shape[0]
        init = spec.initial()
        init_depth = max(len(p) for p in spec.init_tree)
        b = lambda a: jnp.broadcast_to(jnp.asarray(a), (B,) + np.shape(a))  # noqa: E731
        if not self.adaptive:
            return Decision(depth=jnp.full((B,), init_depth, jnp.int32), tree=LayeredTree(*map(b, init)),
                            info={"nodes": jnp.full((B,), len(spec.init_tree), jnp.int32)})
        alpha = state.alpha if self.force_alpha is None else jnp.full((B,), self.force_alpha, jnp.float32)
        got = jax.vmap(spec.plan)(state.p, alpha, state.d_max)
        first = state.first
        pick = lambda a, x: jnp.where(first.reshape((B,) + (1,) * (x.ndim - 1)), a, x)  # noqa: E731
        tree = LayeredTree(*(pick(b(a), x) for a, x in zip(init, got.tree)))
        depth = jnp.where(first, init_depth, got.depth)
        level = np.zeros((spec.layout.num_nodes,), np.int32)  # each slot's depth in the layout
        for d, (a, e) in enumerate(spec.layout.levels):
            level[a:e] = d
        reach = jnp.max(jnp.where(tree.valid, jnp.asarray(level)[None], 0), axis=1)
        info = {"alpha": jnp.where(first, jnp.nan, alpha), "width": jnp.where(first, 0, got.width),
                "nodes": jnp.where(first, len(spec.init_tree), got.nodes), "d_max": state.d_max, "reach": reach}
        return Decision(depth=depth.astype(jnp.int32), tree=tree, info=info)

    def observe(self, state: SageState, record: Record) -> SageState:
        spec = self.spec
        if self.confidence_from == "root":
            top = record.root_topk
            alpha = confidence(top)
        else:  # the mean over the round's drafted nodes of their alphas and sorted top-k
            w = record.node_known.astype(jnp.float32)
            n = jnp.maximum(jnp.sum(w, axis=1), 1.0)
            top = jnp.sum(w[..., None] * record.node_topk, axis=1) / n[:, None]
            alpha = jnp.sum(w * confidence(record.node_topk), axis=1) / n
        p = top / jnp.maximum(jnp.sum(top, axis=-1, keepdims=True), 1e-30)
        on = record.active
        slot = state.seen % self.window
        hist = state.history.at[jnp.arange(on.shape[0]), slot].set(record.accepted.astype(jnp.float32))
        seen = state.seen + 1
        d_max = state.d_max
        if self.history:
            mean = jnp.mean(hist, axis=1)
            full = seen >= self.window
            d_max = jnp.where(full & (mean < self.low), jnp.maximum(d_max - 1, spec.d_min), d_max)
            d_max = jnp.where(full & (mean > self.high), jnp.minimum(d_max + 1, spec.d_cap), d_max)
        keep = lambda new, old: jnp.where(on.reshape(on.shape + (1,) * (old.ndim - 1)), new, old)  # noqa: E731
        return SageState(keep(alpha, state.alpha), keep(p, state.p), keep(d_max, state.d_max),
                         keep(hist, state.history), keep(seen, state.seen), state.first & ~on)


__all__ = ["EntropyTree", "PlannedTree", "SageState", "TreeSpec", "confidence"]
