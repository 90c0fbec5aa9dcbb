"""LLaVA-NeXT, LLaVA-NeXT-Video and LLaVA-OneVision: LLaVA (`ports.families.llava`) with anyres image tiling, `image_newline`,
(OneVision) "anyres_max_N" shrinking and video frames, and (NeXT-Video) video frames pooled before the projector.

Params: LLaVA's {"vision", "projector", "lm"} plus "image_newline" [D]. Decoding runs the language model alone;
images and videos enter once, at prefill, in two steps:

1. `prepare_inputs` (host, before any compute) checks the processor output (`pixel_values` [N_img, max_tiles, C,
   H, W] or the concatenated tiles [N_tiles, C, H, W], `image_sizes` [N_img, 2], OneVision's `batch_num_images`
   and `pixel_values_videos` [N_vid, frames, C, H, W]) against the prompt and lays out, from the image sizes and
   the config alone, what HF's `pack_image_features` / `get_video_features` build (see `ports.core.anyres`). It returns
   the device inputs:
     vision_tiles   [N_t, C, H, W]  the tiles the tower must see: for each image its used tiles (base first, then
                                    the grid row-major), then (OneVision) every video frame in order; zero tiles pad
                                    N_t up to `anyres.bucket` (so nearby counts share one compilation)
     vision_frames  [N_f, C, H, W]  (NeXT-Video) every video frame in order, padded the same way: their tower
                                    features are pooled on the patch grid (`spatial_pool_mode`, stride
                                    `spatial_pool_stride`) before the projector, P' = (grid // stride)^2 per frame
     vision_taps    [B, T, 4] int32 per prompt position, rows of the flat table [N_t * P projected tile features
                                    (tile-major), N_f * P' projected pooled frame features, image_newline] ...
     vision_weights [B, T, 4] f32   ... and their weights (bilinear shrinking mixes up to 4 vectors)
     vision_mask    [B, T] bool     positions of image and video placeholder tokens
     vision_tile_source [N_t + N_f] int32 which input each tile / frame came from: image i -> i, video v ->
                                    N_img + v, pad -> -1
     vision_layout  [0, k]          k identifies the layout (tower geometry, pinpoints, token ids): inputs prepared
                                    for another model's config are refused at trace time, not silently misread
2. `prompt_embeds` (inside jit) runs the tower on the tiles, selects features, projects, and writes
   sum_k w_k * table[taps_k] over the placeholder positions: one fixed-shape gather, no data-dependent shapes.
   Its `vision_features` are the tower features before the projector (and before any video pooling) per tile,
   [N_t + N_f, P, Dv]: vision_tiles then vision_frames.
"""
from __future__ import annotations

import dataclasses
import math
import zlib
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from ports.core import anyres as ANY
from ports.families import llava
from ports.core import vision as VIS

# HF's LlavaOnevisionConfig builds this tower when config.json has no vision_config (SigLIP so400m at 384 px).
_OV_VISION = {"model_type": "siglip_vision_model", "hidden_size": 1152, "intermediate_size": 4304, "patch_size": 14,
              "image_size": 384, "num_hidden_layers": 26, "num_attention_heads": 16, "vision_use_head": False}
_NEXT_PINPOINTS = ((336, 672), (672, 336), (672, 672), (1008, 336), (336, 1008))
_OV_PINPOINTS = tuple((h, w) for h in range(384, 2305, 384) for w in range(384, 2305, 384))
ARCHITECTURES = {"llava_next": "LlavaNextForConditionalGeneration",
                 "llava_next_video": "LlavaNextVideoForConditionalGeneration",
                 "llava_onevision": "LlavaOnevisionForConditionalGeneration"}
VIDEO_POOLS = ("average", "max", "conv")  # LlavaNextVideoPooler's spatial_pool_mode


@dataclasses.dataclass(frozen=True)
class LlavaNextConfig(llava.LlavaConfig):
    """A LLaVA-NeXT ("llava_next"), LLaVA-NeXT-Video ("llava_next_video") or LLaVA-OneVision ("llava_onevision")
    config."""

    grid_pinpoints: tuple[tuple[int, int], ...] = _NEXT_PINPOINTS  # (height, width) resolutions tiles can cover
    vision_aspect_ratio: str | None = None  # OneVision's "anyres_max_N"; None for LLaVA-NeXT (no shrinking)
    video_token_id: int | None = None  # OneVision, NeXT-Video
    video_pool: str | None = None  # NeXT-Video: one of VIDEO_POOLS over each frame's feature grid, before the projector
    video_pool_stride: int = 2  # NeXT-Video: the pooling window and stride

    def __post_init__(self):
        if self.model_type not in ARCHITECTURES:
            raise ValueError(f"LlavaNextConfig: model_type {self.model_type!r} is not one of {sorted(ARCHITECTURES)}")
        if self.vision_aspect_ratio is not None:
            ANY.max_tiles_of(self.vision_aspect_ratio)  # validates the spelling
        if self.next_video:
            if self.video_pool not in VIDEO_POOLS:
                raise ValueError(f"llava_next_video: spatial_pool_mode {self.video_pool!r} is not one of "
                                 f"{list(VIDEO_POOLS)}")
            if not 1 <= self.video_pool_stride <= self.vision.grid:
                raise ValueError(f"llava_next_video: spatial_pool_stride {self.video_pool_stride} must be in [1, "
                                 f"{self.vision.grid}] (the tower's {self.vision.grid} x {self.vision.grid} patch grid)")
        elif self.video_pool is not None:
            raise ValueError(f"{self.model_type} has no video pooler (video_pool={self.video_pool!r})")

    @property
    def onevision(self) -> bool:
        return self.model_type == "llava_onevision"

    @property
    def next_video(self) -> bool:
        return self.model_type == "llava_next_video"

    @property
    def frame_tokens(self) -> int:
        """Placeholder tokens one video frame takes (OneVision's bilinear halving; NeXT-Video's floor pooling)."""
        if self.next_video:
            return (self.vision.grid // self.video_pool_stride) ** 2
        return (-(-self.vision.grid // 2)) ** 2

    @property
    def max_tiles(self) -> int | None:
        return None if self.vision_aspect_ratio is None else ANY.max_tiles_of(self.vision_aspect_ratio)

    def image_taps(self, size_hw, tiled: bool = True):
        """(taps, weights) of one image's placeholder vectors (see `ports.core.anyres.image_taps`)."""
        return ANY.image_taps(size_hw, self.grid_pinpoints, self.vision.image_size, self.feature_grid, tiled,
                            self.max_tiles)

    @property
    def feature_grid(self) -> int:
        """Side of one tile's feature grid (the tower's patch grid, pooled when `image_pool` > 1)."""
        return llava.pooled_side(self.vision.grid, self.image_pool) if self.image_pool > 1 else self.vision.grid

    def num_image_tokens(self, size_hw, tiled: bool = True) -> int:
        """Placeholder tokens one image of size (h, w) takes in the prompt (what HF's processor inserts)."""
        return len(self.image_taps(size_hw, tiled)[0])

    def num_video_tokens(self, frames: int) -> int:
        """Placeholder tokens one video of `frames` frames takes (OneVision ends it with a newline vector)."""
        return frames * self.frame_tokens + (0 if self.next_video else 1)


def config_from_hf(d: dict) -> LlavaNextConfig:
    """Parse an HF `LlavaNextConfig` / `LlavaNextVideoConfig` / `LlavaOnevisionConfig` dict (defaults as those
    classes have them)."""
    mt = d.get("model_type")
    if mt not in ARCHITECTURES:
        raise ValueError(f"llava_next.config_from_hf: model_type {mt!r} is not one of {sorted(ARCHITECTURES)}")
    ov, nv = mt == "llava_onevision", mt == "llava_next_video"
    if ov:
        fields = llava.config_fields_from_hf(d, vision_default=_OV_VISION, text_type="qwen2", feature_layer=-1,
                                             strategy="full", image_token=151646)
    else:
        fields = llava.config_fields_from_hf(d, tie_from_text=nv, image_token=32001 if nv else 32000)
    pins = d.get("image_grid_pinpoints") or (_OV_PINPOINTS if ov else _NEXT_PINPOINTS)
    video = {}
    if ov or nv:
        video["video_token_id"] = int(d.get("video_token_id", d.get("video_token_index", 151647 if ov else 32000)))
    if nv:
        video.update(video_pool=d.get("spatial_pool_mode", "average"),
                     video_pool_stride=int(d.get("spatial_pool_stride", 2)))
    return LlavaNextConfig(**fields, grid_pinpoints=tuple((int(h), int(w)) for h, w in pins),
                           vision_aspect_ratio=d.get("vision_aspect_ratio", "anyres_max_9") if ov else None, **video)


def config_to_hf(cfg: LlavaNextConfig) -> dict:
    out = llava.config_to_hf(cfg)
    out["architectures"] = [ARCHITECTURES[cfg.model_type]]
    out["image_grid_pinpoints"] = [list(p) for p in cfg.grid_pinpoints]
    if cfg.onevision:
        out.pop("image_seq_length")
        out.update(vision_aspect_ratio=cfg.vision_aspect_ratio, video_token_index=cfg.video_token_id)
    if cfg.next_video:
        out.update(video_token_index=cfg.video_token_id, spatial_pool_mode=cfg.video_pool,
                   spatial_pool_stride=cfg.video_pool_stride)
    return out


def param_shapes(cfg: LlavaNextConfig) -> dict:
    """LLaVA's params, `image_newline` [D] and (NeXT-Video, spatial_pool_mode "conv") the pooler's kernel
    `video_pool` {"w": [Dv, s, s, Dv], "b": [Dv]}."""
    out = {**llava.param_shapes(cfg), "image_newline": (cfg.text.hidden_size,)}
    if cfg.video_pool == "conv":
        dv, s = cfg.vision.hidden_size, cfg.video_pool_stride
        out["video_pool"] = {"w": (dv, s, s, dv), "b": (dv,)}
    return out


def init_params(cfg: LlavaNextConfig, key: jax.Array, dtype=jnp.float32, std: float = 0.02) -> dict:
    """Random params; image_newline ~ normal(0, 1/sqrt(D)) as HF initialises it."""
    k1, k2 = jax.random.split(key)
    k3 = jax.random.fold_in(key, 3)
    d = cfg.text.hidden_size
    newline = (jax.random.normal(k2, (d,), jnp.float32) / math.sqrt(d)).astype(dtype)
    out = {**llava.init_params(cfg, k1, dtype, std), "image_newline": newline}
    if cfg.video_pool == "conv":
        shapes = param_shapes(cfg)["video_pool"]
        out["video_pool"] = {"w": (std * jax.random.normal(k3, shapes["w"], jnp.float32)).astype(dtype),
                             "b": jnp.zeros(shapes["b"], dtype)}
    return out


def hf_key_map(cfg: LlavaNextConfig):
    """LLaVA's rows (the transformers-5 on-disk layout) plus `image_newline` (and a conv video pooler)."""
    rows = llava.hf_key_map(cfg) + [("image_newline", ("image_newline",), None)]
    if cfg.video_pool == "conv":
        rows += [("model.vision_resampler.pool.weight", ("video_pool", "w"), "conv"),  # as transformers 5 writes it
                 ("model.vision_resampler.pool.bias", ("video_pool", "b"), None)]
    return rows


def rename_hf_key(name: str) -> str:
    """Any accepted checkpoint name (transformers-5 on disk / in memory, older hub) -> the `hf_key_map` name."""
    if name == "model.image_newline":
        return "image_newline"
    if name.startswith("vision_resampler."):
        return "model." + name
    return llava.rename_hf_key(name)


IGNORED_HF_KEYS = llava.IGNORED_HF_KEYS

# ------------------------------------------------------------------------------------------- host-side layout

RAW_KEYS = ("pixel_values", "image_sizes", "batch_num_images", "pixel_values_videos")
PREPARED_KEYS = ("vision_tiles", "vision_frames", "vision_taps", "vision_weights", "vision_mask", "vision_tile_source",
                 "vision_layout")


def raw_keys(cfg: LlavaNextConfig) -> tuple[str, ...]:
    """The processor outputs this model reads."""
    if cfg.onevision:
        return RAW_KEYS
    return ("pixel_values", "image_sizes") + (("pixel_values_videos",) if cfg.next_video else ())


def layout_key(cfg: LlavaNextConfig) -> int:
    """A small int naming everything the prepared layout depends on (see `vision_layout`)."""
    sig = (cfg.model_type, cfg.vision.image_size, cfg.vision.patch_size, cfg.tokens_per_image, cfg.grid_pinpoints,
           cfg.vision_aspect_ratio, cfg.image_token_id, cfg.video_token_id)
    if cfg.next_video:
        sig += (cfg.video_pool, cfg.video_pool_stride)
    return zlib.crc32(repr(sig).encode()) % 65521 + 1


def _pixels(cfg, arr, name: str, what: str) -> np.ndarray:
    arr = np.asarray(arr)
    c, s = cfg.vision.num_channels, cfg.vision.image_size
    if arr.ndim < 3 or arr.shape[-3:] != (c, s, s):
        raise ValueError(f"{name} has shape {arr.shape}; the {cfg.vision.model_type} tower expects {what} with "
                         f"tiles of ({c}, {s}, {s}) (num_channels={c}, image_size={s})")
    return arr


def _check_square_tiles(cfg):
    g, P = cfg.feature_grid, cfg.tokens_per_image
    if P != g * g:
        raise ValueError(f"{cfg.model_type}: anyres needs {g} x {g} = {g * g} features per tile, but the "
                         f"{cfg.vision.model_type} tower with vision_feature_select_strategy="
                         f"{cfg.feature_strategy!r} gives {P}")


def _images(cfg: LlavaNextConfig, inputs: Mapping[str, Any], n_tok: int):
    """(tiles [n, C, H, W], taps [m, 4] into the tiles' features or NEWLINE, weights [m, 4], tiles per image)."""
    pv, sizes, per_row = inputs.get("pixel_values"), inputs.get("image_sizes"), inputs.get("batch_num_images")
    if pv is None:
        if sizes is not None or per_row is not None:
            raise ValueError("image_sizes / batch_num_images given without pixel_values")
        if n_tok:
            raise ValueError(f"prompt has {n_tok} image tokens (id {cfg.image_token_id}) but no pixel_values")
        return [], [], [], []
    pv = _pixels(cfg, pv, "pixel_values", "(num_images, num_tiles, C, H, W) or (total_tiles, C, H, W)")
    if pv.ndim not in (4, 5):
        raise ValueError(f"pixel_values has shape {pv.shape}: expected 5 dims (num_images, num_tiles, C, H, W) "
                         "or 4 (total_tiles, C, H, W)")
    if sizes is None:
        raise ValueError(f"{cfg.model_type} needs image_sizes [num_images, 2] (the processor returns it) "
                         "with pixel_values")
    sizes = np.asarray(sizes)
    if sizes.ndim != 2 or sizes.shape[1] != 2 or (pv.ndim == 5 and sizes.shape[0] != pv.shape[0]):
        raise ValueError(f"image_sizes has shape {sizes.shape}, expected ({pv.shape[0] if pv.ndim == 5 else 'N'}, "
                         f"2): one (height, width) per image of pixel_values {pv.shape}")
    if np.any(sizes < 1):
        raise ValueError(f"image_sizes must be positive (height, width) pairs, got {sizes.tolist()}")
    n_img = sizes.shape[0]
    tiled = [True] * n_img
    if per_row is not None:
        per_row = np.asarray(per_row).reshape(-1)
        if per_row.sum() != n_img or np.any(per_row < 0):
            raise ValueError(f"batch_num_images {per_row.tolist()} does not add up to the {n_img} images")
        tiled = [int(n) == 1 for n in per_row for _ in range(int(n))]  # HF tiles only a row's single image
    _check_square_tiles(cfg)
    tiles, taps, weights, counts = [], [], [], []
    start = 0
    for i, (hw, t) in enumerate(zip(sizes.tolist(), tiled)):
        n = ANY.num_tiles(hw, cfg.grid_pinpoints, cfg.vision.image_size) if t else 1
        if t:
            rows, cols = ANY.tile_grid(hw, cfg.grid_pinpoints, cfg.vision.image_size)
            if rows * cols != n - 1:
                raise ValueError(f"image_grid_pinpoints {list(cfg.grid_pinpoints)} must be multiples of the tower's "
                                 f"image_size {cfg.vision.image_size}")
        if pv.ndim == 5:
            if n > pv.shape[1]:
                raise ValueError(f"image {i} of size {tuple(hw)} needs {n} tiles (base + grid for "
                                 f"image_grid_pinpoints), but pixel_values {pv.shape} holds {pv.shape[1]} per image")
            tiles.append(pv[i, :n])
        else:
            if start + n > pv.shape[0]:
                raise ValueError(f"image_sizes {sizes.tolist()} need more tiles than pixel_values {pv.shape} holds")
            tiles.append(pv[start:start + n])
            start += n
        tp, w = cfg.image_taps(hw, t)
        taps.append(tp)
        weights.append(w)
        counts.append(len(tp))
    if pv.ndim == 4 and start != pv.shape[0]:
        raise ValueError(f"pixel_values holds {pv.shape[0]} tiles but image_sizes {sizes.tolist()} use {start}")
    if n_tok != sum(counts):
        raise ValueError(f"prompt has {n_tok} image tokens (id {cfg.image_token_id}) but the {n_img} image(s) of "
                         f"sizes {sizes.tolist()} take {' + '.join(map(str, counts))}"
                         f"{f' = {sum(counts)}' if len(counts) > 1 else ''}; build the prompt with the model's "
                         f"processor")
    return tiles, taps, weights, [len(t) for t in tiles]


def _videos(cfg: LlavaNextConfig, inputs: Mapping[str, Any], n_tok: int):
    """(frames per video, taps [m, 4] into the video's frame features or NEWLINE, weights [m, 4], frame counts).
    OneVision's taps index the frames' tower features (P per frame, shrunk bilinearly); NeXT-Video's index the
    pooled ones (P' per frame, one tap each)."""
    pvv = inputs.get("pixel_values_videos")
    if pvv is None:
        if n_tok:
            raise ValueError(f"prompt has {n_tok} video tokens (id {cfg.video_token_id}) but no pixel_values_videos")
        return [], [], [], []
    if cfg.image_pool > 1:
        raise ValueError(f"{cfg.model_type} with pooled image features (image_pool={cfg.image_pool}) reads images, "
                         "not videos")
    pvv = _pixels(cfg, pvv, "pixel_values_videos", "(num_videos, frames, C, H, W)")
    if pvv.ndim != 5:
        raise ValueError(f"pixel_values_videos has shape {pvv.shape}: expected (num_videos, frames, C, H, W)")
    _check_square_tiles(cfg)
    frames = pvv.shape[1]
    if cfg.next_video:
        taps, weights = zip(*[ANY.identity_taps(np.arange(frames * cfg.frame_tokens)) for _ in range(pvv.shape[0])])
    else:
        taps, weights = zip(*[ANY.video_taps(frames, cfg.vision.grid) for _ in range(pvv.shape[0])])
    want = pvv.shape[0] * cfg.num_video_tokens(frames)
    if n_tok != want:
        raise ValueError(f"prompt has {n_tok} video tokens (id {cfg.video_token_id}) but {pvv.shape[0]} video(s) "
                         f"of {frames} frames take {want}; build the prompt with the model's processor")
    return list(pvv), list(taps), list(weights), [frames] * pvv.shape[0]


def prepare_inputs(cfg: LlavaNextConfig, tokens: np.ndarray, lengths: np.ndarray, inputs: Mapping[str, Any]) -> dict:
    """Host-side checks and layout (see the module docstring): processor output -> device inputs."""
    allowed = raw_keys(cfg)
    unknown = sorted(set(inputs) - set(allowed))
    if unknown:
        raise ValueError(f"{cfg.model_type} takes {list(allowed)}; got unsupported {unknown}")
    tokens = np.asarray(tokens)
    B, T = tokens.shape
    valid = np.arange(T)[None, :] < np.asarray(lengths).reshape(B, 1)
    img_pos = valid & (tokens == cfg.image_token_id)
    vid_pos = valid & (tokens == cfg.video_token_id) if cfg.video_token_id is not None else np.zeros_like(valid)
    i_tiles, i_taps, i_w, i_n = _images(cfg, inputs, int(img_pos.sum()))
    v_tiles, v_taps, v_w, v_n = _videos(cfg, inputs, int(vid_pos.sum()))
    if not i_tiles and not v_tiles:
        return {}
    # OneVision's frames are tiles like any other; NeXT-Video's go to a section of their own, pooled before projecting
    tile_n, frame_n = (i_n, v_n) if cfg.next_video else (i_n + v_n, [])
    P, Pf = cfg.tokens_per_image, cfg.frame_tokens
    n_pad = ANY.bucket(sum(tile_n)) if tile_n else 0
    f_pad = ANY.bucket(sum(frame_n)) if frame_n else 0
    newline_row = n_pad * P + f_pad * Pf
    taps = np.zeros((B, T, ANY.TAPS), np.int32)
    weights = np.zeros((B, T, ANY.TAPS), np.float32)
    source = np.full(n_pad + f_pad, -1, np.int32)
    tile_at = 0  # next tile / frame slot of its section
    for pos, tp_list, w_list, ns, first, video in ((img_pos, i_taps, i_w, i_n, 0, False),
                                                   (vid_pos, v_taps, v_w, v_n, len(i_n), True)):
        if not tp_list:
            continue
        base, per, slot = (0, P, 0)
        if video and cfg.next_video:  # the frames section
            base, per, slot, tile_at = n_pad * P, Pf, n_pad, 0
        glob = []
        for j, (tp, n) in enumerate(zip(tp_list, ns)):
            glob.append(np.where(tp == ANY.NEWLINE, newline_row, base + tp + tile_at * per))
            source[slot + tile_at:slot + tile_at + n] = first + j
            tile_at += n
        taps[pos] = np.concatenate(glob)
        weights[pos] = np.concatenate(w_list)
    c, s = cfg.vision.num_channels, cfg.vision.image_size
    out = {"vision_taps": taps, "vision_weights": weights, "vision_mask": img_pos | vid_pos,
           "vision_tile_source": source, "vision_layout": np.zeros((0, layout_key(cfg)), np.int8)}
    for key, arrays, pad in (("vision_tiles", i_tiles if cfg.next_video else i_tiles + v_tiles, n_pad),
                             ("vision_frames", v_tiles if cfg.next_video else [], f_pad)):
        if pad:
            stacked = np.concatenate([np.asarray(t, np.float32).reshape(-1, c, s, s) for t in arrays])
            out[key] = np.concatenate([stacked, np.zeros((pad - len(stacked), c, s, s), np.float32)])
    return out


def pool_frames(cfg: LlavaNextConfig, params: dict, feats: jax.Array) -> jax.Array:
    """NeXT-Video's `vision_resampler`: frame features [N, g * g, Dv] (row-major patch grid) -> [N, o * o, Dv],
    o = g // stride, by stride x stride windows (average, max, or the conv kernel); a grid that stride does not
    divide loses its last rows and columns, as torch's pooling does."""
    n, _, d = feats.shape
    g, s = cfg.vision.grid, cfg.video_pool_stride
    o = g // s
    x = feats.reshape(n, g, g, d)[:, :o * s, :o * s].reshape(n, o, s, o, s, d)
    if cfg.video_pool == "average":
        y = x.astype(jnp.float32).mean(axis=(2, 4)).astype(feats.dtype)
    elif cfg.video_pool == "max":
        y = x.max(axis=(2, 4))
    else:
        w = params["video_pool"]
        y = jnp.einsum("najbkd,djko->nabo", x, w["w"].astype(x.dtype)) + w["b"].astype(x.dtype)
    return y.reshape(n, o * o, y.shape[-1])


def prompt_embeds(cfg: LlavaNextConfig, params: dict, tokens: jax.Array,
                  inputs: Mapping[str, jax.Array]) -> llava.PromptEmbeds:
    """Prompt embeddings [B, T, D] with every image / video placeholder replaced by its packed feature vector.
    `inputs` is `prepare_inputs`' output (empty: text only)."""
    x = llava.embed(cfg, params, tokens)
    if "vision_taps" not in inputs:
        raw = sorted(set(inputs) & set(RAW_KEYS))
        if raw:
            raise ValueError(f"{cfg.model_type}: prompt_embeds takes the output of its prepare_inputs, got raw "
                             f"{raw} (inputs prepared for another model? for a draft: pass draft_prompt=)")
        return llava.PromptEmbeds(x, jnp.zeros(tokens.shape, bool),
                                  jnp.zeros((0, cfg.tokens_per_image, cfg.projector.in_dim), x.dtype))
    if inputs["vision_layout"].shape != (0, layout_key(cfg)):
        raise ValueError(f"these vision inputs were prepared for another model's layout (tower geometry, "
                         f"image_grid_pinpoints or token ids differ from this {cfg.model_type}); run this model's "
                         f"prepare_inputs on the processor output (for a draft: pass draft_prompt=)")
    if inputs["vision_taps"].shape[:2] != tokens.shape:
        raise ValueError(f"vision_taps {inputs['vision_taps'].shape} were prepared for prompts of shape "
                         f"{inputs['vision_taps'].shape[:2]}, not {tokens.shape}")
    feats, rows = [], []
    if "vision_tiles" in inputs:
        f, proj = llava.image_features(cfg, params, inputs["vision_tiles"].astype(x.dtype))
        feats.append(f)
        rows.append(proj.reshape(-1, proj.shape[-1]))
    if "vision_frames" in inputs:
        f = VIS.image_features(cfg.vision, params["vision"], inputs["vision_frames"].astype(x.dtype), cfg.feature_layer,
                              cfg.feature_strategy)
        feats.append(f)
        proj = VIS.projector_forward(params["projector"], pool_frames(cfg, params, f), cfg.projector.act)
        rows.append(proj.reshape(-1, proj.shape[-1]))
    table = jnp.concatenate(rows + [params["image_newline"][None].astype(rows[0].dtype)])
    taps, w = inputs["vision_taps"], inputs["vision_weights"].astype(jnp.float32)
    packed = sum(w[..., k, None] * jnp.take(table, taps[..., k], axis=0).astype(jnp.float32) for k in range(ANY.TAPS))
    mask = inputs["vision_mask"]
    return llava.PromptEmbeds(jnp.where(mask[..., None], packed.astype(x.dtype), x), mask,
                              jnp.concatenate(feats) if len(feats) > 1 else feats[0])


def compact_prompt(cfg: LlavaNextConfig, tokens: jax.Array, inputs: Mapping[str, jax.Array], idx: jax.Array,
                   lengths: jax.Array, new_lengths: jax.Array, positions: str = "renumbered") -> dict:
    """Prepared inputs of a [B, T] prompt -> those of the [B, D] prompt made of the positions idx [B, D]
    (ascending, -1 past each row's new_lengths[b]); the tiles stay whole. LLaVA positions are the sequence index,
    so the pruned prompt is renumbered (0..D-1, SpecVLM's reading); "original" ids need a model that takes
    explicit positions (Qwen2-VL's M-RoPE)."""
    if positions != "renumbered":
        raise ValueError(f"{cfg.model_type} numbers a prompt's positions by sequence index: a pruned prompt can only "
                         f"be renumbered (positions='renumbered'), got {positions!r}")
    on = idx >= 0
    at = jnp.maximum(idx, 0)
    out = dict(inputs)
    for key, fill in (("vision_taps", 0), ("vision_weights", 0.0), ("vision_mask", False)):
        x = inputs[key]
        shape = at.shape + (1,) * (x.ndim - 2)
        out[key] = jnp.where(on.reshape(shape), jnp.take_along_axis(x, at.reshape(shape), axis=1), fill)
    return out
