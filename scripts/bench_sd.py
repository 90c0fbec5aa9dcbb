"""Speculative decoding overhead and speed: AR vs Chain vs Tree vs DynamicTree, and transformers' assisted generation.

    python scripts/bench_sd.py [--runs 3] [--out bench_out]

Pair: a LLaMA-shaped random target (vocab 32000, hidden 768, `--layers` layers, ~106M params at 8) whose layers
after the first are damped, and a draft that is the target truncated to its first layer (same embeddings and
head), so the draft agrees with the target often but not always. Greedy, float32, CPU, batch 1 (and `--batch`).

Per strategy: median tokens/s over `--runs` runs after a warm-up (compile time reported apart), the mean
accepted length tau (bonus included), and the per-phase times of one profiled run (`jspec.decode(...,
profile=True)`). The predicted speedup tau * T_ar / (T_draft + T_verify) (T_ar: one AR step of the target,
T_draft: a step's draft phase, i.e. gamma draft forwards, T_verify: the target's tree forward) is compared with
the measured speedup of the decode loop over jspec AR (time per committed token, prefill excluded); their
ratio shows what the engine keeps for itself (rule, commit, loop). Wall-time tokens/s (prefill included) are
reported too. Runs of all strategies are interleaved, so the machine's drifts hit them alike. transformers `generate` with `assistant_model` (same pair, constant
gamma, no confidence cut-off) is timed on the chain rows. Writes bench_sd.json, bench_sd.md and bench_sd.png.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax
import numpy as np


def make_pair(layers: int, damp: float, vocab: int):
    import ports

    cfg = ports.TextConfig(model_type="llama", vocab_size=vocab, hidden_size=768, intermediate_size=2048,
                           num_layers=layers, num_heads=12, num_kv_heads=12, head_dim=64, eos_token_ids=())
    target = ports.random_model(cfg, key=0, std=0.05)
    params = dict(target.params)
    params["layers"] = [dict(p) for p in params["layers"]]
    for p in params["layers"][1:]:
        p["wo"] = p["wo"] * damp
        p["w_down"] = p["w_down"] * damp
    target = ports.Model(cfg, params)
    draft = ports.Model(dataclasses.replace(cfg, num_layers=1), dict(params, layers=params["layers"][:1]))
    return target, draft


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--damp", type=float, default=0.05, help="scale of the target's layers after the first")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--out", default="bench_out")
    args = ap.parse_args()

    import jspec

    target, draft = make_pair(args.layers, args.damp, args.vocab)
    print(f"target {target.num_params / 1e6:.1f}M params, draft {draft.num_params / 1e6:.1f}M (first layer), f32")
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, args.vocab, (args.batch, args.prompt_len))
    N = args.new_tokens
    strategies = [("AR", jspec.AR(), 0), ("Chain g=3", jspec.Chain(draft, gamma=3), 3),
                  ("Chain g=5", jspec.Chain(draft, gamma=5), 5), ("Tree mc_sim_7b_63", jspec.Tree(draft), 5),
                  ("DynamicTree 5x8/40", jspec.DynamicTree(draft, depth=5, top_k=8, total=40), 5)]
    # warm up (compile) every strategy, then interleave the timed runs so that drifts of this shared machine hit
    # every strategy alike; medians over runs
    compile_s, first = {}, {}
    for name, strat, _ in strategies:
        t = time.perf_counter()
        first[name] = jspec.decode(target, prompt, strategy=strat, max_new_tokens=N)
        compile_s[name] = time.perf_counter() - t
        if name != "AR":
            jspec.decode(target, prompt, strategy=strat, max_new_tokens=N, profile=True)
    wall = {n: [] for n, _, _ in strategies}
    step = {n: [] for n, _, _ in strategies}
    phases = {n: [] for n, _, _ in strategies}
    for r in range(args.runs):
        for name, strat, _ in strategies:
            t = time.perf_counter()
            out = jspec.decode(target, prompt, strategy=strat, max_new_tokens=N)
            wall[name].append(time.perf_counter() - t)
            steps = int(out.stats["steps"].max())
            step[name].append(out.stats["decode_s"] / steps)
            assert np.array_equal(out.tokens, first[name].tokens)
            if name != "AR":
                prof = jspec.decode(target, prompt, strategy=strat, max_new_tokens=N, profile=True)
                phases[name].append([prof.stats[k] / steps for k in ("draft_s", "verify_s", "other_s")])
        print(f"run {r + 1}/{args.runs}: " + ", ".join(f"{n} {args.batch * N / wall[n][-1]:.1f} tok/s"
                                                         for n, _, _ in strategies), flush=True)
    med = statistics.median
    ar_tokens = first["AR"].tokens
    ar_step = med(step["AR"])
    rows = []
    for name, strat, gamma in strategies:
        out = first[name]
        tau = float(np.mean(out.stats["mean_accepted"]))
        row = dict(strategy=name, gamma=gamma, tok_s=round(args.batch * N / med(wall[name]), 1),
                   compile_s=round(compile_s[name], 1), tau=round(tau, 2), step_ms=round(med(step[name]) * 1e3, 2),
                   same_tokens_as_ar=bool(np.array_equal(out.tokens, ar_tokens)))
        # decode-loop speedup (prefill excluded): time per committed token, AR over SD
        measured = ar_step / (med(step[name]) / tau)
        row["speedup"] = round(measured, 2)
        row["wall_speedup"] = round(med(wall["AR"]) / med(wall[name]), 2)
        if name != "AR":
            t_draft, t_verify, t_other = (med(p[i] for p in phases[name]) for i in range(3))
            predicted = tau * ar_step / (t_draft + t_verify)
            row.update(draft_ms=round(t_draft * 1e3, 2), verify_ms=round(t_verify * 1e3, 2),
                       other_ms=round(t_other * 1e3, 2), predicted_speedup=round(predicted, 2),
                       measured_over_predicted=round(measured / predicted, 3))
        print(row)
        rows.append(row)

    hf_rows = []
    if not args.no_transformers and args.batch == 1:
        hf_rows = bench_transformers(target, draft, prompt, N, args.runs, [r for r in rows if "Chain" in r["strategy"]],
                                     rows[0]["tok_s"], ar_tokens)

    import torch
    import transformers

    meta = dict(jax=jax.__version__, torch=torch.__version__, transformers=transformers.__version__,
                device=str(jax.devices()[0]), cpus=os.cpu_count(), date=time.strftime("%Y-%m-%d"),
                target_params_m=round(target.num_params / 1e6, 1), draft_params_m=round(draft.num_params / 1e6, 1),
                prompt_len=args.prompt_len, new_tokens=N, batch=args.batch, runs=args.runs, damp=args.damp)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_sd.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows, "transformers": hf_rows}, f, indent=2)
    md = table(rows, hf_rows)
    with open(os.path.join(args.out, "bench_sd.md"), "w") as f:
        f.write(md + "\n")
    print(md)
    plot(rows, meta, os.path.join(args.out, "bench_sd.png"))


def bench_transformers(target, draft, prompt, N, runs, chain_rows, jspec_ar_tps, ar_tokens):
    """transformers greedy `generate` and assisted generation (constant gamma) on the same pair, batch 1."""
    import torch
    import transformers

    import ports

    torch.set_num_threads(os.cpu_count() or 1)
    with tempfile.TemporaryDirectory() as d:
        ports.save_hf(target, os.path.join(d, "t"))
        ports.save_hf(draft, os.path.join(d, "d"))
        hf_t = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(d, "t"), dtype=torch.float32).eval()
        hf_d = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(d, "d"), dtype=torch.float32).eval()
    pt = torch.tensor(prompt)
    base = dict(max_new_tokens=N, min_new_tokens=N, do_sample=False, pad_token_id=0)

    def timed(**kw):
        with torch.no_grad():
            out = hf_t.generate(pt, **base, **kw)
            walls = []
            for _ in range(runs):
                t = time.perf_counter()
                hf_t.generate(pt, **base, **kw)
                walls.append(time.perf_counter() - t)
        return out[:, prompt.shape[1]:].numpy(), N / statistics.median(walls)

    toks, ar_tps = timed()
    rows = [dict(strategy="transformers AR", tok_s=round(ar_tps, 1),
                 jspec_over_transformers=round(jspec_ar_tps / ar_tps, 2),
                 same_tokens_as_jspec=bool(np.array_equal(toks, ar_tokens)))]
    print(rows[-1])
    for r in chain_rows:
        hf_d.generation_config.num_assistant_tokens = r["gamma"]
        hf_d.generation_config.num_assistant_tokens_schedule = "constant"
        hf_d.generation_config.assistant_confidence_threshold = 0.0
        toks, tps = timed(assistant_model=hf_d)
        rows.append(dict(strategy=f"transformers assisted g={r['gamma']}", tok_s=round(tps, 1),
                         speedup_over_transformers_ar=round(tps / ar_tps, 2),
                         jspec_over_transformers=round(r["tok_s"] / tps, 2),
                         same_tokens_as_jspec=bool(np.array_equal(toks, ar_tokens))))
        print(rows[-1])
    return rows


def table(rows, hf_rows) -> str:
    lines = ["| strategy | tok/s (wall) | wall speedup | decode speedup | predicted speedup | measured / predicted "
             "| tau (mean accepted) | step ms | draft ms/step | verify ms/step | other ms/step | same tokens as AR "
             "| compile s |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['strategy']} | {r['tok_s']} | {r['wall_speedup']} | {r['speedup']} | "
                     f"{r.get('predicted_speedup', '')} | {r.get('measured_over_predicted', '')} | {r['tau']} | "
                     f"{r['step_ms']} | {r.get('draft_ms', '')} | {r.get('verify_ms', '')} | {r.get('other_ms', '')} | "
                     f"{r['same_tokens_as_ar']} | {r['compile_s']} |")
    if hf_rows:
        lines += ["", "| transformers | tok/s | jspec / transformers (same strategy) | same tokens as jspec |",
                  "|---|---|---|---|"]
        for r in hf_rows:
            lines.append(f"| {r['strategy']} | {r['tok_s']} | {r['jspec_over_transformers']} | "
                         f"{r['same_tokens_as_jspec']} |")
    return "\n".join(lines)


def plot(rows, meta, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed (pip install -e '.[bench]'): no plot written")
        return
    sd = rows[1:]
    fig, ax = plt.subplots(figsize=(6.5, 3.4))
    x = np.arange(len(sd))
    ax.bar(x - 0.2, [r["speedup"] for r in sd], 0.4, label="measured")
    ax.bar(x + 0.2, [r["predicted_speedup"] for r in sd], 0.4, label="predicted from phase times")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xticks(x, [f"{r['strategy']}\ntau={r['tau']}" for r in sd], fontsize=7)
    ax.set_ylabel("speedup over jspec AR")
    ax.set_title(f"greedy SD, {meta['target_params_m']}M target / {meta['draft_params_m']}M draft, f32 CPU",
                 fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
