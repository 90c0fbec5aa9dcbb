"""Scanned against unrolled decoder layers (`ports.core.scanned`): compile time and warm decode time of the same target in
both layouts, same tokens checked.

    python scripts/probe_scan_layers.py                                   # the zoo text target, AR and prompt lookup
    python scripts/probe_scan_layers.py --model smollm2-135m-instruct     # after `jspec fetch smollm2-135m-instruct`
    python scripts/probe_scan_layers.py --shape 7b --dtype bfloat16       # a random LLaMA-2-7B-shaped target (a GPU)

Each (layout, strategy, round) runs in a fresh process with the persistent compile cache off: its first `decode`
(compile + run) minus the median of its warm calls is the compile time. Rounds interleave the layouts; the table
gives medians over rounds and the scanned / unrolled ratios of the same round. Results: bench_out/
scan-layers-<model>-<backend>.{json,md} (`--out` for another stem).
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
STRATEGIES = ("AR", "PromptLookup gamma=4")
SHAPES = {"7b": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_layers=32, num_heads=32,
                     num_kv_heads=32, head_dim=128)}


def load_target(args):
    import jax.numpy as jnp
    import numpy as np

    import ports
    from ports.core.config import TextConfig

    dtype = jnp.dtype(args.dtype)
    if args.shape:
        cfg = TextConfig(model_type="llama", max_position_embeddings=4096, **SHAPES[args.shape])
        model = ports.random_model(cfg, 0, dtype=dtype)
    elif args.model == "zoo":
        from jspec.tools.zoo import load

        model = load("text-target")
    else:
        from jspec.tools import models

        model = models.load(args.model, dtype=args.dtype)[0]
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    base = rng.integers(3, vocab, args.prompt_len // 4)
    prompt = np.concatenate([base, base[: args.prompt_len // 8], base, base])[: args.prompt_len]  # copies to look up
    return model, [prompt.astype(np.int32)] * args.batch


def one(args) -> dict:
    import jax
    import numpy as np

    import jspec
    from ports.core import scanned

    model, prompt = load_target(args)
    if args.layout == "scanned":
        model = scanned.scan_layers(model)
    strategy = None if args.one == "AR" else jspec.PromptLookup(max_ngram=3, gamma=4)
    kw = dict(max_new_tokens=args.max_new, eos_token_id=())
    times, toks = [], None
    for i in range(1 + args.warm):
        t0 = time.perf_counter()
        out = jspec.decode(model, prompt, strategy, **kw)
        tokens = np.asarray(jax.block_until_ready(out.tokens))
        times.append(time.perf_counter() - t0)
        assert toks is None or (toks == tokens).all()
        toks = tokens
    warm = statistics.median(times[1:])
    return {"first_s": times[0], "warm_s": warm, "compile_s": times[0] - warm, "tokens": toks.tolist(),
            "backend": jax.default_backend(), "device": str(jax.devices()[0].device_kind), "jax": jax.__version__}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="zoo", help="'zoo' (the zoo text target) or a `jspec.models` name")
    ap.add_argument("--shape", choices=sorted(SHAPES), help="a random target of this shape instead of --model")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=STRATEGIES)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warm", type=int, default=3, help="warm calls per process (their median is the warm time)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--out", default=None)
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--layout", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        print("RESULT " + json.dumps(one(args)))
        return
    env = dict(os.environ, JSPEC_COMPILE_CACHE="", HF_HUB_OFFLINE="1")
    passed = ["--model", args.model, "--dtype", args.dtype, "--warm", str(args.warm), "--batch", str(args.batch),
              "--prompt-len", str(args.prompt_len), "--max-new", str(args.max_new)] + (
        ["--shape", args.shape] if args.shape else [])
    rounds = []
    for r in range(args.rounds):
        res = {}
        for name in args.strategies:
            for layout in ("unrolled", "scanned"):
                cmd = [sys.executable, __file__, *passed, "--one", name, "--layout", layout]
                p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
                line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
                if p.returncode or not line:
                    raise SystemExit(f"{name} / {layout} failed:\n{p.stderr[-3000:]}")
                res[f"{name} | {layout}"] = got = json.loads(line[0][7:])
                print(f"round {r + 1}/{args.rounds} {name:22s} {layout:9s} compile {got['compile_s']:7.2f} s, "
                      f"warm {got['warm_s']:.3f} s", flush=True)
            same = res[f"{name} | unrolled"]["tokens"] == res[f"{name} | scanned"]["tokens"]
            res[f"{name} | same_tokens"] = same
        rounds.append(res)
    first = rounds[0][f"{args.strategies[0]} | unrolled"]
    rows = []
    for name in args.strategies:
        med = lambda layout, k: statistics.median(rd[f"{name} | {layout}"][k] for rd in rounds)  # noqa: E731
        ratio = lambda k: statistics.median(  # noqa: E731
            rd[f"{name} | scanned"][k] / rd[f"{name} | unrolled"][k] for rd in rounds)
        rows.append({"strategy": name, "compile_unrolled_s": med("unrolled", "compile_s"),
                     "compile_scanned_s": med("scanned", "compile_s"), "compile_ratio": ratio("compile_s"),
                     "warm_unrolled_s": med("unrolled", "warm_s"), "warm_scanned_s": med("scanned", "warm_s"),
                     "warm_ratio": ratio("warm_s"),
                     "same_tokens": all(rd[f"{name} | same_tokens"] for rd in rounds)})
    what = f"random {args.shape}" if args.shape else args.model
    head = (f"{what}, {args.dtype}, batch {args.batch}, {args.prompt_len}-token prompt, {args.max_new} new tokens; "
            f"{first['device']} ({first['backend']}), jax {first['jax']}, {time.strftime('%Y-%m-%d')}; medians of "
            f"{args.rounds} rounds (fresh processes, compile cache off), ratios scanned / unrolled per round")
    md = [head, "", "| strategy | compile s, unrolled | scanned | ratio | warm decode s, unrolled | scanned | ratio | "
                    "same tokens |", "|---|---|---|---|---|---|---|---|"]
    md += [f"| {r['strategy']} | {r['compile_unrolled_s']:.2f} | {r['compile_scanned_s']:.2f} | "
           f"{r['compile_ratio']:.2f} | {r['warm_unrolled_s']:.3f} | {r['warm_scanned_s']:.3f} | "
           f"{r['warm_ratio']:.2f} | {r['same_tokens']} |" for r in rows]
    print("\n" + "\n".join(md))
    stem = Path(args.out) if args.out else (
        ROOT / "bench_out" / f"scan-layers-{(args.shape or args.model)}-{first['backend']}")
    stem.parent.mkdir(parents=True, exist_ok=True)
    for rd in rounds:
        for v in rd.values():
            if isinstance(v, dict):
                v.pop("tokens", None)
    Path(f"{stem}.json").write_text(json.dumps({"args": vars(args), "summary": rows, "rounds": rounds}, indent=1))
    Path(f"{stem}.md").write_text("\n".join(md) + "\n")
    print(f"wrote {stem}.json and {stem}.md")


if __name__ == "__main__":
    main()
