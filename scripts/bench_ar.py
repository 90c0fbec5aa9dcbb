"""Greedy AR decoding throughput: jspec vs transformers `generate` (PyTorch), same weights, float32, CPU.

    python scripts/bench_ar.py [--runs 5] [--out bench_out]

A ~106M-parameter LLaMA-shaped random model (vocab 32000, hidden 768, 8 layers), prompt 128, 128 new tokens,
batch 1 and 8. Reports the median of `--runs` timed runs after a warm-up (compile time reported separately),
the ratio jspec / transformers measured in the same run, and ms per step against the memory-bandwidth floor
(parameter bytes / bandwidth). Writes results.json, a markdown table and a PNG bar chart to --out.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax
import numpy as np


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--bandwidth-gbs", type=float, default=29.0, help="memory read bandwidth of this machine")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--out", default="bench_out")
    args = ap.parse_args()

    import torch
    import transformers

    import jspec
    import ports

    torch.set_num_threads(os.cpu_count() or 1)
    cfg = ports.TextConfig(model_type="llama", vocab_size=32000, hidden_size=768, intermediate_size=2048,
                           num_layers=args.layers, num_heads=12, num_kv_heads=12, head_dim=64, eos_token_ids=())
    model = ports.random_model(cfg, key=0, std=0.05)
    n_params = model.num_params
    floor_ms = n_params * 4 / (args.bandwidth_gbs * 1e9) * 1e3
    print(f"model: {n_params / 1e6:.1f}M params, f32; bandwidth floor {floor_ms:.1f} ms/step at {args.bandwidth_gbs} GB/s")
    with tempfile.TemporaryDirectory() as d:
        ports.save_hf(model, d)
        hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()

    rng = np.random.default_rng(0)
    rows = []
    for B in [int(b) for b in args.batches.split(",")]:
        prompt = rng.integers(0, cfg.vocab_size, (B, args.prompt_len))
        N = args.new_tokens
        t = time.perf_counter()
        first = jspec.decode(model, prompt, max_new_tokens=N)
        compile_s = time.perf_counter() - t
        jx, jx_decode = [], []
        for _ in range(args.runs):
            t = time.perf_counter()
            out = jspec.decode(model, prompt, max_new_tokens=N)
            jx.append(time.perf_counter() - t)
            jx_decode.append(out.stats["decode_s"] / (N - 1))
        assert np.array_equal(out.tokens, first.tokens)
        pt_prompt = torch.tensor(prompt)
        gen = dict(max_new_tokens=N, min_new_tokens=N, do_sample=False, pad_token_id=0)
        with torch.no_grad():
            ref = hf.generate(pt_prompt, **gen)
            hf_t = []
            for _ in range(args.runs):
                t = time.perf_counter()
                hf.generate(pt_prompt, **gen)
                hf_t.append(time.perf_counter() - t)
        same = bool(np.array_equal(ref[:, args.prompt_len:].numpy(), out.tokens))
        j_tps = B * N / statistics.median(jx)
        h_tps = B * N / statistics.median(hf_t)
        step_ms = statistics.median(jx_decode) * 1e3
        row = dict(batch=B, jspec_tok_s=round(j_tps, 1), transformers_tok_s=round(h_tps, 1),
                   ratio=round(j_tps / h_tps, 2), jspec_step_ms=round(step_ms, 2), floor_step_ms=round(floor_ms, 2),
                   x_floor=round(step_ms / floor_ms, 2), compile_and_first_call_s=round(compile_s, 2),
                   same_tokens_as_transformers=same)
        print(row)
        rows.append(row)

    os.makedirs(args.out, exist_ok=True)
    meta = dict(jax=jax.__version__, torch=torch.__version__, transformers=transformers.__version__,
                device=str(jax.devices()[0]), cpus=os.cpu_count(), date=time.strftime("%Y-%m-%d"),
                params_m=round(n_params / 1e6, 1), prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                runs=args.runs)
    with open(os.path.join(args.out, "bench_ar.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=2)
    table = ["| batch | jspec tok/s | transformers tok/s | jspec / transformers | jspec ms/step | floor ms/step | x floor | first call (compile) s | same tokens |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        table.append(f"| {r['batch']} | {r['jspec_tok_s']} | {r['transformers_tok_s']} | {r['ratio']} | "
                     f"{r['jspec_step_ms']} | {r['floor_step_ms']} | {r['x_floor']} | {r['compile_and_first_call_s']} | "
                     f"{r['same_tokens_as_transformers']} |")
    md = "\n".join(table)
    with open(os.path.join(args.out, "bench_ar.md"), "w") as f:
        f.write(md + "\n")
    print(md)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5, 3.2))
        x = np.arange(len(rows))
        ax.bar(x - 0.2, [r["jspec_tok_s"] for r in rows], 0.4, label="jspec")
        ax.bar(x + 0.2, [r["transformers_tok_s"] for r in rows], 0.4, label="transformers")
        ax.set_xticks(x, [f"batch {r['batch']}" for r in rows])
        ax.set_ylabel("tokens / s")
        ax.set_title(f"greedy AR, {meta['params_m']}M LLaMA, f32 CPU")
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(args.out, "bench_ar.png"), dpi=120)
    except ImportError:
        print("matplotlib not installed (pip install -e '.[bench]'): no plot written")


if __name__ == "__main__":
    main()
