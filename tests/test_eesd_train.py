"""EESD self-distillation: packing weights only the continuations asked for, the frozen shared layers' states are
the target's own, and a few steps of training lower the loss while leaving the target untouched."""
import jax
import numpy as np
import pytest

import jspec
import ports.core.cache
from jspec.tools.train import trainer as jt
from jspec.parts.drafters import early_exit as EE
from jspec.tools.train import eesd as EST
from tiny_pairs import PROMPTS, tiny_pair


def test_pack_weights_next_tokens_of_the_continuation():
    seqs = [np.array([5, 6, 7, 8]), np.array([9, 10, 11])]
    b, nxt = next(EST.pack(seqs, 2, 8, starts=[2, 1]))
    np.testing.assert_array_equal(b["input_ids"][0], [5, 6, 7, 8, 9, 10, 11, 0])
    np.testing.assert_array_equal(b["targets"][0], [6, 7, 8, 0, 10, 11, 0, 0])
    np.testing.assert_array_equal(b["segment_ids"][0], [1, 1, 1, 1, 2, 2, 2, 0])
    np.testing.assert_array_equal(b["positions"][0], [0, 1, 2, 3, 0, 1, 2, 0])
    np.testing.assert_array_equal(b["weights"][0], [0, 1, 1, 0, 1, 1, 0, 0])   # from the token before each start
    assert nxt == 4


def test_answer_streams_hold_out_the_last_sequences_and_refuse_what_packing_would_cut():
    seqs = [np.arange(i, i + 5 + i % 3) for i in range(40)]  # prompt + answer, the answer from position 3
    starts = [3] * 40
    stream, held = EST.answer_streams(seqs, starts, 2, 8, held_batches=2)
    train_ids = {int(x) for _ in range(30) for x in next(stream)[0]["input_ids"][:, 0]}
    held_ids = {int(x) for b in held for x in b["input_ids"][:, 0]}
    assert held_ids == {38, 39} and not held_ids & train_ids  # the last 5% (2 of 40), apart from the training rows
    assert all(b["weights"][:, :2].sum() == 0 and b["weights"].sum() > 0 for b in held)  # answers only
    with pytest.raises(ValueError, match="longer than seq_len 6 .*use a seq_len of 7"):
        EST.answer_streams(seqs, starts, 2, 6)
    with pytest.raises(ValueError, match="at least 2"):
        EST.answer_streams(seqs[:1], starts[:1], 2, 8)


def test_training_lowers_the_loss_and_reads_the_targets_own_states():
    target, _ = tiny_pair()
    head = EE.init_head(target, exit_layer=1, num_layers=1)
    cfg, lm = EST.head_target_lm(target, head)
    texts = EST.self_distillation_texts(target, PROMPTS, max_new_tokens=10, greedy_first=3, progress=False)
    for t, p in zip(texts, PROMPTS):
        np.testing.assert_array_equal(t[:len(p)], p)
        assert len(t) > len(p)
    batch, _ = next(EST.pack(texts, 3, 32, starts=[len(p) for p in PROMPTS]))
    h = EST.exit_states(cfg, lm, 1, batch)
    full = target.forward(batch["input_ids"][:1, :len(texts[0])], batch["positions"][:1, :len(texts[0])],
                          jspec.core.prefill.new_cache_for(target, 1, len(texts[0])), hidden_layers=(1,), fresh=True)
    np.testing.assert_allclose(h[0, :len(texts[0])], full.hidden[0][0], rtol=1e-4, atol=1e-4)
    tx = jt.adamw(0.0)
    step, eval_step = EST.make_steps(cfg, 1, tx)
    params, opt = head.params, tx.init(head.params)
    before = jax.tree.map(np.asarray, lm)
    first = EST.loss_fn(cfg, 1, params, lm, batch)[0]
    for _ in range(30):
        params, opt, m = step(params, opt, 3e-3, lm, batch)
    assert float(EST.loss_fn(cfg, 1, params, lm, batch)[0]) < 0.5 * float(first)
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(lm)):
        np.testing.assert_array_equal(a, np.asarray(b))
    ev = EST.evaluate(eval_step, params, lm, [batch])
    assert ev["heldout_acc"] > 0.5
    # agreement is with the target's own top-1, not with the text (sampled after the first 3 tokens): a head that
    # copies all of the target's layers after the exit agrees everywhere, though it predicts the text less well
    copy = EE.init_head(target, exit_layer=1, num_layers=2)
    ev_copy = EST.evaluate(eval_step, copy.params, lm, [batch])
    assert ev_copy["heldout_agreement"] == pytest.approx(1.0) and ev_copy["heldout_acc"] < 0.9
    assert EST.evaluate(eval_step, EE.init_head(target, 1, 0).params, lm, [batch])["heldout_agreement"] < 0.9


def test_a_shared_lm_head_trains_without_touching_the_target():
    """A head that shares the target's LM head trains its layers and norm only: the loss falls, the target's LM
    params (its LM head among them) stay as they were, and the held-out metrics read the same head."""
    target, _ = tiny_pair()
    head = EE.init_head(target, exit_layer=1, num_layers=1, share_lm_head=True)
    cfg, lm = EST.head_target_lm(target, head)
    texts = EST.self_distillation_texts(target, PROMPTS, max_new_tokens=10, greedy_first=3, progress=False)
    batch, _ = next(EST.pack(texts, 3, 32, starts=[len(p) for p in PROMPTS]))
    tx = jt.adamw(0.0)
    step, eval_step = EST.make_steps(cfg, 1, tx)
    params, opt = head.params, tx.init(head.params)
    before = jax.tree.map(np.asarray, lm)
    first = float(EST.loss_fn(cfg, 1, params, lm, batch)[0])
    for _ in range(30):
        params, opt, m = step(params, opt, 3e-3, lm, batch)
    assert "lm_head" not in params and float(EST.loss_fn(cfg, 1, params, lm, batch)[0]) < 0.7 * first
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(lm)):
        np.testing.assert_array_equal(a, np.asarray(b))
    assert EST.evaluate(eval_step, params, lm, [batch])["heldout_acc"] > 0.3


@pytest.mark.parametrize("train", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["labels", "training"])
def test_calibration_labels_and_training(train):
    """The predictor's labels are the head's greedy drafts judged by the target under teacher forcing; its pairs
    (anchor t, draft position t + i) stay inside one packed sequence and the weighted continuation; (slow) a few
    steps lower the cross-entropy, and the mean predicted acceptance approaches the real rate."""
    from jspec.parts.controllers import calibration as CAL
    from jspec.parts.drafters.early_exit import head_forward
    from jspec.tools.train import cali as CT

    target, _ = tiny_pair()
    head = EE.init_head(target, exit_layer=1, num_layers=1)
    cfg, lm = EST.head_target_lm(target, head)
    texts = EST.self_distillation_texts(target, PROMPTS, max_new_tokens=12, greedy_first=12, progress=False)
    greedy = jspec.decode(target, PROMPTS, max_new_tokens=12)
    for t, p, g, n in zip(texts, PROMPTS, greedy.tokens, greedy.lengths):
        np.testing.assert_array_equal(t[len(p):], g[:n])
    batch, _ = next(EST.pack(texts, 2, 40, starts=[len(p) for p in PROMPTS]))
    h_t, h_d, match = CT.features(cfg, 1, head.params, lm, batch)
    n0 = len(texts[0])
    h1 = EST.exit_states(cfg, lm, 1, batch)[:1, :n0]
    logits = head_forward(cfg, head.params, h1, batch["positions"][:1, :n0],
                          ports.core.cache.init_cache(1, 1, cfg.num_kv_heads, n0, cfg.head_dim, h1.dtype), fresh=True)[0]
    full = target.forward(batch["input_ids"][:1, :n0], batch["positions"][:1, :n0],
                          jspec.core.prefill.new_cache_for(target, 1, n0), fresh=True)
    np.testing.assert_array_equal(match[0, :n0], np.argmax(logits[0], -1) == np.argmax(full.logits[0], -1))
    pred = CAL.init_predictor(jax.random.key(0), cfg.hidden_size, positions=4)
    terms = CT.pair_terms(pred, h_t, h_d, match, batch)
    seg, w = np.asarray(batch["segment_ids"]), np.asarray(batch["weights"])
    for i in range(1, 5):
        want = sum(1 for r in range(seg.shape[0]) for t in range(seg.shape[1] - i)
                   if seg[r, t] == seg[r, t + i] > 0 and w[r, t + i] > 0 and w[r, t] > 0)
        assert float(terms[i - 1, 4]) == want
    assert 0 < int(np.asarray(match)[seg > 0].sum()) < int((seg > 0).sum())  # labels of both kinds
    if not train:
        return
    tx = jt.adamw(0.0)
    step, eval_step = CT.make_steps(cfg, 1, tx)
    opt = tx.init(pred)
    ev0 = CT.evaluate(eval_step, pred, head.params, lm, [batch])
    for _ in range(40):
        pred, opt, m = step(pred, opt, 1e-2, head.params, lm, batch)
    ev = CT.evaluate(eval_step, pred, head.params, lm, [batch])
    assert ev["heldout_loss"] < ev0["heldout_loss"] - 0.05
    assert abs(ev["heldout_mean_theta"] - ev["heldout_accept_rate"]) < abs(
        ev0["heldout_mean_theta"] - ev0["heldout_accept_rate"])
