"""The multi-token-prediction head a Qwen3.5 checkpoint ships (`mtp.*`), as a drafter: no second download, no
training.

One MTP step (vLLM's and transformers' `MtpLayer` for this layout): for the token x_{t+1} and the target's final,
normed hidden state h_t,

    g = fc([norm_e(e(x_{t+1})); norm_h(h_t)]),  g = the head's decoder layers(g),  f = norm(g)

and f scores x_{t+2} under the target's LM head. Deeper drafts apply the same head to its own f and the token it
drafted (recursively, as vLLM and transformers' MTP candidate generator do with one MTP layer). The norms scale by
1 + weight; the decoder layers are Qwen3.5's gated full-attention layers (q/k norms, partial RoPE, an output
gate; experts for a Qwen3.5-MoE). The pairing of tokens with features, the head's cache, the feed of verified
tokens and the tree levels are EAGLE's (`jspec.parts.drafters.eagle.EagleDrafter`): only the head's computation
differs.

Checkpoint names (the target's own files): mtp.fc.weight [D, 2D], mtp.pre_fc_norm_embedding.weight,
mtp.pre_fc_norm_hidden.weight, mtp.norm.weight [D], and mtp.layers.N.* under the decoder's own names.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jspec.parts.drafters import eagle as EG
from jspec.parts.drafters import heads as H
from ports.core import cache as kvc
from ports.core import fused as FU
from ports.core import hf_layout as HL
from ports.core import layers as LY
from ports.families import llama
from ports.families import qwen3_5 as Q5
from ports.core.param_paths import empty_like_shapes, get_path, set_path
from ports.core.safetensors_io import SafetensorsFile, checkpoint_files

FAMILIES = ("qwen3_5_text", "qwen3_5_moe_text")
VLM_FAMILIES = ("qwen3_5", "qwen3_5_moe")  # `ports.families.qwen3_5_vl`: the language model under "lm"


def text_parts(target) -> tuple[Any, dict]:
    """(text config, language-model params) of a Qwen3.5 target (a vision-language one's language model);
    ValueError otherwise."""
    model = getattr(target, "model", target)  # a guided wrapper holds its model
    if getattr(getattr(model, "config", None), "model_type", None) in VLM_FAMILIES:
        return model.config.text, model.params["lm"]
    return H.text_model(target, FAMILIES, "an MTP head needs a Qwen3.5 target (qwen3_5_text, qwen3_5_moe_text, "
                                          "qwen3_5, qwen3_5_moe)")


@struct.dataclass
class MTPHead:
    """The MTP head of a Qwen3.5 target: params = {"fc": [2D, D], "pre_emb_norm", "pre_hidden_norm", "norm": [D],
    "layers": the head's decoder layers (Qwen3.5 full-attention layers, run layout)}; `config`: the target's text
    config with those layers only."""

    params: dict
    config: Q5.Qwen35Config = struct.field(pytree_node=False)
    target: EG.FeatureHeadTarget = struct.field(pytree_node=False)

    @property
    def num_params(self) -> int:
        return H.num_params(self.params)

    def check(self, target) -> None:
        cfg, lm = text_parts(target)
        H.check_made_for("MTP head", self.target, EG.signature_of(cfg, lm))


def head_config(cfg: Q5.Qwen35Config, num_layers: int) -> Q5.Qwen35Config:
    """The target's text config with `num_layers` full-attention layers (the head's)."""
    return dataclasses.replace(cfg, num_layers=num_layers, linear_layers=())


def key_map(cfg: Q5.Qwen35Config, num_layers: int) -> list:
    """(checkpoint name, param path, transform) rows of an MTP head of `num_layers` layers."""
    rows = [("mtp.fc.weight", ("fc",), "T"), ("mtp.pre_fc_norm_embedding.weight", ("pre_emb_norm",), None),
            ("mtp.pre_fc_norm_hidden.weight", ("pre_hidden_norm",), None), ("mtp.norm.weight", ("norm",), None)]
    return rows + [r for r in Q5.hf_key_map(head_config(cfg, num_layers), prefix="mtp.") if r[1][0] == "layers"]


def head_shapes(cfg: Q5.Qwen35Config, num_layers: int) -> dict:
    D = cfg.hidden_size
    layers = Q5.param_shapes(head_config(cfg, num_layers))["layers"]
    return {"fc": (2 * D, D), "pre_emb_norm": (D,), "pre_hidden_norm": (D,), "norm": (D,), "layers": layers}


def load_head(directory: str, target, dtype=None) -> MTPHead:
    """The MTP head stored in a Qwen3.5 checkpoint directory (the target's own files: only the `mtp.*` tensors are
    read), for `target` (the model loaded from that directory), in `dtype` (default: the target's). ValueError when
    the checkpoint has no MTP head (`mtp_num_hidden_layers` 0 or no `mtp.*` tensors), when a tensor is missing or
    mis-shaped, or when an `mtp.*` tensor is one the head does not use (named)."""
    cfg, lm = text_parts(target)
    n = getattr(cfg, "mtp_layers", 0)
    if n < 1:
        raise ValueError(f"the target's config has no MTP head (mtp_num_hidden_layers = {n})")
    files = {}
    for path in checkpoint_files(directory):
        f = SafetensorsFile(path)
        files.update({k: f for k in f.keys() if k.startswith("mtp.")})
    if not files:
        raise ValueError(f"{directory}: the checkpoint holds no mtp.* tensors (a Qwen3.5 checkpoint without its MTP "
                         "head, or one saved without it)")
    rows = key_map(cfg, n)
    shapes = head_shapes(cfg, n)
    known = {r[0] for r in rows}
    missing = [r[0] for r in rows if r[0] not in files]
    unused = sorted(set(files) - known)
    bad = []
    params = empty_like_shapes(shapes)
    for name, path, tr in rows:
        if name not in files:
            continue
        want = tuple(get_path(shapes, path))
        got = HL.hf_shape_to_ours(files[name].shape(name), tr)
        if got != want:
            bad.append(f"{name}: {files[name].shape(name)} (expected {HL.expected_hf_shape(want, tr)})")
            continue
        set_path(params, path, HL.hf_to_ours(files[name].get(name).astype(np.float32), tr))
    if missing or unused or bad:
        raise HL.key_mismatch_error(f"{directory}: the MTP head does not match the target's config "
                                    f"(mtp_num_hidden_layers {n}):", missing, unused, bad)
    params["layers"] = [FU.fuse_layer(head_config(cfg, n), _stack_experts(layer)) for layer in params["layers"]]
    dt = dtype or lm["embed"].dtype
    params = jax.tree.map(lambda a: jnp.asarray(a, dt), params)
    return MTPHead(params, head_config(cfg, n), EG.signature_of(cfg, lm))


def _stack_experts(layer: dict) -> dict:
    return {k: (np.stack(v) if isinstance(v, list) else v) for k, v in layer.items()}


def init_head(target, key: jax.Array, num_layers: int = 1, scale: float = 0.02, dtype=None) -> MTPHead:
    """An MTP head with random weights (N(0, scale) matrices, norms 0: scale 1) for `target`."""
    cfg, lm = text_parts(target)
    shapes = head_shapes(cfg, num_layers)
    shapes["layers"] = Q5.param_shapes(head_config(cfg, num_layers), stacked_experts=True)["layers"]
    params = llama.init_from_shapes(shapes, key, jnp.float32, scale)
    for k in ("pre_emb_norm", "pre_hidden_norm", "norm"):
        params[k] = jnp.zeros_like(params[k])
    layers = []
    for layer in params["layers"]:
        layer = {k: (jnp.zeros_like(v) if k.endswith("norm") else v) for k, v in layer.items()}
        layers.append(FU.fuse_layer(head_config(cfg, num_layers), _stack_experts(layer)))
    params["layers"] = layers
    dt = dtype or lm["embed"].dtype
    return MTPHead(jax.tree.map(lambda a: jnp.asarray(a, dt), params), head_config(cfg, num_layers),
                   EG.signature_of(cfg, lm))


def head_forward(head: MTPHead, emb: jax.Array, feat: jax.Array, positions: jax.Array, cache: kvc.KVCache,
                 new_mask=None, write_offset: int = 0, fresh: bool = False):
    """f [R, T, D] of T new entries (token embeddings emb, the normed hidden states they pair with) and the head's
    cache with their K/V written at slots length + write_offset.. (`ports.families.llama.forward`'s contract)."""
    cfg, p = head.config, head.params
    eps = cfg.rms_norm_eps
    norm = LY.centered_rms_norm
    x = LY.linear(jnp.concatenate([norm(emb, p["pre_emb_norm"], eps),
                                   norm(feat.astype(emb.dtype), p["pre_hidden_norm"], eps)], axis=-1), p["fc"])
    visible = LY.prefill_visibility(cache, x.shape[1], new_mask, write_offset, fresh)
    start = cache.length + write_offset
    cos, sin = LY.rope_tables(cfg, positions)
    ks, vs = [], []
    for i, layer in enumerate(p["layers"]):
        a, kb, vb = Q5.gated_attention(cfg, layer, norm(x, layer["attn_norm"], eps), cos, sin, cache.k[i],
                                       cache.v[i], start, visible, fresh)
        x = x + a
        x = x + Q5.feed_forward(cfg, layer, norm(x, layer["mlp_norm"], eps))
        ks.append(kb)
        vs.append(vb)
    return norm(x, p["norm"], eps), cache.replace(k=ks, v=vs)


@struct.dataclass
class MTPDrafter(EG.EagleDrafter):
    """Drafts with an `MTPHead` (module docstring); state and steps are `EagleDrafter`'s: the head's entry for the
    token at target slot j pairs it with the target's normed hidden state at slot j - 1."""

    def text_parts(self, target):
        return text_parts(target)

    what = "MTP head"

    def draft_rows(self, cfg, lm: dict, head) -> None:
        return None

    def features(self, cfg, lm: dict, h: jax.Array) -> jax.Array:
        """The target's last hidden state under its final norm (what its LM head reads)."""
        return LY.centered_rms_norm(h, lm["final_norm"], cfg.rms_norm_eps)

    def run_head(self, cfg, emb, feat, positions, cache, new_mask=None, write_offset: int = 0, fresh: bool = False):
        return head_forward(self.head, emb, feat, positions, cache, new_mask, write_offset, fresh)

    def logits(self, cfg, lm: dict, f: jax.Array) -> jax.Array:
        return EG.lm_logits(cfg, lm, f)
