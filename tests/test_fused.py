"""The run layout (`ports.core.fused`): fused q/k/v and gate/up give the checkpoint layout's outputs, convert both ways
exactly, and are what the loaders return."""
import jax
import numpy as np
import pytest

import ports
from conftest import save_and_load, tiny_hf
from ports.core import fused as FU

TOKENS = np.random.default_rng(0).integers(0, 101, (2, 12))


def _cfg(**over):
    base = dict(model_type="qwen2", vocab_size=101, hidden_size=48, intermediate_size=40, num_layers=2,
                num_heads=6, num_kv_heads=2, head_dim=8, qkv_bias=True, o_bias=True, mlp_bias=True)
    return ports.TextConfig(**{**base, **over})


def _separate(cfg, seed=0):
    return ports.family(cfg.model_type).init_params(cfg, jax.random.key(seed), std=0.3)


def _equal(a, b) -> bool:
    la, lb = jax.tree_util.tree_flatten_with_path(a)[0], jax.tree_util.tree_flatten_with_path(b)[0]
    return [p for p, _ in la] == [p for p, _ in lb] and all(np.array_equal(x, y) for (_, x), (_, y) in zip(la, lb))


@pytest.mark.parametrize("heads,kv", [(6, 2), (4, 4), (6, 1)])
def test_fused_forward_equals_separate(heads, kv):
    cfg = _cfg(num_heads=heads, num_kv_heads=kv)
    sep = _separate(cfg)
    fused = FU.fuse_params(cfg, sep)
    layer = fused["layers"][0]
    assert set(layer) >= {"wqkv", "bqkv", "w_gate_up", "b_gate_up"} and not set(layer) & {"wq", "wk", "w_gate"}
    assert layer["wqkv"].shape == (48, kv, heads // kv + 2, 8)
    # query head h reads KV head h // G: the fused groups must keep wq's column order
    G = heads // kv
    for h in range(heads):
        np.testing.assert_array_equal(layer["wqkv"][:, h // G, h % G], sep["layers"][0]["wq"][:, h * 8:(h + 1) * 8])
    ref = ports.logits(ports.Model(cfg, sep), TOKENS)
    np.testing.assert_allclose(ports.logits(ports.Model(cfg, fused), TOKENS), ref, rtol=1e-5, atol=1e-5)
    half = FU.unfuse_params(cfg, fused, mlp=False)  # what sharding.run_layout makes when KV heads cannot split
    assert "wq" in half["layers"][0] and "w_gate_up" in half["layers"][0]
    np.testing.assert_allclose(ports.logits(ports.Model(cfg, half), TOKENS), ref, rtol=1e-5, atol=1e-5)


def test_round_trips_are_exact():
    cfg = _cfg()
    sep = _separate(cfg, 1)
    fused = FU.fuse_params(cfg, sep)
    assert _equal(FU.unfuse_params(cfg, fused), sep)
    assert _equal(FU.fuse_params(cfg, fused), fused)  # idempotent
    assert _equal(FU.fuse_params(cfg, FU.unfuse_params(cfg, fused, mlp=False)), fused)  # from a half-fused layer
    host = FU.fuse_params(cfg, jax.tree.map(np.asarray, sep))  # the loaders fuse numpy on the host
    assert _equal(host, fused)
    shapes = FU.fused_shapes(cfg, ports.family("qwen2").param_shapes(cfg))
    assert jax.tree.map(np.shape, fused) == jax.tree.map(tuple, shapes, is_leaf=lambda x: isinstance(x, tuple))


def test_loaders_give_the_run_layout(tmp_path):
    hf = tiny_hf("qwen2", seed=3)
    model = save_and_load(hf, tmp_path / "in")  # load_hf
    assert "wqkv" in model.params["layers"][0] and "w_gate_up" in model.params["layers"][0]
    assert "wqkv" in ports.random_model(model.config).params["layers"][0]
    ports.save_hf(model, str(tmp_path / "out"))  # back to one matrix per projection
    again = ports.load_hf(str(tmp_path / "out"))
    assert _equal(again.params, model.params)
    half = ports.Model(model.config, FU.unfuse_params(model.config, model.params, mlp=False), model.hf_config)
    ports.save(half, str(tmp_path / "ckpt"))  # a jspec checkpoint is always written fused
    assert _equal(ports.load(str(tmp_path / "ckpt")).params, model.params)
