"""Compile time of a guarded strategy beside its strategy's and AR's (`jspec.Guarded` should cost at most the two
added): each (strategy, round) in a fresh process with the persistent compile cache off; its first `decode` (compile
+ run) minus the median of its warm calls is the compile time. The guard gets a flat cost table, so no measurement
runs.

    python scripts/probe_guard_compile.py                    # SmolLM2-135M-Instruct (after `jspec fetch ...`)
    python scripts/probe_guard_compile.py --rounds 3 --max-new 64
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
NAMES = ("AR", "pld-4", "pld-4 guarded", "eagle3-c3", "eagle3-c3 guarded")


def one(name: str, max_new: int, warm: int) -> dict:
    import numpy as np

    import jspec
    from jspec.engine.costs import CostTable
    from jspec.tools import models

    target, tok = models.load("smollm2-135m-instruct")[:2]
    base = name.removesuffix(" guarded")
    strategy = {"AR": None, "pld-4": jspec.PromptLookup(max_ngram=3, gamma=4),
                "eagle3-c3": jspec.Eagle3(models.head("smollm2-135m-instruct", "eagle3", target), tree="chain",
                                          depth=3) if base == "eagle3-c3" else None}[base]
    if name.endswith("guarded"):
        strategy = jspec.Guarded(strategy, costs=CostTable.flat(strategy.parts().plan.max_depth))
    prompt = np.asarray(tok.apply_chat_template([{"role": "user", "content": "Explain how a bicycle stays upright."}],
                                                add_generation_prompt=True)["input_ids"], np.int32)
    times = []
    for _ in range(1 + warm):
        t0 = time.perf_counter()
        jspec.decode(target, prompt, strategy, max_new_tokens=max_new, eos_token_id=())
        times.append(time.perf_counter() - t0)
    w = statistics.median(times[1:])
    return {"first_s": times[0], "warm_s": w, "compile_s": times[0] - w}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--warm", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "scripts" / "results" / "guard-compile-smollm2-cpu"))
    ap.add_argument("--one", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.one:
        print("RESULT " + json.dumps(one(a.one, a.max_new, a.warm)))
        return
    env = dict(os.environ, JSPEC_COMPILE_CACHE="", HF_HUB_OFFLINE="1")
    rounds = []
    for r in range(a.rounds):
        res = {}
        for name in NAMES:
            p = subprocess.run([sys.executable, __file__, "--one", name, "--max-new", str(a.max_new), "--warm",
                                str(a.warm)], capture_output=True, text=True, env=env, cwd=ROOT)
            line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
            if p.returncode or not line:
                raise SystemExit(f"{name} failed:\n{p.stderr[-3000:]}")
            res[name] = json.loads(line[0][7:])
            print(f"round {r + 1}/{a.rounds} {name:18s} compile {res[name]['compile_s']:6.2f} s, warm "
                  f"{res[name]['warm_s']:.3f} s", flush=True)
        rounds.append(res)
    med = {n: statistics.median(rd[n]["compile_s"] for rd in rounds) for n in NAMES}
    md = [f"SmolLM2-135M-Instruct f32, batch 1, {a.max_new} new tokens, {time.strftime('%Y-%m-%d')}; compile s "
          f"(first call minus warm), medians of {a.rounds} rounds, fresh processes, compile cache off", "",
          "| strategy | compile s | its strategy + AR |", "|---|---|---|"]
    for n in NAMES:
        base = n.removesuffix(" guarded")
        extra = f"{med[base] + med['AR']:.2f}" if n.endswith("guarded") else ""
        md.append(f"| {n} | {med[n]:.2f} | {extra} |")
    print("\n".join(md))
    Path(f"{a.out}.md").write_text("\n".join(md) + "\n")
    Path(f"{a.out}.json").write_text(json.dumps({"args": vars(a), "rounds": rounds, "median": med}, indent=1))


if __name__ == "__main__":
    main()
