"""Long prompts: prefill time and peak memory against prompt length for jspec and transformers (SDPA), on a random
LLaMA of 110M parameters (hidden 768, 12 layers, 12 heads, vocabulary 32000, tied), batch 1, 2 new tokens.

    python scripts/bench_long.py                             # 1k, 2k, 4k, 8k; writes scripts/results/long-prompts.*
    python scripts/bench_long.py --lengths 1024 8192 16384 --skip-hf

Each point runs in a fresh process (its peak RSS is the process's); jspec's time includes its compile (a few
seconds), as a first call does. The blockwise attention path takes prompts of `ports.layers.BLOCKWISE_MIN` tokens
and more; `--direct` turns it off (the [T, S] score path) to compare. Prompts longer than the prefill chunk
(`decode`'s default, 4096 tokens, or `--chunk`) are prefilled a chunk at a time; `--one-pass` adds jspec's one-pass
prefill to compare.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG = dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_layers=12, num_heads=12, num_kv_heads=12,
              head_dim=64, max_position_embeddings=65536, tie_word_embeddings=True)

CHILD = r"""
import json, resource, sys, time, os
sys.path.insert(0, {root!r})
os.environ["HF_HUB_OFFLINE"] = "1"
import numpy as np
T, which, direct, chunk = {T}, {which!r}, {direct}, {chunk!r}
cfg = {cfg!r}
ids = np.random.default_rng(0).integers(3, cfg["vocab_size"], T)
t0 = time.perf_counter()
if which == "jspec":
    import jspec, ports
    from ports import layers as L
    if direct:
        L.BLOCKWISE_MIN = 10 ** 9
    model = ports.random_model(ports.TextConfig(model_type="llama", **cfg), key=0, std=0.02)
    t0 = time.perf_counter()
    out = jspec.decode(model, ids[None], max_new_tokens=2, eos_token_id=(), prefill_chunk=chunk)
    toks = out.tokens[0].tolist()
else:
    import torch, transformers
    torch.manual_seed(0)
    hf_cfg = transformers.LlamaConfig(vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"], num_hidden_layers=cfg["num_layers"],
        num_attention_heads=cfg["num_heads"], num_key_value_heads=cfg["num_kv_heads"],
        max_position_embeddings=cfg["max_position_embeddings"], tie_word_embeddings=True, attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(hf_cfg).eval()
    t0 = time.perf_counter()
    with torch.no_grad():
        toks = model.generate(torch.tensor(ids[None]), max_new_tokens=2, do_sample=False)[0, T:].tolist()
print(json.dumps({{"s": time.perf_counter() - t0, "rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}}))
"""


def run_child(code: str) -> dict:
    """Run `code` in a fresh Python process (its peak RSS is its own); its last stdout line, parsed as JSON, or
    {"error": its last stderr line}."""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if res.returncode:
        return {"error": res.stderr.strip().splitlines()[-1] if res.stderr.strip() else f"exit {res.returncode}"}
    return json.loads(res.stdout.strip().splitlines()[-1])


def median_run(runs: list[dict]) -> dict:
    """The median time and the largest peak RSS of a case's runs (an error if any run failed)."""
    bad = [r for r in runs if "s" not in r]
    if bad:
        return bad[0]
    times = sorted(r["s"] for r in runs)
    return {"s": times[len(times) // 2], "rss_gb": max(r["rss_gb"] for r in runs), "runs_s": [r["s"] for r in runs]}


def run(T: int, which: str, direct: bool = False, chunk="auto") -> dict:
    return run_child(CHILD.format(root=str(ROOT), T=T, which=which, direct=direct, cfg=CONFIG, chunk=chunk))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--direct", action="store_true", help="also run jspec with the blockwise path off")
    ap.add_argument("--one-pass", action="store_true", help="also run jspec's prefill in one pass (no chunks)")
    ap.add_argument("--chunk", type=int, default=None, help="jspec's prefill chunk (default: decode's, 4096)")
    ap.add_argument("--runs", type=int, default=1, help="fresh processes per point and case: median time, max RSS")
    ap.add_argument("--out", default=str(ROOT / "scripts" / "results" / "long-prompts"))
    args = ap.parse_args(argv)
    import time

    import jax

    rows = []
    for T in args.lengths:
        runs = {}
        for rep in range(args.runs):  # the cases interleaved, so that each repeat sees the same machine load
            runs.setdefault("jspec", []).append(run(T, "jspec", chunk=args.chunk or "auto"))
            if args.one_pass:
                runs.setdefault("jspec_one_pass", []).append(run(T, "jspec", chunk=None))
            if args.direct:
                runs.setdefault("jspec_direct", []).append(run(T, "jspec", direct=True))
            if not args.skip_hf:
                runs.setdefault("transformers", []).append(run(T, "hf"))
            print(f"{T} tokens, run {rep + 1}/{args.runs}: "
                  + ", ".join(f"{c} {r[-1].get('s', float('nan')):.1f} s" for c, r in runs.items()), flush=True)
        row = {"tokens": T, **{c: median_run(r) for c, r in runs.items()}}
        rows.append(row)
        print(json.dumps(row), flush=True)
    meta = {"date": time.strftime("%Y-%m-%d"), "jax": jax.__version__, "cpus": os.cpu_count(), "config": CONFIG,
            "prefill_chunk": args.chunk or "auto (4096)", "runs": args.runs}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out + ".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    cols = [c for c in ("jspec", "jspec_one_pass", "jspec_direct", "transformers") if c in rows[0]]
    lines = [f"Prefill + 2 new tokens, batch 1, random LLaMA 110M, f32, {meta['date']}, {meta['cpus']} CPUs, jax "
             f"{meta['jax']} ({'one run' if args.runs == 1 else f'median of {args.runs} runs'} per point, each in a fresh "
             "process; jspec's time includes its compile)", "",
             "| prompt tokens | " + " | ".join(f"{c} time / peak RSS" for c in cols) + " |"
             + (" jspec / transformers time |" if "transformers" in cols else ""),
             "|---" * (len(cols) + 1 + ("transformers" in cols)) + "|"]
    for r in rows:
        cells = [f"{r[c]['s']:.1f} s / {r[c]['rss_gb']:.2f} GB" if "s" in r[c] else r[c]["error"][:60] for c in cols]
        if "transformers" in cols:
            ok = "s" in r["jspec"] and "s" in r["transformers"]
            cells.append(f"{r['jspec']['s'] / r['transformers']['s']:.2f}x" if ok else "-")
        lines.append(f"| {r['tokens']:,} | " + " | ".join(cells) + " |")
    Path(args.out + ".md").write_text("\n".join(lines) + "\n")
    plot(rows, cols, args.out + ".png")
    print("\n".join(lines))


def plot(rows, cols, path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for c in cols:
        pts = [(r["tokens"], r[c]) for r in rows if "s" in r[c]]
        axes[0].plot([p[0] for p in pts], [p[1]["s"] for p in pts], "o-", label=c)
        axes[1].plot([p[0] for p in pts], [p[1]["rss_gb"] for p in pts], "o-", label=c)
    for ax, y in zip(axes, ("seconds (prefill + 2 tokens)", "peak RSS (GB)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel(y)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
