"""The Qwen2.5-VL vision tower on large frames: time and peak memory of window layers that gather their windows
against the same layers run as full per-frame attention (what a window layer costs when it is computed as a masked
[L, L] product), on a tower of Qwen2.5-VL-7B's width, heads, window and patch geometry with fewer blocks.

    python scripts/bench_vision_tower.py                       # writes scripts/results/vision-tower.{json,md}
    python scripts/bench_vision_tower.py --sizes 448 --frames 8 --depth 8

Each point runs in a fresh process (peak RSS is the process's); time is the median of 3 warm calls. The full-attention
variant holds a frame's [L, L] scores per block: 16 heads x 4,096^2 x 4 bytes = 1.07 GB for an 896-pixel frame.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from jspec.tools.bench.long import run_child  # noqa: E402

CHILD = r"""
import json, resource, sys, time
sys.path.insert(0, {root!r})
import jax, jax.numpy as jnp, numpy as np
from ports import qwen2_vl_vision as QV
size, frames, depth, windowed = {size}, {frames}, {depth}, {windowed}
full = (0,) if windowed else tuple(range(depth))  # block 0 full, the rest windows (or all full)
cfg = QV.QwenVisionConfig("qwen2_5_vl", depth=depth, width=1280, mlp_dim=3420, num_heads=16, out_dim=3584,
                          hidden_act="silu", patch_size=14, merge_size=2, window_size=112, fullatt_blocks=full)
params = QV.init_params(cfg, jax.random.key(0))
g = size // 14
items = [(np.random.default_rng(i).normal(size=(g * g, cfg.patch_dim)).astype(np.float32), (1, g, g))
         for i in range(frames)]
lay = QV.frame_layout(cfg, items)
args = [jnp.asarray(a) for a in (lay.patches, lay.rot, lay.valid, lay.window_index, lay.window_slot)]
fn = jax.jit(lambda p, *a: QV.forward(cfg, p, *a).merged)
fn(params, *args).block_until_ready()
times = []
for _ in range(3):
    t0 = time.perf_counter()
    fn(params, *args).block_until_ready()
    times.append(time.perf_counter() - t0)
print(json.dumps({{"s": sorted(times)[1], "rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
                  "patches_per_frame": g * g}}))
"""


def run(size: int, frames: int, depth: int, windowed: bool) -> dict:
    return run_child(CHILD.format(root=str(ROOT), size=size, frames=frames, depth=depth, windowed=windowed))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[448, 896])
    ap.add_argument("--frames", type=int, default=2)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--out", default=str(ROOT / "scripts" / "results" / "vision-tower"))
    a = ap.parse_args(argv)
    rows = []
    for size in a.sizes:
        for windowed in (True, False):
            r = run(size, a.frames, a.depth, windowed)
            r.update(size=size, windowed=windowed)
            print(json.dumps(r), flush=True)
            rows.append(r)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out + ".json").write_text(json.dumps({"frames": a.frames, "depth": a.depth, "rows": rows}, indent=1))
    lines = [f"Qwen2.5-VL-7B-shaped tower (width 1280, 16 heads, window 112 px, patch 14), {a.depth} blocks (block 0 "
             f"full attention), {a.frames} frames of size x size pixels, f32, this CPU; median of 3 warm calls.", "",
             "| frame | patches / frame | windows gathered: time / peak RSS | as full attention: time / peak RSS |",
             "|---|---|---|---|"]
    for size in a.sizes:
        w, f = (next(r for r in rows if r["size"] == size and r["windowed"] == x) for x in (True, False))
        cell = lambda r: r["error"] if "error" in r else f"{r['s']:.2f} s / {r['rss_gb']:.2f} GB"  # noqa: E731
        lines.append(f"| {size} px | {w.get('patches_per_frame', '')} | {cell(w)} | {cell(f)} |")
    Path(a.out + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
