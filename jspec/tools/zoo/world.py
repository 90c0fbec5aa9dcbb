"""A synthetic multimodal world: scenes, their images, and chat tasks whose answers the scenes determine.

Everything here is deterministic from (seed, split, index); nothing touches the network.

Scenes (`Scene`) come in three kinds, all drawn with Pillow at a small configurable resolution (32-64 px):
    "shapes"  1-4 coloured shapes (circle, square, triangle, diamond, cross; big or small) in distinct cells of a
              3x3 grid. Every object carries a `velocity` (grid cells per time unit, zero today) and `render(scene,
              t=...)` moves objects by it, so video clips with motion captions can be added as a new task later.
    "text"    1-4 characters (A-Z, 2-9) in one colour, drawn with the 5x7 pixel font below (legible at 32 px).
    "chart"   a bar chart of 2-4 bars of distinct colours with integer values 1-9 and a unique tallest/shortest bar.

Tasks live in `TASKS`, a registry keyed by name (`register`); each produces a list of chat turns (`Turn`) plus the
scenes its `<image>` placeholders refer to, in order. Every example has a scenario label:
    "caption"      describe one image (brief or detailed; the prompt decides which)
    "vqa"          one short exact-matchable question about one image (colour, shape, count, position, size,
                   existence, read the text, chart value / tallest / number of bars)
    "second_turn"  an image-grounded first turn, its answer, then a text-only second turn (arithmetic, a fact of
                   the fictional knowledge base `KB`, or a follow-up on the first answer)
    "two_image"    compare two images (what changed; which has more shapes)
    "ood"          multi-image prompts (five-image stories, counting across 3-5 images): flagged `ood=True`, they
                   are out of the *draft's* distribution, as in TABED. They are generated for "train" only on
                   request (`allow_ood=True`: the image target trains on them; a draft never does)
    "text"         text-only chats (arithmetic, facts, word games, short stories): training data for text models
User prompts are stochastic (several phrasings, optional clauses); answers are a function of the scene(s) and the
chosen prompt, so exact match is a valid metric: short ("red", "3", "top left", "KP7", "yes") unless the prompt asks
for a full sentence (P_SENTENCE of questions: "Which shape is green? Answer in a full sentence." -> "The green object
is a diamond."), which gives speculative decoding answers long enough to measure acceptance on.

Splits: the example stream of a split is seeded by (seed, split, index), and every scene is assigned to a split by a
hash of its content (`Scene.split`, 1/8 held out), so no held-out scene ever appears in a training example, even
when a different seed would have drawn it. Text-only content (arithmetic, knowledge-base facts) is shared by design.

    ex = example("train", 17, seed=0)                  # one Example; ex.turns, ex.images (Scenes), ex.answer
    img = render(ex.images[0], size=64)                # PIL RGB image
    for ex in examples("heldout", 100, tasks=tasks_of("vqa")): ...
"""
from __future__ import annotations

import dataclasses
import hashlib
import random
from typing import Callable, Iterator, NamedTuple, Sequence

from PIL import Image, ImageDraw

# ----------------------------------------------------------------------------------------------- vocabulary

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (215, 40, 40),
    "green": (40, 160, 60),
    "blue": (40, 90, 225),
    "yellow": (235, 200, 30),
    "purple": (140, 60, 190),
    "orange": (245, 130, 30),
    "pink": (245, 120, 190),
    "brown": (125, 80, 40),
}
BACKGROUND = (235, 235, 235)
AXIS = (70, 70, 70)
SHAPES = ("circle", "square", "triangle", "diamond", "cross")
PLURAL = {"circle": "circles", "square": "squares", "triangle": "triangles", "diamond": "diamonds",
          "cross": "crosses"}
SIZES = {"big": 0.92, "small": 0.56}          # shape diameter as a fraction of a grid cell
GRID = 3
POSITIONS = {(0, 0): "top left", (0, 1): "top middle", (0, 2): "top right",
             (1, 0): "middle left", (1, 1): "center", (1, 2): "middle right",
             (2, 0): "bottom left", (2, 1): "bottom middle", (2, 2): "bottom right"}
NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")
SCENARIOS = ("caption", "vqa", "second_turn", "two_image", "ood", "text", "prior")
SPLITS = ("train", "heldout")
HELDOUT_EVERY = 8                             # 1 scene in 8 (by content hash) is held out

# 5x7 pixel font: rows top to bottom, '#' = ink. 0/1 are left out (they read as O/I at 5x7).
FONT: dict[str, tuple[str, ...]] = {
    "A": (".###.", "#...#", "#...#", "#####", "#...#", "#...#", "#...#"),
    "B": ("####.", "#...#", "#...#", "####.", "#...#", "#...#", "####."),
    "C": (".###.", "#...#", "#....", "#....", "#....", "#...#", ".###."),
    "D": ("####.", "#...#", "#...#", "#...#", "#...#", "#...#", "####."),
    "E": ("#####", "#....", "#....", "####.", "#....", "#....", "#####"),
    "F": ("#####", "#....", "#....", "####.", "#....", "#....", "#...."),
    "G": (".###.", "#...#", "#....", "#.###", "#...#", "#...#", ".####"),
    "H": ("#...#", "#...#", "#...#", "#####", "#...#", "#...#", "#...#"),
    "I": ("#####", "..#..", "..#..", "..#..", "..#..", "..#..", "#####"),
    "J": ("..###", "...#.", "...#.", "...#.", "...#.", "#..#.", ".##.."),
    "K": ("#...#", "#..#.", "#.#..", "##...", "#.#..", "#..#.", "#...#"),
    "L": ("#....", "#....", "#....", "#....", "#....", "#....", "#####"),
    "M": ("#...#", "##.##", "#.#.#", "#.#.#", "#...#", "#...#", "#...#"),
    "N": ("#...#", "#...#", "##..#", "#.#.#", "#..##", "#...#", "#...#"),
    "O": (".###.", "#...#", "#...#", "#...#", "#...#", "#...#", ".###."),
    "P": ("####.", "#...#", "#...#", "####.", "#....", "#....", "#...."),
    "Q": (".###.", "#...#", "#...#", "#...#", "#.#.#", "#..#.", ".##.#"),
    "R": ("####.", "#...#", "#...#", "####.", "#.#..", "#..#.", "#...#"),
    "S": (".####", "#....", "#....", ".###.", "....#", "....#", "####."),
    "T": ("#####", "..#..", "..#..", "..#..", "..#..", "..#..", "..#.."),
    "U": ("#...#", "#...#", "#...#", "#...#", "#...#", "#...#", ".###."),
    "V": ("#...#", "#...#", "#...#", "#...#", "#...#", ".#.#.", "..#.."),
    "W": ("#...#", "#...#", "#...#", "#.#.#", "#.#.#", "#.#.#", ".#.#."),
    "X": ("#...#", "#...#", ".#.#.", "..#..", ".#.#.", "#...#", "#...#"),
    "Y": ("#...#", "#...#", ".#.#.", "..#..", "..#..", "..#..", "..#.."),
    "Z": ("#####", "....#", "...#.", "..#..", ".#...", "#....", "#####"),
    "2": (".###.", "#...#", "....#", "...#.", "..#..", ".#...", "#####"),
    "3": ("####.", "....#", "....#", ".###.", "....#", "....#", "####."),
    "4": ("...#.", "..##.", ".#.#.", "#..#.", "#####", "...#.", "...#."),
    "5": ("#####", "#....", "####.", "....#", "....#", "#...#", ".###."),
    "6": (".###.", "#....", "#....", "####.", "#...#", "#...#", ".###."),
    "7": ("#####", "....#", "...#.", "..#..", ".#...", ".#...", ".#..."),
    "8": (".###.", "#...#", "#...#", ".###.", "#...#", "#...#", ".###."),
    "9": (".###.", "#...#", "#...#", ".####", "....#", "....#", ".###."),
}
GLYPH_W, GLYPH_H = 5, 7
TEXT_CHARS = "".join(FONT)
SIGN_WORDS = ("STOP", "EXIT", "OPEN", "SALE", "CAT", "DOG", "SUN", "MAP", "BUS", "HI", "NO", "YES", "GO", "UP",
              "ZOO", "BOX", "KEY", "FUN", "RUN", "TAXI", "CAFE", "BANK", "PARK", "WAY", "HOT", "ICE", "FIX", "JAM",
              "A2", "B4", "7UP", "Q9")

# A fixed fictional knowledge base (second-turn and text-only questions). Each colour has exactly one creature.
KB_COUNTRIES = {"Zorbia": "Trell", "Mavrin": "Oskenford", "Tullo": "Pim", "Brenna": "Halvik", "Ostrel": "Duvamere",
                "Kalvor": "Sennet", "Pexia": "Rundle", "Varnholt": "Ezzik", "Ilsen": "Corvath", "Quenby": "Lask",
                "Dralmoor": "Tesk", "Yorvane": "Flintholm"}
KB_CREATURES = {  # name: (colour, legs, food)
    "glimmet": ("red", 6, "moss"), "snorvel": ("green", 4, "pebbles"), "quib": ("blue", 2, "clouds"),
    "tazzle": ("yellow", 8, "honey"), "murk": ("purple", 3, "shadows"), "plondo": ("orange", 5, "acorns"),
    "fenwick": ("pink", 10, "petals"), "brumble": ("brown", 7, "roots"),
}
CREATURE_OF_COLOUR = {c: name for name, (c, _, _) in KB_CREATURES.items()}


# -------------------------------------------------------------------------------------------------- scenes


@dataclasses.dataclass(frozen=True)
class Obj:
    """One shape in a grid cell. `velocity` (cells per time unit, (d_row, d_col)) is for future video clips."""
    shape: str
    colour: str
    size: str
    row: int
    col: int
    velocity: tuple[float, float] = (0.0, 0.0)

    @property
    def position(self) -> str:
        return POSITIONS[(self.row, self.col)]

    def phrase(self, article: str = "a") -> str:
        """'a big red circle' / 'the big red circle'."""
        return f"{article} {self.size} {self.colour} {self.shape}"


@dataclasses.dataclass(frozen=True)
class Bar:
    colour: str
    value: int


@dataclasses.dataclass(frozen=True)
class Scene:
    kind: str                                   # "shapes" | "text" | "chart"
    objects: tuple[Obj, ...] = ()
    text: str = ""
    text_colour: str = ""
    bars: tuple[Bar, ...] = ()

    def key(self) -> str:
        """Canonical content string (objects in reading order); equal scenes have equal keys."""
        if self.kind == "shapes":
            objs = sorted(self.objects, key=lambda o: (o.row, o.col))
            return "shapes|" + ";".join(f"{o.shape},{o.colour},{o.size},{o.row},{o.col},{o.velocity}" for o in objs)
        if self.kind == "text":
            return f"text|{self.text}|{self.text_colour}"
        return "chart|" + ";".join(f"{b.colour}={b.value}" for b in self.bars)

    def split(self) -> str:
        """'heldout' for 1 scene in HELDOUT_EVERY (by content hash), else 'train'."""
        h = int.from_bytes(hashlib.blake2b(self.key().encode(), digest_size=8).digest(), "little")
        return "heldout" if h % HELDOUT_EVERY == 0 else "train"

    def by_position(self) -> list[Obj]:
        return sorted(self.objects, key=lambda o: (o.row, o.col))


def _random_obj(rng: random.Random, row: int, col: int, taken: set[tuple[str, str]]) -> Obj:
    while True:
        shape, colour = rng.choice(SHAPES), rng.choice(tuple(COLOURS))
        if (colour, shape) not in taken:
            return Obj(shape, colour, rng.choice(("big", "small")), row, col)


def random_shapes(rng: random.Random, n: int | None = None) -> Scene:
    """1-4 objects in distinct cells with distinct (colour, shape) pairs, so 'the red circle' is always unique."""
    n = n if n is not None else rng.choice((1, 2, 2, 3, 3, 4))
    cells = rng.sample(sorted(POSITIONS), n)
    objs, taken = [], set()
    for r, c in cells:
        o = _random_obj(rng, r, c, taken)
        taken.add((o.colour, o.shape))
        objs.append(o)
    return Scene("shapes", objects=tuple(sorted(objs, key=lambda o: (o.row, o.col))))


def random_text(rng: random.Random) -> Scene:
    if rng.random() < 0.5:
        text = rng.choice(SIGN_WORDS)
    else:
        text = "".join(rng.choice(TEXT_CHARS) for _ in range(rng.randint(1, 4)))
    return Scene("text", text=text, text_colour=rng.choice(tuple(COLOURS)))


def random_chart(rng: random.Random) -> Scene:
    n = rng.randint(2, 4)
    colours = rng.sample(tuple(COLOURS), n)
    while True:
        values = [rng.randint(1, 9) for _ in range(n)]
        if values.count(max(values)) == 1 and values.count(min(values)) == 1:
            return Scene("chart", bars=tuple(Bar(c, v) for c, v in zip(colours, values)))


SCENE_MAKERS: dict[str, Callable[[random.Random], Scene]] = {
    "shapes": random_shapes, "text": random_text, "chart": random_chart}


def scene_in(rng: random.Random, split: str, make: Callable[[random.Random], Scene]) -> Scene:
    """Draw scenes with `make` until one belongs to `split`."""
    for _ in range(10_000):
        s = make(rng)
        if s.split() == split:
            return s
    raise RuntimeError(f"could not draw a {split} scene")  # pragma: no cover (probability ~ (7/8)^10000)


# ------------------------------------------------------------------------------------------------ rendering


def text_layout(text: str, size: int) -> tuple[int, int, int]:
    """(x0, y0, scale) of `text` centred in a size x size image: glyph i covers columns x0 + 6*scale*i ..."""
    units_w = (GLYPH_W + 1) * len(text) - 1
    scale = max(1, min(int(0.9 * size) // units_w, int(0.6 * size) // GLYPH_H))
    x0 = (size - units_w * scale) // 2
    y0 = (size - GLYPH_H * scale) // 2
    return x0, y0, scale


def chart_layout(n_bars: int, size: int) -> tuple[list[tuple[int, int]], int, float]:
    """([(x_left, x_right_exclusive) per bar], baseline row, pixels per unit) in the size x size image.
    A bar of value v covers rows baseline - round(v * unit) .. baseline - 1."""
    left, right = max(2, size // 10), size - max(1, size // 16)
    slot = (right - left) / n_bars
    xs = []
    for i in range(n_bars):
        a = left + int(round(i * slot + slot * 0.18))
        b = left + int(round((i + 1) * slot - slot * 0.18))
        xs.append((a, max(b, a + 1)))
    baseline = size - max(2, size // 10)
    unit = (baseline - max(2, size // 12)) / 9.0
    return xs, baseline, unit


def _draw_shape(d: ImageDraw.ImageDraw, shape: str, cx: float, cy: float, r: float, fill) -> None:
    if shape == "circle":
        d.ellipse((cx - r, cy - r, cx + r, cy + r), fill=fill)
    elif shape == "square":
        h = r * 0.82
        d.rectangle((cx - h, cy - h, cx + h, cy + h), fill=fill)
    elif shape == "triangle":
        d.polygon([(cx, cy - r), (cx + r, cy + 0.8 * r), (cx - r, cy + 0.8 * r)], fill=fill)
    elif shape == "diamond":
        d.polygon([(cx, cy - r), (cx + r, cy), (cx, cy + r), (cx - r, cy)], fill=fill)
    elif shape == "cross":
        w = r * 0.36
        d.rectangle((cx - r, cy - w, cx + r, cy + w), fill=fill)
        d.rectangle((cx - w, cy - r, cx + w, cy + r), fill=fill)
    else:
        raise ValueError(f"unknown shape {shape!r}; expected one of {SHAPES}")


def object_centre(o: Obj, size: int, t: float = 0.0) -> tuple[float, float]:
    """(x, y) pixel centre of an object at time t (velocity moves it, in cells per time unit)."""
    cell = size / GRID
    return (o.col + 0.5 + o.velocity[1] * t) * cell, (o.row + 0.5 + o.velocity[0] * t) * cell


def render(scene: Scene, size: int = 64, t: float = 0.0, supersample: int = 4) -> Image.Image:
    """The scene as a size x size RGB image. Shapes are drawn `supersample` times larger and box-filtered down
    (anti-aliased edges, exact colours inside); text and bars are aligned to whole output pixels (crisp)."""
    ss = supersample
    img = Image.new("RGB", (size * ss, size * ss), BACKGROUND)
    d = ImageDraw.Draw(img)
    if scene.kind == "shapes":
        cell = size / GRID
        for o in scene.objects:
            cx, cy = object_centre(o, size, t)
            _draw_shape(d, o.shape, cx * ss, cy * ss, SIZES[o.size] * cell * ss / 2, COLOURS[o.colour])
    elif scene.kind == "text":
        x0, y0, k = text_layout(scene.text, size)
        fill = COLOURS[scene.text_colour]
        for i, ch in enumerate(scene.text):
            gx = x0 + (GLYPH_W + 1) * k * i
            for r, line in enumerate(FONT[ch]):
                for c, px in enumerate(line):
                    if px == "#":
                        d.rectangle(((gx + c * k) * ss, (y0 + r * k) * ss,
                                     (gx + (c + 1) * k) * ss - 1, (y0 + (r + 1) * k) * ss - 1), fill=fill)
    elif scene.kind == "chart":
        xs, base, unit = chart_layout(len(scene.bars), size)
        for (a, b), bar in zip(xs, scene.bars):
            top = base - int(round(bar.value * unit))
            d.rectangle((a * ss, top * ss, b * ss - 1, base * ss - 1), fill=COLOURS[bar.colour])
        d.rectangle((0, base * ss, size * ss - 1, (base + 1) * ss - 1), fill=AXIS)            # x axis
        x_axis = max(1, xs[0][0] - max(1, size // 32) - 1)
        d.rectangle((x_axis * ss, 0, (x_axis + 1) * ss - 1, (base + 1) * ss - 1), fill=AXIS)    # y axis
    else:
        raise ValueError(f"unknown scene kind {scene.kind!r}")
    return img.reduce(ss) if ss > 1 else img


# ---------------------------------------------------------------------------------------------- examples


@dataclasses.dataclass(frozen=True)
class Turn:
    """One chat turn. A user turn shows `n_images` images (the next ones of the example, in order) before its text:
    rendered as '<image>\\n' * n_images + text."""
    role: str                                   # "user" | "assistant"
    text: str
    n_images: int = 0
    focus: tuple[int, int, int] | None = None   # an answer read off one object: (image of the example, row, col)


@dataclasses.dataclass(frozen=True)
class Example:
    task: str
    scenario: str
    split: str
    index: int
    turns: tuple[Turn, ...]
    images: tuple[Scene, ...]

    @property
    def answer(self) -> str:
        """The final assistant turn (what an evaluation asks the model to produce)."""
        return self.turns[-1].text

    def messages(self, upto_last_answer: bool = False) -> list[dict]:
        """HF chat messages (content lists with {"type": "image"} items) for `apply_chat_template`; with
        upto_last_answer=True the final assistant turn is left out (a generation prompt)."""
        turns = self.turns[:-1] if upto_last_answer else self.turns
        out = []
        for t in turns:
            content = [{"type": "image"} for _ in range(t.n_images)] + [{"type": "text", "text": t.text}]
            out.append({"role": t.role, "content": content})
        return out


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    name: str
    scenario: str
    make: Callable[[random.Random, str], tuple[list[Turn], list[Scene]]]
    weight: float
    ood: bool
    max_images: int


TASKS: dict[str, TaskSpec] = {}


def register(name: str, scenario: str, weight: float = 1.0, ood: bool = False, max_images: int = 1):
    """Add a task to the registry. `make(rng, split) -> (turns, scenes)` must draw its scenes with `scene_in(rng,
    split, ...)` so the split stays disjoint. `ood` tasks are generated for "train" only with `allow_ood=True`."""
    if scenario not in SCENARIOS:
        raise ValueError(f"unknown scenario {scenario!r}; expected one of {SCENARIOS}")

    def deco(fn):
        if name in TASKS:
            raise ValueError(f"task {name!r} registered twice")
        TASKS[name] = TaskSpec(name, scenario, fn, weight, ood, max_images)
        return fn
    return deco


def tasks_of(*scenarios: str, include_ood: bool = True) -> tuple[str, ...]:
    """Names of the registered tasks of the given scenarios (all scenarios when none are given)."""
    bad = [s for s in scenarios if s not in SCENARIOS]
    if bad:
        raise ValueError(f"unknown scenario(s) {bad}; expected {SCENARIOS}")
    return tuple(n for n, t in TASKS.items()
                 if (not scenarios or t.scenario in scenarios) and (include_ood or not t.ood))


def _q(rng: random.Random, templates: Sequence[str], prefix: float = 0.3, **fields) -> str:
    """A question from one of `templates`, with an optional politeness prefix."""
    q = rng.choice(templates).format(**fields)
    if rng.random() < prefix:
        q = rng.choice(("Look at the image. ", "Here is a picture. ", "Please look carefully. ",
                        "Quick question: ", "Hey! ")) + q
    return q


class QA(NamedTuple):
    """A question, its answer, the kind of its short answer, the short answer itself (follow-ups use it), and the
    one object the answer is read off, when there is one."""
    question: str
    answer: str
    kind: str
    short: str
    focus: Obj | None = None


_ONE_WORD = ("Answer with one word.", "Use a single word.", "Be brief.", "Short answer please.")
_NUMBER = ("Answer with a number.", "Reply with a digit.", "Just the number.", "Be brief.")
_PHRASE = ("Be brief.", "Short answer please.", "Keep it short.")
_YESNO = ("Answer yes or no.", "Yes or no?")
_SENTENCE = ("Answer in a full sentence.", "Reply with a complete sentence.", "Use a whole sentence.")
_COLOR = ("colour", "color")
P_SENTENCE = 0.45        # share of questions that ask for a sentence answer (when the question has a sentence form)
P_SHORT_CLAUSE = 0.25    # share that add a "be brief" clause (the answer is short then, as with no clause)


def _styled(rng: random.Random, q: str, kind: str, short: str, sentence: str | None,
            short_clauses: Sequence[str] = (), focus: Obj | None = None) -> QA:
    """The answer style is fixed by the prompt: a sentence clause asks for `sentence`; otherwise the answer is `short`
    (with an optional brevity clause)."""
    r = rng.random()
    if sentence is not None and r < P_SENTENCE:
        return QA(q + " " + rng.choice(_SENTENCE), sentence, kind, short, focus)
    if short_clauses and r > 1.0 - P_SHORT_CLAUSE:
        return QA(q + " " + rng.choice(short_clauses), short, kind, short, focus)
    return QA(q, short, kind, short, focus)


def _there(n: int, singular: str, plural: str) -> str:
    return f"There is 1 {singular}." if n == 1 else f"There are {n} {plural}."


# Each single-image question generator: (rng, scene) -> QA

def _qa_colour(rng: random.Random, s: Scene) -> QA:
    o = rng.choice(s.objects)
    shapes = [x.shape for x in s.objects]
    if shapes.count(o.shape) == 1 and rng.random() < 0.6:
        q = _q(rng, ("What {c} is the {shape}?", "Which {c} is the {shape}?", "What is the {c} of the {shape}?",
                     "Tell me the {c} of the {shape}."), c=rng.choice(_COLOR), shape=o.shape)
        return _styled(rng, q, "colour", o.colour, f"The {o.shape} is {o.colour}.", _ONE_WORD, o)
    q = _q(rng, ("What {c} is the shape in the {pos}?", "Which {c} is the object in the {pos}?",
                 "What is the {c} of the shape in the {pos}?"), c=rng.choice(_COLOR), pos=o.position)
    return _styled(rng, q, "colour", o.colour, f"The shape in the {o.position} is {o.colour}.", _ONE_WORD, o)


def _qa_shape(rng: random.Random, s: Scene) -> QA:
    o = rng.choice(s.objects)
    colours = [x.colour for x in s.objects]
    if colours.count(o.colour) == 1 and rng.random() < 0.5:
        q = _q(rng, ("What shape is the {col} object?", "What is the shape of the {col} object?",
                     "Which shape is {col}?"), col=o.colour)
        return _styled(rng, q, "shape", o.shape, f"The {o.colour} object is a {o.shape}.", _ONE_WORD, o)
    q = _q(rng, ("What shape is in the {pos}?", "Which shape is in the {pos}?",
                 "What kind of shape is in the {pos}?"), pos=o.position)
    return _styled(rng, q, "shape", o.shape, f"The shape in the {o.position} is a {o.shape}.", _ONE_WORD, o)


def _qa_count(rng: random.Random, s: Scene) -> QA:
    mode = rng.choice(("all", "colour", "shape"))
    if mode == "all":
        n = len(s.objects)
        q = _q(rng, ("How many shapes are there?", "How many objects are in the image?", "Count the shapes.",
                     "How many shapes can you see?"))
        return _styled(rng, q, "number", str(n), _there(n, "shape", "shapes"), _NUMBER)
    if mode == "colour":
        c = rng.choice([o.colour for o in s.objects] + [rng.choice(tuple(COLOURS))])
        n = sum(o.colour == c for o in s.objects)
        q = _q(rng, ("How many {c} shapes are there?", "How many {c} objects are in the image?",
                     "Count the {c} shapes."), c=c)
        return _styled(rng, q, "number", str(n), _there(n, f"{c} shape", f"{c} shapes"), _NUMBER)
    sh = rng.choice([o.shape for o in s.objects] + [rng.choice(SHAPES)])
    n = sum(o.shape == sh for o in s.objects)
    q = _q(rng, ("How many {p} are there?", "How many {p} are in the image?", "Count the {p}."), p=PLURAL[sh])
    return _styled(rng, q, "number", str(n), _there(n, sh, PLURAL[sh]), _NUMBER)


def _qa_position(rng: random.Random, s: Scene) -> QA:
    o = rng.choice(s.objects)
    q = _q(rng, ("Where is the {c} {sh}?", "In which part of the image is the {c} {sh}?",
                 "Where can you find the {c} {sh}?", "What is the position of the {c} {sh}?"),
           c=o.colour, sh=o.shape)
    return _styled(rng, q, "position", o.position, f"The {o.colour} {o.shape} is in the {o.position}.", _PHRASE,
                   o)


def _qa_size(rng: random.Random, s: Scene) -> QA:
    o = rng.choice(s.objects)
    q = _q(rng, ("Is the {c} {sh} big or small?", "Is the {c} {sh} small or big?", "How big is the {c} {sh}?",
                 "What size is the {c} {sh}?"), c=o.colour, sh=o.shape)
    return _styled(rng, q, "size", o.size, f"The {o.colour} {o.shape} is {o.size}.", _ONE_WORD, o)


def _qa_exists(rng: random.Random, s: Scene) -> QA:
    if rng.random() < 0.5:
        o = rng.choice(s.objects)
        c, sh = o.colour, o.shape
    else:
        present = {(o.colour, o.shape) for o in s.objects}
        while True:
            o = rng.choice(s.objects)     # near misses: share the colour or the shape of a real object
            c, sh = (o.colour, rng.choice(SHAPES)) if rng.random() < 0.5 else (rng.choice(tuple(COLOURS)), o.shape)
            if (c, sh) not in present:
                break
    match = [x for x in s.objects if x.colour == c and x.shape == sh]
    yes = bool(match)
    q = _q(rng, ("Is there a {c} {sh} in the image?", "Do you see a {c} {sh}?", "Does the picture contain a {c} {sh}?",
                 "Is there any {c} {sh}?"), c=c, sh=sh)
    sentence = f"Yes, there is a {c} {sh}." if yes else f"No, there is no {c} {sh}."
    return _styled(rng, q, "yesno", "yes" if yes else "no", sentence, _YESNO, match[0] if yes else None)


def _qa_text(rng: random.Random, s: Scene) -> QA:
    if rng.random() < 0.75:
        q = _q(rng, ("What does the text say?", "Read the text in the image.", "What is written in the picture?",
                     "What word is shown?", "Which letters are written here?"))
        return _styled(rng, q, "text", s.text, f"The text says {s.text}.", ("Be brief.",))
    q = _q(rng, ("What {c} is the text?", "Which {c} are the letters?", "What is the {c} of the writing?"),
           c=rng.choice(_COLOR))
    return _styled(rng, q, "colour", s.text_colour, f"The text is {s.text_colour}.", _ONE_WORD)


def _qa_chart(rng: random.Random, s: Scene) -> QA:
    mode = rng.choice(("value", "value", "tallest", "shortest", "bars"))
    if mode == "value":
        b = rng.choice(s.bars)
        q = _q(rng, ("What is the value of the {c} bar?", "How high is the {c} bar?",
                     "What number does the {c} bar show?", "Read the value of the {c} bar."), c=b.colour)
        return _styled(rng, q, "number", str(b.value), f"The {b.colour} bar is {b.value}.", _NUMBER)
    if mode in ("tallest", "shortest"):
        b = (max if mode == "tallest" else min)(s.bars, key=lambda x: x.value)
        hi = "highest" if mode == "tallest" else "lowest"
        q = _q(rng, (f"Which bar is the {mode}?", f"What {{c}} is the {mode} bar?", f"Which {{c}} has the {hi} value?"),
               c=rng.choice(_COLOR))
        return _styled(rng, q, "colour", b.colour, f"The {b.colour} bar is the {mode}.", _ONE_WORD)
    n = len(s.bars)
    q = _q(rng, ("How many bars are in the chart?", "How many bars are there?", "Count the bars."))
    return _styled(rng, q, "number", str(n), f"There are {n} bars.", _NUMBER)


def _caption(rng: random.Random, s: Scene) -> QA:
    detailed = rng.random() < 0.5
    if detailed:
        q = _q(rng, ("Describe the image in detail.", "Describe everything you see.",
                     "Give a detailed description of the picture.", "What is in this image? Describe it fully."),
               prefix=0.2)
    else:
        q = _q(rng, ("Describe the image briefly.", "Give a short caption.", "Write a caption for this picture.",
                     "What is in this image? Keep it short."), prefix=0.2)
    a = caption_text(rng, s, detailed)
    return QA(q, a, "caption", a)


def caption_text(rng: random.Random, s: Scene, detailed: bool) -> str:
    """Brief or detailed description of a scene (the content is fixed by the scene; detailed captions open with one
    of three phrasings)."""
    if s.kind == "shapes":
        objs = s.by_position()
        if not detailed:
            parts = [o.phrase() for o in objs]
            body = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
            return body[0].upper() + body[1:] + "."
        n = len(objs)
        noun = "shape" if n == 1 else "shapes"
        opening = rng.choice((f"There {'is' if n == 1 else 'are'} {NUMBER_WORDS[n]} {noun}.",
                              f"I can see {NUMBER_WORDS[n]} {noun}.", f"The image shows {NUMBER_WORDS[n]} {noun}."))
        return " ".join([opening] + [f"{o.phrase('A')} is in the {o.position}." for o in objs])
    if s.kind == "text":
        if not detailed:
            return f"The text {s.text} in {s.text_colour}."
        opening = rng.choice(("The image shows", "I can see", "There is"))
        return f"{opening} the text {s.text} written in {s.text_colour} letters on a gray background."
    n = len(s.bars)
    head = f"A bar chart with {NUMBER_WORDS[n]} bars."
    if not detailed:
        return head
    vals = [f"the {b.colour} bar is {b.value}" for b in s.bars]
    body = ", ".join(vals[:-1]) + " and " + vals[-1]
    return f"{head} From left to right, {body}."


SINGLE_IMAGE_QA: dict[str, tuple[str, Callable]] = {   # vqa task name -> (scene kind, generator)
    "vqa_colour": ("shapes", _qa_colour), "vqa_shape": ("shapes", _qa_shape), "vqa_count": ("shapes", _qa_count),
    "vqa_position": ("shapes", _qa_position), "vqa_size": ("shapes", _qa_size), "vqa_exists": ("shapes", _qa_exists),
    "vqa_text": ("text", _qa_text), "vqa_chart": ("chart", _qa_chart),
}


def answer_turn(qa: QA, image: int = 0) -> Turn:
    """The assistant turn of `qa` about the example's image number `image`, with its focus cell if it has one."""
    focus = (image, qa.focus.row, qa.focus.col) if qa.focus is not None else None
    return Turn("assistant", qa.answer, focus=focus)


def _single_qa_task(kind: str, gen: Callable):
    def make(rng: random.Random, split: str):
        s = scene_in(rng, split, SCENE_MAKERS[kind])
        qa = gen(rng, s)
        return [Turn("user", qa.question, 1), answer_turn(qa)], [s]
    return make


for _name, (_kind, _gen) in SINGLE_IMAGE_QA.items():
    register(_name, "vqa", weight=1.0)(_single_qa_task(_kind, _gen))


@register("caption", "caption", weight=2.0)
def _caption_task(rng: random.Random, split: str):
    kind = rng.choice(("shapes", "shapes", "shapes", "text", "chart"))
    s = scene_in(rng, split, SCENE_MAKERS[kind])
    qa = _caption(rng, s)
    return [Turn("user", qa.question, 1), Turn("assistant", qa.answer)], [s]


def _first_turn(rng: random.Random, split: str) -> tuple[list[Turn], list[Scene], QA]:
    """A random image-grounded first turn (a caption or a single-image question)."""
    if rng.random() < 0.2:
        kind = rng.choice(("shapes", "shapes", "text", "chart"))
        s = scene_in(rng, split, SCENE_MAKERS[kind])
        qa = _caption(rng, s)
    else:
        kind, gen = SINGLE_IMAGE_QA[rng.choice(tuple(SINGLE_IMAGE_QA))]
        s = scene_in(rng, split, SCENE_MAKERS[kind])
        qa = gen(rng, s)
    return [Turn("user", qa.question, 1), answer_turn(qa)], [s], qa


# --- text-only questions (second turns and text chats): rng -> QA

def arithmetic(rng: random.Random) -> QA:
    op = rng.choice(("plus", "minus", "times"))
    if op == "plus":
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        r = a + b
    elif op == "minus":
        a = rng.randint(0, 9)
        b = rng.randint(0, a)
        r = a - b
    else:
        a, b = rng.randint(0, 5), rng.randint(0, 5)
        r = a * b
    q = _q(rng, ("What is {a} {op} {b}?", "Compute {a} {op} {b}.", "How much is {a} {op} {b}?",
                 "Can you tell me what {a} {op} {b} is?"), prefix=0.0, a=a, b=b, op=op)
    return _styled(rng, q, "number", str(r), f"{a} {op} {b} is {r}.", _NUMBER)


def kb_fact(rng: random.Random) -> QA:
    kind = rng.choice(("capital", "capital", "legs", "colour", "food"))
    if kind == "capital":
        country = rng.choice(tuple(KB_COUNTRIES))
        city = KB_COUNTRIES[country]
        q = _q(rng, ("What is the capital of {x}?", "Which city is the capital of {x}?", "Name the capital of {x}."),
               prefix=0.0, x=country)
        return _styled(rng, q, "word", city, f"The capital of {country} is {city}.", _PHRASE)
    name = rng.choice(tuple(KB_CREATURES))
    colour, legs, food = KB_CREATURES[name]
    if kind == "legs":
        q = _q(rng, ("How many legs does a {x} have?", "How many legs has a {x}?", "Count the legs of a {x}."),
               prefix=0.0, x=name)
        return _styled(rng, q, "number", str(legs), f"A {name} has {legs} legs.", _NUMBER)
    if kind == "colour":
        q = _q(rng, ("What {c} is a {x}?", "Which {c} does a {x} have?", "What is the {c} of a {x}?"),
               prefix=0.0, c=rng.choice(_COLOR), x=name)
        return _styled(rng, q, "colour", colour, f"A {name} is {colour}.", _ONE_WORD)
    q = _q(rng, ("What does a {x} eat?", "What is the favourite food of a {x}?", "What do {x}s eat?"),
           prefix=0.0, x=name)
    return _styled(rng, q, "word", food, f"A {name} eats {food}.", _PHRASE)


_NOUN = {"colour": "colour", "shape": "shape", "size": "word", "text": "text", "word": "word"}


def follow_up(rng: random.Random, prev: QA) -> QA | None:
    """A text-only question about the previous answer (its short form), or None when its kind has none."""
    answer, kind = prev.short, prev.kind
    if kind == "number":
        n = int(answer)
        mode = rng.choice(("plus", "double", "parity", "minus"))
        if mode == "plus":
            k = rng.randint(1, 9)
            q = _q(rng, ("What is that number plus {k}?", "Add {k} to that number.", "And if you add {k}?"),
                   prefix=0.0, k=k)
            return _styled(rng, q, "number", str(n + k), f"{n} plus {k} is {n + k}.")
        if mode == "minus" and n > 0:
            k = rng.randint(1, n)
            q = _q(rng, ("What is that number minus {k}?", "Subtract {k} from that number.",
                         "And if you take away {k}?"), prefix=0.0, k=k)
            return _styled(rng, q, "number", str(n - k), f"{n} minus {k} is {n - k}.")
        if mode == "double":
            q = _q(rng, ("What is double that number?", "What is twice that?", "Multiply that by two."), prefix=0.0)
            return _styled(rng, q, "number", str(2 * n), f"Double {n} is {2 * n}.")
        q = _q(rng, ("Is that number even or odd?", "Is that odd or even?", "Is that an even or an odd number?"),
               prefix=0.0)
        parity = "even" if n % 2 == 0 else "odd"
        return _styled(rng, q, "word", parity, f"{n} is an {parity} number.")
    if kind in _NOUN:
        noun = _NOUN[kind]
        modes = ["spell", "letters"] + (["creature"] * 2 if kind == "colour" else []) + \
            (["backwards"] if kind == "text" else ["caps"])
        mode = rng.choice(modes)
        if mode == "creature":
            q = _q(rng, ("Which creature from the fable book has that {c}?", "Name the creature that is that {c}.",
                         "Which fable creature is that {c}?"), prefix=0.0, c=rng.choice(_COLOR))
            name = CREATURE_OF_COLOUR[answer]
            return _styled(rng, q, "word", name, f"The {answer} creature is the {name}.")
        if mode == "spell":
            q = _q(rng, ("Spell that {n}.", "Can you spell the {n}?", "Spell the {n} letter by letter."),
                   prefix=0.0, n=noun)
            return QA(q, "-".join(answer), "spelled", "-".join(answer))
        if mode == "caps":
            q = _q(rng, ("Write that {n} in capital letters.", "Say the {n} again in uppercase.",
                         "Repeat the {n} in capitals."), prefix=0.0, n=noun)
            return QA(q, answer.upper(), "text", answer.upper())
        if mode == "backwards":
            q = _q(rng, ("Write the text backwards.", "What is the text reversed?",
                         "Read the text from right to left."), prefix=0.0)
            return QA(q, answer[::-1], "text", answer[::-1])
        unit = "characters" if kind == "text" else "letters"
        q = _q(rng, ("How many {u} does that {n} have?", "How many {u} are in that {n}?", "Count the {u} of the {n}."),
               prefix=0.0, u=unit, n=noun)
        return _styled(rng, q, "number", str(len(answer)), f"{answer} has {len(answer)} {unit}.")
    if kind == "position":
        r, c = next(k for k, v in POSITIONS.items() if v == answer)
        mode = rng.choice(("left", "top", "bottom", "right"))
        side = {"left": c == 0, "right": c == 2, "top": r == 0, "bottom": r == 2}[mode]
        where = {"left": "on the left side", "right": "on the right side", "top": "in the top row",
                 "bottom": "in the bottom row"}[mode]
        q = _q(rng, (f"Is that {where}?", f"So is it {where}?", f"Would you say that is {where}?"), prefix=0.0)
        return _styled(rng, q, "yesno", "yes" if side else "no",
                       f"Yes, it is {where}." if side else f"No, it is not {where}.")
    return None


def story_text(objs: Sequence[Obj], with_positions: bool) -> str:
    """A short story: one sentence per object, linked by First / Then / Next / After that / Finally."""
    n = len(objs)
    links = {1: ["Once"], 2: ["First", "Then"], 3: ["First", "Then", "Finally"],
             4: ["First", "Then", "Next", "Finally"], 5: ["First", "Then", "Next", "After that", "Finally"]}[n]
    out = []
    for link, o in zip(links, objs):
        where = f" in the {o.position}" if with_positions else ""
        out.append(f"{link}, {o.phrase()} appears{where}.")
    end = "The end." if n > 1 else "That is all."
    return " ".join(out + [end])


@register("turn2_arith", "second_turn", weight=1.0)
def _turn2_arith(rng: random.Random, split: str):
    turns, scenes, _ = _first_turn(rng, split)
    qa = arithmetic(rng)
    return turns + [Turn("user", qa.question), Turn("assistant", qa.answer)], scenes


@register("turn2_fact", "second_turn", weight=1.0)
def _turn2_fact(rng: random.Random, split: str):
    turns, scenes, _ = _first_turn(rng, split)
    qa = kb_fact(rng)
    return turns + [Turn("user", qa.question), Turn("assistant", qa.answer)], scenes


@register("turn2_followup", "second_turn", weight=1.5)
def _turn2_followup(rng: random.Random, split: str):
    while True:
        turns, scenes, first = _first_turn(rng, split)
        qa = follow_up(rng, first)
        if qa is not None:
            return turns + [Turn("user", qa.question), Turn("assistant", qa.answer)], scenes


# --- two images

def _mutate(rng: random.Random, s: Scene) -> tuple[Scene, str, str]:
    """A changed copy of a shapes scene and a one-sentence description of the change (and its kind)."""
    objs = list(s.by_position())
    taken = {(o.colour, o.shape) for o in objs}
    free = [p for p in sorted(POSITIONS) if p not in {(o.row, o.col) for o in objs}]
    modes = ["recolour", "reshape", "resize"] + (["move", "add"] if free else []) + \
        (["remove"] if len(objs) > 1 else [])
    mode = rng.choice(modes)
    if mode == "add":
        r, c = rng.choice(free)
        new = _random_obj(rng, r, c, taken)
        return (Scene("shapes", tuple(sorted(objs + [new], key=lambda o: (o.row, o.col)))),
                f"{new.phrase('A')} was added in the {new.position}.", mode)
    i = rng.randrange(len(objs))
    o = objs[i]
    if mode == "remove":
        rest = objs[:i] + objs[i + 1:]
        return Scene("shapes", tuple(rest)), f"The {o.colour} {o.shape} was removed.", mode
    if mode == "move":
        r, c = rng.choice(free)
        objs[i] = dataclasses.replace(o, row=r, col=c)
        objs.sort(key=lambda x: (x.row, x.col))
        return (Scene("shapes", tuple(objs)),
                f"The {o.colour} {o.shape} moved from the {o.position} to the {POSITIONS[(r, c)]}.", mode)
    if mode == "resize":
        new_size = "small" if o.size == "big" else "big"
        objs[i] = dataclasses.replace(o, size=new_size)
        verb = "shrank" if new_size == "small" else "grew"
        return Scene("shapes", tuple(objs)), f"The {o.colour} {o.shape} {verb} from {o.size} to {new_size}.", mode
    while True:
        if mode == "recolour":
            nc, ns = rng.choice(tuple(COLOURS)), o.shape
        else:
            nc, ns = o.colour, rng.choice(SHAPES)
        if (nc, ns) not in taken:
            break
    objs[i] = dataclasses.replace(o, colour=nc, shape=ns)
    if mode == "recolour":
        return Scene("shapes", tuple(objs)), f"The {o.colour} {o.shape} turned {nc}.", mode
    return Scene("shapes", tuple(objs)), f"The {o.colour} {o.shape} became a {ns}.", mode


@register("two_image_diff", "two_image", weight=1.0, max_images=2)
def _two_image_diff(rng: random.Random, split: str):
    while True:
        a = scene_in(rng, split, random_shapes)
        b, change, _ = _mutate(rng, a)
        if b.split() == split:
            break
    q = _q(rng, ("What is different between the two images?", "What changed from the first picture to the second?",
                 "Spot the difference between these images.", "How does the second image differ from the first?"),
           prefix=0.2)
    return [Turn("user", q, 2), Turn("assistant", change)], [a, b]


@register("two_image_more", "two_image", weight=0.5, max_images=2)
def _two_image_more(rng: random.Random, split: str):
    a = scene_in(rng, split, random_shapes)
    b = scene_in(rng, split, random_shapes)
    na, nb = len(a.objects), len(b.objects)
    short = "the first image" if na > nb else "the second image" if nb > na else "neither"
    sentence = (f"The first image has more shapes, {na} against {nb}." if na > nb else
                f"The second image has more shapes, {nb} against {na}." if nb > na else
                f"Neither, both images have {na} {'shape' if na == 1 else 'shapes'}.")
    q = _q(rng, ("Which image has more shapes?", "Which of the two pictures contains more objects?",
                 "Which image shows more shapes, the first or the second?"))
    qa = _styled(rng, q, "phrase", short, sentence, _PHRASE)
    return [Turn("user", qa.question, 2), Turn("assistant", qa.answer)], [a, b]


# --- out of distribution (heldout only): many images per prompt

@register("ood_story", "ood", weight=1.0, ood=True, max_images=5)
def _ood_story(rng: random.Random, split: str):
    scenes = [scene_in(rng, split, lambda r: random_shapes(r, 1)) for _ in range(5)]
    q = _q(rng, ("Tell a story about these five pictures.", "Write a short story using these images in order.",
                 "Make up a story from these five pictures."), prefix=0.0)
    return [Turn("user", q, 5), Turn("assistant", story_text([s.objects[0] for s in scenes], True))], scenes


@register("ood_count", "ood", weight=1.0, ood=True, max_images=5)
def _ood_count(rng: random.Random, split: str):
    n = rng.randint(3, 5)
    scenes = [scene_in(rng, split, random_shapes) for _ in range(n)]
    total = sum(len(s.objects) for s in scenes)
    q = _q(rng, ("How many shapes are there in these {n} pictures altogether?",
                 "Count all the shapes across the {n} images.", "In total, how many objects do these {n} images show?"),
           n=NUMBER_WORDS[n])
    qa = _styled(rng, q, "number", str(total), f"There are {total} shapes in total.", _NUMBER)
    return [Turn("user", qa.question, n), Turn("assistant", qa.answer)], scenes


# --- text-only chats (text models; also teach the draft the T view's world)

def _text_question(rng: random.Random) -> QA:
    r = rng.random()
    if r < 0.35:
        return arithmetic(rng)
    if r < 0.75:
        return kb_fact(rng)
    word = rng.choice(tuple(COLOURS) + SHAPES)
    mode = rng.choice(("spell", "letters", "caps"))
    if mode == "spell":
        q = _q(rng, ("Spell the word {w}.", "How do you spell {w}?"), prefix=0.0, w=word)
        return QA(q, "-".join(word), "spelled", "-".join(word))
    if mode == "letters":
        q = _q(rng, ("How many letters are in the word {w}?", "Count the letters of {w}."), prefix=0.0, w=word)
        return _styled(rng, q, "number", str(len(word)), f"{word} has {len(word)} letters.")
    q = _q(rng, ("Write {w} in capital letters.", "Uppercase the word {w}."), prefix=0.0, w=word)
    return QA(q, word.upper(), "text", word.upper())


@register("text_chat", "text", weight=1.5, max_images=0)
def _text_chat(rng: random.Random, split: str):
    qa = _text_question(rng)
    turns = [Turn("user", qa.question), Turn("assistant", qa.answer)]
    for _ in range(rng.choice((0, 1, 1, 2))):
        fu = follow_up(rng, qa) if rng.random() < 0.6 else None
        qa = fu if fu is not None else _text_question(rng)
        turns += [Turn("user", qa.question), Turn("assistant", qa.answer)]
    return turns, []


@register("text_story", "text", weight=0.5, max_images=0)
def _text_story(rng: random.Random, split: str):
    objs = random_shapes(rng, rng.randint(2, 4)).objects
    objs = tuple(rng.sample(objs, len(objs)))
    listed = ", ".join(o.phrase() for o in objs[:-1]) + " and " + objs[-1].phrase()
    q = _q(rng, ("Tell a short story about {x}.", "Write a story with {x}, in that order.",
                 "Make up a story about {x}."), prefix=0.0, x=listed)
    return [Turn("user", q), Turn("assistant", story_text(objs, False))], []


# --- the draft's language prior: text-only forms of story and total templates, read by the image draft only. A real
# draft LM is pretrained on web text full of such forms; TABED's text-only view lives on that prior when images
# are out of its distribution. These prompts show no images and are not the OOD prompts.

@register("prior_story", "prior", weight=1.0, max_images=0)
def _prior_story(rng: random.Random, split: str):
    n = rng.randint(2, 5)
    objs = random_shapes(rng, n).objects
    objs = tuple(rng.sample(objs, n))
    q = _q(rng, ("Make up a story about {n} shapes and where they are.", "Tell a story with {n} shapes, saying "
                 "where each one appears.", "Write a short story in which {n} shapes appear one by one."),
           prefix=0.0, n=NUMBER_WORDS[n])
    return [Turn("user", q), Turn("assistant", story_text(objs, True))], []


@register("prior_total", "prior", weight=0.5, max_images=0)
def _prior_total(rng: random.Random, split: str):
    counts = [rng.randint(1, 4) for _ in range(rng.randint(2, 5))]
    listed = ", ".join(map(str, counts[:-1])) + f" and {counts[-1]}"
    n = NUMBER_WORDS[len(counts)]
    q = _q(rng, ("{N} boxes hold {x} shapes. How many shapes are there altogether?",
                 "Add up the shapes in {n} groups of {x}. What is the total?",
                 "There are {n} bags with {x} shapes in them. How many shapes in total?"),
           prefix=0.0, n=n, N=n.capitalize(), x=listed)
    total = sum(counts)
    qa = _styled(rng, q, "number", str(total), f"There are {total} shapes in total.", _NUMBER)
    return [Turn("user", qa.question), Turn("assistant", qa.answer)], []


# ------------------------------------------------------------------------------------------------ streams


def _rng(seed: int, split: str, index: int) -> random.Random:
    return random.Random(f"jspec.zoo/{seed}/{split}/{index}")


def example(split: str, index: int, seed: int = 0, tasks: Sequence[str] | None = None,
            allow_ood: bool = False) -> Example:
    """Example `index` of `split`'s stream: the task is drawn by weight from `tasks` (default: every task allowed in
    the split; OOD tasks are allowed in "train" only when listed in `tasks` with `allow_ood=True`)."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    names = allowed_tasks(split, tasks, allow_ood)
    rng = _rng(seed, split, index)
    name = rng.choices(names, weights=[TASKS[n].weight for n in names])[0] if len(names) > 1 else names[0]
    spec = TASKS[name]
    turns, scenes = spec.make(rng, split)
    return Example(name, spec.scenario, split, index, tuple(turns), tuple(scenes))


def allowed_tasks(split: str, tasks: Sequence[str] | None, allow_ood: bool = False) -> list[str]:
    names = list(tasks) if tasks is not None else [n for n, t in TASKS.items() if split != "train" or not t.ood]
    unknown = [n for n in names if n not in TASKS]
    if unknown:
        raise ValueError(f"unknown task(s) {unknown}; registered: {sorted(TASKS)}")
    if split == "train" and not allow_ood:
        ood = [n for n in names if TASKS[n].ood]
        if ood:
            raise ValueError(f"out-of-distribution task(s) {ood} are held out of 'train' unless allow_ood=True "
                             "(only a target may train on them)")
    if not names:
        raise ValueError("no tasks selected")
    return names


def examples(split: str, n: int, seed: int = 0, tasks: Sequence[str] | None = None,
             start: int = 0, allow_ood: bool = False) -> Iterator[Example]:
    """Examples start .. start + n - 1 of the stream (see `example`)."""
    names = allowed_tasks(split, tasks, allow_ood)
    for i in range(start, start + n):
        yield example(split, i, seed, names, allow_ood)
