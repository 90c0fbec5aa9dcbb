"""Training utilities shared by the zoo and the drafter trainers: losses, the optimizer and its learning-rate
schedule, the one compiled train / eval step pair (`make_steps`, `evaluate`), orbax checkpoints, and one
checkpointed loop (`fit`) with progress, a time budget, exact resume and a loss plot (`plot_log`).

A run's state is any pytree (for example ``{"params": ..., "opt_state": ...}``); its bookkeeping is a JSON-able
``meta`` dict saved with every checkpoint (`new_meta` makes one): ``step``, ``next_index`` (the data cursor),
``tokens``, ``elapsed_s``, ``total_steps``, ``schedule`` (learning-rate segments, see `lr_at`), ``runs`` and
whatever the caller adds. `resume` restores both from the latest checkpoint; `fit` then continues with the same
data stream and schedule, so an interrupted and resumed run ends bit-identical to an uninterrupted one.
"""
from __future__ import annotations

import datetime
import functools
import json
import logging
import queue
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jspec.core import provenance as PV

RESTART_WARMUP = 50      # warmup steps of a continuation segment (a warm restart past a finished schedule)


# ----------------------------------------------------------------------------------------------------- losses


def token_nll(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """[..., T] negative log-likelihood of `targets` under `logits` [..., T, V] (float32)."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]


def masked_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
    """Mean of `x` where `mask` is nonzero (0 when the mask is empty)."""
    m = mask.astype(jnp.float32)
    return (x * m).sum() / jnp.maximum(m.sum(), 1.0)


def segment_mask(segment_ids: jax.Array) -> jax.Array:
    """[B, T, T] bool for packed rows: query t sees key s <= t of the same packed example (segment > 0)."""
    T = segment_ids.shape[1]
    same = (segment_ids[:, :, None] == segment_ids[:, None, :]) & (segment_ids[:, None, :] > 0)
    return same & jnp.tril(jnp.ones((T, T), bool))[None]


def answer_weights(segment_ids: jax.Array, mask: jax.Array, per_example: bool) -> jax.Array:
    """[B, T] weights of the masked tokens, summing to 1: equal per token, or (per_example) equal per packed
    example (`segment_ids` number a row's examples from 1; 0 is padding), shared by that example's tokens."""
    m = mask.astype(jnp.float32)
    if not per_example:
        return m / jnp.maximum(m.sum(), 1.0)
    B, T = m.shape
    ids = (jnp.arange(B)[:, None] * T + segment_ids).ravel()
    count = jax.ops.segment_sum(m.ravel(), ids, num_segments=B * T)
    examples = jnp.maximum((count > 0).sum(), 1)
    return m / jnp.maximum(count[ids].reshape(B, T), 1.0) / examples


# -------------------------------------------------------------------------------------------------- optimizer


def decays(params) -> Any:
    """Weight-decay mask: matrices (ndim >= 2), not the biases (`ports.core.fused`'s bqkv and b_gate_up are biases of
    any rank)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: x.ndim >= 2 and getattr(path[-1], "key", None) not in ("bqkv", "b_gate_up"), params)


def adamw(weight_decay: float, b1: float = 0.9, b2: float = 0.95, eps: float = 1e-8, clip: float = 1.0,
          mask: Callable = decays) -> optax.GradientTransformation:
    """Global-norm clipping then AdamW whose learning rate is a hyperparameter in the state (`set_lr` sets it each
    step, so a schedule lives in the run's meta, not in the compiled step)."""
    inner = optax.inject_hyperparams(optax.adamw, static_args=("mask",))(
        learning_rate=0.0, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, mask=mask)
    return optax.chain(optax.clip_by_global_norm(clip), inner)


def set_lr(opt_state, lr) -> Any:
    """`adamw`'s state with its learning rate set to `lr` (traceable)."""
    clip_state, inj = opt_state
    return clip_state, inj._replace(hyperparams={**inj.hyperparams, "learning_rate": jnp.asarray(lr, jnp.float32)})


def segment(start: int, total: int | None, peak: float, warmup: int) -> dict:
    """One learning-rate segment of a schedule (see `lr_at`)."""
    return {"start": start, "total": total, "peak": peak, "warmup": warmup}


def lr_at(schedule: list[dict], step: int) -> float:
    """The learning rate at `step` of a schedule: segments {start, total, peak, warmup}, each a linear warmup from
    its start to `peak`, then a cosine decay to 10% of it at `total` (constant `peak` while total is unknown). The
    first segment starts at 0; `resume` past a finished schedule appends a warm restart."""
    seg = [g for g in schedule if g["start"] <= step][-1]
    s, peak, warm, total = step - seg["start"], seg["peak"], seg["warmup"], seg["total"]
    if s < warm:
        return peak * (s + 1) / warm
    if total is None:
        return peak
    frac = min(1.0, (s - warm) / max(1, total - seg["start"] - warm))
    return float(optax.cosine_decay_schedule(peak, 1, alpha=0.1)(frac))


# ------------------------------------------------------------------------------------------------------- data


class Prefetch:
    """Items of an iterator made in a background thread (the data pipeline overlaps the jitted step). An
    exception raised while making them surfaces in `next`."""

    def __init__(self, it: Iterator, size: int = 4):
        self.q: queue.Queue = queue.Queue(size)
        self.stop = threading.Event()
        self.t = threading.Thread(target=self._run, args=(it,), daemon=True)
        self.t.start()

    def _run(self, it):
        try:
            for item in it:
                while not self.stop.is_set():
                    try:
                        self.q.put(item, timeout=0.5)
                        break
                    except queue.Full:
                        continue
                if self.stop.is_set():
                    return
        except BaseException as e:  # surfaced in the consumer
            self.q.put(e)

    def __iter__(self):
        return self

    def __next__(self):
        item = self.q.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self):
        self.stop.set()


# ------------------------------------------------------------------------------------------------ steps


class Steps(NamedTuple):
    """A trainer's two compiled programs (`make_steps`)."""
    train: Callable  # (params, opt_state, lr, *args) -> (params, opt_state, metrics); params, opt_state donated
    eval: Callable  # (params, *args) -> {name: (weighted sum, weight)}


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3), donate_argnums=(4, 5))
def _train_step(loss, static, tx, lr_setter, params, opt_state, lr, *args):
    args = jax.lax.stop_gradient(args)
    (_, metrics), grads = jax.value_and_grad(lambda p: loss(static, p, *args), has_aux=True)(params)
    updates, opt_state = tx.update(grads, lr_setter(opt_state, lr), params)
    return optax.apply_updates(params, updates), opt_state, {**metrics, "grad_norm": optax.global_norm(grads)}


@functools.partial(jax.jit, static_argnums=(0, 1))
def _eval_step(sums, static, params, *args):
    return sums(static, params, *args)


def make_steps(loss: Callable, sums: Callable, static, tx: optax.GradientTransformation,
               lr_setter: Callable = None) -> Steps:
    """The one train step and eval step every trainer runs. `loss(static, params, *args) -> (scalar, metrics)`:
    the train step differentiates it in `params` (the other arguments are constants: frozen target weights,
    batches, keys), applies `tx` with the learning rate `lr` set in its state (`lr_setter`, default `set_lr`)
    and returns the metrics with the gradient's global norm. `sums(static, params, *args) -> {name: (weighted
    sum, weight)}` is what `evaluate` averages over held-out batches. `loss` and `sums` are module-level functions
    and `static` is hashable (a config, options): equal runs share their compiled programs."""
    setter = set_lr if lr_setter is None else lr_setter
    return Steps(functools.partial(_train_step, loss, static, tx, setter), functools.partial(_eval_step, sums, static))


def evaluate(eval_step: Callable, params, batches, *args, prefix: str = "heldout_") -> dict:
    """Over `batches`: each of `eval_step(params, *args, batch)`'s weighted sums divided by its weight, named
    `prefix + name`."""
    tot: dict = {}
    for b in batches:
        for k, (v, w) in jax.device_get(eval_step(params, *args, b)).items():
            sv, sw = tot.get(k, (0.0, 0.0))
            tot[k] = (sv + float(v), sw + float(w))
    if not tot:
        raise ValueError("evaluate needs at least one batch")
    return {prefix + k: v / max(w, 1.0) for k, (v, w) in tot.items()}


def weighted_means(eval_step: Callable, state, batches) -> list[float]:
    """`eval_step(state, batch)` returns (sum_1, ..., sum_k, count); the sums over `batches` divided by the count."""
    tot = None
    for b in batches:
        out = [float(o) for o in jax.device_get(eval_step(state, b))]
        tot = out if tot is None else [t + o for t, o in zip(tot, out)]
    if tot is None:
        raise ValueError("weighted_means needs at least one batch")
    return [t / max(tot[-1], 1.0) for t in tot[:-1]]


# ------------------------------------------------------------------------------------------------ checkpoints


class Checkpoints:
    """Orbax checkpoints of (state pytree, meta dict) in `workdir/ckpt`, the latest `keep` kept."""

    def __init__(self, workdir: str | Path, keep: int = 2):
        import orbax.checkpoint as ocp

        self.dir = Path(workdir).resolve() / "ckpt"
        self.mgr = ocp.CheckpointManager(self.dir, options=ocp.CheckpointManagerOptions(max_to_keep=keep,
                                                                                         create=True))

    def latest_step(self) -> int | None:
        return self.mgr.latest_step()

    def save(self, step: int, state, meta: dict) -> None:
        import orbax.checkpoint as ocp

        self.mgr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
                      force=True)
        self.mgr.wait_until_finished()

    def restore(self, like) -> tuple[Any, dict] | None:
        """(state, meta) of the latest checkpoint, with `like`'s tree structure, shapes and dtypes; None if there
        is none."""
        import orbax.checkpoint as ocp

        step = self.latest_step()
        if step is None:
            return None
        template = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
        out = self.mgr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(template),
                                                             meta=ocp.args.JsonRestore()))
        return out["state"], dict(out["meta"])


def new_meta(name: str, seed: int, steps: int | None, lr: float, warmup: int, next_index: int = 0, **extra) -> dict:
    """The bookkeeping of a fresh run (schedule: one segment of `steps`, or of unknown length until `fit` sizes
    it to its time budget)."""
    return {"name": name, "seed": seed, "step": 0, "next_index": next_index, "total_steps": steps,
            "elapsed_s": 0.0, "tokens": 0, "runs": [], "schedule": [segment(0, steps, lr, warmup)], **extra}


def resume(ckpts: Checkpoints, state, meta: dict, steps: int | None = None, restart_peak: float | None = None,
           same: tuple[str, ...] = ("name", "seed")) -> tuple[Any, dict, bool]:
    """(state, meta, resumed): the latest checkpoint's, or the given fresh ones if there is none.

    A checkpoint whose `same` keys differ from `meta`'s is refused. `steps` must equal an unfinished schedule's
    length; past a finished schedule it appends a warm restart to `steps` (peak `restart_peak`, cosine to 10%)."""
    restored = ckpts.restore(state)
    if restored is None:
        return state, meta, False
    state, old = restored
    old.setdefault("runs", [])
    old.setdefault("schedule", [segment(0, old["total_steps"], meta["schedule"][0]["peak"],
                                        meta["schedule"][0]["warmup"])])
    for k in same:
        if old.get(k) != meta.get(k):
            raise ValueError(f"{ckpts.dir} holds a checkpoint with {k}={old.get(k)!r}, not {meta.get(k)!r}")
    finished = old["total_steps"] is not None and old["step"] >= old["total_steps"]
    if steps and old["total_steps"] and steps != old["total_steps"] and not (finished and steps > old["step"]):
        raise ValueError(f"steps={steps} differs from the checkpoint's unfinished schedule ({old['total_steps']} "
                         "steps): resume with the same number of steps or none")
    if finished and steps and steps > old["step"]:
        if restart_peak is None:
            raise ValueError("continuing a finished schedule needs restart_peak (the warm restart's learning rate)")
        old["schedule"].append(segment(old["step"], steps, restart_peak, RESTART_WARMUP))
        old["total_steps"] = steps
    return state, old, True


# ------------------------------------------------------------------------------------------------------ logs


def read_log(path: str | Path, upto: int | None = None) -> list[dict]:
    """The rows of a JSON-lines log (those with step <= upto)."""
    path = Path(path)
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if upto is None or r["step"] <= upto]


def append_log(path: str | Path, row: dict) -> None:
    with Path(path).open("a") as f:
        f.write(json.dumps(row) + "\n")


def plot_log(log: str | Path, out: str | Path, title: str, ylabel: str = "cross-entropy (nats / token)",
             train_key: str = "loss", heldout_key: str = "heldout_loss") -> Path | None:
    """A PNG of a `fit` log: the training loss per logged window (raw and smoothed) and the held-out loss at
    checkpoints, log scale. None (and a note) without matplotlib or without rows."""
    from jspec.tools import report

    rows = read_log(log)
    tr = [r for r in rows if train_key in r]
    ev = [r for r in rows if heldout_key in r]
    if not tr:
        return None
    last = tr[-1]
    with report.figure(str(out), figsize=(7, 4)) as fa:
        if fa is None:
            print("matplotlib missing: no loss plot")
            return None
        ax = fa[1][0, 0]
        steps, loss = np.array([r["step"] for r in tr]), np.array([r[train_key] for r in tr])
        ax.plot(steps, loss, color="tab:blue", alpha=0.3, lw=0.8)
        k = 5
        if len(loss) >= k:
            ax.plot(steps[k - 1:], np.convolve(loss, np.ones(k) / k, mode="valid"), color="tab:blue", label="train")
        if ev:
            ax.plot([r["step"] for r in ev], [r[heldout_key] for r in ev], "o-", color="tab:red", ms=4,
                    label="held-out")
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{title}: {last['step']} steps, {last.get('tokens', 0) / 1e6:.2f}M tokens, "
                     f"{last.get('elapsed_s', 0.0) / 60:.0f} min")
        ax.grid(alpha=0.3, which="both")
        ax.legend()
    logging.getLogger(__name__).info("wrote %s", out)
    return Path(out)


# ------------------------------------------------------------------------------------------------------- loop

Step = Callable[[Any, Any, float, int], tuple[Any, dict]]


def fit(step_fn: Step, state, data: Iterator, meta: dict, workdir: str | Path, *, ckpts: Checkpoints | None = None,
        budget_s: float = float("inf"), ckpt_minutes: float = 3.0, log_every: int = 10,
        evaluate: Callable[[Any], dict] | None = None, desc: str = "train", progress: bool = True,
        argv: list[str] | None = None, schedule_s: float | None = None,
        max_steps: int | None = None) -> tuple[Any, dict]:
    """Run `step_fn` until the schedule's last step, the time budget, Ctrl-C or SIGTERM; returns (state, meta).

    - `step_fn(state, batch, lr, step) -> (state, metrics)`: one update at the schedule's learning rate; metrics
      are scalars, averaged over each logged window.
    - `data` yields (batch, next_index, n_tokens) from `meta["next_index"]` on (an int, or a tuple of ints for a
      mix of streams); it runs in a background thread.
    - Every `log_every` steps a row (window means, lr, tok_s, tokens, elapsed_s) goes to `workdir/log.jsonl`;
      every `ckpt_minutes` and at the end, `evaluate(state)`'s dict is logged and a checkpoint saved.
    - Without a schedule length, the first 20 timed steps size it to fill `budget_s` (or `schedule_s`, when the
      schedule is to span several runs of `budget_s` each), at most `max_steps` (a fast device's budget would
      otherwise repeat a small data set for many epochs).
    - The log is cut back to the checkpoint's step first, and the checkpoint keeps the unlogged window's metrics,
      so a resumed run's log rows equal an uninterrupted one's.
    """
    from tqdm import tqdm

    workdir = Path(workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    ckpts = ckpts or Checkpoints(workdir)
    log_path = workdir / "log.jsonl"
    log_path.write_text("".join(json.dumps(r) + "\n" for r in read_log(log_path, meta["step"])))
    meta["runs"].append({"started": datetime.datetime.now().isoformat(timespec="seconds"),
                         "from_step": meta["step"], "argv": list(sys.argv[1:] if argv is None else argv),
                         "device": PV.device_model(), "jax": jax.__version__, "provenance": PV.provenance()})
    total = meta["total_steps"]
    bar = tqdm(total=total, initial=meta["step"], desc=desc, unit="step", mininterval=2.0, dynamic_ncols=True,
               disable=not progress)
    stopping = {"signal": False}

    def on_term(signum, frame):
        stopping["signal"] = True
    previous = signal.signal(signal.SIGTERM, on_term) if threading.current_thread() is threading.main_thread() \
        else None

    def checkpoint(final: bool = False):
        meta["window"] = [list(w) for w in window]       # a resumed run's first logged row averages the same steps
        row = {"step": meta["step"], **(evaluate(state) if evaluate else {}), "tokens": meta["tokens"],
               "elapsed_s": meta["elapsed_s"]}
        ckpts.save(meta["step"], state, meta)
        append_log(log_path, row)
        shown = ", ".join(f"{k} {v:.4f}" for k, v in row.items() if k not in ("step", "tokens", "elapsed_s"))
        bar.write(f"step {meta['step']}: {shown + '; ' if shown else ''}checkpoint saved{' (final)' if final else ''}")

    data = Prefetch(data)
    run_start = last_ckpt = time.perf_counter()
    elapsed0 = meta["elapsed_s"]
    window: list[tuple[dict, int, float]] = [tuple(w) for w in meta.pop("window", [])]
    timing: list[float] | None = None
    try:
        while total is None or meta["step"] < total:
            t0 = time.perf_counter()
            batch, next_index, n_tok = next(data)
            lr = lr_at(meta["schedule"], meta["step"])
            state, metrics = step_fn(state, batch, lr, meta["step"])
            metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
            dt = time.perf_counter() - t0
            meta["step"] += 1
            meta["next_index"] = _jsonable(next_index)
            meta["tokens"] += int(n_tok)
            meta["elapsed_s"] = elapsed0 + time.perf_counter() - run_start
            window.append((metrics, int(n_tok), dt))
            if timing is None:
                timing = []                      # the first step compiles: not timed
            else:
                timing.append(dt)
            if total is None and len(timing) >= 20:
                per_step = float(np.median(timing))
                left = (budget_s if schedule_s is None else schedule_s) - (time.perf_counter() - run_start)
                warm = meta["schedule"][-1]["warmup"]
                total = meta["step"] + max(warm - meta["step"], int(0.92 * left / per_step))
                if max_steps is not None:
                    total = max(meta["step"] + 1, min(total, max_steps))
                meta["total_steps"] = meta["schedule"][-1]["total"] = total
                bar.total = total
                capped = max_steps is not None and total == max_steps
                bar.write(f"{per_step:.2f} s/step: schedule of {total} steps "
                          + ("(the max_steps cap)" if capped else f"to fill {budget_s / 60:.0f} minutes"))
            if meta["step"] % log_every == 0:
                keys = window[0][0].keys()
                row = {"step": meta["step"], **{k: float(np.mean([w[0][k] for w in window])) for k in keys},
                       "lr": lr, "tok_s": sum(w[1] for w in window) / max(sum(w[2] for w in window), 1e-9),
                       "tokens": meta["tokens"], "elapsed_s": meta["elapsed_s"]}
                append_log(log_path, row)
                window = []
                bar.set_postfix({k: f"{row[k]:.4g}" for k in list(keys)[:4]}, tok_s=f"{row['tok_s']:.0f}",
                                lr=f"{lr:.2e}", refresh=False)
            bar.update()
            if time.perf_counter() - last_ckpt > 60.0 * ckpt_minutes:
                checkpoint()
                last_ckpt = time.perf_counter()
            if time.perf_counter() - run_start > budget_s or stopping["signal"]:
                why = "SIGTERM" if stopping["signal"] else f"time budget of {budget_s / 60:.1f} min"
                bar.write(f"stopping at step {meta['step']}: {why} reached")
                break
    except KeyboardInterrupt:
        bar.write(f"interrupted at step {meta['step']}")
    finally:
        data.close()
        bar.close()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    if ckpts.latest_step() != meta["step"]:
        checkpoint(final=True)
    return state, meta


def _jsonable(x):
    """A data cursor as JSON keeps it: an int, or a list of ints (several streams)."""
    return [int(v) for v in x] if isinstance(x, (tuple, list)) else int(x)


def finished(meta: dict) -> bool:
    """Whether the run reached its schedule's last step."""
    return meta["total_steps"] is not None and meta["step"] >= meta["total_steps"]
