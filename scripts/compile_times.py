"""Compile time of each strategy's decode program on the zoo text pair, relative to AR's.

    python scripts/compile_times.py                       # every strategy, 3 rounds, greedy, 32 new tokens
    python scripts/compile_times.py --strategies AR "Tree mc_sim_7b_63" --rounds 1 --sampled
    python scripts/compile_times.py --strategies AR "Chain gamma=5" "Chain gamma=5 guarded" --rounds 3

Each (strategy, round) runs in a fresh process with the persistent compilation cache off: the first `jspec.decode`
call (compile + run) minus a second call on the same prompt (run only) is its compile time, prefill and loop
together. A round measures every strategy once; the table reports medians over rounds and the ratio to AR's
compile time in the same round (the machine is shared: ratios travel better than seconds). Results go to
`bench_out/compile-times.json` (`--out`).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
BASE = ("AR", "Chain gamma=5", "Chain gamma=8", "Tree mc_sim_7b_63", "DynamicTree", "SAGE", "EESD Beta-TS")
GUARDED = " guarded"  # NAME guarded: NAME under jspec.Guarded, with a given cost table (compiling, not measuring)
STRATEGIES = BASE + tuple(n + GUARDED for n in ("Chain gamma=5", "Tree mc_sim_7b_63", "EESD Beta-TS"))


def build(name: str, pair):
    import jspec
    from jspec.engine.costs import CostTable
    from jspec.parts.drafters.early_exit import load_head
    from jspec.tools.zoo import weights_dir

    if name.endswith(GUARDED):  # drafting pays from a low acceptance: the program switches between both kinds
        inner = build(name[:-len(GUARDED)], pair)
        D = inner.parts().plan.max_depth
        return jspec.Guarded(inner, costs=CostTable(1.0, tuple(1.0 + 0.05 * k for k in range(D + 1))))
    d = pair.draft
    return {"AR": lambda: None,
            "Chain gamma=5": lambda: jspec.Chain(d, gamma=5),
            "Chain gamma=8": lambda: jspec.Chain(d, gamma=8),
            "Tree mc_sim_7b_63": lambda: jspec.Tree(d, tree="mc_sim_7b_63"),
            "DynamicTree": lambda: jspec.DynamicTree(d),
            "SAGE": lambda: jspec.SAGE(d),
            "EESD Beta-TS": lambda: jspec.EESD(load_head(str(weights_dir("text-target-eesd-n1")), pair.target)),
            }[name]()


def one(name: str, max_new: int, sampled: bool) -> dict:
    """In this process: (first call, warm call) seconds of `name` on two zoo prompts."""
    import jax
    import numpy as np

    import jspec
    from jspec.tools.zoo import evaluate as ZE

    pair = ZE.load_pair("text")
    exs = ZE.scenario_examples("text", 2)["text"]
    prompt = ZE.batch_prompt(pair.encoder, exs)
    strategy = build(name, pair)
    kw = dict(max_new_tokens=max_new, eos_token_id=(), key=jax.random.key(0))
    if sampled:
        kw.update(temperature=1.0)
    times, toks = [], []
    for _ in range(2):
        t0 = time.perf_counter()
        out = jspec.decode(pair.target, prompt, strategy, **kw)
        toks.append(np.asarray(out.tokens))
        times.append(time.perf_counter() - t0)
    assert (toks[0] == toks[1]).all()
    return {"first_s": times[0], "warm_s": times[1], "compile_s": times[0] - times[1]}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=STRATEGIES)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-new", type=int, default=32)
    ap.add_argument("--sampled", action="store_true", help="temperature 1 instead of greedy")
    ap.add_argument("--out", default=str(ROOT / "bench_out" / "compile-times.json"))
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        print("RESULT " + json.dumps(one(args.one, args.max_new, args.sampled)))
        return
    names = list(dict.fromkeys(["AR"] + args.strategies))
    env = dict(os.environ, JSPEC_COMPILE_CACHE="", HF_HUB_OFFLINE="1")
    rounds = []
    for r in range(args.rounds):
        res = {}
        for name in names:
            cmd = [sys.executable, __file__, "--one", name, "--max-new", str(args.max_new)] + (
                ["--sampled"] if args.sampled else [])
            p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
            line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
            if p.returncode or not line:
                raise SystemExit(f"{name} failed:\n{p.stderr[-3000:]}")
            res[name] = json.loads(line[0][7:])
            print(f"round {r + 1}/{args.rounds} {name:20s} compile {res[name]['compile_s']:6.2f} s "
                  f"(first {res[name]['first_s']:.2f}, warm {res[name]['warm_s']:.2f})", flush=True)
        rounds.append(res)
    summary = {}
    for name in names:
        c = [rd[name]["compile_s"] for rd in rounds]
        ratio = [rd[name]["compile_s"] / rd["AR"]["compile_s"] for rd in rounds]
        summary[name] = {"compile_s": statistics.median(c), "ratio_to_ar": statistics.median(ratio),
                         "warm_s": statistics.median(rd[name]["warm_s"] for rd in rounds)}
    print(f"\nzoo text pair, {'sampled' if args.sampled else 'greedy'}, {args.max_new} new tokens, 2 prompts; "
          f"medians of {args.rounds} rounds")
    print(f"{'strategy':20s} {'compile s':>10s} {'x AR':>6s} {'warm s':>7s}")
    for name, s in summary.items():
        print(f"{name:20s} {s['compile_s']:10.2f} {s['ratio_to_ar']:6.2f} {s['warm_s']:7.2f}")
    import jax

    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "jax": jax.__version__,
                                          "sampled": args.sampled, "max_new_tokens": args.max_new,
                                          "rounds": rounds, "summary": summary}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
