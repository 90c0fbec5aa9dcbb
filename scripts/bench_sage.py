"""SAGE on the zoo pairs: AR, SD-Chain (depth 5), SD-Tree (mc_sim_7b_63) and SAGE on one engine; tau (accepted
drafts per round, the paper's, and with the bonus), decode-only tokens/s and the speedup over AR measured in the
same rounds, the planned depth / width / nodes, the planner's share of the decode time (Table 6's "tree update"),
SAGE's gain in tau over SD-Tree against the answer-length cap (the paper's Fig. 3), and confidence against the
accepted length per round.

    python scripts/bench_sage.py                   # writes bench_out/sage-zoo.{json,md,png}
    python scripts/bench_sage.py --runs 5 --prompts 8
    python scripts/bench_sage.py --pairs "zoo video" --out bench_out/sage-zoo-video   # + SpecVLM's pruning
    python scripts/bench_sage.py --controls --pairs "zoo text" "zoo image" "zoo video" \
        --out bench_out/sage-zoo-controls   # the controls: a depth-8 chain, alpha forced, history switched

`--controls` runs, beside AR, SD-Chain and SAGE, what tells SAGE's mechanisms from their absence: a chain as deep
as SAGE's deepest tree (gamma 8), SAGE with alpha forced to 0 (every tree shallow and wide), 0.5 and 1 (deep and
narrow), SAGE without the history rule, and the history rule started at d_max 4, below its cap of 8. Rows give
the planned depth D ("depth") beside "reach", the deepest level a node survived the threshold at.

Each scenario's prompts decode as one batch (greedy, EOS honoured); every case runs once to compile, then `--runs`
interleaved timed rounds (median reported).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jspec  # noqa: E402
from jspec.tools.bench import zoo as bench  # noqa: E402

# the zoo's longest answers: text chats (mean 18 tokens, at most 36) and captions; image captions and the
# five-image stories ("ood": mean 36, at most 67)
SCENARIOS = {"zoo text": ("text", "described_caption"), "zoo image": ("ood", "caption"),
             "zoo video": ("describe", "qa")}
DEFAULT_PAIRS = ("zoo text", "zoo image")  # `--pairs "zoo video"` (the paper's setting, with pruning) writes apart
LENGTH_CAPS = (8, 16, 32, 64)


def as_batch(prompts):
    """The zoo's per-example prompts as one ragged batch (image prompts: their input_ids rows and images)."""
    if isinstance(prompts, dict):  # already one batch (the video pair's)
        return prompts
    if not isinstance(prompts[0], dict):
        return prompts
    out = {"input_ids": [p["input_ids"][0] for p in prompts]}
    pv = [p["pixel_values"] for p in prompts if "pixel_values" in p]
    if pv:
        out["pixel_values"] = np.concatenate(pv)
    return out


def cases(draft, pruning: bool = False) -> list[tuple[str, object]]:
    """The strategies compared; with `pruning` (video prompts) also SpecVLM (the static tree, the draft's video
    tokens pruned 90%) and SAGE + pruning (the paper's main setting)."""
    out = [("AR", None), ("SD-Chain", jspec.Chain(draft, gamma=5)), ("SD-Tree", jspec.Tree(draft, tree="mc_sim_7b_63")),
           ("SAGE", jspec.SAGE(draft)), ("SAGE, local threshold", jspec.SAGE(draft, threshold="local")),
           ("static tree on SAGE's program", jspec.SAGE(draft, adaptive_tree=False))]
    if pruning:
        out += [("SpecVLM (tree, pruned 0.9)", jspec.SpecVLM(draft, ratio=0.9)),
                ("SAGE + pruning 0.9", jspec.SAGE(draft, prune_ratio=0.9))]
    return out


def controls(draft) -> list[tuple[str, object]]:
    """The controls (module docstring): each differs from SAGE in one mechanism."""
    return [("AR", None), ("SD-Chain", jspec.Chain(draft, gamma=5)), ("SD-Chain gamma=8", jspec.Chain(draft, gamma=8)),
            ("SAGE", jspec.SAGE(draft)), ("SAGE, alpha forced 0", jspec.SAGE(draft, force_alpha=0.0)),
            ("SAGE, alpha forced 0.5", jspec.SAGE(draft, force_alpha=0.5)),
            ("SAGE, alpha forced 1", jspec.SAGE(draft, force_alpha=1.0)),
            ("SAGE, no history rule", jspec.SAGE(draft, history=False)),
            ("SAGE, history from d_max 4", jspec.SAGE(draft, d_start=4))]


def video_pair(n: int):
    """(target, draft, {scenario: prompt}, eos, max_new) of the zoo's video pair: held-out detailed descriptions and
    video QA questions, each scenario one batch prompt."""
    from jspec.tools import zoo
    from jspec.tools.zoo import video as ZV

    enc = ZV.VideoEncoder()
    scen = {"describe": enc.prompts(ZV.eval_set(n, tasks=("video_describe",))), "qa": enc.prompts(ZV.eval_set(n))}
    return zoo.load("video-target"), zoo.load("video-draft"), scen, None, 128


def tau(out) -> tuple[float, float]:
    """(tau without the bonus, with it): accepted drafts per round, per row, then the mean over rows (SAGE's)."""
    t = np.asarray(out.stats["mean_accepted_no_bonus"], float)
    return float(np.nanmean(t)), float(np.nanmean(t) + 1)


def planner_seconds(strategy, batch: int, runs: int = 7, reps: int = 50) -> float:
    """Seconds per round of SAGE's planner alone, for the whole batch (jitted, per-row vmap)."""
    spec = strategy.spec()
    plan = jax.jit(jax.vmap(spec.plan))
    rng = np.random.default_rng(0)
    p = jnp.asarray(np.sort(rng.dirichlet(np.ones(spec.k), batch))[:, ::-1].astype(np.float32))
    a = jnp.asarray(rng.random(batch).astype(np.float32))
    d = jnp.full((batch,), spec.d_cap, jnp.int32)
    jax.block_until_ready(plan(p, a, d))
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        for _ in range(reps):
            out = plan(p, a, d)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / reps)
    return float(np.median(times))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--pairs", nargs="*", default=list(DEFAULT_PAIRS), choices=list(SCENARIOS))
    ap.add_argument("--out", default=str(ROOT / "bench_out" / "sage-zoo"))
    ap.add_argument("--controls", action="store_true", help="the controls instead of the comparison (docstring)")
    args = ap.parse_args(argv)
    pairs = bench.zoo_pairs(args.prompts)
    if "zoo video" in args.pairs:
        pairs["zoo video"] = video_pair(args.prompts)
    rows, scatter, lengths = [], [], []
    for pname in args.pairs:
        target, draft, scenarios, _, N = pairs[pname]
        for scen in SCENARIOS[pname]:
            prompts = as_batch(scenarios[scen])
            jax.clear_caches()
            todo = controls(draft) if args.controls else cases(draft, pruning=pname == "zoo video")
            res = bench.interleaved([bench.Case(n, (lambda s=s: jspec.decode(target, prompts, s, max_new_tokens=N)))
                                     for n, s in todo], args.runs)
            dec = {n: float(np.median([o.stats["decode_s"] for o in res[n]["results"]])) for n, _ in todo}
            ar = res["AR"]["first"]
            ar_tok_s = float(np.sum(ar.lengths)) / dec["AR"]
            for n, s in todo:
                out = res[n]["first"]
                t0, t1 = tau(out)
                tok_s = float(np.sum(out.lengths)) / dec[n]
                row = {"pair": pname, "scenario": scen, "strategy": n, "tau": t0, "tau_bonus": t1,
                       "tok_s": tok_s, "speedup": tok_s / ar_tok_s,
                       "same_as_ar": bool(np.array_equal(out.tokens, ar.tokens)), "compile_s": res[n]["compile_s"],
                       "mean_len": float(np.mean(out.lengths)), "max_len": int(np.max(out.lengths))}
                if "nodes" in out.stats:
                    st = out.stats
                    rounds = int(np.asarray(st["steps"]).max())
                    row.update(depth=float(np.mean(st["depth"][:, 1:])), nodes=float(np.mean(st["nodes"][:, 1:])),
                               width=float(np.mean(st.get("width", np.full((1, 2), np.nan))[:, 1:])),
                               d_max=float(np.mean(st.get("d_max", np.nan))),
                               reach=float(np.mean(st.get("reach", np.full((1, 2), np.nan))[:, 1:])))
                    if "alpha" in st:
                        al = np.asarray(st["alpha"], float)[:, 1:]
                        al = al[np.isfinite(al)]
                        row["alpha"] = float(al.mean()) if al.size else float("nan")
                    if s.adaptive_tree and (n == "SAGE" or not args.controls):
                        row["planner_share"] = planner_seconds(s, len(out.lengths)) * rounds / dec[n]
                        if n == "SAGE":
                            acc = np.asarray(st["accepted"])[:, 1:] - 1
                            al = np.asarray(st["alpha"])[:, 1:]
                            m = (acc >= 0) & np.isfinite(al)
                            scatter += [(pname, scen, float(a), int(c)) for a, c in zip(al[m], acc[m])]
                rows.append(row)
                print(f"{pname:9s} {scen:18s} {n:30s} tau {t0:.2f} (+1 {t1:.2f})  {tok_s:7.1f} tok/s  "
                      f"x{row['speedup']:.2f}{'' if row['same_as_ar'] else '  DIFFERS FROM AR'}")
        if not args.controls:
            lengths += length_study(pname, target, draft, as_batch(scenarios[SCENARIOS[pname][0]]),
                                    SCENARIOS[pname][0])
    meta = bench.meta("sage", args.runs, False)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out + ".json").write_text(json.dumps({"meta": meta, "rows": rows, "lengths": lengths,
                                                     "alpha_vs_accepted": scatter}, indent=1))
    Path(args.out + ".md").write_text(markdown(rows, lengths, scatter))
    if args.controls:
        plot_controls(rows, args.out + ".png")
    else:
        plot(rows, lengths, scatter, args.out + ".png")
    print(f"wrote {args.out}.json / .md / .png")


def length_study(pname, target, draft, prompts, scen) -> list[dict]:
    """tau of SD-Tree and SAGE with the answer capped at each length (EOS honoured: an answer may end sooner)."""
    out = []
    for cap in LENGTH_CAPS:
        t = {}
        for n, s in (("SD-Tree", jspec.Tree(draft, tree="mc_sim_7b_63")), ("SAGE", jspec.SAGE(draft))):
            o = jspec.decode(target, prompts, s, max_new_tokens=cap)
            t[n] = tau(o)[0]
            t["mean_len"] = float(np.mean(o.lengths))
        out.append({"pair": pname, "scenario": scen, "cap": cap, "mean_len": t["mean_len"], "tree": t["SD-Tree"],
                    "sage": t["SAGE"], "gain": t["SAGE"] / t["SD-Tree"] - 1})
        print(f"{pname:9s} {scen:18s} cap {cap:4d}: mean length {t['mean_len']:.0f}, tau tree {t['SD-Tree']:.2f}, "
              f"SAGE {t['SAGE']:.2f} ({100 * out[-1]['gain']:+.0f}%)")
    return out


def _binned(scatter, pname):
    pts = np.array([(a, c) for p, _, a, c in scatter if p == pname]) if scatter else np.zeros((0, 2))
    if len(pts) < 3:
        return [], float("nan")
    edges = np.linspace(0, 1, 6)
    bins = [(lo, hi, pts[(pts[:, 0] >= lo) & (pts[:, 0] < hi + (hi == 1)), 1]) for lo, hi in zip(edges, edges[1:])]
    r = float(np.corrcoef(pts[:, 0], pts[:, 1])[0, 1]) if pts[:, 0].std() > 0 and pts[:, 1].std() > 0 else float("nan")
    return [(lo, hi, float(v.mean()), len(v)) for lo, hi, v in bins if len(v)], r


def markdown(rows, lengths, scatter) -> str:
    lines = ["| pair | scenario | strategy | tau | tau + 1 | tok/s (decode) | speedup | depth | reach | width | nodes | "
             "alpha | d_max | planner share | same as AR |", "|---" * 15 + "|"]
    f = lambda r, k, fmt: format(r[k], fmt) if k in r else ""  # noqa: E731
    for r in rows:
        lines.append(f"| {r['pair']} | {r['scenario']} | {r['strategy']} | {r['tau']:.2f} | {r['tau_bonus']:.2f} | "
                     f"{r['tok_s']:.0f} | {r['speedup']:.2f} | {f(r, 'depth', '.2f')} | {f(r, 'reach', '.2f')} | "
                     f"{f(r, 'width', '.2f')} | "
                     f"{f(r, 'nodes', '.1f')} | {f(r, 'alpha', '.2f')} | {f(r, 'd_max', '.2f')} | "
                     f"{f(r, 'planner_share', '.1%')} | "
                     f"{'yes' if r['same_as_ar'] else 'NO'} |")
    if not lengths:
        return "\n".join(lines) + "\n"
    lines += ["", "SAGE's tau against SD-Tree's with the answer capped (EOS honoured):", "",
              "| pair | scenario | cap | mean length | tau SD-Tree | tau SAGE | gain |", "|---|---|---|---|---|---|---|"]
    for x in lengths:
        lines.append(f"| {x['pair']} | {x['scenario']} | {x['cap']} | {x['mean_len']:.0f} | {x['tree']:.2f} | "
                     f"{x['sage']:.2f} | {100 * x['gain']:+.1f}% |")
    lines += ["", "Accepted drafts per round against the confidence alpha the round's tree was planned from (SAGE):",
              ""]
    for pname in sorted({p for p, *_ in scatter}):
        bins, r = _binned(scatter, pname)
        lines.append(f"- {pname}: Pearson r = {r:.2f}; " + ", ".join(
            f"alpha {lo:.1f}-{hi:.1f}: {m:.2f} ({n} rounds)" for lo, hi, m, n in bins))
    return "\n".join(lines) + "\n"


def bar_panels(axes, rows, groups, names) -> None:
    """Two bar panels on `axes`: tau and the speedup over AR of each strategy in `names`, per (pair, scenario)."""
    w = 0.8 / len(names)
    for ax, (key, label) in zip(axes, (("tau", "accepted drafts per round (tau)"), ("speedup", "decode speedup over AR"))):
        for i, n in enumerate(names):
            vals = [next((r[key] for r in rows if (r["pair"], r["scenario"]) == g and r["strategy"] == n), 0)
                    for g in groups]
            ax.bar(np.arange(len(groups)) + i * w, vals, w, label=n)
        ax.set_xticks(np.arange(len(groups)) + 0.4 - w / 2, [f"{p}\n{s}" for p, s in groups], fontsize=8)
        ax.set_title(label)
    axes[1].axhline(1.0, color="k", lw=0.8)
    axes[0].legend(fontsize=7)


def plot(rows, lengths, scatter, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["pair"], r["scenario"]) for r in rows})
    names = [n for n, _ in cases(None, pruning=any(r["pair"] == "zoo video" for r in rows))][1:]
    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    bar_panels(axes[0], rows, groups, names)
    ax = axes[1, 0]
    for pname in sorted({x["pair"] for x in lengths}):
        xs = [x for x in lengths if x["pair"] == pname]
        ax.plot([x["cap"] for x in xs], [100 * x["gain"] for x in xs], "o-", label=f"{pname} ({xs[0]['scenario']})")
    ax.axhline(0, color="k", lw=0.8)
    ax.set_xlabel("max new tokens")
    ax.set_ylabel("tau gain of SAGE over SD-Tree (%)")
    ax.set_title("gain against answer length (the paper's Fig. 3: +25 / +40 / +57% at 512 / 1024 / 2048)")
    ax.title.set_fontsize(8)
    ax.legend(fontsize=7)
    ax = axes[1, 1]
    for pname in sorted({p for p, *_ in scatter}):
        bins, r = _binned(scatter, pname)
        ax.plot([(lo + hi) / 2 for lo, hi, _, _ in bins], [m for _, _, m, _ in bins], "o-", label=f"{pname} (r={r:.2f})")
    ax.set_xlabel("confidence alpha the round's tree was planned from")
    ax.set_ylabel("accepted drafts that round")
    ax.set_title("does confidence predict acceptance?")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_controls(rows, path: str) -> None:
    """tau and speedup of each control beside SAGE's, per scenario."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = list(dict.fromkeys((r["pair"], r["scenario"]) for r in rows))
    names = [n for n, _ in controls(None)][1:]
    fig, axes = plt.subplots(1, 2, figsize=(14, 5))
    bar_panels(axes, rows, groups, names)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
