"""Memory-plan exactness, run by tests/test_memory.py in a subprocess with 8 forced CPU devices (the device count is
fixed at jax import): for tiny models and several meshes, the bytes `jspec.tools.memory.estimate` predicts per device for
params, KV cache, draft params and draft cache equal the bytes of the arrays really allocated on device 0.
Prints one JSON line: the compared cases; any mismatch raises."""
import json
import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import ports  # noqa: E402
from jspec.core import prefill as PR  # noqa: E402
from jspec.tools import memory as MEM  # noqa: E402
from jspec.core import sharding as SH  # noqa: E402
from ports.families import llava  # noqa: E402
from ports.core.fused import fused_shapes  # noqa: E402

# (data, fsdp, tensor)
MESHES = ((1, 1, 8), (2, 1, 4), (1, 2, 4), (8, 1, 1))


def zeros_model(cfg, dtype):
    """A model with zero params of the family's param_shapes in the run layout the loaders give (`ports.core.fused`;
    host-built: no per-shape compilation; only the bytes matter here). The plan itself goes through eval_shape of
    init_params, so equal bytes also check that the two agree."""
    fam = ports.model.family(cfg.model_type)
    params = jax.tree.map(lambda s: jnp.asarray(np.zeros(s, dtype)), fused_shapes(cfg, fam.param_shapes(cfg)),
                          is_leaf=lambda x: isinstance(x, tuple))
    return ports.Model(cfg, params, fam.config_to_hf(cfg))


def tiny_llama(layers, hidden, heads, kv_heads, vocab=256, dtype=jnp.bfloat16):
    cfg = ports.text_config_from_hf({"model_type": "llama", "vocab_size": vocab, "hidden_size": hidden,
                                     "intermediate_size": 2 * hidden, "num_hidden_layers": layers,
                                     "num_attention_heads": heads, "num_key_value_heads": kv_heads})
    return zeros_model(cfg, dtype)


def tiny_moe(dtype=jnp.bfloat16):
    """A qwen3_moe of 8 experts (top 2) whose second layer is dense (`mlp_only_layers`)."""
    d = {"model_type": "qwen3_moe", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 96,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
         "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "mlp_only_layers": [1]}
    return zeros_model(ports.model.family("qwen3_moe").config_from_hf(d), dtype)


def tiny_llava(dtype=jnp.bfloat16):
    d = {"model_type": "llava", "image_token_index": 250,
         "text_config": {"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 96,
                         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2},
         "vision_config": {"model_type": "clip_vision_model", "hidden_size": 32, "intermediate_size": 64,
                           "num_hidden_layers": 2, "num_attention_heads": 4, "image_size": 28, "patch_size": 14}}
    return zeros_model(llava.config_from_hf(d), dtype)


def on_device0(tree) -> int:
    """Bytes of the shards of every array in `tree` that live on device 0."""
    dev0 = jax.devices()[0]
    total = 0
    for x in jax.tree.leaves(tree):
        shards = [s for s in x.addressable_shards if s.device == dev0]
        assert len(shards) == 1, (x.shape, x.sharding)
        total += shards[0].data.nbytes
    return total


def nbytes(tree) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(tree))


def check(target, draft, mesh_shape, batch, max_len, dtype, draft_tp=False, expert=1):
    data, fsdp, tensor = mesh_shape
    mesh = SH.make_mesh(data=data, fsdp=fsdp, tensor=tensor, expert=expert)
    placement = SH.Placement(mesh, tuple(SH.rules_table().items()))
    p = MEM.estimate(target.hf_config, dict(data=data, fsdp=fsdp, tensor=tensor, expert=expert), batch, max_len,
                     dtype=dtype,
                draft_config=None if draft is None else draft.hf_config, draft_tensor_parallel=draft_tp)
    c = p["components"]
    sharded = SH.shard(target, mesh)
    real = {"params": (nbytes(sharded.params), on_device0(sharded.params))}
    cache = jax.jit(lambda: placement.constrain_cache(PR.new_cache_for(target, batch, max_len)))()
    real["kv_cache"] = (nbytes(cache), on_device0(cache))
    if draft is not None:
        rep = SH.shard(draft, mesh) if draft_tp else SH.replicate(draft, mesh)
        real["draft_params"] = (nbytes(rep.params), on_device0(rep.params))
        dcache = jax.jit(lambda: placement.constrain_cache(PR.new_cache_for(draft, batch, max_len),
                                                           not draft_tp))()
        real["draft_cache"] = (nbytes(dcache), on_device0(dcache))
    for name, (total, dev0) in real.items():
        got = (c[name]["total"], c[name]["per_device"])
        assert got == (total, dev0), (name, mesh_shape, batch, "plan", got, "allocated", (total, dev0))
    # the split really happened where the rules allow it (not everything replicated)
    if tensor > 1 or expert > 1:
        assert c["params"]["per_device"] < c["params"]["total"], (mesh_shape, c["params"])
    return {"mesh": list(mesh_shape), "expert": expert, "batch": batch, **{k: v[1] for k, v in real.items()}}


def main():
    assert jax.device_count() == 8, jax.devices()
    target = tiny_llama(2, 64, 8, 4)  # kv_heads 4: split over tensor=4, replicated over tensor=8
    draft = tiny_llama(1, 32, 4, 2)
    cases = []
    for mesh_shape in MESHES:
        for batch in (8, 3):  # 3 rows do not divide data=2 / 8: replicated batch
            cases.append(check(target, draft, mesh_shape, batch, 48, "bfloat16"))
    for mesh_shape in ((1, 1, 8), (2, 1, 4)):  # a tensor-parallel draft: params and cache split as allocated
        tp = check(target, draft, mesh_shape, 8, 48, "bfloat16", draft_tp=True)
        rep = next(c for c in cases if c["mesh"] == list(mesh_shape) and c["batch"] == 8)
        assert tp["draft_params"] < rep["draft_params"], (tp, rep)
        cases.append(tp)
    f32 = tiny_llama(2, 64, 8, 8, vocab=264, dtype=jnp.float32)  # f32 params, MHA cache split 8 ways
    cases.append(check(f32, None, (1, 1, 8), 4, 40, "float32"))
    vlm = tiny_llava()
    for mesh_shape in ((1, 1, 8), (2, 1, 4)):
        cases.append(check(vlm, draft, mesh_shape, 4, 32, "bfloat16"))
    moe = tiny_moe()  # its experts split over the expert axis (4), their intermediate over tensor (2)
    for mesh_shape in ((1, 1, 2), (2, 1, 1)):
        cases.append(check(moe, draft, mesh_shape, 4, 32, "bfloat16", expert=4))
    print(json.dumps({"cases": len(cases), "detail": cases}))


if __name__ == "__main__":
    sys.exit(main())
