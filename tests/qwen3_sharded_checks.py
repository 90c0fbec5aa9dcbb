"""Strategies over Qwen3 targets on a mesh, run by tests/test_qwen3_strategies.py in a subprocess with 8 forced CPU
devices (the device count is fixed at jax import): on a (data=2, expert=2, tensor=2) mesh, with the qwen3_moe
target's experts split over `expert` and their width over `tensor`, each strategy of `qwen3_pairs.strategies`
(drafters read from the published layouts) gives the unsharded AR tokens on 4 ragged rows. The default run decodes
`qwen3_pairs.MESH_DEFAULT` on the MoE target; `--slow` the other strategies on it and all of them on the dense
qwen3 target. Prints one JSON line {"placement": 1, "passed": ["kind/name", ...]}; a failed check raises."""
import json
import os
import sys
import tempfile

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jspec  # noqa: E402
from jspec.core import sharding as SH  # noqa: E402
from qwen3_pairs import KINDS, PROMPTS, mesh_names, qwen3_draft, strategies, tiny_target, useful_heads  # noqa: E402
from tolerances import assert_clear_margins  # noqa: E402

MESH = dict(data=2, expert=2, tensor=2)
ROWS = PROMPTS + [PROMPTS[0][:3]]  # 4 rows: the data axis splits the batch


def check_placement(target) -> int:
    """The MoE layers' experts split over `expert` (4 of 8 per device) and their width over `tensor`."""
    layer = SH.shard(target, jspec.make_mesh(**MESH)).params["layers"][1]
    assert layer["we_gate"].sharding.spec == P("expert", None, "tensor"), layer["we_gate"].sharding
    assert layer["we_gate"].addressable_shards[0].data.shape == (4, 64, 16)
    assert layer["we_down"].sharding.spec == P("expert", "tensor", None)
    return 1


def main():
    assert jax.device_count() == 8, jax.devices()
    slow = "--slow" in sys.argv
    want = mesh_names(slow)
    mesh = jspec.make_mesh(**MESH)
    passed, placement = [], 0
    with tempfile.TemporaryDirectory() as tmp:
        for kind in KINDS:
            names = [c.split("/")[1] for c in want if c.startswith(kind + "/")]
            if not names:
                continue
            target = tiny_target(kind)
            if kind == "qwen3_moe":
                placement = check_placement(target)
            kw = dict(max_new_tokens=12, eos_token_id=())
            ar = jspec.decode(target, ROWS, **kw).tokens
            assert_clear_margins(target, ROWS, ar)
            strats = strategies(qwen3_draft(target), useful_heads(target, os.path.join(tmp, kind)))
            for name in names:
                out = jspec.decode(target, ROWS, strategy=strats[name], mesh=mesh, **kw)
                np.testing.assert_array_equal(out.tokens, ar, err_msg=f"{kind}/{name}")
                passed.append(f"{kind}/{name}")
                jax.clear_caches()
    print(json.dumps({"placement": placement, "passed": passed}))


if __name__ == "__main__":
    main()
