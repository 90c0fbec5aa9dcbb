"""Qwen2-VL and Qwen2.5-VL (model types "qwen2_vl", "qwen2_5_vl"): a vision transformer (`ports.families.qwen2_vl_vision`)
in front of a Qwen2 language model with multimodal rotary positions (M-RoPE).

Params: {"vision": tower params, "lm": language-model params (`ports.families.llama` layout, qkv biases)}. Decoding runs the
language model alone; images and videos enter once, at prefill, in two steps:

1. `prepare_inputs` (host, before any compute) checks the processor output (`pixel_values` [patches, C*Tp*p*p] +
   `image_grid_thw` [N_img, 3], `pixel_values_videos` + `video_grid_thw` [N_vid, 3], Qwen2.5's
   `second_per_grid_ts` [N_vid], `mm_token_type_ids`) against the prompt, and computes what HF computes from them
   with data-dependent shapes: the tower's frame layout (`qwen2_vl_vision.frame_layout`) and the M-RoPE position
   ids of every prompt token (HF's `get_rope_index`, transformers 5.23 rules), returning the device inputs
       vision_patches [F, L, patch_dim], vision_rot [F, L, 2], vision_valid [F, L]
                                     the tower's frames (see `qwen2_vl_vision`), F and L bucketed
       vision_window_index [F, NW, W], vision_window_slot [F, L]
                                     Qwen2.5-VL's windows: each window's patches, each patch's window place
       vision_patch_index [N_pad]    flat slot of each patch in HF's order (for `vision_features`)
       vision_src [B, T] int32       per prompt position, the row of the merged-feature table [F * L/4] it reads
       vision_mask [B, T] bool       image and video placeholder positions
       vision_grid_pos [B, T, 4]     per placeholder (item, frame, row, col) in its merged grid (items: images,
                                     then videos, in processor order; frame = temporal patch group); -1 elsewhere
       mrope_positions [3, B, T]     (t, h, w) rotary ids of every prompt position
       mrope_offset [B]              HF's rope_deltas: the token at cache slot j >= prompt has ids j + offset
       vision_layout [0, k]          k names the tower geometry and token ids the layout was made for
2. `prompt_embeds` (inside jit) runs the tower, splices the merged features over the placeholders (one gather) and
   returns the positions and offset, which `jspec.core.prefill.prefill` hands to the forward and the cache.

After the prompt every position is slot + offset in all three components (HF's continuation rule), so decoding
and tree verification use the plain 1-D path (`KVCache.pos_offset`); `forward` takes 3-D ids [3, B, T] or 1-D
[B, T]. `prune_prompt` builds a draft prompt on a subset of the vision tokens (SpecVLM), keeping their original
3-D ids or renumbering the pruned sequence 0..D-1.
"""
from __future__ import annotations

import dataclasses
import zlib
from typing import Any, ClassVar, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ports.core import config as PC
from ports.core import layers as LY
from ports.core import prompts as PR
from ports.families import llama
from ports.families import qwen2_vl_vision as QV

ARCHITECTURES = {"qwen2_vl": "Qwen2VLForConditionalGeneration",
                 "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration"}
# HF's Qwen2VLTextConfig / Qwen2_5_VLTextConfig defaults (identical for both).
_TEXT_DEFAULTS = dict(vocab_size=152064, hidden_size=8192, intermediate_size=29568, num_hidden_layers=80,
                      num_attention_heads=64, num_key_value_heads=8, hidden_act="silu", max_position_embeddings=32768,
                      rms_norm_eps=1e-5, bos_token_id=151643, eos_token_id=151645, pad_token_id=None)
_DEFAULT_THETA = 1000000.0
_DEFAULT_SECTION = (16, 24, 24)
_TOKEN_DEFAULTS = dict(image_token_id=151655, video_token_id=151656, vision_start_token_id=151652,
                       vision_end_token_id=151653)


@dataclasses.dataclass(frozen=True)
class MRopeVLConfig(PC.TextFields):
    """A vision tower in front of a language model with M-RoPE: what the host layout (`prepare_inputs`,
    `rope_index`), `prepared_positions` and `forward` read. A subclass sets `architectures` (the model types it
    takes; construction fails on any other) and `mrope_interleaved`."""

    architectures: ClassVar[Mapping[str, str]]
    mrope_interleaved: ClassVar[bool] = False
    model_type: str
    text: PC.TextConfig
    vision: QV.FrameTowerConfig
    mrope_section: tuple[int, ...]
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int

    def __post_init__(self):
        if self.model_type not in self.architectures:
            raise ValueError(f"{type(self).__name__}: model_type {self.model_type!r} is not one of "
                             f"{sorted(self.architectures)}")

    def tokens_per_item(self, grid_thw) -> int:
        """Placeholder tokens one image / video of patch grid (t, h, w) takes (what the processor inserts)."""
        t, h, w = (int(x) for x in grid_thw)
        return t * h * w // self.vision.merge_unit


@dataclasses.dataclass(frozen=True)
class QwenVLConfig(MRopeVLConfig):
    """Static, hashable config of a Qwen2-VL / Qwen2.5-VL model; exposes the text fields the engine reads."""

    architectures = ARCHITECTURES

    def __post_init__(self):
        super().__post_init__()
        if 2 * sum(self.mrope_section) != self.text.head_dim:
            raise ValueError(f"mrope_section {list(self.mrope_section)} must sum to head_dim / 2 = "
                             f"{self.text.head_dim // 2}")
        if self.text.rope.rope_type == "dynamic":
            raise ValueError("dynamic RoPE scaling with M-RoPE is not supported by jspec")
        # (HF's default configs pair a 3584-wide merger with an 8192-wide language model; like HF, only inputs
        # with images or videos fail on that, in `prepare_inputs`)


def text_fields_from_hf(d: dict, defaults: dict, theta: float) -> tuple[dict, dict]:
    """(text fields, rope parameters) of an HF VLM config dict: the text fields under `text_config` or at the top
    level (older hub configs), `defaults` for missing ones, generation_config's token ids merged at the top
    winning; the rope parameters from `rope_scaling` or `rope_parameters` (popped from the text fields:
    `rope_scaling`, `rope_theta`), theta defaulting to `theta`, an "mrope" or missing type read as "default"."""
    text_d = dict(d.get("text_config") or {k: v for k, v in d.items() if k not in ("vision_config", "text_config")})
    for k, v in defaults.items():
        text_d.setdefault(k, v)
    for k in ("eos_token_id", "bos_token_id", "pad_token_id"):
        if d.get(k) is not None:
            text_d[k] = d[k]
    rope = dict(text_d.pop("rope_scaling", None) or text_d.get("rope_parameters") or {})
    rope.setdefault("rope_theta", text_d.pop("rope_theta", theta))
    if rope.get("rope_type", rope.get("type")) in ("mrope", None):
        rope["rope_type"] = "default"
    rope.pop("type", None)
    return text_d, rope


def config_from_hf(d: dict) -> QwenVLConfig:
    """Parse an HF `Qwen2VLConfig` / `Qwen2_5_VLConfig` dict: text fields under `text_config` (transformers 5) or
    at the top level (older hub configs), `rope_parameters` or `rope_scaling` + `rope_theta`; generation_config's
    token ids merged at the top win; missing fields take HF's defaults."""
    mt = d.get("model_type")
    if mt not in ARCHITECTURES:
        raise ValueError(f"qwen2_vl.config_from_hf: model_type {mt!r} is not one of {sorted(ARCHITECTURES)}")
    text_d, rope = text_fields_from_hf(d, _TEXT_DEFAULTS, _DEFAULT_THETA)
    section = tuple(int(s) for s in rope.pop("mrope_section", _DEFAULT_SECTION))
    text_d["rope_parameters"] = rope
    heads = text_d["num_attention_heads"]
    head_dim = text_d.pop("head_dim", None)
    if head_dim is not None and head_dim != text_d["hidden_size"] // heads:
        raise ValueError(f"head_dim={head_dim} differs from hidden_size / num_attention_heads; Qwen2-VL's attention "
                         "always uses hidden_size / num_attention_heads")
    text_d["tie_word_embeddings"] = bool(d.get("tie_word_embeddings", False)) or bool(
        text_d.get("tie_word_embeddings", False))
    text_d["model_type"] = "qwen2"
    text = PC.text_config_from_hf(text_d)
    vision = QV.vision_config_from_hf(dict(d.get("vision_config") or {}), mt)
    tok = {k: int(d.get(k) if d.get(k) is not None else v) for k, v in _TOKEN_DEFAULTS.items()}
    return QwenVLConfig(model_type=mt, text=text, vision=vision, mrope_section=section, **tok)


def config_to_hf(cfg: QwenVLConfig) -> dict:
    """An HF config.json dict (transformers-5 layout: text under text_config)."""
    text = PC.text_config_to_hf(cfg.text)
    text.pop("architectures", None)
    text.pop("head_dim", None)
    text["model_type"] = f"{cfg.model_type}_text"
    text["rope_parameters"] = {**text["rope_parameters"], "mrope_section": list(cfg.mrope_section)}
    return {"model_type": cfg.model_type, "architectures": [ARCHITECTURES[cfg.model_type]], "text_config": text,
            "vision_config": QV.vision_config_to_hf(cfg.vision), "image_token_id": cfg.image_token_id,
            "video_token_id": cfg.video_token_id, "vision_start_token_id": cfg.vision_start_token_id,
            "vision_end_token_id": cfg.vision_end_token_id, "tie_word_embeddings": cfg.text.tie_word_embeddings}


def param_shapes(cfg: QwenVLConfig) -> dict:
    return {"vision": QV.param_shapes(cfg.vision), "lm": llama.param_shapes(cfg.text)}


def init_params(cfg: QwenVLConfig, key: jax.Array, dtype=jnp.float32, std: float = 0.02) -> dict:
    kv, kl = jax.random.split(key)
    return {"vision": QV.init_params(cfg.vision, kv, dtype, std), "lm": llama.init_params(cfg.text, kl, dtype, std)}


def hf_key_map(cfg: QwenVLConfig):
    """Rows in the layout transformers 5 writes to disk (`visual.*`, `model.*`, `lm_head.weight`);
    `rename_hf_key` maps its in-memory layout (`model.visual.*`, `model.language_model.*`) onto it."""
    rows = [(n, ("vision",) + p, t) for n, p, t in QV.hf_key_map(cfg.vision, "visual.")]
    rows += [(n, ("lm",) + p, t) for n, p, t in llama.hf_key_map(cfg.text, "model.", "lm_head.weight")]
    return rows


_RENAMES = (("model.visual.", "visual."), ("model.language_model.", "model."))


def rename_hf_key(name: str) -> str:
    for old, new in _RENAMES:
        if name.startswith(old):
            return new + name[len(old):]
    return name


IGNORED_HF_KEYS = llama.IGNORED_HF_KEYS + (r"^visual\.rotary_pos_emb\.inv_freq$",)


def kv_layout(cfg: MRopeVLConfig) -> tuple[int, int, int]:
    return llama.kv_layout(cfg.text)


def embed(cfg: MRopeVLConfig, params: dict, tokens: jax.Array) -> jax.Array:
    return llama.embed(params["lm"], tokens)


def unembed(cfg: MRopeVLConfig, params: dict, h: jax.Array) -> jax.Array:
    return llama.unembed(cfg.text, params["lm"], h)


def forward(cfg: MRopeVLConfig, params: dict, tokens, positions: jax.Array, cache, new_mask=None,
            **kwargs) -> llama.ForwardOut:
    """The language model's forward (see `ports.families.llama.forward`, which also takes DeepStack's `layer_adds`)
    with positions either M-RoPE ids [3, B, T] (the prompt; interleaved as `cfg.mrope_interleaved` says) or [B, T]
    (every later token: the three components are equal, which is plain RoPE)."""
    if positions.ndim == 3:
        kwargs["rope"] = LY.mrope_tables(cfg.text, positions, cfg.mrope_section, interleaved=cfg.mrope_interleaved)
        positions = positions[0]
    return llama.forward(cfg.text, params["lm"], tokens, positions, cache, new_mask, **kwargs)


# ------------------------------------------------------------------------------------------- host-side layout

RAW_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts",
            "mm_token_type_ids", "vision_keep", "position_ids", "rope_deltas")
PREPARED_KEYS = ("vision_patches", "vision_rot", "vision_valid", "vision_window_index", "vision_window_slot",
                 "vision_patch_index", "vision_src", "vision_mask", "vision_grid_pos", "mrope_positions",
                 "mrope_offset", "vision_layout")


def layout_key(cfg: QwenVLConfig) -> int:
    """A small int naming everything the prepared inputs depend on (see `vision_layout`)."""
    v = cfg.vision
    sig = (cfg.model_type, v.patch_size, v.temporal_patch_size, v.merge_size, v.in_channels,
           getattr(v, "window_size", None), getattr(v, "tokens_per_second", None), cfg.image_token_id,
           cfg.video_token_id)
    return zlib.crc32(repr(sig).encode()) % 65521 + 1


class _Items(NamedTuple):
    """Every image and video of a prompt, images first (the order of HF's feature tables)."""

    pixels: list  # per item [t*h*w, patch_dim]
    grids: np.ndarray  # [n, 3]
    kind: np.ndarray  # [n] 1 image, 2 video
    interval: list  # per item: temporal M-RoPE step (a number; Qwen2.5 videos: tokens_per_second * seconds)


def _interval(cfg: QwenVLConfig, seconds) -> Any:
    """Qwen2.5-VL's temporal id step of a video, in the dtype HF computes it in (torch promotes the python int
    tokens_per_second against the given tensor: float32 seconds stay float32, float64 stay float64)."""
    if cfg.model_type != "qwen2_5_vl":
        return 1
    if seconds is None:
        return cfg.vision.tokens_per_second
    s = np.asarray(seconds)
    return s.dtype.type(cfg.vision.tokens_per_second) * s


def _items(cfg: QwenVLConfig, inputs: Mapping[str, Any]) -> _Items:
    pixels, grids, kinds, intervals = [], [], [], []
    for kind, pv_key, grid_key, what in ((1, "pixel_values", "image_grid_thw", "image"),
                                         (2, "pixel_values_videos", "video_grid_thw", "video")):
        pv, grid = inputs.get(pv_key), inputs.get(grid_key)
        if pv is None and grid is None:
            continue
        if grid is None:
            raise ValueError(f"{pv_key} given without {grid_key}: {cfg.model_type} needs the (t, h, w) patch grid "
                             f"of every {what} (the processor returns it)")
        if pv is None:
            raise ValueError(f"{grid_key} given without {pv_key}")
        grid = QV.check_grid(cfg.vision, grid, grid_key)
        pv = QV.check_pixels(cfg.vision, pv, grid, pv_key, grid_key)
        offs = np.concatenate([[0], np.cumsum(np.prod(grid, axis=1))])
        seconds = None
        if kind == 2 and inputs.get("second_per_grid_ts") is not None:
            seconds = np.asarray(inputs["second_per_grid_ts"]).reshape(-1)
            if seconds.shape[0] != grid.shape[0]:
                raise ValueError(f"second_per_grid_ts has {seconds.shape[0]} entries for {grid.shape[0]} video(s)")
        for i, g in enumerate(grid):
            pixels.append(pv[offs[i]:offs[i + 1]])
            grids.append(g)
            kinds.append(kind)
            intervals.append(1 if kind == 1 else _interval(cfg, None if seconds is None else seconds[i]))
    if inputs.get("second_per_grid_ts") is not None and inputs.get("video_grid_thw") is None:
        raise ValueError("second_per_grid_ts given without videos (video_grid_thw)")
    return _Items(pixels, np.asarray(grids, np.int64).reshape(-1, 3), np.asarray(kinds, np.int64), intervals)


def _vision_ids(cfg: QwenVLConfig, grid, start: int, interval) -> np.ndarray:
    """(t, h, w) ids [3, n] of one item's placeholders starting at `start` (HF's get_vision_position_ids)."""
    m = cfg.vision.merge_size
    t, lh, lw = int(grid[0]), int(grid[1]) // m, int(grid[2]) // m
    tt = (np.arange(t).astype(np.asarray(interval).dtype) * interval).astype(np.int64)  # .long() truncates
    ids = np.stack([np.repeat(tt, lh * lw), np.tile(np.repeat(np.arange(lh), lw), t), np.tile(np.arange(lw), t * lh)])
    return ids + start


def rope_index(cfg: QwenVLConfig, rows: list[np.ndarray], items: _Items) -> tuple[list[np.ndarray], np.ndarray]:
    """HF's get_rope_index (transformers 5.23) for unpadded token rows: per row the (t, h, w) ids [3, n] and the
    rope delta (max id + 1 - n). Each maximal run of image (video) tokens takes the next image (video) in order,
    across rows; text advances by one per token, an item by max(h, w) / merge_size (its temporal extent is not
    counted, as in transformers 5.23)."""
    m = cfg.vision.merge_size
    queues = {k: [i for i in range(len(items.kind)) if items.kind[i] == k] for k in (1, 2)}
    names = {1: ("image", cfg.image_token_id, "image_grid_thw"), 2: ("video", cfg.video_token_id, "video_grid_thw")}
    out, deltas = [], []
    for b, row in enumerate(rows):
        types = np.where(row == cfg.image_token_id, 1, np.where(row == cfg.video_token_id, 2, 0))
        cuts = np.concatenate([[0], np.flatnonzero(np.diff(types)) + 1, [len(row)]])
        pos, cur = [], 0
        for s, e in zip(cuts[:-1], cuts[1:]):
            ty = int(types[s])
            if ty == 0:
                pos.append(np.broadcast_to(np.arange(e - s) + cur, (3, e - s)))
                cur += e - s
                continue
            what, tok, key = names[ty]
            if not queues[ty]:
                raise ValueError(f"prompt row {b} has more runs of {what} tokens (id {tok}) than {key} has "
                                 f"{what}s")
            i = queues[ty].pop(0)
            want = cfg.tokens_per_item(items.grids[i])
            if e - s != want:
                raise ValueError(f"prompt row {b}: a run of {e - s} {what} tokens (id {tok}) where {what} "
                                 f"{items.grids[i].tolist()} of {key} takes {want}; build the prompt with the model's "
                                 f"processor")
            pos.append(_vision_ids(cfg, items.grids[i], cur, items.interval[i]))
            cur += int(max(items.grids[i][1], items.grids[i][2])) // m
        ids = np.concatenate(pos, axis=1) if pos else np.zeros((3, 0), np.int64)
        out.append(ids)
        deltas.append(int(ids.max()) + 1 - len(row) if len(row) else 0)
    for ty in (1, 2):
        if queues[ty]:
            what, tok, key = names[ty]
            raise ValueError(f"{key} has {len(queues[ty])} {what}(s) more than the prompt's runs of {what} tokens "
                             f"(id {tok}) use")
    return out, np.asarray(deltas, np.int64)


class _Layout(NamedTuple):
    prepared: dict
    feat_of_token: np.ndarray  # [B, T] feature index (images, then videos) of each placeholder, -1 elsewhere
    positions: np.ndarray  # [3, B, T]
    offset: np.ndarray  # [B]


def _layout(cfg: QwenVLConfig, tokens: np.ndarray, lengths: np.ndarray, inputs: Mapping[str, Any]) -> _Layout:
    PR.check_input_keys(cfg.model_type, inputs, RAW_KEYS, PREPARED_KEYS)
    tokens = np.asarray(tokens)
    B, T = tokens.shape
    lengths = np.asarray(lengths).reshape(B)
    valid = np.arange(T)[None, :] < lengths[:, None]
    is_img = valid & (tokens == cfg.image_token_id)
    is_vid = valid & (tokens == cfg.video_token_id)
    items = _items(cfg, inputs)
    if len(items.kind) and cfg.vision.out_dim != cfg.text.hidden_size:
        raise ValueError(f"this {cfg.model_type} config cannot read images: its vision merger outputs "
                         f"{cfg.vision.out_dim} features but the language model's hidden_size is "
                         f"{cfg.text.hidden_size}")
    n_feat = [cfg.tokens_per_item(g) for g in items.grids]
    feat_start = np.concatenate([[0], np.cumsum(n_feat)]).astype(np.int64)
    n_img_feat = int(sum(n for n, k in zip(n_feat, items.kind) if k == 1))
    n_vid_feat = int(sum(n_feat)) - n_img_feat
    keep = inputs.get("vision_keep")
    if keep is not None:
        keep = np.asarray(keep).reshape(-1)
        if keep.dtype != bool or keep.size != n_img_feat + n_vid_feat:
            raise ValueError(f"vision_keep must be a bool mask over the {n_img_feat + n_vid_feat} vision tokens "
                             f"(images, then videos), got shape {keep.shape} dtype {keep.dtype}")
    else:
        keep = np.ones(n_img_feat + n_vid_feat, bool)
    mm = inputs.get("mm_token_type_ids")
    if mm is not None:
        mm = np.asarray(mm)
        # the processor marks image / video placeholders by their ids; padding is type 0 however it was padded
        if int(np.sum(mm == 1)) != int(is_img.sum()) or int(np.sum(mm == 2)) != int(is_vid.sum()):
            raise ValueError(f"mm_token_type_ids mark {int(np.sum(mm == 1))} image / {int(np.sum(mm == 2))} video "
                             f"tokens but the prompt has {int(is_img.sum())} / {int(is_vid.sum())} (ids "
                             f"{cfg.image_token_id} / {cfg.video_token_id})")
    sel = {1: np.flatnonzero(keep[:n_img_feat]), 2: n_img_feat + np.flatnonzero(keep[n_img_feat:])}
    for ty, mask, tok, what, key in ((1, is_img, cfg.image_token_id, "image", "image_grid_thw"),
                                     (2, is_vid, cfg.video_token_id, "video", "video_grid_thw")):
        have, want = int(mask.sum()), sel[ty].size
        if have != want:
            grids = [list(g) for g, k in zip(items.grids.tolist(), items.kind) if k == ty]
            pruned = " kept by vision_keep" if inputs.get("vision_keep") is not None else ""
            given = f"{key} {grids} take {want}{pruned}" if grids else f"no {key} (with its pixels) was given"
            raise ValueError(f"prompt has {have} {what} tokens (id {tok}) but {given}; build the prompt with the "
                             f"model's processor")
    feat_of_token = np.full((B, T), -1, np.int64)
    feat_of_token[is_img] = sel[1]
    feat_of_token[is_vid] = sel[2]
    # M-RoPE ids: HF's rule, or given (a pruned prompt built by `prune_prompt`)
    if inputs.get("position_ids") is not None:
        pid = np.asarray(inputs["position_ids"])
        if pid.ndim != 3 or pid.shape[0] != 3 or pid.shape[1] != B or pid.shape[2] < int(lengths.max()):
            raise ValueError(f"position_ids must be [3, {B}, >= {int(lengths.max())}] (t, h, w) ids per prompt "
                             f"position, right-padded like the prompt; got shape {pid.shape}")
        if inputs.get("rope_deltas") is None:
            raise ValueError("position_ids given without rope_deltas (the offset of the positions after the prompt)")
        offset = np.asarray(inputs["rope_deltas"]).reshape(-1)
        if offset.shape[0] != B:
            raise ValueError(f"rope_deltas has {offset.shape[0]} entries for {B} prompt rows")
        positions = np.zeros((3, B, T), np.int64)
        w = min(T, pid.shape[2])
        positions[:, :, :w] = pid[:, :, :w]
        positions[:, ~valid] = 0
    else:
        if inputs.get("vision_keep") is not None:
            raise ValueError("vision_keep needs position_ids and rope_deltas (build a pruned prompt with "
                             "ports.families.qwen2_vl.prune_prompt)")
        if inputs.get("rope_deltas") is not None:
            raise ValueError("rope_deltas given without position_ids")
        rows = [tokens[b, :lengths[b]] for b in range(B)]
        ids, offset = rope_index(cfg, rows, items) if len(items.kind) else ([None] * B, np.zeros(B, np.int64))
        positions = np.zeros((3, B, T), np.int64)
        for b in range(B):
            positions[:, b, :lengths[b]] = np.arange(lengths[b]) if ids[b] is None else ids[b]
    prepared: dict = {}
    if len(items.kind):
        lay = QV.frame_layout(cfg.vision, list(zip(items.pixels, [tuple(g) for g in items.grids.tolist()])))
        # per feature: its merged-table row and (item, frame, row, col)
        f_item = np.repeat(np.arange(len(n_feat)), n_feat)
        j = np.arange(feat_start[-1]) - feat_start[f_item]
        m = cfg.vision.merge_size
        per_frame = items.grids[f_item, 1] * items.grids[f_item, 2] // (m * m)
        lw = items.grids[f_item, 2] // m
        frame, u = j // per_frame, j % per_frame
        table = (lay.frame_start[f_item] + frame) * lay.merged_per_frame + u
        grid_pos = np.stack([f_item, frame, u // lw, u % lw], axis=-1)
        on = feat_of_token >= 0
        src = np.zeros((B, T), np.int32)
        src[on] = table[feat_of_token[on]]
        gp = np.full((B, T, 4), -1, np.int32)
        gp[on] = grid_pos[feat_of_token[on]]
        prepared.update(vision_patches=lay.patches, vision_rot=lay.rot, vision_valid=lay.valid,
                        vision_window_index=lay.window_index, vision_window_slot=lay.window_slot,
                        vision_patch_index=lay.patch_index, vision_src=src,
                        vision_mask=on, vision_grid_pos=gp)
    if prepared or inputs.get("position_ids") is not None:
        prepared.update(mrope_positions=positions.astype(np.int32), mrope_offset=offset.astype(np.int32),
                        vision_layout=np.zeros((0, layout_key(cfg)), np.int8))
    return _Layout(prepared, feat_of_token, positions, offset)


def prepare_inputs(cfg: QwenVLConfig, tokens: np.ndarray, lengths: np.ndarray, inputs: Mapping[str, Any]) -> dict:
    """Host-side checks and layout (see the module docstring): processor output -> device inputs ({} for a
    text-only prompt, which then runs with plain positions, as HF's does)."""
    return _layout(cfg, tokens, lengths, inputs).prepared


class PromptEmbeds(NamedTuple):
    embeds: jax.Array  # [B, T, D] text embeddings with the merged vision features spliced in
    image_mask: jax.Array  # [B, T] bool: image and video placeholder positions
    vision_features: jax.Array  # [N_pad, width] the tower's last block output per patch (HF order), before merging
    positions: jax.Array | None  # [3, B, T] M-RoPE ids of the prompt (None: plain positions)
    position_offset: jax.Array | None  # [B] rope deltas (the cache's pos_offset)
    vision_grid_pos: jax.Array  # [B, T, 4] (item, frame, row, col) of each placeholder, -1 elsewhere
    forward_inputs: dict | None = None  # extra options of the prompt's forward (Qwen3-VL: DeepStack's layer_adds)


def prepared_positions(cfg, inputs: Mapping[str, jax.Array], B: int, T: int) -> jax.Array | None:
    """The M-RoPE ids [3, B, T] of `prepare_inputs`' output after checking it was made for this model's layout
    and a [B, T] prompt; None for a text-only prompt (no inputs). ValueError otherwise."""
    if "vision_layout" not in inputs:
        raw = sorted(set(inputs) & set(RAW_KEYS))
        if raw or inputs:
            raise ValueError(f"{cfg.model_type}: prompt_embeds takes the output of its prepare_inputs, got "
                             f"{raw or sorted(inputs)} (inputs prepared for another model? for a draft: pass "
                             f"draft_prompt=)")
        return None
    if inputs["vision_layout"].shape != (0, layout_key(cfg)):
        raise ValueError(f"these vision inputs were prepared for another model's layout (tower geometry or token "
                         f"ids differ from this {cfg.model_type}); run this model's prepare_inputs on the processor "
                         f"output (for a draft: pass draft_prompt=)")
    pos = inputs["mrope_positions"]
    if pos.shape != (3, B, T):
        raise ValueError(f"mrope_positions {pos.shape} were prepared for prompts of shape {pos.shape[1:]}, not "
                         f"{(B, T)}")
    return pos


def prompt_embeds(cfg: QwenVLConfig, params: dict, tokens: jax.Array, inputs: Mapping[str, jax.Array]) -> PromptEmbeds:
    """Prompt embeddings, positions and hooks from `prepare_inputs`' output (empty: text only)."""
    x = embed(cfg, params, tokens)
    B, T = tokens.shape
    no_grid = jnp.full((B, T, 4), -1, jnp.int32)
    empty = jnp.zeros((0, cfg.vision.width), x.dtype)
    pos = prepared_positions(cfg, inputs, B, T)
    if pos is None:
        return PromptEmbeds(x, jnp.zeros((B, T), bool), empty, None, None, no_grid)
    if "vision_patches" not in inputs:
        return PromptEmbeds(x, jnp.zeros((B, T), bool), empty, pos, inputs["mrope_offset"], no_grid)
    vo = QV.forward(cfg.vision, params["vision"], inputs["vision_patches"], inputs["vision_rot"],
                    inputs["vision_valid"], inputs["vision_window_index"], inputs["vision_window_slot"])
    table = vo.merged.reshape(-1, vo.merged.shape[-1]).astype(x.dtype)
    mask = inputs["vision_mask"]
    x = jnp.where(mask[..., None], jnp.take(table, inputs["vision_src"], axis=0), x)
    feats = jnp.take(vo.hidden.reshape(-1, vo.hidden.shape[-1]), inputs["vision_patch_index"], axis=0)
    return PromptEmbeds(x, mask, feats, pos, inputs["mrope_offset"], inputs["vision_grid_pos"])


# ------------------------------------------------------------------------------------------- pruned drafts

POSITION_MODES = ("original", "renumbered")


def prune_prompt(cfg: QwenVLConfig, prompt: Mapping[str, Any], keep, positions: str = "original") -> dict:
    """A prompt mapping for a draft prefilled on a subset of the vision tokens (SpecVLM): every text token stays,
    a vision token stays where `keep` says so, in order; the draft still encodes every image / video with its own
    tower and splices the kept tokens' features.

    prompt: the processor output (as `jspec.decode` takes it). keep: bool, one entry per vision placeholder of the
    prompt in prompt order (row-major; the order of `image_mask` positions), or a [B, T] mask laid out like the
    right-padded prompt (only its vision positions are read). positions: "original" keeps each kept token's
    M-RoPE ids (and continues decoding where the full prompt does); "renumbered" gives the pruned sequence plain
    positions 0..D-1 in all three components (SpecVLM's code) and continues at D.
    Returns a right-padded mapping (`input_ids`, `attention_mask`, the pixel inputs, `vision_keep` over the vision
    tokens in feature order, `position_ids` [3, B, D], `rope_deltas` [B]) for `draft_prompt=` or `ports.logits`.
    """
    if positions not in POSITION_MODES:
        raise ValueError(f"positions must be one of {POSITION_MODES}, got {positions!r}")
    tokens, lengths, extra = PR.normalize_prompt(prompt, cfg.vocab_size, pad_to=1)
    if set(extra) & {"vision_keep", "position_ids", "rope_deltas"}:
        raise ValueError("prune_prompt takes the full processor output, not an already pruned prompt")
    lay = _layout(cfg, tokens, lengths, extra)
    is_vis = lay.feat_of_token >= 0
    keep = np.asarray(keep)
    if keep.dtype != bool:
        raise ValueError(f"keep must be a bool mask, got dtype {keep.dtype}")
    if keep.ndim == 2:
        if keep.shape[0] != tokens.shape[0] or keep.shape[1] < tokens.shape[1]:
            raise ValueError(f"a [B, T] keep mask must cover the prompt {tokens.shape}, got {keep.shape}")
        keep = keep[:, :tokens.shape[1]][is_vis]
    if keep.ndim != 1 or keep.size != int(is_vis.sum()):
        raise ValueError(f"keep has {keep.size} entries; the prompt has {int(is_vis.sum())} vision tokens")
    stay = ~is_vis
    stay[is_vis] = keep
    n_feat = int(lay.feat_of_token.max()) + 1 if is_vis.any() else 0
    feat_keep = np.zeros(n_feat, bool)
    feat_keep[lay.feat_of_token[is_vis]] = keep
    B = tokens.shape[0]
    rows = [np.flatnonzero(stay[b, :lengths[b]]) for b in range(B)]
    D = max(1, max(len(r) for r in rows))
    ids = np.zeros((B, D), np.int64)
    mask = np.zeros((B, D), np.int64)
    pos = np.zeros((3, B, D), np.int64)
    deltas = np.zeros(B, np.int64)
    for b, r in enumerate(rows):
        ids[b, :len(r)] = tokens[b, r]
        mask[b, :len(r)] = 1
        if positions == "original":
            pos[:, b, :len(r)] = lay.positions[:, b, r]
            deltas[b] = int(lengths[b]) + int(lay.offset[b]) - len(r)
        else:
            pos[:, b, :len(r)] = np.arange(len(r))
    out = {"input_ids": ids, "attention_mask": mask, "position_ids": pos, "rope_deltas": deltas,
           "vision_keep": feat_keep}
    for k in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts"):
        if k in extra:
            out[k] = extra[k]
    return out


def compact_prompt(cfg: QwenVLConfig, tokens: jax.Array, inputs: Mapping[str, jax.Array], idx: jax.Array,
                   lengths: jax.Array, new_lengths: jax.Array, positions: str = "original") -> dict:
    """`prune_prompt` inside a program: prepared inputs of a [B, T] prompt -> those of the [B, D] prompt made of the
    positions idx [B, D] (ascending, -1 past each row's new_lengths[b]). The vision tables stay whole (the tower
    still encodes every frame); each kept placeholder keeps its feature row. positions: "original" keeps each kept
    token's M-RoPE ids and continues where the full prompt does; "renumbered" gives the pruned row plain positions
    0..D-1 and continues at its length."""
    if positions not in POSITION_MODES:
        raise ValueError(f"positions must be one of {POSITION_MODES}, got {positions!r}")
    on = idx >= 0
    at = jnp.maximum(idx, 0)
    take = lambda x, fill: jnp.where(on.reshape(on.shape + (1,) * (x.ndim - 2)),  # noqa: E731
                                     jnp.take_along_axis(x, at.reshape(at.shape + (1,) * (x.ndim - 2)), axis=1), fill)
    out = dict(inputs)
    for key, fill in (("vision_src", 0), ("vision_mask", False), ("vision_grid_pos", -1)):
        if key in inputs:
            out[key] = take(inputs[key], fill)
    B, D = idx.shape
    if positions == "original":
        pos = jnp.where(on[None], jnp.take_along_axis(inputs["mrope_positions"], at[None], axis=2), 0)
        offset = lengths + inputs["mrope_offset"] - new_lengths
    else:
        pos = jnp.where(on[None], jnp.arange(D, dtype=jnp.int32)[None, None, :], 0)
        pos = jnp.broadcast_to(pos, (3, B, D))
        offset = jnp.zeros_like(inputs["mrope_offset"])
    out["mrope_positions"] = pos.astype(jnp.int32)
    out["mrope_offset"] = offset.astype(jnp.int32)
    return out
