"""Long prompts: prefill time and peak memory against prompt length for jspec and transformers (SDPA) on a random
LLaMA; the same as `jspec bench long` (options and output: `jspec.tools.bench.long`).

    python scripts/bench_long.py                             # 1k, 2k, 4k, 8k; writes scripts/results/long-prompts.*
    python scripts/bench_long.py --lengths 1024 8192 16384 --skip-hf
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jspec.tools.bench import long as bench_long  # noqa: E402

if __name__ == "__main__":
    bench_long.main()
