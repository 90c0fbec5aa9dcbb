"""Plot a controller's per-step decisions from a `jspec bench spec-bench` run: the draft length (EESD's K, SAGE's
tree depth) over each answer's steps, one line per category, beside the tokens each step committed.

    python scripts/plot_spec_bench_plans.py scripts/results/spec-bench-smollm2-135m-instruct-T0-2026-11-28-5 eesd
    python scripts/plot_spec_bench_plans.py RUN_DIR sage-eagle --stat depth --window 16

Reads RUN_DIR/METHOD.jsonl (its "plan" entries, aligned with "accept_lengths", None at each turn's prefill) and
writes RUN_DIR/METHOD-plan.png; prints each category's mean decision and tokens per step.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


def per_answer(path: Path, stat: str) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """(category, decisions per target step, tokens committed per target step) for each answer's first turn."""
    out = []
    for line in path.read_text().splitlines():
        r = json.loads(line)
        c = r["choices"][0]
        plan, acc = c.get("plan", {}).get(stat), c["accept_lengths"]
        if plan is None:
            raise SystemExit(f"{path} has no per-step '{stat}' (a method without a controller, or an older run)")
        starts = [i for i, v in enumerate(plan) if v is None] + [len(plan)]
        a, b = starts[0] + 1, starts[1]  # the first turn's target steps
        out.append((r["category"], np.asarray(plan[a:b], float), np.asarray(acc[a:b], float)))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run_dir")
    ap.add_argument("method")
    ap.add_argument("--stat", default="depth", help="depth (EESD's K, SAGE's depth), width, nodes or alpha")
    ap.add_argument("--window", type=int, default=8, help="moving average over this many steps")
    a = ap.parse_args(argv)
    run = Path(a.run_dir)
    rows = per_answer(run / f"{a.method}.jsonl", a.stat)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    k = np.ones(a.window) / a.window
    colors = plt.get_cmap("tab20")
    for j, (cat, plan, _) in enumerate(rows):
        if len(plan) >= a.window:
            ax.plot(np.convolve(plan, k, mode="valid"), lw=1, label=cat, color=colors(j % 20))
    ax.set_xlabel("target step")
    ax.set_ylabel(f"{a.stat}, moving mean of {a.window} steps")
    ax.set_title(f"{a.method}: per-step {a.stat} over each first answer ({run.name})", fontsize=9)
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    png = run / f"{a.method}-plan.png"
    fig.savefig(png, dpi=120)
    print(f"| category | steps | mean {a.stat} | first 16 steps | last 16 steps | tokens/step |")
    print("|---|---|---|---|---|---|")
    for cat, plan, acc in rows:
        print(f"| {cat} | {len(plan)} | {plan.mean():.2f} | {plan[:16].mean():.2f} | {plan[-16:].mean():.2f} | "
              f"{acc.mean():.3f} |")
    print(f"wrote {png}")


if __name__ == "__main__":
    main()
