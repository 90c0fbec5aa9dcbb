"""`Model(config, params)` and the family registry: which port runs each HF `model_type`.

Checkpoints in and out live beside it: `ports.io.hf_checkpoint` (HF safetensors: `load_hf`, `save_hf`, the streaming
every source format shares), `ports.io.checkpoint` (jspec's own orbax format: `save`, `load`, `convert_hf`) and
`ports.io.gguf` (llama.cpp files).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ports.core import cache as kvc
from ports.core import config as PC
from ports.core import fused as FU
from ports.families import chameleon
from ports.families import llama
from ports.families import llava
from ports.families import llava_next
from ports.families import muse_glimmer
from ports.families import qwen2_vl
from ports.families import qwen3
from ports.families import qwen3_5
from ports.families import qwen3_5_vl
from ports.families import qwen3_vl


class Family(NamedTuple):
    """What jspec needs to know about one HF `model_type`."""

    config_from_hf: Callable[[dict], Any]
    config_to_hf: Callable[[Any], dict]
    param_shapes: Callable[[Any], Any]
    init_params: Callable
    forward: Callable
    hf_key_map: Callable[[Any], list]
    ignored_keys: tuple[str, ...]  # regexes of checkpoint tensors the model does not use
    kv_layout: Callable[[Any], tuple[int, int, int]]
    embed: Callable
    unembed: Callable
    rename_hf_key: Callable[[str], str] = lambda name: name  # other accepted checkpoint layouts -> hf_key_map names
    # models with non-text inputs: prepare_inputs(cfg, tokens, lengths, inputs) -> inputs checks the host arrays
    # before any compute and may add host-computed tables (e.g. gather indices); then
    # prompt_embeds(cfg, params, tokens, inputs) -> .embeds [B, T, D] for the prefill (None: text only)
    prepare_inputs: Callable | None = None
    prompt_embeds: Callable | None = None
    # compact_prompt(cfg, tokens, inputs, idx, lengths, new_lengths, positions) -> inputs: the prepared inputs of the prompt
    # made of the positions idx [B, D] (SpecVLM's pruned draft prompt, inside a program); None: not prunable
    compact_prompt: Callable | None = None
    # whether forward takes defer_writes (`ports.families.llama.forward`, which the LLaVA and Qwen2-VL forwards call)
    defers_writes: bool = False
    # whether forward takes stacked layers (`ports.core.scanned`: the LLaMA forward, and the families that run it)
    scans: bool = False
    # split_hf_tensor(name, shape) -> [(name, shape, take), ...] or None: a checkpoint tensor that holds several
    # `hf_key_map` tensors (e.g. fused experts), each piece take(whole tensor)
    split_hf_tensor: Callable | None = None
    # init_recurrent(cfg, batch, dtype) -> ports.core.recurrent.State: a hybrid model's empty recurrent state (the cache's
    # `rec`); None: attention only
    init_recurrent: Callable | None = None


_TEXT = Family(PC.text_config_from_hf, PC.text_config_to_hf, llama.param_shapes, llama.init_params, llama.forward,
               llama.hf_key_map, llama.IGNORED_HF_KEYS, llama.kv_layout,
               lambda cfg, params, tokens: llama.embed(params, tokens), llama.unembed, defers_writes=True, scans=True)
_LLAVA = Family(llava.config_from_hf, llava.config_to_hf, llava.param_shapes, llava.init_params, llava.forward,
                llava.hf_key_map, llava.IGNORED_HF_KEYS, llava.kv_layout, llava.embed, llava.unembed,
                llava.rename_hf_key, llava.prepare_inputs, llava.prompt_embeds, llava.compact_prompt,
                defers_writes=True, scans=True)
_CHAMELEON = Family(chameleon.config_from_hf, chameleon.config_to_hf, chameleon.param_shapes, chameleon.init_params,
                    chameleon.forward, chameleon.hf_key_map, chameleon.IGNORED_HF_KEYS, chameleon.kv_layout,
                    chameleon.embed, chameleon.unembed, prepare_inputs=chameleon.prepare_inputs,
                    prompt_embeds=chameleon.prompt_embeds)
_LLAVA_NEXT = Family(llava_next.config_from_hf, llava_next.config_to_hf, llava_next.param_shapes,
                     llava_next.init_params, llava.forward, llava_next.hf_key_map, llava_next.IGNORED_HF_KEYS,
                     llava.kv_layout, llava.embed, llava.unembed, llava_next.rename_hf_key, llava_next.prepare_inputs,
                     llava_next.prompt_embeds, llava_next.compact_prompt, defers_writes=True, scans=True)
_QWEN_VL = Family(qwen2_vl.config_from_hf, qwen2_vl.config_to_hf, qwen2_vl.param_shapes, qwen2_vl.init_params,
                  qwen2_vl.forward, qwen2_vl.hf_key_map, qwen2_vl.IGNORED_HF_KEYS, qwen2_vl.kv_layout,
                  qwen2_vl.embed, qwen2_vl.unembed, qwen2_vl.rename_hf_key, qwen2_vl.prepare_inputs,
                  qwen2_vl.prompt_embeds, qwen2_vl.compact_prompt, defers_writes=True, scans=True)
_QWEN3 = Family(qwen3.config_from_hf, qwen3.config_to_hf, qwen3.param_shapes, qwen3.init_params, llama.forward,
                qwen3.hf_key_map, qwen3.IGNORED_HF_KEYS, llama.kv_layout,
                lambda cfg, params, tokens: llama.embed(params, tokens), llama.unembed, defers_writes=True,
                scans=True, split_hf_tensor=qwen3.split_hf_tensor)
# scans=False: DeepStack's per-layer additions run over the unrolled layers only
_QWEN3_VL = Family(qwen3_vl.config_from_hf, qwen3_vl.config_to_hf, qwen3_vl.param_shapes, qwen3_vl.init_params,
                   qwen3_vl.forward, qwen3_vl.hf_key_map, qwen3_vl.IGNORED_HF_KEYS, qwen3_vl.kv_layout,
                   qwen3_vl.embed, qwen3_vl.unembed, prepare_inputs=qwen3_vl.prepare_inputs,
                   prompt_embeds=qwen3_vl.prompt_embeds, compact_prompt=qwen3_vl.compact_prompt, defers_writes=True)
_MUSE_GLIMMER = Family(muse_glimmer.config_from_hf, muse_glimmer.config_to_hf, muse_glimmer.param_shapes,
                      muse_glimmer.init_params, muse_glimmer.forward, muse_glimmer.hf_key_map,
                      muse_glimmer.IGNORED_HF_KEYS, muse_glimmer.kv_layout, muse_glimmer.embed, muse_glimmer.unembed,
                      prepare_inputs=muse_glimmer.prepare_inputs, prompt_embeds=muse_glimmer.prompt_embeds,
                      defers_writes=True)
_QWEN3_5 = Family(qwen3_5.config_from_hf, qwen3_5.config_to_hf, qwen3_5.param_shapes, qwen3_5.init_params,
                  qwen3_5.forward, qwen3_5.hf_key_map, qwen3_5.IGNORED_HF_KEYS, qwen3_5.kv_layout, qwen3_5.embed,
                  qwen3_5.unembed, qwen3_5.rename_hf_key, split_hf_tensor=qwen3.split_hf_tensor,
                  init_recurrent=qwen3_5.init_recurrent)
_QWEN3_5_VL = Family(qwen3_5_vl.config_from_hf, qwen3_5_vl.config_to_hf, qwen3_5_vl.param_shapes,
                     qwen3_5_vl.init_params, qwen3_5_vl.forward, qwen3_5_vl.hf_key_map, qwen3_5_vl.IGNORED_HF_KEYS,
                     qwen3_5_vl.kv_layout, qwen3_5_vl.embed, qwen3_5_vl.unembed,
                     prepare_inputs=qwen3_5_vl.prepare_inputs, prompt_embeds=qwen3_5_vl.prompt_embeds,
                     compact_prompt=qwen3_5_vl.compact_prompt, split_hf_tensor=qwen3.split_hf_tensor,
                     init_recurrent=qwen3_5_vl.init_recurrent)
FAMILIES: dict[str, Family] = {"llama": _TEXT, "qwen2": _TEXT, "mistral": _TEXT, "qwen3": _QWEN3,
                               "qwen3_moe": _QWEN3, "llava": _LLAVA, "llava_next": _LLAVA_NEXT,
                               "llava_next_video": _LLAVA_NEXT, "llava_onevision": _LLAVA_NEXT,
                               "chameleon": _CHAMELEON, "qwen2_vl": _QWEN_VL, "qwen2_5_vl": _QWEN_VL,
                               "qwen3_vl": _QWEN3_VL, "qwen3_vl_moe": _QWEN3_VL, "muse_glimmer": _MUSE_GLIMMER,
                               "qwen3_5_text": _QWEN3_5, "qwen3_5_moe_text": _QWEN3_5,
                               "qwen3_5": _QWEN3_5_VL, "qwen3_5_moe": _QWEN3_5_VL}


def family(model_type: str) -> Family:
    if model_type not in FAMILIES:
        raise ValueError(f"unknown architecture: model_type {model_type!r}; jspec supports {sorted(FAMILIES)}")
    return FAMILIES[model_type]


class _HFConfigKey:
    """The HF config dict as hashable pytree aux data, serialised once per model (a real Chameleon config holds a
    65k-entry vocabulary map: re-serialising it at every jitted call would cost ~25 ms)."""

    __slots__ = ("value", "_key")

    def __init__(self, value: dict):
        self.value = value
        self._key = json.dumps(value, sort_keys=True)

    def __eq__(self, other):
        return isinstance(other, _HFConfigKey) and (self is other or self._key == other._key)

    def __hash__(self):
        return hash(self._key)

    def __repr__(self):  # the config's digest, the same in every process (keys on disk are built from reprs)
        return f"_HFConfigKey({hashlib.sha1(self._key.encode()).hexdigest()[:16]})"


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class Model:
    """A model: static `config` (hashable), `params` (a pytree of arrays), and the HF config dict it came from."""

    config: Any
    params: Any
    hf_config: dict = dataclasses.field(default_factory=dict, compare=False)
    _hf_aux: Any = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if self._hf_aux is None:
            object.__setattr__(self, "_hf_aux", _HFConfigKey(self.hf_config))

    def tree_flatten(self):
        return (self.params,), (self.config, self._hf_aux)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(aux[0], children[0], aux[1].value, aux[1])

    @property
    def family(self) -> Family:
        return family(self.config.model_type)

    @property
    def dtype(self):
        return jax.tree.leaves(self.params)[0].dtype

    @property
    def num_params(self) -> int:
        return int(sum(np.prod(a.shape) for a in jax.tree.leaves(self.params)))

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def kv_layout(self) -> tuple[int, int, int]:
        """(num_layers, kv_heads, head_dim) of the KV cache this model decodes with."""
        return self.family.kv_layout(self.config)

    @property
    def defers_writes(self) -> bool:
        """Whether `forward` takes defer_writes=True (`ports.families.llama.forward`)."""
        return self.family.defers_writes

    def forward(self, *args, **kwargs):
        """Family forward: see `ports.families.llama.forward` for the contract."""
        return self.family.forward(self.config, self.params, *args, **kwargs)

    @property
    def recurrent(self) -> bool:
        """Whether the model keeps a recurrent state beside its KV cache (a hybrid, e.g. Qwen3.5)."""
        return self.family.init_recurrent is not None


def new_cache(model: Model, batch: int, max_len: int, stacked: bool = False):
    """An empty cache for `model`: its KV layout's buffers, and a hybrid model's recurrent state."""
    layers, kvh, hd = model.kv_layout
    cache = kvc.init_cache(layers, batch, kvh, max_len, hd, model.dtype, stacked=stacked)
    if model.recurrent:
        cache = cache.replace(rec=model.family.init_recurrent(model.config, batch, model.dtype))
    return cache


def random_model(config, key: jax.Array | int = 0, dtype=jnp.float32, std: float = 0.02) -> Model:
    """A model with random params (tests, demos, benchmarks)."""
    if isinstance(key, int):
        key = jax.random.key(key)
    fam = family(config.model_type)
    return Model(config, FU.fuse_params(config, fam.init_params(config, key, dtype, std)), fam.config_to_hf(config))


def resolve_dtype(dtype):
    if dtype is None:
        return jnp.float32
    return jnp.dtype(dtype)


def logits(model: Model, prompt) -> np.ndarray:
    """Full-sequence forward without a persistent cache: float32 logits [B, T, V] (B=1 for a 1-D prompt).

    `prompt` is a token array or a mapping with `input_ids` (no padding) and the model's modality inputs
    (e.g. `pixel_values` for LLaVA)."""
    inputs = {}
    if isinstance(prompt, dict):
        inputs = {k: np.asarray(v) for k, v in prompt.items() if k not in ("input_ids", "attention_mask")}
        prompt = prompt["input_ids"]
    tokens = np.asarray(prompt)
    if tokens.ndim == 1:
        tokens = tokens[None]
    fam = model.family
    if inputs:
        if fam.prompt_embeds is None:
            raise ValueError(f"model_type {model.config.model_type!r} takes text only; got inputs {sorted(inputs)}")
        inputs = fam.prepare_inputs(model.config, tokens, np.full((tokens.shape[0],), tokens.shape[1]), inputs)
    return np.asarray(_logits_jit(model, jnp.asarray(tokens, jnp.int32), {k: jnp.asarray(v) for k, v in inputs.items()}))


@jax.jit
def _logits_jit(model: Model, tokens: jax.Array, inputs: dict) -> jax.Array:
    from ports.core.scanned import is_scanned

    B, T = tokens.shape
    cache = new_cache(model, B, T, stacked=is_scanned(model))
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    embeds = None
    if inputs:
        pe = model.family.prompt_embeds(model.config, model.params, tokens, inputs)
        embeds = pe.embeds
        if getattr(pe, "positions", None) is not None:  # e.g. Qwen2-VL's M-RoPE ids [3, B, T]
            positions = pe.positions
        extra = getattr(pe, "forward_inputs", None) or {}  # e.g. Qwen3-VL's DeepStack layer_adds
    else:
        extra = {}
    return model.forward(tokens, positions, cache, embeds=embeds, fresh=True, **extra).logits
