"""EAGLE-3 heads on disk, in the two layouts the field exchanges them in:

- `speculators` (vLLM's head format; what `speculators` trains and vLLM / SGLang load): `config.json` with
  `speculators_model_type: "eagle3"`, the head's `transformer_layer_config`, `draft_vocab_size`,
  `eagle_aux_hidden_state_layer_ids` and the norm flags; `model.safetensors` with `fc.weight` [D, n * D],
  `layers.{i}.*` (HF LLaMA names; layer 0 adds `hidden_norm.weight`, its q / k / v read 2D), `norm.weight`,
  `lm_head.weight` [Vd, D], `d2t` [Vd] (target id = d + d2t[d]) and `t2d` [V] (bool) when Vd < V, and optionally
  `embed_tokens.weight`, `fc_norm.{i}.weight` or `input_norm.weight`;
- the EAGLE repository's (SafeAILab/EAGLE, `eagle/model/cnets.py`): a flat LLaMA `config.json` with
  `draft_vocab_size`, and the same tensors with the decoder layer named `midlayer.*` (`pytorch_model.bin` or
  `model.safetensors`).

The heads published for Qwen3 and Qwen3-MoE targets are these same LLaMA layers (`LlamaForCausalLMEagle3`; the
q/k norms and experts are the target's, not the head's), and load for such a target like any other; a head whose
layers are another family's (`model_type` other than "llama") is refused by name.

`load_head` reads either (a directory, or a Hugging Face repo id already in the local cache); `save_head` writes
either. A checkpoint's token embedding is kept only when it is not the target's (trained embeddings); otherwise
the head reads the target's, and `save_head` leaves it out (vLLM then shares the target's) unless asked.
"""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from jspec.parts.drafters import eagle as EG
from jspec.parts.drafters import eagle3 as E3
from jspec.parts.drafters import heads as H
from jspec.parts.drafters.eagle_io import TORCH_WEIGHTS_NAME
from ports.core import fused as FU
from ports.families import llama
from ports.core.config import text_config_from_hf, text_config_to_hf

FORMATS = ("speculators", "eagle")
CONFIG_NAME = "config.json"
META_NAME = "eagle3_head.json"  # jspec's own note beside either layout: the target's signature, how it was trained
META_FORMAT = "jspec-eagle3-head"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
EMBED_KEY = "embed_tokens.weight"
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _layer_rows(hcfg) -> list[tuple[str, int, str, str | None]]:
    """(name without the layer prefix, layer, our key, transform) of the head's decoder layers."""
    return [(n.split(".", 2)[2], path[1], path[2], tr) for n, path, tr in llama.hf_key_map(hcfg, prefix="")
            if path[0] == "layers"]


def state_dict(head: E3.Eagle3Head, embed=None, layer_prefix: str = "layers.{i}.") -> dict[str, np.ndarray]:
    """The head's tensors in `speculators`' names (`layer_prefix` "midlayer." for the EAGLE repository's one-layer
    layout), numpy. embed: a token embedding [V, D] to store as `embed_tokens.weight` (the head's own if it has
    one)."""
    get = lambda a: np.asarray(jax.device_get(a))  # noqa: E731
    p = head.params
    hcfg = head.config
    out = {"fc.weight": get(p["fc"]).T, "norm.weight": get(p["norm"]), "lm_head.weight": get(p["lm_head"])}
    if "fc_norm" in p:
        out.update({f"fc_norm.{i}.weight": get(w) for i, w in enumerate(p["fc_norm"])})
    if "input_norm" in p:
        out["input_norm.weight"] = get(p["input_norm"])
    layers = [FU.unfuse_layer(hcfg, dict(layer)) for layer in p["layers"]]
    for name, i, key, tr in _layer_rows(hcfg):
        a = get(layers[i][key])
        out[layer_prefix.format(i=i) + name] = a.T if tr == "T" else a
    out[layer_prefix.format(i=0) + "hidden_norm.weight"] = get(layers[0]["hidden_norm"])
    if head.vocab is not None:
        ids = get(head.vocab).astype(np.int64)
        out["d2t"] = ids - np.arange(ids.size)
        t2d = np.zeros(head.target.vocab_size, bool)
        t2d[ids] = True
        out["t2d"] = t2d
    own = p.get("embed")
    if own is not None or embed is not None:
        out[EMBED_KEY] = get(own if own is not None else embed)
    return out


def _config(head: E3.Eagle3Head, fmt: str, verifier: str | None) -> dict:
    layer = text_config_to_hf(head.config)
    layer.update(vocab_size=head.target.vocab_size, tie_word_embeddings=False)
    layer.pop("eos_token_id", None)
    if fmt == "eagle":
        if head.config.num_layers != 1 or head.norm_before_residual or head.norm_output or "fc_norm" in head.params \
                or "input_norm" in head.params:
            raise ValueError("the EAGLE repository's layout holds one-layer heads without norm variants; save this "
                             "head in the speculators format")
        return {**layer, "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": head.draft_vocab_size}
    return {
        "architectures": ["Eagle3DraftModel"], "speculators_model_type": "eagle3",
        "transformer_layer_config": {**layer, "architectures": ["LlamaForCausalLM"]},
        "draft_vocab_size": head.draft_vocab_size, "eagle_aux_hidden_state_layer_ids": list(head.aux_layers),
        "norm_before_residual": bool(head.norm_before_residual), "norm_output": bool(head.norm_output),
        "fc_norm": "fc_norm" in head.params, "norm_before_fc": "input_norm" in head.params,
        "embed_requires_grad": "embed" in head.params, "target_hidden_size": None, "tie_word_embeddings": False,
        "speculators_config": {
            "algorithm": "eagle3", "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3, "accept_tolerance": 0.0,
                                  "verifier_accept_k": 1}],
            "verifier": {"name_or_path": verifier, "architectures": [f"{_arch(head.target.model_type)}"]}},
    }


def _arch(model_type: str) -> str:
    return {"qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM", "qwen3": "Qwen3ForCausalLM",
            "qwen3_moe": "Qwen3MoeForCausalLM"}.get(model_type, "LlamaForCausalLM")


def save_head(head: E3.Eagle3Head, directory: str, fmt: str = "speculators", *, target=None, embed: bool = False,
              verifier: str | None = None, dtype=None, extra: dict | None = None) -> None:
    """`directory/config.json` and `model.safetensors` in `fmt` ("speculators" or "eagle", module docstring), in
    `dtype` (default the head's), and `eagle3_head.json` (the target's signature, which `load_head` checks, and
    `extra`). embed: also store the target's token embedding (needs `target`; a head with its own embedding
    always stores it). verifier: the target's name or path recorded in the speculators config (what
    `speculators` loads missing weights from)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown EAGLE-3 head format {fmt!r}; one of {FORMATS}")
    if embed and target is None and "embed" not in head.params:
        raise ValueError("storing the token embedding needs the target (pass target=)")
    if target is not None:
        head.check(target)
    emb = E3.text_parts(target)[1]["embed"] if embed and target is not None else None
    tensors = state_dict(head, emb, "midlayer." if fmt == "eagle" else "layers.{i}.")
    if dtype is not None:
        tensors = {k: v.astype(dtype) if np.issubdtype(v.dtype, np.floating) else v for k, v in tensors.items()}
    os.makedirs(directory, exist_ok=True)
    H.write_weights(os.path.join(directory, WEIGHTS_NAME), tensors)
    conf = _config(head, fmt, verifier)
    conf["dtype"] = str(np.dtype(dtype or np.asarray(jax.device_get(head.params["norm"])).dtype))
    H.write_meta(os.path.join(directory, CONFIG_NAME), conf)
    H.write_meta(os.path.join(directory, META_NAME), {"format": META_FORMAT, "layout": fmt,
                                                      "target": head.target._asdict(), **(extra or {})})


# ---------------------------------------------------------------------------------------------- reading


def _resolve(path_or_repo_id: str) -> str:
    """A local directory: `path_or_repo_id` itself, or a Hugging Face repo id's snapshot in the local cache
    (nothing is downloaded when HF_HUB_OFFLINE is set)."""
    if os.path.isdir(path_or_repo_id):
        return path_or_repo_id
    if os.path.exists(path_or_repo_id) or path_or_repo_id.count("/") != 1:
        raise ValueError(f"{path_or_repo_id} is neither an EAGLE-3 head directory nor a Hugging Face repo id")
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(path_or_repo_id, allow_patterns=["*.json", "*.safetensors", "*.bin"])
    except Exception as e:
        raise ValueError(f"the EAGLE-3 head {path_or_repo_id!r} is not a local directory, and the Hugging Face "
                         f"cache does not hold it ({type(e).__name__}: {e})") from None


def _read_tensors(directory: str) -> dict[str, np.ndarray]:
    """Every tensor of `directory`'s model.safetensors (or its shards, or pytorch_model.bin through torch), in the
    stored dtype (bfloat16 as float32)."""
    def tidy(d):
        return {k: v.astype(np.float32) if v.dtype.name == "bfloat16" else v for k, v in d.items()}

    index = os.path.join(directory, INDEX_NAME)
    if os.path.exists(index):
        files = sorted(set(H.read_meta(index, None, "safetensors index")["weight_map"].values()))
        out = {}
        for f in files:
            out.update(tidy(H.read_weights(os.path.join(directory, f))))
        return out
    st = os.path.join(directory, WEIGHTS_NAME)
    if os.path.exists(st):
        return tidy(H.read_weights(st))
    pt = os.path.join(directory, TORCH_WEIGHTS_NAME)
    if os.path.exists(pt):
        return H.read_torch_weights(pt)
    raise ValueError(f"{directory} holds no EAGLE-3 head weights ({WEIGHTS_NAME}, {INDEX_NAME} or "
                     f"{TORCH_WEIGHTS_NAME})")


def _parse_config(conf: dict, eagle_layout: bool, target, aux_layers=None) -> dict:
    """The head's settings from either layout's config (module docstring)."""
    cfg, _ = E3.text_parts(target)
    if conf.get("speculators_model_type") is not None:
        if conf["speculators_model_type"] != "eagle3":
            raise ValueError(f"this speculators checkpoint holds a {conf['speculators_model_type']!r} speculator, "
                             "not an EAGLE-3 head")
        layer = dict(conf.get("transformer_layer_config") or {})
        th = conf.get("target_hidden_size")
        if th is not None and int(th) != cfg.hidden_size:
            raise ValueError(f"this EAGLE-3 head reads a target of hidden size {th}; the target's is "
                             f"{cfg.hidden_size}")
        aux = conf.get("eagle_aux_hidden_state_layer_ids")
        flags = {k: bool(conf.get(k, False)) for k in ("norm_before_residual", "norm_output", "fc_norm",
                                                         "norm_before_fc")}
    elif eagle_layout:
        layer, aux = dict(conf), None
        flags = {"norm_before_residual": bool(conf.get("norm_before_residual", False)), "norm_output": False,
                 "fc_norm": False, "norm_before_fc": False}
    else:
        raise ValueError("these weights are neither a speculators EAGLE-3 checkpoint (its config.json has no "
                         "speculators_model_type) nor an EAGLE repository one (no midlayer.* tensors)")
    if layer.get("model_type", "llama") != "llama":
        raise ValueError(f"this EAGLE-3 head's decoder layers are {layer.get('model_type')!r}; jspec runs LLaMA "
                         "layers (LlamaForCausalLMEagle3: the heads the EAGLE repository, vLLM and SGLang ship for "
                         "LLaMA, Qwen2 and Qwen3 targets)")
    layer.setdefault("vocab_size", cfg.vocab_size)
    hcfg = text_config_from_hf({**layer, "model_type": "llama"})
    if hcfg.hidden_size != cfg.hidden_size:
        raise ValueError(f"this EAGLE-3 head is {hcfg.hidden_size} wide; the target is {cfg.hidden_size}")
    if aux_layers is not None:
        if aux is not None and tuple(aux) != tuple(aux_layers):
            raise ValueError(f"this EAGLE-3 head was trained on target layers {list(aux)}, not {list(aux_layers)}")
        aux = aux_layers
    aux = tuple(int(i) for i in aux) if aux is not None else E3.default_aux_layers(cfg.num_layers)
    return {"config": hcfg, "aux_layers": aux, "draft_vocab_size": conf.get("draft_vocab_size"), **flags}


def from_state_dict(sd: dict, conf: dict, target, aux_layers=None) -> E3.Eagle3Head:
    """An `Eagle3Head` for `target` from a checkpoint's tensors and config.json (either layout; `aux_layers` as
    `load_head`'s). Missing, unexpected or mis-shaped tensors raise one ValueError naming them."""
    from ports.core.hf_layout import key_mismatch_error

    cfg, lm = E3.text_parts(target)
    eagle_layout = any(k.startswith("midlayer.") for k in sd)
    sd = {("layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k): v for k, v in sd.items()
          if not k.endswith(IGNORED_SUFFIXES)}
    s = _parse_config(conf, eagle_layout, target, aux_layers)
    hcfg = s["config"]
    D, V, n = cfg.hidden_size, cfg.vocab_size, len(s["aux_layers"])
    Vd = int(sd["lm_head.weight"].shape[0]) if "lm_head.weight" in sd else int(s["draft_vocab_size"] or V)
    layers = sorted({int(k.split(".")[1]) for k in sd if k.startswith("layers.") and k.split(".")[1].isdigit()})
    if layers != list(range(len(layers))) or not layers:
        raise ValueError(f"an EAGLE-3 head's decoder layers are numbered 0..; these weights hold layers {layers}")
    hcfg = E3.head_config(hcfg, len(layers), vocab_size=V, qkv_bias=hcfg.qkv_bias, o_bias=hcfg.o_bias,
                          mlp_bias=hcfg.mlp_bias)
    want = {"fc.weight": (D, n * D), "norm.weight": (D,), "lm_head.weight": (Vd, D), "layers.0.hidden_norm.weight":
            (D,)}
    shapes = llama.param_shapes(hcfg)["layers"]
    for name, i, key, tr in _layer_rows(hcfg):
        shape = tuple(shapes[i][key])
        if i == 0 and key in ("wq", "wk", "wv"):
            shape = (2 * D,) + shape[1:]
        want[f"layers.{i}.{name}"] = tuple(reversed(shape)) if tr == "T" else shape
    if s["fc_norm"]:
        want.update({f"fc_norm.{i}.weight": (D,) for i in range(n)})
    if s["norm_before_fc"]:
        want["input_norm.weight"] = (n * D,)
    if Vd != V:
        want.update({"d2t": (Vd,), "t2d": (V,)})
    missing = [k for k in want if k not in sd]
    bad = [f"{k}: {tuple(np.shape(sd[k]))}, expected {w}" for k, w in want.items()
           if k in sd and tuple(np.shape(sd[k])) != w]
    if EMBED_KEY in sd and tuple(np.shape(sd[EMBED_KEY])) != (V, D):
        bad.append(f"{EMBED_KEY}: {tuple(np.shape(sd[EMBED_KEY]))}, the target's embedding is {(V, D)}")
    unexpected = sorted(set(sd) - set(want) - {EMBED_KEY, "d2t", "t2d"})
    if missing or unexpected or bad:
        raise key_mismatch_error(f"these weights are not an EAGLE-3 head for the target "
                                 f"({E3.signature(target).describe()}, layers {list(s['aux_layers'])})",
                                 missing, unexpected, bad)
    vocab = None
    if Vd != V or "d2t" in sd:
        ids = np.arange(Vd) + np.asarray(sd["d2t"]).astype(np.int64)
        if ids.min() < 0 or ids.max() >= V or np.unique(ids).size != Vd:
            raise ValueError(f"the head's d2t maps its {Vd} draft tokens outside the target's {V} or onto one id twice")
        if "t2d" in sd and not (np.asarray(sd["t2d"]).astype(bool).sum() == Vd and np.asarray(sd["t2d"])[ids].all()):
            raise ValueError("the head's t2d does not mark the tokens its d2t maps to")
        if Vd != V or not np.array_equal(ids, np.arange(V)):
            vocab = jnp.asarray(ids, jnp.int32)
    f32 = lambda k: np.asarray(sd[k], np.float32)  # noqa: E731
    layer_params = [{} for _ in layers]
    for name, i, key, tr in _layer_rows(hcfg):
        a = f32(f"layers.{i}.{name}")
        layer_params[i][key] = a.T if tr == "T" else a
    layer_params[0]["hidden_norm"] = f32("layers.0.hidden_norm.weight")
    params = {"fc": f32("fc.weight").T, "layers": [FU.fuse_layer(hcfg, lp) for lp in layer_params],
              "norm": f32("norm.weight"), "lm_head": f32("lm_head.weight")}
    if s["fc_norm"]:
        params["fc_norm"] = np.stack([f32(f"fc_norm.{i}.weight") for i in range(n)])
    if s["norm_before_fc"]:
        params["input_norm"] = f32("input_norm.weight")
    if EMBED_KEY in sd:
        theirs = np.asarray(jax.device_get(lm["embed"]), np.float32)
        if not np.allclose(f32(EMBED_KEY), theirs, rtol=1e-2, atol=1e-3):
            params["embed"] = f32(EMBED_KEY)  # trained with the head: kept
    params = jax.tree.map(jnp.asarray, params)
    return E3.Eagle3Head(params, hcfg, s["aux_layers"], E3.signature(target), vocab, s["norm_before_residual"],
                         s["norm_output"])


def load_head(path_or_repo_id: str, target, dtype=None, aux_layers=None) -> E3.Eagle3Head:
    """An EAGLE-3 head for `target` from a directory or a cached Hugging Face repo id in either layout (module
    docstring), in `dtype` (default: the target's); ValueError when it is not one or was made for another
    target's shapes. aux_layers: the target layers it reads, when the checkpoint does not say (the EAGLE
    repository's layout never does; default (2, L // 2, L - 3))."""
    directory = _resolve(str(path_or_repo_id))
    conf = H.read_meta(os.path.join(directory, CONFIG_NAME), None, "EAGLE-3 head")
    sig = None
    if os.path.exists(os.path.join(directory, META_NAME)):  # saved by jspec: made for which weights
        sig = EG.FeatureHeadTarget(**H.read_meta(os.path.join(directory, META_NAME), META_FORMAT, "EAGLE-3 head")["target"])
    head = from_state_dict(_read_tensors(directory), conf, target, aux_layers)
    if sig is not None:
        head = head.replace(target=sig)
    dt = np.dtype(dtype or E3.text_parts(target)[1]["embed"].dtype)
    head = head.replace(params=jax.tree.map(lambda a: jnp.asarray(a, dt), head.params))
    head.check(target)
    return head
