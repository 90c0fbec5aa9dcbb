"""EESD on the zoo text target: Beta-TS against every fixed draft length, the paper's ablations, Beta-TS in place of
a separate draft's fixed gamma, and the tree mode; tokens per target step (tau), EESD's v_d / r_d / HM, tokens/s and
the speedup over AR measured in the same rounds.

    python scripts/bench_eesd.py                  # writes bench_out/eesd-zoo.{json,md,png}
    python scripts/bench_eesd.py --runs 5 --scenarios described_caption text

Needs the heads ``jspec train eesd`` ships into assets/zoo/jspec_zoo/ (text-target-eesd-n1 and its ablations; a missing
one is skipped). Each scenario's prompts decode as one batch (greedy, EOS honoured); every case runs once to
compile, then `--runs` interleaved timed rounds (median reported).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jspec  # noqa: E402
from jspec.tools.bench import zoo as bench  # noqa: E402
from jspec.parts.drafters.early_exit import load_head  # noqa: E402

SPLIT = ("EESD Beta-TS", "EESD Cali-TS", "EESD K=5")  # the rows timed phase by phase
HEADS = {"n1": "text-target-eesd-n1", "n1 head-only": "text-target-eesd-n1-k0",
         "n1 open text only": "text-target-eesd-n1-open", "n2": "text-target-eesd-n2"}


def hm_metrics(out) -> dict:
    """EESD Eq. 11-12 with micro sums: v_d = right / drafted, r_d = right / generated, HM = their harmonic mean x 100;
    tau = generated tokens per target step."""
    acc = np.asarray(out.stats["accepted"])
    steps = (acc > 0).sum()
    right = acc.sum() - steps
    drafted = np.asarray(out.stats["drafted"]).sum()
    L = np.asarray(out.lengths).sum()
    v, r = right / max(drafted, 1), right / max(L, 1)
    # the first token comes from the prefill: steps count the speculative rounds only
    return {"tau": float(acc.sum() / max(steps, 1)), "v_d": float(v), "r_d": float(r),
            "hm": float(200 * v * r / max(v + r, 1e-9)), "tokens": int(L)}


def cases(target, draft, heads: dict) -> list[tuple[str, object]]:
    out = [("AR", None)]
    if "n1" in heads:
        h = heads["n1"]
        out.append(("EESD Beta-TS", jspec.EESD(h)))
        if h.calibration is not None:
            out.append(("EESD Cali-TS", jspec.EESD(h, controller="cali")))
        out += [(f"EESD K={k}", jspec.EESD(h, controller=jspec.FixedK(k))) for k in range(1, 11)]
        out.append(("EESD Beta-TS, tree mc_sim_7b_63", jspec.EESD(h, tree="mc_sim_7b_63")))
        if h.calibration is not None:
            out.append(("EESD Cali-TS, tree mc_sim_7b_63", jspec.EESD(h, controller="cali", tree="mc_sim_7b_63")))
    for name in ("n1 head-only", "n1 open text only", "n2"):
        if name in heads:
            out.append((f"EESD Beta-TS ({name})", jspec.EESD(heads[name])))
    out += [("Chain gamma=5 (text-draft)", jspec.Chain(draft, gamma=5)),
            ("Chain gamma=10 (text-draft)", jspec.Chain(draft, gamma=10)),
            ("Chain + Beta-TS (text-draft)", jspec.Chain(draft, gamma=10, controller=jspec.BetaTS()))]
    return out


def control_cost(strategy, batch: int, reps: tuple[int, int] = (20, 120), runs: int = 5) -> float:
    """Seconds per round of the strategy's controller alone (EESD Table 8's "sampling"): its plan, a stop decision
    after every draft level when it makes them (Cali-TS's predictor), and its observation, in one program."""
    from jspec.parts.controllers import Record

    parts = strategy.parts()
    ctrl, D = parts.controller, parts.plan.max_depth
    if ctrl is None:
        return 0.0
    width = target_width = None
    if hasattr(ctrl, "predictor"):
        target_width = ctrl.predictor.w.shape[1]
        width = ctrl.predictor.wp.shape[0] - target_width
    z = jnp.zeros((batch,), jnp.int32)
    rec = Record(accepted=z, committed=z + 1, active=z == 0, depth=z + D, drafted=z + D,
                 path=jnp.zeros((batch, D + 1), jnp.int32), on_path=jnp.zeros((batch, D + 1), bool),
                 tokens=jnp.zeros((batch, D + 1), jnp.int32),
                 hidden=None if target_width is None else jnp.ones((batch, target_width), jnp.float32))

    def one(state, key):
        lim = ctrl.plan(state, key).depth
        if hasattr(ctrl, "stop"):
            aux = {"hidden": jnp.ones((batch, 1, width), jnp.float32)}
            for lvl in range(1, D):
                lim = ctrl.stop(state, lvl, aux, lim, jax.random.fold_in(key, lvl))
        return ctrl.observe(state, rec._replace(depth=lim))

    @jax.jit
    def loop(state, key, n):
        return jax.lax.fori_loop(0, n, lambda i, s: one(jax.lax.optimization_barrier(s), jax.random.fold_in(key, i)),
                                 state)

    state, key = ctrl.init(batch, D), jax.random.key(0)
    timed = lambda n: (lambda t0: (jax.block_until_ready(loop(state, key, n)), time.perf_counter() - t0)[1])(  # noqa: E731
        time.perf_counter())
    timed(reps[0])
    return float(np.median([(timed(reps[1]) - timed(reps[0])) / (reps[1] - reps[0]) for _ in range(runs)]))


def phase_split(target, prompts, strategy, max_new: int) -> dict:
    """EESD Table 8 per decode (seconds): draft / verify / other (the rule, the commit and the controller's
    observation) timed inside one program (`profile="program"`), and the controller's own share ("control", part
    of draft and other)."""
    out = jspec.decode(target, prompts, strategy, max_new_tokens=max_new, profile="program")
    rounds = int(np.asarray(out.stats["steps"]).max())
    return {"draft_s": out.stats["draft_s"], "verify_s": out.stats["verify_s"], "other_s": out.stats["other_s"],
            "control_s": control_cost(strategy, len(prompts)) * rounds, "rounds": rounds}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--scenarios", nargs="*", default=["described_caption", "text"])
    ap.add_argument("--out", default=str(ROOT / "bench_out" / "eesd-zoo"))
    args = ap.parse_args(argv)
    pair = bench.zoo_pairs(args.prompts)["zoo text"]
    target, draft, scenarios, _, N = pair
    heads = {}
    for key, name in HEADS.items():
        try:
            heads[key] = load_head(str(ROOT / "assets" / "zoo" / "jspec_zoo" / name), target)
        except ValueError as e:
            print(f"skipping {key}: {e}")
    rows = []
    for scen in args.scenarios:
        prompts = scenarios[scen]
        jax.clear_caches()
        todo = cases(target, draft, heads)
        res = bench.interleaved([bench.Case(n, (lambda s=s: jspec.decode(target, prompts, s, max_new_tokens=N)))
                                 for n, s in todo], args.runs)
        ar = res["AR"]
        ar_wall = float(np.median(ar["wall"]))
        for n, _ in todo:
            r = res[n]
            out = r["first"]
            wall = float(np.median(r["wall"]))
            same = bool(np.array_equal(out.tokens, ar["first"].tokens))
            m = hm_metrics(out)
            row = {"scenario": scen, "strategy": n, **m, "tok_s": m["tokens"] / wall,
                   "speedup": ar_wall / wall, "same_as_ar": same, "compile_s": r["compile_s"]}
            if "depth" in out.stats:
                row["mean_depth"] = float(np.mean(out.stats["depth"]))
            if n in SPLIT:
                row["phases"] = phase_split(target, prompts, dict(todo)[n], N)
            rows.append(row)
            print(f"{scen:18s} {n:38s} tau {row['tau']:.2f}  HM {row['hm']:5.1f}  {row['tok_s']:7.1f} tok/s  "
                  f"x{row['speedup']:.2f}{'' if same else '  DIFFERS FROM AR'}")
    meta = bench.meta("eesd", args.runs, False)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out + ".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = ["| scenario | strategy | tau | v_d | r_d | HM | tok/s | speedup | mean depth | same as AR |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['scenario']} | {r['strategy']} | {r['tau']:.2f} | {r['v_d']:.2f} | {r['r_d']:.2f} | "
                     f"{r['hm']:.1f} | {r['tok_s']:.0f} | {r['speedup']:.2f} | {r.get('mean_depth', float('nan')):.2f} | "
                     f"{'yes' if r['same_as_ar'] else 'NO'} |")
    split = [r for r in rows if "phases" in r]
    if split:
        lines += ["", "Seconds per decode of the batch by phase (EESD Table 8; timed inside one program; control = the "
                  "controller's own sampling, inside draft and other):", "",
                  "| scenario | strategy | rounds | draft | verify | other | control |", "|---|---|---|---|---|---|---|"]
        for r in split:
            p = r["phases"]
            lines.append(f"| {r['scenario']} | {r['strategy']} | {p['rounds']} | {p['draft_s']:.3f} | "
                         f"{p['verify_s']:.3f} | {p['other_s']:.3f} | {p['control_s']:.4f} |")
    Path(args.out + ".md").write_text("\n".join(lines) + "\n")
    plot(rows, args.out + ".png")
    print(f"wrote {args.out}.json / .md / .png")


def plot(rows: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scens = sorted({r["scenario"] for r in rows})
    fig, axes = plt.subplots(len(scens), 2, figsize=(12, 4 * len(scens)), squeeze=False)
    for i, s in enumerate(scens):
        rs = [r for r in rows if r["scenario"] == s and r["strategy"] != "AR"]
        names = [r["strategy"] for r in rs]
        colour = ["tab:red" if "Beta" in n else "tab:purple" if "Cali" in n else "tab:gray" if "Chain" in n
                  else "tab:blue" for n in names]
        for j, (key, label) in enumerate((("tau", "tokens per target step"), ("speedup", "speedup over AR"))):
            ax = axes[i, j]
            ax.barh(range(len(rs)), [r[key] for r in rs], color=colour)
            ax.set_yticks(range(len(rs)), names, fontsize=7)
            ax.invert_yaxis()
            ax.set_title(f"{s}: {label}")
            if key == "speedup":
                ax.axvline(1.0, color="k", lw=0.8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
