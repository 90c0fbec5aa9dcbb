"""The zoo demo's text-pair rows split into the decode loop and the rest of the call (prefill, drafter prefill,
host work), so that a row's speedup can be told apart from what its rounds cost.

    python scripts/probe_zoo_demo_split.py "AR;Tree (9 drafts);Tree (9 drafts), guarded" --rounds 5

Rows are `jspec.tools.demo.text_section` names (`;`-separated), greedy, measured as the demo measures them
(`demo.measure`: a compiling call, then warm calls interleaved across rows; medians). A guarded row's first call
measures its cost table unless one is on disk. Prints, per row: the whole call, the loop (`stats["decode_s"]`),
the rest, and the speedups over AR of both.
"""
from __future__ import annotations

import argparse


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("rows", help="`;`-separated demo row names; AR is added")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args(argv)

    from jspec.tools import demo as DM

    sec = DM.text_section(args.seed, "all")
    keep = ["AR"] + [r for r in args.rows.split(";") if r and r != "AR"]
    missing = [k for k in keep if k not in sec.strategies]
    if missing:
        raise SystemExit(f"no demo row(s) {missing}; rows: {list(sec.strategies)}")
    sec.strategies = {k: (sec.strategies[k][0], ("greedy",)) for k in keep}
    res = DM.measure(sec, args.max_new_tokens, rounds=args.rounds, seed=args.seed)
    ar = res["AR"]["greedy"]
    for k, r in res.items():
        g = r["greedy"]
        print(f"{k:28s} call {g['wall_s'] * 1e3:7.1f} ms ({ar['wall_s'] / g['wall_s']:.3f}x)  "
              f"loop {g['decode_s'] * 1e3:7.1f} ms ({ar['decode_s'] / g['decode_s']:.3f}x)  "
              f"rest {(g['wall_s'] - g['decode_s']) * 1e3:6.1f} ms  tokens/step {g['tau']:.2f}  "
              f"same as AR {g['same_as_ar']}")


if __name__ == "__main__":
    main()
