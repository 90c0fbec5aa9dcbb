"""LLaVA-NeXT / OneVision "anyres" geometry, on the host (numpy, Python ints), as transformers 5 computes it.

An image of size (h, w) is cut by the processor into a base tile (the whole image resized) plus a grid of tiles
covering the best "pinpoint" resolution; each tile goes through the vision tower and the projector, giving
grid x grid feature vectors per tile. HF's `pack_image_features` then lays the tiles' features out as one big
(rows * grid) x (cols * grid) map, crops the padding the processor added (`unpad`), optionally (OneVision,
"anyres_max_N") shrinks it bilinearly when it holds too many vectors, and appends `image_newline` after each row;
the base tile's vectors come first. Videos (OneVision): each frame's grid x grid map is shrunk bilinearly to
ceil(grid/2) x ceil(grid/2), frames are concatenated and one `image_newline` ends the video.

Every placeholder vector is therefore a fixed linear combination of at most 4 projected tile features (or the
newline). This module computes those combinations as "taps": `idx [n, 4]` (row of the flat feature table, or
`NEWLINE`) and `w [n, 4]` weights, so that the device does one fixed-shape gather (see `ports.families.llava_next`).
Bilinear weights follow torch `F.interpolate(mode="bilinear", align_corners=False)` without antialiasing, in
float32 as torch's CPU kernel does.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

NEWLINE = -1  # tap index standing for the image_newline vector
TAPS = 4  # bilinear: at most 2 x 2 source vectors per output vector


def select_best_resolution(size_hw: Sequence[int], pinpoints: Sequence[Sequence[int]]) -> tuple[int, int]:
    """The pinpoint (height, width) that keeps the most of the image's resolution, then wastes the least
    (transformers' `select_best_resolution`; ties keep the first)."""
    oh, ow = int(size_hw[0]), int(size_hw[1])
    best, best_eff, best_waste = None, 0, float("inf")
    for h, w in pinpoints:
        scale = min(w / ow, h / oh)
        eff = min(int(ow * scale) * int(oh * scale), ow * oh)
        waste = w * h - eff
        if eff > best_eff or (eff == best_eff and waste < best_waste):
            best, best_eff, best_waste = (int(h), int(w)), eff, waste
    if best is None:
        raise ValueError(f"no image_grid_pinpoints fit an image of size {tuple(size_hw)}: {list(pinpoints)}")
    return best


def num_tiles(size_hw, pinpoints, tile: int) -> int:
    """Tiles the processor makes for one image: the base tile + ceil(H / tile) * ceil(W / tile) for the best
    pinpoint (H, W) (HF's `image_size_to_num_patches`)."""
    h, w = select_best_resolution(size_hw, pinpoints)
    return 1 + (-(-h // tile)) * (-(-w // tile))


def tile_grid(size_hw, pinpoints, tile: int) -> tuple[int, int]:
    """(rows, cols) of the tile grid (HF's `get_anyres_image_grid_shape`: best pinpoint // tile size)."""
    h, w = select_best_resolution(size_hw, pinpoints)
    return h // tile, w // tile


def unpad_box(size_hw, cur_h: int, cur_w: int) -> tuple[int, int, int, int]:
    """(r0, r1, c0, c1): the part of a cur_h x cur_w feature map that holds the image of original size (h, w),
    without the letterbox padding (HF's `unpad_image`, same float arithmetic)."""
    oh, ow = int(size_hw[0]), int(size_hw[1])
    if ow / oh > cur_w / cur_h:
        new_h = int(round(oh * (cur_w / ow), 7))
        pad = (cur_h - new_h) // 2
        return pad, cur_h - pad, 0, cur_w
    new_w = int(round(ow * (cur_h / oh), 7))
    pad = (cur_w - new_w) // 2
    return 0, cur_h, pad, cur_w - pad


def max_tiles_of(vision_aspect_ratio: str) -> int:
    """N of OneVision's "anyres_max_N" (HF strips the characters of "anyres_max_" from both ends)."""
    s = vision_aspect_ratio.strip("anyres_max_")
    if not s.isdigit():
        raise ValueError(f"vision_aspect_ratio {vision_aspect_ratio!r}: expected 'anyres_max_N'")
    return int(s)


def downsampled_shape(h: int, w: int, grid: int, max_tiles: int) -> tuple[int, int]:
    """OneVision: an h x w map of more than ~1.1^2 * max_tiles tiles' worth of vectors shrinks to
    (int(h // r), int(w // r)), r = sqrt(h * w / (max_tiles * grid^2)); otherwise it stays h x w."""
    ratio = math.sqrt(h * w / (max_tiles * grid ** 2))
    if ratio > 1.1:
        h, w = int(h // ratio), int(w // ratio)
        if h < 1 or w < 1:
            raise ValueError(f"anyres_max_{max_tiles} would shrink a feature map to {h} x {w} (empty)")
    return h, w


def linear_taps(n_in: int, n_out: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """1-D linear interpolation n_in -> n_out as torch's CPU upsample kernel does (align_corners=False, scale
    in / out, float32): (i0, i1, w0, w1), each [n_out]."""
    dst = np.arange(n_out)
    if n_in == n_out:
        return dst, dst, np.ones(n_out, np.float32), np.zeros(n_out, np.float32)
    scale = np.float32(n_in) / np.float32(n_out)
    src = scale * (dst.astype(np.float32) + np.float32(0.5)) - np.float32(0.5)
    src = np.maximum(src, np.float32(0))
    i0 = np.minimum(np.floor(src).astype(np.int64), n_in - 1)
    w1 = np.clip(src - i0.astype(np.float32), np.float32(0), np.float32(1)).astype(np.float32)
    i1 = i0 + (i0 < n_in - 1)
    return i0, i1, (np.float32(1) - w1).astype(np.float32), w1


def resize_taps(h: int, w: int, oh: int, ow: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Bilinear h x w -> oh x ow: (rows [oh, ow, 4], cols [oh, ow, 4], weights [oh, ow, 4] float32) of the
    source vectors of each output vector."""
    r0, r1, a0, a1 = linear_taps(h, oh)
    c0, c1, b0, b1 = linear_taps(w, ow)
    R = np.stack(np.broadcast_arrays(r0[:, None], r0[:, None], r1[:, None], r1[:, None]), -1)
    C = np.stack(np.broadcast_arrays(c0[None], c1[None], c0[None], c1[None]), -1)
    W = np.stack([a0[:, None] * b0[None], a0[:, None] * b1[None], a1[:, None] * b0[None], a1[:, None] * b1[None]], -1)
    R, C = np.broadcast_to(R, (oh, ow, TAPS)), np.broadcast_to(C, (oh, ow, TAPS))
    return R, C, W.astype(np.float32)


def identity_taps(idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Taps that copy vectors idx [n] as they are."""
    taps = np.zeros((idx.size, TAPS), np.int64)
    taps[:, 0] = idx
    w = np.zeros((idx.size, TAPS), np.float32)
    w[:, 0] = 1
    return taps, w


def _with_newlines(taps: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[rows, cols, 4] taps -> [rows * (cols + 1), 4]: a newline after every row."""
    rows = taps.shape[0]
    nl, nlw = identity_taps(np.full(rows, NEWLINE))
    taps = np.concatenate([taps, nl[:, None]], axis=1).reshape(-1, TAPS)
    w = np.concatenate([w, nlw[:, None]], axis=1).reshape(-1, TAPS)
    return taps, w


def image_taps(size_hw, pinpoints, tile: int, grid: int, tiled: bool = True,
               max_tiles: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Taps of one image's placeholder vectors, in prompt order: idx [n, 4] into the image's own tile features
    (tile t, vector f of its grid x grid map -> t * grid^2 + f; tile 0 is the base) or NEWLINE, w [n, 4].

    tiled=False (OneVision images of a multi-image prompt row): the base tile's vectors and one newline.
    max_tiles: OneVision's anyres_max_N (None: LLaVA-NeXT, no shrinking).
    """
    P = grid * grid
    base_idx, base_w = identity_taps(np.arange(P))
    if not tiled:
        nl, nlw = identity_taps(np.array([NEWLINE]))
        return np.concatenate([base_idx, nl]), np.concatenate([base_w, nlw])
    rows, cols = tile_grid(size_hw, pinpoints, tile)
    r0, r1, c0, c1 = unpad_box(size_hw, rows * grid, cols * grid)
    h, w = r1 - r0, c1 - c0
    oh, ow = (h, w) if max_tiles is None else downsampled_shape(h, w, grid, max_tiles)
    R, C, W = resize_taps(h, w, oh, ow)
    R, C = R + r0, C + c0  # coordinates in the full rows*grid x cols*grid map
    idx = (1 + (R // grid) * cols + (C // grid)) * P + (R % grid) * grid + (C % grid)
    idx, W = _with_newlines(idx, W)
    return np.concatenate([base_idx, idx]), np.concatenate([base_w, W])


def video_taps(frames: int, grid: int) -> tuple[np.ndarray, np.ndarray]:
    """Taps of one video's placeholder vectors (OneVision): each frame's grid x grid map shrunk bilinearly to
    ceil(grid/2) squared, frames in order, then one newline. idx into the video's frame features (frame f,
    vector v -> f * grid^2 + v)."""
    g2 = -(-grid // 2)
    R, C, W = resize_taps(grid, grid, g2, g2)
    one = (R * grid + C).reshape(-1, TAPS)
    idx = np.concatenate([one + f * grid * grid for f in range(frames)])
    w = np.tile(W.reshape(-1, TAPS), (frames, 1))
    nl, nlw = identity_taps(np.array([NEWLINE]))
    return np.concatenate([idx, nl]), np.concatenate([w, nlw])


def bucket(n: int) -> int:
    """n rounded up to one of ~4 sizes per octave (1..8 exact, then multiples of 2^(floor(log2 n) - 2)), so that
    padded tile batches waste at most a quarter and nearby counts share one compilation."""
    if n <= 8:
        return max(n, 1)
    step = 1 << (n.bit_length() - 3)
    return -(-n // step) * step
