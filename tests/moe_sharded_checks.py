"""Mixture-of-experts sharding checks, run by tests/test_qwen3_moe.py in a subprocess with 8 forced CPU devices
(the device count is fixed at jax import): a tiny qwen3_moe's experts split over the `expert` mesh axis (and
their intermediate dimension over `tensor`); its logits on two meshes, with the grouped matmul as tiles and as
`ragged_dot`, equal the unsharded ones; greedy AR and Chain decoding on a data x expert x tensor mesh give the
unsharded tokens. Prints one JSON line of results; any failed check raises."""
import json
import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import dataclasses  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jspec  # noqa: E402
import ports  # noqa: E402
from jspec.core import sharding as SH  # noqa: E402
from ports.core import moe  # noqa: E402
from tolerances import assert_clear_margins, assert_layout_close  # noqa: E402

MESHES = (dict(data=2, expert=2, tensor=2), dict(expert=8))


def tiny_moe():
    """(target, draft): a 3-layer qwen3_moe (8 experts, top 2, layer 1 dense) and its first layer as the draft."""
    cfg = ports.model.family("qwen3_moe").config_from_hf({
        "model_type": "qwen3_moe", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "mlp_only_layers": [1],
        "norm_topk_prob": True, "eos_token_id": None})
    target = ports.random_model(cfg, 0, std=0.3)
    draft = ports.Model(dataclasses.replace(cfg, num_layers=1),
                        {**target.params, "layers": target.params["layers"][:1]})
    return target, draft


def prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(1, 256, int(rng.integers(3, 12))) for _ in range(4)]


def check_placement(target) -> int:
    sharded = SH.shard(target, SH.make_mesh(expert=4, tensor=2))
    layer = sharded.params["layers"][0]
    assert layer["we_gate"].sharding.spec == P("expert", None, "tensor"), layer["we_gate"].sharding
    assert layer["we_gate"].addressable_shards[0].data.shape == (2, 64, 16)
    assert layer["we_down"].sharding.spec == P("expert", "tensor", None)
    assert layer["router"].sharding.spec == P(None, None)
    assert "we_gate" not in sharded.params["layers"][1] and "w_gate_up" in sharded.params["layers"][1]
    return 1


def check_logits(target) -> int:
    ids = np.stack([np.resize(p, 11) for p in prompts()])
    ref = ports.logits(target, ids)
    cases = 0
    for shape in MESHES:
        sharded = SH.shard(target, SH.make_mesh(**shape))
        for how in ("tiled", "ragged"):
            moe.GROUPED = how
            jax.clear_caches()  # the grouped matmul is chosen when the forward is traced
            got = ports.logits(sharded, ids)
            assert_layout_close(got, ref, reduction=96, depth=3, err_msg=f"{shape} {how}")
            cases += 1
    moe.GROUPED = "auto"
    jax.clear_caches()
    return cases


def check_decode(target, draft) -> int:
    kw = dict(max_new_tokens=10, eos_token_id=())
    ar = jspec.decode(target, prompts(), **kw).tokens
    assert_clear_margins(target, prompts(), ar)
    mesh = SH.make_mesh(**MESHES[0])
    for name, strat in (("ar", jspec.AR()), ("chain", jspec.Chain(draft, gamma=3))):
        got = jspec.decode(target, prompts(), strat, mesh=mesh, **kw).tokens
        np.testing.assert_array_equal(got, ar, err_msg=name)
    return 2


def main():
    assert jax.device_count() == 8, jax.devices()
    target, draft = tiny_moe()
    print(json.dumps({"placement": check_placement(target), "logits": check_logits(target),
                      "decode": check_decode(target, draft)}))


if __name__ == "__main__":
    main()
