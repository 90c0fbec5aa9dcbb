"""`jspec bench gpu`: everything that waits for a GPU, as one command of fixed steps with a time budget each (540 s
in all, compiles included, planned for one H100), every result written as soon as its step ends.

    jspec bench gpu                       # on a GPU: bench_out/gpu-<date>.{json,md,png}
    jspec bench gpu --steps 1,paper       # some of the steps (numbers or names), in the plan's order
    jspec bench gpu --dry-run             # every step on the CPU at tiny shapes (its numbers mean nothing)
    jspec bench gpu --budget-scale 1.5    # a slower card: every budget x 1.5

The steps (`STEPS`), in priority order:
  1 attention  cuDNN's flash attention against the blockwise pass (the project's cuDNN test, then both paths'
               error against an f32 reference and their time), and a first `decode` of a 7B-shaped model with and
               without its decode loop compiled beside the prefill (`api.start(compile_loop=)`)
  2 ar-7b      greedy AR on a random LLaMA-2-7B in bf16 against the HBM floor, batch 1 and 8 (`bench.suite_gpu`)
  3 methods    every strategy and method on SmolLM2-135M-Instruct (`jspec fetch smollm2-135m-instruct`) and the
               zoo pairs, and the suite's damped 7B pair: tokens per step, wall and decode speedup over AR, greedy
               rows equal to AR's (a differing row's first divergence measured as jspec.tools.bench.numerics does:
               the top-2 margin of an f32 reference forward, in bf16 ulps; a near-tie when small)
  4 paper      the papers' regime by cost, random weights at their shapes: an AR step, a verify of k tokens and a
               draft step of each drafter kind, timed inside one program; each method's predicted speedup
               tau x AR step / (verify + drafting), from step 3's tau (or the last recorded GPU run's) and from the
               paper's own tau, beside the paper's speedup, and measured / predicted where step 3 measured it
  5 long       7B bf16 prefill of 16k and 32k tokens and a Qwen2.5-VL-7B 12.5k-token video prefill, each in a
               fresh process (`jspec.tools.bench.long`'s programs)
  6 train      EESD head training step (LLaMA-2-13B shape, N = 3) and EAGLE head step (Lumina-mGPT-7B shape)

Each step runs in a fresh process (`--no-isolate`: in this one) that is killed at its budget. A step writes each
measurement as it finishes it and skips what its time left cannot hold, so a step cut short keeps what it
measured ("timed out" / "partial"); a step that raises is "failed" with its error and the next one starts. The
results files are rewritten after every step.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

from jspec.core import provenance as PV
from jspec.tools import report

BUDGET_TOTAL_S = 540  # the plan's sum: one 10-minute device command, with a minute to start and write
DRY_BUDGET_S = 120  # a dry-run step's deadline (the CPU; far more than it takes)
MARGIN_S = 3.0  # a step stops this much before its budget, so that its last write lands before the kill
NEAR_TIE_ULPS = 4.0  # a greedy row leaving AR's where the two tokens' reference logits are this close: a near-tie


@dataclasses.dataclass(frozen=True)
class Step:
    name: str
    budget_s: float  # seconds on one H100, compiles and the process's start included
    fn: str  # "module:function", called with a `Recorder`
    title: str


STEPS = (  # budgets from the 2026-11-27 H200 run: what each step used, and what the steps it skipped needed
    Step("attention", 85, "jspec.tools.bench.gpu:step_attention",
         "cuDNN vs blockwise prefill attention; a first decode with and without compile-ahead"),
    Step("ar-7b", 40, "jspec.tools.bench.gpu:step_ar", "AR on a random 7B LLaMA, bf16, against the HBM floor (batch 1, 8)"),
    Step("methods", 200, "jspec.tools.bench.gpu:step_methods",
         "strategies and methods on SmolLM2-135M-Instruct and the zoo pairs: tau, speedup, greedy == AR"),
    Step("paper", 110, "jspec.tools.bench.gpu:step_paper",
         "the papers' regime by cost: AR step, verify of k tokens, draft steps; predicted speedups"),
    Step("long", 75, "jspec.tools.bench.gpu:step_long", "7B bf16 prefill at 16k and 32k tokens; Qwen2.5-VL-7B video, 12.5k"),
    Step("train", 30, "jspec.tools.bench.gpu:step_train", "EESD (13B shape) and EAGLE head (Lumina-7B shape) training steps"),
)


# ------------------------------------------------------------------------------------------------ a step's record


class Recorder:
    """What a running step measured so far: `add(table, row)` and `put(**fields)` rewrite the step's part file at
    once (atomically), so a step killed at its budget keeps what it finished. `left()`: seconds to the step's own
    deadline; `fits(seconds, what)`: whether that much is left (if not, the skip is noted)."""

    def __init__(self, path: str, deadline: float, dry: bool, results: str | None = None, opts: dict | None = None):
        self.path, self.deadline, self.dry, self.results, self.opts = path, deadline, dry, results, opts or {}
        self.t0 = time.time()
        self.data: dict[str, Any] = {"tables": {}, "notes": [], "skipped": []}

    def left(self) -> float:
        return self.deadline - time.time()

    def fits(self, seconds: float, what: str) -> bool:
        if self.left() > seconds:
            return True
        self.data["skipped"].append(what)
        self.log(f"skipped {what}: {max(self.left(), 0):.0f} s left, needs ~{seconds:.0f} s")
        self._write()
        return False

    def add(self, table: str, row: dict) -> None:
        self.data["tables"].setdefault(table, []).append(row)
        self._write()

    def put(self, **fields) -> None:
        self.data.update(fields)
        self._write()

    def note(self, text: str) -> None:
        self.data["notes"].append(text)
        self.log(text)
        self._write()

    def log(self, text: str) -> None:
        print(f"    [{time.time() - self.t0:5.1f} s] {text}", flush=True)

    def _write(self) -> None:
        report.write_json(self.path, self.data, indent=1)


def _r(x, n: int = 3):
    """`x` rounded to n decimals, but to at least 4 significant digits (a dry run's tiny times and ratios keep
    their precision); None for None or a non-finite value."""
    if x is None:
        return None
    x = float(x)
    if not math.isfinite(x):
        return None
    if x == 0:
        return 0.0
    return round(x, max(n, 3 - math.floor(math.log10(abs(x)))))


med = statistics.median


# ------------------------------------------------------------------------------------------------ the runner


def select(names: str | None, steps=STEPS) -> list[Step]:
    """The steps named in a comma-separated list of numbers (1-based) or names, in the plan's order (None: all)."""
    if not names:
        return list(steps)
    want = set()
    for part in (p.strip() for p in str(names).split(",") if p.strip()):
        if part.isdigit() and 1 <= int(part) <= len(steps):
            want.add(steps[int(part) - 1].name)
        elif part in {s.name for s in steps}:
            want.add(part)
        else:
            raise ValueError(f"unknown step {part!r}; the steps are "
                             + ", ".join(f"{i + 1} {s.name}" for i, s in enumerate(steps)))
    return [s for s in steps if s.name in want]


def plan_lines(plan: list[Step], scale: float, dry: bool) -> list[str]:
    total = sum(s.budget_s * scale for s in plan)
    out = [f"jspec bench gpu{' --dry-run (CPU, tiny shapes)' if dry else ''}: {len(plan)} steps, "
           f"{total:.0f} s of budgets (GPU, x{scale:g})" + (f"; dry-run deadline {DRY_BUDGET_S} s per step" if dry
                                                           else ""),
           "| # | step | budget | what |", "|---|---|---|---|"]
    for i, s in enumerate(plan):
        out.append(f"| {i + 1} | {s.name} | {s.budget_s * scale:.0f} s | {s.title} |")
    return out


def run(steps: str | list[Step] | None = None, out_dir: str | None = None, dry_run: bool = False,
        budget_scale: float = 1.0, isolate: bool = True, opts: dict | None = None,
        after_step: Callable[[str, list], None] | None = None, env: dict | None = None) -> dict:
    """Run the steps in order, each under its budget plus what the steps before it left unspent (so the plan's sum
    bounds the whole run, and a step that skips or ends early hands its time on), rewriting
    `<out_dir>/gpu[-dry]-<date>.{json,md,png}` after each; returns the result. What an earlier call of the same day
    wrote there and this one does not measure is kept (`merge_earlier`), so that a second call adds to the first.
    `after_step(name, files)` is called after each write (tests)."""
    plan = steps if isinstance(steps, list) else select(steps)
    if budget_scale <= 0:
        raise ValueError(f"budget scale must be > 0, got {budget_scale}")
    if out_dir is None:
        out_dir = tempfile.mkdtemp(prefix="jspec-bench-gpu-dry-") if dry_run else "bench_out"
    os.makedirs(out_dir, exist_ok=True)
    date = time.strftime("%Y-%m-%d")
    stem = os.path.join(out_dir, f"gpu{'-dry' if dry_run else ''}-{date}")
    numbers = {s.name: i + 1 for i, s in enumerate(STEPS)}
    result = {"meta": {"date": date, "dry_run": dry_run, "budget_scale": budget_scale, "isolated": isolate,
                       "argv": sys.argv[1:], "host_cpus": os.cpu_count(), "opts": opts or {}},
              "plan": [{"step": numbers.get(s.name, i + 1), "name": s.name, "title": s.title,
                        "budget_s": s.budget_s * budget_scale} for i, s in enumerate(plan)],
              "steps": {}}
    earlier = _read_part(stem + ".json")
    merge_earlier(result, earlier)
    this_call = {"argv": sys.argv[1:], "budget_scale": budget_scale, "seconds": 0.0, "steps": [s.name for s in plan]}
    if earlier.get("steps"):  # the calls of the day, each with the steps it ran
        em = earlier.get("meta", {})
        result["meta"]["calls"] = em.get("calls") or [
            {"argv": em.get("argv", []), "budget_scale": em.get("budget_scale", 1), "seconds": em.get("seconds", 0),
             "steps": [n for n, st in earlier["steps"].items() if not st.get("earlier")]}]
        result["meta"]["calls"].append(this_call)
    print("\n".join(plan_lines(plan, budget_scale, dry_run)), flush=True)
    work = tempfile.mkdtemp(prefix="jspec-bench-gpu-")
    files = write(result, stem)  # the plan, before anything runs
    t_all = time.time()
    planned = 0.0  # seconds from t_all by which the steps so far were to end
    for i, step in enumerate(plan):
        own = DRY_BUDGET_S if dry_run else step.budget_s * budget_scale
        planned += own
        t0 = time.time()
        budget = own if dry_run else max(planned - (t0 - t_all), own)
        part = os.path.join(work, f"{step.name}.json")
        extra = f" ({budget - own:+.0f} s from the steps before)" if round(budget - own) else ""
        print(f"\n[{i + 1}/{len(plan)}] {step.name} (budget {budget:.0f} s{extra}): {step.title}", flush=True)
        go = _run_isolated if isolate else _run_inline
        status, error = go(step, part, t0 + budget, dry_run, stem + ".json", opts or {}, env or {})
        data = _read_part(part)
        if status == "ok" and data.get("skipped"):
            status = "partial"
        error = error or data.pop("error", None)
        result["steps"][step.name] = {"status": status, "seconds": round(time.time() - t0, 1),
                                      "budget_s": round(budget, 1), **({"error": error} if error else {}), **data}
        merge_earlier(result, earlier)
        result["meta"]["seconds"] = this_call["seconds"] = round(time.time() - t_all, 1)
        files = write(result, stem)
        if after_step is not None:
            after_step(step.name, files)
        s = result["steps"][step.name]
        print(f"[{i + 1}/{len(plan)}] {step.name}: {status} in {s['seconds']:.0f} s"
              + (f" ({error})" if error else "") + (f": {s['headline']}" if s.get("headline") else ""), flush=True)
    print("\n" + "\n".join(summary_lines(result)))
    print("wrote " + ", ".join(files), flush=True)
    result["files"] = files
    return result


def merge_earlier(result: dict, earlier: dict) -> None:
    """Fold an earlier call of the same day into `result` (in place): its steps this call does not run (marked
    "earlier"); when both ran the methods step, the earlier rows, notes and skips of the pairs this call measured
    nothing of (each row marked "call": "earlier"); and when the paper step is the earlier one while step 3 ran
    now, its predictions made again from its recorded costs and the merged step 3 (`repredict`)."""
    steps = earlier.get("steps", {})
    planned = {p["name"] for p in result["plan"]}
    for p in earlier.get("plan", []):
        if p["name"] not in planned and p["name"] in steps:
            result["plan"].append(p)
            result["steps"][p["name"]] = {**steps[p["name"]], "earlier": True}
    result["plan"].sort(key=lambda p: p["step"])
    now, before = result["steps"].get("methods"), steps.get("methods")
    if now and not now.get("earlier") and before and not now.get("merged"):
        tables = now.setdefault("tables", {})
        ours = {r["pair"] for r in tables.get("rows", [])}
        mine = lambda text: any(text.startswith(p + ":") or text == f"pair {p}" for p in ours)  # noqa: E731
        kept = [{**r, "call": "earlier"} for r in before.get("tables", {}).get("rows", []) if r["pair"] not in ours]
        if kept:
            tables["rows"] = kept + tables.get("rows", [])
            now["notes"] = [n for n in before.get("notes", []) if not mine(n)] + now.get("notes", [])
            now["skipped"] = [n for n in before.get("skipped", []) if not mine(n)] + now.get("skipped", [])
            now["merged"] = (f"rows of {sorted({r['pair'] for r in kept})} from an earlier call of the same day")
            now["headline"] = methods_headline(tables["rows"])
    paper = result["steps"].get("paper")
    if paper and paper.get("earlier") and now and not now.get("earlier") and not paper.get("repredicted"):
        repredict(result)


def repredict(result: dict) -> None:
    """The paper step's methods table made again (in place) from its recorded costs and the result's step 3 rows
    (then the recorded GPU runs', as `measured_rows`): the same arithmetic the step does, over the same costs."""
    paper = result["steps"]["paper"]
    costs = {(c["shape"], c["k"]): c["ms"] / 1e3 for c in paper.get("tables", {}).get("costs", [])}
    by = measured_rows(Recorder(os.devnull, 0, bool(result["meta"].get("dry_run"))), current=result)
    paper.setdefault("tables", {})["methods"] = method_rows(costs, by)
    paper["repredicted"] = "predictions made again from the recorded costs after a later call's step 3"


def _read_part(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        return {}


def _call(fn: str) -> Callable:
    module, name = fn.split(":")
    return getattr(importlib.import_module(module), name)


def _run_inline(step: Step, part: str, deadline: float, dry: bool, results: str, opts: dict, env: dict):
    """The step in this process: its deadline is only the step's own (nothing kills it)."""
    rec = Recorder(part, deadline - MARGIN_S, dry, results, opts)
    rec._write()
    try:
        _call(step.fn)(rec)
    except Exception as e:  # noqa: BLE001 - a step's failure is its result; the next step runs
        traceback.print_exc()
        return "failed", f"{type(e).__name__}: {e}"
    return ("over budget", None) if time.time() > deadline else ("ok", None)


def _run_isolated(step: Step, part: str, deadline: float, dry: bool, results: str, opts: dict, env: dict):
    """The step in a fresh process (its own session, so that the processes it starts die with it), killed at the
    deadline."""
    cmd = [sys.executable, "-m", "jspec.tools.bench.gpu", "--child", step.fn, "--part", part, "--deadline", repr(deadline),
           "--results", results, "--opts", json.dumps(opts)] + (["--dry-run"] if dry else [])
    penv = dict(os.environ)
    penv.update(env)
    penv.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", ".9")  # a step has the device to itself
    penv.setdefault("HF_HUB_OFFLINE", "1")
    proc = subprocess.Popen(cmd, env=penv, start_new_session=True)
    try:
        rc = proc.wait(timeout=max(deadline - time.time(), 0.1))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return "timed out", None
    if rc == 0:
        return "ok", None
    return "failed", _read_part(part).get("error") or f"the step's process exited with status {rc}"


def child_main(argv=None) -> int:
    """A step in its own process (`_run_isolated`)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", required=True)
    ap.add_argument("--part", required=True)
    ap.add_argument("--deadline", type=float, required=True)
    ap.add_argument("--results")
    ap.add_argument("--opts", default="{}")
    ap.add_argument("--dry-run", action="store_true")
    a = ap.parse_args(argv)
    rec = Recorder(a.part, a.deadline - MARGIN_S, a.dry_run, a.results, json.loads(a.opts))
    rec._write()
    try:
        _call(a.child)(rec)
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        rec.put(error=f"{type(e).__name__}: {e}")
        return 1
    return 0


# ------------------------------------------------------------------------------------------------ output


def summary_lines(result: dict) -> list[str]:
    """The one table a reader looks at first: each step's status, time against budget and headline."""
    rows = []
    for p in result["plan"]:
        s = result["steps"].get(p["name"])
        rows.append({"#": p["step"], "step": p["name"],
                     "status": (s["status"] + (" (earlier call)" if s.get("earlier") else "")) if s else "not run",
                     "s / budget": f"{s['seconds']:.0f} / {s['budget_s']:.0f}" if s else f"- / {p['budget_s']:.0f}",
                     "headline": (s.get("headline") or s.get("error") or "") if s else ""})
    return report.markdown_table(rows)


def markdown(result: dict) -> str:
    m = result["meta"]
    dev = next((s["device"] for s in result["steps"].values() if s.get("device")), {})
    out = [f"# jspec bench gpu, {m['date']}" + (" (dry run on the CPU: the numbers mean nothing)" if m["dry_run"]
                                                 else ""), "",
           f"{dev.get('kind', 'device unknown')}, jax {dev.get('jax', '?')}; "
           + (f"{len(m['calls'])} calls" if m.get("calls") else f"budgets x{m['budget_scale']:g}")
           + f", {m.get('seconds', 0):.0f} s in all.", *([""] + [
               f"- call {i + 1}: `{' '.join(c['argv'])}` (budgets x{c['budget_scale']:g}, "
               f"{c['seconds']:.0f} s): {', '.join(c['steps'])}" for i, c in enumerate(m.get("calls", []))]
               if m.get("calls") else []), "", *summary_lines(result)]
    for p in result["plan"]:
        s = result["steps"].get(p["name"])
        if not s:
            continue
        out += ["", f"## {p['step']}. {p['name']}: {p['title']}", "",
                f"{s['status']}, {s['seconds']:.0f} s of {s['budget_s']:.0f}"
                + (f"; error: {s['error']}" if s.get("error") else "")]
        for key in ("headline", "merged", "repredicted"):
            if s.get(key):
                out += ["", s[key]]
        for name, rows in s.get("tables", {}).items():
            out += ["", f"**{name}**", "", *report.markdown_table(rows)]
        if s.get("notes") or s.get("skipped"):
            out.append("")
        for n in s.get("notes", []):
            out.append(f"- {n}")
        if s.get("skipped"):
            out.append("- skipped for lack of time: " + "; ".join(s["skipped"]))
    return "\n".join(out) + "\n"


def write(result: dict, stem: str) -> list[str]:
    """The result as JSON and markdown (and the plot, when there is something to plot); returns the paths."""
    files = [report.write_json(stem + ".json", result, indent=1), report.write_text(stem + ".md", markdown(result))]
    try:
        if plot(result, stem + ".png"):
            files.append(stem + ".png")
    except Exception as e:  # noqa: BLE001 - a plot is never worth a lost result
        print(f"(no plot: {type(e).__name__}: {e})", flush=True)
    return files


def plot(result: dict, path: str) -> str | None:
    """Panels for what is there: step 4's verify cost against k (in AR steps of each target), its predicted
    speedups beside the papers', step 3's measured speedups. None when there is nothing to plot or no matplotlib."""
    steps = result["steps"]
    costs = steps.get("paper", {}).get("tables", {})
    curves = [r for r in costs.get("costs", []) if r.get("role") == "target" and r.get("k")]
    preds = [r for r in costs.get("methods", []) if r.get("paper_speedup") or r.get("predicted")]
    measured = [r for r in steps.get("methods", {}).get("tables", {}).get("rows", [])
                if r.get("strategy") != "AR" and r.get("wall_speedup") is not None]
    panels = [p for p, rows in (("curve", curves), ("pred", preds), ("meas", measured)) if rows]
    if not panels:
        return None
    with report.figure(path, 1, len(panels), figsize=(5.5 * len(panels), 4.0)) as fa:
        if fa is None:
            return None
        for ax, p in zip(fa[1][0], panels):
            if p == "curve":
                for shape in dict.fromkeys(r["shape"] for r in curves):
                    pts = sorted((r["k"], r["over_ar"]) for r in curves if r["shape"] == shape and r.get("over_ar"))
                    ax.plot([a for a, _ in pts], [b for _, b in pts], "o-", ms=3, label=shape)
                ax.set_xscale("log", base=2)
                ax.set_xlabel("tokens verified per forward (k)")
                ax.set_ylabel("forward time / AR step")
                ax.set_title("verify cost at the papers' shapes", fontsize=9)
                ax.axhline(1.0, color="gray", lw=0.8)
                ax.legend(fontsize=6)
            elif p == "pred":
                report.grouped_bars(ax, [r["method"] for r in preds], {
                    "predicted, measured tau": [r.get("predicted") or 0 for r in preds],
                    "predicted, paper's tau": [r.get("predicted_paper_tau") or 0 for r in preds],
                    "paper": [r.get("paper_speedup") or 0 for r in preds]}, "speedup over AR", rotation=60,
                    fontsize=6, title="the papers' regime: predicted by cost vs reported")
            else:
                report.grouped_bars(ax, [f"{r['pair']}: {r['strategy']}" for r in measured], {
                    "wall": [r["wall_speedup"] for r in measured],
                    "decode loop": [r.get("decode_speedup") or 0 for r in measured]}, "speedup over AR",
                    rotation=60, fontsize=6, title="measured on the real model and the zoo")
    return path


# ------------------------------------------------------------------------------------------------ shared helpers


def device_info() -> dict:
    import jax

    d = jax.devices()[0]
    stats = d.memory_stats() or {}
    return {"kind": getattr(d, "device_kind", d.platform), "backend": jax.default_backend(), "jax": jax.__version__,
            "provenance": PV.provenance(),
            "memory_gb": _r(stats.get("bytes_limit", 0) / 2 ** 30, 1)}


def text_config(name, tiny: bool = False, **over):
    """The text decoder of a shipped config (`jspec/tools/configs`) or an HF config dict as a LLaMA / Qwen2 `TextConfig`:
    a VLM's language model, Chameleon's layers as LLaMA's (its QK-norm left out), M-RoPE as plain RoPE (same cost).
    `tiny`: a 2-layer, 64-wide stand-in (dry runs); `over`: HF fields to change after that (num_hidden_layers)."""
    from jspec.tools import memory as MEM
    from ports.model import family

    d = MEM.load_config(name) if isinstance(name, str) else dict(name)
    mt = d["model_type"]
    t = dict(d.get("text_config") or {k: v for k, v in d.items() if k not in ("vision_config", "vq_config")})
    t.pop("rope_scaling", None)
    t["model_type"] = "qwen2" if mt.startswith("qwen2") else "llama"
    if tiny:
        kv = 2 if t.get("num_key_value_heads", 1) < t.get("num_attention_heads", 1) else 4
        t.update(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=kv, vocab_size=512,
                 num_hidden_layers=min(int(t.get("num_hidden_layers", 2)), 2), head_dim=16)
    t.update(over)
    return family(t["model_type"]).config_from_hf(t)


def random_model(cfg, dtype):
    import jax

    import ports

    m = ports.random_model(cfg, key=0, std=0.02, dtype=dtype)
    jax.block_until_ready(m.params)
    return m


def _dtype(rec):
    import jax.numpy as jnp

    return jnp.float32 if rec.dry else jnp.bfloat16


def _numerics():
    """`jspec.tools.bench.numerics` (bf16 arithmetic: near-ties, first divergences, casting a pair)."""
    from jspec.tools.bench import numerics

    return numerics


# ------------------------------------------------------------------------------------------------ step 1


def step_attention(rec: Recorder) -> None:
    """cuDNN vs blockwise prefill attention; a first decode with and without compile-ahead."""
    if rec.dry:
        rec.note("dry run: the cuDNN check (`cudnn_check`) runs on a GPU only")
    elif rec.fits(40, "the cuDNN check"):
        rec.put(cudnn_test=_check_in_child("cudnn_check", min(rec.left() - 20, 90)))
        rec.log(f"cuDNN test: {rec.data['cudnn_test']['outcome']}")
    rec.put(device=device_info())
    shapes = [(256, 4, 2, 64)] if rec.dry else [(8192, 32, 32, 128), (16384, 28, 4, 128)]
    for T, H, KVH, Dh in shapes:
        if rec.fits(10, f"attention at {T} tokens"):
            rec.add("attention", _attention_point(T, H, KVH, Dh, rec.dry))
            rec.log(f"attention {rec.data['tables']['attention'][-1]}")
    _compile_ahead(rec)
    att = rec.data["tables"].get("attention", [])
    ca = rec.data.get("compile_ahead") or {}
    rec.put(headline="; ".join(filter(None, [
        f"cuDNN test {rec.data['cudnn_test']['outcome']}" if "cudnn_test" in rec.data else None,
        ", ".join(f"{a['tokens']} tokens: {a['implementation']} {a['fused_ms']} ms vs blockwise {a['blockwise_ms']} "
                  f"ms, max err {a['fused_err']} vs {a['blockwise_err']}" for a in att) or None,
        f"first decode {ca['with_s']} s with compile-ahead, {ca['without_s']} s without" if ca else None])))


def cudnn_check() -> None:
    """On a GPU, "auto" runs cuDNN's kernel for a bf16 prefill (grouped-query, head size 128, 2,048 tokens) and it
    agrees with the blockwise pass within bf16 rounding of the output; AssertionError otherwise."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from ports.core import blockwise as BW

    if jax.default_backend() != "gpu":
        raise RuntimeError("cuDNN's flash attention needs a CUDA GPU")
    rng = np.random.default_rng(3)
    B, T, H, KVH, Dh = 2, 2048, 8, 2, 128
    q, k, v = (jnp.asarray(rng.normal(size=(B, T, h, Dh)), jnp.bfloat16) for h in (H, KVH, KVH))
    zero = jnp.zeros((B,), jnp.int32)
    calls, real = [], jax.nn.dot_product_attention

    def spy(*a, **kw):
        out = real(*a, **kw)
        calls.append(kw)
        return out

    jax.nn.dot_product_attention = spy
    try:
        fused = jax.jit(lambda q, k, v: BW.causal_attention(q, k, v, zero))(q, k, v)
    finally:
        jax.nn.dot_product_attention = real
    assert calls and calls[0]["implementation"] == "cudnn", f"the fused path ran {calls or 'nothing'}"
    mode, BW.FUSED = BW.FUSED, "off"
    try:
        ref = jax.jit(lambda q, k, v: BW.causal_attention(q, k, v, zero))(q, k, v)
    finally:
        BW.FUSED = mode
    np.testing.assert_allclose(np.asarray(fused, np.float32), np.asarray(ref, np.float32), atol=2e-2, rtol=2e-2)


def _check_in_child(name: str, timeout: float) -> dict:
    """A check of this module in its own process (which allocates the device only as it needs: this one holds it
    later): "passed" when it returns, "failed" with the error's last lines when it raises."""
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    code = f"from jspec.tools.bench import gpu; gpu.{name}(); print('check passed')"
    t0 = time.time()
    try:
        p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                           timeout=max(timeout, 5))
        tail = (p.stdout + p.stderr).strip().splitlines()[-3:]
        outcome = "passed" if p.returncode == 0 and "check passed" in p.stdout else "failed"
    except subprocess.TimeoutExpired:
        tail, outcome = [], "timed out"
    return {"test": name, "outcome": outcome, "seconds": _r(time.time() - t0, 1), "tail": tail}


def _attention_point(T: int, H: int, KVH: int, Dh: int, dry: bool) -> dict:
    """One causal prefill attention [1, T, H, Dh] over KVH heads, bf16: the fused path ("auto": cuDNN on a GPU; a
    dry run: XLA's) and the blockwise pass, each against the blockwise pass on the same inputs in f32, and their
    time (median of 5 warm calls)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from ports.core import blockwise as BW

    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(1, T, h, Dh)), jnp.bfloat16) for h in (H, KVH, KVH))
    zero = jnp.zeros((1,), jnp.int32)
    calls, real, mode = [], jax.nn.dot_product_attention, BW.FUSED

    def spy(*a, **kw):
        out = real(*a, **kw)
        calls.append(kw.get("implementation"))
        return out

    def timed(fn):
        jax.block_until_ready(fn(q, k, v))
        ts = []
        for _ in range(5):
            t = time.perf_counter()
            jax.block_until_ready(fn(q, k, v))
            ts.append(time.perf_counter() - t)
        return med(ts)

    try:
        jax.nn.dot_product_attention = spy
        BW.FUSED = "xla" if dry else "auto"
        fused_fn = jax.jit(lambda q, k, v: BW.causal_attention(q, k, v, zero))
        fused, fused_s = fused_fn(q, k, v), timed(fused_fn)
        BW.FUSED = "off"
        block_fn = jax.jit(lambda q, k, v: BW.causal_attention(q, k, v, zero))
        block, block_s = block_fn(q, k, v), timed(block_fn)
        f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
        with jax.default_matmul_precision("highest"):  # a GPU's default f32 dot is TF32
            ref = jax.jit(lambda q, k, v: BW.causal_attention(f32(q), f32(k), f32(v), zero))(q, k, v)
    finally:
        jax.nn.dot_product_attention, BW.FUSED = real, mode
    err = lambda a: float(jnp.max(jnp.abs(a.astype(jnp.float32) - ref)))  # noqa: E731
    diff = float(jnp.max(jnp.abs(fused.astype(jnp.float32) - block.astype(jnp.float32))))
    return {"tokens": T, "heads": H, "kv_heads": KVH, "head_dim": Dh,
            "implementation": calls[0] if calls else "none (blockwise)", "fused_ms": _r(fused_s * 1e3, 2),
            "blockwise_ms": _r(block_s * 1e3, 2), "fused_err": _r(err(fused), 4), "blockwise_err": _r(err(block), 4),
            "fused_vs_blockwise": _r(diff, 4), "agree": bool(diff <= 2e-2 + 2e-2 * float(jnp.max(jnp.abs(ref))))}


def _compile_ahead(rec: Recorder) -> None:
    """A first decode (prefill + decode loop, compiles included) of a bf16 LLaMA with 16 of LLaMA-2-7B's layers (half
    its compile, so that both variants fit the budget), with the loop compiled beside the prefill and without,
    alternating, every compiled program dropped before each call."""
    import jax
    import numpy as np

    from jspec import api

    cfg = text_config("llama-2-7b", tiny=rec.dry, **({} if rec.dry else {"num_hidden_layers": 16}))
    P, N = (64, 8) if rec.dry else (1024, 32)
    if not rec.dry:  # the device's own first-use costs, paid before either variant
        warm = random_model(text_config("llama-68m", tiny=True), _dtype(rec))
        api.start(warm, np.arange(8) + 3, max_new_tokens=2, eos_token_id=()).run()
    if not rec.fits(1 if rec.dry else 30, "compile-ahead"):
        return
    model = random_model(cfg, _dtype(rec))
    prompt = np.random.default_rng(0).integers(3, cfg.vocab_size, P)
    times: dict[str, list] = {"with": [], "without": []}
    for r in range(1 if rec.dry else 3):
        for ahead in ((True, False) if r % 2 == 0 else (False, True)):
            need = max([t for ts in times.values() for t in ts] or [0])
            if not rec.fits(need + 1, f"first decode, round {r + 1}, compile-ahead {ahead}"):
                break
            jax.clear_caches()
            t0 = time.perf_counter()
            s = api.start(model, prompt, max_new_tokens=N, eos_token_id=(), compile_loop=ahead)
            jax.block_until_ready(s.run().out)
            dt = time.perf_counter() - t0
            times["with" if ahead else "without"].append(dt)
            rec.add("first_decode", {"compile_ahead": ahead, "seconds": _r(dt, 2), "prefill_s": _r(s.prefill_s, 2),
                                     "prompt": P, "new_tokens": N, "layers": cfg.num_layers})
    if times["with"] and times["without"]:
        w, wo = med(times["with"]), med(times["without"])
        rec.put(compile_ahead={"with_s": _r(w, 2), "without_s": _r(wo, 2), "gain_s": _r(wo - w, 2)})


# ------------------------------------------------------------------------------------------------ step 2


def step_ar(rec: Recorder) -> None:
    """`bench.suite_gpu`'s `ar` part: a random LLaMA-2-7B in bf16, batch 1 and 8, against the HBM floor."""
    from jspec.tools.bench import zoo as BENCH

    rec.put(device=device_info())
    res = BENCH.suite_gpu(runs=1 if rec.dry else 3, quick=rec.dry, progress=False, allow_cpu=rec.dry,
                      with_transformers=False, parts=("ar",), zoo=False)
    rec.put(bandwidth_gbs=res["bandwidth_gbs"])
    for row in res["rows"]:
        rec.add("rows", row)
    rec.put(headline="; ".join(f"batch {r['batch']}: {r['ms_per_token']} ms/token = {r['x_floor']}x the HBM floor "
                               f"({r['jspec_tok_s']} tok/s)" for r in res["rows"]))


# ------------------------------------------------------------------------------------------------ step 3


@dataclasses.dataclass
class BenchPair:
    """A model (and draft) with prompts and the strategies to compare; `decode(strategy)` -> (token rows, totals as
    `bench._decode_rows` gives them); `greedy`: whether rows must equal AR's."""

    name: str
    target: Any
    prompts: list
    strategies: list  # [(name, strategy or None for AR)]
    decode: Callable
    greedy: bool = True
    note: str = ""


def step_methods(rec: Recorder) -> None:
    """Each pair's strategies: compiled once, then timed in interleaved rounds (median), within the time left."""
    rec.put(device=device_info())
    names = PAIR_NAMES_DRY if rec.dry else PAIR_NAMES
    only = rec.opts.get("pairs")
    compiles = [1.0 if rec.dry else 8.0]  # seconds to compile a strategy: a first guess, then each pair's
    for name in names:
        if only and name not in only:
            continue
        if not rec.fits(2 * med(compiles), f"pair {name}"):  # AR and one method, at least
            continue
        t0 = time.perf_counter()
        try:
            pair = load_pair(name, rec)
        except (FileNotFoundError, ValueError, ImportError) as e:
            rec.note(f"{name}: not run ({type(e).__name__}: {e})")
            continue
        rec.log(f"{name}: loaded in {time.perf_counter() - t0:.1f} s, {len(pair.strategies)} strategies")
        if pair.note:
            rec.note(f"{pair.name}: {pair.note}")
        compiles += _measure_pair(rec, pair)
    rec.put(headline=methods_headline(rec.data["tables"].get("rows", [])))


def methods_headline(rows: list[dict]) -> str:
    best = sorted((r for r in rows if r["strategy"] != "AR" and r.get("wall_speedup")),
                  key=lambda r: -r["wall_speedup"])[:3]
    bad = [r for r in rows if r.get("verdict", "").startswith("DIFFERS")]
    return (f"{len(rows)} rows; best wall speedups: " + ", ".join(
        f"{r['pair']} {r['strategy']} {r['wall_speedup']}x (tau {r['tau']})" for r in best)
        + (f"; {len(bad)} greedy rows differ from AR beyond near-ties" if bad else "; greedy rows equal AR's "
           "(or near-ties)"))


PAIR_NAMES = ("SmolLM2-135M-Instruct", "zoo text", "zoo image", "zoo video", "zoo text-to-image", "random damped 7B")
PAIR_NAMES_DRY = ("SmolLM2-135M-Instruct", "random damped 7B")


def load_pair(name: str, rec: Recorder) -> BenchPair:
    """The pair `name` with its prompts and strategies (bf16 on a GPU; a dry run: float32, tiny, few)."""
    import numpy as np

    import jspec
    from jspec.tools.bench import zoo as BENCH
    from jspec.tools.bench import spec_bench as SB

    dry, dtype = rec.dry, _dtype(rec)
    N = 8 if dry else 96
    rows = lambda t, ps, eos, n=N: (lambda s: BENCH._decode_rows(t, ps, s, n, eos))  # noqa: E731
    if name == "SmolLM2-135M-Instruct" and dry:  # a tiny random target stands in (SmolLM2 compiles for minutes)
        t, _ = BENCH.damped_pair(dtype=dtype, layers=2, vocab=512, hidden=64, mlp=128, heads=4)
        ps = [np.tile(np.random.default_rng(1).integers(0, t.vocab_size, 6), 2)]
        strats = [("AR", jspec.AR()), ("pld", SB.strategies()["pld"])]
        return BenchPair(name + " (stand-in: a tiny random LLaMA)", t, ps, strats, rows(t, ps, ()))
    if name == "SmolLM2-135M-Instruct":
        from jspec.tools import models

        t, tok = models.load("smollm2-135m-instruct", dtype=dtype)
        qs = SB.load_questions(("summarization", "rag", "translation"), 1)
        ps = [SB.chat_ids(tok, [{"role": "user", "content": q["turns"][0]}]) for q in qs]
        eos = tuple(np.atleast_1d(tok.eos_token_id).tolist())
        strats = [("AR" if k == "ar" else k, s) for k, s in SB.strategies().items()
                  if SB.dtype_of(k) == "float32"]  # the model is loaded in `dtype` already
        rec.note("SmolLM2's strategies as `jspec bench spec-bench` names them: pld = PromptLookup(max_ngram=3, "
                 "gamma=10) (Spec-Bench's PLD), pld-4 gamma 4, pld-tree gamma 4 with 3 branches")
        return BenchPair(name, t, ps, strats, rows(t, ps, eos, 128),
                    note="3 Spec-Bench questions (summarization, rag, translation), up to 128 new tokens")
    if name == "random damped 7B":  # as `bench.suite_gpu` makes it
        shape = (dict(layers=2, vocab=512, hidden=64, mlp=128, heads=4) if dry else
                 dict(layers=32, vocab=32000, hidden=4096, mlp=11008, heads=32))
        t, d = BENCH.damped_pair(dtype=dtype, **shape)
        P, new = (12, 8) if dry else (128, 64)
        ps = [np.random.default_rng(1).integers(0, t.vocab_size, P)]
        keep = ("AR", "Chain g=5") + (() if dry else ("Tree mc_sim_7b_63", "DynamicTree 6x10/60"))
        strats = [(n, s) for n, s, _ in BENCH.sd_strategies(d, False) if n in keep]
        return BenchPair(name, t, ps, strats, rows(t, ps, (), new),
                    note=f"as the gpu suite's: one random {P}-token prompt, {new} new tokens, EOS off")
    if name == "zoo text":
        from jspec.parts.drafters.early_exit import load_head
        from jspec.tools import zoo

        _, t, d, ps = _zoo("text", dtype)
        head = load_head(str(zoo.weights_dir("text-target-eesd-n1")), t)
        strats = [("AR", jspec.AR()), ("Chain g=5", jspec.Chain(d, gamma=5)), ("EESD Beta-TS", jspec.EESD(head)),
                  ("SAGE", jspec.SAGE(d)), ("Tree mc_sim_7b_63", jspec.Tree(d, tree="mc_sim_7b_63")),
                  ("DynamicTree 6x10/60", jspec.DynamicTree(d, depth=6, top_k=10, total=60))]
        return BenchPair(name, t, ps, strats, rows(t, ps, None))
    if name == "zoo image":
        pair, t, d, ps = _zoo("image", dtype)
        nl = pair.encoder.text_ids("\n")[0]
        strats = [("AR", jspec.AR()), ("TABED MT*", jspec.TABED.method("MT*", d, gamma=5, newline_id=nl)),
                  ("Chain g=5", jspec.Chain(d, gamma=5))]
        return BenchPair(name, t, ps, strats, rows(t, ps, None))
    if name == "zoo video":
        from jspec.tools import zoo
        from jspec.tools.zoo import video as ZV

        t, d = _numerics().cast_models([zoo.load("video-target"), zoo.load("video-draft")], dtype)
        ps = [ZV.VideoEncoder().prompts([ex]) for ex in ZV.eval_set(2, tasks=("video_describe",))]
        strats = [("AR", jspec.AR()), ("SpecVLM r=0.9", jspec.SpecVLM(d, ratio=0.9)),
                  ("SAGE + pruning 0.9", jspec.SAGE(d, prune_ratio=0.9))]
        return BenchPair(name, t, ps, strats, rows(t, ps, None))
    if name == "zoo text-to-image":
        return _t2i_pair(dtype)
    raise ValueError(f"unknown pair {name!r}; the pairs are {PAIR_NAMES}")


def _zoo(kind: str, dtype, n: int = 3):
    """(the zoo pair `kind`, its target and draft in `dtype`, the first held-out prompt of its first n scenarios, as
    `bench.zoo_pairs` builds them: token rows for the text pair, processor-style mappings for the image pair)."""
    from jspec.tools.zoo import evaluate as ZE

    pair = ZE.load_pair(kind)
    t, d = _numerics().cast_models([pair.target, pair.draft], dtype)
    ps = [pair.encoder.prompt(exs[0]) for exs in list(ZE.scenario_examples(kind, 1).values())[:n]]
    return pair, t, d, [p["input_ids"][0] if kind == "text" else p for p in ps]


def _t2i_pair(dtype) -> BenchPair:
    """The zoo's text-to-image pair (sampled under CFG 3, as `scripts/bench_lantern.py`): AR, EAGLE-1 and
    LANTERN++ k=10, lambda=3 on the extended tree; tau = image tokens per target step."""
    import jax
    import numpy as np

    import jspec
    from jspec import images as IG
    from jspec.parts.drafters import eagle_io as IO
    from jspec.tools.zoo import t2i as T

    G = _numerics()
    target = IG._generating(G.cast_models([T.load_target()], dtype)[0])
    head, table = IO.load_drafter(str(T.weights_dir("t2i-eagle")), target)
    caps = [T.caption_ids(T.caption(T.scene("heldout", i))) for i in range(2)]
    per_image = T.GRID * (T.GRID + 1) + 1

    def decode(strategy):
        out = jspec.generate_image(target, caps, T.GRID, T.GRID, strategy=strategy, key=jax.random.key(0),
                                   image_prefix_ids=T.image_prefix(), cfg_scale=3.0, temperature=1.0, top_k=128)
        steps = [int(x) for x in np.asarray(out.stats["steps"])] if strategy is not None and \
            not isinstance(strategy, jspec.AR) else [per_image - 1] * len(caps)
        tot = {"tokens": per_image * len(caps), "steps": sum(steps) + len(caps), "decode_s":
               float(out.stats["decode_s"]), "row_steps": steps, "drafted": 0}
        return [np.asarray(r) for r in np.asarray(out.tokens)], tot

    P = jspec.LanternPP
    strats = [("AR", None), ("LANTERN++ k10 lam3", P(head, table, k=10, lam=3.0, tree="naive_extend_57")),
              ("EAGLE-1", P(head, table, k=0, lam=1.0, tree="naive_extend_57"))]
    return BenchPair("zoo text-to-image", target, caps, strats, decode, greedy=False,
                note="sampled (CFG 3, temperature 1, top-k 128); tau = image tokens per target step")


def _measure_pair(rec: Recorder, pair: BenchPair) -> list[float]:
    """Every strategy of the pair compiled, then timed in interleaved rounds (`bench.interleaved`, within the time
    left); a row per strategy. Returns the compile times (for the next pair's estimate)."""
    import numpy as np

    from jspec.tools.bench import zoo as BENCH

    cases = [BENCH.Case(n, (lambda s=s: pair.decode(s))) for n, s in pair.strategies]
    res = BENCH.interleaved(cases, 1 if rec.dry else 3, progress=False, deadline=rec.deadline)
    missing = [n for n, _ in pair.strategies if n not in res]
    if missing:
        rec.data["skipped"].append(f"{pair.name}: {', '.join(missing)}")
        rec.log(f"{pair.name}: no time for {missing}")
    if "AR" not in res:
        return [r["compile_s"] for r in res.values()]
    ar_toks, ar_tot = res["AR"]["first"]
    ar_wall = med(res["AR"]["wall"]) if res["AR"]["wall"] else None
    ar_dec = med([t["decode_s"] for _, t in res["AR"]["results"]]) if res["AR"]["results"] else None
    n = len(pair.prompts)
    for name, _ in pair.strategies:
        if name not in res:
            continue
        c = res[name]
        toks, tot = c["first"]
        steps = max(sum(tot["row_steps"]), 1)
        row = {"pair": pair.name, "strategy": name, "prompts": n, "tokens": tot["tokens"],
               "tau": _r((tot["tokens"] - n) / steps), "drafts_per_step": _r(tot.get("drafted", 0) / steps, 2),
               "compile_s": _r(c["compile_s"], 1), "runs": len(c["wall"])}
        if c["wall"] and ar_wall:
            dec = med([t["decode_s"] for _, t in c["results"]])
            row.update(tok_s=_r(tot["tokens"] / med(c["wall"]), 1), wall_speedup=_r(ar_wall / med(c["wall"])),
                       decode_speedup=_r(ar_dec / dec) if dec else None)
        if pair.greedy:
            differ = [i for i, (a, b) in enumerate(zip(toks, ar_toks)) if not np.array_equal(a, b)]
            row["equal_to_ar"] = f"{n - len(differ)}/{n}"
            ties = [near_tie(pair.target, pair.prompts[i], ar_toks[i], toks[i]) for i in differ[:3]
                    if rec.left() > 20]  # a reference forward per row (a 7B one casts the weights to f32)
            row["verdict"] = "equal" if not differ else tie_verdict(ties) if ties else "DIFFERS (margins not measured)"
            if ties:
                row["divergences"] = ties
        rec.add("rows", row)
        rec.log(f"{pair.name} | {name}: tau {row['tau']}, wall x{row.get('wall_speedup')}, "
                f"{row.get('verdict', 'sampled')}")
    return [r["compile_s"] for r in res.values()]


def near_tie(target, prompt, ar, sd) -> dict:
    """Where a greedy row leaves AR's: the first divergence j, and the target's logits there recomputed by one full
    forward teacher-forced on the prompt + AR's tokens before j, with f32 weights at the highest matmul precision
    (the reference) and as run; `jspec.tools.bench.numerics`' record of them (the reference top-2 margin in bf16
    ulps, which token each forward picks)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import ports

    G = _numerics()
    j = G.first_divergence(sd, ar)
    if j is None or j >= min(len(ar), len(sd)):
        return {"position": j, "note": "one row is a prefix of the other"}
    try:
        ids = np.asarray(prompt["input_ids"] if isinstance(prompt, dict) else prompt).reshape(-1)
        seq = np.concatenate([ids, np.asarray(ar[:j])]).astype(np.int32)[None]
        full = {**prompt, "input_ids": seq} if isinstance(prompt, dict) else seq
        if isinstance(full, dict) and "attention_mask" in full:
            full["attention_mask"] = np.ones_like(seq)
        if isinstance(full, dict) and "mm_token_type_ids" in full:
            full["mm_token_type_ids"] = np.pad(full["mm_token_type_ids"], ((0, 0), (0, j)))
        as_run = np.asarray(ports.logits(target, full))[0, -1]
        ref_model = G.cast_models([target], jnp.float32)[0]
        with jax.default_matmul_precision("highest"):
            ref = np.asarray(ports.logits(ref_model, full))[0, -1]
        rec = G.divergence_record(ref, as_run, int(ar[j]), int(sd[j]))
        keep = ("ar_token", "sd_token", "ref_gap_bf16_ulps", "ref_margin", "margin_bf16_ulps", "ar_sd_are_ref_top2",
                "ref_picks", "bf16_picks")
        return {"position": j, **{k: rec[k] for k in keep}}
    except Exception as e:  # noqa: BLE001 - the row is reported as differing either way
        return {"position": j, "note": f"margin not measured: {type(e).__name__}: {e}"}


def tie_verdict(ties: list[dict]) -> str:
    """"near-tie" when at every measured divergence the reference logits of AR's and SD's tokens are within
    NEAR_TIE_ULPS bf16 ulps of each other (the 2026-11-25 GPU run's bf16 divergences: 0.3-4 ulps, where the median
    top-2 margin of all positions was 8.7); "DIFFERS" otherwise."""
    gaps = [t.get("ref_gap_bf16_ulps") for t in ties]
    ok = [g for g in gaps if g is not None and g <= NEAR_TIE_ULPS]
    if ties and len(ok) == len(ties):
        return f"near-tie ({len(ties)} rows, AR's and SD's tokens within {max(ok):.3g} bf16 ulps)"
    return f"DIFFERS ({len(ties) - len(ok)} of {len(ties)} divergences are not near-ties)"


# ------------------------------------------------------------------------------------------------ step 4

QWEN25_VL_3B = {"model_type": "qwen2", "hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36,
                "num_attention_heads": 16, "num_key_value_heads": 2, "vocab_size": 151936, "rope_theta": 1e6,
                "tie_word_embeddings": True, "max_position_embeddings": 128000, "rms_norm_eps": 1e-6}

# The papers' models at their shapes (random weights): config, over (HF fields changed), the tokens in the cache, batch
SHAPES = {
    "llama-2-7b": dict(config="llama-2-7b", context=768),  # also LLaVA-1.5-7B's LM (vocab 32,064 against 32,000)
    "llama-68m": dict(config="llama-68m", context=768),
    "llama-68m x2": dict(config="llama-68m", context=768, batch=2),  # TABED: two views in one batch
    "qwen2.5-vl-7b": dict(config="qwen2.5-vl-7b", context=8192),  # a long video prompt (SAGE's plan: 8,192)
    "qwen2.5-vl-3b": dict(config=QWEN25_VL_3B, context=1024),  # the draft's cache: the video pruned 90%
    "lumina-mgpt-7b": dict(config="lumina-mgpt-7b-768", context=1280, batch=2),  # CFG: two streams, mid-image
    "eagle head": dict(config="lumina-mgpt-7b-768", over={"num_hidden_layers": 1}, context=1280, batch=2),
    "llama-2-13b": dict(config="llama-2-13b", context=768),
    "eesd draft": dict(config="llama-2-13b", over={"num_hidden_layers": 4}, context=768),  # N = 3 + its 1 layer
    "damped draft": dict(config="llama-2-7b", over={"num_hidden_layers": 1}, context=768),  # the damped pair's
}
ROLE = {"llama-2-7b": "target", "qwen2.5-vl-7b": "target", "lumina-mgpt-7b": "target", "llama-2-13b": "target"}

# (name, target shape, verify width, drafting [(drafter shape, tokens per forward), ...] or a tree name + drafter,
# where tau comes from (step 3's pair, strategy), the paper's tau (tokens per step, the bonus included) and
# speedup, and where the paper's figures come from)
METHODS = [
    ("TABED MT*", "llama-2-7b", 6, [("llama-68m x2", 1)] * 5, ("zoo image", "TABED MT*"), 2.292, 1.743,
     "TABED: LLaVA-1.5-7B + 68M, gamma 5; mean tau of 7 benchmarks x 2 turns, expected walltime (Eq. 1)"),
    ("Chain g=5, one view", "llama-2-7b", 6, [("llama-68m", 1)] * 5, ("zoo image", "Chain g=5"), 2.120, 1.612,
     "TABED's M row: one multimodal view"),
    ("SpecVLM", "qwen2.5-vl-7b", 26, [("qwen2.5-vl-3b", 10)] * 5, ("zoo video", "SpecVLM r=0.9"), 4.23, 2.05,
     "SpecVLM Table 2: Qwen2.5-VL-32B + 7B, VDC (tau 3.23 + the bonus)"),
    ("SAGE", "qwen2.5-vl-7b", 65, [("qwen2.5-vl-3b", 10)] * 6, ("zoo video", "SAGE + pruning 0.9"), 6.18, 3.18,
     "SAGE Table 2: Qwen2.5-VL-72B + 7B, VDC (tau 5.18 + the bonus); drafting taken as 6 levels of 10"),
    ("LANTERN++ k10 lam3", "lumina-mgpt-7b", 58, ("naive_extend_57", "eagle head"),
     ("zoo text-to-image", "LANTERN++ k10 lam3"), 3.63, 2.56, "LANTERN++ Table 2: Lumina-mGPT-7B-768"),
    ("EAGLE-1", "lumina-mgpt-7b", 58, ("naive_extend_57", "eagle head"), ("zoo text-to-image", "EAGLE-1"), 2.94,
     2.10, "LANTERN++ Table 2: Lumina-mGPT-7B-768, EAGLE-1"),
    ("EESD Beta-TS", "llama-2-13b", None, "eesd draft", ("zoo text", "EESD Beta-TS"), 3.03, 1.91,
     "EESD Table 1: LLaMA-2-13B, Gsm8k (tau = 1 / (1 - r_d), r_d 0.67); drafts per step from step 3 (else 5)"),
    ("PromptLookup g=10", "llama-2-7b", 11, [], ("SmolLM2-135M-Instruct", "pld"), None, None, ""),
    ("Chain g=5, damped pair", "llama-2-7b", 6, [("damped draft", 1)] * 5, ("random damped 7B", "Chain g=5"), None,
     None, ""),
    ("Tree mc_sim_7b_63, damped pair", "llama-2-7b", 64, ("mc_sim_7b_63", "damped draft"),
     ("random damped 7B", "Tree mc_sim_7b_63"), None, None, ""),
    ("DynamicTree 6x10/60, damped pair", "llama-2-7b", 61, [("damped draft", 10)] * 6,
     ("random damped 7B", "DynamicTree 6x10/60"), None, None, ""),
]
K_GRID = (1, 2, 4, 8, 16, 32, 64)  # the full verify curve, on LLaMA-2-7B once the methods' widths are measured


def tree_levels(name: str) -> list[int]:
    """Tokens the drafter feeds per level of a static tree: the root, then every level's nodes but the last."""
    import numpy as np

    from jspec.parts.trees import build_tree

    t = build_tree(name)
    depth = np.asarray(t.depth)[np.asarray(t.valid)]
    return [int((depth == d).sum()) for d in range(int(depth.max()))]


def drafting(spec, drafts_per_step: float | None) -> list[tuple[str, int, float]]:
    """A method's draft forwards per step as (drafter shape, tokens per forward, how many times)."""
    if isinstance(spec, str):  # an early-exit chain: one forward per draft token, as many as the run drafted
        return [(spec, 1, drafts_per_step or 5.0)]
    if isinstance(spec, tuple):
        tree, drafter = spec
        return [(drafter, w, 1.0) for w in tree_levels(tree)]
    return [(s, w, 1.0) for s, w in spec]


def probes(methods=METHODS, dry: bool = False) -> list[tuple[str, int]]:
    """(shape, tokens per forward) to time, in priority order, method by method: the target's AR step and verify
    width, each drafter's step at 1 token and at its widest level (levels between are interpolated); then the rest
    of LLaMA-2-7B's verify curve. `dry`: k = 1 and 8 of every shape."""
    widest: dict[str, int] = {}
    for _, _, _, spec, *_ in methods:
        for d, w, _ in drafting(spec, None):
            widest[d] = max(widest.get(d, 1), w)
    out = []
    for _, target, width, spec, *_ in methods:
        out += [(target, 1)] + ([(target, width)] if width else [(target, 6), (target, 11)])
        out += [(d, k) for d, _, _ in drafting(spec, None) for k in (1, widest[d])]
    if dry:
        return list(dict.fromkeys((s, k) for s, _ in out for k in (1, 8)))
    return list(dict.fromkeys(out + [("llama-2-7b", k) for k in K_GRID]))


def forward_cost(model, batch: int, k: int, context: int, reps=(2, 8), runs: int = 3) -> float:
    """Seconds per forward of k new tokens per row (causal among them, as a chain verify; a tree's mask costs the
    same) against a cache holding `context` tokens, timed inside one program as `jspec.engine.profiling` times a step: the
    forward repeated n times in a `fori_loop` at two n, the difference over the difference (median of `runs`);
    each repetition feeds its argmax to the next through an optimization barrier, so nothing is hoisted."""
    import jax
    import jax.numpy as jnp

    from jspec.core import prefill as PR

    cache = PR.new_cache_for(model, batch, -(-(context + k) // 64) * 64)
    cache = cache.replace(length=jnp.full((batch,), context, jnp.int32))
    toks = jnp.full((batch, k), 3, jnp.int32)

    def timed(n):
        t = time.perf_counter()
        jax.block_until_ready(_forward_loop(model, cache, toks, n))
        return time.perf_counter() - t

    timed(reps[0])  # compile
    lo, hi = reps
    slope = med([(timed(hi) - timed(lo)) / (hi - lo) for _ in range(runs)])
    return slope if slope > 0 else timed(hi) / hi  # lost in the timer's noise (tiny models): the loop's mean


def _forward_loop_fn(model, cache, toks, n):
    import jax
    import jax.numpy as jnp

    from ports.core import cache as kvc

    B, k = toks.shape
    mask = None if k == 1 else jnp.broadcast_to(jnp.tril(jnp.ones((k, k), bool)), (B, k, k))
    offs = jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (B, k))

    def body(_, c):
        cache, toks = jax.lax.optimization_barrier(c)
        logits = model.forward(toks, kvc.positions(cache, offs), cache, mask).logits
        return cache, jnp.argmax(logits, -1).astype(jnp.int32)

    return jax.lax.fori_loop(0, n, body, (cache, toks))[1]


def _forward_loop(model, cache, toks, n):
    import jax

    global _FORWARD_LOOP
    if _FORWARD_LOOP is None:
        _FORWARD_LOOP = jax.jit(_forward_loop_fn)
    return _FORWARD_LOOP(model, cache, toks, n)


_FORWARD_LOOP = None


def interpolate(points: dict[int, float], k: float) -> float | None:
    """The cost at k from measured {k: seconds}: linear between the nearest measured widths, the end segments'
    slopes beyond them; None with fewer than two points (unless k was measured)."""
    if k in points:
        return points[k]
    ks = sorted(points)
    if len(ks) < 2:
        return None
    if k < ks[0]:
        lo, hi = ks[0], ks[1]
    elif k > ks[-1]:
        lo, hi = ks[-2], ks[-1]
    else:
        lo, hi = max(x for x in ks if x < k), min(x for x in ks if x > k)
    return points[lo] + (points[hi] - points[lo]) * (k - lo) / (hi - lo)


def predict(tau: float | None, ar_s: float, verify_s: float, draft_s: float) -> float | None:
    """tau x AR step / (verify + drafting): the speedup of a method whose step commits tau tokens."""
    if tau is None or not ar_s or verify_s is None:
        return None
    return tau * ar_s / (verify_s + draft_s)


def measured_rows(rec: Recorder, current: dict | None = None) -> dict[tuple[str, str], dict]:
    """Step 3's rows by (pair, strategy), each with its "source": this run's first (`current`, a result, else the
    one `rec.results` names), then the newest recorded `jspec bench gpu` run's (`gpu-<date>.json`), then the older
    gpu suite's (`gpu-<pair>-<date>.json`, whose mean_accepted is the same tau; its first scenario). A dry run reads
    only its own."""
    found: dict[tuple[str, str], dict] = {}

    def take(rows: list, source: str) -> None:
        for r in rows:
            key, tau = (r["pair"].split(" (stand-in")[0], r["strategy"]), r.get("tau", r.get("mean_accepted"))
            if key not in found and tau is not None:
                found[key] = {**r, "tau": tau, "source": source}

    methods = lambda d: d.get("steps", {}).get("methods", {}).get("tables", {}).get("rows", [])  # noqa: E731
    if current is not None:
        take(methods(current), "this run")
    elif rec.results and os.path.exists(rec.results):
        take(methods(_read_part(rec.results)), "this run")
    if not rec.dry:
        res = Path(rec.results).parent if rec.results else Path("bench_out")
        for path in sorted(res.glob("gpu-2*.json"), reverse=True):
            take(methods(_read_part(str(path))), path.name)
        for path in sorted(res.glob("gpu-*-20*.json"), reverse=True):
            take(_read_part(str(path)).get("sd", []), path.name)
    return found


def step_paper(rec: Recorder) -> None:
    """Time every probe (model shapes built once, freed when no later probe needs them), then predict."""
    import gc

    rec.put(device=device_info())
    todo = probes(dry=rec.dry)
    if rec.dry:  # every shape's config is built; one tiny model stands in for all (its programs shared)
        for sp in SHAPES.values():
            text_config(sp["config"], **sp.get("over", {}))
    measured = measured_rows(rec)
    costs: dict[tuple[str, int], float] = {}
    models: dict[str, Any] = {}
    last: dict[str, float] = {}  # seconds of each shape's last probe (compile included): the next one's estimate
    for i, (shape, k) in enumerate(todo):
        sp = SHAPES[shape]
        est = last.get(shape, max(last.values() or [0]))
        if not rec.fits(est, f"{shape} k={k}"):
            continue
        t0 = time.perf_counter()
        key = "tiny" if rec.dry else shape
        if key not in models:
            cfg = text_config("llama-2-7b", tiny=True) if rec.dry else text_config(sp["config"], **sp.get("over", {}))
            models[key] = random_model(cfg, _dtype(rec))
        model, batch = models[key], sp.get("batch", 1)
        context = 32 if rec.dry else sp["context"]
        s = forward_cost(model, batch, k, context, reps=(4, 64) if rec.dry else (2, 8), runs=1 if rec.dry else 3)
        costs[(shape, k)] = s
        last[shape] = time.perf_counter() - t0
        ar = costs.get((shape, 1))
        rec.add("costs", {"shape": shape, "role": ROLE.get(shape, "drafter"), "k": k, "batch": batch,
                          "context": context, "layers": model.config.num_layers,
                          "params_b": _r(model.num_params / 1e9, 3), "ms": _r(s * 1e3, 4),
                          "over_ar": _r(s / ar) if ar else None, "seconds": _r(last[shape], 1)})
        rec.log(f"{shape} batch {batch} k={k}: {s * 1e3:.2f} ms ({last[shape]:.1f} s)")
        _predictions(rec, costs, measured)  # after every probe: a step cut short keeps its predictions so far
        later = {sh for sh, _ in todo[i + 1:]} | {"tiny"}
        for name in [m for m in models if m not in later]:
            del models[name]
            gc.collect()
    models.clear()
    gc.collect()
    _engine_check(rec, costs)


def _predictions(rec: Recorder, costs: dict, measured: dict) -> None:
    """The methods table (`method_rows`) from the costs so far, and the step's headline."""
    rows = method_rows(costs, measured)
    rec.data["tables"]["methods"] = rows
    done = [r for r in rows if r.get("predicted_paper_tau")]
    rec.put(headline="predicted by cost with the paper's tau vs the paper's speedup: " + ", ".join(
        f"{r['method']} {r['predicted_paper_tau']}x vs {r['paper_speedup']}x" for r in done))


def method_rows(costs: dict, by: dict[tuple[str, str], dict]) -> list[dict]:
    """One row per method with every cost measured: AR step, verify and drafting (ms), tau (measured, paper's),
    the predicted speedups, the paper's, and measured / predicted where step 3 measured the method at this shape.
    `by`: step 3's rows by (pair, strategy) (`measured_rows`)."""
    out = []
    for name, target, width, spec, src, p_tau, p_speed, paper in METHODS:
        m = by.get(src)
        tau = m.get("tau") if m else None
        dps = m.get("drafts_per_step") if m else None
        if width is None:  # a chain whose length the controller picks: verify what it drafts, + 1
            width = 1 + (dps or 5.0)
        pts = {k: s for (sh, k), s in costs.items() if sh == target}
        ar = costs.get((target, 1))
        verify = interpolate(pts, width)
        parts = drafting(spec, dps)
        draft = 0.0
        for shape, w, times in parts:
            c = interpolate({k: s for (sh, k), s in costs.items() if sh == shape}, w)
            draft = None if c is None or draft is None else draft + times * c
        if ar is None or verify is None or draft is None:
            continue
        pred, pred_p = predict(tau, ar, verify, draft), predict(p_tau, ar, verify, draft)
        row = {"method": name, "target": target, "verify_k": _r(width, 2), "ar_ms": _r(ar * 1e3, 4),
               "verify_ms": _r(verify * 1e3, 4), "draft_ms": _r(draft * 1e3, 4),
               "tau": tau, "tau_from": f"{src[0]}: {src[1]}" if m else None,
               "tau_source": m["source"] if m else None, "predicted": _r(pred),
               "paper_tau": p_tau, "predicted_paper_tau": _r(pred_p), "paper_speedup": p_speed,
               "paper_over_predicted": _r(p_speed / pred_p) if p_speed and pred_p else None}
        if m and m.get("decode_speedup") and src[0] == "random damped 7B" and pred:
            row["measured_decode_speedup"] = m["decode_speedup"]
            row["measured_over_predicted"] = _r(m["decode_speedup"] / pred)
        row["paper"] = paper
        out.append(row)
    return out


def _engine_check(rec: Recorder, costs: dict) -> None:
    """The engine's own AR step on LLaMA-2-7B (`jspec.engine.profiling.in_program_costs` after `api.start`) beside the
    bare forward's: what sampling and the state cost on top."""
    import numpy as np

    from jspec import api
    from jspec.engine import profiling as PF

    fwd = costs.get(("llama-2-7b", 1))
    est = max([r["seconds"] for r in rec.data["tables"].get("costs", []) if r["shape"] == "llama-2-7b"] or [0])
    if fwd is None or not rec.fits(2 * est, "the engine's AR step"):
        return
    cfg = text_config("llama-2-7b", tiny=rec.dry)
    model = random_model(cfg, _dtype(rec))
    P_ = 32 if rec.dry else SHAPES["llama-2-7b"]["context"]
    s = api.start(model, np.random.default_rng(0).integers(3, cfg.vocab_size, P_), max_new_tokens=16,
                  eos_token_id=(), compile_loop=False)
    step = PF.in_program_costs(s, runs=1 if rec.dry else 3)["step_s"]
    rec.put(engine_ar_step={"engine_ms": _r(step * 1e3, 3), "forward_ms": _r(fwd * 1e3, 3),
                            "engine_over_forward": _r(step / fwd) if fwd else None})


# ------------------------------------------------------------------------------------------------ step 5


TINY_TEXT = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=4,
                 head_dim=16, max_position_embeddings=8192, tie_word_embeddings=True)


def step_long(rec: Recorder) -> None:
    """Prefill + 2 tokens, batch 1, each point in a fresh process (this one never touches the device): the
    programs of `jspec bench long` (`bench_long.CHILD`, `VIDEO_CHILD`). Time includes the compile."""
    from jspec.tools.bench import long as BL

    if rec.dry:
        points = [("text", 1100, "auto"), ("video", 64, "auto")]
    else:
        points = [("text", 16384, "auto"), ("text", 32768, "auto"), ("video", 12544, "auto"),
                  ("text, one pass", 16384, None)]
    dtype = "f32" if rec.dry else "bf16"
    took = [0.0]
    for kind, n, chunk in points:
        if not rec.fits(max(took), f"{kind} prefill of {n} tokens"):
            continue
        if kind == "video":
            model = "qwen2.5-vl-tiny" if rec.dry else "qwen2.5-vl-7b"
            code = BL.VIDEO_CHILD.format(config=BL.video_config(model), n_video=n,
                                         grid_hw=BL.VIDEO_MODELS[model][1], dtype=dtype, chunk=chunk)
        else:
            model = "tiny" if rec.dry else "7b"
            code = BL.CHILD.format(T=n, which="jspec", direct=False, chunk=chunk, dtype=dtype,
                                   cache_dir=None, warm=False, cfg=TINY_TEXT if rec.dry else BL.MODELS["7b"])
        t0 = time.perf_counter()
        res = _child(code, rec.left())
        took.append(time.perf_counter() - t0)
        row = {"prompt": kind, "model": model, "tokens": n, "chunk": chunk or "one pass", "dtype": dtype,
               "seconds": _r(res.get("s"), 2), "device_gb": _r(res.get("device_gb"), 2),
               "rss_gb": _r(res.get("rss_gb"), 2), "process_s": _r(took[-1], 1)}
        row.update({k: res[k] for k in ("prompt_tokens", "frames", "error") if k in res})
        rec.add("rows", row)
        rec.log(f"{kind} {n}: {row.get('seconds')} s {row.get('error', '')}")
    rows = rec.data["tables"].get("rows", [])
    rec.put(headline=", ".join(f"{r['prompt']} {r['tokens']:,}: " + (f"{r['seconds']} s" if r.get("seconds")
                                                                     else r.get("error", "?")[:40]) for r in rows))


def _child(code: str, timeout: float) -> dict:
    """`bench_long.run_child` with a timeout: the last stdout line as JSON, or {"error": ...}."""
    try:
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=max(timeout, 1))
    except subprocess.TimeoutExpired:
        return {"error": f"did not finish in {timeout:.0f} s"}
    if p.returncode:
        lines = p.stderr.strip().splitlines()
        return {"error": lines[-1] if lines else f"exit {p.returncode}"}
    return json.loads(p.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------------------------ step 6


def step_train(rec: Recorder) -> None:
    """One EESD head training step on LLaMA-2-13B's shape (its first N = 3 layers shared, a 1-layer head, the
    paper's AdamW) and one EAGLE head step on Lumina-mGPT-7B's (the full target's features, CFG rows): compile,
    then the median of timed steps; the paper's batch extrapolated from the measured rows."""
    rec.put(device=device_info())
    if rec.fits(10 if not rec.dry else 1, "the EESD training step"):
        _eesd_train(rec)
    if rec.fits(25 if not rec.dry else 1, "the EAGLE head training step"):
        _eagle_train(rec)
    rows = rec.data["tables"].get("rows", [])
    rec.put(headline=", ".join(f"{r['what']}: {r['step_s']} s per step of {r['batch']} x {r['seq_len']}"
                               for r in rows))


def _timed_steps(step, state, n: int) -> tuple[float, float, Any]:
    """(first call s, median of the next n, state): `step(state) -> (state, metrics)`, synced on the metrics."""
    import jax

    t = time.perf_counter()
    state, m = step(state)
    jax.block_until_ready(m)
    first = time.perf_counter() - t
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        state, m = step(state)
        jax.block_until_ready(m)
        ts.append(time.perf_counter() - t)
    return first, med(ts), state


def _eesd_train(rec: Recorder) -> None:
    import numpy as np

    from jspec.tools.train import trainer as jt
    from jspec.parts.drafters import early_exit as EE
    from jspec.tools.train import eesd as EST

    N, B, T = (3, 2, 64) if rec.dry else (3, 8, 2048)
    cfg = text_config("llama-2-13b", tiny=rec.dry, num_hidden_layers=N + 1)
    target = random_model(cfg, _dtype(rec))
    head = EE.init_head(target, N, 1)
    tcfg, lm = EST.head_target_lm(target, head)
    tx = jt.adamw(weight_decay=0.0)
    train, _ = EST.make_steps(tcfg, N, tx)
    rng = np.random.default_rng(0)
    batch = next(EST.pack([rng.integers(3, cfg.vocab_size, T) for _ in range(B)], B, T))[0]
    step = lambda s: (lambda p, o, m: ((p, o), m))(*train(s[0], s[1], np.float32(1e-3), lm, batch))  # noqa: E731
    first, per, _ = _timed_steps(step, (head.params, tx.init(head.params)), 2 if rec.dry else 3)
    rec.add("rows", {"what": "EESD head, LLaMA-2-13B (N = 3, 1 layer)", "head_params_m": _r(head.num_params / 1e6, 1),
                     "batch": B, "seq_len": T, "compile_s": _r(first - per, 1), "step_s": _r(per, 3),
                     "tokens_per_s": _r(B * T / per, 0), "paper_batch_64_step_s": _r(per * 64 / B, 2),
                     "hours_20k_steps": _r(per * 64 / B * 20000 / 3600, 1)})


def _eagle_train(rec: Recorder) -> None:
    import jax
    import numpy as np

    from jspec.parts.drafters import eagle as EG
    from jspec.tools.train import eagle as EGT

    B, T = (2, 64) if rec.dry else (2, 2353)  # LANTERN++: 2 rows a device; a 768-px image is 2,353 tokens
    cfg = text_config("lumina-mgpt-7b-768", tiny=rec.dry)
    target = random_model(cfg, _dtype(rec))
    head = EGT.trainable(EG.init_head(target, jax.random.key(0)), target)
    tx = EGT.optimizer()
    train, _ = EGT.make_steps(target, head, tx)
    lm = EG.text_parts(target)[1]
    rng = np.random.default_rng(0)
    batch = next(EGT.batches([rng.integers(3, cfg.vocab_size, T) for _ in range(B)], B, T))[0]
    it = iter(range(10 ** 6))
    step = lambda s: (lambda p, o, m: ((p, o), m))(  # noqa: E731
        *train(s[0], s[1], np.float32(1e-4), lm, batch, EGT.step_key(0, next(it))))
    first, per, _ = _timed_steps(step, (head.params, tx.init(head.params)), 2 if rec.dry else 3)
    rec.add("rows", {"what": "EAGLE head, Lumina-mGPT-7B (LLaMA layers)", "head_params_m": _r(head.num_params / 1e6, 1),
                     "batch": B, "seq_len": T, "compile_s": _r(first - per, 1), "step_s": _r(per, 3),
                     "tokens_per_s": _r(B * T / per, 0), "paper_batch_16_step_s": _r(per * 16 / B, 2)})


# ------------------------------------------------------------------------------------------------ command line


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--steps", default=None, help="comma-separated step numbers or names (default: all), e.g. "
                                                  "'1,2' or 'methods,paper'")
    ap.add_argument("--dry-run", action="store_true", help="every step on the CPU at tiny shapes (writes into a "
                                                           "temporary directory unless --out)")
    ap.add_argument("--out", default=None, help="results directory (default bench_out; a dry run: a new "
                                                "temporary directory)")
    ap.add_argument("--budget-scale", type=float, default=1.0, help="multiply every step's budget")
    ap.add_argument("--pair", action="append", default=[], help=f"step 3: only this pair (repeatable): "
                                                                f"{', '.join(PAIR_NAMES)}")
    ap.add_argument("--no-isolate", action="store_true", help="run the steps in this process (no kill at the "
                                                              "budget: a step stops itself when it can)")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="jspec bench gpu", description=__doc__.split("\n")[0])
    add_arguments(ap)
    a = ap.parse_args(argv)
    bad = [p for p in a.pair if p not in PAIR_NAMES]
    if bad:
        raise ValueError(f"unknown pair(s) {bad}; the pairs are {list(PAIR_NAMES)}")
    plan = select(a.steps)
    if not a.dry_run and backend() == "cpu":
        raise ValueError("the steps need a GPU (JAX sees only the CPU here); --dry-run runs them on the CPU at tiny "
                         "shapes")
    return run(plan, a.out, a.dry_run, a.budget_scale, isolate=not a.no_isolate,
               opts={"pairs": a.pair} if a.pair else None)


def backend() -> str:
    """JAX's default backend, asked in a separate process (this one never holds the device: the steps need it)."""
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    p = subprocess.run([sys.executable, "-c", "import jax; print(jax.default_backend())"], env=env,
                       capture_output=True, text=True)
    return p.stdout.strip().splitlines()[-1] if p.returncode == 0 and p.stdout.strip() else "unknown"


if __name__ == "__main__":
    if "--child" in sys.argv[1:]:
        sys.exit(child_main(sys.argv[1:]))
    main()
