"""Video clips of the synthetic world, their tasks, and the Qwen2.5-VL-style inputs of the zoo's video pair.

A clip (`Clip`) is a shapes scene over time: `FRAMES` frames of `FRAME_SIZE` px, t from 0 to 1. Each object (`Track`)
is a `world.Obj` on the 3x3 grid that stays still, moves in a straight line to another cell (1 or 2 cells in one of 8
directions, during an interval), appears at some time or leaves at some time. Every event happens between 6/32 and
28/32 of the clip, on the boundaries of the 32 temporal patch groups, so the first and last groups show the start
and end states. (colour, shape) pairs are unique in a clip, so "the red circle" names one object.

Tasks (scenario "video"; a registry of their own, `TASKS`: the image world's registry, task lists and example
streams are untouched, so no shipped model's data changes):
    video_move      where a shape moves to / starts from, which way it moves, which shape moves, from where to where,
                    whether a given shape (or any) moves
    video_appear    which shape appears / disappears, where, whether any does
    video_count     how many shapes (of a colour) at the start / end, how many appear, leave, move
    video_describe  a detailed description of the clip (60-125 tokens), for speculative-decoding measurements
Answers are short ("bottom right", "3", "red circle", "yes") unless the question asks for a full sentence, as in
the image world. The first three are the video QA tasks (`QA_TASKS`) whose exact match the target is held to.
Splits: a clip is held out by the hash of its content (`Clip.key`: objects, start and end cells, which appear or
leave; event times excluded, so the same story at other times stays in the same split), 1 in 8.

Tokens and ids (the zoo tokenizer, unchanged; Qwen2.5-VL's config ids mapped onto it):
    video_token_id        3  ('<image>', the zoo's visual placeholder): a clip is FRAMES/2 x 9 = 288 of them
    image_token_id        the byte-level token of byte 0xFF, which no UTF-8 text contains (the video pair shows
                          no still images, but Qwen2.5-VL needs an image id distinct from the video id)
    vision_start_token_id 4  ('<|user|>': the clip opens every user turn that shows one)
    vision_end_token_id   the id of '\\n' (the newline that closes the clip, as '<image>\\n' does an image)
Neither transformers 5 nor our port reads the start / end ids (both find the clip by its video-token run and
`mm_token_type_ids`); they are set so the config says where a clip sits.

A prompt: <s><|user|>[288 video tokens]\\n{question}<|assistant|>  ->  {answer}</s>
Geometry: 48 px frames, 8 px patches, 2x2 merge: one merged token per grid cell and temporal patch group (two
frames), 9 per group; 64 frames at 4 fps (second_per_grid_ts 0.5, tokens_per_second 2: temporal ids 0..31). Each
frame has a 1 px dark border: Qwen2.5-VL's tower has only relative (rotary) positions, and without a border a cell's
patches can tell where they are only from edge effects (a small tower, width 64 and 2 blocks, pretrained on
`tower_labels` learnt the rows or the columns, never both, in 300-450 steps; with the border both within 300).

    ex = example("heldout", 3)                        # a VideoExample: ex.clip, ex.question, ex.answer
    frames = render_clip(ex.clip)                     # uint8 [64, 48, 48, 3]
    enc = VideoEncoder()
    prompt = enc.prompts([ex])                        # input_ids, attention_mask, pixel_values_videos,
                                                      # video_grid_thw, second_per_grid_ts, mm_token_type_ids
    jspec.decode(target, prompt)                      # or ports.logits(target, prompt)
    enc.prompts([ex], variant="shuffled")             # the clip's frames shuffled ("blank": no shapes at all)
    for batch in batches("train", 32, 512): ...       # training rows: one clip, several QA segments (below)
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import math
import os
import random
import time
from typing import Callable, Iterable, Iterator, NamedTuple, Sequence

import numpy as np
from PIL import Image, ImageDraw

from jspec.tools.zoo import tokenizer as TK
from jspec.tools.zoo import world as ZW

# ---------------------------------------------------------------------------------------------------- geometry

FRAMES = 64
FRAME_SIZE = 48
PATCH = 8
MERGE = 2
TEMPORAL_PATCH = 2
GROUPS = FRAMES // TEMPORAL_PATCH                      # temporal patch groups (32)
GRID_PATCHES = FRAME_SIZE // PATCH                     # patches per side (6)
CELLS = ZW.GRID ** 2
TOKENS_PER_GROUP = (GRID_PATCHES // MERGE) ** 2        # 9: one merged token per grid cell
VIDEO_TOKENS = GROUPS * TOKENS_PER_GROUP               # 288
PATCH_DIM = 3 * TEMPORAL_PATCH * PATCH * PATCH          # 384
SECONDS_PER_GROUP = 0.5                                # 4 fps
TOKENS_PER_SECOND = 2                                  # temporal M-RoPE ids: 2 * 0.5 = 1 per group
SUPERSAMPLE = 4
BORDER = ZW.AXIS                                        # a 1 px frame around every frame (drawn over the shapes):
                                                       # Qwen's tower has no absolute positions, and the border
                                                       # tells each cell's patches where they are
EVENT_FIRST, EVENT_LAST = 6, 28                        # events happen within groups 6..28 of 32
SCENARIO = "video"
SPLITS = ZW.SPLITS
HELDOUT_EVERY = ZW.HELDOUT_EVERY

# token ids (see the module docstring)
VIDEO_ID = TK.IMAGE_ID
VISION_START_ID = TK.USER_ID
PREFIX_VIDEO_START = 2                                 # <s><|user|> then the clip
PREFIX_LEN = PREFIX_VIDEO_START + VIDEO_TOKENS + 1     # ... then '\n'
MEAN = np.array([0.48145466, 0.4578275, 0.40821073], np.float32)   # OpenAI CLIP, as Qwen2-VL's processors
STD = np.array([0.26862954, 0.26130258, 0.27577711], np.float32)
_LUT = ((np.arange(256, dtype=np.float32)[None, :] / np.float32(255.0)) - MEAN[:, None]) / STD[:, None]


@functools.lru_cache(maxsize=None)
def special_ids() -> dict[str, int]:
    """The Qwen2.5-VL config ids on the zoo tokenizer (module docstring)."""
    tok = TK.load_tokenizer().backend_tokenizer
    byte_ff = tok.token_to_id("\u00ff")            # byte-level alphabet: byte 0xFF is the character U+00FF
    newline = tok.encode("\n", add_special_tokens=False).ids
    if byte_ff is None or len(newline) != 1:
        raise RuntimeError("the zoo tokenizer lacks the byte token 0xFF or a single-token newline")
    return {"video_token_id": VIDEO_ID, "image_token_id": byte_ff, "vision_start_token_id": VISION_START_ID,
            "vision_end_token_id": newline[0]}


# ------------------------------------------------------------------------------------------------------ clips

DIRECTIONS = {(-1, 0): "up", (1, 0): "down", (0, -1): "left", (0, 1): "right", (-1, -1): "up and left",
              (-1, 1): "up and right", (1, -1): "down and left", (1, 1): "down and right"}
DIRECTION_IDS = {d: i + 1 for i, d in enumerate(DIRECTIONS)}   # tower labels: 0 = not moving


@dataclasses.dataclass(frozen=True)
class Track:
    """One object of a clip. `obj` holds its shape, colour, size and start cell; it moves to `end` during groups
    move[0] .. move[1] (None: it stays), appears at the start of group `appear` (None: there from the start) or
    leaves at the start of group `leave` (None: there until the end). Times are in temporal groups (0..GROUPS)."""
    obj: ZW.Obj
    end: tuple[int, int]
    move: tuple[int, int] | None = None
    appear: int | None = None
    leave: int | None = None

    @property
    def start(self) -> tuple[int, int]:
        return (self.obj.row, self.obj.col)

    @property
    def name(self) -> str:
        return f"{self.obj.colour} {self.obj.shape}"

    @property
    def step(self) -> tuple[int, int]:
        """The unit direction of its motion ((0, 0) when still)."""
        dr, dc = self.end[0] - self.start[0], self.end[1] - self.start[1]
        return (dr > 0) - (dr < 0), (dc > 0) - (dc < 0)

    @property
    def direction(self) -> str:
        return DIRECTIONS[self.step]

    def present(self, t: float) -> bool:
        """Shown at clip time t in [0, 1]."""
        return ((self.appear is None or t >= self.appear / GROUPS) and
                (self.leave is None or t < self.leave / GROUPS))

    def progress(self, t):
        """Fraction of its motion done at time(s) t (0 before it starts, 1 after it ends)."""
        if self.move is None:
            return np.zeros_like(np.asarray(t, np.float64)) if np.ndim(t) else 0.0
        g0, g1 = self.move[0] / GROUPS, self.move[1] / GROUPS
        p = np.clip((np.asarray(t, np.float64) - g0) / (g1 - g0), 0.0, 1.0)
        return p if np.ndim(t) else float(p)

    def moving(self, t: float) -> bool:
        return self.move is not None and self.move[0] / GROUPS <= t < self.move[1] / GROUPS

    def centres(self, t, size: int = FRAME_SIZE) -> tuple[np.ndarray, np.ndarray]:
        """(x, y) pixel centres at times t [N]: `world.object_centre` of the object moved by its progress (the same
        float operations), rounded to the renderer's sub-pixel grid (1 / SUPERSAMPLE px)."""
        p = self.progress(np.atleast_1d(np.asarray(t, np.float64)))
        cell = size / ZW.GRID
        x = (self.obj.col + 0.5 + ((self.end[1] - self.start[1]) * p) * 1.0) * cell
        y = (self.obj.row + 0.5 + ((self.end[0] - self.start[0]) * p) * 1.0) * cell
        q = lambda v: np.floor(v * SUPERSAMPLE + 0.5) / SUPERSAMPLE
        return q(x), q(y)

    def centre(self, t: float, size: int = FRAME_SIZE) -> tuple[float, float]:
        """(x, y) pixel centre at time t (see `centres`)."""
        x, y = self.centres(t, size)
        return float(x[0]), float(y[0])

    def cell_at(self, t: float) -> tuple[int, int]:
        """The grid cell nearest to its centre at time t."""
        x, y = self.centre(t, 3 * ZW.GRID)                   # 3 px per cell: cell = floor(px / 3)
        return min(ZW.GRID - 1, int(y // 3)), min(ZW.GRID - 1, int(x // 3))


@dataclasses.dataclass(frozen=True)
class Clip:
    tracks: tuple[Track, ...]

    def key(self) -> str:
        """Canonical content (event times left out); equal stories have equal keys."""
        rows = sorted(f"{t.obj.shape},{t.obj.colour},{t.obj.size},{t.start},{t.end},{t.appear is not None},"
                      f"{t.leave is not None}" for t in self.tracks)
        return "clip|" + ";".join(rows)

    def split(self) -> str:
        h = int.from_bytes(hashlib.blake2b(self.key().encode(), digest_size=8).digest(), "little")
        return "heldout" if h % HELDOUT_EVERY == 0 else "train"

    @property
    def at_start(self) -> list[Track]:
        return sorted((t for t in self.tracks if t.appear is None), key=lambda t: t.start)

    @property
    def at_end(self) -> list[Track]:
        return sorted((t for t in self.tracks if t.leave is None), key=lambda t: t.end)

    @property
    def movers(self) -> list[Track]:
        return [t for t in self.tracks if t.move is not None]

    @property
    def appearing(self) -> list[Track]:
        return [t for t in self.tracks if t.appear is not None]

    @property
    def leaving(self) -> list[Track]:
        return [t for t in self.tracks if t.leave is not None]

    def track(self, name: str) -> Track:
        return next(t for t in self.tracks if t.name == name)

    def scene_at(self, t: float) -> ZW.Scene:
        """The world scene shown at time t (objects at their nearest cells; exact between motions)."""
        objs = [dataclasses.replace(tr.obj, row=tr.cell_at(t)[0], col=tr.cell_at(t)[1])
                for tr in self.tracks if tr.present(t)]
        return ZW.Scene("shapes", objects=tuple(sorted(objs, key=lambda o: (o.row, o.col))))


def frame_times(frames: int = FRAMES) -> np.ndarray:
    """Clip time of each frame (frame k at (k + 0.5) / frames: both frames of a temporal group lie inside it)."""
    return (np.arange(frames) + 0.5) / frames


def group_time(g: int) -> float:
    return (g + 0.5) / GROUPS


def _line_ends(r: int, c: int) -> list[tuple[int, int]]:
    """Cells 1 or 2 steps away from (r, c) in one of the 8 directions."""
    out = []
    for dr, dc in DIRECTIONS:
        for k in (1, 2):
            rr, cc = r + k * dr, c + k * dc
            if 0 <= rr < ZW.GRID and 0 <= cc < ZW.GRID:
                out.append((rr, cc))
    return out


def random_clip(rng: random.Random) -> Clip:
    """1-4 shapes at the start, then 1-3 events (moves, appearances, departures). Start cells are distinct, end
    cells are distinct, and no end cell is another object's start cell (so the first and last groups each show
    every object whole); at least one shape is left at the end."""
    n = rng.choice((1, 2, 2, 3, 3, 4))
    cells = rng.sample(sorted(ZW.POSITIONS), n)
    taken: set = set()
    objs = []
    for r, c in cells:
        o = ZW._random_obj(rng, r, c, taken)
        taken.add((o.colour, o.shape))
        objs.append(o)
    tracks = {i: Track(o, (o.row, o.col)) for i, o in enumerate(objs)}
    kinds = [rng.choice(("move", "move", "appear", "leave")) for _ in range(rng.choice((1, 1, 2, 2, 3)))]

    def blocked(skip=None) -> set:
        return {t.start for k, t in tracks.items() if k != skip} | {t.end for k, t in tracks.items() if k != skip}

    for kind in kinds:
        idle = [k for k, t in tracks.items() if t.move is None and t.appear is None and t.leave is None]
        if kind == "move" and idle:
            k = rng.choice(idle)
            t = tracks[k]
            ends = [e for e in _line_ends(*t.start) if e not in blocked(k)]
            if ends:
                g0 = rng.randint(EVENT_FIRST, 18)
                tracks[k] = dataclasses.replace(t, end=rng.choice(ends), move=(g0, g0 + rng.randint(6, 10)))
        elif kind == "appear":
            free = [p for p in sorted(ZW.POSITIONS) if p not in blocked()]
            if free:
                r, c = rng.choice(free)
                o = ZW._random_obj(rng, r, c, taken)
                taken.add((o.colour, o.shape))
                tracks[len(tracks)] = Track(o, (r, c), appear=rng.randint(8, 24))
        elif kind == "leave" and len(idle) > 1:     # someone stays
            k = rng.choice(idle)
            tracks[k] = dataclasses.replace(tracks[k], leave=rng.randint(8, 24))
    return Clip(tuple(tracks[k] for k in sorted(tracks)))


def clip_in(rng: random.Random, split: str, make: Callable[[random.Random], Clip] = random_clip) -> Clip:
    for _ in range(10_000):
        c = make(rng)
        if c.split() == split:
            return c
    raise RuntimeError(f"could not draw a {split} clip")  # pragma: no cover


# -------------------------------------------------------------------------------------------------- rendering


@functools.lru_cache(maxsize=None)
def _sprite(shape: str, size: str, fx: int, fy: int, frame_size: int) -> tuple[np.ndarray, int]:
    """(coverage [n, n] int32 in 0..SUPERSAMPLE^2, R): the shape drawn as `world.render` draws it, centred at
    sub-pixel phase (fx, fy) / SUPERSAMPLE of pixel (R, R); pixel (i, j) of it lands on (floor(cy) - R + i,
    floor(cx) - R + j)."""
    ss = SUPERSAMPLE
    cell = frame_size / ZW.GRID
    r = ZW.SIZES[size] * cell * ss / 2
    R = int(math.ceil(r / ss)) + 1
    n = 2 * R + 1
    img = Image.new("L", (n * ss, n * ss), 0)
    ZW._draw_shape(ImageDraw.Draw(img), shape, R * ss + fx, R * ss + fy, r, 1)
    return np.asarray(img, np.int32).reshape(n, ss, n, ss).sum((1, 3)), R


def _paste(out: np.ndarray, f0: int, f1: int, obj: ZW.Obj, cx: float, cy: float) -> None:
    """Blend one object into frames f0..f1-1 of out [F, S, S, 3] (uint8, in place) as a box filter of the
    supersampled drawing would: (k * colour + (ss^2 - k) * under + ss^2 / 2) // ss^2 for coverage k."""
    S = out.shape[1]
    ss2 = SUPERSAMPLE ** 2
    qx, qy = int(round(cx * SUPERSAMPLE)), int(round(cy * SUPERSAMPLE))
    cov, R = _sprite(obj.shape, obj.size, qx % SUPERSAMPLE, qy % SUPERSAMPLE, S)
    y0, x0 = qy // SUPERSAMPLE - R, qx // SUPERSAMPLE - R
    n = cov.shape[0]
    a0, b0 = max(0, -y0), max(0, -x0)
    a1, b1 = min(n, S - y0), min(n, S - x0)
    k = cov[a0:a1, b0:b1, None].astype(np.uint16)
    region = out[f0:f1, y0 + a0:y0 + a1, x0 + b0:x0 + b1]
    col = np.asarray(ZW.COLOURS[obj.colour], np.uint16)
    region[...] = (k * col + (ss2 - k) * region + ss2 // 2) // ss2         # < 2^16: 16 * 255 + 8


@functools.lru_cache(maxsize=4)
def _background(frames: int, size: int) -> np.ndarray:
    out = np.empty((frames, size, size, 3), np.uint8)
    out[...] = np.asarray(ZW.BACKGROUND, np.uint8)
    out.flags.writeable = False
    return out


def _draw_border(out: np.ndarray) -> None:
    """The 1 px frame of every frame of out [F, S, S, 3] (in place)."""
    c = np.asarray(BORDER, np.uint8)
    out[:, 0], out[:, -1], out[:, :, 0], out[:, :, -1] = c, c, c, c


def render_clip(clip: Clip, frames: int = FRAMES, size: int = FRAME_SIZE, out: np.ndarray | None = None) -> np.ndarray:
    """uint8 [frames, size, size, 3]: frame k shows the clip at time (k + 0.5) / frames in a 1 px border
    (`BORDER`). Inside it, pixel for pixel what `world.render` draws (supersampled x4, box-filtered) wherever
    objects do not overlap (`render_clip_reference`
    is the per-frame Pillow version); fast: each object is blended once per run of frames where it stands still.
    `out`: an array of that shape to draw into."""
    out = np.empty((frames, size, size, 3), np.uint8) if out is None else out
    np.copyto(out, _background(frames, size))
    times = frame_times(frames)
    for tr in clip.tracks:
        on = np.ones(frames, bool)
        if tr.appear is not None:
            on &= times >= tr.appear / GROUPS
        if tr.leave is not None:
            on &= times < tr.leave / GROUPS
        xs, ys = tr.centres(times, size)
        f = 0
        while f < frames:
            if not on[f]:
                f += 1
                continue
            g = f + 1
            while g < frames and on[g] and xs[g] == xs[f] and ys[g] == ys[f]:
                g += 1
            _paste(out, f, g, tr.obj, xs[f], ys[f])
            f = g
    _draw_border(out)
    return out


def render_clip_reference(clip: Clip, frames: int = FRAMES, size: int = FRAME_SIZE) -> np.ndarray:
    """`render_clip` drawn frame by frame with Pillow exactly as `world.render` draws a scene (slow; tests)."""
    ss = SUPERSAMPLE
    cell = size / ZW.GRID
    out = []
    for t in frame_times(frames):
        img = Image.new("RGB", (size * ss, size * ss), ZW.BACKGROUND)
        d = ImageDraw.Draw(img)
        for tr in clip.tracks:
            if tr.present(t):
                cx, cy = tr.centre(t, size)
                ZW._draw_shape(d, tr.obj.shape, cx * ss, cy * ss, ZW.SIZES[tr.obj.size] * cell * ss / 2,
                              ZW.COLOURS[tr.obj.colour])
        out.append(np.asarray(img.reduce(ss)))
    out = np.stack(out)
    _draw_border(out)
    return out


VARIANTS = ("clip", "shuffled", "blank")
ORDER_CONTROL = "reversed"  # the clip played backwards: what a model that reads the order answers differently


def frames_of(clip: Clip, variant: str = "clip", seed: int = 0) -> np.ndarray:
    """The clip's frames ("clip"), the same frames in a random order ("shuffled", seeded by the clip's content and
    `seed`), empty frames ("blank": background and border, no shapes), or the frames backwards ("reversed"): the
    controls for a model that must read the video."""
    if variant not in VARIANTS + (ORDER_CONTROL,):
        raise ValueError(f"unknown variant {variant!r}; expected one of {VARIANTS + (ORDER_CONTROL,)}")
    fr = render_clip(clip)
    if variant == ORDER_CONTROL:
        fr = fr[::-1]
    elif variant == "shuffled":
        rng = np.random.default_rng(int.from_bytes(hashlib.blake2b(f"{seed}/{clip.key()}".encode(),
                                                                   digest_size=8).digest(), "little"))
        fr = fr[rng.permutation(len(fr))]
    elif variant == "blank":
        fr = np.array(_background(*fr.shape[:2]))
        _draw_border(fr)
    return fr


def video_pixels(frames: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(pixel rows float32 [G * h * w, PATCH_DIM], grid int64 [3] = (G, h, w)) of uint8 frames [F, S, S, 3] (F
    even, S a multiple of PATCH * MERGE), as Qwen2VLVideoProcessor rescales, normalises (CLIP mean / std) and
    patchifies them: per temporal group, patches in 2x2 merge blocks, each row (channel, time, y, x)."""
    F, S = frames.shape[0], frames.shape[1]
    x = np.stack([_LUT[c][frames[..., c]] for c in range(3)], axis=1)          # [F, 3, S, S]
    gt, gh, p, m = F // TEMPORAL_PATCH, S // PATCH, PATCH, MERGE
    x = x.reshape(gt, TEMPORAL_PATCH, 3, gh // m, m, p, gh // m, m, p).transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return (np.ascontiguousarray(x.reshape(gt * gh * gh, 3 * TEMPORAL_PATCH * p * p)),
            np.array([gt, gh, gh], np.int64))


# ------------------------------------------------------------------------------------------------------ tasks


class VideoQA(NamedTuple):
    question: str
    answer: str
    focus: tuple[str, int, int] | None = None   # an answer read off one object at the start / end: (when, row, col)


@dataclasses.dataclass(frozen=True)
class VideoTaskSpec:
    name: str
    make: Callable[[random.Random, Clip], VideoQA | None]     # None: no question of this task for that clip
    weight: float


TASKS: dict[str, VideoTaskSpec] = {}


def register(name: str, weight: float = 1.0):
    def deco(fn):
        if name in TASKS:
            raise ValueError(f"video task {name!r} registered twice")
        TASKS[name] = VideoTaskSpec(name, fn, weight)
        return fn
    return deco


_PREFIXES = ("Watch the video. ", "Look at the clip. ", "Please watch carefully. ", "Quick question: ", "Hey! ")


def _q(rng: random.Random, templates: Sequence[str], prefix: float = 0.25, **fields) -> str:
    q = rng.choice(templates).format(**fields)
    if rng.random() < prefix:
        q = rng.choice(_PREFIXES) + q
    return q


def _styled(rng: random.Random, q: str, short: str, sentence: str, clauses: Sequence[str] = (),
            focus=None) -> VideoQA:
    """As the image world: a sentence clause asks for `sentence`, else the short answer (maybe with a brevity
    clause)."""
    r = rng.random()
    if r < ZW.P_SENTENCE:
        return VideoQA(q + " " + rng.choice(ZW._SENTENCE), sentence, focus)
    if clauses and r > 1.0 - ZW.P_SHORT_CLAUSE:
        return VideoQA(q + " " + rng.choice(clauses), short, focus)
    return VideoQA(q, short, focus)


def _pos(cell: tuple[int, int]) -> str:
    return ZW.POSITIONS[cell]


def _count_sentence(n: int, what: str, when: str) -> str:
    noun = "shape" if n == 1 else "shapes"
    what = f"{what} {noun}" if what else noun
    return f"There {'is' if n == 1 else 'are'} {n} {what} {when}."


def _mode(rng: random.Random, modes: dict[str, float]) -> str | None:
    """A mode drawn by weight among those with weight > 0 (None when there is none)."""
    live = [(m, w) for m, w in modes.items() if w > 0]
    return rng.choices([m for m, _ in live], weights=[w for _, w in live])[0] if live else None


@register("video_move", weight=1.5)
def _video_move(rng: random.Random, clip: Clip) -> VideoQA | None:
    movers = clip.movers
    m = bool(movers)
    mode = _mode(rng, {"end": 3 * m, "start": 2 * m, "direction": 3 * m, "fromto": 2 * m,
                       "which": 2.0 * (len(movers) == 1), "does": 1.0, "any": 0.5 * m + 0.25 * (not m)})
    if mode in ("end", "start", "direction", "fromto"):
        t = rng.choice(movers)
        c, sh = t.obj.colour, t.obj.shape
        if mode == "end":
            q = _q(rng, ("Where does the {c} {sh} move to?", "Where does the {c} {sh} end up?",
                         "Where is the {c} {sh} at the end?", "Where does the {c} {sh} go?"), c=c, sh=sh)
            return _styled(rng, q, _pos(t.end), f"The {c} {sh} moves to the {_pos(t.end)}.", ZW._PHRASE,
                           ("end",) + t.end)
        if mode == "start":
            q = _q(rng, ("Where does the {c} {sh} start?", "Where is the {c} {sh} at the beginning?",
                         "Where does the {c} {sh} come from?"), c=c, sh=sh)
            return _styled(rng, q, _pos(t.start), f"The {c} {sh} starts in the {_pos(t.start)}.", ZW._PHRASE,
                           ("start",) + t.start)
        if mode == "direction":
            q = _q(rng, ("Which way does the {c} {sh} move?", "In which direction does the {c} {sh} move?",
                         "Which direction does the {c} {sh} go?"), c=c, sh=sh)
            return _styled(rng, q, t.direction, f"The {c} {sh} moves {t.direction}.", ZW._PHRASE)
        q = _q(rng, ("From where to where does the {c} {sh} move?", "Where does the {c} {sh} move from and to?"),
               c=c, sh=sh)
        short = f"from the {_pos(t.start)} to the {_pos(t.end)}"
        return _styled(rng, q, short, f"The {c} {sh} moves from the {_pos(t.start)} to the {_pos(t.end)}.",
                       ZW._PHRASE)
    if mode == "which":
        t = movers[0]
        q = _q(rng, ("Which shape moves?", "Which object moves in the video?", "What moves?"))
        return _styled(rng, q, t.name, f"The {t.name} moves {t.direction}.", ZW._PHRASE)
    if mode == "does":
        t = rng.choice(movers if m and rng.random() < 0.5 else clip.tracks)
        yes = t.move is not None
        q = _q(rng, ("Does the {c} {sh} move?", "Is the {c} {sh} moving?", "Does the {c} {sh} change its place?"),
               c=t.obj.colour, sh=t.obj.shape)
        return _styled(rng, q, "yes" if yes else "no",
                       f"Yes, the {t.name} moves {t.direction}." if yes else f"No, the {t.name} does not move.",
                       ZW._YESNO)
    q = _q(rng, ("Does any shape move?", "Is anything moving in the video?", "Does something move?"))
    return _styled(rng, q, "yes" if m else "no",
                   f"Yes, {len(movers)} {'shape moves' if len(movers) == 1 else 'shapes move'}." if m else
                   "No, nothing moves.", ZW._YESNO)


@register("video_appear", weight=1.5)
def _video_appear(rng: random.Random, clip: Clip) -> VideoQA | None:
    app, lea = clip.appearing, clip.leaving
    if not app and not lea and rng.random() < 0.75:
        return None                                   # mostly ask about clips where something does appear / leave
    a, le = bool(app), bool(lea)
    mode = _mode(rng, {"where_appears": 3 * a, "which_appears": 3.0 * (len(app) == 1), "where_leaves": 2 * le,
                       "which_leaves": 3.0 * (len(lea) == 1), "any_appear": 1.0 if a else 0.5,
                       "any_leave": 1.0 if le else 0.5})
    if mode == "which_appears":
        t = app[0]
        q = _q(rng, ("Which shape appears?", "What new shape shows up?", "Which object appears in the video?"))
        return _styled(rng, q, t.name, f"{t.obj.phrase('A')} appears in the {_pos(t.end)}.", ZW._PHRASE,
                       ("end",) + t.end)
    if mode == "which_leaves":
        t = lea[0]
        q = _q(rng, ("Which shape disappears?", "Which shape leaves?", "Which object vanishes in the video?"))
        return _styled(rng, q, t.name, f"The {t.name} disappears from the {_pos(t.start)}.", ZW._PHRASE,
                       ("start",) + t.start)
    if mode == "where_appears":
        t = rng.choice(app)
        q = _q(rng, ("Where does the {c} {sh} appear?", "In which part of the video does the {c} {sh} show up?",
                     "Where does the new {c} {sh} appear?"), c=t.obj.colour, sh=t.obj.shape)
        return _styled(rng, q, _pos(t.end), f"The {t.name} appears in the {_pos(t.end)}.", ZW._PHRASE,
                       ("end",) + t.end)
    if mode == "where_leaves":
        t = rng.choice(lea)
        q = _q(rng, ("Where was the {c} {sh} before it disappeared?", "Where does the {c} {sh} disappear from?"),
               c=t.obj.colour, sh=t.obj.shape)
        return _styled(rng, q, _pos(t.start), f"The {t.name} disappears from the {_pos(t.start)}.", ZW._PHRASE,
                       ("start",) + t.start)
    if mode == "any_appear":
        q = _q(rng, ("Does any shape appear?", "Does a new shape show up?", "Does anything appear in the video?"))
        n = len(app)
        return _styled(rng, q, "yes" if n else "no",
                       (f"Yes, {n} {'shape appears' if n == 1 else 'shapes appear'}." if n else
                        "No, no shape appears."), ZW._YESNO)
    q = _q(rng, ("Does any shape disappear?", "Does a shape leave?", "Does anything vanish in the video?"))
    n = len(lea)
    return _styled(rng, q, "yes" if n else "no",
                   (f"Yes, {n} {'shape disappears' if n == 1 else 'shapes disappear'}." if n else
                    "No, no shape disappears."), ZW._YESNO)


@register("video_count", weight=1.5)
def _video_count(rng: random.Random, clip: Clip) -> VideoQA | None:
    mode = _mode(rng, {"end": 3.0, "start": 2.0, "end_colour": 2.0, "start_colour": 1.0,
                       "appear": 1.0, "leave": 0.5 + 0.5 * bool(clip.leaving), "move": 1.0})
    if mode in ("end", "start", "end_colour", "start_colour"):
        when = "at the end" if mode.startswith("end") else "at the start"
        objs = clip.at_end if mode.startswith("end") else clip.at_start
        if mode.endswith("colour"):
            col = rng.choice([t.obj.colour for t in clip.tracks] + [rng.choice(tuple(ZW.COLOURS))])
            n = sum(t.obj.colour == col for t in objs)
            q = _q(rng, ("How many {c} shapes are there {w}?", "How many {c} objects can you see {w}?",
                         "Count the {c} shapes {w}."), c=col, w=when)
            return _styled(rng, q, str(n), _count_sentence(n, col, when), ZW._NUMBER)
        n = len(objs)
        q = _q(rng, ("How many shapes are there {w}?", "How many objects can you see {w}?",
                     "Count the shapes {w}."), w=when)
        return _styled(rng, q, str(n), _count_sentence(n, "", when), ZW._NUMBER)
    what = {"appear": (clip.appearing, "appear", "appears"), "leave": (clip.leaving, "disappear", "disappears"),
            "move": (clip.movers, "move", "moves")}[mode]
    n = len(what[0])
    q = _q(rng, ("How many shapes {v}?", "How many shapes {v} in the video?", "Count the shapes that {v}."),
           v=what[1])
    return _styled(rng, q, str(n), f"{n} {'shape' if n == 1 else 'shapes'} {what[2] if n == 1 else what[1]}.",
                   ZW._NUMBER)


def describe(clip: Clip) -> str:
    """The detailed description of a clip: the shapes at the start, what each one does (reading order of where it
    starts, then the shapes that appear, in reading order of where they appear), how many moved, appeared and
    disappeared, and the shapes at the end."""
    def count(n: int, one: str = "shape", many: str = "shapes") -> str:
        return f"{ZW.NUMBER_WORDS[n]} {one if n == 1 else many}"

    def events(n: int, one: str, many: str) -> str:
        return "none " + one if n == 0 else count(n, "shape " + one, "shapes " + many)

    n0, n1 = len(clip.at_start), len(clip.at_end)
    out = [f"At the start there {'is' if n0 == 1 else 'are'} {count(n0)}."]
    for t in clip.at_start:
        a = t.obj.phrase("A")
        if t.move is not None:
            out.append(f"{a} moves {t.direction} from the {_pos(t.start)} to the {_pos(t.end)}.")
        elif t.leave is not None:
            out.append(f"{a} in the {_pos(t.start)} disappears.")
        else:
            out.append(f"{a} stays in the {_pos(t.start)}.")
    for t in sorted(clip.appearing, key=lambda t: t.end):
        out.append(f"Then {t.obj.phrase('a')} appears in the {_pos(t.end)}.")
    moved = events(len(clip.movers), "moves", "move")
    out.append(f"In all, {moved}, {events(len(clip.appearing), 'appears', 'appear')} and "
               f"{events(len(clip.leaving), 'disappears', 'disappear')}.")
    out.append(f"At the end there {'is' if n1 == 1 else 'are'} {count(n1)}.")
    return " ".join(out)


@register("video_describe", weight=0.5)
def _video_describe(rng: random.Random, clip: Clip) -> VideoQA:
    q = _q(rng, ("Describe the video in detail.", "Describe everything that happens in the video.",
                 "What happens in this clip? Describe it fully.", "Give a detailed description of the video."),
           prefix=0.2)
    return VideoQA(q, describe(clip))


QA_TASKS = ("video_move", "video_appear", "video_count")
ALL_TASKS = tuple(TASKS)


# --------------------------------------------------------------------------------------------------- examples


@dataclasses.dataclass(frozen=True)
class VideoExample:
    task: str
    split: str
    index: int
    clip: Clip
    question: str
    answer: str
    focus: tuple[str, int, int] | None = None
    scenario: str = SCENARIO


def _rng(seed: int, split: str, index: int) -> random.Random:
    return random.Random(f"jspec.zoo.video/{seed}/{split}/{index}")


def _check(split: str, tasks: Sequence[str] | None) -> list[str]:
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    names = list(tasks) if tasks is not None else list(TASKS)
    bad = [n for n in names if n not in TASKS]
    if bad or not names:
        raise ValueError(f"unknown video task(s) {bad or 'none given'}; registered: {sorted(TASKS)}")
    return names


def _draw_task(rng: random.Random, names: Sequence[str]) -> str:
    return rng.choices(names, weights=[TASKS[n].weight for n in names])[0] if len(names) > 1 else names[0]


def example(split: str, index: int, seed: int = 0, tasks: Sequence[str] | None = None) -> VideoExample:
    """Example `index` of a split's stream: a clip of that split and one question about it (task by weight)."""
    names = _check(split, tasks)
    rng = _rng(seed, split, index)
    name = _draw_task(rng, names)
    while True:                                       # a task may pass on a clip (None): draw another clip
        clip = clip_in(rng, split)
        qa = TASKS[name].make(rng, clip)
        if qa is not None:
            return VideoExample(name, split, index, clip, qa.question, qa.answer, qa.focus)


def examples(split: str, n: int, seed: int = 0, tasks: Sequence[str] | None = None,
             start: int = 0) -> Iterator[VideoExample]:
    for i in range(start, start + n):
        yield example(split, i, seed, tasks)


def eval_set(n: int = 100, seed: int = 0, tasks: Sequence[str] | None = QA_TASKS) -> list[VideoExample]:
    """n held-out examples round-robin over `tasks` (default the video QA tasks)."""
    names = _check("heldout", tasks)
    return [example("heldout", i, seed, [names[i % len(names)]]) for i in range(n)]


def training_clip(split: str, index: int, seed: int = 0,
                  tasks: Sequence[str] | None = None) -> tuple[Clip, random.Random, list[str]]:
    """Clip `index` of a split's training-row stream, the row's rng (for its questions) and the task names."""
    names = _check(split, tasks)
    rng = random.Random(f"jspec.zoo.video/rows/{seed}/{split}/{index}")
    return clip_in(rng, split), rng, names


# ------------------------------------------------------------------------------------------------ token ids


def focus_index(focus: tuple[str, int, int] | None) -> int:
    """Index in the prompt (and in every training row) of the video token an answer is read off: the focus
    object's cell in the first or last temporal group; -1 without a focus."""
    if focus is None:
        return -1
    when, r, c = focus
    g = 0 if when == "start" else GROUPS - 1
    return PREFIX_VIDEO_START + g * TOKENS_PER_GROUP + r * ZW.GRID + c


@functools.lru_cache(maxsize=None)
def prefix_positions() -> np.ndarray:
    """int32 [3, PREFIX_LEN] M-RoPE (t, h, w) ids of <s><|user|>[clip]\\n (HF's get_rope_index, transformers 5.23
    rules: text +1 per token, the clip at (start + group, start + row, start + col), text after it from start +
    max(rows, cols))."""
    g, r, c = np.meshgrid(np.arange(GROUPS), np.arange(ZW.GRID), np.arange(ZW.GRID), indexing="ij")
    s = PREFIX_VIDEO_START
    vid = np.stack([g.ravel() * int(TOKENS_PER_SECOND * SECONDS_PER_GROUP), r.ravel(), c.ravel()]) + s
    after = s + ZW.GRID
    return np.concatenate([np.broadcast_to(np.arange(s), (3, s)), vid, np.full((3, 1), after)],
                          axis=1).astype(np.int32)


def segment_positions(n_question: int, n_answer: int) -> np.ndarray:
    """int32 [3, n_question + n_answer] M-RoPE ids of a QA segment after the clip's prefix, as inference sees it.

    The question (its tokens up to and including <|assistant|>) continues the prefix's text positions (its
    prompt's ids, `prefix_positions`' rule). The answer's tokens as inputs (answer and EOS) are generated ones:
    transformers 5.23 (get_rope_index: rope_deltas = max(prompt ids) + 1 - len) and our port (`mrope_offset`,
    the cache's pos_offset in `jspec.decode`) feed generated token i at P + i, P = max(every prompt id over the
    three components) + 1, and the clip's temporal ids (up to start + GROUPS - 1) usually exceed the question's
    last text id: the answer does not continue the question's positions contiguously."""
    pre = prefix_positions()
    first = int(pre[0, -1]) + 1
    q = np.arange(first, first + n_question)
    p = max(int(pre.max()), int(q[-1]) if n_question else first - 1) + 1
    ids = np.concatenate([q, np.arange(p, p + n_answer)])
    return np.broadcast_to(ids, (3, len(ids))).astype(np.int32)


class VideoEncoder:
    """Token ids of video examples in the zoo chat format, and processor-style prompts (see the module docstring)."""

    def __init__(self, tokenizer=None):
        from jspec.tools.zoo import data as ZD

        self.text = ZD.Encoder(tokenizer)            # its text_ids cache and the special-token checks
        self.tokenizer = self.text.tokenizer
        self.ids = special_ids()
        self.prefix = np.array([TK.BOS_ID, TK.USER_ID] + [VIDEO_ID] * VIDEO_TOKENS
                               + [self.ids["vision_end_token_id"]], np.int32)

    def segment(self, question: str, answer: str | None) -> tuple[list[int], list[int]]:
        """(ids, loss mask) of '{question}<|assistant|>{answer}</s>' (without an answer: up to <|assistant|>)."""
        q = self.text.text_ids(question) + [TK.ASSISTANT_ID]
        if answer is None:
            return q, [0] * len(q)
        a = self.text.text_ids(answer) + [TK.EOS_ID]
        return q + a, [0] * len(q) + [1] * len(a)

    def prompt_ids(self, ex: VideoExample) -> np.ndarray:
        return np.concatenate([self.prefix, np.asarray(self.segment(ex.question, None)[0], np.int32)])

    def prompts(self, examples: Sequence[VideoExample], variant: str = "clip", seed: int = 0) -> dict:
        """A right-padded batch prompt (Qwen2.5-VL processor output) for `jspec.decode` / `ports.logits` and
        transformers' Qwen2_5_VLForConditionalGeneration: input_ids, attention_mask, pixel_values_videos,
        video_grid_thw, second_per_grid_ts, mm_token_type_ids; `variant` as in `frames_of`."""
        rows = [self.prompt_ids(ex) for ex in examples]
        T = max(len(r) for r in rows)
        ids = np.zeros((len(rows), T), np.int64)
        mask = np.zeros((len(rows), T), np.int64)
        for b, r in enumerate(rows):
            ids[b, :len(r)] = r
            mask[b, :len(r)] = 1
        px, grids = zip(*[video_pixels(frames_of(ex.clip, variant, seed)) for ex in examples])
        return {"input_ids": ids, "attention_mask": mask, "pixel_values_videos": np.concatenate(px),
                "video_grid_thw": np.stack(grids),
                "second_per_grid_ts": np.full(len(rows), SECONDS_PER_GROUP, np.float32),
                "mm_token_type_ids": np.where((ids == VIDEO_ID) & (mask > 0), 2, 0).astype(np.int64)}

    def row(self, split: str, index: int, seq_len: int, seed: int = 0, tasks: Sequence[str] | None = None,
            max_segments: int = 8) -> dict:
        """Training row `index`: one clip and QA segments about it (tasks drawn by weight) until the row is full.
        Every segment sees the clip's prefix and itself only (`qa_segment`), at the positions greedy decoding
        gives it alone (`segment_positions`: its question at its prompt's positions, its answer and EOS where
        generation feeds them), so a row trains exactly what len(segments) single-question prompts followed by
        their generated answers would, reading the clip once."""
        clip, rng, names = training_clip(split, index, seed, tasks)
        ids, mask, seg, focus = list(self.prefix), [0] * PREFIX_LEN, [0] * PREFIX_LEN, [-1] * PREFIX_LEN
        pos = [prefix_positions()]
        misses, draws, k = 0, 0, 0
        while k < max_segments and misses < 3 and draws < 50:
            draws += 1
            qa = TASKS[_draw_task(rng, names)].make(rng, clip)
            if qa is None:                            # the task passed on this clip
                continue
            s_ids, s_mask = self.segment(qa.question, qa.answer)
            if len(ids) + len(s_ids) > seq_len:       # does not fit: try a few shorter ones
                misses += 1
                continue
            k += 1
            f = focus_index(qa.focus)
            ids += s_ids
            mask += s_mask
            seg += [k] * len(s_ids)
            focus += [f if m else -1 for m in s_mask]
            n_question = len(s_mask) - sum(s_mask)    # up to and including <|assistant|>
            pos.append(segment_positions(n_question, len(s_ids) - n_question))
        if len(ids) > seq_len:
            raise ValueError(f"seq_len {seq_len} cannot hold the clip's {PREFIX_LEN}-token prefix")
        return {"clip": clip, "ids": np.asarray(ids, np.int32), "loss_mask": np.asarray(mask, np.float32),
                "qa_segment": np.asarray(seg, np.int32), "focus": np.asarray(focus, np.int32),
                "positions": np.concatenate(pos, axis=1).astype(np.int32)}


# ---------------------------------------------------------------------------------------------- training data

_ENCODERS: dict = {}


def _encoder() -> VideoEncoder:
    enc = _ENCODERS.get(os.getpid())
    if enc is None:
        enc = _ENCODERS[os.getpid()] = VideoEncoder()
    return enc


def make_batch(split: str, start: int, batch_size: int, seq_len: int, seed: int = 0,
               tasks: Sequence[str] | None = None, labels: bool = False) -> dict:
    """Rows start .. start + batch_size - 1 of a split's training stream as fixed-shape numpy arrays:
        frames       uint8 [B, FRAMES, S, S, 3]
        input_ids    int32 [B, T]   (pad 0)
        targets      int32 [B, T]   next token of the same segment (pad 0)
        target_mask  float32 [B, T] 1 where targets is an answer token or its '</s>'
        qa_segment   int32 [B, T]   0 on the clip's prefix, k >= 1 on QA segment k, -1 on padding: query q sees
                                    key s <= q when s is in the prefix or in q's own segment
        positions    int32 [3, B, T] M-RoPE ids (each segment at its positions alone, its answer where
                                    generation feeds it: `segment_positions`)
        target_focus int32 [B, T]   where targets is an answer token read off one object: the index of that
                                    object's video token (first or last group); -1 elsewhere
        labels       int32 [B, GROUPS, 9, len(LABELS)] with labels=True: the tower's per-token attributes
        next_index   int64 []
    """
    enc = _encoder()
    B, T = batch_size, seq_len
    out = {"frames": np.empty((B, FRAMES, FRAME_SIZE, FRAME_SIZE, 3), np.uint8),
           "input_ids": np.zeros((B, T), np.int32), "loss_mask": np.zeros((B, T), np.float32),
           "qa_segment": np.full((B, T), -1, np.int32), "positions": np.zeros((3, B, T), np.int32),
           "focus": np.full((B, T), -1, np.int32)}
    if labels:
        out["labels"] = np.zeros((B, GROUPS, CELLS, len(LABELS)), np.int32)
    for b in range(B):
        r = enc.row(split, start + b, T, seed, tasks)
        L = len(r["ids"])
        render_clip(r["clip"], out=out["frames"][b])
        out["input_ids"][b, :L] = r["ids"]
        out["loss_mask"][b, :L] = r["loss_mask"]
        out["qa_segment"][b, :L] = r["qa_segment"]
        out["positions"][:, b, :L] = r["positions"]
        out["focus"][b, :L] = r["focus"]
        if labels:
            out["labels"][b] = tower_labels(r["clip"])
    seg = out.pop("qa_segment")
    same = np.zeros((B, T), bool)
    same[:, :-1] = (seg[:, 1:] == seg[:, :-1]) & (seg[:, :-1] > 0)
    nxt = np.zeros((B, T), np.int32)
    nxt[:, :-1] = out["input_ids"][:, 1:]
    out["targets"] = np.where(same, nxt, TK.PAD_ID).astype(np.int32)
    tm = np.zeros((B, T), np.float32)
    tm[:, :-1] = out.pop("loss_mask")[:, 1:]
    out["target_mask"] = np.where(same, tm, 0.0).astype(np.float32)
    tf = np.full((B, T), -1, np.int32)
    tf[:, :-1] = out.pop("focus")[:, 1:]
    out["target_focus"] = np.where(same, tf, -1).astype(np.int32)
    out["qa_segment"] = seg
    out["next_index"] = np.asarray(start + B, np.int64)
    return out


def batches(split: str, batch_size: int, seq_len: int = 512, seed: int = 0, *, tasks: Sequence[str] | None = None,
            start: int = 0, workers: int = 0, labels: bool = False, prefetch: int = 4) -> Iterator[dict]:
    """Endless deterministic stream of `make_batch` batches from row `start` on (row i depends only on (seed,
    split, i, tasks)); with workers > 0 made in that many processes (see `pooled`), in the same order."""
    _check(split, tasks)
    fn = functools.partial(make_batch, split, batch_size=batch_size, seq_len=seq_len, seed=seed, tasks=tasks,
                           labels=labels)
    yield from pooled(fn, itertools.count(start, batch_size), workers, prefetch)


def tower_batch(split: str, start: int, n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Frames [n, F, S, S, 3] uint8 and `tower_labels` [n, GROUPS, 9, len(LABELS)] of clips start .. start + n - 1
    of a split's tower-pretraining stream (seeded apart from the training rows)."""
    clips = [clip_in(random.Random(f"jspec.zoo.video/tower/{seed}/{split}/{i}"), split)
             for i in range(start, start + n)]
    return np.stack([render_clip(c) for c in clips]), np.stack([tower_labels(c) for c in clips])


def pooled(fn: Callable, starts: Iterable, workers: int = 0, prefetch: int = 4) -> Iterator:
    """fn(s) for each s of `starts`, in order. With workers > 0 in that many spawned processes (CPU only: they
    start with JAX_PLATFORMS=cpu and no visible CUDA device, so they never touch the accelerator), with at most
    workers + prefetch results in flight; `fn` must be picklable (a module-level function or a partial of one)."""
    starts = iter(starts)
    if workers <= 0:
        for s in starts:
            yield fn(s)
        return
    import collections
    import multiprocessing as mp

    saved = {k: os.environ.get(k) for k in ("JAX_PLATFORMS", "CUDA_VISIBLE_DEVICES")}
    os.environ.update(JAX_PLATFORMS="cpu", CUDA_VISIBLE_DEVICES="")
    try:
        pool = mp.get_context("spawn").Pool(workers)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    pending: collections.deque = collections.deque()

    def submit() -> None:                   # a bounded window (Pool.imap would drain an endless `starts` at once)
        s = next(starts, None)
        if s is not None:
            pending.append(pool.apply_async(fn, (s,)))

    try:
        for _ in range(workers + prefetch):
            submit()
        while pending:
            out = pending.popleft().get()
            submit()
            yield out
    finally:
        pool.terminate()


# ------------------------------------------------------------------------------------------- tower labels

LABELS = ("colour", "shape", "size", "row", "col", "motion")
LABEL_CLASSES = (len(ZW.COLOURS) + 1, len(ZW.SHAPES) + 1, len(ZW.SIZES) + 1, ZW.GRID, ZW.GRID, len(DIRECTIONS) + 1)
_COLOUR = {c: i + 1 for i, c in enumerate(ZW.COLOURS)}
_SHAPE = {s: i + 1 for i, s in enumerate(ZW.SHAPES)}
_SIZE = {s: i + 1 for i, s in enumerate(ZW.SIZES)}


def tower_labels(clip: Clip) -> np.ndarray:
    """int32 [GROUPS, 9, len(LABELS)]: per temporal group and grid cell, the colour / shape / size of the shape whose
    centre is nearest that cell at the group's mid time (0: none), the cell's row and column, and the shape's
    direction while it moves (0: still or none)."""
    y = np.zeros((GROUPS, CELLS, len(LABELS)), np.int32)
    y[:, :, 3] = np.arange(CELLS) // ZW.GRID
    y[:, :, 4] = np.arange(CELLS) % ZW.GRID
    for g in range(GROUPS):
        t = group_time(g)
        for tr in clip.tracks:
            if tr.present(t):
                r, c = tr.cell_at(t)
                o = tr.obj
                y[g, r * ZW.GRID + c, :3] = _COLOUR[o.colour], _SHAPE[o.shape], _SIZE[o.size]
                y[g, r * ZW.GRID + c, 5] = DIRECTION_IDS[tr.step] if tr.moving(t) else 0
    return y


# ------------------------------------------------------------------------------------------------ measuring


def answers(model, examples: Sequence[VideoExample], variant: str = "clip", batch: int = 16, max_new: int = 32,
            encoder: VideoEncoder | None = None) -> list[str]:
    """The model's greedy answers (up to EOS) to the examples' questions, their clips shown as `variant`."""
    import jspec
    from jspec.tools.zoo.evaluate import answer_text

    enc = encoder or VideoEncoder()
    out = []
    for i in range(0, len(examples), batch):
        chunk = examples[i:i + batch]
        r = jspec.decode(model, enc.prompts(chunk, variant), max_new_tokens=max_new)
        out += [answer_text(enc.tokenizer, r.tokens[b, :r.lengths[b]]) for b in range(len(chunk))]
    return out


def exact_match(model, examples: Sequence[VideoExample], variant: str = "clip", **kw) -> list[bool]:
    """Greedy answer == reference, per example (see `answers`)."""
    return [a == ex.answer for a, ex in zip(answers(model, examples, variant, **kw), examples)]


def sd_acceptance(target, draft, examples: Sequence[VideoExample], gamma: int = 5, max_new: int = 128,
                  batch: int = 8, encoder: VideoEncoder | None = None) -> dict:
    """Greedy Chain(gamma) SD of `draft` for `target` (each reading the clip): mean accepted length per target
    step (bonus included, pooled over rows and steps) and whether it produced greedy AR's tokens."""
    import jspec

    enc = encoder or VideoEncoder()
    acc, same = [], True
    for i in range(0, len(examples), batch):
        prompt = enc.prompts(examples[i:i + batch])
        ar = jspec.decode(target, prompt, max_new_tokens=max_new)
        sd = jspec.decode(target, prompt, strategy=jspec.Chain(draft, gamma=gamma), max_new_tokens=max_new)
        a = np.asarray(sd.stats["accepted"])
        acc.append(a[a > 0])
        same &= all(np.array_equal(ar.tokens[b, :ar.lengths[b]], sd.tokens[b, :sd.lengths[b]])
                    for b in range(ar.tokens.shape[0]))
    acc = np.concatenate(acc)
    return {"prompts": len(examples), "mean_accepted": float(acc.mean()), "same_tokens": bool(same)}


# ------------------------------------------------------------------------------------------------- benchmark


def benchmark(n: int = 200, batch_size: int = 32, seq_len: int = 512, workers: int = 0) -> dict[str, float]:
    """Seconds per clip to generate, to render (fast and Pillow reference), and training rows per second of the
    whole batch pipeline (`batches`, with `workers` processes)."""
    clips = [clip_in(_rng(0, "train", i), "train") for i in range(n)]
    t0 = time.perf_counter()
    for i in range(n):
        clip_in(_rng(0, "train", i), "train")
    t1 = time.perf_counter()
    for c in clips:
        render_clip(c)
    t2 = time.perf_counter()
    for c in clips[:max(1, n // 20)]:
        render_clip_reference(c)
    t3 = time.perf_counter()
    it = batches("train", batch_size, seq_len, workers=workers)
    next(it)                                                   # workers start, caches fill
    t4 = time.perf_counter()
    k = max(2, (4 * workers) or 4)
    for _ in range(k):
        next(it)
    t5 = time.perf_counter()
    it.close()
    return {"generate_ms": 1e3 * (t1 - t0) / n, "render_ms": 1e3 * (t2 - t1) / n,
            "render_reference_ms": 1e3 * (t3 - t2) / max(1, n // 20),
            "rows_per_s": k * batch_size / (t5 - t4)}
