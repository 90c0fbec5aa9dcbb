"""How large a target must be for Chain speculative decoding to pay on this CPU, with the shipped zoo draft.

A Chain step's cost in AR steps (c) is measured on random LLaMA targets of the zoo text target's depth (12 layers)
and vocabulary at growing widths, drafted for by the shipped text draft, on the demo's batch of four long-answer
prompts (EOS off, the same number of new tokens for every call; medians of interleaved warm runs, loop time only).
The decode speedup a pair with tokens-per-step tau would get is tau / c; the table gives it at the zoo text pair's
measured tau (the demo's, 5.5 at gamma 5) and says at which size it reaches 1.5x. The shipped (trained) target is
measured too, with its own tau. Random targets accept few drafts, so their own tau is not the point: their step
costs are.

    python scripts/probe_target_size.py                 # widths 256-1024, about 5 minutes
    python scripts/probe_target_size.py --widths 256 512 --runs 3
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import jspec  # noqa: E402
from jspec.tools.bench import zoo as BENCH  # noqa: E402
from jspec.tools import demo  # noqa: E402
from jspec.tools.zoo import evaluate as ZE  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def step_costs(target, draft, prompt, new_tokens: int, gamma: int, runs: int) -> dict:
    """Median loop time per step of AR and of Chain(gamma) on `prompt`, and Chain's tokens per step."""
    def ar():
        return jspec.decode(target, prompt, max_new_tokens=new_tokens, eos_token_id=())

    def sd():
        return jspec.decode(target, prompt, strategy=jspec.Chain(draft, gamma=gamma), max_new_tokens=new_tokens,
                            eos_token_id=())

    outs = {"ar": ar(), "sd": sd()}  # compile
    times = {"ar": [], "sd": []}
    for _ in range(runs):
        for k, fn in (("ar", ar), ("sd", sd)):
            o = fn()
            times[k].append(o.stats["decode_s"] / o.stats["accepted"].shape[1])
    acc = np.asarray(outs["sd"].stats["accepted"])
    ar_step, sd_step = float(np.median(times["ar"])), float(np.median(times["sd"]))
    return {"ar_step_ms": ar_step * 1e3, "chain_step_ms": sd_step * 1e3, "cost_in_ar_steps": sd_step / ar_step,
            "own_tau": float(acc.sum() / max((acc > 0).sum(), 1))}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--widths", type=int, nargs="+", default=[256, 384, 512, 768, 1024])
    ap.add_argument("--gamma", type=int, default=5)
    ap.add_argument("--tau", type=float, default=5.5, help="tokens per step to predict the speedup at")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "scripts" / "results" / "target-size"))
    args = ap.parse_args(argv)
    pair = ZE.load_pair("text")
    prompt = ZE.batch_prompt(pair.encoder, demo.long_examples(3, pair.tokenizer))
    cfg = pair.target.config
    targets = {"zoo text-target (trained)": pair.target}
    for w in args.widths:
        heads = max(w // 64, 1)
        mlp = int(round(w * 2.75 / 64) * 64)
        targets[f"random, width {w}"] = BENCH.random_llama(cfg.num_layers, cfg.vocab_size, w, mlp, heads)
    rows = []
    for name, t in targets.items():
        r = step_costs(t, pair.draft, prompt, args.new_tokens, args.gamma, args.runs)
        r.update(name=name, params_m=t.num_params / 1e6, predicted_speedup=args.tau / r["cost_in_ar_steps"])
        rows.append(r)
        print(f"{name}: {r['params_m']:.1f}M params, AR step {r['ar_step_ms']:.2f} ms, Chain step "
              f"{r['chain_step_ms']:.2f} ms = {r['cost_in_ar_steps']:.2f} AR steps; at tau {args.tau} the decode "
              f"speedup would be {r['predicted_speedup']:.2f}x (own tau {r['own_tau']:.2f})", flush=True)
    meta = {"date": datetime.date.today().isoformat(), "cpus": os.cpu_count(), "machine": platform.machine(),
            "jax": jax.__version__, "gamma": args.gamma, "tau": args.tau,
            "batch": int(len(prompt["input_ids"])), "new_tokens": args.new_tokens, "runs": args.runs,
            "draft_params_m": pair.draft.num_params / 1e6}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [f"Chain gamma={args.gamma} with the zoo text draft ({meta['draft_params_m']:.2f}M), batch "
             f"{meta['batch']}, {args.new_tokens} new tokens, EOS off, medians of {args.runs} runs, {meta['date']}, {meta['cpus']} "
             f"CPUs, jax {meta['jax']}", "",
             "| target | params | AR step ms | Chain step ms | Chain step / AR step | decode speedup at tau "
             f"{args.tau} |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['name']} | {r['params_m']:.1f}M | {r['ar_step_ms']:.2f} | {r['chain_step_ms']:.2f} | "
              f"{r['cost_in_ar_steps']:.2f} | {r['predicted_speedup']:.2f}x |" for r in rows]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
