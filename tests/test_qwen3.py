"""Qwen3 (dense) through `ports`, against transformers 5.23's `Qwen3ForCausalLM` on tiny random models (f32):
logits through `load_hf` (untied with a head_dim of its own, tied with attention biases, a sliding window in some
layers by `max_window_layers` and by explicit `layer_types`), the legacy RoPE spelling, `save_hf` read back by
transformers, greedy decode against transformers' generate on a ragged batch, greedy Chain / Tree SD == AR with
a Qwen3 draft, stacked layers, and bad configs refused before any weight is read, naming the field.
Each comparison that a feature decides also checks that dropping the feature changes the result."""
import dataclasses
import json

import numpy as np
import pytest
import torch
import transformers

import jspec
import ports
from conftest import hf_greedy, hf_logits, perturb, save_and_load
from ports.families import qwen3 as Q3
from ports.core import scanned as SC
from tolerances import assert_clear_margins, assert_layout_close

BASE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=24, vocab_size=101, initializer_range=0.25,
            max_position_embeddings=256, bos_token_id=None, eos_token_id=None, pad_token_id=None)
WINDOW = dict(use_sliding_window=True, sliding_window=5, max_window_layers=1)  # layer 0 full, layer 1 slides


def tiny_qwen3(seed: int, **over):
    """A tiny random Qwen3ForCausalLM with every parameter perturbed (q/k norm scales included)."""
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**{**BASE, **over})).eval()
    return perturb(model, seed, scale=0.1)


def close_to(ours, ref, layers: int = 2):
    assert_layout_close(ours, ref, reduction=96, depth=layers)


def differs(ours, ref) -> bool:
    return float(np.abs(np.asarray(ours) - ref).max()) > 1e-3 * float(np.abs(ref).max())


def with_config(model, **changes):
    return ports.Model(dataclasses.replace(model.config, **changes), model.params)


TOKENS = np.random.default_rng(0).integers(0, 101, (2, 19))


# ------------------------------------------------------------------------------------------ logits


@pytest.mark.parametrize("case", ["untied", "tied_bias", "window", "layer_types"])
def test_logits_match_transformers(case, tmp_path):
    """load_hf of a saved Qwen3ForCausalLM gives its logits on a 19-token batch. head_dim 24 is not hidden / heads
    (16); the q/k norms matter (without them, other logits); in the windowed cases the window matters and so
    does which layers slide."""
    over = {"untied": {}, "tied_bias": dict(tie_word_embeddings=True, attention_bias=True), "window": WINDOW,
            "layer_types": dict(use_sliding_window=True, sliding_window=4,
                                layer_types=["sliding_attention", "full_attention"])}[case]
    hf = tiny_qwen3(1, **over)
    model = save_and_load(hf, tmp_path)
    cfg = model.config
    assert (cfg.model_type, cfg.head_dim, cfg.tie_word_embeddings, cfg.qkv_bias) == (
        "qwen3", 24, case == "tied_bias", case == "tied_bias")
    ref = hf_logits(hf, TOKENS)
    close_to(ports.logits(model, TOKENS), ref)
    no_norm = [{k: v for k, v in p.items() if k not in ("q_norm", "k_norm")} for p in model.params["layers"]]
    assert differs(ports.logits(ports.Model(cfg, {**model.params, "layers": no_norm}), TOKENS), ref)
    if case in ("window", "layer_types"):
        assert cfg.full_attention_layers == ((0,) if case == "window" else (1,))
        assert differs(ports.logits(with_config(model, sliding_window=None), TOKENS), ref)
        assert differs(ports.logits(with_config(model, full_attention_layers=()), TOKENS), ref)


def test_legacy_rope_spelling_equals_rope_parameters(tmp_path):
    """A config.json with rope_theta + rope_scaling ({"type": "linear"}) loads to the model its rope_parameters
    spelling gives, and both match transformers."""
    hf = tiny_qwen3(2, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 20000.0})
    new = save_and_load(hf, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    rp = cfg.pop("rope_parameters")
    cfg.update(rope_theta=rp["rope_theta"], rope_scaling={"type": "linear", "factor": rp["factor"]})
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    old = ports.load_hf(str(tmp_path))
    assert old.config == new.config and (old.config.rope.rope_type, old.config.rope.theta) == ("linear", 20000.0)
    close_to(ports.logits(old, TOKENS), hf_logits(hf, TOKENS))


# ------------------------------------------------------------------------------------------ save_hf


def test_save_hf_loads_in_transformers_with_equal_logits(tmp_path):
    """save_hf of a loaded model, and of a Model without its source config (config_to_hf's: the window and its
    layer_types written back), load in transformers as Qwen3ForCausalLM with the source model's logits."""
    hf = tiny_qwen3(3, **WINDOW)
    model = save_and_load(hf, tmp_path / "in")
    ref = hf_logits(hf, TOKENS)
    for name, m in (("loaded", model), ("bare", ports.Model(model.config, model.params))):
        ports.save_hf(m, str(tmp_path / name))
        back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / name)).eval()
        assert type(back).__name__ == "Qwen3ForCausalLM"
        assert back.config.layer_types == ["full_attention", "sliding_attention"], name
        np.testing.assert_allclose(hf_logits(back, TOKENS), ref, rtol=0, atol=1e-6, err_msg=name)
        assert ports.load_hf(str(tmp_path / name)).config == model.config
    assert Q3.config_from_hf(Q3.config_to_hf(model.config)) == model.config


# ------------------------------------------------------------------------------------------ decoding


def test_greedy_decode_equals_transformers_generate(tmp_path):
    """A ragged batch of 3 prompts (17, 9 and 12 tokens, window 5 in layer 1), 10 new tokens: each row is
    transformers' cached greedy generate's; without the window the tokens differ."""
    hf = tiny_qwen3(4, **WINDOW)
    model = save_and_load(hf, tmp_path)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 101, n) for n in (17, 9, 12)]
    out = jspec.decode(model, prompts, max_new_tokens=10, eos_token_id=())
    assert_clear_margins(model, prompts, out.tokens)
    for b, p in enumerate(prompts):
        np.testing.assert_array_equal(out.tokens[b], hf_greedy(hf, p, 10), err_msg=f"row {b}")
    free = jspec.decode(with_config(model, sliding_window=None), prompts, max_new_tokens=10, eos_token_id=())
    assert not np.array_equal(free.tokens, out.tokens)


CFG = Q3.config_from_hf({**BASE, "model_type": "qwen3", "vocab_size": 97, "num_hidden_layers": 3,
                         "use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1})
PROMPTS = [np.arange(5) % 97, (np.arange(14) * 7) % 97, (np.arange(9) * 3 + 1) % 97]


def qwen3_pair():
    """(target, draft): a 3-layer random Qwen3 (layers 1, 2 slide over 4 tokens) and its first layer as a 1-layer
    Qwen3 draft (later target layers damped, so the draft agrees often but not always)."""
    target = ports.random_model(CFG, key=0, std=0.3)
    for layer in target.params["layers"][1:]:
        layer["wo"] = layer["wo"] * 0.3
        layer["w_gate_up"] = layer["w_gate_up"] * 0.5
    draft = ports.Model(dataclasses.replace(CFG, num_layers=1),
                        {**target.params, "layers": target.params["layers"][:1]})
    return target, draft


def test_greedy_sd_with_a_qwen3_draft_equals_ar():
    """Chain (gamma 3) and a static tree with a 1-layer Qwen3 draft on a ragged batch of 3: AR's tokens, with
    drafts accepted (mean accepted > 1)."""
    target, draft = qwen3_pair()
    ar = jspec.decode(target, PROMPTS, max_new_tokens=16, eos_token_id=())
    assert_clear_margins(target, PROMPTS, ar.tokens)
    for name, strat in (("chain", jspec.Chain(draft, gamma=3)), ("tree", jspec.Tree(draft, tree=[[0], [1], [0, 0]]))):
        sd = jspec.decode(target, PROMPTS, strategy=strat, max_new_tokens=16, eos_token_id=())
        np.testing.assert_array_equal(sd.tokens, ar.tokens, err_msg=name)
        assert np.all(sd.stats["mean_accepted"] > 1.0), (name, sd.stats["mean_accepted"])


def test_stacked_layers_run_one_window():
    """`scan_layers` of a Qwen3 whose layers share one window gives the unrolled logits; where the layers attend
    under different windows, the stacked forward refuses naming them."""
    target, _ = qwen3_pair()
    same = with_config(target, full_attention_layers=())
    close_to(ports.logits(SC.scan_layers(same), PROMPTS[1]), ports.logits(same, PROMPTS[1]), layers=3)
    with pytest.raises(ValueError, match="one attention window"):
        ports.logits(SC.scan_layers(target), PROMPTS[1])


# ------------------------------------------------------------------------------------------ bad configs


BAD = {
    "hidden_act": ({"hidden_act": "gelu"}, "hidden_act"),
    "head_dim_null": ({"head_dim": None}, "head_dim"),
    "kv_heads": ({"num_key_value_heads": 3}, "num_key_value_heads"),
    "layer_types_length": ({"layer_types": ["full_attention"]}, "layer_types"),
    "layer_types_value": ({"layer_types": ["full_attention", "chunked_attention"]}, "layer_types"),
    "sliding_without_window": ({"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
    "window_zero": ({"use_sliding_window": True, "sliding_window": 0}, "sliding_window"),
    "eps": ({"rms_norm_eps": -1e-6}, "rms_norm_eps"),
    "tied_string": ({"tie_word_embeddings": "yes"}, "tie_word_embeddings"),
    "layers": ({"num_hidden_layers": 0}, "num_hidden_layers"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_configs_are_refused_before_any_weight_is_read(case, tmp_path, monkeypatch):
    """A checkpoint whose config.json holds one bad field: load_hf raises ValueError naming it, and no tensor is
    read (reading one would raise AssertionError)."""
    from ports.core import safetensors_io

    tiny_qwen3(6).save_pretrained(str(tmp_path))
    cfg = json.loads((tmp_path / "config.json").read_text())
    over, field = BAD[case]
    (tmp_path / "config.json").write_text(json.dumps({**cfg, **over}))
    monkeypatch.setattr(safetensors_io.SafetensorsFile, "get", lambda *a: (_ for _ in ()).throw(AssertionError))
    with pytest.raises(ValueError, match=field):
        ports.load_hf(str(tmp_path))
    assert Q3.config_from_hf(cfg).num_layers == 2  # the good config parses
