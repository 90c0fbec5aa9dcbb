"""What a block drafter's round costs, in AR steps, at every draft depth: `jspec.costs.measure` over a random
`DFlashHead` (its numbers do not depend on the weights: a round's programs are the same whatever it drafts).

    python scripts/probe_dflash_cost.py --model smollm2-135m-instruct        # after `jspec fetch smollm2-135m-instruct`
    python scripts/probe_dflash_cost.py --shape 7b --dtype bfloat16          # a random LLaMA-2-7B-shaped target (a GPU)

For each (draft layers, block) it times an AR step and a round of the chain and of DDTree at depth 0 .. block - 1
(warm, in one program per shape, the points interleaved over --runs; `jspec.engine.costs`). Results:
bench_out/dflash-cost-<model>-<backend>.{json,md}, with the device and versions.
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
SHAPES = {"7b": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_layers=32, num_heads=32,
                     num_kv_heads=32, head_dim=128)}


def load_target(args):
    import jax.numpy as jnp

    import ports
    from ports.core.config import TextConfig

    if args.shape:
        cfg = TextConfig(model_type="llama", max_position_embeddings=4096, **SHAPES[args.shape])
        return ports.random_model(cfg, 0, dtype=jnp.dtype(args.dtype)), f"random-{args.shape}"
    from jspec.tools import models

    return models.load(args.model, dtype=args.dtype)[0], args.model


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--shape", choices=sorted(SHAPES), default=None)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--heads", default="2x8,2x16", help="comma-separated LAYERSxBLOCK heads to measure")
    ap.add_argument("--draft-vocab", type=int, default=8192, help="0: the whole vocabulary")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    import jspec
    from jspec import costs
    from jspec.parts.drafters import dflash

    target, name = load_target(args)
    V = target.config.vocab_size
    vocab = np.arange(min(args.draft_vocab, V)) if args.draft_vocab else None
    rows = []
    for spec in args.heads.split(","):
        layers, block = (int(x) for x in spec.split("x"))
        head = dflash.init_head(target, jax.random.key(0), layers, block, draft_vocab=vocab,
                                dtype=jnp.dtype(args.dtype))
        for tree, strat in (("chain", jspec.DFlash(head)),
                            ("ddtree", jspec.DFlash(head, tree="ddtree", top_k=4, total=min(24, 4 * (block - 1))))):
            t = costs.measure(target, strat, batch=args.batch, prompt_len=args.prompt_len, cache=False,
                              runs=args.runs, progress=lambda s: print("  " + s, flush=True))
            rows.append({"layers": layers, "block": block, "tree": tree, "ar_ms": t.ar_s * 1e3,
                         "round_ms": [s * 1e3 for s in t.step_s], "ar_steps": [float(x) for x in t.relative()]})
            print(f"{layers} layers, block {block}, {tree}: AR {t.ar_s * 1e3:.2f} ms; rounds in AR steps "
                  + " ".join(f"{x:.2f}" for x in t.relative()), flush=True)
    meta = {"model": name, "dtype": args.dtype, "batch": args.batch, "prompt_len": args.prompt_len,
            "draft_vocab": args.draft_vocab, "runs": args.runs, "device": str(jax.devices()[0].device_kind),
            "backend": jax.default_backend(), "jax": jax.__version__,
            "date": datetime.date.today().isoformat()}
    stem = args.out or str(ROOT / "bench_out" / f"dflash-cost-{name}-{jax.default_backend()}")
    Path(stem).parent.mkdir(parents=True, exist_ok=True)
    Path(stem + ".json").write_text(json.dumps({**meta, "rows": rows}, indent=1))
    lines = [f"# A block drafter's round, in AR steps ({meta['device']}, {name} {args.dtype}, batch {args.batch}, "
             f"{args.prompt_len}-token prompt, jax {jax.__version__}, {meta['date']})", "",
             "| layers | block | plan | AR step ms | depth 0 | 1 | 2 | 4 | deepest |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        a = r["ar_steps"]
        pick = [a[0], a[1], a[min(2, len(a) - 1)], a[min(4, len(a) - 1)], a[-1]]
        lines.append(f"| {r['layers']} | {r['block']} | {r['tree']} | {r['ar_ms']:.2f} | "
                     + " | ".join(f"{x:.2f}" for x in pick) + " |")
    Path(stem + ".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {stem}.json and .md")
    return {**meta, "rows": rows}


if __name__ == "__main__":
    main()
