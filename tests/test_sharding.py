"""Sharded decoding on 8 forced CPU devices (a subprocess: the device count is fixed at jax import): the mesh
(2,4) gives the unsharded greedy tokens for AR, Chain and Tree, and under `-m slow` (8,1) and (1,8) too; params and
the decode cache are really split; an orbax checkpoint saved from one mesh restores onto another with the same
logits; sampling on the (2, 4) mesh draws one device's tokens for the same key (a tree, TABED, SpecVLM); under
`-m slow` sampling on the (2, 4) mesh is exact too (the first four tokens of a depth-3 tree against
exact enumeration, with a negative control)."""
import json
import os
import subprocess
import sys

import pytest


@pytest.mark.parametrize("slow", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["default", "slow"])
def test_sharded_checks(tmp_path, slow):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    here = os.path.dirname(__file__)
    proc = subprocess.run([sys.executable, os.path.join(here, "sharded_checks.py"), str(tmp_path)]
                          + (["--slow"] if slow else []), env=env, capture_output=True, text=True, timeout=900,
                          cwd=os.path.dirname(here))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    dist = results.pop("distribution", None)
    assert results == {"decode_cases": 9 if slow else 3, "placement": 1, "orbax": 1, "sampled_rows": 3,
                       "tp_draft": 1}
    if slow:
        assert dist["pvalue"] > 1e-3 and dist["tv"] <= dist["tv_bound"], dist
