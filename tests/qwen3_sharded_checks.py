"""Strategies over Qwen3 and Muse Glimmer targets on a mesh, run by tests/test_qwen3_strategies.py and
tests/test_muse_glimmer_strategies.py in a subprocess with 8 forced CPU devices (the device count is fixed at jax
import): on a (data=2, expert=2, tensor=2) mesh each strategy gives the unsharded AR tokens on 4 ragged rows.

Qwen3 (the default): the qwen3_moe target's experts split over `expert` and their width over `tensor`; each
strategy of `qwen3_pairs.strategies` (drafters read from the published layouts). The default run decodes
`qwen3_pairs.MESH_DEFAULT` on the MoE target; `--slow` the other strategies on it and all of them on the dense
qwen3 target.

`--muse-glimmer TARGET_DIR HEAD_DIR`: the Muse Glimmer checkpoint in TARGET_DIR (its attention gate split by query
heads over `tensor`, as `wq`) with `qwen3_pairs.model_and_block`'s strategies over its one-layer draft and the
assistant-layout head in HEAD_DIR: `qwen3_pairs.MUSE_MESH_DEFAULT`, or with `--slow` the other MUSE_NAMES.

Prints one JSON line {"placement": 1, "passed": ["kind/name", ...]}; a failed check raises."""
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
import ports  # noqa: E402
from jspec.core import sharding as SH  # noqa: E402
from jspec.parts.drafters import dflash_io  # noqa: E402
from qwen3_pairs import (KINDS, PROMPTS, mesh_names, model_and_block, muse_glimmer_draft, qwen3_draft,  # noqa: E402
                         strategies, tiny_target, useful_heads)
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


def check_muse_placement(target) -> int:
    """Each layer's attention gate split by query heads over `tensor` (half its columns per device), as `wqkv` by
    KV-head groups."""
    layer = SH.shard(target, jspec.make_mesh(**MESH)).params["lm"]["layers"][0]
    gate = layer["w_attn_gate"]
    assert gate.sharding.spec == P(None, "tensor"), gate.sharding
    assert gate.addressable_shards[0].data.shape == (gate.shape[0], gate.shape[1] // 2)
    assert layer["wqkv"].sharding.spec[1] == "tensor", layer["wqkv"].sharding
    return 1


def check_strategies(kind: str, target, rows, strats: dict, names) -> list[str]:
    """Each of `names` decodes `rows` on the mesh to the unsharded AR tokens (whose greedy margins are clear);
    returns the "kind/name" cases passed."""
    mesh = jspec.make_mesh(**MESH)
    kw = dict(max_new_tokens=12, eos_token_id=())
    ar = jspec.decode(target, rows, **kw).tokens
    assert_clear_margins(target, rows, ar)
    passed = []
    for name in names:
        out = jspec.decode(target, rows, strategy=strats[name], mesh=mesh, **kw)
        np.testing.assert_array_equal(out.tokens, ar, err_msg=f"{kind}/{name}")
        passed.append(f"{kind}/{name}")
        jax.clear_caches()
    return passed


def qwen3(slow: bool) -> tuple[int, list[str]]:
    want = mesh_names(slow)
    passed, placement = [], 0
    with tempfile.TemporaryDirectory() as tmp:
        for kind in KINDS:
            names = [c.split("/")[1] for c in want if c.startswith(kind + "/")]
            if not names:
                continue
            target = tiny_target(kind)
            if kind == "qwen3_moe":
                placement = check_placement(target)
            strats = strategies(qwen3_draft(target), useful_heads(target, os.path.join(tmp, kind)))
            passed += check_strategies(kind, target, ROWS, strats, names)
    return placement, passed


def muse_glimmer(target_dir: str, head_dir: str, slow: bool) -> tuple[int, list[str]]:
    target = ports.load_hf(target_dir)
    placement = check_muse_placement(target)
    strats = model_and_block(muse_glimmer_draft(target), dflash_io.load_head(head_dir, target))
    names = [c.split("/")[1] for c in mesh_names(slow, "muse_glimmer")]
    return placement, check_strategies("muse_glimmer", target, ROWS, strats, names)


def main():
    assert jax.device_count() == 8, jax.devices()
    slow = "--slow" in sys.argv
    if "--muse-glimmer" in sys.argv:
        i = sys.argv.index("--muse-glimmer")
        placement, passed = muse_glimmer(sys.argv[i + 1], sys.argv[i + 2], slow)
    else:
        placement, passed = qwen3(slow)
    print(json.dumps({"placement": placement, "passed": passed}))


if __name__ == "__main__":
    main()
