"""Qwen3-MoE through `ports`, against transformers 5.23's `Qwen3MoeForCausalLM` on tiny random models (f32):
logits through `load_hf` with dense and sparse layers (`mlp_only_layers`, `decoder_sparse_step`) and
`norm_topk_prob` both ways, from the per-expert checkpoint layout and from transformers' fused one; `save_hf` read
back by transformers; greedy decode against generate, and Chain SD == AR, on a ragged batch; the grouped matmul
(tiles and `ragged_dot`) against a per-pair loop, with work that follows the experts used, not the experts
stored; the experts sharded over an 8-device mesh (a subprocess); bad configs named before any weight is read."""
import dataclasses
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors import safe_open

import jspec
import ports
from conftest import hf_greedy, hf_logits, perturb, save_and_load
from ports.core import moe
from ports.families import qwen3 as Q3
from tolerances import assert_clear_margins, assert_f32_close, assert_layout_close

BASE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=101, initializer_range=0.25, max_position_embeddings=256,
            num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, bos_token_id=None, eos_token_id=None,
            pad_token_id=None)
CASES = {"norm_topk_dense_layer_2": dict(norm_topk_prob=True, mlp_only_layers=[2]),
         "no_norm_sparse_step_2": dict(norm_topk_prob=False, decoder_sparse_step=2),
         "no_experts": dict(num_experts=0)}
SPARSE = {"norm_topk_dense_layer_2": (True, True, False, True), "no_norm_sparse_step_2": (False, True, False, True),
          "no_experts": (False,) * 4}
TOKENS = np.random.default_rng(0).integers(0, 101, (2, 19))


def tiny_moe(seed: int, **over):
    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**{**BASE, **over})).eval()
    return perturb(model, seed, scale=0.1)


def close_to(ours, ref):
    assert_layout_close(ours, ref, reduction=96, depth=4)


def differs(ours, ref) -> bool:
    return float(np.abs(np.asarray(ours) - ref).max()) > 1e-3 * float(np.abs(ref).max())


# ------------------------------------------------------------------------------------------ logits


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(case, tmp_path):
    """Both checkpoint layouts transformers writes (per-expert tensors by default; fused gate_up_proj / down_proj
    with save_original_format=False) load to its logits; the sparse layers are the ones transformers builds with
    experts (none with num_experts 0); flipping norm_topk_prob gives other logits where there are experts."""
    hf = tiny_moe(1, **CASES[case])
    assert tuple(hasattr(layer.mlp, "experts") for layer in hf.model.layers) == SPARSE[case]
    ref = hf_logits(hf, TOKENS)
    model = save_and_load(hf, tmp_path / "experts")
    fused = save_and_load(hf, tmp_path / "fused", save_original_format=False)
    for layout, m in (("experts", model), ("fused", fused)):
        with safe_open(str(tmp_path / layout / "model.safetensors"), "np") as f:
            names = set(f.keys())
        experts = case != "no_experts"
        assert ("model.layers.1.mlp.experts.gate_up_proj" in names) == (experts and layout == "fused")
        assert ("model.layers.1.mlp.experts.7.up_proj.weight" in names) == (experts and layout == "experts")
        assert tuple(m.config.is_sparse(i) for i in range(4)) == SPARSE[case]
        close_to(ports.logits(m, TOKENS), ref)
    flipped = dataclasses.replace(model.config, norm_topk_prob=not model.config.norm_topk_prob)
    assert differs(ports.logits(ports.Model(flipped, model.params), TOKENS), ref) == (case != "no_experts")


def test_save_hf_loads_in_transformers_with_equal_logits(tmp_path):
    """save_hf writes the per-expert layout with config_to_hf's config (of a Model without its source config);
    transformers loads it as Qwen3MoeForCausalLM with the source model's logits, and load_hf reads it back."""
    hf = tiny_moe(2, **CASES["norm_topk_dense_layer_2"])
    model = save_and_load(hf, tmp_path / "in")
    ports.save_hf(ports.Model(model.config, model.params), str(tmp_path / "out"))
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (cfg["num_experts"], cfg["mlp_only_layers"], cfg["norm_topk_prob"]) == (8, [2], True)
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    assert type(back).__name__ == "Qwen3MoeForCausalLM"
    np.testing.assert_allclose(hf_logits(back, TOKENS), hf_logits(hf, TOKENS), rtol=0, atol=1e-6)
    assert ports.load_hf(str(tmp_path / "out")).config == model.config
    assert Q3.config_from_hf(Q3.config_to_hf(model.config)) == model.config


# ------------------------------------------------------------------------------------------ decoding


def test_greedy_decode_equals_generate_and_chain_sd_equals_ar(tmp_path):
    """A 3-layer MoE (layer 1 dense; layers 1 and 2 damped, so that a draft of layer 0 often agrees), loaded from
    transformers: on a ragged batch of 3 prompts (15, 6 and 11 tokens), 12 new tokens, each row is transformers'
    greedy generate's; Chain (gamma 3) with the model's first (sparse) layer as the draft gives the same tokens,
    with drafts accepted."""
    hf = tiny_moe(3, num_hidden_layers=3, mlp_only_layers=[1], norm_topk_prob=True)
    with torch.no_grad():
        for layer in hf.model.layers[1:]:
            layer.self_attn.o_proj.weight.mul_(0.2)
            down = layer.mlp.experts.down_proj if hasattr(layer.mlp, "experts") else layer.mlp.down_proj.weight
            down.mul_(0.2)
    model = save_and_load(hf, tmp_path)
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, 101, n) for n in (15, 6, 11)]
    out = jspec.decode(model, prompts, max_new_tokens=12, eos_token_id=())
    assert_clear_margins(model, prompts, out.tokens)
    for b, p in enumerate(prompts):
        np.testing.assert_array_equal(out.tokens[b], hf_greedy(hf, p, 12), err_msg=f"row {b}")
    draft = ports.Model(dataclasses.replace(model.config, num_layers=1),
                        {**model.params, "layers": model.params["layers"][:1]})
    sd = jspec.decode(model, prompts, strategy=jspec.Chain(draft, gamma=3), max_new_tokens=12, eos_token_id=())
    np.testing.assert_array_equal(sd.tokens, out.tokens)
    assert np.all(sd.stats["mean_accepted"] > 1.0), sd.stats["mean_accepted"]


# ------------------------------------------------------------------------------------------ the expert block


def random_experts(E: int, D: int = 16, F: int = 8, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    shapes = {"router": (D, E), "we_gate": (E, D, F), "we_up": (E, D, F), "we_down": (E, F, D)}
    return {k: jnp.asarray(rng.normal(size=s), jnp.float32) for k, s in shapes.items()}


@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_grouped_matmul_equals_a_loop_over_token_expert_pairs(tokens, monkeypatch):
    """The MoE block as tiles (1 row per tile when pairs <= experts; wider tiles, padded, when not) and as
    ragged_dot: each token's sum over its top-2 experts of weight x SwiGLU_expert(x), computed pair by pair."""
    p = random_experts(6)
    x = jnp.asarray(np.random.default_rng(tokens).normal(size=(tokens, 16)), jnp.float32)
    cfg = dataclasses.make_dataclass("C", [("num_experts_per_tok", int), ("norm_topk_prob", bool)])(2, True)
    w, e = moe.route(x, p["router"], 2, True)
    np.testing.assert_allclose(np.asarray(w).sum(-1), 1.0, rtol=1e-6)
    want = np.zeros((tokens, 16))
    for n in range(tokens):
        for j in range(2):
            i = int(e[n, j])
            h = jax.nn.silu(x[n] @ p["we_gate"][i]) * (x[n] @ p["we_up"][i])
            want[n] += float(w[n, j]) * np.asarray(h @ p["we_down"][i], np.float64)
    for how in ("tiled", "ragged"):
        monkeypatch.setattr(moe, "GROUPED", how)
        got = np.asarray(jax.jit(lambda x: moe.sparse_moe(cfg, p, x))(x))
        assert_f32_close(got, want, ulps=1024, atol=1e-5 * np.abs(want).max(), err_msg=how)


def test_moe_work_follows_the_experts_used_not_the_experts_stored():
    """XLA's flop count of the default MoE block (on this backend) for 1, 4 and 48 tokens, top 2: with 64 experts
    it is within 1.3x of the count with 8 (only the router grows), and at most twice the work of the pairs' own
    SwiGLUs plus the router. `ragged_dot` as XLA:CPU lowers it would grow with the experts stored."""
    cfg = dataclasses.make_dataclass("C", [("num_experts_per_tok", int), ("norm_topk_prob", bool)])(2, False)
    D, F = 64, 32

    def flops(E, N):
        p = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in
             {"router": (D, E), "we_gate": (E, D, F), "we_up": (E, D, F), "we_down": (E, F, D)}.items()}
        cost = jax.jit(lambda p, x: moe.sparse_moe(cfg, p, x)).lower(
            p, jax.ShapeDtypeStruct((N, D), jnp.float32)).compile().cost_analysis()
        return (cost[0] if isinstance(cost, list) else cost)["flops"]

    for N in (1, 4, 48):
        pairs = 2 * N * 3 * D * F * 2  # the chosen experts' three matmuls
        few, many = flops(8, N), flops(64, N)
        assert many < 1.3 * few, (N, few, many)
        assert many <= 2 * pairs + 4 * N * D * 64, (N, many, pairs)


@pytest.mark.slow  # (tests/test_qwen3_strategies.py decodes with the experts split over `expert` by default)
def test_experts_shard_over_the_expert_axis():
    """tests/moe_sharded_checks.py on 8 forced CPU devices: the expert weights split over `expert` (and their
    width over `tensor`); logits on two meshes, as tiles and as ragged_dot, equal the unsharded ones; greedy AR
    and Chain on a data x expert x tensor mesh give the unsharded tokens."""
    here = os.path.dirname(__file__)
    proc = subprocess.run([sys.executable, os.path.join(here, "moe_sharded_checks.py")],
                          env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True, timeout=600,
                          cwd=os.path.dirname(here))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"placement": 1, "logits": 4, "decode": 2}


# ------------------------------------------------------------------------------------------ bad configs


BAD = {
    "top_k": ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
    "head_dim": ({"head_dim": None, "hidden_size": 66}, "head_dim"),
    "mlp_only_layers": ({"mlp_only_layers": [4]}, "mlp_only_layers"),
    "sparse_step": ({"decoder_sparse_step": 0}, "decoder_sparse_step"),
    "moe_width": ({"moe_intermediate_size": 0}, "moe_intermediate_size"),
    "norm_topk_prob": ({"norm_topk_prob": "true"}, "norm_topk_prob"),
    "hidden_act": ({"hidden_act": "relu"}, "hidden_act"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_configs_are_refused_before_any_weight_is_read(case, tmp_path, monkeypatch):
    from ports.core import safetensors_io

    tiny_moe(5).save_pretrained(str(tmp_path))
    cfg = json.loads((tmp_path / "config.json").read_text())
    over, field = BAD[case]
    bad = {**cfg, **over}
    if bad.get("head_dim", 0) is None:  # absent: qwen3_moe has no head_dim of its own, hidden / heads is used
        del bad["head_dim"]
    (tmp_path / "config.json").write_text(json.dumps(bad))
    monkeypatch.setattr(safetensors_io.SafetensorsFile, "get", lambda *a: (_ for _ in ()).throw(AssertionError))
    with pytest.raises(ValueError, match=field):
        ports.load_hf(str(tmp_path))
    assert Q3.config_from_hf({k: v for k, v in cfg.items() if k != "head_dim"}).head_dim == 16  # 64 / 4 heads
