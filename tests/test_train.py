"""jspec.tools.train.trainer: the learning-rate schedule, the optimizer's injected learning rate, the loss weights, and the
checkpointed loop, whose interrupted-and-resumed run ends bit-identical to an uninterrupted one."""
from __future__ import annotations

import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jspec.tools.train import trainer as jt
from provenance_check import assert_provenance


def test_lr_schedule_warms_up_decays_to_a_tenth_and_restarts():
    sched = [jt.segment(0, 100, 1e-2, 10)]
    assert jt.lr_at(sched, 0) == pytest.approx(1e-3) and jt.lr_at(sched, 9) == pytest.approx(1e-2)
    lrs = [jt.lr_at(sched, s) for s in range(10, 101)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))                       # cosine: never rises after warmup
    assert lrs[-1] == pytest.approx(1e-3) and jt.lr_at(sched, 500) == pytest.approx(1e-3)
    assert jt.lr_at([jt.segment(0, None, 2e-3, 5)], 400) == 2e-3          # length unknown: constant peak
    restart = sched + [jt.segment(100, 160, 5e-3, 20)]
    assert jt.lr_at(restart, 99) == lrs[-2] or jt.lr_at(restart, 99) == pytest.approx(lrs[-2])
    assert jt.lr_at(restart, 100) == pytest.approx(5e-3 / 20) and jt.lr_at(restart, 119) == pytest.approx(5e-3)
    assert jt.lr_at(restart, 160) == pytest.approx(5e-4)


def test_adamw_reads_the_learning_rate_set_in_its_state_and_decays_matrices_only():
    params = {"w": jnp.ones((3, 2)), "b": jnp.ones((2,)), "bqkv": jnp.ones((2, 4))}
    grads = jax.tree.map(jnp.zeros_like, params)                          # zero gradient: only weight decay moves
    tx = jt.adamw(weight_decay=0.5)
    state = tx.init(params)
    for lr in (0.0, 0.1):
        upd, _ = tx.update(grads, jt.set_lr(state, lr), params)
        moved = optax.apply_updates(params, upd)
        np.testing.assert_allclose(moved["w"], 1.0 - lr * 0.5, rtol=1e-6)
        np.testing.assert_array_equal(moved["b"], params["b"])
        np.testing.assert_array_equal(moved["bqkv"], params["bqkv"])


def test_loss_helpers():
    logits = jnp.log(jnp.array([[[0.5, 0.25, 0.25], [0.1, 0.1, 0.8]]]))
    np.testing.assert_allclose(jt.token_nll(logits, jnp.array([[1, 2]])), [[np.log(4), -np.log(0.8)]], rtol=1e-6)
    assert float(jt.masked_mean(jnp.array([1.0, 3.0, 5.0]), jnp.array([1, 0, 1]))) == 3.0
    assert float(jt.masked_mean(jnp.array([1.0]), jnp.array([0]))) == 0.0


def test_answer_weights_per_token_and_per_example():
    """Per token: every answer token weighs the same. Per example: each packed example's answer tokens share an equal
    part, so a one-token answer weighs as much as a long one; padding and prompt tokens weigh nothing."""
    seg = np.array([[1, 1, 1, 1, 2, 2, 0], [1, 1, 2, 2, 2, 3, 3]], np.int32)
    mask = np.array([[0, 1, 1, 1, 0, 1, 0], [0, 1, 0, 0, 1, 0, 0]], np.float32)   # row 1, segment 3: no answer
    tok = np.asarray(jt.answer_weights(jnp.asarray(seg), jnp.asarray(mask), False))
    np.testing.assert_allclose(tok, mask / mask.sum())
    ex = np.asarray(jt.answer_weights(jnp.asarray(seg), jnp.asarray(mask), True))
    np.testing.assert_allclose(ex.sum(), 1.0, rtol=1e-6)
    assert (ex[mask == 0] == 0).all()
    np.testing.assert_allclose(ex[0, 1:4], 1 / 12)            # 4 examples with answers; 3 tokens share one quarter
    np.testing.assert_allclose([ex[0, 5], ex[1, 1], ex[1, 4]], 1 / 4)


# ---------------------------------------------------------------------------------------- the checkpointed loop

W_TRUE = np.arange(12, dtype=np.float32).reshape(4, 3) / 10


def _data(start: int):
    """Batch i is a function of i alone (the data cursor), as the zoo's packed streams are."""
    i = start
    while True:
        x = np.random.default_rng(i).normal(size=(8, 4)).astype(np.float32)
        yield {"x": x, "y": x @ W_TRUE}, i + 1, 8
        i += 1


def _setup(workdir, steps, seed=0, interrupt_at=None):
    tx = jt.adamw(weight_decay=0.01)
    params = {"w": jnp.zeros((4, 3)), "b": jnp.zeros((3,))}
    state = {"params": params, "opt_state": tx.init(params)}

    @jax.jit
    def update(state, batch, lr):
        def loss(p):
            return jnp.mean((batch["x"] @ p["w"] + p["b"] - batch["y"]) ** 2)
        lo, g = jax.value_and_grad(loss)(state["params"])
        upd, opt = tx.update(g, jt.set_lr(state["opt_state"], lr), state["params"])
        return {"params": optax.apply_updates(state["params"], upd), "opt_state": opt}, {"loss": lo}

    def step(state, batch, lr, i):
        if i == interrupt_at:
            raise KeyboardInterrupt
        return update(state, batch, lr)

    held = next(_data(10_000))[0]
    evaluate = lambda s: {"heldout_loss": float(jnp.mean((held["x"] @ s["params"]["w"] + s["params"]["b"]  # noqa: E731
                                                          - held["y"]) ** 2))}
    meta = jt.new_meta("toy", seed, steps, 0.1, 3)
    ckpts = jt.Checkpoints(workdir)
    return step, state, meta, ckpts, evaluate


def _run(workdir, steps, **kw):
    step, state, meta, ckpts, evaluate = _setup(workdir, steps, **kw)
    state, meta, _ = jt.resume(ckpts, state, meta, steps, restart_peak=0.05)
    return jt.fit(step, state, _data(meta["next_index"]), meta, workdir, ckpts=ckpts, log_every=2,
                  evaluate=evaluate, progress=False, argv=[])


def _log(workdir):
    return [{k: v for k, v in r.items() if k not in ("tok_s", "elapsed_s")} for r in jt.read_log(workdir / "log.jsonl")]


def test_interrupted_and_resumed_run_ends_bit_identical(tmp_path):
    whole, meta = _run(tmp_path / "a", 12)
    assert jt.finished(meta) and meta["step"] == 12 and meta["next_index"] == 12 and meta["tokens"] == 96
    log = _log(tmp_path / "a")
    assert [r["step"] for r in log if "loss" in r] == [2, 4, 6, 8, 10, 12]
    assert log[-1]["heldout_loss"] < log[0]["loss"] / 5                  # it learned

    part, meta = _run(tmp_path / "b", 12, interrupt_at=7)                # Ctrl-C inside step 8: checkpoint at 7
    assert meta["step"] == 7 and not jt.finished(meta)
    assert jt.Checkpoints(tmp_path / "b").latest_step() == 7
    resumed, meta = _run(tmp_path / "b", 12)
    assert meta["step"] == 12 and [r["from_step"] for r in meta["runs"]] == [0, 7]
    saved = jt.Checkpoints(tmp_path / "b").restore(resumed)[1]  # the checkpoint records where each segment ran
    for r in saved["runs"]:
        assert_provenance(r["provenance"])
    for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(resumed)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # the log of the resumed run: the same training rows as the uninterrupted one, plus the checkpoint at 7
    train_rows = lambda rows: [r for r in rows if "loss" in r]  # noqa: E731
    assert train_rows(_log(tmp_path / "b")) == train_rows(log)
    assert [r["step"] for r in _log(tmp_path / "b") if "heldout_loss" in r] == [7, 12]


def test_resume_refuses_another_run_and_continues_a_finished_schedule(tmp_path):
    _run(tmp_path, 6)
    step, state, meta, ckpts, _ = _setup(tmp_path, 6, seed=1)
    with pytest.raises(ValueError, match="seed=0, not 1"):
        jt.resume(ckpts, state, meta, 6)
    _run(tmp_path / "u", 10, interrupt_at=3)
    step, state, meta, ckpts, _ = _setup(tmp_path / "u", 10)
    with pytest.raises(ValueError, match="unfinished schedule"):
        jt.resume(ckpts, state, meta, 20)
    # past the finished 6-step schedule: a warm restart to step 9
    state, meta = _run(tmp_path, 9)
    assert meta["step"] == 9 and [g["start"] for g in meta["schedule"]] == [0, 6]
    assert meta["schedule"][1] == jt.segment(6, 9, 0.05, jt.RESTART_WARMUP)
    assert json.loads(json.dumps(meta)) == meta                            # the meta stays JSON


def test_schedule_sized_for_several_runs(tmp_path):
    """Without a schedule length, `schedule_s` (not the run's own budget) sizes it: a run stopped by its budget
    leaves the rest of the schedule to resumed runs."""
    step, state, meta, ckpts, _ = _setup(tmp_path, None)

    def slow(state, batch, lr, i):
        time.sleep(0.02)
        return step(state, batch, lr, i)
    state, meta = jt.fit(slow, state, _data(0), meta, tmp_path, ckpts=ckpts, budget_s=3.0, schedule_s=30.0,
                         progress=False, argv=[])
    assert 21 <= meta["step"] < 160 and not jt.finished(meta)
    assert meta["total_steps"] > 5 * meta["step"] and meta["schedule"][0]["total"] == meta["total_steps"]


def test_budget_sized_schedule_is_capped_by_max_steps(tmp_path):
    """A budget that would hold thousands of fast steps sizes a schedule of at most `max_steps`, which the run
    then finishes (its learning rate decayed to the end) well inside the budget."""
    step, state, meta, ckpts, _ = _setup(tmp_path, None)
    state, meta = jt.fit(step, state, _data(0), meta, tmp_path, ckpts=ckpts, budget_s=60.0, max_steps=30,
                         progress=False, argv=[])
    assert jt.finished(meta) and meta["step"] == meta["total_steps"] == 30
    assert meta["schedule"][0]["total"] == 30 and meta["elapsed_s"] < 30


def test_prefetch_surfaces_the_producers_error():
    def bad():
        yield 1
        raise RuntimeError("broken data")
    it = jt.Prefetch(bad())
    assert next(it) == 1
    with pytest.raises(RuntimeError, match="broken data"):
        next(it)
    it.close()
