"""The Qwen3-VL vision transformer (also Qwen3-VL-MoE's): Qwen2-VL's frame-major tower (`ports.families.qwen2_vl_vision`:
the same host frame layout, 2-D rotary embedding and LayerNorm blocks, here with `linear_fc1` / `linear_fc2`
MLPs) plus a biased patch embedding, learned position embeddings resampled bilinearly (align_corners) from a
square table to each frame's patch grid, and DeepStack: the outputs of the blocks `deepstack_indexes` names, each
through its own merger (LayerNorm after the 2x2 merge), come out beside the final merger's.

Params (a plain pytree; matrices [in, out]):
    {"patch_embed": [D, C, Tp, p, p] (HF's Conv3d kernel as is), "patch_b": [D], "pos_embed": [N, D],
     "layers": [{"norm1", "norm1_b", "norm2", "norm2_b", "wqkv", "bqkv", "wo", "bo", "w_fc1", "b_fc1", "w_fc2",
                 "b_fc2"}, ...],
     "merger": {"norm" [D], "norm_b", "w1", "b1", "w2", "b2"},
     "deepstack": [{"norm" [4D], "norm_b", "w1", "b1", "w2", "b2"}, ...]  (one per deepstack index, config order)}
"""
from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ports.core import layers as LY
from ports.families import qwen2_vl_vision as QV
from ports.core import vision as VIS

# transformers 5.23's Qwen3VLVisionConfig defaults
_HF_DEFAULTS = dict(depth=27, hidden_size=1152, hidden_act="gelu_pytorch_tanh", intermediate_size=4304, num_heads=16,
                    in_channels=3, patch_size=16, spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=3584,
                    num_position_embeddings=2304, deepstack_visual_indexes=(8, 16, 24))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Qwen3VisionConfig(QV.FrameTowerConfig):
    """A Qwen3-VL tower; read by `qwen2_vl_vision`'s layout and block functions (full attention per frame)."""

    out_dim: int
    patch_size: int = 16
    num_position_embeddings: int = 2304
    deepstack_indexes: tuple[int, ...] = (8, 16, 24)
    model_type: str = "qwen3_vl"

    def __post_init__(self):
        for name in ("depth", "width", "mlp_dim", "num_heads", "out_dim", "in_channels", "patch_size",
                     "temporal_patch_size", "merge_size", "num_position_embeddings"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"qwen3_vl vision_config: {name} = {v!r}; expected a positive integer")
        super().__post_init__()
        idx = self.deepstack_indexes
        if len(set(idx)) != len(idx) or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.depth
                                            for i in idx):
            raise ValueError(f"qwen3_vl vision_config: deepstack_visual_indexes = {list(idx)}; expected distinct "
                             f"block indices in [0, depth={self.depth})")

    windowed = False  # no window attention: every block attends over its whole frame

    @property
    def grid_side(self) -> int:
        """Side of the square learned position grid (HF's num_grid_per_side)."""
        return int(self.num_position_embeddings ** 0.5)


def _int_field(d: dict, key: str):
    v = d[key]
    if isinstance(v, (list, tuple)):
        raise ValueError(f"qwen3_vl vision_config: {key} = {v!r}; jspec takes one integer (square patches)")
    return v


def vision_config_from_hf(d: dict[str, Any]) -> Qwen3VisionConfig:
    """Parse a Qwen3-VL `vision_config` dict (transformers' defaults for what is missing)."""
    v = dict(_HF_DEFAULTS)
    v.update({k: d[k] for k in v if d.get(k) is not None})
    rope = d.get("rope_parameters") or {}
    if rope.get("rope_type", "axial") != "axial":
        raise ValueError(f"qwen3_vl vision_config: rope_parameters.rope_type {rope.get('rope_type')!r}; the tower "
                         "takes axial rope only")
    return Qwen3VisionConfig(
        depth=v["depth"], width=v["hidden_size"], mlp_dim=v["intermediate_size"], num_heads=v["num_heads"],
        out_dim=v["out_hidden_size"], hidden_act=v["hidden_act"], in_channels=v["in_channels"],
        patch_size=_int_field(v, "patch_size"), temporal_patch_size=_int_field(v, "temporal_patch_size"),
        merge_size=v["spatial_merge_size"], rope_theta=float(rope.get("rope_theta", 10000.0)),
        num_position_embeddings=v["num_position_embeddings"],
        deepstack_indexes=tuple(v["deepstack_visual_indexes"]))


def vision_config_to_hf(cfg: Qwen3VisionConfig, model_type: str = "qwen3_vl") -> dict[str, Any]:
    return {"model_type": f"{model_type}_vision", "depth": cfg.depth, "hidden_size": cfg.width,
            "intermediate_size": cfg.mlp_dim, "num_heads": cfg.num_heads, "out_hidden_size": cfg.out_dim,
            "hidden_act": cfg.hidden_act, "in_channels": cfg.in_channels, "patch_size": cfg.patch_size,
            "temporal_patch_size": cfg.temporal_patch_size, "spatial_merge_size": cfg.merge_size,
            "num_position_embeddings": cfg.num_position_embeddings,
            "deepstack_visual_indexes": list(cfg.deepstack_indexes),
            "rope_parameters": {"rope_type": "axial", "rope_theta": cfg.rope_theta}}


# --------------------------------------------------------------------------------------------------- params


def param_shapes(cfg: Qwen3VisionConfig) -> dict:
    d, f, m = cfg.width, cfg.mlp_dim, cfg.width * cfg.merge_unit
    layer = {"norm1": (d,), "norm1_b": (d,), "norm2": (d,), "norm2_b": (d,), "wqkv": (d, 3 * d), "bqkv": (3 * d,),
             "wo": (d, d), "bo": (d,), "w_fc1": (d, f), "b_fc1": (f,), "w_fc2": (f, d), "b_fc2": (d,)}
    merger = lambda n: {"norm": (n,), "norm_b": (n,), "w1": (m, m), "b1": (m,),  # noqa: E731
                        "w2": (m, cfg.out_dim), "b2": (cfg.out_dim,)}
    return {"patch_embed": (d, cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size),
            "patch_b": (d,), "pos_embed": (cfg.num_position_embeddings, d),
            "layers": [dict(layer) for _ in range(cfg.depth)], "merger": merger(d),
            "deepstack": [merger(m) for _ in cfg.deepstack_indexes]}


def init_params(cfg: Qwen3VisionConfig, key: jax.Array, dtype=jnp.float32, std: float = 0.02) -> dict:
    """Random params (normal(0, std); unit LayerNorm scales)."""
    shapes = param_shapes(cfg)
    flat, treedef = jax.tree_util.tree_flatten_with_path(shapes, is_leaf=lambda x: isinstance(x, tuple))
    out = []
    for k, (path, shape) in zip(jax.random.split(key, len(flat)), flat):
        if jax.tree_util.keystr(path).endswith(("norm1']", "norm2']", "norm']")):
            out.append(jnp.ones(shape, dtype))
        else:
            out.append((jax.random.normal(k, shape, jnp.float32) * std).astype(dtype))
    return jax.tree.unflatten(treedef, out)


def hf_key_map(cfg: Qwen3VisionConfig, prefix: str = "model.visual."):
    """(hf_name, param path, transform) rows of the tower under `prefix` (transformers 5.23's names)."""
    rows = [(f"{prefix}patch_embed.proj.weight", ("patch_embed",), None),
            (f"{prefix}patch_embed.proj.bias", ("patch_b",), None),
            (f"{prefix}pos_embed.weight", ("pos_embed",), None)]
    linears = {"wqkv": "attn.qkv", "wo": "attn.proj", "w_fc1": "mlp.linear_fc1", "w_fc2": "mlp.linear_fc2"}
    for i in range(cfg.depth):
        rows += QV.block_key_rows(f"{prefix}blocks.{i}.", i, linears)

    def merger(mp, path):
        return [(f"{mp}norm.weight", path + ("norm",), None), (f"{mp}norm.bias", path + ("norm_b",), None),
                (f"{mp}linear_fc1.weight", path + ("w1",), "T"), (f"{mp}linear_fc1.bias", path + ("b1",), None),
                (f"{mp}linear_fc2.weight", path + ("w2",), "T"), (f"{mp}linear_fc2.bias", path + ("b2",), None)]

    rows += merger(f"{prefix}merger.", ("merger",))
    for j in range(len(cfg.deepstack_indexes)):
        rows += merger(f"{prefix}deepstack_merger_list.{j}.", ("deepstack", j))
    return rows


# --------------------------------------------------------------------------------------------------- host layout


def interpolation(cfg: Qwen3VisionConfig, rot: np.ndarray, hw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(index, weight) [..., 4] of the bilinear (align_corners) taps into the flat [side * side] position table
    for patches at rot [..., 2] (row, col) of frames of (h, w) patches hw [..., 2] (HF's
    get_vision_interpolation_indices_and_weights, in float32 as it computes them)."""
    side = cfg.grid_side
    taps, weights = [], []
    for a in (0, 1):
        src = rot[..., a].astype(np.float32) * np.float32(side - 1) / np.maximum(hw[..., a] - 1, 1).astype(np.float32)
        fl = np.floor(src)
        off = np.arange(2)
        taps.append(np.clip(fl.astype(np.int64)[..., None] + off, 0, side - 1))
        dist = np.abs(src[..., None] - fl[..., None] - off.astype(np.float32))
        weights.append(np.clip(np.float32(1) - dist, 0, None).astype(np.float32))
    index = (taps[0][..., :, None] * side + taps[1][..., None, :]).reshape(rot.shape[:-1] + (4,))
    weight = (weights[0][..., :, None] * weights[1][..., None, :]).reshape(rot.shape[:-1] + (4,))
    return index.astype(np.int32), weight.astype(np.float32)


# --------------------------------------------------------------------------------------------------- forward


def merge(cfg: Qwen3VisionConfig, p: dict, x: jax.Array, postshuffle: bool) -> jax.Array:
    """A patch merger on frames x [F, L, D]: LayerNorm (per patch, or after the merge_size^2 patches of a merged
    token are concatenated when `postshuffle`) -> Linear -> GELU -> Linear; [F, L / merge_unit, out_dim]."""
    F, Lp, D = x.shape
    if not postshuffle:
        x = VIS.layer_norm(x, p["norm"], p["norm_b"], QV.NORM_EPS)
    h = x.reshape(F, Lp // cfg.merge_unit, cfg.merge_unit * D)
    if postshuffle:
        h = VIS.layer_norm(h, p["norm"], p["norm_b"], QV.NORM_EPS)
    h = VIS.activation("gelu", LY.linear(h, p["w1"], p["b1"]))
    return LY.linear(h, p["w2"], p["b2"])


class VisionOut(NamedTuple):
    merged: jax.Array  # [F, L / merge_unit, out_dim]: the final merger's output per frame
    deepstack: jax.Array  # [F, n, L / merge_unit, out_dim]: block deepstack_indexes[j]'s output through merger j
    hidden: jax.Array  # [F, L, width]: the last block's output (before the merger)


def forward(cfg: Qwen3VisionConfig, params: dict, patches: jax.Array, rot: jax.Array, valid: jax.Array,
            interp_index: jax.Array, interp_weight: jax.Array) -> VisionOut:
    """Encode frames (`qwen2_vl_vision.frame_layout`'s patches, rot, valid and `interpolation`'s taps),
    `ports.core.layers.VISION_BATCH` frames at a time. Padding patches are never attended to; their outputs are junk."""
    return LY.in_batches(lambda *a: _frames_forward(cfg, params, *a),
                         (patches, rot, valid, interp_index, interp_weight), LY.VISION_BATCH)


def _frames_forward(cfg, params, patches, rot, valid, interp_index, interp_weight) -> VisionOut:
    dt = params["merger"]["w1"].dtype
    F, Lp, _ = patches.shape
    kernel = params["patch_embed"].reshape(cfg.width, -1)
    x = (LY.einsum_f32("flk,dk->fld", patches.astype(dt), kernel) + params["patch_b"].astype(jnp.float32)).astype(dt)
    table = params["pos_embed"]
    pos = jnp.sum(jnp.take(table, interp_index, axis=0).astype(jnp.float32) * interp_weight[..., None], axis=-2)
    x = x + pos.astype(dt)
    cos, sin = QV.rotary(cfg, rot)
    full = jnp.broadcast_to(valid[:, None, :], (F, Lp, Lp))
    deep = {}
    for i, p in enumerate(params["layers"]):
        x = QV.block(cfg, p, x, cos, sin, full)
        if i in cfg.deepstack_indexes:
            j = cfg.deepstack_indexes.index(i)
            deep[i] = merge(cfg, params["deepstack"][j], x, postshuffle=True)
    merged = merge(cfg, params["merger"], x, postshuffle=False)
    if deep:
        stack = jnp.stack([deep[i] for i in sorted(deep)], axis=1)
    else:
        stack = jnp.zeros((F, 0) + merged.shape[1:], merged.dtype)
    return VisionOut(merged, stack, x)


__all__ = ["Qwen3VisionConfig", "vision_config_from_hf", "vision_config_to_hf", "param_shapes", "init_params",
           "hf_key_map", "interpolation", "merge", "forward", "VisionOut"]
