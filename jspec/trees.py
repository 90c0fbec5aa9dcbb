"""Draft trees as fixed-shape arrays.

Node 0 is the root (the newest committed token); draft nodes follow with parents before children. A static tree
comes from a list of child-rank paths (EAGLE-1 / Medusa style) and is built once on the host, in breadth-first
order (each level contiguous, siblings by rank); its arrays are padded to a node budget so that trees of one
budget share a compilation. A dynamic tree (EAGLE-2) is selected per step and per row inside `jit` from a pool of
scored candidates (`tree_from_pool`). Both reach the verifier as a batched `TreeArrays`.
"""
from __future__ import annotations

import dataclasses
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
class StaticTree:
    """Host-side arrays of a static tree with N = 1 + drafts nodes (padded to `n_max` when built with one).

    parent [N] (-1 for the root and padding), depth [N], rank [N] (which draft choice of its parent), valid [N],
    ancestor [N, N] (ancestor[i, j]: j is i or an ancestor of i), children [N, M] (node ids by rank, -1 padded),
    retrieve [P, D+1] (root-to-leaf node ids, -1 padded), levels: (start, end) node range of each depth.
    """

    paths: tuple
    parent: np.ndarray
    depth: np.ndarray
    rank: np.ndarray
    valid: np.ndarray
    ancestor: np.ndarray
    children: np.ndarray
    retrieve: np.ndarray
    levels: tuple

    @property
    def num_nodes(self) -> int:
        return int(self.parent.shape[0])

    @property
    def max_depth(self) -> int:
        return len(self.levels) - 1

    @property
    def max_children(self) -> int:
        return int(self.children.shape[1])

    @property
    def is_chain(self) -> bool:
        """One node per depth (node i at depth i): an accepted path is already a prefix of the scratch slots."""
        return all(e - s == 1 for s, e in self.levels)

    def __hash__(self):
        return hash((self.paths, self.num_nodes))

    def __eq__(self, other):
        return isinstance(other, StaticTree) and self.paths == other.paths and self.num_nodes == other.num_nodes


def build_tree(paths, n_max: int | None = None) -> StaticTree:
    """Tree arrays from child-rank paths. Every path's prefixes must be in the list (ranks may skip none)."""
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
    n = 1 + len(paths)
    N = n if n_max is None else n_max
    if N < n:
        raise ValueError(f"tree has {n} nodes (root included), more than the budget n_max={n_max}")
    index = {(): 0}
    for i, p in enumerate(paths):
        index[p] = i + 1
    parent = np.full(N, -1, np.int32)
    depth = np.zeros(N, np.int32)
    rank = np.zeros(N, np.int32)
    valid = np.zeros(N, bool)
    valid[:n] = True
    for p, i in index.items():
        if p:
            parent[i], depth[i], rank[i] = index[p[:-1]], len(p), p[-1]
    ancestor = np.zeros((N, N), bool)
    for i in range(N):
        ancestor[i, i] = True
        j = parent[i]
        while j >= 0:
            ancestor[i, j] = True
            j = parent[j]
    M = max(1, max(rank[1:n]) + 1)
    children = np.full((N, M), -1, np.int32)
    for i in range(1, n):
        children[parent[i], rank[i]] = i
    leaves = [i for i in range(n) if not (children[i] >= 0).any()]
    D = int(depth.max())
    retrieve = np.full((len(leaves), D + 1), -1, np.int32)
    for r, leaf in enumerate(leaves):
        chain_ = []
        j = leaf
        while j >= 0:
            chain_.append(j)
            j = parent[j]
        retrieve[r, :len(chain_)] = chain_[::-1]
    levels = tuple((int(np.flatnonzero(depth[:n] == d)[0]), int(np.flatnonzero(depth[:n] == d)[-1]) + 1)
                   for d in range(D + 1))
    return StaticTree(tuple(paths), parent, depth, rank, valid, ancestor, children, retrieve, levels)


class TreeArrays(NamedTuple):
    """Device-side tree, one per row: parent [B, N] (-1 for the root), depth [B, N], ancestor [B, N, N]
    (ancestor[b, i, j]: j is i or an ancestor of i), children [B, N, M] (node ids in the order the verifier tries
    them, -1 padded)."""

    parent: jax.Array
    depth: jax.Array
    ancestor: jax.Array
    children: jax.Array


def device_tree(tree: StaticTree, batch: int) -> TreeArrays:
    """A static tree's arrays broadcast to `batch` rows."""
    b = lambda a: jnp.broadcast_to(jnp.asarray(a), (batch,) + a.shape)
    return TreeArrays(b(tree.parent), b(tree.depth), b(tree.ancestor), b(tree.children))


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
    up = jnp.maximum(parent, 0)  # the root is its own parent for pointer jumping
    cur = jnp.broadcast_to(jnp.arange(N, dtype=jnp.int32), (B, N))
    ancestor = jax.nn.one_hot(cur, N, dtype=bool)
    for _ in range(max_depth):
        valid = valid & jnp.take_along_axis(valid, up, axis=1)
        cur = jnp.take_along_axis(up, cur, axis=1)
        ancestor = ancestor | jax.nn.one_hot(cur, N, dtype=bool)
    # sibling rank = earlier valid nodes with the same parent; children listed in node order
    i = jnp.arange(N)
    same = (parent[:, :, None] == parent[:, None, :]) & (i[None, None, :] < i[None, :, None]) & valid[:, None, :]
    rank = jnp.sum(same, axis=-1)
    slot_parent = jnp.where(valid & (i[None] > 0), parent, N)  # out of range: dropped
    children = jnp.full((B, N, max_children), -1, jnp.int32).at[rows, slot_parent, rank].set(
        jnp.broadcast_to(i, (B, N)).astype(jnp.int32), mode="drop")
    return sel, valid, TreeArrays(parent, depth, ancestor, children)
