"""Where a decode step's time goes: the phases of `jspec.engine.step.sd_step` (AR: `loop.ar_step`), timed two ways, with
the same phase functions the fused loop runs (`jspec.engine.step.PHASES`).

`host_timed` runs the decode loop phase by phase, each phase jitted alone and synced from the host: the same
tokens as the fused loop, but every phase also pays a dispatch and a sync (on a CPU that is a large share of a
small model's step).

`in_program_costs` times each phase, and the whole step, inside one compiled program: the phase repeated n times
in a `fori_loop`, at two values of n, the difference divided by the difference of n. Dispatch, sync and the loop's
own fixed cost cancel. The whole step is what a step of the fused decode loop should cost; what the loop spends
beyond it is the engine's overhead (loop control, the call, reading results back). The phases alone add up to
less than the whole step on a CPU: run back to back, the draft's and the target's work cost more than each
repeated alone (measured: a draft phase followed by an unrelated target AR step costs ~2 ms more than the two
repeated apart). Every repetition passes its inputs through an optimization barrier with the carried state, so no
part of a phase is hoisted out of the loop as loop-invariant.
"""
from __future__ import annotations

import functools
import re
import time

import jax
import numpy as np

from jspec.engine import loop
from jspec.engine import step as SD
from jspec.engine.strategy import merge

# the stats keys of a speculative profile, by phase (the third, "other", is the rule and the commit); AR: "step_s"
KEYS = {"draft": "draft_s", "verify": "verify_s", "accept": "other_s"}


def _phase_fn(name):
    if name == "step":
        return lambda ctx, parts, target, carry: (loop.ar_step(ctx, target, carry[0]), None, None)
    return dict(SD.PHASES)[name]


@functools.partial(jax.jit, static_argnames=("name", "ctx", "static"), donate_argnames=("carry",))
def _phase(name, ctx, static, dyn, target, carry):
    """One phase of the step (`jspec.engine.step.PHASES`, or "step": the AR step), alone in its own program."""
    return _phase_fn(name)(ctx, None if static is None else merge(static, dyn), target, carry)


_phase_keep = jax.jit(_phase.__wrapped__, static_argnames=("name", "ctx", "static"))  # keeps its input


def host_timed(started):
    """Run the decode loop phase by phase (AR: step by step), blocking after each; returns (state, summed seconds
    per phase: {"draft_s", "verify_s", "other_s"}, AR {"step_s"}). Same functions as the fused loop."""
    s = started
    names = ("step",) if s.parts is None else tuple(n for n, _ in SD.PHASES)
    keys = {"step": "step_s", **KEYS}
    times = {keys[n]: 0.0 for n in names}
    state = s.state
    while bool(loop.running(s.ctx, state)):
        carry = (state, None, None)
        for n in names:
            t0 = time.perf_counter()
            carry = jax.block_until_ready(_phase(n, s.ctx, s.static, s.dyn, s.target, carry))
            times[keys[n]] += time.perf_counter() - t0
        state = carry[0]
    return state, times


def _body(name, ctx, parts, target):
    """The loop body of `_repeat` for `name`: a phase of the step, the whole step ("sd_step", "step"), or a
    composition control ("ar+ar", "draft+ar": a draft phase, then a target AR step that does not use its
    proposal)."""
    ar = lambda s: loop.ar_step(ctx, target, s)
    if name == "sd_step":
        return lambda c: (SD.sd_step(ctx, parts, target, c[0]), c[1], c[2])
    if name == "ar+ar":
        return lambda c: (ar(ar(c[0])), c[1], c[2])
    if name == "draft+ar":
        return lambda c: (lambda d: (ar(d[0]), d[1], c[2]))(SD.sd_draft(ctx, parts, target, c))
    fn = _phase_fn(name)
    if name == "draft":
        return lambda c: fn(ctx, parts, target, c)[:2] + (c[2],)
    if name == "verify":
        return lambda c: fn(ctx, parts, target, c)

    def accept(c):  # a hybrid target's pending recurrent inputs are handed to every repetition's commit again
        s, pending = fn(ctx, parts, target, c)[0], c[0].cache.rec_new
        return (s if pending is None else s.replace(cache=s.cache.replace(rec_new=pending)), c[1], c[2])

    return accept


@functools.partial(jax.jit, static_argnames=("name", "ctx", "static"))
def _repeat(name, ctx, static, dyn, target, carry, n):
    """`name` applied n times (n traced: one compile serves every n); returns the whole carry (nothing is dead).
    Every repetition passes its inputs through an optimization barrier, so nothing is hoisted out of the loop."""
    body = _body(name, ctx, None if static is None else merge(static, dyn), target)
    return jax.lax.fori_loop(0, n, lambda _, c: body(jax.lax.optimization_barrier(c)), carry)


def _cost(name, started, carry, reps: tuple[int, int], runs: int) -> float:
    """Seconds per application of `name`: the slope between `reps` repetitions, median over `runs`."""
    s = started

    def timed(n):
        t0 = time.perf_counter()
        jax.block_until_ready(_repeat(name, s.ctx, s.static, s.dyn, s.target, carry, n))
        return time.perf_counter() - t0

    timed(reps[0])  # compile
    lo, hi = reps
    slopes = [(timed(hi) - timed(lo)) / (hi - lo) for _ in range(runs)]
    return max(float(np.median(slopes)), 0.0)


def _carries(started):
    """The state, and the carries after its draft and verify phases (the state is not consumed)."""
    s = started
    c0 = (s.state, None, None)
    c1 = _phase_keep("draft", s.ctx, s.static, s.dyn, s.target, c0)
    c2 = _phase_keep("verify", s.ctx, s.static, s.dyn, s.target, c1)
    return c0, c1, c2


def in_program_costs(started, reps: tuple[int, int] = (4, 16), runs: int = 3) -> dict[str, float]:
    """Seconds per step, timed inside one program from `started.state` (not consumed): {"step_s"} for AR, else
    the phases {"draft_s", "verify_s", "other_s"} and the whole step "step_s". The phases repeat on their own
    outputs, so a repetition does the work of a real step (shapes are static; the cache may run past its end, where
    writes clamp, which costs the same)."""
    if started.parts is None:
        return {"step_s": _cost("step", started, (started.state, None, None), reps, runs)}
    c0, c1, c2 = _carries(started)
    # the draft and the whole step repeat from a carry that already holds a proposal and logits (fixed shapes)
    out = {KEYS[name]: _cost(name, started, c, reps, runs)
           for name, c in (("draft", (c0[0], c2[1], c2[2])), ("verify", (c1[0], c1[1], c2[2])), ("accept", c2))}
    out["step_s"] = _cost("sd_step", started, (c0[0], c2[1], c2[2]), reps, runs)
    return out


def composition_control(started, reps: tuple[int, int] = (4, 16), runs: int = 3) -> dict[str, float]:
    """Seconds per repetition of a draft phase, a target AR step, both in one loop body ("draft+ar", the AR step
    not using the proposal) and two AR steps in one body ("ar+ar"), from a speculative start's state: whether
    composing two models' work costs more than its parts, with no speculative logic involved."""
    c0, _, c2 = _carries(started)
    carry = (c0[0], c2[1], c2[2])
    return {name: _cost(name, started, carry, reps, runs) for name in ("draft", "step", "draft+ar", "ar+ar")}


_CONTROL_OPS = ("while", "conditional", "call", "tuple", "get-tuple-element", "parameter")


def _hlo_instructions(hlo_text: str) -> dict[str, tuple[str, str]]:
    """Instruction name -> (result shape, the JAX op it came from) of a compiled module's text; control-flow
    instructions (whose time contains their bodies') are left out."""
    out = {}
    for line in hlo_text.splitlines():
        m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = (\S+) ([\w\-]+)\(", line)
        if not m or m.group(3) in _CONTROL_OPS:
            continue
        name = re.search(r'op_name="([^"]*)"', line)
        parts = name.group(1).split("/") if name else [m.group(3)]
        op = parts[-1]
        if len(parts) > 1 and "->" in parts[-2]:  # an einsum: keep its spec ("btd,dkgh->btkgh/dot_general")
            op = parts[-2] + "/" + op
        out[m.group(1)] = (m.group(2), op)
    return out


def op_costs(started, top: int | None = 25) -> dict:
    """Where the fused decode loop's time goes, by XLA operation: `started` (`jspec.api.start`'s result) runs its
    loop once under `jax.profiler.trace`, and each executed instruction's time is summed per (result shape, JAX op)
    and divided by the loop's steps. Returns {"steps", "ops": [{"op", "shape", "per_step", "us_per_step"}, ...]
    largest first (the `top` ones; None: all), "total_us_per_step"} (the instructions' summed time: where the
    runtime runs instructions on several threads at once, more than the loop's wall time). The loop runs once
    untraced first, on a copy of the state; the traced run consumes the state."""
    import glob
    import gzip
    import json
    import tempfile

    fn, args = started.loop_call()
    instr = _hlo_instructions(fn.lower(*args).compile().as_text())
    jax.block_until_ready(started.run(jax.tree.map(lambda x: x.copy(), started.state)))  # warm, untraced
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp):
            state = jax.block_until_ready(started.run())
        files = glob.glob(f"{tmp}/**/*.trace.json.gz", recursive=True)
        if not files:
            raise RuntimeError(f"jax.profiler.trace wrote no trace file under {tmp}")
        with gzip.open(files[0]) as f:
            events = json.load(f)["traceEvents"]
    steps = max(int(np.max(np.asarray(state.step))), 1)
    agg: dict[tuple[str, str], list] = {}
    for e in events:
        if e.get("ph") != "X" or e.get("name") not in instr:
            continue
        a = agg.setdefault(instr[e["name"]], [0.0, 0])
        a[0] += float(e["dur"])
        a[1] += 1
    ops = [{"op": op, "shape": shape, "per_step": n / steps, "us_per_step": us / steps}
           for (shape, op), (us, n) in agg.items()]
    ops.sort(key=lambda r: -r["us_per_step"])
    return {"steps": steps, "ops": ops[:top] if top else ops,
            "total_us_per_step": sum(r["us_per_step"] for r in ops)}
