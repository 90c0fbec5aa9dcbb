"""Benchmarks: `python scripts/bench.py SUITE [--runs 3] [--quick] [--out scripts/results]` (= `jspec bench`).

Suites (see `jspec/tools/bench/zoo.py`): `ar` (greedy AR, jspec vs transformers), `sd` (every strategy on the zoo text pair
and a random pair, with transformers' assisted generation), `gpu` (the same in bf16 on a lent GPU). Writes
`<out>/<suite>-<date>.json`, `.md` and `.png`. Needs the `bench` extra for plots: pip install -e ".[bench]".
"""
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jspec.tools.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
