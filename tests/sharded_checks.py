"""Sharded decoding checks, run by tests/test_sharding.py in a subprocess with 8 forced CPU devices (the device
count must be set before jax is imported). Prints one JSON line of results; any failed check raises."""
import json
import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jspec  # noqa: E402
import ports  # noqa: E402
from jspec import api  # noqa: E402
from jspec.engine import loop
from jspec.core import sampling as SM  # noqa: E402
from jspec.core import sharding as SH  # noqa: E402
from tolerances import assert_clear_margins, assert_layout_close  # noqa: E402

MESHES = ((2, 4),)  # (data, tensor)
SLOW_MESHES = ((8, 1), (1, 8))  # with --slow: eight-way data and tensor parallel too


def tiny(layers, hidden, heads, kv_heads, seed):
    cfg = ports.text_config_from_hf({"model_type": "llama", "vocab_size": 256, "hidden_size": hidden,
                                     "intermediate_size": 2 * hidden, "num_hidden_layers": layers,
                                     "num_attention_heads": heads, "num_key_value_heads": kv_heads,
                                     "eos_token_id": None})
    return ports.random_model(cfg, seed, std=0.5)


def prompts(n=8):
    rng = np.random.default_rng(0)
    return [rng.integers(1, 256, int(rng.integers(3, 12))) for _ in range(n)]


def strategies(draft):
    return {"ar": jspec.AR(), "chain": jspec.Chain(draft, gamma=3), "tree": jspec.Tree(draft, tree="mc_sim_7b_63")}


def check_decode(target, draft, meshes=MESHES):
    ref = {k: jspec.decode(target, prompts(), s, max_new_tokens=12, eos_token_id=()).tokens
           for k, s in strategies(draft).items()}
    assert all(np.array_equal(ref["ar"], v) for v in ref.values())
    assert_clear_margins(target, prompts(), ref["ar"])  # exact equality below is not at the mercy of rounding
    for data, tensor in meshes:
        mesh = SH.make_mesh(data=data, tensor=tensor)
        for k, s in strategies(draft).items():
            out = jspec.decode(target, prompts(), s, max_new_tokens=12, eos_token_id=(), mesh=mesh)
            assert np.array_equal(out.tokens, ref[k]), (data, tensor, k)
    return len(meshes) * 3


def check_placement(target):
    mesh = SH.make_mesh(data=2, tensor=4)
    sharded = SH.shard(target, mesh)
    layer = sharded.params["layers"][0]
    hd = target.config.head_dim
    # fused q/k/v (`ports.core.fused`): each device holds whole KV-head groups, 4 groups of 2 query heads + k + v
    assert layer["wqkv"].sharding.spec == P(None, "tensor", None, None), layer["wqkv"].sharding
    assert layer["wqkv"].addressable_shards[0].data.shape == (target.config.hidden_size, 1, 2 + 2, hd)
    assert layer["wo"].sharding.spec == P("tensor", None)
    assert layer["w_gate_up"].sharding.spec == P(None, None, "tensor")
    assert layer["w_down"].addressable_shards[0].data.shape[0] == target.config.intermediate_size // 4
    assert sharded.params["embed"].addressable_shards[0].data.shape[0] == 256 // 4
    assert layer["attn_norm"].sharding.spec == P()
    # kv_heads=4 over tensor=8 does not divide: replicated, not split inside a head
    wide = SH.shard(target, SH.make_mesh(tensor=8))
    # ... so q/k/v go back to separate matrices there: wq still splits by heads (`sharding.run_layout`)
    wl = wide.params["layers"][0]
    assert "wqkv" not in wl and "w_gate_up" in wl
    assert wl["wk"].sharding.spec == P(None, None)
    assert wl["wq"].sharding.spec == P(None, "tensor")

    # the decode state's target cache: batch over data, kv heads over tensor
    ctx = loop.StepContext(max_new=4, max_steps=3, out_len=5, eos=(), sampling=SM.SamplingConfig(),
                           placement=SH.Placement(mesh, tuple(SH.rules_table().items())))
    toks = np.ones((8, 16), np.int32)
    lens = np.full((8,), 5, np.int32)
    _, sp = SM.make_sampling(0.0, None, None)
    state = api._prefill_ar(ctx, 64, sharded, toks, lens, {}, jax.random.key(0), sp)
    state = api._decode_ar(ctx, sharded, state)
    k0 = state.cache.k[0]
    assert k0.sharding.spec[0] == ("data", "tensor"), k0.sharding.spec       # flat rows b * KVH + h
    assert k0.addressable_shards[0].data.shape == (4 * 1, 64, hd), k0.addressable_shards[0].data.shape
    return 1


def check_orbax(target, tmp):
    a = SH.shard(target, SH.make_mesh(data=2, tensor=4))
    ports.save(a, tmp)
    mesh_b = SH.make_mesh(tensor=8)
    restored = ports.load(tmp, shardings=SH.param_shardings(target, mesh_b))
    gu = restored.params["layers"][0]["w_gate_up"]
    assert gu.sharding.mesh.shape["tensor"] == 8 and gu.sharding.spec == P(None, None, "tensor")
    ids = np.array([[3, 5, 7, 9, 11]])
    # another mesh sums every layer's products in another order: a bound that follows float32 and the longest
    # reduction (the MLP's), not a fixed tolerance
    assert_layout_close(ports.logits(restored, ids), ports.logits(target, ids),
                        reduction=target.config.intermediate_size, depth=target.config.num_layers)
    return 1


def check_distribution():
    """Exact sampling on a (2, 4) mesh (rows over data, heads and vocabulary over tensor): the first four tokens of
    20k rows of a depth-3 tree at T 0.8 + top-k 4 follow the target's exact joint; the same counts do not fit the
    joint without top-k (the negative control)."""
    sys.path.insert(0, os.path.dirname(__file__))
    from sampling_check import check, close_pair, exact_joint, joint_index

    cfg = ports.TextConfig(model_type="llama", vocab_size=8, hidden_size=32, intermediate_size=32, num_layers=1,
                           num_heads=4, num_kv_heads=4, head_dim=8)
    target, draft = close_pair(cfg)
    n, rows, warpers = 4, 20000, dict(temperature=0.8, top_k=4)
    mesh = SH.make_mesh(data=2, tensor=4)
    tree = jspec.Tree(draft, tree=[[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
    out = jspec.decode(target, np.tile([1, 4, 2], (rows, 1)), tree, max_new_tokens=n, key=jax.random.key(2),
                       eos_token_id=(), mesh=mesh, **warpers)
    depth = np.asarray(out.stats["accepted"])[:, 0]
    assert (depth >= 3).sum() >= 200 and (depth == 1).sum() >= 200, np.bincount(depth)
    counts = np.bincount(joint_index(out.tokens, n, 8), minlength=8 ** n)
    pval, tv, bound = check(counts, exact_joint(target, n, np.array([1, 4, 2]), **warpers))
    check(counts, exact_joint(target, n, np.array([1, 4, 2]), temperature=0.8), exact=False)
    return {"pvalue": round(pval, 4), "tv": round(tv, 4), "tv_bound": round(bound, 4)}


def check_sampled_rows() -> int:
    """Sampling on a (2, 4) mesh draws the tokens one device draws with the same key (each row's randomness is its
    own, whatever the layout), so the single-device exactness tests carry over: a depth-3 tree on text, TABED's
    views and SpecVLM's pruned draft on image prompts, at a temperature (plus top-k for the tree)."""
    sys.path.insert(0, os.path.dirname(__file__))
    from sampling_check import IMAGE_PROMPT, PIXELS, close_pair, tiny_llava

    cfg = ports.TextConfig(model_type="llama", vocab_size=8, hidden_size=32, intermediate_size=32, num_layers=1,
                           num_heads=4, num_kv_heads=4, head_dim=8)
    target, draft = close_pair(cfg)
    t_vlm, d_vlm = tiny_llava(10, 0.4), tiny_llava(11, 0.6)
    pix = np.random.default_rng(3).normal(size=(64,) + PIXELS.shape[1:]).astype(np.float32)
    cases = [(target, np.tile([1, 4, 2], (512, 1)), jspec.Tree(draft, tree=[[0], [1], [0, 0], [0, 1], [1, 0],
                                                                          [0, 0, 0]]), dict(top_k=4)),
             (t_vlm, {"input_ids": np.tile(IMAGE_PROMPT, (64, 1)), "pixel_values": pix},
              jspec.TABED(d_vlm, views=("M", "T", "P"), weights=(0.2, 0.5, 0.3), newline_id=3, gamma=3), {}),
             (t_vlm, {"input_ids": np.tile(IMAGE_PROMPT, (64, 1)), "pixel_values": pix},
              jspec.SpecVLM(d_vlm, ratio=0.5, modality="image", tree=[[0], [1], [0, 0], [0, 0, 0]]), {})]
    mesh = SH.make_mesh(data=2, tensor=4)
    for model, prompt, strat, warp in cases:
        kw = dict(max_new_tokens=6, key=jax.random.key(2), eos_token_id=(), temperature=0.8, **warp)
        one = jspec.decode(model, prompt, strat, **kw)
        sharded = jspec.decode(model, prompt, strat, mesh=mesh, **kw)
        first = np.asarray(one.stats["accepted"])[:, 0]
        assert (first == 1).any() and (first >= 3).any(), (type(strat).__name__, np.bincount(first))
        np.testing.assert_array_equal(sharded.tokens, one.tokens, err_msg=type(strat).__name__)
    return len(cases)


def check_tensor_parallel_draft(target, draft) -> int:
    """A draft passed sharded over the mesh (`jspec.shard(draft, mesh)`) stays split: its params over the tensor
    axis, its cache as the target's; it decodes the tokens of the replicated draft, greedy and sampled."""
    mesh = SH.make_mesh(data=2, tensor=4)
    tp = SH.shard(draft, mesh)
    for kw in ({}, dict(temperature=1.0, key=jax.random.key(4))):
        for make in (lambda d: jspec.Chain(d, gamma=3), lambda d: jspec.Tree(d, tree=[[0], [1], [0, 0]])):
            want = jspec.decode(target, prompts(), make(draft), max_new_tokens=12, eos_token_id=(), mesh=mesh, **kw)
            got = jspec.decode(target, prompts(), make(tp), max_new_tokens=12, eos_token_id=(), mesh=mesh, **kw)
            np.testing.assert_array_equal(got.tokens, want.tokens)
            np.testing.assert_array_equal(got.stats["accepted"], want.stats["accepted"])
    s = jspec.api.start(target, prompts(), jspec.Chain(tp, gamma=3), max_new_tokens=8, mesh=mesh)
    assert s.parts.drafter.tensor_parallel
    wq = s.parts.drafter.model.params["layers"][0]
    assert any("tensor" in str(x.sharding.spec) for x in jax.tree.leaves(wq)), jax.tree.map(lambda x: x.sharding, wq)
    k = s.state.aux.draft.cache.k[0]
    assert k.sharding.spec != P() and k.addressable_shards[0].data.shape[0] < k.shape[0], k.sharding  # as the
    # target's: rows over data (this draft's 2 kv heads do not divide the 4-way tensor axis)
    r = jspec.api.start(target, prompts(), jspec.Chain(draft, gamma=3), max_new_tokens=8, mesh=mesh)
    assert not r.parts.drafter.tensor_parallel and r.state.aux.draft.cache.k[0].sharding.spec == P()
    return 1


def main(tmp, slow=False):
    assert jax.device_count() == 8, jax.devices()
    target = tiny(2, 64, 8, 4, 0)
    draft = tiny(1, 32, 4, 2, 1)
    results = {"decode_cases": check_decode(target, draft, MESHES + (SLOW_MESHES if slow else ())),
               "placement": check_placement(target), "orbax": check_orbax(target, os.path.join(tmp, "ckpt")),
               "sampled_rows": check_sampled_rows(), "tp_draft": check_tensor_parallel_draft(target, draft)}
    if slow:
        results["distribution"] = check_distribution()
    print(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1], slow="--slow" in sys.argv[2:])
