"""Training an EAGLE-3 head (`jspec.parts.drafters.eagle3.Eagle3Head`) on a frozen target with training-time test.

For a batch of token rows x [B, T] the target runs once (no gradient) and gives its residual streams at the head's
layers, fused into h [B, T, n * D], and its next-token distribution p_j after each token j, restricted to the
head's draft vocabulary and renormalised (what the head can say). The head then runs `steps` times over the same
positions, as EAGLE-3 trains it (its Sec. 3.2, "training-time test"; `speculators`' Eagle3DraftModel.forward):

- step 0: entry t pairs the true next token x_{t+1} with g_t = fc(h_t) and predicts x_{t+2};
- step s > 0: entry t pairs the true token x_{t+1+s} with the head's own step s - 1 output at t, sees the step-0
  entries 0..t and its own entries at t of steps 1..s (the keys a chain draft sees when its drafts were right),
  sits at position pos(x_{t+1}) + s, and predicts x_{t+2+s}.

    loss = sum_s decay**s * KL(p_{t+1+s} || q_{s,t}), averaged over the weighted entries of each step

An entry of step s counts when the token it predicts is one the target generated (the batch mask's convention,
`eagle_train.batches`: mask[j] = 1 when x_{j+1} is generated) and lies in the entry's own sequence. Everything of
the head trains (fc, its layers, norm and LM head); the target, its embedding included, is frozen. The head starts
with fc reading only the highest fused layer (identity there), random layers (N(0, 0.02)), unit norms and the
target's LM-head rows of the draft vocabulary. The draft vocabulary is the `draft_vocab` tokens the training
answers use most (EAGLE-3's d2t).

Logged per window: loss, kl0.. (each step's KL), top1_0.. (the head's argmax = the target's, per step), grad_norm;
held out: heldout_loss and heldout_top1_s. The loop, optimizer, checkpoints and exact resume are
`eagle_train`'s and `jspec.tools.train.trainer.fit`'s.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp

from jspec.tools.train import trainer as jt
from jspec.parts.drafters import eagle as EG
from jspec.parts.drafters import eagle3 as E3
from jspec.tools.train import eagle as ET
from ports.core import cache as kvc
from ports.core import layers as LY
from ports.families import llama


@dataclasses.dataclass(frozen=True)
class TTTOptions:
    """steps: training-time-test steps; decay: each step's loss weight is decay**s (the EAGLE repository's 0.8)."""

    steps: int = 3
    decay: float = 0.8


def target_view(cfg, lm: dict, head: E3.Eagle3Head, ids, positions, new_mask=None):
    """(fused states h [B, T, n * D], the target's log-probs over the draft vocabulary [B, T, Vd]; float32, no
    gradient): one fresh forward of the target, its streams at the head's layers and its last layer."""
    B, T = ids.shape
    cache = kvc.init_cache(cfg.num_layers, B, cfg.num_kv_heads, T, cfg.head_dim, lm["embed"].dtype)
    layers = tuple(head.aux_layers) + (cfg.num_layers,)
    fo = llama.forward(cfg, lm, ids, positions, cache, new_mask, hidden_layers=layers, compute_logits=False,
                       fresh=True)
    h = jnp.concatenate(fo.hidden[:-1], axis=-1).astype(jnp.float32)
    f = LY.rms_norm(fo.hidden[-1], lm["final_norm"], cfg.rms_norm_eps)
    ids = jnp.arange(cfg.vocab_size) if head.vocab is None else head.vocab
    logits = LY.weight_dot("btd,vd->btv", f, EG.vocab_rows(cfg, lm, ids), jnp.float32)
    return jax.lax.stop_gradient(h), jax.lax.stop_gradient(jax.nn.log_softmax(logits, axis=-1))


def _shift(x, s: int, fill=0):
    """x [B, T, ...] moved s positions left, `fill` past the end."""
    if s == 0:
        return x
    pad = jnp.full((x.shape[0], s) + x.shape[2:], fill, x.dtype)
    return jnp.concatenate([x[:, s:], pad], axis=1)


def loss_terms(cfg, lm: dict, head: E3.Eagle3Head, batch: dict, opts: TTTOptions):
    """(loss, {loss, kl_s, top1_s, weight_s}) of one batch (module docstring)."""
    ids, pos = batch["input_ids"], batch["positions"]
    B, T = ids.shape
    nxt, npos, _, _, tvis, hvis = ET.entries(batch)
    h, logp_t = target_view(cfg, lm, head, ids, pos, tvis)
    mk = batch["mask"].astype(jnp.float32)  # mk[j]: x_{j+1} is a generated token
    if "segment_ids" in batch:
        seg = batch["segment_ids"]
        same = lambda s: (_shift(seg, s) == seg) & (seg > 0)  # noqa: E731
    else:
        inside = jnp.arange(T)[None] < batch["lengths"][:, None]
        same = lambda s: _shift(inside, s, False) & inside  # noqa: E731
    xs = E3.ttt_states(head, lambda s: llama.embed(lm, _shift(nxt, s)).astype(jnp.float32), E3.fuse(head, h),
                       npos, hvis, opts.steps)
    total, aux = 0.0, {}
    for s, x in enumerate(xs):
        q = E3.draft_logits(head, x)
        p_logp = _shift(logp_t, 1 + s)  # the target's distribution of x_{t+2+s}
        w = _shift(mk, 1 + s) * same(1 + s)
        logq = jax.nn.log_softmax(q, axis=-1)
        kl = jnp.sum(jnp.exp(p_logp) * (p_logp - logq), axis=-1)
        top1 = (jnp.argmax(q, -1) == jnp.argmax(p_logp, -1)).astype(jnp.float32)
        k = jt.masked_mean(kl, w)
        total = total + (opts.decay ** s) * k
        aux.update({f"kl{s}": k, f"top1_{s}": jt.masked_mean(top1, w), f"weight{s}": w.sum()})
    return total, {"loss": total, **aux}


def _loss(static, params, vocab, lm, batch):
    cfg, spec, opts = static
    config, aux_layers, target, nbr, nout = spec
    loss, aux = loss_terms(cfg, lm, E3.Eagle3Head(params, config, aux_layers, target, vocab, nbr, nout), batch, opts)
    return loss, {k: v for k, v in aux.items() if not k.startswith("weight")}


def _sums(static, params, vocab, lm, batch):
    """The loss over step 0's weight, then per step its top-1 over its weight."""
    cfg, spec, opts = static
    config, aux_layers, target, nbr, nout = spec
    _, aux = loss_terms(cfg, lm, E3.Eagle3Head(params, config, aux_layers, target, vocab, nbr, nout), batch, opts)
    return {"loss": (aux["loss"] * aux["weight0"], aux["weight0"]),
            **{f"top1_{s}": (aux[f"top1_{s}"] * aux[f"weight{s}"], aux[f"weight{s}"]) for s in range(opts.steps)}}


def make_steps(target, head: E3.Eagle3Head, tx, opts: TTTOptions) -> jt.Steps:
    """`jspec.tools.train.trainer.make_steps` of the training-time-test loss: train(params, opt_state, lr, vocab,
    lm, batch), eval(params, vocab, lm, batch)."""
    cfg, _ = E3.text_parts(target)
    return jt.make_steps(_loss, _sums, (cfg, _spec(head), opts), tx, ET.set_lr)


def _spec(head: E3.Eagle3Head) -> tuple:
    return (head.config, head.aux_layers, head.target, head.norm_before_residual, head.norm_output)


def evaluate(eval_step, params, vocab, lm, batches) -> dict:
    """Held-out means over `batches`: heldout_loss and each step's heldout_top1_s."""
    return jt.evaluate(eval_step, params, batches, vocab, lm)


def start_head(target, key: jax.Array, draft_vocab=None, aux_layers=None, num_layers: int = 1) -> E3.Eagle3Head:
    """The head training starts from (module docstring), float32."""
    cfg, lm = E3.text_parts(target)
    head = E3.init_head(target, key, aux_layers, draft_vocab, num_layers, jnp.float32, scale=0.02)
    D, n = cfg.hidden_size, len(head.aux_layers)
    fc = jnp.zeros((n * D, D), jnp.float32).at[(n - 1) * D:].set(jnp.eye(D))
    ids = jnp.arange(cfg.vocab_size) if head.vocab is None else head.vocab
    rows = EG.vocab_rows(cfg, lm, ids).astype(jnp.float32)
    return head.replace(params=dict(head.params, fc=fc, lm_head=rows))


def fit_head(target, data, workdir, *, steps: int | None = None, minutes: float | None = None, lr: float = 1e-3,
             warmup: int | None = None, head: E3.Eagle3Head | None = None, draft_vocab=None, aux_layers=None,
             seed: int = 0, resume: bool = True, batch_size: int = 8, seq_len: int = 256, pack: bool = False,
             opts: TTTOptions = TTTOptions(), weight_decay: float = 0.0, clip_value: float = 0.5,
             heldout: Sequence[dict] | None = None, log_every: int = 10, ckpt_minutes: float = 3.0,
             progress: bool = True, name: str = "eagle3", argv: list[str] | None = None,
             interrupt_at: int | None = None, max_steps: int | None = None) -> tuple[E3.Eagle3Head, dict]:
    """Train an EAGLE-3 head for `target` with `jspec.tools.train.trainer.fit`; returns (head, run meta). The arguments are
    `eagle_train.fit_head`'s, plus: draft_vocab (target ids of the draft vocabulary; None: all), aux_layers
    (default EAGLE-3's), opts (training-time-test steps and decay); head: a start other than `start_head`'s."""
    workdir = ET.start_run(workdir, resume, steps, minutes)
    cfg, lm = E3.text_parts(target)
    head = head if head is not None else start_head(target, jax.random.key(seed), draft_vocab, aux_layers)
    head = head.replace(params=jax.tree.map(lambda a: jnp.array(a, jnp.float32), head.params))
    head.check(target)
    tx = ET.optimizer(weight_decay, clip_value)
    meta = jt.new_meta(name, seed, steps, lr, ET.default_warmup(warmup, steps), aux_layers=list(head.aux_layers),
                       draft_vocab=head.draft_vocab_size, target=head.target._asdict(), ttt_steps=opts.steps,
                       decay=opts.decay)
    train_step, eval_step = make_steps(target, head, tx, opts)
    vocab = head.vocab

    def step(params, opt_state, batch, lr_now, i):
        return train_step(params, opt_state, lr_now, vocab, lm, batch)

    evaluate_fn = (lambda s: evaluate(eval_step, s["params"], vocab, lm, heldout)) if heldout else None
    state, meta = ET.run(step, {"params": head.params, "opt_state": tx.init(head.params)}, meta, workdir, data,
                         batch_size=batch_size, seq_len=seq_len, pack=pack, steps=steps, lr=lr, minutes=minutes,
                         evaluate_fn=evaluate_fn, ckpt_minutes=ckpt_minutes, log_every=log_every, name=name,
                         progress=progress, argv=argv, interrupt_at=interrupt_at, max_steps=max_steps)
    return head.replace(params=state["params"]), meta
