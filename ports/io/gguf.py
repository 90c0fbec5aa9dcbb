"""GGUF (llama.cpp) checkpoints as `ports.Model`s: `load_gguf`, `convert_gguf`, `gguf_to_hf_config`,
`tokenizer_from_gguf`.

Four GGUF architectures are read (`SUPPORTED_ARCHITECTURES`), as llama.cpp's convert_hf_to_gguf.py writes them:
- `llama` (LLaMA, Mistral, ...): an HF `LlamaConfig` (no biases). The converter reorders the Q/K rows of each head
  for llama.cpp's RoPE kernel (its `LlamaModel.permute`); we put them back in HF's order (`unpermute_rope_rows`).
- `qwen2` (Qwen2, Qwen2.5): an HF `Qwen2Config` (`Qwen2ForCausalLM`), with the Q/K/V biases
  (`blk.N.attn_q.bias`, ...). Its converter (`Qwen2Model`) does not permute, so the rows are taken as they are.
  GGUF holds no sliding-window setting (llama.cpp runs Qwen2 with full attention): the config says
  `use_sliding_window: false`.
- `qwen3` (Qwen3 dense): an HF `Qwen3Config` (`Qwen3ForCausalLM`, no biases) with its per-head Q/K norms
  (`blk.N.attn_q_norm.weight`, `attn_k_norm`) and its head size from `qwen3.attention.key_length`. Its converter
  (`Qwen3Model`, a `Qwen2Model`) does not permute either; no sliding window, as for Qwen2.
- `qwen3moe` (Qwen3-MoE): an HF `Qwen3MoeConfig` (`Qwen3MoeForCausalLM`), qwen3's attention tensors, and per layer
  the router `blk.N.ffn_gate_inp.weight` [E, D] and the experts stacked, `ffn_gate_exps` / `ffn_up_exps` [E, F, D]
  and `ffn_down_exps` [E, D, F]. They load as transformers' fused layout (`mlp.experts.gate_up_proj`, gate and up
  joined, and `mlp.experts.down_proj`; `ports.families.qwen3.split_hf_tensor`), each dequantized once. The config
  is what transformers 5.23 reads: `expert_count`, `expert_used_count`, `norm_topk_prob: true` (llama.cpp
  normalizes the top-k weights of qwen3moe whatever the file says) and every layer sparse
  (`decoder_sparse_step: 1`, no `mlp_only_layers`: llama.cpp runs no dense qwen3moe layer); unlike transformers,
  `moe_intermediate_size` is the file's `expert_feed_forward_length` (transformers ignores it and takes its default
  768).

A GGUF file holds its config as metadata (`<arch>.block_count`, `<arch>.attention.head_count`, ...) and its tensors
under llama.cpp's names, many quantized. We read it with the `gguf` package: the metadata becomes an HF config dict
(so the model goes through the same family code as an HF checkpoint and `save_hf` writes a checkpoint transformers
loads), the names map to HF names, every tensor is dequantized to float32 with `gguf.quants.dequantize`, and for
`llama` the Q/K rows are un-permuted. The output head is tied to the embedding when the file has no `output.weight`
(llama.cpp writes it only when it differs). Then the tensors take the same checked path as safetensors
(`ports.io.hf_checkpoint.stream_checkpoint`): bad files, unsupported architectures or types and missing / unexpected /
mis-shaped tensors are ValueErrors raised before any tensor is dequantized.

GGUF lists a tensor's dimensions fastest-varying first (`ne`): a [out, in] matrix has ne = (in, out). The reader's
`data` is already in numpy order, so a dequantized matrix is [out, in], HF's Linear layout.
"""
from __future__ import annotations

import functools
import os
import re
from typing import Any

import numpy as np

from ports.io.checkpoint import convert_stream
from ports.io.hf_checkpoint import SourceTensor, load_stream, stream_checkpoint
from ports.model import Model

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3moe")
# the architectures whose Q/K rows llama.cpp's converter permutes for its RoPE kernel
_PERMUTED_ARCHITECTURES = ("llama",)
_HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                      "qwen3moe": "Qwen3MoeForCausalLM"}
_MODEL_TYPES = {"qwen3moe": "qwen3_moe"}  # the HF model_type of an architecture, where the names differ
# the ggml tensor types whose dequantization is tested here (tests/test_gguf.py)
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
                   "Q6_K")

# llama.cpp tensor name -> HF LlamaForCausalLM / Qwen2ForCausalLM / Qwen3ForCausalLM / Qwen3MoeForCausalLM name;
# per-layer names are "blk.N.<key>.weight" (and "blk.N.<key>.bias" for Qwen2's Q/K/V biases)
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
_LAYER_NAMES = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
                "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
                "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm", "ffn_gate_inp": "mlp.gate"}
# the stacked experts (qwen3moe) -> transformers' fused expert tensors (no ".weight"); gate and up join in one
_EXPERT_NAMES = {"ffn_gate_exps": "mlp.experts.gate_up_proj", "ffn_up_exps": "mlp.experts.gate_up_proj",
                 "ffn_down_exps": "mlp.experts.down_proj"}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_HF_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)")
_HF_EXPERT_RE = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(?:(\d+)\.)?(gate|up|down)_proj(?:\.weight)?")


def hf_name(gguf_name: str) -> str | None:
    """The HF name of a llama.cpp tensor name (None when it has none); the stacked expert gate and up matrices
    both name transformers' fused `mlp.experts.gate_up_proj`, which holds them joined."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.fullmatch(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    if m and m.group(2) in _EXPERT_NAMES and m.group(3) == "weight":
        return f"model.layers.{m.group(1)}.{_EXPERT_NAMES[m.group(2)]}"
    return None


def gguf_name(name: str) -> str:
    """The llama.cpp name of an HF tensor name (the name itself when it has none): the inverse of `hf_name`; an
    expert matrix, per-expert or fused, names the stacked tensor that holds it."""
    for g, h in _GLOBAL_NAMES.items():
        if h == name:
            return g
    m = _HF_EXPERT_RE.fullmatch(name)
    if m:
        return f"blk.{m.group(1)}.ffn_{m.group(3)}_exps.weight"
    m = _HF_LAYER_RE.fullmatch(name)
    ours = {h: g for g, h in _LAYER_NAMES.items()}
    if m and m.group(2) in ours:
        return f"blk.{m.group(1)}.{ours[m.group(2)]}.{m.group(3)}"
    return name


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """HF's row order of a Q or K projection ([n_heads * head_dim, ...]) from llama.cpp's.

    HF rotates the two halves of each head (dimension i pairs with i + head_dim/2); llama.cpp rotates adjacent
    pairs, so its converter stores, per head, HF rows (0, d/2, 1, d/2+1, ...). This undoes exactly that: row
    2i + j of a head goes back to row j * d/2 + i."""
    rows = w.shape[0]
    if rows % (2 * n_heads):
        raise ValueError(f"{rows} rows do not split into {n_heads} heads of an even size")
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@functools.cache
def _reader_class():
    import gguf

    class Reader(gguf.GGUFReader):
        """`gguf.GGUFReader` that names the tensor when its type id is one gguf does not know (gguf's own error
        names only the id). `_build_tensors` and the tensor-info field layout are gguf 0.19's (pinned)."""

        def _build_tensors(self, start_offs, fields):
            known = {int(t) for t in gguf.GGMLQuantizationType}
            for field in fields:
                name, raw = bytes(field.parts[1]).decode("utf-8", "replace"), int(field.parts[4][0])
                if raw not in known:
                    raise _UnknownType(f"tensor {name}: unknown ggml type id {raw}")
            super()._build_tensors(start_offs, fields)

    return Reader


class _UnknownType(ValueError):
    pass


def open_gguf(path: str):
    """A `gguf.GGUFReader` of `path` whose every tensor lies inside the file; a file that is not GGUF, is
    truncated, or holds a tensor of an unknown type is a ValueError naming the file."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such GGUF file")
    try:
        reader = _reader_class()(path)
    except _UnknownType as e:
        raise ValueError(f"{path}: {e}; jspec reads {', '.join(SUPPORTED_TYPES)}") from None
    except Exception as e:  # noqa: BLE001 - the reader fails in many ways on a damaged file; all mean the same
        raise ValueError(f"{path}: not a GGUF file, or truncated ({type(e).__name__}: {e})") from None
    size = os.path.getsize(path)
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size or t.data.nbytes != t.n_bytes:
            raise ValueError(f"{path}: truncated: tensor {t.name} needs bytes up to {t.data_offset + t.n_bytes}, "
                             f"the file holds {size}")
    return reader


def _as_reader(source):
    """(reader, path) of a path or an open reader."""
    if isinstance(source, (str, os.PathLike)):
        return open_gguf(os.fspath(source)), os.fspath(source)
    return source, getattr(source.data, "filename", None) or "<GGUF>"


_REQUIRED = object()


def _meta(reader, key: str, path: str, default: Any = _REQUIRED):
    """A metadata value (scalars as Python numbers, strings as str)."""
    field = reader.fields.get(key)
    if field is None:
        if default is _REQUIRED:
            raise ValueError(f"{path}: GGUF metadata has no {key}")
        return default
    value = field.contents()
    return value.item() if isinstance(value, np.generic) else value


def _int_meta(reader, key: str, path: str, default: Any = _REQUIRED):
    value = _meta(reader, key, path, default)
    if value is not None and not isinstance(value, int):
        raise ValueError(f"{path}: {key} = {value!r}; jspec reads a single integer there (no per-layer values)")
    return value


def _architecture(reader, path: str) -> str:
    arch = _meta(reader, "general.architecture", path)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported; jspec reads "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    return arch


def _rope_scaling(reader, arch: str, path: str) -> dict | None:
    kind = _meta(reader, f"{arch}.rope.scaling.type", path, "none")
    if kind == "none":
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(_meta(reader, f"{arch}.rope.scaling.factor", path))}
    raise ValueError(f"{path}: {arch}.rope.scaling.type {kind!r} is not supported (jspec reads none and linear)")


def _hf_config(reader, path: str) -> dict:
    arch = _architecture(reader, path)
    key = lambda k: f"{arch}.{k}"
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise ValueError(f"{path}: holds rope_freqs.weight (Llama-3.1-style RoPE frequency factors), which jspec "
                         "does not read")
    hidden = _int_meta(reader, key("embedding_length"), path)
    heads = _int_meta(reader, key("attention.head_count"), path)
    head_dim = (_int_meta(reader, key("attention.key_length"), path, None)
                or _int_meta(reader, key("rope.dimension_count"), path, None) or hidden // heads)
    for k in ("rope.dimension_count", "attention.value_length"):
        if _int_meta(reader, key(k), path, head_dim) != head_dim:
            raise ValueError(f"{path}: {key(k)} = {_meta(reader, key(k), path)} differs from the head size "
                             f"{head_dim}; jspec reads {arch} models whose RoPE and values span whole heads")
    vocab = _int_meta(reader, key("vocab_size"), path, None)
    if vocab is None and "tokenizer.ggml.tokens" in reader.fields:
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    if vocab is None and "token_embd.weight" in names:
        vocab = int(next(t for t in reader.tensors if t.name == "token_embd.weight").shape[-1])
    if vocab is None:
        raise ValueError(f"{path}: no vocabulary size ({key('vocab_size')}, tokenizer.ggml.tokens, token_embd)")
    tok = lambda k: _int_meta(reader, f"tokenizer.ggml.{k}_token_id", path, None)
    hf = {
        "model_type": _MODEL_TYPES.get(arch, arch),
        "architectures": [_HF_ARCHITECTURES[arch]],
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": _int_meta(reader, key("feed_forward_length"), path,
                                       None if arch == "qwen3moe" else _REQUIRED),
        "num_hidden_layers": _int_meta(reader, key("block_count"), path),
        "num_attention_heads": heads,
        "num_key_value_heads": _int_meta(reader, key("attention.head_count_kv"), path, heads),
        "head_dim": head_dim,
        "rms_norm_eps": float(_meta(reader, key("attention.layer_norm_rms_epsilon"), path)),
        "max_position_embeddings": _int_meta(reader, key("context_length"), path, 2048),
        "rope_theta": float(_meta(reader, key("rope.freq_base"), path, 10000.0)),
        "tie_word_embeddings": "output.weight" not in names,
        "hidden_act": "silu",
        "bos_token_id": tok("bos"),
        "eos_token_id": tok("eos"),
        "pad_token_id": tok("padding"),
    }
    if arch == "llama":
        hf.update(attention_bias=False, mlp_bias=False)
    elif arch == "qwen2":  # Q/K/V biases are implied by the model type
        hf["use_sliding_window"] = False
    else:  # qwen3, qwen3moe: no biases; the Q/K norms are tensors of the file
        hf.update(attention_bias=False, use_sliding_window=False)
    if arch == "qwen3moe":
        hf.update(_moe_config(reader, path))
    if hf["intermediate_size"] is None:  # unused where every layer is sparse; Qwen3MoeConfig's default then
        del hf["intermediate_size"]
    scaling = _rope_scaling(reader, arch, path)
    if scaling:
        hf["rope_scaling"] = scaling
    return hf


def _moe_config(reader, path: str) -> dict:
    """The Qwen3MoeConfig fields of a qwen3moe file: as transformers 5.23 reads them (norm_topk_prob true, every
    layer sparse), moe_intermediate_size from expert_feed_forward_length."""
    out = {}
    for field, k in (("num_experts", "expert_count"), ("num_experts_per_tok", "expert_used_count"),
                     ("moe_intermediate_size", "expert_feed_forward_length")):
        out[field] = _int_meta(reader, f"qwen3moe.{k}", path)
        if out[field] < 1:
            raise ValueError(f"{path}: qwen3moe.{k} = {out[field]}; expected an integer >= 1")
    return {**out, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []}


def gguf_to_hf_config(source) -> dict:
    """The HF config dict of a GGUF file's metadata: a `LlamaConfig` (model_type "llama"), a `Qwen2Config`
    (model_type "qwen2"), a `Qwen3Config` (model_type "qwen3") or a `Qwen3MoeConfig` (model_type "qwen3_moe"),
    `tie_word_embeddings` true when the file has no output.weight; ValueError when the file is not a GGUF, its
    architecture is not one jspec reads (SUPPORTED_ARCHITECTURES), or a value it needs is missing."""
    reader, path = _as_reader(source)
    return _hf_config(reader, path)


def _check_types(reader, path: str) -> None:
    bad = [f"{t.name}: {t.tensor_type.name}" for t in reader.tensors if t.tensor_type.name not in SUPPORTED_TYPES]
    if bad:
        raise ValueError(f"{path}: tensors of unsupported ggml types ({len(bad)}): {bad[:20]}; jspec reads "
                         f"{', '.join(SUPPORTED_TYPES)}")


def _read(tensor, heads: int | None) -> np.ndarray:
    """A tensor dequantized to float32 in numpy order ([out, in]), Q/K rows in HF's order when `heads` is given."""
    import gguf

    arr = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
    arr = arr.reshape(tuple(int(d) for d in reversed(tensor.shape)))
    return unpermute_rope_rows(arr, heads) if heads else arr


def stream_gguf(source, dtype=None, progress: bool = False):
    """`ports.io.hf_checkpoint.stream_checkpoint` of a GGUF file (a path or an open reader): everything about the file is
    checked here, before any tensor is dequantized."""
    reader, path = _as_reader(source)
    hf = _hf_config(reader, path)
    _check_types(reader, path)
    rope_heads = ({"attn_q": hf["num_attention_heads"], "attn_k": hf["num_key_value_heads"]}
                  if hf["model_type"] in _PERMUTED_ARCHITECTURES else {})
    gate_up: dict[str, dict] = {}
    for t in reader.tensors:
        m = _LAYER_RE.fullmatch(t.name)
        if m and m.group(2) in ("ffn_gate_exps", "ffn_up_exps") and m.group(3) == "weight":
            gate_up.setdefault(m.group(1), {})[m.group(2)] = t
    entries = []
    for t in reader.tensors:
        m = _LAYER_RE.fullmatch(t.name)
        if m and gate_up.get(m.group(1), {}).get(m.group(2)) is t:
            if next(iter(gate_up[m.group(1)].values())) is t:  # at the pair's first tensor in the file
                entries += _gate_up_entries(m.group(1), **gate_up[m.group(1)])
            continue
        heads = rope_heads.get(m.group(2)) if m and m.group(3) == "weight" else None
        entries.append(SourceTensor(hf_name(t.name) or t.name, t.name, _shape(t), functools.partial(_read, t, heads)))
    names = {t.name for t in reader.tensors}

    def spell(name: str) -> str:  # an expert missing from a stacked tensor the file holds: the tensor and expert
        m, g = _HF_EXPERT_RE.fullmatch(name), gguf_name(name)
        return f"{g} (expert {m.group(2)})" if m and m.group(2) and g in names else g

    return stream_checkpoint(path, hf, entries, dtype, progress, spell=spell)


def _shape(tensor) -> tuple:
    """A tensor's shape in numpy order."""
    return tuple(int(d) for d in reversed(tensor.shape))


def _gate_up_entries(layer: str, ffn_gate_exps=None, ffn_up_exps=None) -> list[SourceTensor]:
    """A layer's stacked expert gate and up matrices ([E, F, D] each) as one fused `mlp.experts.gate_up_proj`
    [E, 2F, D] (gate rows, then up rows), each dequantized once. When one is missing or their shapes differ, the
    file fails the checks: each is listed then as its per-expert matrices, so the error names what is wrong."""
    pair = [t for t in (ffn_gate_exps, ffn_up_exps) if t is not None]
    if len(pair) == 2 and _shape(ffn_gate_exps) == _shape(ffn_up_exps) and len(_shape(ffn_gate_exps)) == 3:
        E, F, D = _shape(ffn_gate_exps)
        return [SourceTensor(f"model.layers.{layer}.mlp.experts.gate_up_proj",
                             f"{ffn_gate_exps.name} + {ffn_up_exps.name}", (E, 2 * F, D),
                             functools.partial(_read_gate_up, ffn_gate_exps, ffn_up_exps))]
    out = []
    for t in pair:
        shape, kind = _shape(t), t.name.split(".")[2][len("ffn_"):-len("_exps")]
        if len(shape) != 3:
            out.append(SourceTensor(t.name, t.name, shape, functools.partial(_read, t, None)))
            continue
        for e in range(shape[0]):
            name = f"model.layers.{layer}.mlp.experts.{e}.{kind}_proj.weight"
            out.append(SourceTensor(name, f"{t.name} ({name})", shape[1:], functools.partial(_read_expert, t, e)))
    return out


def _read_gate_up(gate, up) -> np.ndarray:
    """transformers' fused [E, 2F, D] of the stacked gate and up matrices."""
    g = _read(gate, None)
    out = np.empty((g.shape[0], 2 * g.shape[1], g.shape[2]), np.float32)
    out[:, :g.shape[1]] = g
    del g
    out[:, out.shape[1] // 2:] = _read(up, None)
    return out


def _read_expert(tensor, e: int) -> np.ndarray:
    return _read(tensor, None)[e]


def load_gguf(source, dtype=None, *, progress: bool = False) -> Model:
    """A GGUF file (path or open reader) as a `Model` in `dtype` (default float32), its tensors dequantized one at a
    time. ValueError, before anything is dequantized, for a file that is not GGUF or is truncated, an architecture
    other than llama, qwen2, qwen3 and qwen3moe, a tensor type outside SUPPORTED_TYPES, or tensors that do not match the
    config."""
    return load_stream(stream_gguf(source, dtype, progress))


def convert_gguf(source, out_dir: str, dtype=None, progress: bool = False) -> tuple[Any, int]:
    """GGUF file (path or open reader) -> jspec checkpoint directory (what `ports.load` reads), streaming and
    resumable as `ports.convert_hf`; returns (config, number of parameters)."""
    reader, path = _as_reader(source)
    return convert_stream(stream_gguf(reader, dtype, progress), path, out_dir, dtype, progress)


# llama.cpp's tokenizer metadata keys (under "tokenizer.") -> the names transformers' GGUF tokenizer converter reads
# ("tokenizer") and the tokenizer constructor's kwargs ("tokenizer_config").
TOKENIZER_KEYS = {
    "tokenizer": {
        "ggml.model": "tokenizer_type", "ggml.pre": "pre_tokenizer_type", "ggml.tokens": "tokens",
        "ggml.scores": "scores", "ggml.token_type": "token_type", "ggml.merges": "merges",
        "ggml.precompiled_charsmap": "precompiled_charsmap", "ggml.bos_token_id": "bos_token_id",
        "ggml.eos_token_id": "eos_token_id", "ggml.unknown_token_id": "unk_token_id",
        "ggml.padding_token_id": "pad_token_id", "ggml.add_space_prefix": "add_prefix_space",
    },
    "tokenizer_config": {
        "chat_template": "chat_template", "ggml.add_bos_token": "add_bos_token",
        "ggml.add_eos_token": "add_eos_token",
    },
}


def _tokenizer_converter():
    """transformers' `convert_gguf_tokenizer(architecture, vocab) -> (backend, kwargs)`, wherever this version keeps
    it (`integrations.gguf.gguf_tokenizer_mapping` from 5.23, `integrations.ggml` before)."""
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer
    except ImportError:
        try:
            from transformers.integrations.ggml import convert_gguf_tokenizer
        except ImportError as e:
            import transformers

            raise ImportError(f"transformers {transformers.__version__} has no GGUF tokenizer converter "
                              f"(convert_gguf_tokenizer); jspec pins transformers==5.23.0") from e
    return convert_gguf_tokenizer


def _tokenizer_fields(reader, path: str) -> tuple[dict, dict]:
    """(the vocabulary dict transformers' GGUF tokenizer converter takes, tokenizer constructor kwargs)."""
    if "tokenizer.ggml.tokens" not in reader.fields:
        raise ValueError(f"{path}: holds no tokenizer (no tokenizer.ggml.tokens metadata)")
    groups = {group: {name: _meta(reader, f"tokenizer.{key}", path) for key, name in renames.items()
                      if f"tokenizer.{key}" in reader.fields}
              for group, renames in TOKENIZER_KEYS.items()}
    vocab, kwargs = groups["tokenizer"], groups["tokenizer_config"]
    if vocab.get("tokenizer_type") == "llama":  # a sentencepiece vocabulary: llama.cpp adds BOS unless told not to
        kwargs.setdefault("add_bos_token", True)
    for name, key in (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"), ("pad_token", "padding")):
        token_id = _meta(reader, f"tokenizer.ggml.{key}_token_id", path, None)
        kwargs[name] = vocab["tokens"][token_id] if token_id is not None else None
    return vocab, kwargs


def tokenizer_from_gguf(source):
    """The transformers tokenizer a GGUF file (path or open reader) describes, with its chat template when the file
    holds one: the tokenizer `AutoTokenizer.from_pretrained(dir, gguf_file=name)` builds, without importing torch
    (transformers' GGUF reader does). ValueError when the file holds no tokenizer."""
    import transformers

    convert_gguf_tokenizer = _tokenizer_converter()
    reader, path = _as_reader(source)
    vocab, kwargs = _tokenizer_fields(reader, path)
    backend, extra = convert_gguf_tokenizer(_meta(reader, "general.architecture", path), vocab)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, **{**extra, **kwargs})  # the file's ids win
