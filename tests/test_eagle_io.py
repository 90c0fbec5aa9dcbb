"""EAGLE head storage (jspec.parts.drafters.eagle_io): our directories round-trip exactly; a foreign EAGLE-1 LLaMA
checkpoint (pytorch_model.bin, no input norm) and a LANTERN Chameleon one (model.safetensors, input norm, per-head
QK norms) load, draft the logits a PyTorch reference computes from the same weights, and keep greedy SD == AR;
malformed or mismatched checkpoints fail with errors that name the problem."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import jspec
import ports.core.cache
from jspec.parts.drafters import eagle as EG
from jspec.parts.drafters import eagle_io as IO
from jspec.parts.plans import StaticPlan
from jspec.parts.trees import build_tree
from ports.core import fused as FU
from tiny_pairs import CFG, PROMPTS, tiny_pair

TREE = [[0], [1], [0, 0], [0, 0, 0]]


@pytest.fixture(scope="module")
def llama_target():
    return tiny_pair()[0]


@pytest.fixture(scope="module")
def chameleon_target():
    from jspec import images as IG
    from test_imagegen import make_model

    return IG._generating(make_model(0))


def _decode(target, head, prompts=PROMPTS, n=12):
    return jspec.decode(target, prompts, jspec.Speculative(EG.EagleDrafter(head), StaticPlan.of(build_tree(TREE))),
                        max_new_tokens=n, eos_token_id=())


def _perturbed(module, seed, scale=0.3):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return module


@jax.jit
def _teacher_forced(target, head, seq):
    """(the target's features f [T, D] of seq, the draft logits [T - 1, V] of entries (seq[j + 1], f_j) as
    eagle.head_forward computes them)."""
    cfg, lm = EG.text_parts(target)
    T = seq.shape[0]
    cache = ports.core.cache.init_cache(cfg.num_layers, 1, cfg.num_kv_heads, T, cfg.head_dim, jnp.float32)
    fo = target.forward(seq[None], jnp.arange(T)[None], cache, fresh=True, hidden_layers=(cfg.num_layers,))
    f = EG.features(cfg, lm, fo.hidden[0])
    hc = ports.core.cache.init_cache(1, 1, cfg.num_kv_heads, T - 1, cfg.head_dim, jnp.float32)
    x, _ = EG.head_forward(cfg, head, lm["embed"][seq[1:]][None], f[:, :-1], jnp.arange(1, T)[None], hc, fresh=True)
    return f[0], EG.lm_logits(cfg, lm, x)[0]


def _ours_logits(target, head, seq):
    f, logits = _teacher_forced(target, head, jnp.asarray(seq, jnp.int32))
    return np.asarray(logits), np.asarray(f)


def _torch_logits(target, fc, layer, rotary, seq, f):
    """The PyTorch head (EAGLE-1 / LANTERN `Model.forward` with one layer) on the same entries, and the target's LM
    head over its output."""
    cfg, lm = EG.text_parts(target)
    T = len(seq) - 1
    emb = torch.tensor(np.asarray(lm["embed"]))[torch.tensor(seq[1:])][None]
    x = fc(torch.cat([emb, torch.tensor(f[:T])[None]], dim=-1))
    pos = torch.arange(T)[None]  # EAGLE counts from 0; jspec from 1: RoPE sees only differences
    mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        out = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=rotary(x, pos))
    out = out[0] if isinstance(out, tuple) else out
    head = np.asarray(lm["embed"]).T if cfg.tie_word_embeddings else np.asarray(lm["lm_head"])
    return out[0].detach().numpy() @ head


def _state_dict(fc, layer, embed=None, drop=()):
    sd = {"fc.weight": fc.weight, "fc.bias": fc.bias}
    sd.update({f"layers.0.{k}": v for k, v in layer.state_dict().items() if k not in drop})
    if embed is not None:
        sd["embed_tokens.weight"] = torch.tensor(np.asarray(embed))
    return {k: v.detach().clone() for k, v in sd.items()}


# ------------------------------------------------------------------------------------------------- round trip


def test_round_trip_gives_identical_params_and_decodes(llama_target, tmp_path):
    target = llama_target
    for input_norm in (True, False):
        head = EG.init_head(target, jax.random.key(1), input_norm=input_norm, noise=0.3)
        d = tmp_path / f"norm{int(input_norm)}"
        IO.save_head(head, str(d), extra={"note": "test"}, target=target)
        meta = json.loads((d / IO.CONFIG_NAME).read_text())
        assert meta["format"] == IO.FORMAT and meta["input_norm"] is input_norm and meta["note"] == "test"
        assert json.loads((d / "config.json").read_text())["num_hidden_layers"] == 1
        sd = IO.torch_state_dict(head)
        assert ("layers.0.input_layernorm.weight" in sd) is input_norm
        assert sd["fc.weight"].shape == (64, 128)
        back = IO.load_head(str(d), target)
        assert back.input_norm is input_norm and back.target == head.target
        if not input_norm:  # the copied input norm is not read, so not stored
            layer = dict(head.params["layer"])
            del layer["attn_norm"]
            head = head.replace(params=dict(head.params, layer=layer))
        assert IO.same_params(head, back)
    a, b = _decode(target, head), _decode(target, back)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.stats["mean_accepted"], b.stats["mean_accepted"])
    h16 = IO.load_head(str(d), target, dtype=jnp.bfloat16)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(h16.params))


def test_neighbour_table_travels_with_the_head(chameleon_target, tmp_path):
    from jspec.parts.neighbours import NeighbourTable
    from ports.families import vqgan as VQ

    target = chameleon_target
    cfg, params = EG.text_parts(target)
    table = NeighbourTable.for_chameleon(cfg, np.asarray(VQ.codebook(params["vqmodel"])), k=3)
    head = EG.init_head(target, jax.random.key(0))
    IO.save_head(head, str(tmp_path), table=table)
    h, t = IO.load_drafter(str(tmp_path), target)
    assert IO.same_params(h, head) and h.input_norm  # LANTERN's Chameleon heads normalise their input
    np.testing.assert_array_equal(np.asarray(t.ids), np.asarray(table.ids))
    IO.save_head(head, str(tmp_path))  # saving without a table removes the old one
    assert IO.load_drafter(str(tmp_path), target)[1] is None
    other = NeighbourTable(jnp.full((cfg.vocab_size + 1, 3), -1, jnp.int32), table.num_codes, 3)
    with pytest.raises(ValueError, match="vocabulary"):
        IO.save_head(head, str(tmp_path), table=other)
    other.save(str(tmp_path / IO.TABLE_NAME))
    with pytest.raises(ValueError, match="vocabulary"):
        IO.load_drafter(str(tmp_path), target)


# ------------------------------------------------------------------------------------------------- foreign heads


def test_foreign_eagle1_llama_checkpoint(llama_target, tmp_path):
    """EAGLE-1's LLaMA layout: fc with bias, one LlamaDecoderLayer without input_layernorm, torch.save'd with the
    target's embedding, beside a config.json."""
    from transformers.models.llama import modeling_llama as LM

    target = llama_target
    torch.manual_seed(0)
    hf_cfg = transformers.LlamaConfig(hidden_size=CFG.hidden_size, intermediate_size=CFG.intermediate_size,
                                      num_hidden_layers=1, num_attention_heads=CFG.num_heads,
                                      num_key_value_heads=CFG.num_kv_heads, head_dim=CFG.head_dim,
                                      vocab_size=CFG.vocab_size, rms_norm_eps=CFG.rms_norm_eps)
    hf_cfg._attn_implementation = "eager"
    layer = _perturbed(LM.LlamaDecoderLayer(hf_cfg, 0), seed=1, scale=0.15).eval()
    fc = _perturbed(torch.nn.Linear(2 * CFG.hidden_size, CFG.hidden_size), seed=2, scale=0.1)
    sd = _state_dict(fc, layer, EG.text_parts(target)[1]["embed"], drop=("input_layernorm.weight",))
    torch.save(sd, tmp_path / "pytorch_model.bin")
    (tmp_path / "config.json").write_text(json.dumps(hf_cfg.to_dict()))
    head = IO.load_head(str(tmp_path), target)
    assert not head.input_norm and head.target == EG.signature(target)

    seq = np.concatenate([PROMPTS[1], np.arange(10) * 5 % 97])
    ours, f = _ours_logits(target, head, seq)
    layer.input_layernorm = torch.nn.Identity()  # EAGLE-1's layer 0 feeds fc's output to attention unnormalised
    ref = _torch_logits(target, fc, layer, LM.LlamaRotaryEmbedding(hf_cfg), seq, f)
    np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-4)

    ar = jspec.decode(target, PROMPTS, max_new_tokens=12, eos_token_id=())
    np.testing.assert_array_equal(_decode(target, head).tokens, ar.tokens)


def _lantern_checkpoint(target, tmp_path, decode=False):
    """LANTERN's Chameleon layout: input_layernorm, attention biases and per-head q/k norms, in model.safetensors
    (what accelerate's save_state writes): it loads and drafts the PyTorch layer's logits (and, with `decode`,
    keeps greedy SD == AR); returns the state dict."""
    from ports.core.safetensors_io import write_safetensors
    from test_chameleon import hf_config
    from transformers.models.chameleon import modeling_chameleon as CM

    hf_cfg = hf_config(num_hidden_layers=1)
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    layer = _perturbed(CM.ChameleonDecoderLayer(hf_cfg, 0), seed=3, scale=0.2).eval()
    fc = _perturbed(torch.nn.Linear(64, 32), seed=4, scale=0.1)
    sd = {k: v.numpy() for k, v in _state_dict(fc, layer, EG.text_parts(target)[1]["embed"]).items()}
    write_safetensors(str(tmp_path / "model.safetensors"), {k: (v.shape, v.dtype) for k, v in sd.items()},
                      sd.__getitem__)
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 32, "num_attention_heads": 4,
                                                      "num_hidden_layers": 1, "model_type": "chameleon"}))
    head = IO.load_head(str(tmp_path), target)
    assert head.input_norm and head.family == "chameleon"

    seq = np.asarray([8, 9, 17, 40, 41, 55, 60, 43, 70, 44, 45, 46, 59], np.int32)
    ours, f = _ours_logits(target, head, seq)
    ref = _torch_logits(target, fc, layer, CM.ChameleonRotaryEmbedding(hf_cfg), seq, f)
    np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-4)

    if decode:
        prompts = [np.asarray([8, 9, 17, 40, 41]), np.asarray([15, 16, 50, 51, 52, 53, 12])]
        ar = jspec.decode(target, prompts, max_new_tokens=10, eos_token_id=())
        np.testing.assert_array_equal(_decode(target, head, prompts, 10).tokens, ar.tokens)
    return sd


@pytest.mark.slow  # compiles a Chameleon EAGLE decode
def test_foreign_lantern_chameleon_checkpoint_decodes(chameleon_target, tmp_path):
    _lantern_checkpoint(chameleon_target, tmp_path, decode=True)


def test_foreign_lantern_chameleon_checkpoint(chameleon_target, tmp_path):
    target = chameleon_target
    sd = _lantern_checkpoint(target, tmp_path)
    # LANTERN's own layer keeps one QK-norm row per model-parallel shard (model_parallel_size 1: one row for all
    # heads); it is expanded to one row per head
    sd1 = dict(sd)
    for n in ("q_norm", "k_norm"):
        for part in ("weight", "bias"):
            sd1[f"layers.0.self_attn.{n}.{part}"] = sd[f"layers.0.self_attn.{n}.{part}"][:1]
    h1 = IO.from_torch_state_dict(sd1, target)
    cfg, _ = EG.text_parts(target)
    unf = FU.unfuse_layer(cfg, h1.params["layer"])
    np.testing.assert_array_equal(unf["q_norm"], np.repeat(sd["layers.0.self_attn.q_norm.weight"][:1], 4, 0))
    np.testing.assert_array_equal(unf["k_norm_b"], np.repeat(sd["layers.0.self_attn.k_norm.bias"][:1], 2, 0))


# ------------------------------------------------------------------------------------------------- errors


def test_errors_name_the_problem(llama_target, tmp_path):
    target = llama_target
    head = EG.init_head(target, jax.random.key(1), input_norm=True)
    sd = IO.torch_state_dict(head)

    def fails(d, match, input_norm=None):
        with pytest.raises(ValueError, match=match):
            IO.from_torch_state_dict(d, target, input_norm)

    fails({k: v for k, v in sd.items() if k != "layers.0.mlp.up_proj.weight"}, r"missing keys.*mlp.up_proj")
    fails({**sd, "layers.0.self_attn.extra.weight": sd["fc.bias"]}, r"unexpected keys.*self_attn.extra")
    fails({**sd, "fc.weight": sd["fc.weight"].T}, r"wrong shapes.*fc.weight")
    fails({**sd, "layers.0.self_attn.q_proj.weight": sd["layers.0.self_attn.q_proj.weight"][:, :10]},
          r"wrong shapes.*q_proj")
    fails({**sd, "layers.1.mlp.up_proj.weight": sd["layers.0.mlp.up_proj.weight"]}, r"one decoder layer.*\[0, 1\]")
    fails({**sd, "embed_tokens.weight": np.zeros((10, 64), np.float32)}, "another target")
    fails({k: v for k, v in sd.items() if "input_layernorm" not in k}, "missing keys.*input_layernorm", True)
    fails(sd, "unexpected keys.*input_layernorm", False)
    assert not IO.from_torch_state_dict({k: v for k, v in sd.items() if "input_layernorm" not in k},
                                        target).input_norm
    # directories
    with pytest.raises(ValueError, match="no EAGLE head weights"):
        IO.load_head(str(tmp_path), target)
    IO.save_head(head, str(tmp_path / "ours"))
    import dataclasses

    import ports

    narrow = ports.random_model(dataclasses.replace(CFG, hidden_size=32, head_dim=8), key=5)
    with pytest.raises(ValueError, match="another target"):
        IO.load_head(str(tmp_path / "ours"), narrow)
    with pytest.raises(ValueError, match="another target's weights"):
        IO.load_head(str(tmp_path / "ours"), ports.random_model(CFG, key=11))
    os.remove(tmp_path / "ours" / IO.WEIGHTS_NAME)
    with pytest.raises(ValueError, match="no EAGLE head weights"):
        IO.load_head(str(tmp_path / "ours"), target)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    from ports.core.safetensors_io import write_safetensors

    write_safetensors(str(foreign / IO.WEIGHTS_NAME), {k: (v.shape, v.dtype) for k, v in sd.items()}, sd.__getitem__)
    (foreign / "config.json").write_text(json.dumps({"hidden_size": 4096, "num_attention_heads": 32}))
    with pytest.raises(ValueError, match="another target.*hidden_size 4096"):
        IO.load_head(str(foreign), target)
    (foreign / "config.json").write_text(json.dumps({"hidden_size": 64, "num_attention_heads": 4,
                                                     "num_hidden_layers": 2}))
    with pytest.raises(ValueError, match="num_hidden_layers=2"):
        IO.load_head(str(foreign), target)
