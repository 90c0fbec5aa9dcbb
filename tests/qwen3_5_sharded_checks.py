"""Strategies over the tiny Qwen3.5 targets on a mesh, run by tests/test_qwen3_5.py in a subprocess with 8 forced
CPU devices: on a (data=2, expert=2, tensor=2) mesh, the gated attention's heads split over `tensor`, the MoE's
experts over `expert`, the recurrent state's rows over `data`; each strategy gives the unsharded AR tokens on 4
ragged rows (a chain on the dense target by default; every strategy, and a chain on the MoE target, with --slow).
Prints one JSON line {"passed": [...]}; a failed check raises."""
import json
import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jspec  # noqa: E402
import ports  # noqa: E402
from jspec.core import sharding as SH  # noqa: E402
from ports.families import qwen3_5 as Q5  # noqa: E402
from test_qwen3_5 import KINDS, PROMPTS, STRATEGIES, damped_pair  # noqa: E402

ROWS = PROMPTS + [PROMPTS[0][:3]]
DEFAULT = ("chain",)


def main():
    assert jax.device_count() == 8, jax.devices()
    names = sorted(STRATEGIES) if "--slow" in sys.argv else DEFAULT
    mesh = jspec.make_mesh(data=2, expert=2, tensor=2)
    target, draft, _ = damped_pair()
    layer = SH.shard(target, mesh).params["layers"][3]
    assert layer["wqg"].sharding.spec == P(None, "tensor"), layer["wqg"].sharding
    moe = ports.random_model(Q5.config_from_hf({**KINDS["moe"], "model_type": "qwen3_5_moe_text"}), key=2, std=0.3)
    assert SH.shard(moe, mesh).params["layers"][0]["we_gate"].sharding.spec[0] == "expert"
    passed = []
    slow = "--slow" in sys.argv
    for kind, model in (("dense", target), ("moe", moe)) if slow else (("dense", target),):
        ar = jspec.decode(model, ROWS, max_new_tokens=12, eos_token_id=()).tokens
        for name in names if kind == "dense" else ("chain",):
            out = jspec.decode(model, ROWS, strategy=STRATEGIES[name](model, draft), max_new_tokens=12,
                               eos_token_id=(), mesh=mesh)
            np.testing.assert_array_equal(out.tokens, ar, err_msg=f"{kind}/{name}")
            passed.append(f"{kind}/{name}")
    print(json.dumps({"passed": passed}))


if __name__ == "__main__":
    main()
