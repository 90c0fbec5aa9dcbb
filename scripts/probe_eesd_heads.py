"""Whether two EESD heads of the zoo text target (exit after layer 1 and after layer 2) decode differently: the
same prompts, controller and key through each head, greedy and sampled (T = 1), with Beta-TS and with a fixed
K = 10; equal acceptance in every round means the heads' drafts agree wherever the decode looked.

    python scripts/probe_eesd_heads.py      # writes scripts/results/eesd-heads-n1-n2.{json,md}
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import jspec  # noqa: E402
from jspec.tools.bench import zoo as bench  # noqa: E402
from jspec.parts.drafters.early_exit import load_head  # noqa: E402

HEADS = {"N = 1": "text-target-eesd-n1", "N = 2": "text-target-eesd-n2"}


def main() -> None:
    target, _, scenarios, _, max_new = bench.zoo_pairs(8)["zoo text"]
    heads = {n: load_head(str(ROOT / "assets" / "zoo" / "jspec_zoo" / d), target) for n, d in HEADS.items()}
    rows = []
    for scen in ("text", "described_caption"):
        for temp in (0.0, 1.0):
            for ctrl in ("Beta-TS", "K = 10"):
                outs = {n: jspec.decode(target, scenarios[scen], jspec.EESD(
                    h, controller="beta" if ctrl == "Beta-TS" else jspec.FixedK(10)), max_new_tokens=max_new,
                    temperature=temp, key=jax.random.key(0)) for n, h in heads.items()}
                a, b = (outs[n] for n in HEADS)
                row = {"scenario": scen, "temperature": temp, "controller": ctrl,
                       "exit_layers": [int(h.exit_layer) for h in heads.values()],
                       "tokens": int(np.sum(a.lengths)), "rounds": int(np.sum(a.stats["steps"])),
                       "same_rounds": bool(np.array_equal(a.stats["accepted"], b.stats["accepted"])),
                       "same_tokens": bool(np.array_equal(a.tokens, b.tokens)),
                       **{f"tau {n}": float(np.nanmean(o.stats["mean_accepted"])) for n, o in outs.items()}}
                rows.append(row)
                print(row)
    out = ROOT / "scripts" / "results" / "eesd-heads-n1-n2"
    out.with_suffix(".json").write_text(json.dumps({"meta": bench.meta("eesd-heads", 1, False), "rows": rows},
                                                   indent=1))
    lines = ["Two EESD heads of the zoo text target, one decode each per setting (same prompts, controller, key):",
             "", "| scenario | T | controller | tokens | rounds | tau N = 1 | tau N = 2 | same acceptance every round |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['scenario']} | {r['temperature']:g} | {r['controller']} | {r['tokens']} | {r['rounds']} | "
                     f"{r['tau N = 1']:.3f} | {r['tau N = 2']:.3f} | {'yes' if r['same_rounds'] else 'no'} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
