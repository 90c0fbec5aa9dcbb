"""Tiny random Qwen3 and Qwen3-MoE targets, a small Qwen3 draft model for each, and drafters written in the layouts
their authors publish (z-lab's DFlash, an EAGLE-3 head in `speculators`' and in the EAGLE repository's layout),
shared by tests/test_qwen3_strategies.py and tests/qwen3_sharded_checks.py; and the strategies a Muse Glimmer
target runs in the same settings, with its one-layer draft (tests/test_muse_glimmer_strategies.py).

Two kinds of drafters are written:
- `random_dirs`: directories written by hand, field for field as the published drafters for Qwen3 targets hold
  them, with random values: they must load and decode as AR, whatever they draft;
- `useful_heads`: the conformance registry's drafters that draft accepted tokens on tiny targets
  (tests/strategies.py), saved by jspec in the published layouts with jspec's own notes removed, and loaded back:
  the strategies' accepted paths are exercised on the new targets.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import NamedTuple

import numpy as np

import jspec
import ports
from jspec.parts.drafters import dflash_io, eagle3_io
from ports.families import qwen3 as Q3
from strategies import SMALL_TREE, dflash_head, eagle3_head, every_third_dropped, guarded
from tiny_pairs import PROMPTS  # noqa: F401  (the ragged batch of 3 the tests decode; vocabulary 97)

V = 97
COMMON = {"vocab_size": V, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 24, "rms_norm_eps": 1e-6,
          "bos_token_id": None, "eos_token_id": None}
KINDS = ("qwen3", "qwen3_moe")


def _damp(target):
    """Later layers' branches scaled by 0.3 (as tiny_pairs does), so that a draft of the first layer agrees with
    the target often but not always."""
    for layer in target.params["layers"][1:]:
        for k in ("wo", "w_down", "we_down"):
            if k in layer:
                layer[k] = layer[k] * 0.3
    return target


def tiny_target(kind: str):
    """A 3-layer `qwen3` (head_dim 24, not hidden / heads; tied embeddings; layer 2 slides over a window of 4:
    `max_window_layers` 2) or `qwen3_moe` (untied; layer 0 dense by `mlp_only_layers`, layers 1 and 2 over 8
    experts, top 2, `norm_topk_prob`), random, later layers damped."""
    if kind == "qwen3":
        d = {**COMMON, "model_type": "qwen3", "tie_word_embeddings": True, "use_sliding_window": True,
             "sliding_window": 4, "max_window_layers": 2}
    elif kind == "qwen3_moe":
        d = {**COMMON, "model_type": "qwen3_moe", "num_experts": 8, "num_experts_per_tok": 2,
             "moe_intermediate_size": 32, "mlp_only_layers": [0], "norm_topk_prob": True}
    else:
        raise ValueError(kind)
    return _damp(ports.random_model(Q3.config_from_hf(d), key=3, std=0.3))


def qwen3_draft(target):
    """A one-layer dense `qwen3` draft: the target's first (dense) layer, embedding, final norm and LM head (the
    way a Qwen3-0.6B drafts for a larger Qwen3 or Qwen3-MoE: same vocabulary, fewer and narrower layers)."""
    cfg = dataclasses.replace(target.config, model_type="qwen3", num_layers=1, num_experts=0, num_experts_per_tok=0,
                              moe_intermediate_size=0, norm_topk_prob=False, mlp_only_layers=(),
                              full_attention_layers=(), sliding_window=None)
    return ports.Model(cfg, {**target.params, "layers": target.params["layers"][:1]})


# ------------------------------------------------------------------------------------------ published layouts


def _rand(rng, scale=0.3):
    return lambda *s: (scale * rng.standard_normal(s)).astype(np.float32)


def write_zlab_dflash(path: str, target, seed: int = 0, ids=(0, 2), block: int = 5) -> dict:
    """z-lab's DFlashDraftModel directory for `target` (Qwen3-8B-DFlash's config fields at the target's widths, its
    tensor names, 2 Qwen3 layers with q/k norms), random values. Returns the config."""
    cfg = target.config
    D, F, H, KVH, Dh = cfg.hidden_size, 80, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    conf = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "attention_bias": False,
            "block_size": block, "dflash_config": {"mask_token_id": V - 1, "target_layer_ids": list(ids)},
            "head_dim": Dh, "hidden_act": "silu", "hidden_size": D, "intermediate_size": F,
            "layer_types": ["full_attention"] * 2, "max_position_embeddings": 40960, "max_window_layers": 2,
            "num_attention_heads": H, "num_hidden_layers": 2, "num_key_value_heads": KVH,
            "num_target_layers": cfg.num_layers, "rms_norm_eps": 1e-6, "rope_scaling": None, "rope_theta": 1000000,
            "sliding_window": None, "tie_word_embeddings": False, "use_sliding_window": False, "vocab_size": V,
            "torch_dtype": "bfloat16"}
    r = _rand(np.random.default_rng(seed))
    t = {"fc.weight": r(D, len(ids) * D), "hidden_norm.weight": 1 + r(D), "norm.weight": 1 + r(D)}
    for i in range(2):
        p = f"layers.{i}."
        t.update({p + "self_attn.q_proj.weight": r(H * Dh, D), p + "self_attn.k_proj.weight": r(KVH * Dh, D),
                  p + "self_attn.v_proj.weight": r(KVH * Dh, D), p + "self_attn.o_proj.weight": r(D, H * Dh),
                  p + "self_attn.q_norm.weight": 1 + r(Dh), p + "self_attn.k_norm.weight": 1 + r(Dh),
                  p + "mlp.gate_proj.weight": r(F, D), p + "mlp.up_proj.weight": r(F, D),
                  p + "mlp.down_proj.weight": r(D, F), p + "input_layernorm.weight": 1 + r(D),
                  p + "post_attention_layernorm.weight": 1 + r(D)})
    _write(path, conf, t)
    return conf


def _eagle3_layer_config(target, F: int = 160) -> dict:
    """The LLaMA decoder layer config of the EAGLE-3 heads published for Qwen3 targets, at the target's widths
    (head_dim from the target, as Qwen3's is not hidden / heads; Qwen3's RoPE theta)."""
    cfg = target.config
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
            "attention_dropout": 0.0, "head_dim": cfg.head_dim, "hidden_act": "silu", "hidden_size": cfg.hidden_size,
            "initializer_range": 0.02, "intermediate_size": F, "max_position_embeddings": 40960, "mlp_bias": False,
            "num_attention_heads": cfg.num_heads, "num_hidden_layers": 1, "num_key_value_heads": cfg.num_kv_heads,
            "pretraining_tp": 1, "rms_norm_eps": 1e-6, "rope_scaling": None, "rope_theta": 1000000,
            "tie_word_embeddings": False, "use_cache": True, "vocab_size": V}


def _eagle3_tensors(target, prefix: str, draft_ids: np.ndarray, seed: int, F: int = 160) -> dict:
    """An EAGLE-3 head's tensors (fc, the decoder layer under `prefix` with hidden_norm and 2D-wide q / k / v, norm,
    lm_head over the draft vocabulary, d2t and t2d), random values."""
    cfg = target.config
    D, H, KVH, Dh, Vd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, draft_ids.size
    r = _rand(np.random.default_rng(seed))
    t = {"fc.weight": r(D, 3 * D), "norm.weight": 1 + r(D), "lm_head.weight": r(Vd, D),
         "d2t": (draft_ids - np.arange(Vd)).astype(np.int64), "t2d": np.isin(np.arange(V), draft_ids)}
    layer = {"hidden_norm.weight": 1 + r(D), "input_layernorm.weight": 1 + r(D),
             "self_attn.q_proj.weight": r(H * Dh, 2 * D), "self_attn.k_proj.weight": r(KVH * Dh, 2 * D),
             "self_attn.v_proj.weight": r(KVH * Dh, 2 * D), "self_attn.o_proj.weight": r(D, H * Dh),
             "post_attention_layernorm.weight": 1 + r(D), "mlp.gate_proj.weight": r(F, D),
             "mlp.up_proj.weight": r(F, D), "mlp.down_proj.weight": r(D, F)}
    t.update({prefix + k: v for k, v in layer.items()})
    return t


DRAFT_IDS = np.arange(0, V, 3)  # a 33-token draft vocabulary (published Qwen3 heads keep 32000 of 151936)
SPECULATORS_AUX = (0, 1, 3)  # the layers the speculators head names; the EAGLE layout's head reads the default ones


def write_speculators_eagle3(path: str, target, seed: int = 1) -> dict:
    """An EAGLE-3 head in `speculators`' layout for `target`, as the speculators heads for Qwen3 targets are
    published (Eagle3Speculator, a LLaMA `transformer_layer_config`, norm_before_residual, the verifier's
    Qwen3 architecture, `layers.0.*` names), random values. Returns the config."""
    arch = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}[target.config.model_type]
    conf = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "speculators_version": "0.2.0",
            "draft_vocab_size": int(DRAFT_IDS.size), "norm_before_residual": True,
            "eagle_aux_hidden_state_layer_ids": list(SPECULATORS_AUX), "target_hidden_size": None,
            "transformer_layer_config": _eagle3_layer_config(target), "torch_dtype": "bfloat16",
            "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                   "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3,
                                                         "accept_tolerance": 0.0, "verifier_accept_k": 1}],
                                   "verifier": {"architectures": [arch], "name_or_path": "Qwen/Qwen3-8B"}}}
    _write(path, conf, _eagle3_tensors(target, "layers.0.", DRAFT_IDS, seed))
    return conf


def write_eagle_repo_eagle3(path: str, target, seed: int = 2) -> dict:
    """An EAGLE-3 head in the EAGLE repository's layout for `target`, as its Qwen3 heads are published (a flat
    LlamaForCausalLMEagle3 config with draft_vocab_size, `midlayer.*` names, d2t / t2d; no layer ids), random
    values. Returns the config."""
    conf = {**_eagle3_layer_config(target), "architectures": ["LlamaForCausalLMEagle3"],
            "draft_vocab_size": int(DRAFT_IDS.size), "torch_dtype": "bfloat16"}
    _write(path, conf, _eagle3_tensors(target, "midlayer.", DRAFT_IDS, seed))
    return conf


def _write(path: str, conf: dict, tensors: dict) -> None:
    """config.json and model.safetensors, the floats in bfloat16 (as the drafters are published)."""
    import ml_dtypes

    from jspec.parts.drafters import heads as H

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(conf, f, indent=1)
    H.write_weights(os.path.join(path, "model.safetensors"),
                    {k: v.astype(ml_dtypes.bfloat16) if v.dtype == np.float32 else v for k, v in tensors.items()})


class Heads(NamedTuple):
    dflash: object  # a DFlashHead read from z-lab's layout
    eagle3_speculators: object  # an Eagle3Head read from speculators' layout
    eagle3_eagle: object  # an Eagle3Head read from the EAGLE repository's layout


def random_dirs(target, root: str) -> Heads:
    """The hand-written random drafters (module docstring) for `target` under `root`, loaded."""
    write_zlab_dflash(os.path.join(root, "zlab"), target)
    write_speculators_eagle3(os.path.join(root, "speculators"), target)
    write_eagle_repo_eagle3(os.path.join(root, "eagle"), target)
    return Heads(dflash_io.load_head(os.path.join(root, "zlab"), target),
                 eagle3_io.load_head(os.path.join(root, "speculators"), target),
                 eagle3_io.load_head(os.path.join(root, "eagle"), target))


def _as_published(path: str) -> None:
    """Remove what jspec adds beside the authors' files (eagle3_head.json; config.json's `jspec` entry), so the
    directory holds only what the published layout does."""
    meta = os.path.join(path, eagle3_io.META_NAME)
    if os.path.exists(meta):
        os.remove(meta)
    conf_path = os.path.join(path, "config.json")
    with open(conf_path) as f:
        conf = json.load(f)
    conf.pop("jspec", None)
    with open(conf_path, "w") as f:
        json.dump(conf, f, indent=1)


def useful_heads(target, root: str) -> Heads:
    """The registry's drafters that draft accepted tokens (tests/strategies.py: `dflash_head`, `eagle3_head` over
    a reduced vocabulary and over the whole one), saved in z-lab's, speculators' and the EAGLE repository's
    layouts under `root` without jspec's notes, and loaded back."""
    L = target.config.num_layers
    dflash_io.save_head(dflash_head(target), os.path.join(root, "zlab"))
    eagle3_io.save_head(eagle3_head(target, every_third_dropped(target)), os.path.join(root, "speculators"),
                        "speculators", target=target)
    eagle3_io.save_head(eagle3_head(target), os.path.join(root, "eagle"), "eagle", target=target)
    for d in ("zlab", "speculators", "eagle"):
        _as_published(os.path.join(root, d))
    return Heads(dflash_io.load_head(os.path.join(root, "zlab"), target),
                 eagle3_io.load_head(os.path.join(root, "speculators"), target),
                 eagle3_io.load_head(os.path.join(root, "eagle"), target, aux_layers=(0, L // 2, L)))


NAMES = ("chain", "tree", "dflash_chain", "dflash_ddtree", "eagle3_chain", "eagle3_tree", "guarded_chain")
# on the MoE target by default (its AR and Chain on such a mesh: tests/moe_sharded_checks.py); the rest: slow
MESH_DEFAULT = ("dflash_ddtree", "eagle3_chain")
# what tests/test_muse_glimmer_strategies.py runs over a Muse Glimmer target (EAGLE-3 refuses one), and on the mesh
# by default
MUSE_NAMES = ("chain", "tree", "dflash_chain", "dflash_ddtree", "guarded_chain")
MUSE_MESH_DEFAULT = ("chain", "dflash_chain")


def mesh_names(slow: bool, family: str = "qwen3") -> list[str]:
    """The "kind/name" cases tests/qwen3_sharded_checks.py decodes on the mesh. Qwen3: MESH_DEFAULT on the
    qwen3_moe target, or with `slow` every other strategy on it and all of them on the dense qwen3 target. Muse
    Glimmer: MUSE_MESH_DEFAULT, or with `slow` the other MUSE_NAMES."""
    if family == "muse_glimmer":
        return [f"muse_glimmer/{n}" for n in MUSE_NAMES if (n in MUSE_MESH_DEFAULT) != slow]
    default = [f"qwen3_moe/{n}" for n in MESH_DEFAULT]
    return default if not slow else [f"{k}/{n}" for k in KINDS for n in NAMES if f"{k}/{n}" not in default]


def model_and_block(draft, dflash) -> dict:
    """Chain and Tree with the draft model, DFlash's chain and DDTree with the block drafter `dflash`, and the guard
    over the chain, by name: the strategies every target family here runs, in the same settings."""
    return {
        "chain": jspec.Chain(draft, gamma=3),
        "tree": jspec.Tree(draft, tree=SMALL_TREE),
        "dflash_chain": jspec.DFlash(dflash),
        "dflash_ddtree": jspec.DFlash(dflash, tree="ddtree", top_k=3, total=8, depth=3),
        "guarded_chain": guarded(jspec.Chain(draft, gamma=3)),
    }


def strategies(draft, heads: Heads) -> dict:
    """Every strategy the tests run over a Qwen3 target, by name: `model_and_block`'s with z-lab's DFlash head,
    EAGLE-3 as a chain (speculators' head) and as a static tree (the EAGLE layout's head)."""
    out = {**model_and_block(draft, heads.dflash),
           "eagle3_chain": jspec.Eagle3(heads.eagle3_speculators, tree="chain", depth=3),
           "eagle3_tree": jspec.Eagle3(heads.eagle3_eagle, tree=[[0], [1], [0, 0], [1, 0], [0, 0, 0]])}
    assert set(out) == set(NAMES)
    return out


# ------------------------------------------------------------------------------------------ Muse Glimmer


def muse_glimmer_draft(target):
    """A one-layer Muse Glimmer draft: the target's first layer (a sliding one with rotary positions), its tower,
    adapter, embedding, final norm and LM head, so it reads the target's image and video prompts itself."""
    text = dataclasses.replace(target.config.text, num_layers=1, full_attention_layers=(), nope_layers=())
    lm = {**target.params["lm"], "layers": target.params["lm"]["layers"][:1]}
    return ports.Model(dataclasses.replace(target.config, text=text), {**target.params, "lm": lm})
