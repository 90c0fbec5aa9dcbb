"""Several prompt views of one draft model, drafted as rows of one batch and mixed in probability space (TABED).

A view rewrites the draft's own prompt (the multimodal prompt as the draft reads it); each image is a run of the
draft's image placeholder tokens:
    "M"  the prompt as is (the draft's vision tower reads the images);
    "T"  each image's run becomes one newline token (text only: no tower);
    "P"  each image's run shortened to the tower's patch grid average-pooled `pool` x `pool` before the projector
         (LLaVA-1.5-style drafts);
    "C"  each image's run becomes a captioner's ids for that image ("image: " + its caption).
`build_views` makes them on the host before any compute. The drafter prefills view k of prompt row b into row
k * B + b of one cache of m * B rows, then drafts every view with one forward per tree level: the rows share the
committed tokens, the drafted nodes and the rollback, and differ only in their prompts (own lengths, positions,
padding). Its distribution is q = sum_k w_k softmax(l_k) with per-row weights w [B, m] from the controller's
`Decision.weights` (the drafter's own `weights` without one: uniform by default); the verifier reads this q, so
exactness holds for any weights. Its per-node aux is every view's log-softmax at temperature 1, [B, K, m, V]
(what a weight controller compares with the target's distribution).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jspec.core import sharding as SH
from jspec.core import prefill as PR
from jspec.parts.protocols import Catchup, DraftEnv, Prepared, Setup, TargetPrefill
from jspec.parts.drafters.feed import FeedDrafter, FeedState, draft_log_probs
from jspec.parts.drafters.model import ModelDrafter, check_vocab
from ports.core.prompts import model_prompt, normalize_prompt

VIEWS = ("M", "T", "P", "C")


def reads_images(model) -> bool:
    return model.family.prompt_embeds is not None


def image_runs(row: np.ndarray, image_id: int, counts: list[int]) -> list[tuple[int, int]]:
    """[(start, end)] of each image's placeholder run in a token row, in order. `counts` holds the placeholder
    counts of the images still to place (the row's come first); the row's runs consume them (adjacent images
    share one contiguous run)."""
    is_img = np.concatenate([[False], row == image_id, [False]])
    edges = np.flatnonzero(is_img[1:] != is_img[:-1])
    runs = []
    for s, e in zip(edges[::2], edges[1::2]):
        at = int(s)
        while at < e:
            if not counts:
                raise ValueError(f"the prompt has more image tokens (id {image_id}) than its images take")
            n = counts.pop(0)
            if at + n > e:
                raise ValueError(f"a run of {e - s} image tokens (id {image_id}) does not split into whole images "
                                 f"(next image: {n} tokens): build the prompt with the draft's processor")
            runs.append((at, at + n))
            at += n
    return runs


def image_counts(cfg, extra: dict) -> list[int]:
    """Placeholder tokens each image of a processor mapping takes for a model config, in order."""
    if "pixel_values" not in extra:
        return []
    pv = np.asarray(extra["pixel_values"])
    if hasattr(cfg, "num_image_tokens"):  # anyres (LLaVA-NeXT / OneVision): per image size, tiled or not
        sizes = np.asarray(extra.get("image_sizes", np.zeros((0, 2))))
        if sizes.shape[0] == 0:
            raise ValueError(f"{cfg.model_type} needs image_sizes with pixel_values")
        tiled = [True] * sizes.shape[0]
        if "batch_num_images" in extra:  # a row's single image is tiled, several are not (HF)
            tiled = [int(n) == 1 for n in np.asarray(extra["batch_num_images"]).reshape(-1) for _ in range(int(n))]
        return [int(cfg.num_image_tokens(tuple(int(x) for x in hw), t)) for hw, t in zip(sizes, tiled)]
    return [int(cfg.tokens_per_image)] * pv.shape[0]


def _rewrite(rows: Sequence[np.ndarray], runs: list[list[tuple[int, int]]], fill: Callable[[int], Sequence[int]]):
    """Rows with their image runs replaced: image i (row-major over the batch) by fill(i)."""
    out, i = [], 0
    for row, rr in zip(rows, runs):
        parts, at = [], 0
        for s, e in rr:
            parts += [row[at:s], np.asarray(fill(i), np.int32)]
            at, i = e, i + 1
        out.append(np.concatenate(parts + [row[at:]]).astype(np.int32))
    return out


def image_inputs(extra: dict) -> dict:
    """The per-image arrays of a processor mapping (pixel_values and, for anyres models, image_sizes): what a
    captioner reads."""
    return {k: np.asarray(extra[k]) for k in ("pixel_values", "image_sizes") if k in extra}


def build_views(draft, target, source, views: Sequence[str], newline_id: int | None = None, pool: int = 2,
                captioner=None) -> tuple[list, dict]:
    """([(tokens, lengths, inputs)] per view in `views` order, host stats) for one decode's prompt `source` (the
    draft's prompt: `draft_prompt=` or the target's). Raises ValueError, before any compute, for a view the draft or
    the prompt cannot give."""
    stats: dict = {}
    img_model = draft if reads_images(draft) else target
    image_id = getattr(img_model.config, "image_token_id", None)
    tokens, lengths, extra = normalize_prompt(source, img_model.config.vocab_size)
    rows = [tokens[b, :lengths[b]] for b in range(tokens.shape[0])]
    counts = image_counts(img_model.config, extra) if image_id is not None else []
    n_images, todo = len(counts), list(counts)
    runs = [image_runs(r, image_id, todo) if image_id is not None else [] for r in rows]
    if todo or sum(len(r) for r in runs) != n_images:
        raise ValueError(f"the prompt's image tokens (id {image_id}) do not match its {n_images} image(s) taking "
                         f"{counts} tokens: build the prompt with the draft's processor")
    if n_images == 0 and any(v != "M" for v in views):
        raise ValueError(f"views {tuple(views)} rewrite the prompt's images, and it has none (no run of image "
                         f"token {image_id}): decode text-only prompts with views=('M',) or a plain Chain")
    images = image_inputs(extra)
    out = []
    for v in views:
        if v == "M":
            if not reads_images(draft) and n_images:
                raise ValueError(f"view 'M' needs a draft that reads images; the draft {draft.config.model_type!r} "
                                 "is text-only (use views T / C)")
            out.append(model_prompt(draft, source, "draft "))
        elif v == "T":
            if newline_id is None:
                raise ValueError("view 'T' needs newline_id= (the draft tokenizer's id of '\\n', e.g. 13 for "
                                 "LLaMA / Vicuna)")
            out.append(_text_view(draft, _rewrite(rows, runs, lambda i: [newline_id])))
        elif v == "P":
            if not reads_images(draft):
                raise ValueError(f"view 'P' needs a draft that reads images; {draft.config.model_type!r} is text-only")
            pooled = pooled_model(draft, pool)
            n = image_counts(pooled.config, extra)
            p_rows = _rewrite(rows, runs, lambda i: [image_id] * n[i])
            out.append(model_prompt(pooled, {"input_ids": p_rows, **extra}, "draft (pooled view) "))
        elif v == "C":
            if captioner is None:
                raise ValueError("view 'C' needs a captioner= (e.g. jspec.ModelCaptioner over a model that reads "
                                 "images)")
            t0 = time.perf_counter()
            caps = captioner(images)
            stats["caption_s"] = time.perf_counter() - t0
            if len(caps) != n_images:
                raise ValueError(f"the captioner returned {len(caps)} captions for {n_images} images")
            out.append(_text_view(draft, _rewrite(rows, runs, lambda i: [int(t) for t in caps[i]])))
        else:
            raise ValueError(f"unknown view {v!r}; expected some of {VIEWS}")
    return out, stats


def _text_view(draft, rows):
    tokens, lengths, _ = normalize_prompt(rows, draft.config.vocab_size)
    return tokens, lengths, {}


def pooled_model(model, pool: int):
    """The draft as its P view reads images: same params, features pooled `pool` x `pool` before the projector."""
    if not hasattr(model.config, "pooled"):
        raise ValueError(f"view 'P' pools a LLaVA tower's patch grid; {model.config.model_type!r} has none")
    return dataclasses.replace(model, config=model.config.pooled(pool))


def mix(logp: jax.Array, weights: jax.Array) -> jax.Array:
    """log sum_k w[b, k] exp(logp[k, b, ...]) for per-view log-probabilities [m, B, ...] and weights [B, m]."""
    m = logp.shape[0]
    w = jnp.log(jnp.moveaxis(weights.astype(jnp.float32), 1, 0)).reshape((m, weights.shape[0]) + (1,) * (logp.ndim - 2))
    return jax.nn.logsumexp(logp + w, axis=0)


@struct.dataclass
class MultiViewDrafter(FeedDrafter):
    """Drafts with one model over several prompt views at once (see the module docstring).

    views: a tuple of "M", "T", "P", "C"; weights: [m] used when no controller decides (None: uniform);
    newline_id: the token the T view puts for each image; pool: the P view's pooling factor; captioner: a callable
    `images -> [ids per image]` for the C view (run once per decode, on the host, timed as "caption_s").
    Its feed (`FeedDrafter`) has a row per view and prompt row; the model reads it as `ModelDrafter` does."""

    model: Any
    views: tuple = struct.field(pytree_node=False, default=("M", "T"))
    weights: Any = None
    newline_id: int | None = struct.field(pytree_node=False, default=None)
    pool: int = struct.field(pytree_node=False, default=2)
    captioner: Any = struct.field(pytree_node=False, default=None)

    @property
    def m(self) -> int:
        return len(self.views)

    @property
    def inner(self) -> ModelDrafter:
        return ModelDrafter(self.model)

    def check(self, target) -> None:
        if self.model is None:
            raise ValueError("a multi-view drafter needs a draft model")
        check_vocab(target, self.model)
        views = tuple(self.views)
        if not views or len(set(views)) != len(views) or any(v not in VIEWS for v in views):
            raise ValueError(f"views must be distinct entries of {VIEWS}, got {views!r}")
        if not reads_images(self.model) and "P" in views:
            raise ValueError(f"view 'P' needs a draft that reads images; the draft {self.model.config.model_type!r} "
                             "is text-only (use views T / C)")
        if "P" in views:
            pooled_model(self.model, self.pool)
        if "T" in views and self.newline_id is None:
            raise ValueError("view 'T' needs newline_id= (the draft tokenizer's id of '\\n', e.g. 13 for LLaMA)")
        if "C" in views and self.captioner is None:
            raise ValueError("view 'C' needs captioner= (e.g. jspec.ModelCaptioner)")
        if self.weights is not None and np.shape(self.weights) != (len(views),):
            raise ValueError(f"weights must have one entry per view ({len(views)}), got shape {np.shape(self.weights)}")

    def map_models(self, fn) -> "MultiViewDrafter":
        return self.replace(model=fn(self.model))

    def prepare(self, setup: Setup) -> Prepared:
        if setup.guidance is not None or setup.constraint is not None:
            raise ValueError("guidance / constraint with a multi-view drafter are not supported")
        source = setup.prompt if setup.draft_prompt is None else setup.draft_prompt
        prompts, stats = build_views(self.model, setup.target, source, self.views, self.newline_id, self.pool,
                                     self.captioner)
        for k, (t, _, _) in enumerate(prompts):
            if t.shape[0] != setup.tokens.shape[0]:
                raise ValueError(f"view {self.views[k]} has {t.shape[0]} rows, the prompt has {setup.tokens.shape[0]}")
        model = self.model if setup.mesh is None else SH.replicate(self.model, setup.mesh)
        longest = max(int(np.max(p[1])) for p in prompts)
        width = max(p[0].shape[1] for p in prompts)
        return Prepared(self.replace(model=model, captioner=None), tuple(prompts), longest, width, stats)

    def _tile(self, x):
        return None if x is None else jnp.tile(x, (self.m,) + (1,) * (x.ndim - 1))

    def _env(self, env: DraftEnv) -> DraftEnv:
        return env._replace(last=self._tile(env.last))

    def _weights(self, env: DraftEnv, batch: int) -> jax.Array:
        w = None if env.decision is None else env.decision.weights
        if w is None:
            w = jnp.full((self.m,), 1.0 / self.m) if self.weights is None else jnp.asarray(self.weights, jnp.float32)
            w = jnp.broadcast_to(w, (batch, self.m))
        if w.shape != (batch, self.m):
            raise ValueError(f"ensemble weights must be [B, m] = {(batch, self.m)}, got {w.shape}")
        return w

    def init(self, env: DraftEnv, prefill: TargetPrefill, prompt, max_len: int) -> FeedState:
        B = env.last.shape[0]
        caches = []
        for view, (tokens, lengths, inputs) in zip(self.views, prompt):
            model = pooled_model(self.model, self.pool) if view == "P" else self.model
            cache = PR.new_cache_for(model, B, max_len)
            caches.append(PR.prefill(model, tokens, lengths, cache, inputs)[2])
        return self.fresh(self._env(env), jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=0), *caches))

    def forward(self, env: DraftEnv, tokens, positions, cache, mask=None, offset=0, logits_at=None):
        return self.inner.forward(env, tokens, positions, cache, mask, offset, logits_at)

    def read(self, env: DraftEnv, ds: FeedState, width: int):
        return self.inner.read(env, ds, width)

    def written(self, env: DraftEnv, ds: FeedState, new) -> FeedState:
        return self.inner.written(env, ds, new)

    def _out(self, env: DraftEnv, logits: jax.Array):
        """(mixed log q [B, K, V], per-view log-softmax [B, K, m, V]) from the view rows' logits [m * B, K, V]."""
        B = env.last.shape[0]
        per = draft_log_probs(logits, env).reshape((self.m, B) + logits.shape[1:])
        raw = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1).reshape(per.shape)
        return mix(per, self._weights(env, B)), jnp.moveaxis(raw, 0, 2)

    def root(self, env: DraftEnv, ds: FeedState):
        logits, ds = self.read_feed(self._env(env), ds)
        logq, aux = self._out(env, logits)
        return logq, aux, ds

    def level(self, env: DraftEnv, ds: FeedState, tokens, depth, mask, offset: int, run):
        t = lambda x: None if x is None else self._tile(x)  # noqa: E731
        logits, ds = self.level_logits(self._env(env), ds, t(tokens), t(depth), t(mask), offset, run)
        logq, aux = self._out(env, logits)
        return logq, aux, ds

    def commit(self, env: DraftEnv, ds: FeedState, c: Catchup) -> FeedState:
        t = self._tile
        return super().commit(self._env(env), ds, c._replace(path=t(c.path), new=t(c.new), accepted=t(c.accepted),
                                                              active=t(c.active), fed=t(c.fed)))
