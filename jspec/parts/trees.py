"""Draft trees as fixed-shape arrays.

Node 0 is the root (the newest committed token); draft nodes follow with parents before children. A layered tree
has a static `Layout` (node slots per depth level) and data (parent, rank, valid per slot), so trees of one layout
share a compilation and may differ per row and per step (`layered_arrays`). A static tree comes from a list of
child-rank paths (EAGLE-1 / Medusa style), built once on the host in breadth-first order (each level contiguous,
siblings by rank) and padded to a layout. A dynamic tree (EAGLE-2) is selected per step and per row inside `jit`
from a pool of scored candidates (`tree_from_pool`). All reach the verifier as a batched `TreeArrays`.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

# EAGLE-1's `mc_sim_7b_63` as used by EAGLE-1, SpecVLM and SAGE (their initial tree): 25 drafts, depth 5.
MC_SIM_7B_63 = [[0], [1], [2], [3], [0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [2, 0], [2, 1], [3, 0], [0, 0, 0],
                [0, 0, 1], [0, 0, 2], [0, 1, 0], [0, 1, 1], [0, 2, 0], [0, 2, 1], [1, 0, 0], [0, 0, 0, 0],
                [0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 0, 0, 0], [0, 0, 0, 0, 1]]
# LANTERN++'s extended tree `naive_extend_57`: 57 drafts, depth 5, at most 5 children per node.
NAIVE_EXTEND_57 = [
    [0], [1], [2], [3], [4], [0, 0], [0, 1], [0, 2], [0, 3], [1, 0], [1, 1], [1, 2], [2, 0], [2, 1], [2, 2], [3, 0],
    [3, 1], [4, 0], [0, 0, 0], [0, 0, 1], [0, 0, 2], [0, 0, 3], [0, 1, 0], [0, 1, 1], [0, 1, 2], [0, 2, 0],
    [0, 2, 1], [0, 2, 2], [0, 3, 0], [0, 3, 1], [1, 0, 0], [1, 0, 1], [1, 1, 0], [2, 0, 0], [0, 0, 0, 0],
    [0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 0, 3], [0, 0, 1, 0], [0, 0, 1, 1], [0, 0, 1, 2], [0, 0, 2, 0], [0, 0, 2, 1],
    [0, 0, 3, 0], [0, 1, 0, 0], [0, 1, 0, 1], [0, 1, 1, 0], [0, 2, 0, 0], [0, 0, 0, 0, 0], [0, 0, 0, 0, 1],
    [0, 0, 0, 0, 2], [0, 0, 0, 1, 0], [0, 0, 0, 1, 1], [0, 0, 1, 0, 0], [0, 0, 1, 0, 1], [0, 0, 1, 1, 0],
    [0, 0, 2, 0, 0]]


def chain(n: int) -> list[list[int]]:
    """A single path of n drafts ([0], [0, 0], ...)."""
    return [[0] * d for d in range(1, n + 1)]


NAMED_TREES = {"mc_sim_7b_63": MC_SIM_7B_63, "eagle1": MC_SIM_7B_63, "specvlm": MC_SIM_7B_63,
               "sage_init": MC_SIM_7B_63, "naive_extend_57": NAIVE_EXTEND_57, "lantern": NAIVE_EXTEND_57,
               "chain5": chain(5)}


@dataclasses.dataclass(frozen=True)
class Layout:
    """The static shape of a layered tree: `widths[d - 1]` node slots at depth d (d = 1..D; the root is one slot at
    depth 0) and `children[d]` the most children one node at depth d may have. Nodes are numbered level by level,
    so level d occupies the slot range `levels[d]`; a tree smaller than its layout leaves slots invalid. Trees of one
    layout share one compiled program: which slots are used, their parents and ranks are data."""

    widths: tuple
    children: tuple

    def __post_init__(self):
        if not self.widths or min(self.widths) < 1 or len(self.children) != len(self.widths) or min(self.children) < 1:
            raise ValueError(f"a tree layout needs >= 1 slot per level and >= 1 child per level, got widths="
                             f"{self.widths}, children={self.children}")

    @property
    def levels(self) -> tuple:
        out, s = [(0, 1)], 1
        for w in self.widths:
            out.append((s, s + w))
            s += w
        return tuple(out)

    @property
    def num_nodes(self) -> int:
        return 1 + sum(self.widths)

    @property
    def max_depth(self) -> int:
        return len(self.widths)

    @property
    def max_children(self) -> int:
        return max(self.children)

    @property
    def is_chain(self) -> bool:
        """One node per depth (node i at depth i): an accepted path is already a prefix of the scratch slots."""
        return all(w == 1 for w in self.widths)

    def holds(self, other: "Layout") -> bool:
        """Whether every tree of `other` fits in this layout."""
        return (len(other.widths) <= len(self.widths) and all(a <= b for a, b in zip(other.widths, self.widths))
                and all(a <= b for a, b in zip(other.children, self.children)))


@dataclasses.dataclass(frozen=True)
class StaticTree:
    """Host-side arrays of a static tree laid out in `layout` (N = layout.num_nodes slots, unused ones invalid).

    parent [N] (-1 for the root and unused slots), depth [N], rank [N] (which draft choice of its parent), valid
    [N], ancestor [N, N] (ancestor[i, j]: j is i or an ancestor of i), children [N, M] (node ids by rank, -1
    padded), levels: (start, end) slot range of each depth.
    """

    paths: tuple
    layout: Layout
    parent: np.ndarray
    depth: np.ndarray
    rank: np.ndarray
    valid: np.ndarray
    ancestor: np.ndarray
    children: np.ndarray

    @property
    def levels(self) -> tuple:
        return self.layout.levels

    @property
    def num_nodes(self) -> int:
        return self.layout.num_nodes

    @property
    def max_depth(self) -> int:
        return self.layout.max_depth

    @property
    def max_children(self) -> int:
        return int(self.children.shape[1])

    @property
    def is_chain(self) -> bool:
        return self.layout.is_chain

    def __hash__(self):
        return hash((self.paths, self.layout))

    def __eq__(self, other):
        return isinstance(other, StaticTree) and self.paths == other.paths and self.layout == other.layout


def _canonical(paths) -> list[tuple]:
    if isinstance(paths, str):
        if paths not in NAMED_TREES:
            raise ValueError(f"unknown tree {paths!r}; named trees: {sorted(NAMED_TREES)}")
        paths = NAMED_TREES[paths]
    paths = sorted({tuple(int(r) for r in p) for p in paths}, key=lambda p: (len(p), p))
    if not paths:
        raise ValueError("a tree needs at least one draft path")
    known = set(paths)
    for p in paths:
        if min(p) < 0:
            raise ValueError(f"tree path {list(p)} has a negative rank")
        if len(p) > 1 and p[:-1] not in known:
            raise ValueError(f"tree path {list(p)} has no parent path {list(p[:-1])} in the list")
        if p[-1] > 0 and p[:-1] + (p[-1] - 1,) not in known:
            raise ValueError(f"tree path {list(p)}: rank {p[-1]} without rank {p[-1] - 1} before it")
    return paths


def layout_of(paths) -> Layout:
    """The smallest layout that holds a path list (its own level widths and child counts)."""
    paths = _canonical(paths)
    D = max(len(p) for p in paths)
    widths = tuple(sum(len(p) == d for p in paths) for d in range(1, D + 1))
    children = tuple(max([p[-1] + 1 for p in paths if len(p) == d + 1], default=1) for d in range(D))
    return Layout(widths, children)


def build_tree(paths, layout: Layout | None = None) -> StaticTree:
    """Tree arrays from child-rank paths, in `layout` (default: the tree's own). Every path's prefixes must be in
    the list (ranks may skip none)."""
    paths = _canonical(paths)
    own = layout_of(paths)
    layout = own if layout is None else layout
    if not layout.holds(own):
        raise ValueError(f"tree with level widths {own.widths} and children {own.children} does not fit the budget "
                         f"widths={layout.widths}, children={layout.children}")
    N = layout.num_nodes
    index = {(): 0}
    fill = [s for s, _ in layout.levels]
    for p in paths:
        index[p] = fill[len(p)]
        fill[len(p)] += 1
    parent = np.full(N, -1, np.int32)
    depth = np.zeros(N, np.int32)
    rank = np.zeros(N, np.int32)
    valid = np.zeros(N, bool)
    for d, (s, e) in enumerate(layout.levels):
        depth[s:e] = d
    for p, i in index.items():
        valid[i] = True
        if p:
            parent[i], rank[i] = index[p[:-1]], p[-1]
    ancestor = np.zeros((N, N), bool)
    for i in range(N):
        ancestor[i, i] = True
        j = parent[i]
        while j >= 0:
            ancestor[i, j] = True
            j = parent[j]
    children = np.full((N, layout.max_children), -1, np.int32)
    for i in index.values():
        if i:
            children[parent[i], rank[i]] = i
    return StaticTree(tuple(paths), layout, parent, depth, rank, valid, ancestor, children)


class TreeArrays(NamedTuple):
    """Device-side tree, one per row: parent [B, N] (-1 for the root), depth [B, N], ancestor [B, N, N]
    (ancestor[b, i, j]: j is i or an ancestor of i), children [B, N, M] (node ids in the order the verifier tries
    them, -1 padded)."""

    parent: jax.Array
    depth: jax.Array
    ancestor: jax.Array
    children: jax.Array



def as_paths(tree):
    """A tree as a hashable key: its name, or its child-rank paths as tuples of ints."""
    return tree if isinstance(tree, str) else tuple(tuple(int(r) for r in p) for p in tree)


def cached_tree(tree, layout: "Layout | None" = None) -> "StaticTree":
    """`build_tree(tree, layout)` for a name or child-rank paths, built once per (tree, layout)."""
    return _built(as_paths(tree), layout)


@functools.lru_cache(maxsize=64)
def _built(paths, layout):
    return build_tree(paths if isinstance(paths, str) else [list(p) for p in paths], layout)

def device_tree(tree: StaticTree, batch: int) -> TreeArrays:
    """A static tree's arrays broadcast to `batch` rows."""
    b = lambda a: jnp.broadcast_to(jnp.asarray(a), (batch,) + a.shape)
    return TreeArrays(b(tree.parent), b(tree.depth), b(tree.ancestor), b(tree.children))


def _ancestors(parent: jax.Array, max_depth: int) -> jax.Array:
    """ancestor [B, N, N] of parent [B, N] (-1 for roots) by pointer jumping."""
    B, N = parent.shape
    up = jnp.where(parent < 0, jnp.arange(N)[None], parent)  # a root is its own parent
    cur = jnp.broadcast_to(jnp.arange(N, dtype=jnp.int32), (B, N))

    def jump(_, c):
        cur, ancestor = c
        cur = jnp.take_along_axis(up, cur, axis=1)
        return cur, ancestor | jax.nn.one_hot(cur, N, dtype=bool)

    return jax.lax.fori_loop(0, max_depth, jump, (cur, jax.nn.one_hot(cur, N, dtype=bool)))[1]


def _closed(ok: jax.Array, par: jax.Array, max_depth: int) -> jax.Array:
    """ok [B, N] and'ed with every ancestor's (parent indices par [B, N], a root its own parent)."""
    return jax.lax.fori_loop(0, max_depth, lambda _, ok: ok & jnp.take_along_axis(ok, par, axis=1), ok)


def layered_arrays(parent: jax.Array, rank: jax.Array, valid: jax.Array, layout: Layout) -> tuple[jax.Array, TreeArrays]:
    """A batch of per-row layered trees (parent, rank, valid [B, N] over `layout`'s slots) as (valid, TreeArrays).

    A slot is usable when it and every ancestor are valid, its parent sits in the level above and its rank is
    below that level's child limit; unusable slots get no parent, no children, and only themselves as ancestor.
    Siblings must have distinct ranks (a plan builder's duty)."""
    B, N = parent.shape
    depth = np.zeros(N, np.int32)
    for d, (s, e) in enumerate(layout.levels):
        depth[s:e] = d
    lim = jnp.asarray(np.array([(layout.children + (0,))[d] for d in depth], np.int32))  # children per slot
    par = jnp.clip(parent, 0, N - 1)
    depth = jnp.asarray(depth)
    ok = valid & (jnp.take(depth, par) == depth[None] - 1) & (rank >= 0) & (rank < jnp.take(lim, par))
    ok = _closed(ok.at[:, 0].set(True), par, layout.max_depth)
    parent = jnp.where(ok, parent, -1).at[:, 0].set(-1)
    ancestor = _ancestors(parent, layout.max_depth)
    rows = jnp.arange(B)[:, None]
    slot = jnp.where(ok & (jnp.arange(N) > 0)[None], par, N)  # out of range: dropped
    children = jnp.full((B, N, layout.max_children), -1, jnp.int32).at[rows, slot, rank].set(
        jnp.broadcast_to(jnp.arange(N, dtype=jnp.int32), (B, N)), mode="drop")
    return ok, TreeArrays(parent, jnp.broadcast_to(depth, (B, N)), ancestor, children)


def tree_from_pool(pool_parent: jax.Array, pool_depth: jax.Array, pool_score: jax.Array, total: int,
                   max_depth: int, max_children: int) -> tuple[jax.Array, jax.Array, TreeArrays]:
    """EAGLE-2 reranking: keep the `total` best-scored candidates of each row as the tree's draft nodes.

    pool_* [B, P]: candidates in creation order (every candidate after its parent), pool_parent = pool index of
    the parent or -1 for a child of the root, pool_score = cumulative draft log-probability (-inf = unusable).
    Returns (sel [B, total] pool index of node i+1, valid [B, total+1], tree). Nodes keep creation order, so
    parents precede children. A child never outscores its parent (log-probs are <= 0), so the kept set is closed
    under ancestors; a node whose ancestor was not kept anyway (a tie) or whose score is -inf is marked invalid.
    """
    B, P = pool_score.shape
    N = total + 1
    rows = jnp.arange(B)[:, None]
    _, top = jax.lax.top_k(pool_score, total)
    sel = jnp.sort(top, axis=-1).astype(jnp.int32)  # [B, total]
    node_of = jnp.full((B, P), -1, jnp.int32).at[rows, sel].set(jnp.arange(1, N, dtype=jnp.int32))
    par_pool = jnp.take_along_axis(pool_parent, sel, axis=1)
    par = jnp.where(par_pool < 0, 0, jnp.take_along_axis(node_of, jnp.maximum(par_pool, 0), axis=1))
    ok = jnp.isfinite(jnp.take_along_axis(pool_score, sel, axis=1)) & (par >= 0)
    parent = jnp.concatenate([jnp.full((B, 1), -1, jnp.int32), jnp.where(ok, par, 0)], axis=1)
    depth = jnp.concatenate([jnp.zeros((B, 1), jnp.int32), jnp.take_along_axis(pool_depth, sel, axis=1)], axis=1)
    valid = jnp.concatenate([jnp.ones((B, 1), bool), ok], axis=1)
    valid = _closed(valid, jnp.maximum(parent, 0), max_depth)
    ancestor = _ancestors(parent, max_depth)
    # sibling rank = earlier valid nodes with the same parent; children listed in node order
    i = jnp.arange(N)
    same = (parent[:, :, None] == parent[:, None, :]) & (i[None, None, :] < i[None, :, None]) & valid[:, None, :]
    rank = jnp.sum(same, axis=-1)
    slot_parent = jnp.where(valid & (i[None] > 0), parent, N)  # out of range: dropped
    children = jnp.full((B, N, max_children), -1, jnp.int32).at[rows, slot_parent, rank].set(
        jnp.broadcast_to(i, (B, N)).astype(jnp.int32), mode="drop")
    return sel, valid, TreeArrays(parent, depth, ancestor, children)
