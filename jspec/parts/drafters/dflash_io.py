"""Block drafters (`jspec.parts.drafters.dflash.DFlashHead`) on disk, in the layouts their authors publish.

`load_head` reads two layouts, each a config.json and a model.safetensors:
- z-lab's DFlash drafters (`architectures: ["DFlashDraftModel"]`, `model_type: "qwen3"`): Qwen3's config fields,
  and `block_size`, `mask_token_id` and `target_layer_ids` in `dflash_config` or at the top level (z-lab's code
  reads both); tensors `fc.weight` [D, n * D], `hidden_norm.weight`, `norm.weight` and Qwen3 decoder layers
  `layers.{i}.self_attn.{q,k,v,o}_proj.weight`, `layers.{i}.self_attn.{q,k}_norm.weight`,
  `layers.{i}.mlp.{gate,up,down}_proj.weight`, `layers.{i}.{input,post_attention}_layernorm.weight` (and the
  projections' biases under `attention_bias`);
- Meta's Muse Glimmer assistant (`model_type: "muse_glimmer_assistant"`): the same layers, `encoder.fc.weight` and
  `encoder.output_norm_enc.weight` in place of `fc` and `hidden_norm`, the three fields at the top level, and
  sliding-window layers (transformers' mask: |q - k| <= sliding_window).
In both, `target_layer_ids` count from 0: id i is the output of the target's layer i, so jspec's `target_layers`
are the ids plus one; the mask positions' input is the target's embedding of `mask_token_id`.

Refused, each with its reason: z-lab's DFlash2 (`DFlash2DraftModel`: a candidate selector and convolutions in each
layer, which jspec does not implement); a logit multiplier, soft-cap or input-embedding scale; causal attention
within the block; layers mixing windows; jspec's older layout (a learned `mask_embedding`).

`save_head` writes z-lab's layout, which their `DFlashDraftModel` loads, plus a `jspec` entry in config.json (the
target's signature and how the head was trained; z-lab's code ignores it). A reduced draft vocabulary goes to
`draft_vocab.safetensors` beside it: z-lab's layout has no field for one, and their code scores every token.
The token embedding and the LM head are the target's and are never stored.
"""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from jspec.parts.drafters import dflash as DF
from jspec.parts.drafters import eagle as EG
from jspec.parts.drafters import heads as H
from ports.core.config import TextConfig, rope_from_hf, text_config_to_hf

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
VOCAB_NAME = "draft_vocab.safetensors"
ASSISTANT = "muse_glimmer_assistant"
# jspec's layer params and the Qwen3 layer tensors they are, ("T": stored [out, in])
LAYER_NAMES = {"wq": ("self_attn.q_proj.weight", "T"), "wk": ("self_attn.k_proj.weight", "T"),
               "wv": ("self_attn.v_proj.weight", "T"), "wo": ("self_attn.o_proj.weight", "T"),
               "q_norm": ("self_attn.q_norm.weight", None), "k_norm": ("self_attn.k_norm.weight", None),
               "w_gate": ("mlp.gate_proj.weight", "T"), "w_up": ("mlp.up_proj.weight", "T"),
               "w_down": ("mlp.down_proj.weight", "T"), "attn_norm": ("input_layernorm.weight", None),
               "mlp_norm": ("post_attention_layernorm.weight", None)}
BIAS_NAMES = {"bq": "self_attn.q_proj.bias", "bk": "self_attn.k_proj.bias", "bv": "self_attn.v_proj.bias",
              "bo": "self_attn.o_proj.bias"}
# the head-level tensors of each layout
TOP_NAMES = {"dflash": {"fc": "fc.weight", "hidden_norm": "hidden_norm.weight", "norm": "norm.weight"},
             ASSISTANT: {"fc": "encoder.fc.weight", "hidden_norm": "encoder.output_norm_enc.weight",
                         "norm": "norm.weight"}}


def layout(conf: dict) -> str:
    """"dflash" (z-lab's) or "muse_glimmer_assistant" for a drafter's config.json; ValueError for any other, naming
    what jspec lacks for it."""
    arch = list(conf.get("architectures") or [])
    if "DFlash2DraftModel" in arch:
        raise ValueError("a DFlash2 drafter (DFlash2DraftModel) is not supported: jspec implements neither its "
                         "candidate_selector (the codebooks that rescore each position's top tokens along the path) "
                         "nor the attention_conv / mlp_conv convolutions in its layers")
    if conf.get("model_type") == ASSISTANT or "MuseGlimmerAssistantModel" in arch:
        return ASSISTANT
    if "DFlashDraftModel" in arch or "dflash_config" in conf:
        return "dflash"
    raise ValueError(f"config.json describes no DFlash drafter (architectures {arch}, model_type "
                     f"{conf.get('model_type')!r}): jspec reads z-lab's DFlashDraftModel and the Muse Glimmer "
                     "assistant")


def _field(conf: dict, name: str, default=None):
    """A DFlash field where z-lab's code looks for it: `dflash_config` first, then the top level."""
    return (conf.get("dflash_config") or {}).get(name, conf.get(name, default))


def _window(conf: dict, kind: str) -> int | None:
    """The head's window in jspec's convention (positions less than it apart see each other; None: all), from the
    config's layer types; ValueError for causal blocks or layers of different windows."""
    n = int(conf["num_hidden_layers"])
    if kind == ASSISTANT:  # transformers' MuseGlimmerAssistant: bidirectional, |q - k| <= sliding_window
        types = conf.get("layer_types") or ["sliding_attention"] * n
        wins = {int(conf["sliding_window"]) + 1 if t == "sliding_attention" else None for t in types}
    else:  # z-lab's Qwen3DFlashAttention over Qwen3Config: |q - k| < sliding_window where use_sliding_window
        types = conf.get("layer_types") or ["sliding_attention" if conf.get("use_sliding_window") and
                                            i >= int(conf.get("max_window_layers", 28)) else "full_attention"
                                            for i in range(n)]
        causal = conf.get("is_causal")
        if any((t == "sliding_attention") if causal is None else bool(causal) for t in types):
            raise ValueError("this drafter attends causally within the block (is_causal, or sliding layers without "
                             "is_causal: false): jspec's block drafter attends both ways")
        w = conf.get("sliding_window") if conf.get("use_sliding_window") else None
        wins = {int(w) if t == "sliding_attention" and w is not None else None for t in types}
    if len(wins) != 1:
        raise ValueError(f"this drafter's layers attend under different windows ({conf.get('layer_types')}): jspec's "
                         "block drafter has one window for all its layers")
    return wins.pop()


def _refuse_unsupported(conf: dict) -> None:
    for name, neutral in (("output_multiplier", 1.0), ("input_embedding_scale", 1.0)):
        v = _field(conf, name)
        if v is not None and float(v) != neutral:
            raise ValueError(f"this drafter sets {name}={v}: jspec's block drafter applies no such factor")
    if _field(conf, "final_logit_softcapping"):
        raise ValueError("this drafter soft-caps its logits (final_logit_softcapping): jspec's block drafter does not")
    if conf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {conf.get('hidden_act')!r}: the drafter's layers must use silu")


def head_config(conf: dict, vocab_size: int) -> TextConfig:
    """The head's decoder config from a drafter's config.json (its own widths, RoPE and window)."""
    kind = layout(conf)
    heads = int(conf["num_attention_heads"])
    bias = bool(conf.get("attention_bias", False))
    return TextConfig(model_type="qwen3", vocab_size=vocab_size, hidden_size=int(conf["hidden_size"]),
                      intermediate_size=int(conf["intermediate_size"]), num_layers=int(conf["num_hidden_layers"]),
                      num_heads=heads, num_kv_heads=int(conf.get("num_key_value_heads") or heads),
                      head_dim=int(conf.get("head_dim") or int(conf["hidden_size"]) // heads),
                      rms_norm_eps=float(conf.get("rms_norm_eps", 1e-6)), rope=rope_from_hf(conf),
                      max_position_embeddings=int(conf.get("max_position_embeddings", 2048)), qkv_bias=bias,
                      o_bias=bias, sliding_window=_window(conf, kind))


def tensors(conf: dict) -> dict[str, tuple[tuple, tuple, str | None]]:
    """Every tensor a drafter of this config.json holds: name -> (shape, jspec param path, "T" when stored
    [out, in]). Shapes are the config's own (full size)."""
    kind = layout(conf)
    hc = head_config(conf, 1)
    D, F, Dh = hc.hidden_size, hc.intermediate_size, hc.head_dim
    q, kv = hc.num_heads * Dh, hc.num_kv_heads * Dh
    n = len(_field(conf, "target_layer_ids") or ())
    top = TOP_NAMES[kind]
    out = {top["fc"]: ((D, n * D), ("fc",), "T"), top["hidden_norm"]: ((D,), ("hidden_norm",), None),
           top["norm"]: ((D,), ("norm",), None)}
    shape = {"wq": (q, D), "wk": (kv, D), "wv": (kv, D), "wo": (D, q), "q_norm": (Dh,), "k_norm": (Dh,),
             "w_gate": (F, D), "w_up": (F, D), "w_down": (D, F), "attn_norm": (D,), "mlp_norm": (D,),
             "bq": (q,), "bk": (kv,), "bv": (kv,), "bo": (D,)}
    for i in range(hc.num_layers):
        for key, (name, tr) in LAYER_NAMES.items():
            out[f"layers.{i}.{name}"] = (shape[key], ("layers", i, key), tr)
        if hc.qkv_bias:
            for key, name in BIAS_NAMES.items():
                out[f"layers.{i}.{name}"] = (shape[key], ("layers", i, key), None)
    return out


def load_head(directory: str, target, dtype=None) -> DF.DFlashHead:
    """The drafter in `directory` (either layout of the module docstring), checked against `target`; its floats
    as `dtype` (default the target's). ValueError naming what is missing, refused or does not fit."""
    conf = H.read_meta(os.path.join(directory, CONFIG_NAME), what="block drafter")
    kind = layout(conf)
    _refuse_unsupported(conf)
    path = os.path.join(directory, WEIGHTS_NAME)
    if not os.path.exists(path):
        raise ValueError(f"{directory} holds no {WEIGHTS_NAME}")
    sd = H.read_weights(path)
    if "mask_embedding" in sd:
        raise ValueError(f"{path} is jspec's older layout (a learned mask_embedding): jspec's block drafters now "
                         "feed the mask positions the target's embedding of a mask token id, as the authors do; "
                         "train the head again (jspec train dflash)")
    cfg, lm = DF.text_parts(target)
    ids, mask_token = _field(conf, "target_layer_ids"), _field(conf, "mask_token_id")
    if ids is None or mask_token is None:
        raise ValueError(f"{directory}/{CONFIG_NAME} lacks {'target_layer_ids' if ids is None else 'mask_token_id'}")
    for name, theirs, ours in (("vocab_size", conf.get("vocab_size"), cfg.vocab_size),
                               ("num_target_layers", _field(conf, "num_target_layers"), cfg.num_layers)):
        if theirs is not None and int(theirs) != ours:
            raise ValueError(f"this drafter was made for a target with {name} {theirs}; the target's is {ours}")
    want = tensors(conf)
    missing, extra = sorted(set(want) - set(sd)), sorted(set(sd) - set(want))
    if missing:
        raise ValueError(f"{path} lacks {missing[:4]}{' ...' if len(missing) > 4 else ''}")
    if extra:
        raise ValueError(f"{path} holds tensors a {kind} drafter does not have: {extra[:4]}")
    hcfg = head_config(conf, cfg.vocab_size)
    dt = dtype or lm["embed"].dtype
    params = {"layers": [dict() for _ in range(hcfg.num_layers)]}
    for name, (shape, p, tr) in want.items():
        a = sd[name]
        if tuple(a.shape) != shape:
            raise ValueError(f"{path}: {name} is {tuple(a.shape)}, not {shape} as config.json makes it")
        a = jnp.asarray(a.T if tr == "T" else a, dt)
        if p[0] == "layers":
            params["layers"][p[1]][p[2]] = a
        else:
            params[p[0]] = a
    meta = conf.get("jspec") or {}
    sig = DF.signature(target)
    if "target" in meta:  # written by jspec: the target it was trained for
        t = meta["target"]
        sig = EG.FeatureHeadTarget(t["model_type"], int(t["hidden_size"]), int(t["vocab_size"]),
                                   float(t["fingerprint"]))
    vpath = os.path.join(directory, VOCAB_NAME)
    vocab = jnp.asarray(H.read_weights(vpath)["draft_vocab"], jnp.int32) if os.path.exists(vpath) else None
    head = DF.DFlashHead(params, hcfg, tuple(int(i) + 1 for i in ids), sig, int(_field(conf, "block_size", 16)),
                         vocab, int(mask_token))
    head.check(target)
    return head


def state_dict(head: DF.DFlashHead) -> dict[str, np.ndarray]:
    """The head's tensors under z-lab's names, numpy; ValueError for a head without q / k norms (z-lab's layers
    have them)."""
    get = lambda a: np.asarray(jax.device_get(a))  # noqa: E731
    if any("q_norm" not in p or "k_norm" not in p for p in head.params["layers"]):
        raise ValueError("z-lab's layout has q_norm / k_norm in every layer; this head's layers lack them")
    out = {}
    for name, (_, p, tr) in tensors(config(head)).items():
        a = get(head.params[p[0]] if p[0] != "layers" else head.params["layers"][p[1]][p[2]])
        out[name] = a.T if tr == "T" else a
    return out


def config(head: DF.DFlashHead, extra: dict | None = None) -> dict:
    """z-lab's config.json for `head` (Qwen3's fields in transformers' spelling, the DFlash fields in
    `dflash_config` and `block_size` at the top level too), with `jspec`: the target's signature, the draft
    vocabulary's size and `extra`."""
    c = head.config
    w, n = c.sliding_window, c.num_layers
    return {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size, "num_hidden_layers": n, "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps,
        "hidden_act": "silu", "attention_bias": bool(c.qkv_bias),
        "rope_parameters": text_config_to_hf(c)["rope_parameters"], "rope_theta": c.rope.theta,
        "max_position_embeddings": c.max_position_embeddings, "vocab_size": head.target.vocab_size,
        "tie_word_embeddings": False, "use_sliding_window": w is not None, "sliding_window": w,
        "max_window_layers": 0 if w is not None else n, "is_causal": False,
        "layer_types": ["sliding_attention" if w is not None else "full_attention"] * n,
        "block_size": int(head.block),
        "dflash_config": {"block_size": int(head.block), "mask_token_id": int(head.mask_token),
                          "target_layer_ids": [int(i) - 1 for i in head.target_layers]},
        "jspec": {"target": head.target._asdict(), "draft_vocab": head.draft_vocab_size, **(extra or {})},
    }


def save_head(head: DF.DFlashHead, directory: str, *, dtype=None, extra: dict | None = None) -> str:
    """Write `head` to `directory` in z-lab's layout (module docstring), cast to `dtype` when given; returns the
    directory. `load_head` reads it back to an equal head."""
    if head.config.qkv_bias != head.config.o_bias or head.config.mlp_bias:
        raise ValueError("z-lab's layers have biases on all four attention projections or none, and none in the MLP")
    os.makedirs(directory, exist_ok=True)
    H.write_meta(os.path.join(directory, CONFIG_NAME), config(head, extra))
    sd = state_dict(head)
    if dtype is not None:
        sd = {k: v.astype(jnp.dtype(dtype)) for k, v in sd.items()}
    H.write_weights(os.path.join(directory, WEIGHTS_NAME), sd)
    vpath = os.path.join(directory, VOCAB_NAME)
    if head.vocab is not None:
        H.write_weights(vpath, {"draft_vocab": np.asarray(jax.device_get(head.vocab)).astype(np.int64)})
    elif os.path.exists(vpath):
        os.remove(vpath)
    return directory
