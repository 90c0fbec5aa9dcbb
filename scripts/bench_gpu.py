"""Every GPU measurement in one command of budgeted steps: the same as `jspec bench gpu` (see `jspec/tools/bench/gpu.py`).

    python scripts/bench_gpu.py                 # on a GPU: scripts/results/gpu-<date>.{json,md,png}
    python scripts/bench_gpu.py --dry-run       # every step on the CPU at tiny shapes, into a temporary directory
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from jspec.tools.bench import gpu as bench_gpu  # noqa: E402

if __name__ == "__main__":
    result = bench_gpu.main()
    sys.exit(0 if all(s["status"] in ("ok", "partial") for s in result["steps"].values()) else 1)
