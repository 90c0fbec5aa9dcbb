"""Choose the layers a layer-skipping self-draft (EESD's "Self-SD" baseline) leaves out, by greedy search.

    python scripts/search_layer_skip.py                        # SmolLM2-135M-Instruct on its self-written data
    python scripts/search_layer_skip.py --max-skip 12 --ship   # ... and ship the chosen set with the package

Greedy backward elimination (`jspec.tools.train.layer_skip.search`): each round drops the layer whose removal keeps
the reduced model's top-1 equal to the full model's on the most answer positions of the model's own text
(``jspec train self-data``, the first sequences; teacher-forced). Then, for each number of skipped layers s, the
predicted greedy speedup of a chain of gamma drafts, with a = that round's agreement taken as a per-token
acceptance rate: tau = (1 - a^(gamma+1)) / (1 - a) tokens per target step, at a cost of gamma draft steps
(`draft_cost`: the reduced model's share of the multiply-adds, its LM head included) plus one verify of gamma + 1
tokens (`--verify-cost`, in AR steps; measured on this CPU). The set with the best prediction is the choice;
`--ship` writes it to assets/heads/jspec_heads/<model>/layer-skip/layers.json (`jspec.models.head(model, "layer-skip")`).
Writes bench_out/layer-skip-<model>.{json,md,png} (the shipped set's: docs/results/real-model-drafters/).
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def predicted(a: float, cost: float, gamma: int, verify: float) -> tuple[float, float]:
    """(tokens per target step, speedup over AR) of a gamma-chain at per-token acceptance a."""
    tau = float(gamma + 1) if a >= 1 else (1 - a ** (gamma + 1)) / (1 - a)
    return tau, tau / (gamma * cost + verify)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--data", default=None, help="default build/self-data/<model>.jsonl")
    ap.add_argument("--rows", type=int, default=4, help="packed rows of the data to score on (its first sequences)")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--max-skip", type=int, default=12)
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--verify-cost", type=float, default=1.5, help="a verify of gamma + 1 tokens, in AR steps")
    ap.add_argument("--ship", action="store_true")
    ap.add_argument("--rescore", action="store_true", help="no search: the predictions made again from the rounds "
                                                           "of the last results file (another --gamma / --verify-cost)")
    a = ap.parse_args(argv)

    import numpy as np

    from jspec.tools import models
    from jspec.tools import self_data as SD
    from jspec.parts.drafters import layer_skip as LS
    from jspec.tools.train import layer_skip as LSS
    from jspec.tools.train import eesd as EST

    target, _ = models.load(a.model)
    out = ROOT / "bench_out" / f"layer-skip-{a.model}"
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    if a.rescore:
        last = json.loads(Path(f"{out}.json").read_text())
        n_tok, rounds = last["answer_positions"], last["rounds"]
        t0 -= last["seconds"]
    else:
        seqs, starts = SD.sequences(SD.read(a.data or str(ROOT / "build" / "self-data" / f"{a.model}.jsonl")))
        batches = [b for b, _ in itertools.islice(EST.pack(seqs, 1, a.seq_len, starts=starts), a.rows)]
        n_tok = int(sum(float(np.asarray(b["weights"]).sum()) for b in batches))
        print(f"{a.model}: {target.config.num_layers} layers; scoring on {len(batches)} packed rows, {n_tok} answer "
              f"positions", flush=True)
        _, rounds = LSS.search(target, batches, a.max_skip, progress=lambda r, i, ag: print(
            f"  round {r + 1}: skip layer {i}, agreement {ag:.4f} ({time.time() - t0:.0f} s)", flush=True))
    rows = []
    for r in rounds:
        s = len(r["skip"])
        cost = LS.draft_cost(target, s)
        tau, speed = predicted(r["agreement"], cost, a.gamma, a.verify_cost)
        rows.append({"skipped": s, "layers": sorted(r["skip"]), "agreement": round(r["agreement"], 4),
                     "draft_cost": round(cost, 3), "predicted_tau": round(tau, 3),
                     "predicted_speedup": round(speed, 3)})
    best = max(rows, key=lambda r: r["predicted_speedup"])
    result = {"model": a.model, "gamma": a.gamma, "verify_cost_ar_steps": a.verify_cost,
              "answer_positions": n_tok, "rows": rows, "choice": best,
              "rounds": [{"skip": r["skip"], "agreement": r["agreement"],
                          "candidates": {str(k): round(v, 4) for k, v in r["candidates"].items()}} for r in rounds],
              "seconds": round(time.time() - t0, 1),
              "date": last["date"] if a.rescore else time.strftime("%Y-%m-%d")}
    with open(f"{out}.json", "w") as f:
        json.dump(result, f, indent=1)
    cols = list(rows[0])
    md = [f"# Layer skipping for {a.model}: greedy search ({result['date']})", "",
          f"Agreement = the reduced model's top-1 equal to the full model's, teacher-forced on {n_tok} answer "
          f"positions of the model's own text. Predicted for a chain of {a.gamma} drafts with a verify of "
          f"{a.verify_cost} AR steps. Choice: skip {best['layers']}.", "",
          "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    md += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows]
    Path(f"{out}.md").write_text("\n".join(md) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(1, 2, figsize=(9, 3.2))
        xs = [r["skipped"] for r in rows]
        ax[0].plot(xs, [r["agreement"] for r in rows], "o-")
        ax[0].set(xlabel="layers skipped", ylabel="top-1 agreement with the full model")
        ax[1].plot(xs, [r["predicted_speedup"] for r in rows], "o-")
        ax[1].axhline(1.0, color="k", lw=0.8)
        ax[1].set(xlabel="layers skipped", ylabel=f"predicted speedup (chain of {a.gamma})")
        fig.suptitle(f"layer skipping, {a.model}", fontsize=9)
        fig.tight_layout()
        fig.savefig(f"{out}.png", dpi=120)
    except ImportError:
        pass
    print(f"choice: skip {best['layers']} (agreement {best['agreement']}, predicted {best['predicted_speedup']}x); "
          f"wrote {out}.json/.md/.png")
    if a.ship:
        d = Path(models.head_dir(a.model, "layer-skip"))
        d.mkdir(parents=True, exist_ok=True)
        (d / "layers.json").write_text(json.dumps({
            "format": "jspec-layer-skip", "model": a.model, "skip": best["layers"],
            "agreement": best["agreement"], "search": f"bench_out/layer-skip-{a.model}.json",
            "command": "python scripts/search_layer_skip.py " + " ".join(sys.argv[1:] if argv is None else argv)},
            indent=1) + "\n")
        print(f"shipped {d / 'layers.json'}")
    return result


if __name__ == "__main__":
    main()
