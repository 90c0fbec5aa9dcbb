"""The kernels' bit-for-bit promises hold on other instruction sets than this CPU's: the library built, where this
CPU runs AVX-512, for `skylake-avx512` (whose builds broke them while floating-point contraction was on) and, under
`-m slow`, for `x86-64-v3` (AVX2 + FMA), in a subprocess, then the tests that compare a row computed alone with the
same row among others."""
import os
import subprocess
import sys

import pytest

from ports.cpu import library

HERE = os.path.dirname(__file__)
BIT_FOR_BIT = "neighbour or one_token_steps"


def _cpu_flags() -> set:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


FLAGS = _cpu_flags() if os.path.exists("/proc/cpuinfo") else set()
TARGETS = [pytest.param("x86-64-v3", marks=[pytest.mark.slow,
                                            pytest.mark.skipif(not {"avx2", "fma"} <= FLAGS, reason="no AVX2")]),
           pytest.param("skylake-avx512", marks=pytest.mark.skipif(
               not {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd"} <= FLAGS, reason="no AVX-512"))]


@pytest.mark.parametrize("march", TARGETS)
def test_rows_are_independent_built_for(march, tmp_path):
    env = dict(os.environ, **{library.MARCH_ENV: march, library.DIR_ENV: str(tmp_path)})
    files = [os.path.join(HERE, f) for f in ("test_cpu_dot.py", "test_cache_attention.py", "test_packed_weights.py")]
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", BIT_FOR_BIT, *files],
                          env=env, capture_output=True, text=True, cwd=os.path.dirname(HERE))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout.splitlines()[-1], done.stdout[-500:]
    assert os.listdir(tmp_path), "the library was not built for the target"
