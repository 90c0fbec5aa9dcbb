"""The Qwen2-VL / Qwen2.5-VL vision transformer: params, a fixed-shape forward, the host-side frame layout, HF maps.

HF runs the tower over one flat sequence of patches (every image and video concatenated) with attention split by
`cu_seqlens`: each temporal patch group ("frame": one image, or two video frames) attends only to itself, and
Qwen2.5-VL's window layers only inside windows of `window_size` pixels. Every other op is per patch, and the
patch merger joins 4 consecutive patches (the processor orders them block-major), which never cross a frame. So
here the tower runs on a frame-major layout `[F, L, ...]`: frame f holds its patches in the processor's order,
padded to L; full-attention layers take one masked `[L, L]` product per frame, and Qwen2.5-VL's window layers
gather each window's patches into `[windows, W]` rows (W = the most patches a window holds) and attend inside
them, so a window layer's scores are windows x W^2, not L^2; nothing has a data-dependent shape, and memory grows
with frames x L^2, not with (all patches)^2.
`frame_layout` (host, numpy) builds that layout from the processor's `pixel_values` / `image_grid_thw`.

Params (a plain pytree):
    {"patch_embed": [D, C, Tp, p, p] (HF's Conv3d kernel as is),
     "layers": [{"norm1", "norm2" (+ "_b" biases for Qwen2-VL's LayerNorm), "wqkv" [D, 3D], "bqkv", "wo", "bo",
                 Qwen2-VL: "w_fc1", "b_fc1", "w_fc2", "b_fc2" | Qwen2.5-VL: "w_gate", "b_gate", "w_up", "b_up",
                 "w_down", "b_down"}, ...],
     "merger": {"norm" (+ "norm_b"), "w1", "b1", "w2", "b2"}}
Matrices are stored [in, out].
"""
from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ports.core import anyres as ANY
from ports.core import layers as LY
from ports.core import vision as VIS

VISION_TYPES = ("qwen2_vl", "qwen2_5_vl")

# HF's Qwen2VLVisionConfig / Qwen2_5_VLVisionConfig defaults (older hub configs write only what differs).
_HF_DEFAULTS = {
    "qwen2_vl": dict(depth=32, embed_dim=1280, hidden_size=3584, hidden_act="quick_gelu", mlp_ratio=4, num_heads=16,
                     in_channels=3, patch_size=14, spatial_merge_size=2, temporal_patch_size=2),
    "qwen2_5_vl": dict(depth=32, hidden_size=3584, hidden_act="silu", intermediate_size=3420, num_heads=16,
                       in_channels=3, patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                       tokens_per_second=4, window_size=112, out_hidden_size=3584,
                       fullatt_block_indexes=(7, 15, 23, 31)),
}
NORM_EPS = 1e-6  # HF hard-codes it for the tower's norms and the merger's ln_q


@dataclasses.dataclass(frozen=True, kw_only=True)
class FrameTowerConfig:
    """What every frame-major tower (this one, Qwen3-VL's, Muse Glimmer's) holds and `check_grid`, `check_pixels`,
    `frame_layout`, `rotary` and `block` read; a subclass names its tower in `model_type`. Construction fails
    unless `hidden_act` is supported and head_dim is a multiple of 4."""

    depth: int
    width: int  # the tower's hidden size
    mlp_dim: int
    num_heads: int
    hidden_act: str
    in_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    rope_theta: float = 10000.0

    merge_key = "spatial_merge_size"  # the HF config's name of merge_size

    def __post_init__(self):
        where = f"{self.model_type} vision_config"
        if self.hidden_act not in VIS.ACTIVATIONS:
            raise ValueError(f"{where}: hidden_act {self.hidden_act!r} is not supported; jspec supports "
                             f"{sorted(VIS.ACTIVATIONS)}")
        if self.width % self.num_heads or self.head_dim % 4:
            raise ValueError(f"{where}: width {self.width} / num_heads {self.num_heads} must be a multiple of 4 "
                             "(the 2-D rotary embedding splits each head in four)")

    @property
    def head_dim(self) -> int:
        return self.width // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Length of one flattened patch, the processor's pixel_values rows (laid out as `patch_layout` says)."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def patch_layout(self) -> str:
        """The factors of `patch_dim` in the order a pixel_values row holds them."""
        return (f"(channels {self.in_channels} x temporal_patch_size {self.temporal_patch_size} x patch_size "
                f"{self.patch_size}^2)")

    @property
    def merge_unit(self) -> int:
        return self.merge_size ** 2


@dataclasses.dataclass(frozen=True, kw_only=True)
class QwenVisionConfig(FrameTowerConfig):
    """A Qwen2-VL ("qwen2_vl": LayerNorm + fc1/act/fc2 blocks, full attention) or Qwen2.5-VL ("qwen2_5_vl": RMSNorm
    + SwiGLU blocks with biases, window attention except in `fullatt_blocks`) tower; `width` is Qwen2-VL's
    embed_dim, Qwen2.5-VL's hidden_size."""

    model_type: str = dataclasses.field(kw_only=False)
    out_dim: int  # the merger's output (the language model's hidden size)
    window_size: int = 112  # pixels (Qwen2.5-VL)
    fullatt_blocks: tuple[int, ...] = ()  # Qwen2.5-VL: blocks with full (per-frame) attention
    tokens_per_second: int = 4  # Qwen2.5-VL: temporal M-RoPE ids per second of video

    def __post_init__(self):
        if self.model_type not in VISION_TYPES:
            raise ValueError(f"unknown Qwen vision tower {self.model_type!r}; jspec supports {VISION_TYPES}")
        super().__post_init__()
        if self.windowed and self.window_blocks < 1:
            raise ValueError(f"window_size={self.window_size} is smaller than one merged patch "
                             f"({self.merge_size} x {self.patch_size} pixels)")

    @property
    def windowed(self) -> bool:
        return self.model_type == "qwen2_5_vl"

    @property
    def window_blocks(self) -> int:
        """Window side in merged patches (HF's vit_merger_window_size)."""
        return self.window_size // self.merge_size // self.patch_size


def vision_config_from_hf(d: dict[str, Any], model_type: str) -> QwenVisionConfig:
    """Parse a Qwen2-VL / Qwen2.5-VL `vision_config` dict (HF defaults for what is missing; the hub's `in_chans`
    spelling accepted)."""
    if model_type not in VISION_TYPES:
        raise ValueError(f"unknown Qwen vision tower {model_type!r}; jspec supports {VISION_TYPES}")
    v = dict(_HF_DEFAULTS[model_type])
    if d.get("in_chans") is not None and d.get("in_channels") is None:
        v["in_channels"] = d["in_chans"]
    v.update({k: d[k] for k in v if d.get(k) is not None})
    rope = d.get("rope_parameters") or {}
    theta = float(rope.get("rope_theta", d.get("rope_theta", 10000.0)))
    common = dict(model_type=model_type, depth=int(v["depth"]), num_heads=int(v["num_heads"]),
                  hidden_act=v["hidden_act"], in_channels=int(v["in_channels"]), patch_size=int(v["patch_size"]),
                  temporal_patch_size=int(v["temporal_patch_size"]), merge_size=int(v["spatial_merge_size"]),
                  rope_theta=theta)
    if model_type == "qwen2_vl":
        width = int(v["embed_dim"])
        return QwenVisionConfig(width=width, mlp_dim=int(width * v["mlp_ratio"]), out_dim=int(v["hidden_size"]),
                                **common)
    return QwenVisionConfig(width=int(v["hidden_size"]), mlp_dim=int(v["intermediate_size"]),
                            out_dim=int(v["out_hidden_size"]), window_size=int(v["window_size"]),
                            fullatt_blocks=tuple(int(i) for i in v["fullatt_block_indexes"]),
                            tokens_per_second=int(v["tokens_per_second"]), **common)


def vision_config_to_hf(cfg: QwenVisionConfig) -> dict[str, Any]:
    out = {"model_type": f"{cfg.model_type}_vision", "depth": cfg.depth, "num_heads": cfg.num_heads,
           "hidden_act": cfg.hidden_act, "in_channels": cfg.in_channels, "patch_size": cfg.patch_size,
           "temporal_patch_size": cfg.temporal_patch_size, "spatial_merge_size": cfg.merge_size,
           "rope_parameters": {"rope_type": "axial", "rope_theta": cfg.rope_theta}}
    if cfg.model_type == "qwen2_vl":
        if cfg.mlp_dim % cfg.width:
            raise ValueError(f"Qwen2-VL's config spells the MLP as an integer mlp_ratio; {cfg.mlp_dim} / "
                             f"{cfg.width} is not one")
        out.update(embed_dim=cfg.width, hidden_size=cfg.out_dim, mlp_ratio=cfg.mlp_dim // cfg.width)
    else:
        out.update(hidden_size=cfg.width, intermediate_size=cfg.mlp_dim, out_hidden_size=cfg.out_dim,
                   window_size=cfg.window_size, fullatt_block_indexes=list(cfg.fullatt_blocks),
                   tokens_per_second=cfg.tokens_per_second)
    return out


# --------------------------------------------------------------------------------------------------- params


def param_shapes(cfg: QwenVisionConfig) -> dict:
    d, f, m = cfg.width, cfg.mlp_dim, cfg.width * cfg.merge_unit
    layer = {"norm1": (d,), "norm2": (d,), "wqkv": (d, 3 * d), "bqkv": (3 * d,), "wo": (d, d), "bo": (d,)}
    merger = {"norm": (d,), "w1": (m, m), "b1": (m,), "w2": (m, cfg.out_dim), "b2": (cfg.out_dim,)}
    if cfg.windowed:
        layer.update(w_gate=(d, f), b_gate=(f,), w_up=(d, f), b_up=(f,), w_down=(f, d), b_down=(d,))
    else:
        layer.update(norm1_b=(d,), norm2_b=(d,), w_fc1=(d, f), b_fc1=(f,), w_fc2=(f, d), b_fc2=(d,))
        merger["norm_b"] = (d,)
    return {"patch_embed": (d, cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size),
            "layers": [dict(layer) for _ in range(cfg.depth)], "merger": merger}


def init_params(cfg: QwenVisionConfig, key: jax.Array, dtype=jnp.float32, std: float = 0.02) -> dict:
    """Random params (normal(0, std), unit norm scales)."""
    shapes = param_shapes(cfg)
    is_shape = lambda x: isinstance(x, tuple)
    flat, treedef = jax.tree_util.tree_flatten_with_path(shapes, is_leaf=is_shape)
    keys = jax.random.split(key, len(flat))
    out = []
    for k, (path, shape) in zip(keys, flat):
        name = jax.tree_util.keystr(path)
        if name.endswith(("norm1']", "norm2']", "norm']")):
            out.append(jnp.ones(shape, dtype))
        else:
            out.append((jax.random.normal(k, shape, jnp.float32) * std).astype(dtype))
    return jax.tree.unflatten(treedef, out)


def block_key_rows(prefix: str, i: int, linears: dict[str, str], norm_bias: bool = True) -> list:
    """(hf_name, param path, transform) rows of block i at `prefix`: norm1 and norm2 (weight, then bias when
    `norm_bias`), then per `linears` entry (our weight name: HF's module name) its weight, transposed, and bias."""
    rows = []
    for n in ("norm1", "norm2"):
        rows.append((f"{prefix}{n}.weight", ("layers", i, n), None))
        if norm_bias:
            rows.append((f"{prefix}{n}.bias", ("layers", i, n + "_b"), None))
    for ours, theirs in linears.items():
        rows += [(f"{prefix}{theirs}.weight", ("layers", i, ours), "T"),
                 (f"{prefix}{theirs}.bias", ("layers", i, "b" + ours[1:]), None)]
    return rows


def hf_key_map(cfg: QwenVisionConfig, prefix: str = "visual."):
    """(hf_name, param path, transform) triples of the tower at `prefix` ("visual." on disk, "model.visual." in
    transformers 5's memory layout)."""
    rows = [(f"{prefix}patch_embed.proj.weight", ("patch_embed",), None)]
    linears = {"wqkv": "attn.qkv", "wo": "attn.proj"}
    if cfg.windowed:
        linears.update(w_gate="mlp.gate_proj", w_up="mlp.up_proj", w_down="mlp.down_proj")
    else:
        linears.update(w_fc1="mlp.fc1", w_fc2="mlp.fc2")
    for i in range(cfg.depth):
        rows += block_key_rows(f"{prefix}blocks.{i}.", i, linears, norm_bias=not cfg.windowed)
    mp = f"{prefix}merger."
    rows.append((f"{mp}ln_q.weight", ("merger", "norm"), None))
    if not cfg.windowed:
        rows.append((f"{mp}ln_q.bias", ("merger", "norm_b"), None))
    rows += [(f"{mp}mlp.0.weight", ("merger", "w1"), "T"), (f"{mp}mlp.0.bias", ("merger", "b1"), None),
             (f"{mp}mlp.2.weight", ("merger", "w2"), "T"), (f"{mp}mlp.2.bias", ("merger", "b2"), None)]
    return rows


# --------------------------------------------------------------------------------------------------- host layout


class FrameLayout(NamedTuple):
    """The tower's fixed-shape input, built on the host by `frame_layout`."""

    patches: np.ndarray  # [F, L, patch_dim] float32: frame f's patches in the processor's (block-major) order
    rot: np.ndarray  # [F, L, 2] int32: (row, column) of each patch in its frame (2-D rotary positions)
    valid: np.ndarray  # [F, L] bool
    window_index: np.ndarray  # [F, NW, W] int32: the frame slots of each window's patches (-1 padding; NW = 0
    #                           for Qwen2-VL, which has no window layers)
    window_slot: np.ndarray  # [F, L] int32: where each patch sits in its frame's windows, flat (w * W + i)
    patch_index: np.ndarray  # [N_pad] int32: flat slot f * L + l of every patch in HF's order (pad: 0)
    frame_start: np.ndarray  # [num_items + 1] int32: first frame of each item (images, then videos)
    merged_per_frame: int  # L / merge_unit: merged tokens per padded frame


def check_grid(cfg: FrameTowerConfig, grid, name: str) -> np.ndarray:
    """[N, 3] positive (t, h, w) rows with h and w multiples of the merge size, else ValueError."""
    g = np.asarray(grid)
    if g.ndim != 2 or g.shape[1] != 3 or not np.issubdtype(g.dtype, np.integer):
        raise ValueError(f"{name} must be an integer array [num, 3] of (t, h, w) patch counts, got shape {g.shape} "
                         f"dtype {g.dtype}")
    if np.any(g < 1):
        raise ValueError(f"{name} must be positive, got {g.tolist()}")
    m = cfg.merge_size
    if np.any(g[:, 1:] % m):
        raise ValueError(f"{name} {g.tolist()}: heights and widths must be multiples of {cfg.merge_key}={m}")
    return g.astype(np.int64)


def check_pixels(cfg: FrameTowerConfig, pixels, grid: np.ndarray, name: str, grid_name: str) -> np.ndarray:
    """pixel rows [sum t*h*w, patch_dim] matching the grid, else ValueError naming both counts."""
    pv = np.asarray(pixels)
    want = int(np.sum(np.prod(grid, axis=1)))
    if pv.ndim != 2 or pv.shape[1] != cfg.patch_dim:
        raise ValueError(f"{name} has shape {pv.shape}; the {cfg.model_type} tower expects (num_patches, "
                         f"{cfg.patch_dim}) rows {cfg.patch_layout}, as its processor returns")
    if pv.shape[0] != want:
        raise ValueError(f"{name} holds {pv.shape[0]} patches but {grid_name} {grid.tolist()} describes {want} "
                         f"(sum of t * h * w)")
    return pv


def frame_rot(cfg: QwenVisionConfig, h: int, w: int) -> np.ndarray:
    """(row, column) [h * w, 2] of a frame's patches in the processor's block-major order."""
    m = cfg.merge_size
    rr, cc = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    blk = lambda a: a.reshape(h // m, m, w // m, m).transpose(0, 2, 1, 3).reshape(-1)
    return np.stack([blk(rr), blk(cc)], axis=-1)


def frame_windows(cfg: QwenVisionConfig, rot: np.ndarray, w: int) -> np.ndarray:
    """Window ids of patches at rot [n, 2] (HF's get_vision_window_index, as ids instead of a permutation)."""
    ws = cfg.window_blocks
    lw = w // cfg.merge_size
    n_w = (lw + ws - 1) // ws
    r, c = rot[:, 0] // cfg.merge_size, rot[:, 1] // cfg.merge_size
    return (r // ws) * n_w + c // ws


def window_gather(cfg: QwenVisionConfig, window: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(window_index [F, NW, W], window_slot [F, L]) of window ids [F, L] (-1: padding): each window's patch slots
    in frame order, W = window_blocks^2 merged patches of merge_unit patches, NW the most windows in a frame
    (`anyres.bucket`ed); padding patches get slot 0, which nothing reads back. Qwen2-VL: NW = 0."""
    F, Lp = window.shape
    W = cfg.window_blocks ** 2 * cfg.merge_unit if cfg.windowed else 1
    NW = ANY.bucket(int(window.max()) + 1) if cfg.windowed and window.size and window.max() >= 0 else 0
    index = np.full((F, NW, W), -1, np.int32)
    slot = np.zeros((F, Lp), np.int32)
    for f in range(F if NW else 0):
        on = np.flatnonzero(window[f] >= 0)
        wid = window[f, on]
        order = np.argsort(wid, kind="stable")
        counts = np.bincount(wid, minlength=NW)
        if counts.max() > W:
            raise ValueError(f"a window of {counts.max()} patches; window_size={cfg.window_size} holds at most {W}")
        rank = np.empty_like(order)
        rank[order] = np.arange(on.size) - np.repeat(np.cumsum(counts) - counts, counts)
        index[f, wid, rank] = on
        slot[f, on] = wid * W + rank
    return index, slot


def frame_layout(cfg: QwenVisionConfig, items: list[tuple[np.ndarray, tuple[int, int, int]]]) -> FrameLayout:
    """Lay out items [(pixel rows [t*h*w, patch_dim], (t, h, w)), ...] frame by frame; F and L are padded to
    `anyres.bucket` sizes (L a multiple of the merge unit) so nearby inputs share one compilation."""
    frames = [(px[f * h * w:(f + 1) * h * w], h, w) for px, (t, h, w) in items for f in range(t)]
    n_frames = len(frames)
    longest = max(h * w for _, h, w in frames)
    unit = cfg.merge_unit
    Lp = -(-ANY.bucket(longest) // unit) * unit
    Fp = ANY.bucket(n_frames)
    patches = np.zeros((Fp, Lp, cfg.patch_dim), np.float32)
    rot = np.zeros((Fp, Lp, 2), np.int32)
    valid = np.zeros((Fp, Lp), bool)
    window = np.full((Fp, Lp), -1, np.int32)
    index = []
    for f, (px, h, w) in enumerate(frames):
        n = h * w
        patches[f, :n] = px
        r = frame_rot(cfg, h, w)
        rot[f, :n] = r
        valid[f, :n] = True
        window[f, :n] = frame_windows(cfg, r, w) if cfg.windowed else 0
        index.append(f * Lp + np.arange(n))
    index = np.concatenate(index).astype(np.int32)
    n_pad = ANY.bucket(index.size)
    patch_index = np.zeros(n_pad, np.int32)
    patch_index[:index.size] = index
    starts = np.cumsum([0] + [t for _, (t, _, _) in items]).astype(np.int32)
    return FrameLayout(patches, rot, valid, *window_gather(cfg, window), patch_index, starts, Lp // unit)


# --------------------------------------------------------------------------------------------------- forward


def rotary(cfg: FrameTowerConfig, rot: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos, sin [F, L, head_dim] of HF's axial 2-D rotary embedding: frequencies of head_dim / 4 applied to the
    row, then the column, the pair repeated (rotate-half layout)."""
    quarter = cfg.head_dim // 2
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, quarter, 2, dtype=np.float32) / quarter))
    fr = rot.astype(jnp.float32)[..., None] * jnp.asarray(inv, jnp.float32)  # [F, L, 2, hd/4]
    hw = jnp.concatenate([fr[..., 0, :], fr[..., 1, :]], axis=-1)
    emb = jnp.concatenate([hw, hw], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def _norm(cfg: QwenVisionConfig, x, w, b):
    if cfg.windowed:
        return LY.rms_norm(x, w, NORM_EPS)
    return VIS.layer_norm(x, w, b, NORM_EPS)


def window_attention(q: jax.Array, k: jax.Array, v: jax.Array, window_index: jax.Array,
                     window_slot: jax.Array) -> jax.Array:
    """Attention of frames' patches q, k, v [F, L, H, Dh] inside their windows (`window_gather`'s arrays): each
    window's patches gathered into one row of W, attended among themselves, and put back in frame order."""
    F, Lp, H, Dh = q.shape
    _, NW, W = window_index.shape
    at = jnp.maximum(window_index, 0).reshape(F, NW * W, 1, 1)
    rows = lambda t: jnp.take_along_axis(t, at, axis=1).reshape(F * NW, W, H, Dh)  # noqa: E731
    on = (window_index >= 0).reshape(F * NW, 1, W)
    o = LY.attention(rows(q), LY.kv_rows(rows(k)), LY.kv_rows(rows(v)), jnp.broadcast_to(on, (F * NW, W, W)))
    return jnp.take_along_axis(o.reshape(F, NW * W, H, Dh), window_slot[:, :, None, None], axis=1)


def block(cfg: QwenVisionConfig, p: dict, x: jax.Array, cos, sin, visible) -> jax.Array:
    """One tower block on frames x [F, L, D]; visible is a [F, L, L] mask of which patches each patch attends to,
    or a (window_index, window_slot) pair for attention inside windows."""
    F, Lp, D = x.shape
    H, Dh = cfg.num_heads, cfg.head_dim
    h = _norm(cfg, x, p["norm1"], p.get("norm1_b"))
    qkv = LY.linear(h, p["wqkv"], p["bqkv"]).reshape(F, Lp, 3, H, Dh)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    dt = q.dtype
    q = LY.apply_rope(q.astype(jnp.float32), cos, sin).astype(dt)
    k = LY.apply_rope(k.astype(jnp.float32), cos, sin).astype(dt)
    if isinstance(visible, tuple):
        o = window_attention(q, k, v, *visible)
    else:
        o = LY.attention(q, LY.kv_rows(k), LY.kv_rows(v), visible)
    x = x + LY.linear(o.reshape(F, Lp, D), p["wo"], p["bo"])
    h = _norm(cfg, x, p["norm2"], p.get("norm2_b"))
    if cfg.windowed:
        g = VIS.activation(cfg.hidden_act, LY.linear(h, p["w_gate"], p["b_gate"]))
        h = LY.linear(g * LY.linear(h, p["w_up"], p["b_up"]), p["w_down"], p["b_down"])
    else:
        h = LY.linear(VIS.activation(cfg.hidden_act, LY.linear(h, p["w_fc1"], p["b_fc1"])), p["w_fc2"], p["b_fc2"])
    return x + h


def merger(cfg: QwenVisionConfig, p: dict, x: jax.Array) -> jax.Array:
    """Patch merger: norm, then each run of merge_size^2 patches concatenated -> Linear -> GELU -> Linear."""
    F, Lp, D = x.shape
    h = _norm(cfg, x, p["norm"], p.get("norm_b")).reshape(F, Lp // cfg.merge_unit, cfg.merge_unit * D)
    h = VIS.activation("gelu", LY.linear(h, p["w1"], p["b1"]))
    return LY.linear(h, p["w2"], p["b2"])


class VisionOut(NamedTuple):
    merged: jax.Array  # [F, L / merge_unit, out_dim]: the merger's output per frame
    hidden: jax.Array  # [F, L, width]: the last block's output (before the merger)


def forward(cfg: QwenVisionConfig, params: dict, patches: jax.Array, rot: jax.Array, valid: jax.Array,
            window_index: jax.Array, window_slot: jax.Array) -> VisionOut:
    """Encode frames (a `FrameLayout`'s arrays), `ports.core.layers.VISION_BATCH` frames at a time (frames never attend
    to each other, so a long video's attention holds a few frames' [L, L] scores, not all of them). Padding
    patches are never attended to; their outputs are junk."""
    return LY.in_batches(lambda *a: _frames_forward(cfg, params, *a), (patches, rot, valid, window_index, window_slot),
                        LY.VISION_BATCH)


def _frames_forward(cfg: QwenVisionConfig, params: dict, patches: jax.Array, rot: jax.Array, valid: jax.Array,
                    window_index: jax.Array, window_slot: jax.Array) -> VisionOut:
    dt = params["merger"]["w1"].dtype
    F, Lp, K = patches.shape
    kernel = params["patch_embed"].reshape(cfg.width, -1)
    x = LY.einsum_f32("flk,dk->fld", patches.astype(dt), kernel).astype(dt)
    cos, sin = rotary(cfg, rot)
    full = jnp.broadcast_to(valid[:, None, :], (F, Lp, Lp))
    local = (window_index, window_slot) if cfg.windowed else full
    for i, p in enumerate(params["layers"]):
        vis = full if (not cfg.windowed or i in cfg.fullatt_blocks) else local
        x = block(cfg, p, x, cos, sin, vis)
    return VisionOut(merger(cfg, params["merger"], x), x)
