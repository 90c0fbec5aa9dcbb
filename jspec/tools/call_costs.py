"""What a `jspec.decode` call costs beyond its steps, measured from whole calls (the in-program costs of a step are
`jspec.engine.profiling`'s)."""
from __future__ import annotations

import time

import jax
import numpy as np

import jspec
from jspec import api


def call_costs(target, prompts, strategy=None, max_new: tuple[int, ...] = (4, 8, 12, 16, 24), rounds: int = 5,
               **decode_kw) -> dict:
    """What a `jspec.decode` call costs beyond its steps, from whole calls: every prompt decoded at every
    `max_new` with EOS off (so the step count grows with it), `rounds` interleaved rounds after a compiling one, and
    the median decode time per (prompt, max_new) fitted as per_call_s + per_step_s x steps (least squares).

    Also: "zero_step_s", the median time of the compiled decode loop called on a state whose rows are all finished
    (launching the program, no step), and "prefill_s", the median prefill. "points": (steps, decode_s) per fit
    point."""
    kw = dict(decode_kw, strategy=strategy, eos_token_id=())
    runs: dict[tuple[int, int], list] = {}
    for r in range(rounds + 1):
        for i, p in enumerate(prompts):
            for n in max_new:
                o = jspec.decode(target, p, max_new_tokens=n, **kw)
                if r:
                    runs.setdefault((i, n), []).append((int(o.stats["steps"].max()), o.stats["decode_s"],
                                                        o.stats["prefill_s"]))
    points = [(v[0][0], float(np.median([x[1] for x in v]))) for v in runs.values()]
    steps, secs = np.array(points, float).T
    if len(set(steps)) < 2:
        raise ValueError(f"every call took {int(steps[0])} steps: give max_new values that differ more")
    per_step, per_call = np.polyfit(steps, secs, 1)
    s = api.start(target, prompts[0], max_new_tokens=max(max_new), **kw)
    state = s.state.replace(done=jax.numpy.ones_like(s.state.done))

    times = []
    for _ in range(3 + 20):
        t0 = time.perf_counter()
        state = jax.block_until_ready(s.run(state))
        times.append(time.perf_counter() - t0)
    return {"per_call_s": float(per_call), "per_step_s": float(per_step), "zero_step_s": float(np.median(times[3:])),
            "prefill_s": float(np.median([x[2] for v in runs.values() for x in v])), "points": points}
