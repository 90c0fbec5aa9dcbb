"""Multi-controller decoding: two processes of 4 CPU devices each (jax.distributed over localhost, gloo) decode
on a (data 2, tensor 4) mesh spanning both, every process passing the same prompts and getting the same tokens as
one process decoding alone, greedy and sampled; a target restored from a `jspec convert` checkpoint onto that mesh
(each process reading its shards) too; a mesh larger than the devices and hosts passing different prompts are
clear errors. AR, Chain, Tree, SAGE and EESD by default; DynamicTree under -m slow."""
import numpy as np
import pytest

import jspec
import ports
from multihost import launch
from multihost_cases import CASES, SAMPLED, pair

DEFAULT = ["ar", "chain", "tree", "sage", "eesd"]


def _single(names):
    target, draft, prompts = pair()
    want = {}
    for name in names:
        strat = CASES[name](target, draft)
        for label, kw in (("greedy", {}), ("sampled", SAMPLED)):
            want[f"{name}/{label}"] = jspec.decode(target, prompts, strat, max_new_tokens=10, eos_token_id=(),
                                                   **kw).tokens.tolist()
    return want


@pytest.mark.parametrize("names", [DEFAULT, pytest.param(["dynamic"], marks=pytest.mark.slow)],
                         ids=["default", "slow"])
def test_two_processes_decode_the_tokens_of_one(names, tmp_path):
    ckpt = None
    if names == DEFAULT:
        ckpt = str(tmp_path / "ckpt")
        ports.save(pair()[0], ckpt)  # what `jspec convert` writes
    results = launch(names + (["--ckpt", ckpt, "--bad"] if ckpt else []), timeout=900)
    bad = [r.pop("bad", None) for r in results]
    assert results[0] == results[1]  # every process gets the whole output
    assert results[0] == _single(names)
    if ckpt:
        for i, b in enumerate(bad):
            assert b["mesh"] == "mesh data=4 x fsdp=1 x tensor=8 needs 32 devices; 8 available"
            assert b["prompts"].startswith(f"the processes passed different prompts (process {i} of 2)")
