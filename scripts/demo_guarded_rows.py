"""The zoo demo's guarded rows beside AR: the text section (`methods="all"`: the tree and EESD guarded) and the
image section (the chain guarded), measured as `jspec demo` measures them (interleaved warm rounds, medians).

    JSPEC_COSTS_DIR=build/costs python scripts/demo_guarded_rows.py --seed 3 --out scripts/results/demo-guarded.md
"""
from __future__ import annotations

import argparse


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", default="scripts/results/demo-guarded.md")
    args = ap.parse_args(argv)

    from jspec.engine import compilation as CJ
    from jspec.tools import demo

    CJ.enable_cache()
    text = []
    for make in (lambda: demo.text_section(args.seed, "all"), lambda: demo.image_section(args.seed)):
        sec = make()
        res = demo.measure(sec, args.max_new_tokens, args.rounds, args.seed)
        text += [f"### {sec.title}", "", *demo.table(res), ""]
        print("\n".join(text[-len(demo.table(res)) - 3:]), flush=True)
    with open(args.out, "w") as f:
        f.write("\n".join(text))


if __name__ == "__main__":
    main()
