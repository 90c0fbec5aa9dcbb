"""Where a guarded round that drafts nothing spends its time, beside an AR step, on the real model or the zoo.

    python scripts/probe_guard_depth0.py pld-4 eagle3-c3          # Spec-Bench method names
    python scripts/probe_guard_depth0.py --zoo chain tree eesd    # the zoo text pair's demo strategies, batch 4

Each strategy runs under `jspec.Guarded(..., force=0)` (every row at depth 0) from a 128-token prompt, batch 1; its
phases (draft, verify, the rest: rule, commit, bookkeeping) and the whole round are timed inside one program
(`jspec.engine.profiling.in_program_costs`), as is the AR step. Milliseconds; printed and written to `--out`.
"""
from __future__ import annotations

import argparse
import json


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("methods", nargs="+")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--zoo", action="store_true", help="the zoo text pair (methods: chain, tree, eesd)")
    ap.add_argument("--batch", type=int, default=None, help="rows (default 1; 4 with --zoo)")
    ap.add_argument("--out", default="scripts/results/guard-depth0-phases.json")
    args = ap.parse_args(argv)

    import jspec
    from jspec import api
    from jspec.engine import profiling as PF
    from jspec.engine.costs import CostTable, probe_prompt
    from jspec.tools import models
    from jspec.tools.bench import spec_bench as SB

    batch = args.batch or (4 if args.zoo else 1)
    if args.zoo:
        from jspec.parts.drafters.early_exit import load_head
        from jspec.tools.demo import DEMO_TREE
        from jspec.tools.zoo import evaluate as ZE
        from jspec.tools.zoo import weights_dir

        pair = ZE.load_pair("text")
        target = pair.target
        zoo = {"chain": lambda: jspec.Chain(pair.draft, gamma=5), "tree": lambda: jspec.Tree(pair.draft, tree=DEMO_TREE),
               "eesd": lambda: jspec.EESD(load_head(str(weights_dir("text-target-eesd-n1")), target))}
    else:
        target, _ = models.load(args.model)
    prompt = probe_prompt(target.vocab_size, 64 if args.zoo else 128, batch)
    kw = dict(max_new_tokens=200, eos_token_id=(), compile_loop=False)
    ms = lambda d: {k: round(v * 1e3, 2) for k, v in d.items()}  # noqa: E731
    res = {"AR": ms(PF.in_program_costs(api.start(target, prompt, jspec.AR(), **kw)))}
    print("AR", res["AR"], flush=True)
    for name in args.methods:
        if args.zoo:
            s = zoo[name]()
        elif name in SB.HEAD_METHODS:
            kind, build = SB.HEAD_METHODS[name]
            s = build(models.head(args.model, kind, target))
        else:
            s = SB.strategies()[name]
        D = s.parts().plan.max_depth
        st = api.start(target, prompt, jspec.Guarded(s, costs=CostTable.flat(D), force=0), **kw)
        res[name] = ms(PF.in_program_costs(st))
        print(name, res[name], flush=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
