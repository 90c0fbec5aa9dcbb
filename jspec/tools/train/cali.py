"""Training Cali-TS's acceptance predictor (EESD App. B) for a trained early-exit head.

Labels come from teacher forcing on the target's own greedy text: at every position s the head drafts its argmax
from the true prefix, and the label is whether that draft equals the target's argmax there (the token the target
would accept under greedy verification). An example pairs an anchor t with a draft offset i = 1..P (P = 10): the
target's last-layer hidden state at t and the head's post-norm hidden state at t + i, exactly the pair the
controller sees when the draft's i-th token of a round is scored (the anchor is the node the previous round's bonus
token follows). Anchor and draft position must lie in one packed sequence, the draft position in the weighted
continuation. Loss: 2-way cross-entropy, averaged over every (t, i); the target and the head are frozen.
"""
from __future__ import annotations


import jax
import jax.numpy as jnp
import optax

from ports.core import cache as kvc
from jspec.tools.train import trainer as jt
from jspec.parts.controllers.calibration import CaliPredictor
from jspec.parts.drafters.early_exit import head_logits, head_states
from ports.families import llama


def features(cfg, n: int, head_params: dict, lm: dict, batch: dict):
    """(target last-layer hidden [B, T, D], head post-norm hidden [B, T, D], the head's argmax == the target's
    [B, T] bool) over a packed batch, without gradients."""
    B, T = batch["input_ids"].shape
    mask = jt.segment_mask(batch["segment_ids"])
    cache = kvc.init_cache(cfg.num_layers, B, cfg.num_kv_heads, T, cfg.head_dim, lm["embed"].dtype)
    fo = llama.forward(cfg, lm, batch["input_ids"], batch["positions"], cache, mask,
                       hidden_layers=(n, cfg.num_layers), fresh=True)
    h_exit, h_last = fo.hidden
    hcache = None
    if head_params["layers"]:
        hcache = kvc.init_cache(len(head_params["layers"]), B, cfg.num_kv_heads, T, cfg.head_dim, h_exit.dtype)
    states, _ = head_states(cfg, head_params, h_exit, batch["positions"], hcache, mask, fresh=hcache is not None)
    match = jnp.argmax(head_logits(head_params, states, lm), -1) == jnp.argmax(fo.logits, -1)
    return jax.lax.stop_gradient(h_last), jax.lax.stop_gradient(states), match


def pair_terms(pred: CaliPredictor, h_target, h_draft, match, batch: dict):
    """Per offset i = 1..P: (summed cross-entropy, summed correct, summed label, summed theta_M, pairs)."""
    seg, w = batch["segment_ids"], batch["weights"]
    T = seg.shape[1]
    out = []
    for i in range(1, pred.positions + 1):
        if i >= T:
            break
        ok = ((seg[:, :T - i] == seg[:, i:]) & (seg[:, i:] > 0) & (w[:, i:] > 0) & (w[:, :T - i] > 0)).astype(
            jnp.float32)
        logits = pred.logits(i, h_target[:, :T - i], h_draft[:, i:])
        label = match[:, i:].astype(jnp.int32)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, label)
        p1 = jax.nn.softmax(logits, -1)[..., 1]
        right = ((p1 > 0.5) == (label > 0)).astype(jnp.float32)
        out.append(jnp.stack([(ce * ok).sum(), (right * ok).sum(), (label * ok).sum(), (p1 * ok).sum(), ok.sum()]))
    return jnp.stack(out)  # [P, 5]


def _loss(static, pred, head_params, lm, batch):
    t = pair_terms(pred, *features(*static, head_params, lm, batch), batch).sum(0)
    n = jnp.maximum(t[4], 1.0)
    return t[0] / n, {"loss": t[0] / n, "acc": t[1] / n, "accept_rate": t[2] / n}


def _sums(static, pred, head_params, lm, batch):
    t = pair_terms(pred, *features(*static, head_params, lm, batch), batch).sum(0)
    return {"loss": (t[0], t[4]), "acc": (t[1], t[4]), "accept_rate": (t[2], t[4]), "mean_theta": (t[3], t[4])}


def make_steps(cfg, n: int, tx: optax.GradientTransformation) -> jt.Steps:
    """`jspec.tools.train.trainer.make_steps` of the predictor's loss: train(pred, opt_state, lr, head_params, lm,
    batch), eval(pred, head_params, lm, batch); the features come from the frozen target and head."""
    return jt.make_steps(_loss, _sums, (cfg, n), tx)


def evaluate(eval_step, pred, head_params, lm, batches) -> dict:
    """Held-out: cross-entropy, accuracy, the majority-class accuracy to beat, and the mean predicted vs the real
    acceptance rate (calibration), over every (t, i) pair."""
    ev = jt.evaluate(eval_step, pred, batches, head_params, lm)
    rate = ev["heldout_accept_rate"]
    return {**ev, "heldout_majority_acc": max(rate, 1 - rate)}
