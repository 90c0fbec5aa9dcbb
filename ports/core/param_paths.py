"""Nested params trees (dicts and lists) addressed by key paths: what checkpoint readers and writers share."""
from __future__ import annotations

from typing import Any

import jax

from ports.core import fused as FU

layers_path = FU.layers_path  # the decoder layer list's path in a params tree


def set_path(tree, path, value):
    node = tree
    for p in path[:-1]:
        node = node[p]
    node[path[-1]] = value


def get_path(tree, path):
    for p in path:
        tree = tree[p]
    return tree


def empty_like_shapes(shapes):
    if isinstance(shapes, dict):
        return {k: empty_like_shapes(v) for k, v in shapes.items()}
    if isinstance(shapes, list):
        return [empty_like_shapes(v) for v in shapes]
    return None


def leaf_paths(tree) -> list[tuple[tuple, Any]]:
    """(path of keys / indices, leaf) of every leaf of a nested dict / list."""
    return [(tuple(getattr(k, "key", getattr(k, "idx", None)) for k in kp), leaf)
            for kp, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]]


def without_layers(tree, lp: tuple):
    """A shallow copy of the params tree with the decoder layer list emptied."""
    out = dict(tree)
    if len(lp) == 2:
        out[lp[0]] = dict(out[lp[0]])
        out[lp[0]][lp[1]] = []
    else:
        out[lp[0]] = []
    return out
