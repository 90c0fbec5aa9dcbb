"""Training sequences and evaluation prompts from the synthetic world.

An `Encoder` turns an `Example` into token ids in the zoo chat format (see `jspec.tools.zoo.tokenizer`) under one of two
views of its images:
    "M"  each '<image>' becomes `image_tokens` copies of the image token id (3); the image model splices the
         projected features of pixel image k over the k-th run of them (LLaVA);
    "T"  each '<image>' becomes the text `t_view_text` (default '\\n', TABED's text-only view); no pixels.
`loss_mask` is 1 exactly on the tokens of assistant answers and the '</s>' that ends each answer.
Images are float32 [3, S, S] arrays normalised as the CLIP image processor of `make_image_processor(S)` does
((x / 255 - CLIP_MEAN) / CLIP_STD), i.e. the `pixel_values` transformers' LlavaProcessor returns for our renders.

Training batches (numpy, fixed shapes, for a jitted step):

    for batch in batches("train", batch_size=32, seq_len=256, seed=0, tasks=DRAFT_TASKS, image_tokens=16):
        ...
    batch["input_ids"]     int32   [B, T]  tokens (pad 0)
    batch["targets"]       int32   [B, T]  next token of the same example (pad 0 where there is none)
    batch["target_mask"]   float32 [B, T]  1 where targets[b, t] is an answer token or its '</s>': the loss is
                                           sum(CE(logits, targets) * target_mask) / sum(target_mask)
    batch["loss_mask"]     float32 [B, T]  the same, aligned with input_ids (1 where input_ids[b, t] is answer/EOS)
    batch["segment_ids"]   int32   [B, T]  1, 2, ... per packed example in the row, 0 on padding: attend only
                                           within a segment (causal, segment_ids[q] == segment_ids[k] > 0)
    batch["positions"]     int32   [B, T]  position within its example (restarts at 0 per segment)
    batch["attention_mask"] int32  [B, T]  1 on tokens, 0 on padding
    batch["pixel_values"]  float32 [B, K, 3, S, S]  image k of row b (in the order of the image-token runs)
    batch["image_mask"]    bool    [B, K]  which of the K image slots are real
    batch["target_focus"]  int32   [B, T]  where targets[b, t] is an answer token read off one object
                                           (`Turn.focus`) and each image has one token per grid cell: the row
                                           position of that object's cell token; -1 elsewhere
    batch["next_index"]    int64   []      resume with batches(..., start=next_index)

With pack=True several examples share a row (next-fit, up to K images per row); with pack=False each row holds one
example (segment_ids is then 1 on the example). Examples longer than seq_len (or with more than K images) are
skipped and counted in `Stats`. The stream is endless and deterministic: example i of a split depends only on
(seed, split, i, tasks), so a resumed run sees the same data as an uninterrupted one.

Evaluation: `eval_set(scenario, n)` gives held-out examples balanced over that scenario's tasks, and
`Encoder.prompt(example)` the model input for generating its final answer (a mapping like an HF processor's output:
input_ids [1, L], attention_mask, pixel_values [n_images, 3, S, S] in the M view), to compare with `example.answer`.

Task sets: TARGET_TASKS (every image-world task, the multi-image OOD ones included: the target may know them),
DRAFT_TASKS (single-image and text-only tasks: multi-image prompts stay out of the draft's distribution, as in
TABED; plus the draft's own language prior, the "prior" scenario: text-only stories with positions and totals of
counts, which no target reads), TEXT_TASKS (text-only chats, for text models). OOD tasks are produced for "train"
only with `allow_ood=True`, which only the target's training passes.
"""
from __future__ import annotations

import dataclasses
import random
import time
from collections import defaultdict
from typing import Iterator, Sequence

import numpy as np

from jspec.tools.zoo import tokenizer as TK
from jspec.tools.zoo import world as ZW

CLIP_MEAN = np.array([0.48145466, 0.4578275, 0.40821073], np.float32)
CLIP_STD = np.array([0.26862954, 0.26130258, 0.27577711], np.float32)
# uint8 value -> normalised float, per channel: [3, 256]
_LUT = ((np.arange(256, dtype=np.float32)[None, :] / np.float32(255.0)) - CLIP_MEAN[:, None]) / CLIP_STD[:, None]

TARGET_TASKS = ZW.tasks_of("caption", "vqa", "second_turn", "two_image", "text", "ood")
DRAFT_TASKS = tuple(n for n in TARGET_TASKS if ZW.TASKS[n].max_images <= 1 and not ZW.TASKS[n].ood) + ZW.tasks_of("prior")
TEXT_TASKS = ZW.tasks_of("text")
VIEWS = ("M", "T")

# Text versions of the image tasks, for the text pair: each image is replaced by its detailed description, so
# VQA-style questions about scenes exist in text form and every answer follows from the prompt. Registered in the
# world's task registry (scenario "text", no images) by `register_described_tasks()`; the task sets above are
# fixed before that, so they never include them.
DESCRIBED = {  # task name -> (inner tasks, weight)
    "described_vqa": (tuple(ZW.tasks_of("vqa")), 1.0),
    "described_caption": (("caption",), 0.5),
    "described_turn2": (tuple(ZW.tasks_of("second_turn")), 0.5),
}
TEXT_PAIR_TASKS = TEXT_TASKS + tuple(DESCRIBED)  # what the text pair is trained on


def described(turns, scenes, rng) -> list:
    """The turns with each image replaced by 'Picture: <its detailed description>\\n' in front of the text."""
    out, k = [], 0
    for t in turns:
        if t.n_images:
            pics = "".join(f"Picture: {ZW.caption_text(rng, s, detailed=True)}\n" for s in scenes[k:k + t.n_images])
            k += t.n_images
            out.append(ZW.Turn(t.role, pics + t.text, 0))
        else:
            out.append(ZW.Turn(t.role, t.text, t.n_images))   # no focus: there is no image to look at
    return out


def _described_task(inner: tuple[str, ...]):
    def make(rng, split):
        name = rng.choices(inner, weights=[ZW.TASKS[n].weight for n in inner])[0] if len(inner) > 1 else inner[0]
        turns, scenes = ZW.TASKS[name].make(rng, split)
        return described(turns, scenes, rng), []
    return make


def register_described_tasks() -> None:
    """Add the `described_*` tasks to the world's registry (scenario "text", no images); idempotent."""
    for name, (inner, weight) in DESCRIBED.items():
        if name not in ZW.TASKS:
            ZW.register(name, "text", weight=weight, max_images=0)(_described_task(inner))


def pixels(scene: ZW.Scene, size: int = 64) -> np.ndarray:
    """The rendered scene as CLIP-normalised float32 [3, size, size]."""
    a = np.asarray(ZW.render(scene, size))                      # [S, S, 3] uint8
    return np.stack([_LUT[c][a[..., c]] for c in range(3)])


@dataclasses.dataclass
class Encoded:
    ids: np.ndarray          # int32 [L]
    loss_mask: np.ndarray    # uint8 [L]: 1 on answer tokens and their EOS
    images: tuple            # the Scenes whose features fill the image-token runs, in order (M view); () in T view
    focus: np.ndarray        # int32 [L]: on the answer tokens of a turn with a focus, the index in `ids` of the
                             # focus cell's image token (M view, one token per grid cell); -1 elsewhere


class Encoder:
    """Example -> token ids under a view (see module docstring). Caches the encodings of repeated text pieces."""

    def __init__(self, tokenizer=None, image_tokens: int = 16, image_size: int = 64, view: str = "M",
                 t_view_text: str = "\n"):
        if view not in VIEWS:
            raise ValueError(f"unknown view {view!r}; expected one of {VIEWS}")
        if image_tokens < 1:
            raise ValueError(f"image_tokens must be >= 1, got {image_tokens}")
        self.tokenizer = tokenizer if tokenizer is not None else TK.load_tokenizer()
        self._backend = getattr(self.tokenizer, "backend_tokenizer", self.tokenizer)
        for i, s in enumerate(TK.SPECIAL_TOKENS):
            if self._backend.token_to_id(s) != i:
                raise ValueError(f"tokenizer maps {s!r} to {self._backend.token_to_id(s)}, the zoo format needs {i}")
        self.image_tokens, self.image_size, self.view, self.t_view_text = image_tokens, image_size, view, t_view_text
        self._cache: dict[str, list[int]] = {}

    def text_ids(self, text: str) -> list[int]:
        ids = self._cache.get(text)
        if ids is None:
            ids = self._backend.encode(text, add_special_tokens=False).ids
            if len(self._cache) < 200_000:
                self._cache[text] = ids
        return ids

    def encode(self, example: ZW.Example, upto_last_answer: bool = False, view: str | None = None) -> Encoded:
        """Token ids and loss mask of the whole example (or of the prompt for its final answer)."""
        view = self.view if view is None else view
        if view not in VIEWS:
            raise ValueError(f"unknown view {view!r}; expected one of {VIEWS}")
        turns = example.turns[:-1] if upto_last_answer else example.turns
        ids, mask, focus = [TK.BOS_ID], [0], [-1]
        used, runs = 0, []
        cells = view == "M" and self.image_tokens == ZW.GRID ** 2
        for t in turns:
            if t.role == "user":
                seg = [TK.USER_ID]
                if view == "M":
                    for k in range(t.n_images):
                        runs.append(len(ids) + len(seg))
                        seg += [TK.IMAGE_ID] * self.image_tokens
                        seg += self.text_ids("\n" + (t.text if k == t.n_images - 1 else ""))
                    if t.n_images == 0:
                        seg += self.text_ids(t.text)
                else:
                    seg += self.text_ids((self.t_view_text + "\n") * t.n_images + t.text)
                used += t.n_images
                ids += seg
                mask += [0] * len(seg)
                focus += [-1] * len(seg)
            elif t.role == "assistant":
                ans = self.text_ids(t.text) + [TK.EOS_ID]
                ids += [TK.ASSISTANT_ID] + ans
                mask += [0] + [1] * len(ans)
                f = -1
                if cells and t.focus is not None:
                    image, row, col = t.focus
                    if image >= len(runs):
                        raise ValueError(f"{example.task} example {example.index}: an answer's focus is on image "
                                         f"{image}, but the turns before it show {len(runs)} image(s)")
                    f = runs[image] + row * ZW.GRID + col
                focus += [-1] + [f] * len(ans)
            else:
                raise ValueError(f"unknown chat role {t.role!r}")
        if upto_last_answer:
            ids.append(TK.ASSISTANT_ID)
            mask.append(0)
            focus.append(-1)
        images = tuple(example.images[:used]) if view == "M" else ()
        return Encoded(np.asarray(ids, np.int32), np.asarray(mask, np.uint8), images, np.asarray(focus, np.int32))

    def prompt(self, example: ZW.Example, view: str | None = None) -> dict:
        """Model input for generating the example's final answer (batch of 1), like an HF processor's output."""
        enc = self.encode(example, upto_last_answer=True, view=view)
        out = {"input_ids": enc.ids[None], "attention_mask": np.ones((1, len(enc.ids)), np.int32)}
        if enc.images:
            out["pixel_values"] = np.stack([pixels(s, self.image_size) for s in enc.images])
        return out


@dataclasses.dataclass
class Stats:
    """Counters of a `batches` stream."""
    examples: int = 0
    skipped: int = 0            # longer than seq_len or with more images than a row holds
    tokens: int = 0             # real (non-pad) tokens emitted
    answer_tokens: int = 0
    slots: int = 0              # B * T summed over batches

    @property
    def fill(self) -> float:
        return self.tokens / max(1, self.slots)


def _view_of(seed: int, split: str, index: int, t_view_prob: float, view: str) -> str:
    if t_view_prob <= 0.0:
        return view
    if t_view_prob >= 1.0:
        return "T"
    return "T" if random.Random(f"view/{seed}/{split}/{index}").random() < t_view_prob else view


def batches(split: str, batch_size: int, seq_len: int, seed: int = 0, *, tasks: Sequence[str] | None = None,
            view: str = "M", t_view_prob: float = 0.0, t_view_text: str = "\n", image_tokens: int = 16,
            image_size: int = 64, images_per_row: int | None = None, pack: bool = True, tokenizer=None,
            encoder: Encoder | None = None, start: int = 0, stats: Stats | None = None,
            allow_ood: bool = False) -> Iterator[dict]:
    """Endless stream of fixed-shape numpy batches (keys in the module docstring).

    tasks: task names (default: every task allowed in the split; see TARGET_TASKS / DRAFT_TASKS / TEXT_TASKS).
    view / t_view_prob: the view of each example ("M", or "T" with probability t_view_prob, chosen per example).
    images_per_row (K): image slots per row; default the most images one example of `tasks` has, or, when packing,
        seq_len // (image_tokens + 24) if that is more (rows then fill ~90%); 0 in the pure T view. The vision
        tower runs on all B*K slots, so keep it small.
    stats: pass a `Stats` to count skipped examples and the fill rate.
    allow_ood: let `tasks` name OOD tasks in "train" (a target's data; a draft must never see them).
    """
    if batch_size < 1 or seq_len < 8:
        raise ValueError(f"batch_size must be >= 1 and seq_len >= 8, got {batch_size}, {seq_len}")
    if view not in VIEWS:
        raise ValueError(f"unknown view {view!r}; expected one of {VIEWS}")
    names = ZW.allowed_tasks(split, tasks, allow_ood)
    enc = encoder or Encoder(tokenizer, image_tokens, image_size, view, t_view_text)
    any_m = view == "M" and t_view_prob < 1.0
    if images_per_row is None:
        most = max(ZW.TASKS[n].max_images for n in names)
        images_per_row = (max(most, seq_len // (image_tokens + 24)) if pack else most) if any_m else 0
    K, S, B, T = images_per_row, enc.image_size, batch_size, seq_len
    stats = stats if stats is not None else Stats()
    index = start

    def new_batch():
        return {"input_ids": np.zeros((B, T), np.int32), "loss_mask": np.zeros((B, T), np.float32),
                "segment_ids": np.zeros((B, T), np.int32), "positions": np.zeros((B, T), np.int32),
                "pixel_values": np.zeros((B, K, 3, S, S), np.float32), "image_mask": np.zeros((B, K), bool),
                "focus": np.full((B, T), -1, np.int32)}

    while True:
        out, row, used, n_img, seg = new_batch(), 0, 0, 0, 0
        while row < B:
            ex = ZW.example(split, index, seed, names, allow_ood)
            e = enc.encode(ex, view=_view_of(seed, split, index, t_view_prob, view))
            index += 1
            stats.examples += 1
            L, k = len(e.ids), len(e.images)
            if L > T or k > K:
                stats.skipped += 1
                continue
            if used and (not pack or used + L > T or n_img + k > K):
                row, used, n_img, seg = row + 1, 0, 0, 0
                if row == B:
                    index -= 1                          # this example opens the next batch
                    stats.examples -= 1
                    break
            seg += 1
            out["input_ids"][row, used:used + L] = e.ids
            out["loss_mask"][row, used:used + L] = e.loss_mask
            out["segment_ids"][row, used:used + L] = seg
            out["positions"][row, used:used + L] = np.arange(L)
            out["focus"][row, used:used + L] = np.where(e.focus >= 0, e.focus + used, -1)
            for j, s in enumerate(e.images):
                out["pixel_values"][row, n_img + j] = pixels(s, S)
                out["image_mask"][row, n_img + j] = True
            used, n_img = used + L, n_img + k
            stats.tokens += L
            stats.answer_tokens += int(e.loss_mask.sum())
        same = np.zeros((B, T), bool)
        same[:, :-1] = (out["segment_ids"][:, 1:] == out["segment_ids"][:, :-1]) & (out["segment_ids"][:, :-1] > 0)
        targets = np.zeros((B, T), np.int32)
        targets[:, :-1] = out["input_ids"][:, 1:]
        out["targets"] = np.where(same, targets, TK.PAD_ID).astype(np.int32)
        tm = np.zeros((B, T), np.float32)
        tm[:, :-1] = out["loss_mask"][:, 1:]
        out["target_mask"] = np.where(same, tm, 0.0).astype(np.float32)
        tf = np.full((B, T), -1, np.int32)
        tf[:, :-1] = out.pop("focus")[:, 1:]
        out["target_focus"] = np.where(same, tf, -1).astype(np.int32)
        out["attention_mask"] = (out["segment_ids"] > 0).astype(np.int32)
        out["next_index"] = np.asarray(index, np.int64)
        stats.slots += B * T
        yield out


def eval_set(scenario: str, n: int = 100, seed: int = 0, tasks: Sequence[str] | None = None) -> list[ZW.Example]:
    """n held-out examples of one scenario, round-robin over its tasks (or over `tasks`)."""
    names = list(tasks) if tasks is not None else list(ZW.tasks_of(scenario))
    bad = [t for t in names if t not in ZW.TASKS or ZW.TASKS[t].scenario != scenario]
    if bad or not names:
        raise ValueError(f"{bad or 'no tasks'}: expected tasks of scenario {scenario!r}: {ZW.tasks_of(scenario)}")
    return [ZW.example("heldout", i, seed, [names[i % len(names)]]) for i in range(n)]


def eval_sets(n: int = 100, seed: int = 0) -> dict[str, list[ZW.Example]]:
    """`eval_set` for every scenario."""
    return {s: eval_set(s, n, seed) for s in ZW.SCENARIOS}


def length_stats(split: str = "train", n: int = 5000, seed: int = 0, image_tokens: int = 16, view: str = "M",
                 tokenizer=None, encoder: Encoder | None = None) -> dict[str, dict[str, float]]:
    """Sequence-length statistics per scenario (mean / p95 / max tokens, mean answer tokens) of n examples of
    `split` (held-out: balanced eval sets of n per scenario)."""
    enc = encoder or Encoder(tokenizer, image_tokens=image_tokens, view=view)
    if split == "train":
        exs = list(ZW.examples("train", n, seed))
    else:
        exs = [e for s in ZW.SCENARIOS for e in eval_set(s, n, seed)]
    by: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for ex in exs:
        e = enc.encode(ex, view=view)
        by[ex.scenario].append((len(e.ids), int(e.loss_mask.sum())))
    out = {}
    for sc, v in sorted(by.items()):
        a = np.array(v)
        out[sc] = {"n": len(a), "mean": float(a[:, 0].mean()), "p95": float(np.percentile(a[:, 0], 95)),
                   "max": int(a[:, 0].max()), "answer_mean": float(a[:, 1].mean())}
    return out


def benchmark(n: int = 50_000, image_tokens: int = 16, image_size: int = 64, seq_len: int = 256,
              batch_size: int = 32) -> dict[str, float]:
    """Seconds to generate n examples, to encode them, and examples/s of the full batch pipeline (with pixels)."""
    t0 = time.perf_counter()
    exs = list(ZW.examples("train", n))
    t1 = time.perf_counter()
    enc = Encoder(image_tokens=image_tokens, image_size=image_size)
    for ex in exs:
        enc.encode(ex)
    t2 = time.perf_counter()
    st = Stats()
    it = batches("train", batch_size, seq_len, image_tokens=image_tokens, image_size=image_size, stats=st,
                 encoder=enc)
    t3 = time.perf_counter()
    while st.examples < min(n, 20_000):
        next(it)
    t4 = time.perf_counter()
    return {"generate_s": t1 - t0, "encode_s": t2 - t1, "pipeline_examples_per_s": st.examples / (t4 - t3),
            "fill": st.fill}
