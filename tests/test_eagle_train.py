"""EAGLE head training (jspec.tools.train.eagle): the batches' layouts and masks, the loss against a direct
computation, a few dozen steps on a tiny target's own greedy text lowering the loss and raising the top-1
agreement and the decode acceptance, an interrupted run resuming bit-identically, and the 90/10 CFG path on a
tiny Chameleon."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
import ports.core.cache
from jspec.tools.train import trainer as jt
from jspec.parts.drafters import eagle as EG
from jspec.tools.train import eagle as EGT
from jspec.parts.plans import StaticPlan
from jspec.parts.trees import build_tree
from train_checks import assert_resumes_bit_identical
from tiny_pairs import PROMPTS, tiny_pair

TREE = [[0], [1], [0, 0], [0, 0, 0]]  # the tree test_eagle_io decodes with (one compile for both files)
NEW = 12
OPTS = EGT.LossOptions(noise=0.0)  # EAGLE's 0.2 * 512 / L is +-1.6 at L = 32


@pytest.fixture(scope="module")
def target():
    return tiny_pair()[0]


def _decode(target, head):
    return jspec.decode(target, PROMPTS, jspec.Speculative(EG.EagleDrafter(head), StaticPlan.of(build_tree(TREE))),
                        max_new_tokens=NEW, eos_token_id=())


@pytest.fixture(scope="module")
def untrained(target):
    """(the untrained head, its greedy decode of PROMPTS: the target's own greedy text, greedy SD being AR)."""
    head = EGT.trainable(EG.init_head(target, jax.random.key(0)), target)
    return head, _decode(target, head)


@pytest.fixture(scope="module")
def own_text(untrained):
    """The target's greedy continuations of PROMPTS, masked to the continuation (what the acceptance test decodes)."""
    out = untrained[1]
    seqs = [np.concatenate([p, out.tokens[i, :NEW]]) for i, p in enumerate(PROMPTS)]
    return [(s, EGT.generated_mask(len(s), len(p))) for s, p in zip(seqs, PROMPTS)]


def test_batches_layout_and_masks():
    a, b, c = np.arange(5) + 10, np.arange(3) + 20, np.arange(9) + 30
    items = [(a, EGT.generated_mask(5, 2)), b, c]
    np.testing.assert_array_equal(items[0][1], [0, 1, 1, 1, 0])  # entry j counts when token j + 1 is generated
    bt, nxt, n = next(EGT.batches(items, 2, 8))
    np.testing.assert_array_equal(bt["input_ids"], [[10, 11, 12, 13, 14, 0, 0, 0], [20, 21, 22, 0, 0, 0, 0, 0]])
    np.testing.assert_array_equal(bt["lengths"], [5, 3])
    np.testing.assert_array_equal(bt["mask"][1], [1, 1, 0, 0, 0, 0, 0, 0])
    assert (nxt, n) == (2, 8) and "segment_ids" not in bt
    bt, nxt, n = next(EGT.batches(items, 2, 8, start=2))  # c is cut to 8 tokens; cycling wraps to a
    np.testing.assert_array_equal(bt["input_ids"][0], c[:8])
    assert bt["mask"][0].sum() == 8 and nxt == 4  # (the head never counts a row's last position)
    bt, nxt, _ = next(EGT.batches(items, 2, 8, pack=True))
    np.testing.assert_array_equal(bt["segment_ids"], [[1, 1, 1, 1, 1, 2, 2, 2], [1, 1, 1, 1, 1, 1, 1, 1]])
    np.testing.assert_array_equal(bt["positions"][0], [0, 1, 2, 3, 4, 0, 1, 2])
    assert nxt == 3
    # the head's view: the entry crossing a packed sequence's end and the last position never count
    _, npos, m, lengths, _, _ = EGT.entries({k: jnp.asarray(v) for k, v in bt.items()})
    np.testing.assert_array_equal(m[0], [0, 1, 1, 1, 0, 1, 1, 0])
    np.testing.assert_array_equal(npos[0], [1, 2, 3, 4, 0, 1, 2, 3])
    np.testing.assert_array_equal(lengths[:, 0], [8, 8])
    # CFG pairs: both forms, the unconditional one after its own prompt; rows pick one with a key
    pairs = [EGT.cfg_item([1, 2, 3], [9], [40, 41, 42]), EGT.cfg_item([4, 5], [9], [43, 44])]
    bt, _, _ = next(EGT.batches(pairs, 2, 8))
    np.testing.assert_array_equal(bt["u_input_ids"][0, :4], [9, 40, 41, 42])
    np.testing.assert_array_equal(bt["mask"][0], [0, 0, 1, 1, 1, 0, 0, 0])
    np.testing.assert_array_equal(bt["u_mask"][0], [1, 1, 1, 0, 0, 0, 0, 0])
    jb = {k: jnp.asarray(v) for k, v in bt.items()}
    for p, want in ((0.0, "input_ids"), (1.0, "u_input_ids")):
        picked, rows = EGT.pick_rows(jb, jax.random.key(0), p)
        np.testing.assert_array_equal(picked["input_ids"], bt[want])
        assert not any(k.startswith("u_") for k in picked)
    with pytest.raises(ValueError, match="packing"):
        next(EGT.batches(pairs, 2, 8, pack=True))


def test_training_lowers_the_loss_and_raises_agreement_and_acceptance(target, untrained, own_text, tmp_path):
    """Self-distillation on the prompts' own greedy continuations: after 60 steps the head agrees with the target
    on most of them and the greedy decode of the same prompts accepts more drafts per step."""
    head0, out0 = untrained
    held = [next(EGT.batches(own_text, 3, 32))[0]]
    _, lm = EG.text_parts(target)
    opts = OPTS
    _, eval_step = EGT.make_steps(target, head0, EGT.optimizer(), opts)
    before = EGT.evaluate(eval_step, head0.params, lm, held)
    acc0 = float(np.mean(out0.stats["mean_accepted"]))
    head, meta = EGT.fit_head(target, own_text, tmp_path, steps=60, lr=1e-2, batch_size=3, seq_len=32, opts=opts,
                             heldout=held, progress=False, argv=[])
    assert jt.finished(meta) and meta["step"] == 60
    log = jt.read_log(tmp_path / "log.jsonl")
    rows = [r for r in log if "loss" in r]
    assert [r["step"] for r in rows] == list(range(10, 61, 10))
    assert {"vloss", "ploss", "top1", "grad_norm", "lr"} <= set(rows[0])
    after = [r for r in log if "heldout_loss" in r][-1]
    acc1 = float(np.mean(_decode(target, head).stats["mean_accepted"]))
    print(f"held-out loss {before['heldout_loss']:.3f} -> {after['heldout_loss']:.3f}, top1 "
          f"{before['heldout_top1']:.3f} -> {after['heldout_top1']:.3f}, mean accepted {acc0:.3f} -> {acc1:.3f}")
    assert after["heldout_loss"] < 0.5 * before["heldout_loss"]
    assert after["heldout_top1"] > before["heldout_top1"] + 0.3
    assert acc1 > acc0 + 0.3
    assert EGT.evaluate(eval_step, head.params, lm, held)["heldout_top1"] == pytest.approx(after["heldout_top1"])


def test_interrupted_run_resumes_bit_identical(target, own_text, tmp_path):
    kw = dict(steps=12, lr=1e-2, batch_size=3, seq_len=32, progress=False, argv=[], log_every=2, seed=3,
              opts=OPTS)  # (the options and shapes of the test above: its compiled step is reused)
    run = assert_resumes_bit_identical(EGT.fit_head, target, own_text, tmp_path, **kw)
    with pytest.raises(ValueError, match="seed"):
        EGT.fit_head(target, own_text, run, **{**kw, "seed": 4})


@pytest.mark.slow  # compiles a Chameleon training step (the CFG batches and picks are checked above)
def test_cfg_pairs_train_on_a_tiny_chameleon(tmp_path):
    """Text-to-image samples as CFG pairs (the generated image tokens after the conditional and after the
    unconditional prompt): rows pick a form per step, the unconditional one about uncond_prob of the time, and the
    loss falls."""
    from jspec import images as IG
    from test_imagegen import PREFIX, make_model

    target = IG._generating(make_model(0))
    cfg, lm = EG.text_parts(target)
    rng = np.random.default_rng(0)
    img = [rng.integers(cfg.image_token_ids[0], cfg.image_token_ids[-1] + 1, 14) for _ in range(4)]
    conds = [np.concatenate([rng.integers(8, 40, 5), PREFIX]) for _ in range(4)]
    pairs = [EGT.cfg_item(c, PREFIX, g) for c, g in zip(conds, img)]
    held = [next(EGT.batches(pairs, 4, 24))[0]]
    head0 = EGT.trainable(EG.init_head(target, jax.random.key(0)), target)
    opts = EGT.LossOptions(noise=0.0, uncond_prob=0.5)
    _, eval_step = EGT.make_steps(target, head0, EGT.optimizer(), opts)
    before = EGT.evaluate(eval_step, head0.params, lm, held)["heldout_loss"]
    head, meta = EGT.fit_head(target, pairs, tmp_path, steps=20, lr=1e-2, batch_size=4, seq_len=24, opts=opts,
                             heldout=held, progress=False, argv=[], log_every=5)
    after = EGT.evaluate(eval_step, head.params, lm, held)["heldout_loss"]
    assert np.isfinite(after) and after < 0.7 * before
    assert head.family == "chameleon" and head.input_norm
    # the picks: a function of the step's key alone, both forms drawn over the run
    b = {k: jnp.asarray(v) for k, v in held[0].items()}
    picks = np.stack([np.asarray(EGT.pick_rows(b, jax.random.split(EGT.step_key(0, i))[0], 0.5)[1])
                      for i in range(20)])
    assert 0.2 < picks.mean() < 0.8


@pytest.mark.parametrize("rows", [1, pytest.param(3, marks=pytest.mark.slow)])  # a few compiles per row
def test_loss_equals_a_direct_computation(target, own_text, rows):
    """The batched loss: the target's features from its own forward, the head teacher-forced over
    (x_{j+1}, f_j) as the drafter feeds it, SmoothL1 + 0.1 CE over the weighted entries."""
    head = EGT.trainable(EG.init_head(target, jax.random.key(2), noise=0.3), target)
    cfg, lm = EG.text_parts(target)
    own_text = own_text[:rows]
    batch = next(EGT.batches(own_text, rows, 32))[0]
    loss, aux = EGT.loss_terms(cfg, lm, head, {k: jnp.asarray(v) for k, v in batch.items()}, None, EGT.LossOptions())
    vl, ce, top, w = [], [], [], []
    for r, (seq, mask) in enumerate(own_text):
        T = len(seq)
        cache = ports.core.cache.init_cache(cfg.num_layers, 1, cfg.num_kv_heads, T, cfg.head_dim, jnp.float32)
        fo = target.forward(jnp.asarray(seq)[None], jnp.arange(T)[None], cache, fresh=True,
                            hidden_layers=(cfg.num_layers,))
        f = np.asarray(EG.features(cfg, lm, fo.hidden[0])[0])
        hc = ports.core.cache.init_cache(1, 1, cfg.num_kv_heads, T - 1, cfg.head_dim, jnp.float32)
        fh, _ = EG.head_forward(cfg, head, lm["embed"][jnp.asarray(seq[1:])][None], jnp.asarray(f[:-1])[None],
                               jnp.arange(1, T)[None], hc, fresh=True)
        fh = np.asarray(fh[0])
        d = np.abs(fh - f[1:])
        vl.append(np.where(d < 1, 0.5 * d * d, d - 0.5).mean(-1))
        lt, lh = (np.asarray(EG.lm_logits(cfg, lm, jnp.asarray(x)[None])[0], np.float64) for x in (f[1:], fh))
        p = np.exp(lt - lt.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        logq = lh - lh.max(-1, keepdims=True)
        logq -= np.log(np.exp(logq).sum(-1, keepdims=True))
        ce.append(-(p * logq).sum(-1))
        top.append(lt.argmax(-1) == lh.argmax(-1))
        w.append(mask[:-1])
    vl, ce, top, w = (np.concatenate(x) for x in (vl, ce, top, w))
    np.testing.assert_allclose(float(aux["vloss"]), (vl * w).sum() / w.sum(), rtol=1e-4)
    np.testing.assert_allclose(float(aux["ploss"]), (ce * w).sum() / w.sum(), rtol=1e-4)
    np.testing.assert_allclose(float(loss), float(aux["vloss"]) + 0.1 * float(aux["ploss"]), rtol=1e-6)
    np.testing.assert_allclose(float(aux["top1"]), (top * w).sum() / w.sum(), rtol=1e-6)
