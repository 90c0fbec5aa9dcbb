"""Memory estimates: bytes per device of one decode run, from shapes alone (nothing is allocated).

`estimate(config, mesh_shape, batch, max_len, ...)` answers "does this target (and draft) fit on these devices?" on any
machine, e.g. a 1-CPU laptop planning for 8 GPUs or a TPU slice:

* params: `jax.eval_shape` of the family's `init_params` (abstract `ShapeDtypeStruct`s), placed by
  `jspec.core.sharding.param_shardings` on a `jax.sharding.AbstractMesh` of the requested shape; each leaf's bytes on
  one device come from `NamedSharding.shard_shape`, the split the real sharding makes;
* the target's KV cache: `jax.eval_shape` of `jspec.core.prefill.new_cache_for`, split by the engine's own
  `jspec.core.sharding.Placement.cache_spec` (batch over `data`, kv heads over `tensor`, replicated when they do not
  divide);
* a draft: params and cache replicated, as `jspec.decode(..., mesh=)` places them (or, `draft_tensor_parallel`,
  split as a draft passed through `jspec.shard(draft, mesh)` is);
* activations: an analytic estimate (not a measurement) of the peak of prefill (`prompt_len` tokens through each
  layer, f32 attention scores [B, heads, T, S], MLP intermediates, the vision tower on the prompt's images) and of
  one decode step (`tree_nodes` tree nodes verified, f32 logits [B, N, V]); the larger one counts.

A mixture-of-experts target (`qwen3_moe`) stores every expert: its params count them all, split over the
`expert` mesh axis (and each expert's intermediate dimension over `tensor`); its activations count the top-k
experts each token runs (`mlp_width`).

Model types not ported yet plan through their parts: Qwen2-VL / Qwen2.5-VL count their language model through the
qwen2 text family and their vision transformer analytically from `vision_config`.
`fits(device_bytes)` on the result says whether the per-device sum fits with a safety margin (`headroom`) for
what the plan does not see (XLA scratch, fragmentation, the runtime itself).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, NamedSharding

from jspec.core import prefill as PR
from jspec.core import sharding as SH

CONFIG_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")

DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "f16": "float16", "fp16": "float16", "float16": "float16",
          "f32": "float32", "fp32": "float32", "float32": "float32"}

# Qwen2-VL / Qwen2.5-VL: the vision tower's geometry is read from vision_config. Images are assumed
# to have this many pixels (Qwen's own recommended max_pixels = 1280 * 28 * 28) unless the caller says otherwise.
QWEN_VL_TYPES = ("qwen2_vl", "qwen2_5_vl")
QWEN_VL_IMAGE_PIXELS = 1280 * 28 * 28

_UNITS = {"": 1, "b": 1, "k": 10 ** 3, "kb": 10 ** 3, "m": 10 ** 6, "mb": 10 ** 6, "g": 10 ** 9, "gb": 10 ** 9,
          "t": 10 ** 12, "tb": 10 ** 12, "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40}


# ------------------------------------------------------------------------------------------------ inputs


def available_configs() -> list[str]:
    """Names of the configs shipped in jspec/tools/configs (config.json files of public checkpoints, no weights)."""
    if not os.path.isdir(CONFIG_DIR):
        return []
    return sorted(f[:-5] for f in os.listdir(CONFIG_DIR) if f.endswith(".json"))


def load_config(name_or_path: str) -> dict:
    """An HF config dict from a shipped config name, a config.json file, or a checkpoint directory."""
    from ports.io.hf_checkpoint import read_hf_config

    p = os.path.expanduser(str(name_or_path))
    if os.path.isdir(p):
        return read_hf_config(p)
    if os.path.isfile(p):
        with open(p) as f:
            return json.load(f)
    names = available_configs()
    key = str(name_or_path).lower()
    key = key[:-5] if key.endswith(".json") else key
    if key in names:
        with open(os.path.join(CONFIG_DIR, key + ".json")) as f:
            return json.load(f)
    raise ValueError(f"unknown config {name_or_path!r}: not a config.json file or checkpoint directory, and not a "
                     f"shipped config; shipped configs: {', '.join(names)}")


def parse_mesh(text: str) -> dict[str, int]:
    """"tensor=8" / "data=2,fsdp=2,tensor=4" -> {"data": .., "fsdp": .., "expert": .., "tensor": ..} (missing axes
    are 1)."""
    usage = (f"malformed mesh {text!r}: expected comma-separated axis=size pairs over the axes "
             f"{', '.join(SH.MESH_AXES)}, e.g. tensor=8 or data=2,tensor=4")
    out = dict.fromkeys(SH.MESH_AXES, 1)
    seen = set()
    parts = [s.strip() for s in str(text).split(",")]
    if not text or not all(parts):
        raise ValueError(usage)
    for part in parts:
        m = re.fullmatch(r"([a-z]+)\s*=\s*(\d+)", part)
        if not m or m.group(1) not in out or m.group(1) in seen or int(m.group(2)) < 1:
            raise ValueError(usage)
        seen.add(m.group(1))
        out[m.group(1)] = int(m.group(2))
    return out


def parse_bytes(text) -> int:
    """"80GB" (10^9), "16GiB" (2^30), "95G", "1.5e10" -> bytes."""
    if isinstance(text, (int, float)):
        return int(text)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*", str(text).lower())
    if not m or m.group(2) not in _UNITS:
        raise ValueError(f"cannot read a memory size from {text!r}: write e.g. 80GB, 16GiB or a number of bytes")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def _dtype(dtype) -> jnp.dtype:
    name = DTYPES.get(str(dtype).lower(), None) if isinstance(dtype, str) else None
    if isinstance(dtype, str) and name is None:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(DTYPES)}")
    return jnp.dtype(name or dtype)


def abstract_mesh(mesh_shape: Mapping[str, int]) -> AbstractMesh:
    """A ("data", "fsdp", "expert", "tensor") mesh of that shape without devices."""
    unknown = set(mesh_shape) - set(SH.MESH_AXES)
    if unknown:
        raise ValueError(f"unknown mesh axes {sorted(unknown)}; jspec meshes have axes {SH.MESH_AXES}")
    sizes = tuple(int(mesh_shape.get(a, 1)) for a in SH.MESH_AXES)
    if min(sizes) < 1:
        raise ValueError(f"mesh sizes must be >= 1, got {dict(zip(SH.MESH_AXES, sizes))}")
    return AbstractMesh(sizes, SH.MESH_AXES)


# ------------------------------------------------------------------------------------------------ models


@dataclasses.dataclass
class _Planned:
    """One model as the planner sees it: a `ports.Model` with abstract params, plus what is counted analytically."""

    model: Any  # ports.Model(config, params of ShapeDtypeStruct)
    text: Any  # the language model's TextConfig
    notes: list
    analytic_vision: dict | None = None  # Qwen-VL tower geometry: {"hidden", "mlp", "heads", "patch", "gated"}
    vit: Any = None  # a ported ViT (VisionConfig) and its tiles per image, for the activation estimate
    tiles_per_image: int = 0


def _abstract_params(fam, cfg, dtype, notes: list):
    """eval_shape of init_params; a family whose init is not traceable (host-side random draw) gives its
    param_shapes in `dtype`, the same pytree."""
    from ports.core import fused as FU

    try:  # in the run layout the loaders give (`ports.core.fused`)
        return jax.eval_shape(lambda: FU.fuse_params(cfg, fam.init_params(cfg, jax.random.key(0), dtype)))
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        notes.append(f"{cfg.model_type}: params from param_shapes (its init_params draws on the host)")
        shapes = FU.fused_shapes(cfg, fam.param_shapes(cfg))
        return jax.tree.map(lambda s: jax.ShapeDtypeStruct(tuple(s), dtype), shapes,
                            is_leaf=lambda x: isinstance(x, tuple))


def _qwen_vl_text(d: dict) -> dict:
    """The qwen2 text-model dict of a Qwen2-VL / Qwen2.5-VL config (fields under text_config, or at the top)."""
    text = {k: v for k, v in d.items() if k not in ("vision_config", "text_config")}
    text.update(d.get("text_config") or {})
    text["model_type"] = "qwen2"
    return text


def _qwen_vl_vision(d: dict) -> dict:
    """Parameter count and geometry of a Qwen2-VL / Qwen2.5-VL vision transformer, from vision_config (HF's
    module layout: Conv3d patch embed without bias, `depth` blocks of two norms + fused qkv + proj + MLP, and the
    2x2 patch merger ln_q -> Linear(4D, 4D) -> GELU -> Linear(4D, out))."""
    v = dict(d.get("vision_config") or {})
    v25 = d["model_type"] == "qwen2_5_vl"
    D = int(v.get("hidden_size", 1280) if v25 else v.get("embed_dim", 1280))
    out = int(v.get("out_hidden_size", 3584) if v25 else v.get("hidden_size", 3584))
    F = int(v.get("intermediate_size", 3420)) if v25 else int(D * v.get("mlp_ratio", 4))
    depth, heads = int(v.get("depth", 32)), int(v.get("num_heads", 16))
    ps, tps = int(v.get("patch_size", 14)), int(v.get("temporal_patch_size", 2))
    merge = int(v.get("spatial_merge_size", 2))
    chans = int(v.get("in_chans", v.get("in_channels", 3)))
    norm = D if v25 else 2 * D  # RMSNorm (2.5) vs LayerNorm with bias (2)
    mlp = (2 * (D * F + F) + F * D + D) if v25 else (D * F + F + F * D + D)  # SwiGLU with biases vs fc1/fc2
    block = 2 * norm + (D * 3 * D + 3 * D) + (D * D + D) + mlp
    m = D * merge * merge
    merger = norm + (m * m + m) + (m * out + out)
    n = chans * tps * ps * ps * D + depth * block + merger
    return dict(params=n, hidden=D, mlp=F, heads=heads, patch=ps, gated=v25)


def _planned(config: dict, dtype, role: str) -> _Planned:
    from ports.core import anyres as ANY
    from ports.families import chameleon as CH
    from ports.core import vision as VIS
    from ports.model import FAMILIES, Model, family

    if not isinstance(config, Mapping):
        raise TypeError(f"{role} config must be an HF config dict (config.json), got {type(config).__name__}")
    mt = config.get("model_type")
    notes: list[str] = []
    if mt in FAMILIES:
        fam = family(mt)
        cfg = CH.config_from_hf(config, require_vocabulary=False) if mt == "chameleon" else fam.config_from_hf(config)
        if mt == "chameleon" and not cfg.image_token_ids:
            notes.append(f"{role} chameleon config has no vocabulary_map: image vocabulary left empty (sizes only)")
        params = _abstract_params(fam, cfg, dtype, notes)
        text = getattr(cfg, "text", cfg)
        out = _Planned(Model(cfg, params), text, notes)
        vision = getattr(cfg, "vision", None)
        if mt in QWEN_VL_TYPES:  # params from the family, the tower's geometry (activations) from vision_config
            out.analytic_vision = _qwen_vl_vision(config)
        elif isinstance(vision, VIS.VisionConfig):
            out.vit = vision
            pins = getattr(cfg, "grid_pinpoints", None)
            out.tiles_per_image = ANY.bucket(1 + max(-(-h // vision.image_size) * -(-w // vision.image_size)
                                                   for h, w in pins)) if pins else 1
        return out
    family(mt)  # raises: unknown architecture, naming the supported ones
    raise AssertionError("unreachable")


# ------------------------------------------------------------------------------------------------ bytes


def shard_bytes(shape, dtype, sharding: NamedSharding) -> int:
    """Bytes one device holds of an array of `shape` under `sharding` (NamedSharding's own split; jspec's rules
    only split a dimension its mesh axes divide, which is asserted)."""
    spec = tuple(sharding.spec) + (None,) * (len(shape) - len(sharding.spec))
    for dim, axes in zip(shape, spec):
        if axes is None:
            continue
        n = math.prod(sharding.mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes))
        assert dim % n == 0, f"uneven split: dimension {dim} over {axes} ({n} ways) in {tuple(shape)}"
    local = sharding.shard_shape(tuple(shape))
    return int(np.prod(local, dtype=np.int64)) * jnp.dtype(dtype).itemsize


def _nbytes(x) -> int:
    return int(np.prod(x.shape, dtype=np.int64)) * jnp.dtype(x.dtype).itemsize


def _sharded_tree_bytes(tree, shardings) -> tuple[int, int]:
    """(total bytes, bytes on one device) of an abstract pytree under a matching pytree of NamedShardings."""
    leaves = jax.tree.leaves(tree)
    shs = jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, NamedSharding))
    assert len(leaves) == len(shs)
    return sum(_nbytes(x) for x in leaves), sum(shard_bytes(x.shape, x.dtype, s) for x, s in zip(leaves, shs))


def param_bytes(model, mesh, rules=None) -> tuple[int, int]:
    """(total, per device) bytes of a model's params placed by `jspec.core.sharding.param_shardings`."""
    model = SH.run_layout(model, mesh, rules)
    return _sharded_tree_bytes(model.params, SH.param_shardings(model, mesh, rules))


def constrained_bytes(fn) -> tuple[int, int, Any]:
    """(total, per device, abstract output) of `fn()`, whose every output leaf goes through
    `with_sharding_constraint` (as `Placement.constrain_cache` does): the shardings are read from the traced
    program itself, so the plan follows the engine's placement whatever fields the cache has. Nothing runs."""
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)()
    made_by = {id(e.outvars[0]): e.params["sharding"] for e in closed.jaxpr.eqns
               if e.primitive.name == "sharding_constraint"}
    total = per = 0
    for var, aval in zip(closed.jaxpr.outvars, closed.out_avals):
        sharding = made_by.get(id(var))
        if not isinstance(sharding, NamedSharding):
            raise ValueError(f"output {aval} has no sharding constraint: cannot plan its placement")
        total += _nbytes(aval)
        per += shard_bytes(aval.shape, aval.dtype, sharding)
    return total, per, out_shape


def cache_bytes(model, batch: int, max_len: int, placement: SH.Placement, replicated: bool = False):
    """(total, per device, abstract cache) of `PR.new_cache_for(model, batch, max_len)` constrained by
    `placement.constrain_cache` (the target's: batch over data, kv heads over tensor; `replicated`: a draft's)."""
    return constrained_bytes(lambda: placement.constrain_cache(PR.new_cache_for(model, batch, max_len),
                                                               replicated))


# ------------------------------------------------------------------------------------------------ activations


def _split(axis: str, units: int, mesh, rules) -> int:
    """How many ways the rules split a logical axis of `units` indivisible units on this mesh (1: replicated)."""
    spec = SH.spec_for((axis,), {axis: units}, mesh, rules)
    axes = spec[0] if len(spec) else None
    if axes is None:
        return 1
    return math.prod(mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes))


def _decoder_terms(text, b: int, T: int, S: int, dt: int, heads: int, kv_heads: int, mlp: int,
                   blockwise: bool = False) -> dict:
    """Per-device bytes live inside one decoder layer for T new tokens over an S-slot cache (b rows, heads /
    kv_heads / mlp already divided by their splits): the larger of the attention and MLP sub-blocks, plus the
    residual stream and what lives across all layers (visibility mask, RoPE tables). blockwise: the attention
    holds one [q_block, k_block] tile of scores per (row, head) and float32 outputs with their log-sum-exp, and no
    [T, S] mask (`ports.core.blockwise`); else the direct path's [T, S] scores and boolean mask."""
    D, Dh = text.hidden_size, text.head_dim
    resid = 3 * b * T * D * dt  # residual stream, its norm, the sub-block output
    rope = 2 * b * T * Dh * 4  # f32 cos / sin
    if blockwise:
        from ports.core.blockwise import BLOCK

        tq, tk = min(T, BLOCK), min(S, BLOCK)
        across = rope
        scores = b * heads * (tq * tk * (4 + 4 + dt) + T * (Dh + 1) * 4)  # a tile; f32 outputs and log-sum-exp
    else:
        across = b * T * S + rope  # bool visibility [B, T, S]
        scores = b * heads * T * S * (4 + 4 + dt)  # f32 scores, f32 softmax, probabilities in the param dtype
    attn = b * T * (2 * heads + 2 * kv_heads) * Dh * dt + scores  # q, k, v, attention output
    ffn = 3 * b * T * mlp * dt  # gate, up, act(gate) * up
    return dict(resid=resid, across=across, attn=attn, scores=scores, mlp=ffn,
                layer=resid + across + max(attn, ffn))


def prefill_shape(prompt_len: int, max_len: int, chunk: int | None) -> tuple[int, int, bool]:
    """(tokens through a layer at once, key slots they attend over, blockwise?) of a prefill of `prompt_len` tokens
    with `decode`'s `prefill_chunk` (None: one pass): one pass attends over its own tokens only (a fresh cache), a
    chunk over the whole cache; `ports.core.layers.BLOCKWISE_MIN` tokens or more attend blockwise."""
    from ports.core.layers import BLOCKWISE_MIN

    if chunk is not None and prompt_len > chunk:
        return chunk, max_len, chunk >= BLOCKWISE_MIN
    return prompt_len, prompt_len, prompt_len >= BLOCKWISE_MIN


def _vit_terms(n: int, P: int, D: int, F: int, heads: int, dt: int, gated: bool = False) -> int:
    """Peak bytes of one full-attention ViT block over n sequences of P tokens (replicated tower)."""
    resid = 3 * n * P * D * dt
    scores = n * heads * P * P * (4 + 4 + dt) + n * P * P  # + the all-true bool mask
    attn = 4 * n * P * D * dt + scores
    ffn = (3 if gated else 2) * n * P * F * dt
    return resid + max(attn, ffn)


def _vision_peak(pl: _Planned, images: int, dt: int) -> tuple[int, str]:
    if images <= 0:
        return 0, ""
    from ports.core.layers import VISION_BATCH  # towers encode this many images / tiles / frames at a time

    if pl.vit is not None:
        v = pl.vit
        n = images * pl.tiles_per_image
        return (_vit_terms(min(n, VISION_BATCH), v.num_positions, v.hidden_size, v.intermediate_size, v.num_heads,
                           dt),
                f"vision tower on {images} image(s) x {pl.tiles_per_image} tile(s) of {v.num_positions} tokens, "
                f"{VISION_BATCH} at a time")
    if pl.analytic_vision is not None:
        v = pl.analytic_vision
        patches = QWEN_VL_IMAGE_PIXELS // (v["patch"] ** 2)
        return (_vit_terms(min(images, VISION_BATCH), patches, v["hidden"], v["mlp"], v["heads"], dt, v["gated"]),
                f"vision tower on {images} image(s) of {QWEN_VL_IMAGE_PIXELS / 1e6:.2f} MP ({patches} patches, "
                f"full-attention layers)")
    return 0, ""


def _fsdp_gather(pl: _Planned, mesh, rules) -> int:
    """With fsdp > 1 XLA gathers each layer's weights (and the LM head) before use: the largest such transient
    (bytes on one device, tensor split kept)."""
    if mesh.shape.get("fsdp", 1) == 1:
        return 0
    model = SH.run_layout(pl.model, mesh, rules)
    shardings = SH.param_shardings(model, mesh, rules)

    def gathered(tree, shs):
        out = 0
        for x, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shs, is_leaf=lambda y: isinstance(y, NamedSharding))):
            kept = [a for ax in s.spec if ax is not None for a in ((ax,) if isinstance(ax, str) else ax)
                    if a != "fsdp"]
            out += _nbytes(x) // math.prod(mesh.shape[a] for a in kept)
        return out

    lm = model.params["lm"] if "lm" in model.params else model.params
    lm_sh = shardings["lm"] if "lm" in model.params else shardings
    layer = gathered(lm["layers"][0], lm_sh["layers"][0])
    head_key = "lm_head" if "lm_head" in lm else "embed"
    return max(layer, gathered(lm[head_key], lm_sh[head_key]))


def mlp_width(text, mesh, rules) -> int:
    """The widest feed-forward intermediate one token holds on one device: a dense layer's intermediate_size
    (split over `mlp`), and in a mixture-of-experts layer (`ports.core.moe`) its top-k experts' k x
    moe_intermediate_size (each split over `moe_mlp`)."""
    dense = any(not text.is_sparse(i) for i in range(text.num_layers)) if hasattr(text, "is_sparse") else True
    f = text.intermediate_size // _split("mlp", text.intermediate_size, mesh, rules) if dense else 0
    if getattr(text, "num_experts", 0):
        F = text.moe_intermediate_size
        f = max(f, text.num_experts_per_tok * (F // _split("moe_mlp", F, mesh, rules)))
    return f


def activation_estimate(target: _Planned, draft: _Planned | None, mesh, rules, batch: int, max_len: int,
                        prompt_len: int, tree_nodes: int, images: int, dt: int, draft_len: int | None = None,
                        prefill_chunk: int | None = None) -> dict:
    """Analytic per-device peak of prefill and of one decode step (bytes); see the module docstring. draft_len:
    the draft's cache slots when a pruned prompt shortens it (its prompt shrinks by as much). prefill_chunk: the
    target's prefill chunk (`prefill_shape`); the draft prefills its prompt in one pass."""
    text = target.text
    cache_spec = SH.spec_for(SH.CACHE_AXES, {"batch": batch, "kv_heads": text.num_kv_heads}, mesh, rules)
    b_split = math.prod(mesh.shape[a] for a in ((cache_spec[0],) if isinstance(cache_spec[0], str)
                                                else cache_spec[0] or ()))
    b = batch // b_split
    h = text.num_heads // _split("heads", text.num_heads, mesh, rules)
    kvh = text.num_kv_heads // _split("kv_heads", text.num_kv_heads, mesh, rules)
    f = mlp_width(text, mesh, rules)
    gather = _fsdp_gather(target, mesh, rules)
    V = text.vocab_size

    T_pre, S_pre, bw = prefill_shape(prompt_len, max_len, prefill_chunk)
    pre = _decoder_terms(text, b, T_pre, S_pre, dt, h, kvh, f, blockwise=bw)
    vis, vis_what = _vision_peak(target, images, dt)
    prefill = max(pre["layer"], vis) + b * V * 4 + gather
    dec = _decoder_terms(text, b, tree_nodes, max_len, dt, h, kvh, f)
    logits = 2 * b * tree_nodes * V * 4  # f32 logits and probabilities of every node (whole rows)
    draft_prefill = draft_step = 0
    if draft is not None:  # replicated: every device runs the whole draft batch with all its heads
        dtext = draft.text
        logits += b * tree_nodes * dtext.vocab_size * 4  # draft probabilities kept for verification

        d_max = max_len if draft_len is None else draft_len
        d_prompt = max(1, prompt_len - (max_len - d_max))

        def draft_layer(T, S, blockwise=False):
            return _decoder_terms(dtext, batch, T, S, dt, dtext.num_heads, dtext.num_kv_heads,
                                  mlp_width(dtext, abstract_mesh({}), rules), blockwise)["layer"]

        d_T, d_S, d_bw = prefill_shape(d_prompt, d_max, None)
        draft_prefill = (max(draft_layer(d_T, d_S, d_bw), _vision_peak(draft, images, dt)[0])
                         + batch * dtext.vocab_size * 4)
        draft_step = draft_layer(tree_nodes, d_max)
    prefill = max(prefill, draft_prefill)
    decode = max(dec["layer"], draft_step) + logits + gather
    return dict(prefill=prefill, decode=decode, peak=max(prefill, decode),
                phase="prefill" if prefill >= decode else "decode",
                prefill_attention_scores=pre["scores"], prefill_mlp=pre["mlp"], vision=vis, vision_what=vis_what,
                prefill_tokens_at_once=T_pre, prefill_blockwise=bw,
                draft_prefill=draft_prefill,
                decode_logits=logits, fsdp_gather=gather, rows_per_device=b, heads_per_device=h)


# ------------------------------------------------------------------------------------------------ estimate


class MemoryEstimate(dict):
    """The estimate (a JSON-serialisable dict) with a `fits` verdict."""

    def fits(self, device_bytes, headroom: float = 0.10) -> dict:
        """Whether the per-device sum fits `device_bytes` (int or "80GB") keeping `headroom` (a fraction) free
        for what the plan does not see (XLA scratch, fragmentation, runtime)."""
        dev = parse_bytes(device_bytes)
        if not 0 <= headroom < 1:
            raise ValueError(f"headroom is a fraction in [0, 1), got {headroom}")
        usable = int(dev * (1 - headroom))
        need = self["per_device"]
        return dict(fits=need <= usable, device_bytes=dev, headroom=headroom, usable_bytes=usable,
                    needed_bytes=need, free_bytes=usable - need)


def _name(config: dict) -> str:
    return str(config.get("_name_or_path") or config.get("name") or config.get("model_type"))


def eesd_components(target: _Planned, exit_layer: int, layers: int, calibration: bool, batch: int, max_len: int,
                    scratch: int, dt) -> dict:
    """An EESD early-exit drafter's own bytes (replicated, like the head `EarlyExitDrafter.prepare` places): its
    `layers` decoder layers (the target's layer shape), norm and untied LM head; their KV cache; the scratch K/V
    of the shared layers 1..N for one step's drafts; Cali-TS's predictor (W^1..W^10, W_p) when asked. The shared
    layers themselves are the target's (counted in its params, sharded as they are)."""
    text = target.text
    if not 1 <= exit_layer < text.num_layers:
        raise ValueError(f"exit layer N={exit_layer} is out of range: the target has {text.num_layers} layers")
    if not 0 <= layers <= text.num_layers:
        raise ValueError(f"the head's layers must be in [0, {text.num_layers}], got {layers}")
    per_layer = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(target.model.params["layers"][0]))
    D, V = text.hidden_size, text.vocab_size
    n = layers * per_layer + D + D * V
    out = {"eesd_head": dict(total=n * dt.itemsize, per_device=n * dt.itemsize, count=n, replicated=True)}
    kv = 2 * batch * text.num_kv_heads * text.head_dim * dt.itemsize
    cache = layers * kv * max_len + exit_layer * kv * scratch
    out["eesd_cache"] = dict(total=cache, per_device=cache, replicated=True)
    if calibration:
        c = 10 * D * D + 2 * 2 * D + 2
        out["eesd_calibration"] = dict(total=c * 4, per_device=c * 4, count=c, replicated=True)
    return out


def eagle_components(target: _Planned, batch: int, max_len: int, dt) -> dict:
    """An EAGLE-1 feature head's own bytes (replicated, as `EagleDrafter.prepare` places it): fc [2D, D] + bias and
    one decoder layer of the target's shape (the embedding and LM head are the target's), and its one-layer KV
    cache for `batch` stream rows (CFG doubles them)."""
    text = target.text
    per_layer = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(target.model.params["layers"][0]))
    D = text.hidden_size
    n = 2 * D * D + D + per_layer
    cache = 2 * batch * text.num_kv_heads * text.head_dim * dt.itemsize * max_len
    return {"eagle_head": dict(total=n * dt.itemsize, per_device=n * dt.itemsize, count=n, replicated=True),
            "eagle_cache": dict(total=cache, per_device=cache, replicated=True)}


def mtp_components(target: _Planned, batch: int, max_len: int, dt) -> dict:
    """A Qwen3.5 MTP head's own bytes (replicated, as `EagleDrafter.prepare` places it): fc [2D, D], three norms and
    `mtp_num_hidden_layers` full-attention layers of the target's shape (its embedding and LM head shared), and
    their KV cache for `batch` rows."""
    text = target.text
    n_layers = max(1, int(getattr(text, "mtp_layers", 0)))
    attn = next(layer for layer in target.model.params["layers"] if "wqg" in layer)
    per_layer = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(attn))
    D = text.hidden_size
    n = 2 * D * D + 3 * D + n_layers * per_layer
    cache = 2 * batch * n_layers * text.num_kv_heads * text.head_dim * dt.itemsize * max_len
    return {"mtp_head": dict(total=n * dt.itemsize, per_device=n * dt.itemsize, count=n, replicated=True),
            "mtp_cache": dict(total=cache, per_device=cache, replicated=True)}


def recurrent_verify_bytes(text, batch: int, nodes: int, dt) -> int:
    """What a hybrid target's verify keeps per new token for the commit (`ports.core.recurrent.Pending`), over `nodes`
    nodes and `batch` rows: per linear layer the conv input (model dtype), the key, δ and the log decay (float32)."""
    per_node = (text.conv_channels * dt.itemsize
                + 4 * (text.linear_key_heads * text.linear_key_dim
                       + text.linear_value_heads * (text.linear_value_dim + 1)))
    return len(text.linear_layers) * batch * nodes * per_node


def estimate(config: dict, mesh_shape: Mapping[str, int], batch: int, max_len: int, dtype="bfloat16",
             draft_config: dict | None = None, tree_nodes: int = 64, prompt_len: int | None = None, rules=None,
             images: int | None = None, eesd: tuple[int, int, bool] | None = None, draft_max_len: int | None = None,
             self_draft: bool = False, streams: int = 1, eagle: bool = False, prefill_chunk: int | None | str = "auto",
             draft_tensor_parallel: bool = False, mtp: bool = False) -> MemoryEstimate:
    """Bytes per device of decoding `config` (an HF config dict) on a mesh of `mesh_shape`
    ({"data":, "fsdp":, "tensor":}) with a `max_len`-slot cache for `batch` rows, params in `dtype`, optionally
    with a replicated draft. Nothing is allocated and no devices are needed.

    prompt_len: tokens prefilled at once (default max_len, the worst case); tree_nodes: nodes verified per step
    (gamma + 1 for a chain); images: images in the prefill batch for a vision-language target (default: one per
    row); eesd: (exit layer N, head layers, with Cali-TS's predictor) sizes an EESD early-exit drafter
    (`eesd_components`); draft_max_len: the draft's cache slots when they differ from the target's (SpecVLM's
    pruned draft prompt); self_draft: the target drafts for itself from a second cache of its own, sharded like
    the target's (SpecVLM's Self-SD); streams: sequences per row (2 under classifier-free guidance: every cache
    and activation holds batch * streams rows); eagle: an EAGLE-1 feature head drafts (`eagle_components`,
    LANTERN++'s drafter); prefill_chunk: `decode`'s (default "auto", its 4,096 tokens; None: one pass), which
    sets how many tokens go through a layer at once and which attention path they take; mtp: a Qwen3.5 target's
    own MTP head drafts (`mtp_components`). A hybrid target's cache holds its recurrent state too, and its verify
    keeps per node what the commit needs (`recurrent_verify_bytes`, counted with the activations). Returns a `MemoryEstimate`: per
    component {"total", "per_device"} bytes ("total" is one logical copy), their sums, and notes;
    `estimate(...).fits(device_bytes)` gives the verdict."""
    for name, v in (("batch", batch), ("max_len", max_len), ("tree_nodes", tree_nodes), ("streams", streams)):
        if int(v) < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    prompt_len = max_len if prompt_len is None else int(prompt_len)
    if not 1 <= prompt_len <= max_len:
        raise ValueError(f"prompt_len={prompt_len} must be in [1, max_len={max_len}]")
    from jspec.core.config import check_prefill_chunk

    chunk = check_prefill_chunk(prefill_chunk)
    dt = _dtype(dtype)
    mesh = abstract_mesh(mesh_shape)
    table = tuple(SH.rules_table(rules).items())
    placement = SH.Placement(mesh, table)

    target = _planned(config, dt, "target")
    draft = _planned(draft_config, dt, "draft") if draft_config is not None else None
    notes = list(target.notes) + (list(draft.notes) if draft else [])
    comps: dict[str, dict] = {}

    total, per = param_bytes(target.model, mesh, table)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(target.model.params))
    comps["params"] = dict(total=total, per_device=per, count=n_params)
    rows = batch * int(streams)  # CFG runs a conditional and an unconditional sequence per row
    total, per, cache = cache_bytes(target.model, rows, max_len, placement)
    comps["kv_cache"] = dict(total=total, per_device=per, spec=str(placement.cache_spec(cache)))
    d_len = max_len if draft_max_len is None else int(draft_max_len)
    if not 1 <= d_len <= max_len:
        raise ValueError(f"draft_max_len={d_len} must be in [1, max_len={max_len}]")
    if self_draft and draft is not None:
        raise ValueError("plan a separate draft or the target drafting for itself, not both")
    if draft is not None:
        n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(draft.model.params))
        rep = not draft_tensor_parallel
        total, per = (n * dt.itemsize, n * dt.itemsize) if rep else param_bytes(draft.model, mesh, table)
        comps["draft_params"] = dict(total=total, per_device=per, count=n, replicated=rep)
        total, per, _ = cache_bytes(draft.model, rows, d_len, placement, replicated=rep)
        comps["draft_cache"] = dict(total=total, per_device=per, replicated=rep, slots=d_len)
        if not rep:
            saved = n * dt.itemsize - comps["draft_params"]["per_device"]
            notes.append(f"tensor-parallel draft (`jspec.shard(draft, mesh)`): its params split by the target's "
                         f"rules, {saved / 2 ** 30:.2f} GiB per device less than replicated; its cache split as the "
                         "target's")
    if self_draft:
        total, per, _ = cache_bytes(target.model, batch, d_len, placement)
        comps["draft_cache"] = dict(total=total, per_device=per, replicated=False, slots=d_len)
        notes.append(f"Self-SD: the target drafts for itself (its weights shared) from a second cache of {d_len} slots")

    if eesd is not None:
        if draft is not None:
            raise ValueError("plan a separate draft or an early-exit drafter, not both")
        comps.update(eesd_components(target, int(eesd[0]), int(eesd[1]), bool(eesd[2]), batch, max_len,
                                     tree_nodes + 2, dt))
        notes.append(f"EESD: exits after layer {eesd[0]} of {target.text.num_layers} (shared with the target), "
                     f"{eesd[1]} head layer(s) + norm + LM head = {comps['eesd_head']['count'] / 1e9:.3f}B params"
                     + (f", Cali-TS predictor {comps['eesd_calibration']['count'] / 1e9:.3f}B" if eesd[2] else ""))
    if eagle:
        if draft is not None or eesd is not None or self_draft:
            raise ValueError("plan one drafter: a separate draft, an early-exit head or an EAGLE head")
        comps.update(eagle_components(target, rows, max_len, dt))
        notes.append(f"EAGLE-1 head: fc + one decoder layer = {comps['eagle_head']['count'] / 1e9:.3f}B params "
                     "(the target's embedding and LM head shared), its one-layer cache replicated")
    if mtp:
        if draft is not None or eesd is not None or self_draft or eagle:
            raise ValueError("plan one drafter: a separate draft, an early-exit head, an EAGLE head or an MTP head")
        if not hasattr(target.text, "linear_layers"):
            raise ValueError(f"an MTP head is a Qwen3.5 target's own; the target is {config.get('model_type')}")
        comps.update(mtp_components(target, rows, max_len, dt))
        notes.append(f"MTP head: fc + {max(1, target.text.mtp_layers)} decoder layer(s) = "
                     f"{comps['mtp_head']['count'] / 1e9:.3f}B params (the target's embedding and LM head shared), "
                     "its cache replicated")
    if streams > 1:
        notes.append(f"{streams} streams per row (classifier-free guidance): caches and activations hold "
                     f"{rows} sequences")
    vlm = target.vit is not None or target.analytic_vision is not None
    n_img = (batch if vlm else 0) if images is None else int(images)
    one = abstract_mesh({})
    act = activation_estimate(target, draft, mesh, table, rows, max_len, prompt_len, tree_nodes, n_img,
                              dt.itemsize, d_len, chunk)
    act_one = activation_estimate(target, draft, one, table, rows, max_len, prompt_len, tree_nodes, n_img,
                                  dt.itemsize, d_len, chunk)
    comps["activations"] = dict(total=act_one["peak"], per_device=act["peak"], estimate=True, phase=act["phase"],
                                prefill=act["prefill"], decode=act["decode"], detail=act)
    if hasattr(target.text, "linear_layers"):  # a hybrid target: its verify's per-node commit inputs
        rv = recurrent_verify_bytes(target.text, rows, tree_nodes, dt)
        b_split = _split("batch", rows, mesh, table)
        comps["recurrent_verify"] = dict(total=rv, per_device=rv // b_split, estimate=True)
        notes.append(f"hybrid target: {len(target.text.linear_layers)} linear-attention layers; its cache holds "
                     f"their recurrent state, and a verify of {tree_nodes} nodes keeps "
                     f"{rv / max(1, rows * tree_nodes) / 2 ** 20:.2f} MiB per node for the commit (docs/hybrid.md)")
    how = (f"in chunks of {act['prefill_tokens_at_once']}" if act["prefill_tokens_at_once"] < prompt_len
           else "in one pass") + (", blockwise attention" if act["prefill_blockwise"] else ", [T, S] attention scores")
    notes.append(f"activations are an analytic estimate (peak of the {act['phase']}: prefill of {prompt_len} "
                 f"tokens {how} = {act['prefill'] / 1e9:.2f} GB"
                 + (f" (the replicated draft's own prefill: {act['draft_prefill'] / 1e9:.2f} GB)" if draft else "")
                 + f", decode step with {tree_nodes} nodes = {act['decode'] / 1e9:.2f} GB per device; "
                 "f32 attention scores per layer)"
                 + (f"; prefill counts the {act['vision_what']}" if act["vision_what"] else ""))
    n_dev = math.prod(mesh.shape.values())
    return MemoryEstimate(
        target=dict(name=_name(config), model_type=config.get("model_type"), params=n_params),
        draft=None if draft is None else dict(name=_name(draft_config), model_type=draft_config.get("model_type"),
                                              params=comps["draft_params"]["count"]),
        mesh=dict(mesh.shape), devices=n_dev, batch=int(batch), max_len=int(max_len), prompt_len=prompt_len,
        tree_nodes=int(tree_nodes), images=n_img, dtype=dt.name, components=comps,
        total=sum(c["total"] for c in comps.values()), per_device=sum(c["per_device"] for c in comps.values()),
        notes=notes)


# ------------------------------------------------------------------------------------------------ report

LABELS = {"params": "params", "kv_cache": "KV cache", "eesd_head": "EESD head (replicated)",
          "eesd_cache": "EESD head cache + scratch", "eesd_calibration": "Cali-TS predictor (f32)",
          "eagle_head": "EAGLE head (replicated)", "eagle_cache": "EAGLE head cache (replicated)",
          "mtp_head": "MTP head (replicated)", "mtp_cache": "MTP head cache (replicated)",
          "recurrent_verify": "verify's recurrent inputs (estimate)",
          "draft_params": "draft params (replicated)", "draft_cache": "draft KV cache (replicated)",
          "activations": "activations (estimate)"}


def gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


def format_estimate(p: MemoryEstimate, device_bytes=None, headroom: float = 0.10) -> str:
    """A readable table: component, total, per device; the verdict when device memory is given."""
    mesh = " x ".join(f"{k}={v}" for k, v in p["mesh"].items())
    t = p["target"]
    lines = [f"target {t['name']} ({t['model_type']}, {t['params'] / 1e9:.2f}B params)"
             + (f" + draft {p['draft']['name']} ({p['draft']['params'] / 1e9:.2f}B params)" if p["draft"] else ""),
             f"mesh {mesh} ({p['devices']} devices), batch {p['batch']}, max-len {p['max_len']}, "
             f"prompt {p['prompt_len']}, {p['tree_nodes']} tree nodes, {p['dtype']}", ""]
    w = max(len(v) for v in LABELS.values())
    lines.append(f"{'component':<{w}}  {'total':>12}  {'per device':>12}")
    for k, c in p["components"].items():
        label = "draft KV cache (sharded)" if k == "draft_cache" and not c.get("replicated", True) else LABELS.get(k, k)
        lines.append(f"{label:<{w}}  {gb(c['total']):>12}  {gb(c['per_device']):>12}")
    lines.append(f"{'sum':<{w}}  {gb(p['total']):>12}  {gb(p['per_device']):>12}")
    if device_bytes is not None:
        v = p.fits(device_bytes, headroom)
        lines.append("")
        lines.append(f"device memory {gb(v['device_bytes'])}, usable {gb(v['usable_bytes'])} "
                     f"({headroom:.0%} headroom): " + (f"FITS ({gb(v['free_bytes'])} to spare)" if v["fits"] else
                                                       f"DOES NOT FIT ({gb(-v['free_bytes'])} over)"))
    for n in p["notes"]:
        lines.append(f"note: {n}")
    return "\n".join(lines)
