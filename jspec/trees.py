"""Draft trees as fixed-shape arrays.

Node 0 is the root (the newest committed token); draft nodes follow in breadth-first order (parents before
children, each level contiguous, siblings by rank). A static tree comes from a list of child-rank paths
(EAGLE-1 / Medusa style) and is built once on the host; its arrays are padded to a node budget so that trees of
one budget share a compilation.
"""
from __future__ import annotations

import dataclasses

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
