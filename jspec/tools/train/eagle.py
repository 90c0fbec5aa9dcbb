"""Training an EAGLE-1 feature head (`jspec.parts.drafters.eagle.EagleHead`) on a frozen target: LANTERN++ 2.2 / EAGLE-1.

For a batch of token sequences x [B, T] the target runs once (no gradient) and gives its features f [B, T, D]
(its last hidden state after the final norm, `eagle.features`). The head then runs over the entries
(x_{j+1}, f_j + noise), j = 0 .. T - 1, from a fresh cache (`eagle.head_forward(..., fresh=True)`), and its
prediction f-hat_j is compared with the target's next feature f_{j+1}:

    loss_j = SmoothL1_beta=1(f-hat_j, f_{j+1}) (mean over D) + p_w * CE(softmax(lm(f_{j+1})), log_softmax(lm(f-hat_j)))

with lm the target's frozen LM head (`eagle.lm_logits`), averaged over the entries the mask weights (p_w = 0.1).
Only the head's parameters train; the target (its embedding and LM head included) is frozen. Feature noise is
EAGLE's uniform (U - 0.5) * noise * 512 / L with L the row's length in real tokens (EAGLE's sequence length; a
packed row's sum of its sequences'), noise = 0.2; 0 disables. The scale is EAGLE's, made for rows of hundreds or
thousands of tokens: short rows get large noise (at L = 32 it is +-1.6 on features of RMS 1).

Masks. `mask[b, j]` weights entry j: the prediction f-hat_j of f_{j+1}, made from token x_{j+1}. The convention
is the next-token one: mask[j] = 1 when x_{j+1} is a token the target generates (an answer token of a chat, an
image token of a text-to-image sample), which is the zoo's `target_mask`. The last position (no next feature) and
entries that cross a packed sequence's end never count.

Classifier-free guidance (LANTERN++ trains each sample as the conditional sequence w.p. 0.9 and as the
unconditional one, the same generated tokens after the unconditional prompt, w.p. 0.1; no CFG in the loss): a
batch may carry both forms, the conditional under input_ids / positions / mask / lengths and the unconditional
under u_input_ids / u_positions / u_mask / u_lengths, and each row picks one with a key (`uncond_prob`).

Batches (what `batches` makes from token sequences and `fit` consumes) are dicts of numpy arrays:
input_ids, positions [B, T] int32 and mask [B, T] float32, and either lengths [B] (one sequence per row, right
padded: the target and the head attend causally, blockwise for long rows) or segment_ids [B, T] (packed rows, 1,
2, ... per sequence, 0 on padding: attention stays inside a sequence).

The optimizer is `jspec.tools.train.trainer.adamw` (b1 0.9, b2 0.95) after a per-value gradient clip (0.5), with the
warmup-then-decay schedule of `jspec.tools.train.trainer` (warmup 3% of the steps); `train_head` runs `jspec.tools.train.trainer.fit`
(progress, time budget, orbax checkpoints, exact resume). Logged per window: loss, vloss (SmoothL1), ploss (CE),
top1 (the head's argmax = the target's on weighted entries, a cheap proxy of acceptance), grad_norm.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ports.core import cache as kvc
from jspec.tools.train import trainer as jt
from jspec.parts.drafters import eagle as EG
from ports.families import chameleon as CH
from ports.families import llama



@dataclasses.dataclass(frozen=True)
class LossOptions:
    """p_w: weight of the CE term; noise: the uniform feature noise's scale (0: none); uncond_prob: the chance a
    row trains on its unconditional form (when the batch carries one); beta: SmoothL1's transition point."""

    p_w: float = 0.1
    noise: float = 0.2
    uncond_prob: float = 0.1
    beta: float = 1.0


# ---------------------------------------------------------------------------------------------- the loss


def _forward_fn(cfg):
    return CH.forward if EG.family_of(cfg) == "chameleon" else llama.forward


def target_features(cfg, lm: dict, ids: jax.Array, positions: jax.Array, new_mask=None) -> jax.Array:
    """The target's features f [B, T, D] (float32, no gradient) over token rows: one fresh forward of all its
    layers, its last hidden state after the final norm."""
    B, T = ids.shape
    cache = kvc.init_cache(cfg.num_layers, B, cfg.num_kv_heads, T, cfg.head_dim, lm["embed"].dtype)
    fo = _forward_fn(cfg)(cfg, lm, ids, positions, cache, new_mask, hidden_layers=(cfg.num_layers,),
                          compute_logits=False, fresh=True)
    return jax.lax.stop_gradient(EG.features(cfg, lm, fo.hidden[0]).astype(jnp.float32))


def pick_rows(batch: dict, key: jax.Array, uncond_prob: float) -> tuple[dict, jax.Array]:
    """(the batch with each row's conditional or unconditional form, [B] bool: which rows took the latter). A
    batch without unconditional forms passes through."""
    B = batch["input_ids"].shape[0]
    base = {k: v for k, v in batch.items() if not k.startswith("u_")}
    if "u_input_ids" not in batch or uncond_prob <= 0:
        return base, jnp.zeros((B,), bool)
    pick = jax.random.bernoulli(key, uncond_prob, (B,))
    out = {}
    for k, v in base.items():
        u = batch.get("u_" + k)
        out[k] = v if u is None else jnp.where(pick.reshape((B,) + (1,) * (v.ndim - 1)), u, v)
    return out, pick


def entries(batch: dict):
    """The head's view of a batch: (next tokens [B, T] (x_{j+1}; 0 past the end), their positions [B, T], the
    entry weights [B, T], the row's length (its real tokens, the noise scale's L) per entry [B, T], the target's
    attention mask (None: causal) and the head's [B, T, T])."""
    ids, pos = batch["input_ids"], batch["positions"]
    B, T = ids.shape
    nxt = jnp.concatenate([ids[:, 1:], jnp.zeros((B, 1), ids.dtype)], axis=1)
    npos = jnp.concatenate([pos[:, 1:], pos[:, -1:] + 1], axis=1)
    m = batch["mask"].astype(jnp.float32) * (jnp.arange(T) < T - 1)[None]
    causal = jnp.tril(jnp.ones((T, T), bool))[None]
    if "segment_ids" in batch:
        seg = batch["segment_ids"]
        same = jnp.concatenate([(seg[:, 1:] == seg[:, :-1]) & (seg[:, :-1] > 0), jnp.zeros((B, 1), bool)], 1)
        m = m * same
        vis = jt.segment_mask(seg)
        lengths = jnp.broadcast_to((seg > 0).sum(1, keepdims=True).astype(jnp.float32), (B, T))
        return nxt, npos, m, lengths, vis, vis
    lengths = jnp.broadcast_to(batch["lengths"].astype(jnp.float32)[:, None], (B, T))
    return nxt, npos, m, lengths, None, jnp.broadcast_to(causal, (B, T, T))


def smooth_l1(a: jax.Array, b: jax.Array, beta: float = 1.0) -> jax.Array:
    d = jnp.abs(a - b)
    return jnp.where(d < beta, 0.5 * d * d / beta, d - 0.5 * beta)


def loss_terms(cfg, lm: dict, head: EG.EagleHead, batch: dict, key: jax.Array | None, opts: LossOptions):
    """(loss, {loss, vloss, ploss, top1, weight}) of one batch (module docstring); key None: no noise, no
    unconditional rows (evaluation)."""
    if key is None:
        batch, _ = pick_rows(batch, jax.random.key(0), 0.0)
    else:
        k_pick, k_noise = jax.random.split(key)
        batch, _ = pick_rows(batch, k_pick, opts.uncond_prob)
    nxt, npos, m, lengths, tvis, hvis = entries(batch)
    f = target_features(cfg, lm, batch["input_ids"], batch["positions"], tvis)
    B, T, D = f.shape
    f_in = f
    if key is not None and opts.noise > 0:
        u = jax.random.uniform(k_noise, f.shape, jnp.float32)
        f_in = f + (u - 0.5) * (opts.noise * 512.0 / jnp.maximum(lengths, 1.0))[..., None]
    f_next = jnp.concatenate([f[:, 1:], jnp.zeros((B, 1, D), f.dtype)], axis=1)
    emb = llama.embed(lm, nxt).astype(jnp.float32)
    cache = kvc.init_cache(1, B, cfg.num_kv_heads, T, cfg.head_dim, jnp.float32)
    fhat, _ = EG.head_forward(cfg, head, emb, f_in, npos, cache, new_mask=hvis, fresh=True)
    fhat = fhat.astype(jnp.float32)
    vl = smooth_l1(fhat, f_next, opts.beta).mean(-1)
    lt = EG.lm_logits(cfg, lm, f_next)
    lh = EG.lm_logits(cfg, lm, fhat)
    p = jax.nn.softmax(lt, axis=-1)
    logp = jax.nn.log_softmax(lh, axis=-1)
    ce = -jnp.sum(jnp.where(p > 0, p * logp, 0.0), axis=-1)
    top1 = (jnp.argmax(lh, -1) == jnp.argmax(lt, -1)).astype(jnp.float32)
    vloss, ploss = jt.masked_mean(vl, m), jt.masked_mean(ce, m)
    loss = vloss + opts.p_w * ploss
    return loss, {"loss": loss, "vloss": vloss, "ploss": ploss, "top1": jt.masked_mean(top1, m), "weight": m.sum()}


# ---------------------------------------------------------------------------------------------- optimizer


@functools.lru_cache(maxsize=None)
def optimizer(weight_decay: float = 0.0, clip_value: float = 0.5, clip_norm: float = math.inf
              ) -> optax.GradientTransformation:
    """Per-value gradient clipping (EAGLE / LANTERN: 0.5) then `jspec.tools.train.trainer.adamw` (b1 0.9, b2 0.95; its global-
    norm clip off unless `clip_norm`); the learning rate lives in the state (`set_lr`). Cached: equal arguments
    give the same object, so the compiled steps of equal runs are shared."""
    return optax.chain(optax.clip(clip_value), jt.adamw(weight_decay, b1=0.9, b2=0.95, clip=clip_norm))


def set_lr(opt_state, lr):
    """`optimizer`'s state with its learning rate set to `lr` (traceable)."""
    return opt_state[0], jt.set_lr(opt_state[1], lr)


def _loss(static, params, lm, batch, key):
    cfg, spec, opts = static
    loss, aux = loss_terms(cfg, lm, EG.EagleHead(params, *spec), batch, key, opts)
    return loss, {k: v for k, v in aux.items() if k != "weight"}


def _sums(static, params, lm, batch):
    cfg, spec, opts = static
    _, aux = loss_terms(cfg, lm, EG.EagleHead(params, *spec), batch, None, opts)
    return {k: (aux[k] * aux["weight"], aux["weight"]) for k in ("loss", "vloss", "ploss", "top1")}


def training_config(target):
    """The target's text config as the loss reads it: a Chameleon's LM head raw (HF's text-mode suppression of the
    image tokens off, as LANTERN's loss reads `lm_head` directly), whatever mode the target is in."""
    cfg, _ = EG.text_parts(target)
    if getattr(cfg, "suppress_image_logits", False):
        cfg = dataclasses.replace(cfg, suppress_image_logits=False)
    return cfg


def make_steps(target, head: EG.EagleHead, tx: optax.GradientTransformation, opts: LossOptions = LossOptions()
               ) -> jt.Steps:
    """`jspec.tools.train.trainer.make_steps` of the EAGLE loss: train(params, opt_state, lr, lm, batch, key),
    eval(params, lm, batch). `lm` is the target's language-model params (`eagle.text_parts(target)[1]`), an
    argument so it is not baked into the compiled program."""
    spec = (head.family, head.input_norm, head.target)
    return jt.make_steps(_loss, _sums, (training_config(target), spec, opts), tx, set_lr)


def evaluate(eval_step, params, lm, batches) -> dict:
    """Held-out means over `batches` (no noise, conditional rows): heldout_loss, _vloss, _ploss, _top1."""
    return jt.evaluate(eval_step, params, batches, lm)


def step_key(seed: int, step: int) -> jax.Array:
    """The noise / row-pick key of training step `step` (a function of the seed and the step alone, so a resumed
    run draws what an uninterrupted one does)."""
    return jax.random.fold_in(jax.random.key(seed), step)


# ---------------------------------------------------------------------------------------------- data


def generated_mask(length: int, first_generated: int) -> np.ndarray:
    """The entry mask [length] of a sequence whose tokens from index `first_generated` on are the target's
    (mask[j] = 1 when token j + 1 is one of them)."""
    m = np.zeros(length, np.float32)
    m[max(first_generated - 1, 0):length - 1] = 1.0
    return m


def cfg_item(cond_prompt, uncond_prompt, generated) -> dict:
    """One CFG training sample: the generated tokens after the conditional and after the unconditional prompt,
    with masks over the generated part (what `batches` takes)."""
    c = np.concatenate([np.asarray(cond_prompt, np.int32), np.asarray(generated, np.int32)])
    u = np.concatenate([np.asarray(uncond_prompt, np.int32), np.asarray(generated, np.int32)])
    return {"tokens": c, "mask": generated_mask(len(c), len(cond_prompt)),
            "uncond_tokens": u, "uncond_mask": generated_mask(len(u), len(uncond_prompt))}


def _as_item(x) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
    """(tokens, mask, uncond tokens, uncond mask) of a data item: a token array, (tokens, mask), or a dict with
    tokens (or input_ids), mask, uncond_tokens, uncond_mask (the masks optional: every entry counts)."""
    if isinstance(x, dict):
        t = np.asarray(x["tokens"] if "tokens" in x else x["input_ids"], np.int32)
        m = x.get("mask")
        u, um = x.get("uncond_tokens"), x.get("uncond_mask")
    elif isinstance(x, tuple):
        t, m = np.asarray(x[0], np.int32), x[1]
        u = um = None
    else:
        t, m, u, um = np.asarray(x, np.int32), None, None, None
    if t.ndim != 1 or len(t) < 2:
        raise ValueError(f"a training sequence is a 1-D array of at least 2 token ids, got shape {t.shape}")
    m = generated_mask(len(t), 0) if m is None else np.asarray(m, np.float32)
    if m.shape != t.shape:
        raise ValueError(f"a mask must have its sequence's shape {t.shape}, got {m.shape}")
    if u is not None:
        u = np.asarray(u, np.int32)
        um = generated_mask(len(u), 0) if um is None else np.asarray(um, np.float32)
        if um.shape != u.shape:
            raise ValueError(f"an unconditional mask must have its sequence's shape {u.shape}, got {um.shape}")
    return t, m, u, um


def _item_stream(items, start: int) -> Iterator:
    """Items from index `start` on: a sequence (cycled), a callable start -> iterator, or an iterable (its
    first `start` items skipped)."""
    if callable(items):
        yield from items(start)
        return
    if isinstance(items, Sequence) and not isinstance(items, (str, bytes)):
        if not len(items):
            raise ValueError("no training sequences")
        i = start
        while True:
            yield items[i % len(items)]
            i += 1
    it = iter(items)
    for _ in range(start):
        next(it)
    yield from it


def batches(items: Sequence | Iterable | Callable[[int], Iterator], batch_size: int, seq_len: int, start: int = 0,
            pack: bool = False, cfg_pairs: bool | None = None) -> Iterator[tuple[dict, int, int]]:
    """`fit`'s batches (batch, next item index, real tokens) of token sequences (+ masks; see `_as_item`), from
    item `start` on; sequences longer than seq_len are cut to it. One sequence per row (right-padded, `lengths`),
    or with `pack` several per row next-fit (`segment_ids`). `cfg_pairs` (default: whether the first item has
    an unconditional form): the batches carry the u_ forms (rows without one repeat their conditional form).
    Endless over a sequence; ends with a finite iterable."""
    if pack and cfg_pairs:
        raise ValueError("packing is not supported for CFG pairs: use pack=False")
    B, T = batch_size, seq_len
    stream = _item_stream(items, start)
    index = start
    pending = None
    done = False
    while not done:
        rows = {k: np.zeros((B, T), np.int32) for k in ("input_ids", "positions")}
        rows["mask"] = np.zeros((B, T), np.float32)
        if pack:
            rows["segment_ids"] = np.zeros((B, T), np.int32)
        else:
            rows["lengths"] = np.zeros((B,), np.int32)
        u_rows = None
        r, used, seg, n_tok = 0, 0, 0, 0
        while r < B:
            if pending is None:
                try:
                    pending = _as_item(next(stream))
                except StopIteration:
                    done = True
                    break
                if cfg_pairs is None:
                    cfg_pairs = pending[2] is not None
                    if pack and cfg_pairs:
                        raise ValueError("packing is not supported for CFG pairs: use pack=False")
            t, m, u, um = pending
            t, m = t[:T], m[:T]
            L = len(t)
            if pack and used and used + L > T:
                r, used, seg = r + 1, 0, 0
                continue
            rows["input_ids"][r, used:used + L] = t
            rows["positions"][r, used:used + L] = np.arange(L)
            rows["mask"][r, used:used + L] = m
            if pack:
                seg += 1
                rows["segment_ids"][r, used:used + L] = seg
            else:
                rows["lengths"][r] = L
            if cfg_pairs:
                if u_rows is None:
                    u_rows = {k: np.zeros_like(v) for k, v in rows.items()}
                u, um = (t, m) if u is None else (u[:T], um[:T])
                u_rows["input_ids"][r, :len(u)] = u
                u_rows["positions"][r, :len(u)] = np.arange(len(u))
                u_rows["mask"][r, :len(u)] = um
                u_rows["lengths"][r] = len(u)
            n_tok += L
            index += 1
            pending = None
            if pack:
                used += L
            else:
                r += 1
        if n_tok == 0:
            return
        if cfg_pairs:
            rows.update({"u_" + k: v for k, v in u_rows.items()})
        yield rows, index, n_tok


# ---------------------------------------------------------------------------------------------- the run


def trainable(head: EG.EagleHead, target) -> EG.EagleHead:
    """The head with float32 parameters and without what its forward never reads (the copied input norm of a head
    without one), so its parameters are exactly what the PyTorch layout stores (`eagle_io`)."""
    params = jax.tree.map(lambda a: jnp.array(a, jnp.float32), head.params)  # copies: training donates them
    layer = dict(params["layer"])
    cfg, _ = EG.text_parts(target)
    swin = head.family == "chameleon" and getattr(cfg, "swin_norm", False)  # a swin layer reads attn_norm anyway
    if not head.input_norm and "attn_norm" in layer and not swin:
        del layer["attn_norm"]
    return head.replace(params={**params, "layer": layer})


def fit_head(target, data, workdir, *, steps: int | None = None, minutes: float | None = None, lr: float = 1e-3,
             warmup: int | None = None, head: EG.EagleHead | None = None, seed: int = 0, resume: bool = True,
             batch_size: int = 8, seq_len: int = 256, pack: bool = False, opts: LossOptions = LossOptions(),
             weight_decay: float = 0.0, clip_value: float = 0.5, input_norm: bool | None = None,
             heldout: Sequence[dict] | None = None, log_every: int = 10, ckpt_minutes: float = 3.0,
             progress: bool = True, name: str = "eagle", argv: list[str] | None = None,
             interrupt_at: int | None = None, max_steps: int | None = None) -> tuple[EG.EagleHead, dict]:
    """Train an EAGLE head for `target` with `jspec.tools.train.trainer.fit`; returns (head, run meta).

    data: a callable start -> iterator of `fit` batches (batch, next index, tokens), e.g. the zoo's text stream,
        or token sequences / items for `batches(data, batch_size, seq_len, pack=pack)`.
    steps / minutes: the schedule's length, or a time budget (the schedule sized to fill it, at most max_steps);
        warmup: default 3% of the steps (10 steps when only a budget is given).
    head: the start (default `eagle.init_head(target, key(seed), input_norm)`), trained in float32.
    resume: continue from the orbax checkpoint in workdir/ckpt (same name and seed), bit-identical to a run that
        was never interrupted; False starts over (the checkpoints are replaced).
    heldout: batches evaluated at every checkpoint (heldout_loss, _vloss, _ploss, _top1 in the log).
    interrupt_at: act as if Ctrl-C came at the start of this step (tests: the run checkpoints and returns)."""
    workdir = start_run(workdir, resume, steps, minutes)
    _, lm = EG.text_parts(target)
    head = trainable(head if head is not None else EG.init_head(target, jax.random.key(seed), input_norm), target)
    head.check(target)
    tx = optimizer(weight_decay, clip_value)
    meta = jt.new_meta(name, seed, steps, lr, default_warmup(warmup, steps), family=head.family,
                       input_norm=head.input_norm, target=head.target._asdict(), p_w=opts.p_w, noise=opts.noise,
                       uncond_prob=opts.uncond_prob)
    train_step, eval_step = make_steps(target, head, tx, opts)

    def step(params, opt_state, batch, lr_now, i):
        return train_step(params, opt_state, lr_now, lm, batch, step_key(seed, i))

    evaluate_fn = (lambda s: evaluate(eval_step, s["params"], lm, heldout)) if heldout else None
    state, meta = run(step, {"params": head.params, "opt_state": tx.init(head.params)}, meta, workdir, data,
                      batch_size=batch_size, seq_len=seq_len, pack=pack, steps=steps, lr=lr, minutes=minutes,
                      evaluate_fn=evaluate_fn, ckpt_minutes=ckpt_minutes, log_every=log_every, name=name,
                      progress=progress, argv=argv, interrupt_at=interrupt_at, max_steps=max_steps)
    return head.replace(params=state["params"]), meta


def start_run(workdir, resume: bool, steps: int | None, minutes: float | None) -> Path:
    """A head-training run's directory, resolved; ValueError without a schedule length or budget; with `resume`
    False, an earlier run's checkpoints and log there are removed."""
    if steps is None and minutes is None:
        raise ValueError("give steps or minutes")
    workdir = Path(workdir).resolve()
    if not resume and (workdir / "ckpt").exists():
        import shutil

        shutil.rmtree(workdir / "ckpt")
        (workdir / "log.jsonl").unlink(missing_ok=True)
    return workdir


def default_warmup(warmup: int | None, steps: int | None) -> int:
    """3% of the steps (10 steps when only a budget is given), unless given."""
    if warmup is not None:
        return warmup
    return max(1, int(round(0.03 * steps))) if steps else 10


def run(train_step, state: dict, meta: dict, workdir: Path, data, *, batch_size: int, seq_len: int, pack: bool,
        steps: int | None, lr: float, minutes: float | None, evaluate_fn, ckpt_minutes: float, log_every: int,
        name: str, progress: bool, argv, interrupt_at: int | None, max_steps: int | None) -> tuple[dict, dict]:
    """The checkpointed loop every head trainer shares: resume from workdir's checkpoint (same name and seed), then
    `jspec.tools.train.trainer.fit` over `data` (a callable start -> batches, or items for `batches`) with
    train_step(params, opt_state, batch, lr, step index) -> (params, opt_state, metrics). Returns (state, meta)."""
    ckpts = jt.Checkpoints(workdir)
    state, meta, resumed = jt.resume(ckpts, state, meta, steps, restart_peak=lr * 0.5)
    if resumed and progress:
        print(f"resumed {name} at step {meta['step']} from {workdir}")

    def step(state, batch, lr_now, i):
        if i == interrupt_at:
            raise KeyboardInterrupt
        params, opt, m = train_step(state["params"], state["opt_state"], batch, np.float32(lr_now), i)
        return {"params": params, "opt_state": opt}, m

    stream = data(meta["next_index"]) if callable(data) else batches(data, batch_size, seq_len, meta["next_index"],
                                                                      pack)
    budget = 60.0 * minutes if minutes is not None else float("inf")
    return jt.fit(step, state, stream, meta, workdir, ckpts=ckpts, budget_s=budget, ckpt_minutes=ckpt_minutes,
                  log_every=log_every, evaluate=evaluate_fn, desc=name, progress=progress, argv=argv,
                  max_steps=max_steps)


def train_head(target, data, workdir, **kw) -> EG.EagleHead:
    """`fit_head`'s head (see there for the arguments)."""
    return fit_head(target, data, workdir, **kw)[0]

