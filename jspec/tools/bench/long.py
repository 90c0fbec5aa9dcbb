"""Long prompts: prefill time and peak memory against prompt length for jspec and transformers (SDPA), on a random
LLaMA, batch 1, 2 new tokens (`jspec bench long`).

    jspec bench long                                  # 110M (hidden 768, 12 layers), f32: 1k, 2k, 4k, 8k tokens
    jspec bench long --lengths 8192 16384 32768 --skip-hf
    jspec bench long --model 7b --dtype bf16 --lengths 16384 32768 65536    # on a GPU: LLaMA-2-7B's shape
    jspec bench long --video qwen2.5-vl-7b --dtype bf16 --lengths 12544     # a 64-frame video prompt, jspec only

Each point runs in a fresh process (its peak RSS is the process's; on a GPU also the device's peak bytes); jspec's
time includes its compile, as a first call does. `--runs N` runs every case N times, interleaved, and reports the
median time. The blockwise attention path takes prompts of `ports.core.layers.BLOCKWISE_MIN` tokens and more (on a GPU
in bf16 / f16 a fresh prefill runs cuDNN's flash attention, `ports.core.blockwise.fused_attention`); `--direct` turns it
off (the [T, S] score path) to compare. Prompts longer than the prefill chunk (`decode`'s default, 4096 tokens, or
`--chunk`) are prefilled a chunk at a time; `--one-pass` adds jspec's one-pass prefill to compare. `--compile-cache` adds jspec in a fresh process whose
programs load from a warm persistent compilation cache (`jspec.core.compilation.enable_cache`) instead of compiling;
`--warm` adds each library's second call in a process (what a long-running job pays per prompt).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from jspec.core import provenance as PV
from jspec.tools import report

MODELS = {  # random LLaMAs: the CPU table's 110M, and LLaMA-2-7B's shape for a GPU
    "110m": dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_layers=12, num_heads=12,
                 num_kv_heads=12, head_dim=64, max_position_embeddings=65536, tie_word_embeddings=True),
    "7b": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_layers=32, num_heads=32,
               num_kv_heads=32, head_dim=128, max_position_embeddings=131072, tie_word_embeddings=False),
}
DTYPES = ("f32", "bf16")

CHILD = r"""
import json, resource, sys, time, os
os.environ["HF_HUB_OFFLINE"] = "1"
import numpy as np
T, which, direct, chunk, dtype, cache_dir, warm = {T}, {which!r}, {direct}, {chunk!r}, {dtype!r}, {cache_dir!r}, {warm}
cfg = {cfg!r}
ids = np.random.default_rng(0).integers(3, cfg["vocab_size"], T)
device_peak = None
if which == "jspec":
    import jax, jax.numpy as jnp
    import jspec, ports
    from ports.core import layers as LY
    if cache_dir:
        from jspec.core import compilation
        compilation.enable_cache(cache_dir)
    if direct:
        LY.BLOCKWISE_MIN = 10 ** 9
    model = ports.random_model(ports.TextConfig(model_type="llama", **cfg), key=0, std=0.02,
                               dtype=jnp.bfloat16 if dtype == "bf16" else jnp.float32)
    jax.block_until_ready(model.params)
    call = lambda: jspec.decode(model, ids[None], max_new_tokens=2, eos_token_id=(), prefill_chunk=chunk).tokens
    if warm:
        call()
    t0 = time.perf_counter()
    toks = call()[0].tolist()
    stats = jax.devices()[0].memory_stats() or {{}}
    device_peak = stats.get("peak_bytes_in_use")
else:
    import torch, transformers
    torch.manual_seed(0)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    hf_cfg = transformers.LlamaConfig(vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"], num_hidden_layers=cfg["num_layers"],
        num_attention_heads=cfg["num_heads"], num_key_value_heads=cfg["num_kv_heads"],
        max_position_embeddings=cfg["max_position_embeddings"], tie_word_embeddings=cfg["tie_word_embeddings"],
        attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(hf_cfg).to(dev, torch.bfloat16 if dtype == "bf16" else torch.float32).eval()
    def call():
        with torch.no_grad():
            return model.generate(torch.tensor(ids[None], device=dev), max_new_tokens=2, do_sample=False)
    if warm:
        call()
    t0 = time.perf_counter()
    toks = call()[0, T:].tolist()
    if dev == "cuda":
        torch.cuda.synchronize()
        device_peak = torch.cuda.max_memory_allocated()
res = {{"s": time.perf_counter() - t0, "rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}}
if device_peak is not None:
    res["device_gb"] = device_peak / 2**30
print(json.dumps(res))
"""


VIDEO_CHILD = r"""
import json, resource, sys, time, os
os.environ["HF_HUB_OFFLINE"] = "1"
import numpy as np
import jax, jax.numpy as jnp
import jspec, ports
d, n_video, grid_hw, dtype, chunk = {config!r}, {n_video}, {grid_hw!r}, {dtype!r}, {chunk!r}
cfg = ports.model.family(d["model_type"]).config_from_hf(d)
model = ports.random_model(cfg, key=0, std=0.02, dtype=jnp.bfloat16 if dtype == "bf16" else jnp.float32)
jax.block_until_ready(model.params)
v = cfg.vision
h, w = grid_hw                                    # patches per frame side; merged tokens per temporal patch: h w / m^2
per = h * w // v.merge_size ** 2
t = max(1, round(n_video / per))
rng = np.random.default_rng(0)
text = list(rng.integers(3, 1000, 16))
ids = np.array([text[:4] + [d["vision_start_token_id"]] + [d["video_token_id"]] * (t * per)
                + [d["vision_end_token_id"]] + text[4:]], np.int64)
prompt = {{"input_ids": ids, "attention_mask": np.ones_like(ids),
          "pixel_values_videos": rng.normal(size=(t * h * w, v.in_channels * v.temporal_patch_size * v.patch_size ** 2))
          .astype(np.float32),
          "video_grid_thw": np.array([[t, h, w]]), "second_per_grid_ts": np.array([1.0], np.float32),
          "mm_token_type_ids": np.where(ids == d["video_token_id"], 2, 0)}}
t0 = time.perf_counter()
out = jspec.decode(model, prompt, max_new_tokens=2, eos_token_id=(), prefill_chunk=chunk)
res = {{"s": time.perf_counter() - t0, "rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
       "prompt_tokens": int(ids.shape[1]), "video_tokens": int(t * per), "frames": int(2 * t)}}
stats = jax.devices()[0].memory_stats() or {{}}
if stats.get("peak_bytes_in_use") is not None:
    res["device_gb"] = stats["peak_bytes_in_use"] / 2**30
print(json.dumps(res))
"""
# Qwen2.5-VL video prompts: the 7B checkpoint's shape (392 x 784-pixel frames: 28 x 56 patches, 392 tokens per two
# frames) and a tiny one of the same architecture for smoke runs
VIDEO_MODELS = {"qwen2.5-vl-7b": (None, (28, 56)),
                "qwen2.5-vl-tiny": ({"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                                     "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 152064,
                                     "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
                                     "vision_config": {"depth": 2, "hidden_size": 32, "intermediate_size": 64,
                                                       "num_heads": 2, "out_hidden_size": 64,
                                                       "fullatt_block_indexes": [1]}}, (4, 8))}


def video_config(name: str) -> dict:
    """The HF config dict of a VIDEO_MODELS entry (the shipped qwen2.5-vl-7b config, with the tiny overrides)."""
    d = json.loads((Path(__file__).resolve().parent.parent / "configs" / "qwen2.5-vl-7b.json").read_text())
    over = VIDEO_MODELS[name][0] or {}
    return {**d, **{k: x for k, x in over.items() if k != "vision_config"},
            "vision_config": {**d["vision_config"], **over.get("vision_config", {})}}


def run_video(n_video: int, model: str, dtype: str, chunk="auto") -> dict:
    return run_child(VIDEO_CHILD.format(config=video_config(model), n_video=n_video,
                                        grid_hw=VIDEO_MODELS[model][1], dtype=dtype, chunk=chunk))


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
    out = {"s": times[len(times) // 2], "rss_gb": max(r["rss_gb"] for r in runs), "runs_s": [r["s"] for r in runs]}
    if all("device_gb" in r for r in runs):
        out["device_gb"] = max(r["device_gb"] for r in runs)
    return out


def run(T: int, which: str, direct: bool = False, chunk="auto", model: str = "110m", dtype: str = "f32",
        cache_dir: str | None = None, warm: bool = False) -> dict:
    """One point in a fresh process; with `cache_dir`, jspec uses that persistent compilation cache; `warm`: the
    time of a second call (the first, untimed, compiles)."""
    return run_child(CHILD.format(T=T, which=which, direct=direct, cfg=MODELS[model], chunk=chunk,
                                  dtype=dtype, cache_dir=cache_dir, warm=warm))


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    ap.add_argument("--model", choices=sorted(MODELS), default="110m", help="the random LLaMA's shape")
    ap.add_argument("--video", choices=sorted(VIDEO_MODELS), default=None,
                    help="instead: a random Qwen2.5-VL of this shape prefilling a video prompt of --lengths video "
                         "tokens (jspec only; e.g. 12544 = 64 frames of the 7B's 392 x 784 pixels)")
    ap.add_argument("--dtype", choices=DTYPES, default="f32", help="params and activations of both libraries")
    ap.add_argument("--skip-hf", action="store_true", help="jspec only")
    ap.add_argument("--direct", action="store_true", help="also run jspec with the blockwise path off")
    ap.add_argument("--one-pass", action="store_true", help="also run jspec's prefill in one pass (no chunks)")
    ap.add_argument("--compile-cache", action="store_true",
                    help="also run jspec with a warm persistent compilation cache (filled by an untimed run first): "
                         "a later process's first call, which loads the compiled programs instead of compiling")
    ap.add_argument("--warm", action="store_true",
                    help="also time both libraries' second call in a process (compile and first-call costs apart)")
    ap.add_argument("--chunk", type=int, default=None, help="jspec's prefill chunk (default: decode's, 4096)")
    ap.add_argument("--runs", type=int, default=1, help="fresh processes per point and case: median time, max RSS")
    ap.add_argument("--out", default="bench_out/long-prompts",
                    help="writes <out>.json, .md and .png")


def run_bench(args) -> dict:
    """Every (length, case) point, `args.runs` times; writes the JSON, markdown and plot; returns the result."""
    import time

    import jax

    if args.runs < 1 or any(T < 2 for T in args.lengths):
        raise ValueError("--runs must be >= 1 and every length >= 2 tokens")
    if args.video:
        return run_video_bench(args)
    kw = dict(model=args.model, dtype=args.dtype)
    rows = []
    cache_root = tempfile.mkdtemp(prefix="jspec-bench-long-") if args.compile_cache else None
    for T in args.lengths:
        runs = {}
        cache_dir = None
        if cache_root:
            cache_dir = os.path.join(cache_root, str(T))
            run(T, "jspec", chunk=args.chunk or "auto", cache_dir=cache_dir, **kw)  # fills the cache, untimed
        for rep in range(args.runs):  # the cases interleaved, so that each repeat sees the same machine load
            runs.setdefault("jspec", []).append(run(T, "jspec", chunk=args.chunk or "auto", **kw))
            if cache_dir:
                runs.setdefault("jspec_cached", []).append(run(T, "jspec", chunk=args.chunk or "auto",
                                                               cache_dir=cache_dir, **kw))
            if args.one_pass:
                runs.setdefault("jspec_one_pass", []).append(run(T, "jspec", chunk=None, **kw))
            if args.direct:
                runs.setdefault("jspec_direct", []).append(run(T, "jspec", direct=True, **kw))
            if args.warm:
                runs.setdefault("jspec_warm", []).append(run(T, "jspec", chunk=args.chunk or "auto", warm=True, **kw))
            if not args.skip_hf:
                runs.setdefault("transformers", []).append(run(T, "hf", **kw))
                if args.warm:
                    runs.setdefault("transformers_warm", []).append(run(T, "hf", warm=True, **kw))
            print(f"{T} tokens, run {rep + 1}/{args.runs}: "
                  + ", ".join(f"{c} {r[-1].get('s', float('nan')):.1f} s" for c, r in runs.items()), flush=True)
        row = {"tokens": T, **{c: median_run(r) for c, r in runs.items()}}
        rows.append(row)
        print(json.dumps(row), flush=True)
    dev = jax.devices()[0]
    meta = {"date": time.strftime("%Y-%m-%d"), "jax": jax.__version__, "cpus": os.cpu_count(),
            "device": PV.device_model(), "provenance": PV.provenance(), "model": args.model, "config": MODELS[args.model],
            "dtype": args.dtype, "prefill_chunk": args.chunk or "auto (4096)", "runs": args.runs}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    report.write_json(args.out + ".json", {"meta": meta, "rows": rows}, indent=1)
    if cache_root:
        shutil.rmtree(cache_root, ignore_errors=True)
    cols = [c for c in ("jspec", "jspec_cached", "jspec_warm", "jspec_one_pass", "jspec_direct", "transformers",
                        "transformers_warm") if c in rows[0]]
    ratios = [(c, "transformers_warm" if c == "jspec_warm" else "transformers") for c in ("jspec", "jspec_cached",
              "jspec_warm") if c in cols and ("transformers_warm" if c == "jspec_warm" else "transformers") in cols]
    mem = "device_gb" if all("device_gb" in r[c] for r in rows for c in cols) else "rss_gb"
    mem_name = "peak device memory" if mem == "device_gb" else "peak RSS"
    lines = [f"Prefill + 2 new tokens, batch 1, random LLaMA {args.model}, {args.dtype}, {meta['date']}, "
             f"{meta['device']} ({meta['cpus']} CPUs), jax {meta['jax']} "
             f"({'one run' if args.runs == 1 else f'median of {args.runs} runs'} per point, each in a fresh "
             "process; jspec's time includes its compile"
             + ("; jspec_cached: loaded from a warm persistent compilation cache instead" if cache_root else "")
             + ("; *_warm: the second call in a process" if args.warm else "") + ")", ""]
    table = []
    for r in rows:
        t = {"prompt tokens": f"{r['tokens']:,}"}
        t.update({f"{c} time / {mem_name}": f"{r[c]['s']:.1f} s / {r[c][mem]:.2f} GB" if "s" in r[c]
                  else r[c]["error"][:60] for c in cols})
        t.update({f"{c} / {h} time": f"{r[c]['s'] / r[h]['s']:.2f}x" if "s" in r[c] and "s" in r[h] else "-"
                  for c, h in ratios})
        table.append(t)
    lines += report.markdown_table(table)
    report.write_text(args.out + ".md", lines)
    plot(rows, cols, args.out + ".png", mem, mem_name)
    print("\n".join(lines))
    return {"meta": meta, "rows": rows, "markdown": "\n".join(lines),
            "files": [args.out + ext for ext in (".json", ".md", ".png")]}


def run_video_bench(args) -> dict:
    """`--video`: jspec's time and peak memory to prefill video prompts (+ 2 new tokens) on a random Qwen2.5-VL."""
    import time

    import jax

    rows = []
    for n in args.lengths:
        runs = [run_video(n, args.video, args.dtype, args.chunk or "auto") for _ in range(args.runs)]
        row = {"video_tokens": n, "jspec": median_run(runs)}
        row.update({k: runs[0][k] for k in ("prompt_tokens", "video_tokens", "frames") if k in runs[0]})
        rows.append(row)
        print(json.dumps(row), flush=True)
    dev = jax.devices()[0]
    meta = {"date": time.strftime("%Y-%m-%d"), "jax": jax.__version__, "device": PV.device_model(),
            "provenance": PV.provenance(), "video_model": args.video, "dtype": args.dtype, "runs": args.runs,
            "prefill_chunk": args.chunk or "auto (4096)"}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    report.write_json(args.out + ".json", {"meta": meta, "rows": rows}, indent=1)
    mem = "device_gb" if all("device_gb" in r["jspec"] for r in rows) else "rss_gb"
    lines = [f"Video prompt prefill + 2 new tokens, batch 1, random {args.video}, {args.dtype}, {meta['date']}, "
             f"{meta['device']}, jax {meta['jax']} (jspec's time includes its compile and the vision tower)", ""]
    peak = "peak device memory" if mem == "device_gb" else "peak RSS"
    lines += report.markdown_table([{"video tokens": f"{r['video_tokens']:,}", "frames": r.get("frames", "-"),
                                     "prompt tokens": r.get("prompt_tokens", "-"),
                                     "time": f"{r['jspec']['s']:.1f} s" if "s" in r["jspec"]
                                     else r["jspec"]["error"][:60],
                                     peak: f"{r['jspec'][mem]:.2f} GB" if "s" in r["jspec"] else ""} for r in rows])
    report.write_text(args.out + ".md", lines)
    print("\n".join(lines))
    return {"meta": meta, "rows": rows, "markdown": "\n".join(lines), "files": [args.out + ".json", args.out + ".md"]}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_arguments(ap)
    return run_bench(ap.parse_args(argv))


def plot(rows, cols, path, mem: str = "rss_gb", mem_name: str = "peak RSS") -> None:
    with report.figure(path, 1, 2, figsize=(10, 4)) as fa:
        if fa is None:
            return
        axes = fa[1][0]
        for c in cols:
            pts = [(r["tokens"], r[c]) for r in rows if "s" in r[c]]
            axes[0].plot([p[0] for p in pts], [p[1]["s"] for p in pts], "o-", label=c)
            axes[1].plot([p[0] for p in pts], [p[1][mem] for p in pts], "o-", label=c)
        for ax, y in zip(axes, ("seconds (prefill + 2 tokens)", f"{mem_name} (GB)")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("prompt tokens")
            ax.set_ylabel(y)
            ax.grid(alpha=0.3)
            ax.legend()