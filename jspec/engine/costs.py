"""What a decode step costs on this device: an AR step, and a strategy's round at each depth it can draft to.

`measure(target, parts, start, batch=..., prompt_len=...)` times, warm and inside one compiled program
(`jspec.engine.profiling`: a step repeated n times in a `fori_loop`, the slope between two n; the median of
`runs` slopes taken in turn over every point, so that the machine's slow moments fall on all alike), the target's AR step
and the guarded strategy's whole round with every row made to draft to depth d = 0 .. D (d = 0: no draft, the
drafter only catches up and the target verifies one token). The depth is data, so one program serves every d. The
prompt repeats a random block, so that a drafter that copies (prompt lookup) finds something to draft; the table
keeps the draft tokens each depth actually offered per row and round.

A table is cached as JSON under `$JSPEC_COSTS_DIR` (else ~/.cache/jspec/costs), keyed by the device's model (a CPU's
name and vector extensions, a GPU's or TPU's kind: `jspec.core.provenance.device_model`), the jax version, the
target's and the strategy's shapes (not their values), the batch and the cache length (prompt length rounded up
to a power of two); a missing entry is measured. Each table records its provenance (machine, versions, flags,
commit, load). `jspec.Guarded` reads one (`jspec costs` prints it and its plot).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Callable

import jax
import numpy as np

from jspec.core import provenance as PV
from jspec.core.config import max_positions
from jspec.engine import profiling as PF
from jspec.engine.strategy import split
from jspec.parts.controllers.guard import Guard

COSTS_ENV = "JSPEC_COSTS_DIR"
VERSION = 3


@dataclasses.dataclass(frozen=True)
class CostTable:
    """Seconds per step on one device for one (target, strategy, batch, cache length)."""

    ar_s: float  # the target's AR step
    step_s: tuple[float, ...]  # a round of the strategy drafting to depth 0 .. D (0: no draft)
    drafted: tuple[float, ...] = ()  # draft tokens a row offered per round at each depth, as measured
    device: str = ""
    batch: int = 1
    prompt_len: int = 0
    key: str = ""
    measured: str = ""  # when (UTC)
    seconds: float = 0.0  # how long the measurement took
    provenance: dict = dataclasses.field(default_factory=dict)  # jspec.core.provenance.provenance() when measured

    @property
    def max_depth(self) -> int:
        return len(self.step_s) - 1

    def drafting_can_pay(self, slack: float = 1e-4) -> bool:
        """Whether some depth k >= 1 costs less than k + 1 rounds without drafts (with `slack`, relative): a round
        drafting to k commits at most k + 1 tokens, so where none does, no acceptance makes drafting pay and the
        guard picks depth 0 in every round (`jspec.Guarded.drafts`)."""
        s0 = self.step_s[0]
        return any(s < (k + 1) * s0 * (1.0 + slack) for k, s in enumerate(self.step_s) if k >= 1)

    def relative(self) -> np.ndarray:
        """The round times in AR steps."""
        return np.asarray(self.step_s) / self.ar_s

    @classmethod
    def flat(cls, max_depth: int) -> "CostTable":
        """Every depth costing one AR step (a placeholder for measuring; a guard run on it speculates freely)."""
        return cls(1.0, (1.0,) * (max_depth + 1))

    def format(self) -> str:
        rows = [f"{self.device}, batch {self.batch}, {self.prompt_len}-token prompt: AR step {self.ar_s * 1e3:.2f} ms",
                "depth | round ms | AR steps | drafts offered per row"]
        for d, s in enumerate(self.step_s):
            off = f"{self.drafted[d]:.2f}" if d < len(self.drafted) else ""
            rows.append(f"{d:5d} | {s * 1e3:8.2f} | {s / self.ar_s:8.2f} | {off}")
        return "\n".join(rows)


def costs_dir() -> Path:
    return Path(os.environ.get(COSTS_ENV) or Path.home() / ".cache" / "jspec" / "costs")


def _shapes(tree) -> list:
    """A pytree's structure with array leaves as (shape, dtype) and numbers as values: what shapes a program."""
    leaves, treedef = jax.tree.flatten(tree)
    out = [str(treedef)]
    for x in leaves:
        if hasattr(x, "shape") and hasattr(x, "dtype") and np.ndim(x) > 0:
            out.append((tuple(x.shape), str(x.dtype)))
        else:
            out.append(repr(np.asarray(x).tolist()) if np.ndim(x) == 0 and hasattr(x, "dtype") else repr(x))
    return out


def table_key(target, parts, batch: int, prompt_len: int, defer: int = 0) -> str:
    """The cache key of a table: the device's model (two CPUs of one kind but other models get other keys), the
    backend, the jax version, the XLA flags, the target's and the strategy parts' shapes, the batch, the cache
    length bucket and the guard's `defer`."""
    bucket = 1 << max(int(prompt_len) - 1, 1).bit_length()
    what = [VERSION, jax.default_backend(), PV.device_model(), jax.__version__, os.environ.get("XLA_FLAGS", ""),
            _shapes(target), _shapes(parts), int(batch), bucket, int(defer)]
    return hashlib.sha1(json.dumps(what, default=str).encode()).hexdigest()[:20]


def probe_prompt(vocab_size: int, prompt_len: int, batch: int, seed: int = 0) -> np.ndarray:
    """[batch, prompt_len] tokens: a random block repeated (so copies exist to look up), a different block per
    row."""
    rng = np.random.default_rng(seed)
    block = max(prompt_len // 4, 4)
    rows = [np.resize(rng.integers(3, vocab_size, block), prompt_len) for _ in range(batch)]
    return np.stack(rows).astype(np.int32)


def rounds_for(speed: float, lo: int, hi: int) -> tuple[int, int]:
    """The two round counts to time a point at whose round is `speed` times an AR step's length (<= 1 for a dearer
    round): (lo, hi) for an AR step's length, fewer for a dearer round, so that each point's timed runs last about
    as long as AR's (a round of 25 AR steps is timed over 1 and 2 rounds, not 4 and 16)."""
    f = min(1.0, max(float(speed), 0.0))
    b = max(2, int(np.ceil(hi * f)))
    return max(1, min(b - 1, round(lo * f))), b


def forced_depth(parts, defer: int = 24):
    """`parts` (a `Speculative`) under a guard forced to depth 0 that lets its drafter leave `defer` AR rounds
    unread: every round drafts nothing until the guard's `force` is replaced (the depth is data)."""
    D = parts.plan.max_depth
    return parts.replace(controller=Guard(np.ones(D + 1, np.float32), parts.controller, force=0, defers=defer))


def measure(target, parts, start: Callable, batch: int = 1, prompt_len: int = 128, defer: int = 24,
            cache: bool = True, reps=(4, 16), runs: int = 5, progress=None) -> CostTable:
    """The cost table of a strategy's `parts` (its `Speculative`, checked against `target`) under a guard that
    lets a drafter leave `defer` AR rounds unread, on `target` at this batch and prompt length: measured on this
    device, or read from the disk cache (`cache=False` measures anew and does not write). `start` is `jspec.start`
    (the decodes are started by it and their rounds timed here). `reps`: the two round counts whose time difference
    gives an AR step's time (fewer where the model's positions would run out); a dearer round is timed over
    proportionally fewer (`rounds_for`), so that a deep tree on a slow device is measured in about the time of its
    AR steps. `progress(str)` hears each step of the measurement. `jspec.costs.measure` is this for a strategy."""
    inner = parts
    D = inner.plan.max_depth
    key = table_key(target, inner, batch, prompt_len, defer)
    path = costs_dir() / f"{key}.json"
    if cache and path.exists():
        return CostTable(**{k: tuple(v) if isinstance(v, list) else v for k, v in json.loads(path.read_text()).items()})
    say = progress or (lambda s: None)
    t0 = time.perf_counter()
    prompt = probe_prompt(target.vocab_size, prompt_len, batch)
    # no decode loop compiled ahead (only the timed programs run), and those are compiled here and dropped after,
    # not kept in jit's cache beside the caller's programs
    lo, hi = reps
    mpe = max_positions(target)
    if mpe:  # a timed run of `hi` rounds commits up to hi * (D + 1) tokens: fewer rounds where positions run out
        room = (mpe - prompt_len - 2) // (D + 1)
        if room < 2:
            raise ValueError(f"a {prompt_len}-token prompt leaves room for {max(room, 0)} rounds of depth {D} within "
                             f"the model's max_position_embeddings={mpe}: measure at a shorter prompt_len")
        hi = min(hi, room)
        lo = min(lo, hi // 2)
    kw = dict(max_new_tokens=hi * (D + 1) + 2, eos_token_id=(), compile_loop=False)
    say(f"compile: an AR step and a round ({batch} rows, {prompt_len}-token prompt)")
    ar = start(target, prompt, None, **kw)
    st = start(target, prompt, forced_depth(inner, defer), **kw)
    guard = st.parts.controller
    points = {"ar": ("step", ar)}
    for d in range(D + 1):
        static, dyn = split(st.parts.replace(controller=guard.replace(force=d)))
        points[d] = ("sd_step", st._replace(static=static, dyn=dyn))
    programs = {}

    def timed(name, at, n):
        args = (at.dyn, at.target, (at.state, None, None), np.int32(n))
        if name not in programs:
            programs[name] = PF._repeat.lower(name, at.ctx, at.static, *args).compile()
        t = time.perf_counter()
        out = jax.block_until_ready(programs[name](*args))
        return time.perf_counter() - t, out[0]

    drafted, rough = [], {}
    for d in range(D + 1):  # compiles once (the depth is data); the drafts each depth offers per row and round
        t, end = timed(*points[d], lo)
        rough[d] = t / lo
        drafted.append(float(np.mean(np.asarray(end.drafted - st.state.drafted))) / lo)
    rough["ar"] = timed(*points["ar"], lo)[0] / lo
    n = {k: rounds_for(rough["ar"] / max(rough[k], 1e-12), lo, hi) for k in points}
    slopes = {k: [] for k in points}
    for r in range(runs):  # interleaved, so that the machine's slow moments fall on every point alike
        say(f"timing run {r + 1} of {runs}: AR and depths 0 .. {D}")
        for k, (name, at) in points.items():
            a, b = n[k]
            slopes[k].append((timed(name, at, b)[0] - timed(name, at, a)[0]) / (b - a))
    med = {k: max(float(np.median(v)), 1e-9) for k, v in slopes.items()}
    ar_s, step_s = med.pop("ar"), [med[d] for d in range(D + 1)]
    table = CostTable(float(ar_s), tuple(float(s) for s in step_s), tuple(drafted),
                      PV.device_model(), int(batch), int(prompt_len), key,
                      time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), time.perf_counter() - t0, PV.provenance())
    if cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(dataclasses.asdict(table), indent=1))
    return table


__all__ = ["CostTable", "costs_dir", "forced_depth", "measure", "probe_prompt", "rounds_for", "table_key"]
