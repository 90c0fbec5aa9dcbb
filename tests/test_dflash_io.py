"""Block drafters on disk (jspec.parts.drafters.dflash_io): jspec's heads round-trip through z-lab's layout, a
directory written by hand in z-lab's layout (on a LLaMA and a Qwen3 target) and a shrunk Muse Glimmer assistant
load and decode as AR, the head's
forward is transformers' MuseGlimmerAssistantModel's, the real assistant header is mapped name by name and the
DFlash2 drafter is refused by name."""
import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.numpy import save_file

import jspec
from jspec.parts.drafters import dflash as DF
from jspec.parts.drafters import dflash_io as IO
from ports.core import cache as kvc
from ports.families import llama
from tiny_pairs import CFG, PROMPTS, tiny_pair

REAL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "real_layouts", "next")
ASSISTANT_DIR = os.path.join(REAL, "meta-models__Muse-Glimmer-30B-assistant")
DFLASH2_DIR = os.path.join(REAL, "z-lab__Muse-Glimmer-30B-DFlash2")
needs_real = pytest.mark.skipif(not os.path.isdir(REAL), reason="../shared/real_layouts/next is not here")


@pytest.fixture(scope="module")
def target():
    return tiny_pair()[0]


def _equal_heads(a, b):
    assert (a.config, a.target_layers, a.target, a.block, a.mask_token) == \
        (b.config, b.target_layers, b.target, b.block, b.mask_token)
    np.testing.assert_array_equal(np.asarray(a.vocab), np.asarray(b.vocab))
    la, lb = jax.tree_util.tree_leaves_with_path(a.params), jax.tree_util.tree_leaves_with_path(b.params)
    assert [p for p, _ in la] == [p for p, _ in lb]
    for (p, x), (_, y) in zip(la, lb):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=jax.tree_util.keystr(p))


@pytest.mark.parametrize("window", [None, 4])
def test_a_saved_head_loads_back_equal(target, tmp_path, window):
    """A random head (two layers with q / k norms, a reduced draft vocabulary, a mask token, with and without a
    sliding window) written by save_head reads back to an equal head; config.json holds z-lab's fields."""
    head = DF.init_head(target, jax.random.key(2), num_layers=2, block=6, target_layers=(1, 3),
                        draft_vocab=np.arange(0, 97, 2), dtype=jnp.float32, scale=0.3, mask_token=11)
    head = head.replace(config=dataclasses.replace(head.config, sliding_window=window))
    IO.save_head(head, str(tmp_path))
    _equal_heads(IO.load_head(str(tmp_path), target), head)
    conf = json.load(open(tmp_path / IO.CONFIG_NAME))
    assert conf["architectures"] == ["DFlashDraftModel"] and conf["model_type"] == "qwen3"
    assert conf["dflash_config"] == {"block_size": 6, "mask_token_id": 11, "target_layer_ids": [0, 2]}
    assert conf["sliding_window"] == window and conf["use_sliding_window"] == (window is not None)
    import transformers

    q3 = transformers.Qwen3Config.from_pretrained(str(tmp_path))
    assert (q3.num_hidden_layers, q3.head_dim, q3.sliding_window) == (2, 16, window)


def _zlab_dir(path, rng, ids=(0, 2), mask=96, block=5, layers=2):
    """A z-lab-layout directory written by hand: Qwen3-4B-DFlash's config fields at the tiny target's widths and
    z-lab's tensor names, random values."""
    D, F, H, KVH, Dh = CFG.hidden_size, 80, 4, 2, 16
    conf = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "attention_bias": False,
            "block_size": block, "dflash_config": {"mask_token_id": mask, "target_layer_ids": list(ids)},
            "head_dim": Dh, "hidden_act": "silu", "hidden_size": D, "intermediate_size": F,
            "layer_types": ["full_attention"] * layers, "max_position_embeddings": 40960, "max_window_layers": 5,
            "num_attention_heads": H, "num_hidden_layers": layers, "num_key_value_heads": KVH,
            "num_target_layers": CFG.num_layers, "rms_norm_eps": 1e-6, "rope_scaling": None, "rope_theta": 1000000,
            "sliding_window": None, "tie_word_embeddings": True, "use_sliding_window": False,
            "vocab_size": CFG.vocab_size}
    r = lambda *s: (0.3 * rng.standard_normal(s)).astype(np.float32)  # noqa: E731
    t = {"fc.weight": r(D, len(ids) * D), "hidden_norm.weight": 1 + r(D), "norm.weight": 1 + r(D)}
    for i in range(layers):
        p = f"layers.{i}."
        t.update({p + "self_attn.q_proj.weight": r(H * Dh, D), p + "self_attn.k_proj.weight": r(KVH * Dh, D),
                  p + "self_attn.v_proj.weight": r(KVH * Dh, D), p + "self_attn.o_proj.weight": r(D, H * Dh),
                  p + "self_attn.q_norm.weight": 1 + r(Dh), p + "self_attn.k_norm.weight": 1 + r(Dh),
                  p + "mlp.gate_proj.weight": r(F, D), p + "mlp.up_proj.weight": r(F, D),
                  p + "mlp.down_proj.weight": r(D, F), p + "input_layernorm.weight": 1 + r(D),
                  p + "post_attention_layernorm.weight": 1 + r(D)})
    os.makedirs(path, exist_ok=True)
    json.dump(conf, open(os.path.join(path, "config.json"), "w"))
    save_file(t, os.path.join(path, "model.safetensors"))
    return conf, t


def _decodes_as_ar(target, head):
    ar = jspec.decode(target, PROMPTS, max_new_tokens=16, eos_token_id=())
    for strat in (jspec.DFlash(head), jspec.DFlash(head, tree="ddtree", top_k=3, total=8)):
        out = jspec.decode(target, PROMPTS, strategy=strat, max_new_tokens=16, eos_token_id=())
        np.testing.assert_array_equal(out.tokens, ar.tokens)


def test_a_zlab_layout_directory_loads_and_decodes_as_ar(target, tmp_path):
    """A hand-written z-lab directory loads as the head its names say (fc transposed, target_layer_ids + 1, the
    mask token id, the block), and decodes PROMPTS (3 ragged rows) to AR's tokens as a chain and as a DDTree."""
    _, t = _zlab_dir(str(tmp_path), np.random.default_rng(0))
    head = IO.load_head(str(tmp_path), target)
    assert (head.target_layers, head.mask_token, head.block, head.vocab) == ((1, 3), 96, 5, None)
    assert head.config.sliding_window is None
    np.testing.assert_array_equal(np.asarray(head.params["fc"]), t["fc.weight"].T)
    np.testing.assert_array_equal(np.asarray(head.params["layers"][1]["k_norm"]), t["layers.1.self_attn.k_norm.weight"])
    np.testing.assert_array_equal(np.asarray(head.params["layers"][0]["w_down"]), t["layers.0.mlp.down_proj.weight"].T)
    _decodes_as_ar(target, head)


def test_a_zlab_head_decodes_as_ar_on_a_qwen3_target(tmp_path):
    """The targets z-lab's drafters are for: a hand-written z-lab directory on a tiny random Qwen3 (q / k norms, its
    last two layers sliding over 4 tokens) decodes PROMPTS to AR's tokens as a chain and as a DDTree."""
    import ports
    from ports.families import qwen3 as Q3

    cfg = Q3.config_from_hf({"model_type": "qwen3", "vocab_size": 97, "hidden_size": 64, "intermediate_size": 96,
                             "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
                             "head_dim": 24, "use_sliding_window": True, "sliding_window": 4,
                             "max_window_layers": 1, "bos_token_id": None, "eos_token_id": None})
    qwen3 = ports.random_model(cfg, key=1, std=0.3)
    _zlab_dir(str(tmp_path), np.random.default_rng(2))
    _decodes_as_ar(qwen3, IO.load_head(str(tmp_path), qwen3))


def test_bad_directories_are_refused(target, tmp_path):
    rng = np.random.default_rng(1)
    cases = {"vocab_size 50": dict(conf={"vocab_size": 50}),
             "num_target_layers 12": dict(conf={"num_target_layers": 12}),
             "lacks": dict(drop="layers.1.self_attn.q_norm.weight"), "mask token": dict(mask=97),
             "output_multiplier": dict(conf={"output_multiplier": 0.5}),
             "causally": dict(conf={"layer_types": ["sliding_attention"] * 2, "use_sliding_window": True,
                                    "sliding_window": 8}),
             "older layout": dict(add="mask_embedding"), "reads target layers": dict(ids=(0, 5))}
    for i, (match, case) in enumerate(cases.items()):
        d = str(tmp_path / str(i))
        conf, t = _zlab_dir(d, rng, ids=case.get("ids", (0, 2)), mask=case.get("mask", 96))
        conf.update(case.get("conf", {}))
        json.dump(conf, open(os.path.join(d, "config.json"), "w"))
        if "drop" in case or "add" in case:
            t.pop(case.get("drop"), None)
            if "add" in case:
                t[case["add"]] = np.zeros(CFG.hidden_size, np.float32)
            save_file(t, os.path.join(d, "model.safetensors"))
        with pytest.raises(ValueError, match=match):
            IO.load_head(d, target)


# ---------------------------------------------------------------------------------------------- Muse Glimmer


def _assistant(window=6, layers=2, hidden=CFG.hidden_size, seed=0):
    """A tiny random transformers MuseGlimmerAssistantModel (every weight random, norms included)."""
    from transformers import MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel

    cfg = MuseGlimmerAssistantConfig(hidden_size=hidden, intermediate_size=96, num_hidden_layers=layers,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, block_size=5,
                                     mask_token_id=7, target_layer_ids=[0, 2], sliding_window=window,
                                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    torch.manual_seed(seed)
    model = MuseGlimmerAssistantModel(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p + 0.3 * torch.randn_like(p))
    return model


def _torch_states(model, h, embeds):
    """transformers' block states [B, D] for context states h [T, n * D] and block inputs embeds [B, D], the way its
    DFlash candidate generator calls the assistant (positions 0 .. T + B - 1)."""
    from transformers.cache_utils import DFlashCache

    T, B = h.shape[0], embeds.shape[0]
    cache = DFlashCache(config=model.config)
    cache.activate_past_recording()
    cache.set_previous_accepted_tokens(T)
    with torch.no_grad():
        out = model(noise_embeds=torch.tensor(embeds)[None], context_hidden_states=torch.tensor(h)[None],
                    position_ids=torch.arange(T + B)[None], attention_mask=torch.ones(1, T + B, dtype=torch.long),
                    past_key_values=cache, use_cache=True)
    return out.last_hidden_state[0].numpy()


def _jspec_states(target, head, ids):
    """The head's block states [block, D] after the committed tokens ids[:-1], anchored at ids[-1], and the
    context states [T, n * D] the target gives it."""
    cfg, lm = DF.text_parts(target)
    T = len(ids) - 1
    cache = kvc.init_cache(cfg.num_layers, 1, cfg.num_kv_heads, T, cfg.head_dim, jnp.float32)
    fo = llama.forward(cfg, lm, jnp.asarray(ids[None, :T]), jnp.arange(T)[None], cache,
                       hidden_layers=head.target_layers, compute_logits=False, fresh=True)
    h = jnp.concatenate(fo.hidden, axis=-1)
    hc = head.config
    own = kvc.init_cache(hc.num_layers, 1, hc.num_kv_heads, T + head.block, hc.head_dim, jnp.float32)
    own = DF.write_context(head, own, h).replace(length=jnp.asarray([T]))
    f = DF.block_forward(head, lm, jnp.asarray(ids[-1:]), own, head.block)[0]
    return np.asarray(f), np.asarray(h[0])


@pytest.mark.parametrize("window", [6, 64])
def test_the_head_computes_what_transformers_assistant_does(target, tmp_path, window):
    """A tiny random MuseGlimmerAssistantModel saved by transformers loads as a head whose block states equal
    transformers' over the same context and block (the target's embeddings of the anchor and the mask token), with
    a window shorter than the context (6) and one longer (64). And jspec's z-lab layout of that head, its fc and
    hidden_norm renamed to the assistant's, loads back into transformers with the same states."""
    model = _assistant(window)
    model.save_pretrained(str(tmp_path / "assistant"))
    head = IO.load_head(str(tmp_path / "assistant"), target)
    assert (head.target_layers, head.mask_token, head.block, head.config.sliding_window) == ((1, 3), 7, 5, window + 1)
    ids = np.asarray([5, 9, 33, 2, 71, 40, 40, 12, 3, 88, 6, 19, 54], np.int32)
    f, h = _jspec_states(target, head, ids)
    embed = np.asarray(DF.text_parts(target)[1]["embed"])
    want = _torch_states(model, h, embed[[ids[-1]] + [7] * 4])
    np.testing.assert_allclose(f, want, rtol=1e-4, atol=1e-4)

    IO.save_head(head, str(tmp_path / "zlab"))
    from safetensors.torch import load_file

    sd = load_file(str(tmp_path / "zlab" / IO.WEIGHTS_NAME))
    sd = {{"fc.weight": "encoder.fc.weight", "hidden_norm.weight": "encoder.output_norm_enc.weight"}.get(k, k): v
          for k, v in sd.items()}
    again = _assistant(window, seed=1)
    assert not torch.equal(again.layers[0].self_attn.q_norm.weight, model.layers[0].self_attn.q_norm.weight)
    again.load_state_dict(sd, strict=True)
    np.testing.assert_allclose(_torch_states(again, h, embed[[ids[-1]] + [7] * 4]), want, rtol=1e-5, atol=1e-5)


def test_a_shrunk_assistant_decodes_as_ar(target, tmp_path):
    """A shrunk random assistant (the real config's fields, the tiny target's width, a window of 6 shorter than
    the texts) decodes PROMPTS to AR's tokens as a chain and as a DDTree."""
    _assistant(window=6).save_pretrained(str(tmp_path))
    _decodes_as_ar(target, IO.load_head(str(tmp_path), target))


@needs_real
def test_the_muse_glimmer_assistant_header_is_mapped():
    """Every tensor of the real Muse-Glimmer-30B-assistant header is one the loader maps, at the shape the real
    config gives it (full size), and the loader expects no other; every head parameter is among them; the config
    reads as block 16, mask token 201818, target layers 2, 14, 26, 38, 50 and a window of 2048 either side."""
    conf = json.load(open(os.path.join(ASSISTANT_DIR, "config.json")))
    header = json.load(open(os.path.join(ASSISTANT_DIR, "model.safetensors.header.json")))
    real = {k: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"}
    want = IO.tensors(conf)
    assert set(want) == set(real)
    assert {k: s for k, (s, _, _) in want.items()} == real
    paths = {p for _, p, _ in want.values()}
    layer = {"wq", "wk", "wv", "wo", "q_norm", "k_norm", "w_gate", "w_up", "w_down", "attn_norm", "mlp_norm"}
    assert paths == {("fc",), ("hidden_norm",), ("norm",)} | {("layers", i, k) for i in range(5) for k in layer}
    assert IO.layout(conf) == IO.ASSISTANT
    hc = IO.head_config(conf, 202048)
    assert (hc.hidden_size, hc.num_layers, hc.head_dim, hc.sliding_window, hc.rope.theta) == (6656, 5, 128, 2049,
                                                                                              500000.0)
    assert [IO._field(conf, k) for k in ("block_size", "mask_token_id", "target_layer_ids")] == \
        [16, 201818, [1, 13, 25, 37, 49]]


@needs_real
def test_the_dflash2_drafter_is_refused_by_name(target):
    """z-lab's DFlash2 drafter for Muse Glimmer is refused before any weight is read, naming its candidate
    selector and its layers' convolutions."""
    for call in (lambda: IO.load_head(DFLASH2_DIR, target),
                 lambda: IO.layout(json.load(open(os.path.join(DFLASH2_DIR, "config.json"))))):
        with pytest.raises(ValueError, match=r"DFlash2.*candidate_selector.*attention_conv / mlp_conv"):
            call()
