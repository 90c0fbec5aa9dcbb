"""Evaluate the shipped zoo pairs: exact match of target and draft per held-out task, and greedy Chain SD (gamma 5,
batch 1) per scenario with the draft reading the image (TABED's M view) or a text stand-in (T view).

    python scripts/eval_zoo.py                  # every shipped pair
    python scripts/eval_zoo.py image --n 40 --n-sd 20 --runs 3

Writes bench_out/zoo-eval-<pair>-<date>.json, a markdown table (.md) and a plot of mean accepted length per
scenario and view (.png), and prints whether the scenarios differ as TABED's premise needs (image pair: M beats T on
image-grounded first turns; T at least as good as M on text-only second turns and OOD multi-image prompts).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jspec.tools import zoo  # noqa: E402
from jspec.tools.zoo import evaluate as ZE  # noqa: E402
from jspec.tools.zoo import world as ZW  # noqa: E402

RESULTS_DIR = ROOT / "bench_out"
GROUNDED, TEXT_ONLY = ("caption", "vqa"), ("second_turn", "ood")


def premise(sd: dict) -> dict:
    """TABED's premise on the image pair's per-scenario mean accepted lengths (M vs T)."""
    acc = lambda s, v: sd[s][v]["mean_accepted"]
    checks = {f"M > T on {s}": acc(s, "M") > acc(s, "T") for s in GROUNDED if s in sd}
    checks.update({f"T >= M on {s}": acc(s, "T") >= acc(s, "M") for s in TEXT_ONLY if s in sd})
    return checks


def bars(res: dict) -> dict:
    """Issue 8's bars on the image pair: the target's mean exact match over the VQA tasks (>= 0.90) and greedy
    Chain SD's mean accepted length on held-out VQA with the draft in the M view (>= 2.5)."""
    vqa = [r["target"] for r in res["exact_match"].values() if r["scenario"] == "vqa"]
    out = {}
    if vqa:
        out["target VQA exact match >= 0.90"] = {"value": float(np.mean(vqa)), "met": bool(np.mean(vqa) >= 0.90)}
    if "M" in res["sd"].get("vqa", {}):
        tau = res["sd"]["vqa"]["M"]["mean_accepted"]
        out["VQA mean accepted (M view) >= 2.5"] = {"value": float(tau), "met": bool(tau >= 2.5)}
    return out


def evaluate(pair_name: str, n: int, n_sd: int, runs: int, gamma: int) -> dict:
    pair = ZE.load_pair(pair_name)
    res = {"pair": pair_name, "date": datetime.date.today().isoformat(),
           "machine": f"{platform.machine()}, {os.cpu_count()} cores", "jax": jax.__version__, "n": n, "n_sd": n_sd,
           "runs": runs, "gamma": gamma, "target_view": pair.view, "exact_match": {}, "sd": {}}
    print(f"[{pair_name}] exact match on {n} held-out examples per task ({pair.view} view):", flush=True)
    for task in ZE.exact_match_tasks(pair_name):
        exs = [ZW.example("heldout", i, 0, [task]) for i in range(n)]
        t, d = np.mean(ZE.exact_match(pair.target, pair, exs)), np.mean(ZE.exact_match(pair.draft, pair, exs))
        res["exact_match"][task] = {"scenario": ZW.TASKS[task].scenario, "target": float(t), "draft": float(d)}
        print(f"  {task:20s} target {t:.3f}  draft {d:.3f}", flush=True)
    res["binding"] = ZE.binding(pair, n)
    print(f"[{pair_name}] target exact match on the shape-scene VQA tasks by objects in the scene: " + ", ".join(
        f"{k}: {r['exact_match']:.2f} (n={r['n']})" for k, r in res["binding"].items()), flush=True)
    print(f"[{pair_name}] greedy Chain SD, gamma={gamma}, batch 1, {n_sd} prompts per scenario, {runs} runs, "
          f"draft views {pair.draft_views}:", flush=True)
    for sc, exs in ZE.scenario_examples(pair_name, n_sd).items():
        res["sd"][sc] = ZE.sd_scenario(pair, exs, runs=runs, gamma=gamma)
        line = "  ".join(f"{v}: tau {r['mean_accepted']:.2f}, {r['speedup']:.2f}x, same {r['same_tokens']}"
                         for v, r in res["sd"][sc].items())
        print(f"  {sc:20s} {line}", flush=True)
    if pair_name == "image":
        res["premise"] = premise(res["sd"])
        for k, ok in res["premise"].items():
            print(f"  TABED premise: {k}: {'yes' if ok else 'NO'}")
        res["bars"] = bars(res)
        for k, r in res["bars"].items():
            print(f"  bar: {k}: {r['value']:.3f} {'met' if r['met'] else 'NOT met'}")
    return res


def markdown(res: dict) -> str:
    views = sorted({v for r in res["sd"].values() for v in r})
    lines = [f"Zoo {res['pair']} pair, {res['date']}, {res['machine']}, jax {res['jax']}. Exact match on {res['n']} "
             f"held-out examples per task; greedy Chain SD gamma={res['gamma']} at batch 1 on {res['n_sd']} prompts "
             f"per scenario (median of {res['runs']} runs).", "",
             "| task | scenario | target exact match | draft exact match |", "|---|---|---|---|"]
    for task, r in res["exact_match"].items():
        lines.append(f"| {task} | {r['scenario']} | {r['target']:.2f} | {r['draft']:.2f} |")
    if res.get("binding"):
        lines += ["", "Target exact match on the shape-scene VQA tasks (" + ", ".join(ZE.SHAPE_VQA) + "), by objects in "
                  "the scene:", "", "| objects | " + " | ".join(str(k) for k in res["binding"]) + " |",
                  "|---|" + "---|" * len(res["binding"]),
                  "| exact match | " + " | ".join(f"{r['exact_match']:.2f} (n={r['n']})"
                                                 for r in res["binding"].values()) + " |"]
    head = " | ".join(f"mean accepted ({v} view) | speedup ({v})" for v in views)
    lines += ["", f"| scenario | {head} | same tokens as AR |", "|---|" + "---|---|" * len(views) + "---|"]
    for sc, r in res["sd"].items():
        cells = " | ".join(f"{r[v]['mean_accepted']:.2f} | {r[v]['speedup']:.2f}x" for v in views)
        lines.append(f"| {sc} | {cells} | {all(x['same_tokens'] for x in r.values())} |")
    if "premise" in res:
        lines += ["", "TABED premise: " + "; ".join(f"{k}: {'yes' if ok else 'no'}" for k, ok in res["premise"].items())]
    if res.get("bars"):
        lines += ["", "Bars: " + "; ".join(f"{k}: {r['value']:.3f} ({'met' if r['met'] else 'not met'})"
                                           for k, r in res["bars"].items())]
    return "\n".join(lines) + "\n"


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scen = list(res["sd"])
    views = sorted({v for r in res["sd"].values() for v in r})
    fig, ax = plt.subplots(figsize=(1.3 * len(scen) + 2, 3.2))
    w = 0.8 / len(views)
    for i, v in enumerate(views):
        ys = [res["sd"][s].get(v, {}).get("mean_accepted", np.nan) for s in scen]
        ax.bar(np.arange(len(scen)) + (i - (len(views) - 1) / 2) * w, ys, w, label=f"draft {v} view")
    ax.set_xticks(np.arange(len(scen)), scen, rotation=20)
    ax.set_ylabel("mean accepted length (incl. bonus)")
    ax.set_title(f"zoo {res['pair']} pair, greedy Chain gamma={res['gamma']}")
    ax.axhline(1.0, color="grey", lw=0.5)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("pairs", nargs="*", help=f"any of {sorted(ZE.PAIRS)} (default: every shipped pair)")
    ap.add_argument("--n", type=int, default=40, help="held-out examples per task (exact match)")
    ap.add_argument("--n-sd", type=int, default=20, help="prompts per scenario (speculative decoding)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--gamma", type=int, default=5)
    ap.add_argument("--out", default=str(RESULTS_DIR))
    args = ap.parse_args(argv)
    bad = [p for p in args.pairs if p not in ZE.PAIRS]
    if bad:
        ap.error(f"unknown pair(s) {bad}; expected {sorted(ZE.PAIRS)}")
    have = set(zoo.available())
    pairs = args.pairs or [p for p, names in ZE.PAIRS.items() if set(names) <= have]
    if not pairs:
        raise SystemExit(f"no zoo pair is shipped in this install (have: {sorted(have) or 'none'})")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for p in pairs:
        res = evaluate(p, args.n, args.n_sd, args.runs, args.gamma)
        stem = out / f"zoo-eval-{p}-{res['date']}"
        stem.with_suffix(".json").write_text(json.dumps(res, indent=2) + "\n")
        stem.with_suffix(".md").write_text(markdown(res))
        plot(res, stem.with_suffix(".png"))
        print(f"wrote {stem}.json / .md / .png")


if __name__ == "__main__":
    main()
