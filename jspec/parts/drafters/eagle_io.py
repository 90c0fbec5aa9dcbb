"""Storage of EAGLE-1 feature heads (`jspec.parts.drafters.eagle.EagleHead`) in the PyTorch EAGLE / LANTERN key layout.

On disk a head is what a PyTorch user of EAGLE-1 (SafeAILab/EAGLE `eagle/model/cnets.py`) or LANTERN
(`models/drafters/cnets_*.py`) holds in its state dict, minus the frozen token embedding:

    fc.weight [D, 2D] (out, in; the input is [embedding; feature]), fc.bias [D]
    layers.0.self_attn.{q,k,v,o}_proj.weight (+ .bias with attention biases)
    layers.0.self_attn.{q,k}_norm.{weight,bias}          Chameleon only: [heads, head_dim] / [kv heads, head_dim]
    layers.0.mlp.{gate,up,down}_proj.weight
    layers.0.post_attention_layernorm.weight
    layers.0.input_layernorm.weight                       only when the head normalises its input (`input_norm`):
                                                          LANTERN's Chameleon heads do, EAGLE-1's LLaMA heads not

`save_head` writes `model.safetensors` in that layout, `eagle_head.json` (format tag, family, input_norm, the
target's signature, the caller's extra) and, given a LANTERN latent-neighbour table, `neighbours.npz`.
`load_head` / `load_drafter` read those, and also a foreign checkpoint directory (no eagle_head.json): an EAGLE or
LANTERN `pytorch_model.bin` (through torch, when it is installed) or `model.safetensors`, with its `config.json`
checked against the target; the head then takes the target's signature. LANTERN's own Chameleon layer stores the
per-head QK-norm scales as [model_parallel_size, head_dim] rows shared by consecutive heads; those are expanded
to one row per head on reading (what transformers' ChameleonDecoderLayer holds, and what is written back).
"""
from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from jspec.parts.drafters import eagle as EG
from jspec.parts.drafters import heads as H
from ports.core import fused as FU
from ports.families import llama

CONFIG_NAME = EG.CONFIG_NAME          # eagle_head.json
WEIGHTS_NAME = EG.WEIGHTS_NAME        # model.safetensors
TORCH_WEIGHTS_NAME = "pytorch_model.bin"
TABLE_NAME = "neighbours.npz"
COUNTS_NAME = "token_counts.npy"  # how often each token id was an answer token of the head's training data
HF_CONFIG_NAME = "config.json"
FORMAT = "jspec-eagle-head"
# tensors a PyTorch head may carry that the head does not use (the target's embedding is checked, then dropped)
EMBED_KEY = "embed_tokens.weight"
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


# ---------------------------------------------------------------------------------------------- key layout


def _derived_config(head: EG.EagleHead):
    """A one-layer text config of the head's shapes (fused layer: wqkv [D, KVH, G + 2, Dh], w_gate_up [D, 2, F]),
    for when no target is at hand."""
    from ports.core.config import TextConfig

    p = head.params["layer"]
    if "wqkv" not in p or "w_gate_up" not in p:
        raise ValueError("writing a head whose layer is not in the run layout (fused q/k/v and gate/up) needs the "
                         "target (pass target=)")
    D, KVH, G2, Dh = p["wqkv"].shape
    kw = dict(model_type=head.target.model_type, vocab_size=head.target.vocab_size, hidden_size=D,
              intermediate_size=p["w_gate_up"].shape[-1], num_layers=1, num_heads=KVH * (G2 - 2), num_kv_heads=KVH,
              head_dim=Dh, qkv_bias="bqkv" in p, o_bias="bo" in p, mlp_bias="b_down" in p)
    if head.family == "chameleon":
        from ports.families.chameleon import ChameleonConfig

        return ChameleonConfig(**kw)
    return TextConfig(**kw)


def _layer_rows(cfg, family: str) -> list[tuple[str, str, str | None]]:
    """(torch name, our layer key, transform) of the head's one decoder layer: the port's `hf_key_map` rows of
    layer 0 without their prefix ("T": the torch tensor is [out, in])."""
    hcfg = EG.head_config(cfg)
    if family == "chameleon":
        from ports.families import chameleon as CH

        rows = [(n[len("model."):], path, tr) for n, path, tr in CH.hf_key_map(hcfg)]
    else:
        rows = llama.hf_key_map(hcfg, prefix="")
    return [(n, path[2], tr) for n, path, tr in rows if path[0] == "layers"]


def _uses_attn_norm(cfg, family: str, input_norm: bool) -> bool:
    """Whether the layer reads attn_norm (torch: input_layernorm): an input norm, or Chameleon's swin norm (there
    the same weight normalises the attention output)."""
    return bool(input_norm) or (family == "chameleon" and bool(getattr(cfg, "swin_norm", False)))


def torch_state_dict(head: EG.EagleHead, target=None) -> dict[str, np.ndarray]:
    """The head in the PyTorch EAGLE / LANTERN key layout (module docstring), numpy arrays in the head's dtype.
    `target` (optional) supplies the config; without it the config is read off the head's fused shapes."""
    cfg = EG.text_parts(target)[0] if target is not None else _derived_config(head)
    layer = FU.unfuse_layer(cfg, dict(head.params["layer"]))
    keep_norm = _uses_attn_norm(cfg, head.family, head.input_norm)
    fc = np.asarray(jax.device_get(head.params["fc"]))
    out = {"fc.weight": fc.T}
    if head.params.get("fc_b") is not None:
        out["fc.bias"] = np.asarray(jax.device_get(head.params["fc_b"]))
    used = set()
    for name, key, tr in _layer_rows(cfg, head.family):
        if key == "attn_norm" and not keep_norm:
            used.add(key)
            continue
        if key not in layer:
            raise ValueError(f"the head's layer lacks {key!r} (torch {name})")
        a = np.asarray(jax.device_get(layer[key]))
        out[name] = a.T if tr == "T" else a
        used.add(key)
    left = sorted(set(layer) - used)
    if left:
        raise ValueError(f"the head's layer holds parameters the PyTorch layout has no name for: {left}")
    return out


def _expand_heads(a: np.ndarray, want: tuple[int, ...]) -> np.ndarray | None:
    """LANTERN's [model_parallel_size, head_dim] QK-norm rows, each shared by consecutive heads, as one row per head
    (torch's repeat_interleave); None if `a` is not of that form."""
    if a.ndim == 2 and len(want) == 2 and a.shape[1] == want[1] and 0 < a.shape[0] < want[0] \
            and want[0] % a.shape[0] == 0:
        return np.repeat(a, want[0] // a.shape[0], axis=0)
    return None


def _layer_index(name: str) -> int | None:
    parts = name.split(".")
    if len(parts) > 2 and parts[0] == "layers" and parts[1].isdigit():
        return int(parts[1])
    return None


def from_torch_state_dict(sd: dict, target, input_norm: bool | None = None) -> EG.EagleHead:
    """The inverse of `torch_state_dict`: an `EagleHead` for `target` (its signature; its dtype is the tensors').
    `embed_tokens.weight`, if present, must have the target's embedding shape and is otherwise ignored (the head
    uses the target's). `input_norm` None: inferred from the presence of `layers.0.input_layernorm.weight`.
    Missing, unexpected or mis-shaped tensors raise one ValueError naming them; so does a head of several layers."""
    from ports.core.hf_layout import key_mismatch_error

    cfg, _ = EG.text_parts(target)
    family = EG.family_of(cfg)
    D, V = cfg.hidden_size, cfg.vocab_size
    sd = {k: v for k, v in sd.items() if not k.endswith(IGNORED_SUFFIXES)}
    layers = sorted({i for i in map(_layer_index, sd) if i is not None})
    if layers and layers != [0]:
        raise ValueError(f"an EAGLE-1 head has one decoder layer; these weights hold layers {layers}: EAGLE-1 / "
                         "LANTERN heads only are supported")
    if EMBED_KEY in sd and tuple(np.shape(sd[EMBED_KEY])) != (V, D):
        raise ValueError(f"the head's {EMBED_KEY} has shape {tuple(np.shape(sd[EMBED_KEY]))}, the target's embedding "
                         f"is ({V}, {D}): this head was made for another target")
    if input_norm is None:
        input_norm = "layers.0.input_layernorm.weight" in sd
    keep_norm = _uses_attn_norm(cfg, family, input_norm)
    shapes = _layer_shapes(cfg, family)
    missing, bad = [], []
    used = {EMBED_KEY}
    layer = {}
    for name, key, tr in _layer_rows(cfg, family):
        if key == "attn_norm" and not keep_norm:
            continue
        if name not in sd:
            missing.append(name)
            continue
        used.add(name)
        a = np.asarray(sd[name])
        a = a.T if tr == "T" else a
        want = shapes[key]
        if a.shape != want:
            expanded = _expand_heads(a, want) if key in ("q_norm", "q_norm_b", "k_norm", "k_norm_b") else None
            if expanded is None:
                bad.append(f"{name}: {tuple(np.shape(sd[name]))}, expected "
                           f"{tuple(reversed(want)) if tr == 'T' else want}")
                continue
            a = expanded
        layer[key] = a
    fc = sd.get("fc.weight")
    used.update({"fc.weight", "fc.bias"})
    if fc is None:
        missing.append("fc.weight")
    elif tuple(np.shape(fc)) != (D, 2 * D):
        bad.append(f"fc.weight: {tuple(np.shape(fc))}, expected {(D, 2 * D)}")
    fc_b = sd.get("fc.bias")
    if fc_b is not None and tuple(np.shape(fc_b)) != (D,):
        bad.append(f"fc.bias: {tuple(np.shape(fc_b))}, expected {(D,)}")
    unexpected = sorted(set(sd) - used)
    if missing or unexpected or bad:
        sig = EG.signature(target).describe()
        raise key_mismatch_error(f"these weights are not an EAGLE-1 head for the target ({sig}, input_norm="
                                 f"{input_norm})", missing, unexpected, bad)
    params = {"fc": jnp.asarray(np.asarray(fc).T), "layer": {k: jnp.asarray(v) for k, v in
                                                              FU.fuse_layer(cfg, layer).items()}}
    if fc_b is not None:
        params["fc_b"] = jnp.asarray(np.asarray(fc_b))
    return EG.EagleHead(params, family, bool(input_norm), EG.signature(target))


def _layer_shapes(cfg, family: str) -> dict[str, tuple[int, ...]]:
    """Our (checkpoint-layout, unfused) shapes of the head's layer."""
    hcfg = EG.head_config(cfg)
    layer = dict(llama.param_shapes(hcfg)["layers"][0])
    if family == "chameleon":  # ports.families.chameleon.param_shapes adds the same per-head QK norms
        H, KVH, Dh = hcfg.num_heads, hcfg.num_kv_heads, hcfg.head_dim
        layer.update(q_norm=(H, Dh), q_norm_b=(H, Dh), k_norm=(KVH, Dh), k_norm_b=(KVH, Dh))
    return layer


# ---------------------------------------------------------------------------------------------- directories


def save_head(head: EG.EagleHead, directory: str, table=None, extra: dict | None = None, *, target=None,
              dtype=None) -> None:
    """`directory/model.safetensors` (the `torch_state_dict` layout, in `dtype` or the head's), `eagle_head.json`
    (format, family, input_norm, the target's signature, `extra`) and, given a `jspec.parts.neighbours.NeighbourTable`,
    `neighbours.npz`. With `target`, also a `config.json`: the target's HF config with one layer (what a PyTorch
    EAGLE / LANTERN head is built from)."""
    if target is not None:
        head.check(target)
    H.write_weights(os.path.join(directory, WEIGHTS_NAME), torch_state_dict(head, target), dtype)
    H.write_meta(os.path.join(directory, CONFIG_NAME), {
        "format": FORMAT, "family": head.family, "input_norm": bool(head.input_norm),
        "fc_bias": head.params.get("fc_b") is not None, "target": head.target._asdict(), **(extra or {})})
    if target is not None:
        hf = _hf_config(target)
        if hf is not None:
            H.write_meta(os.path.join(directory, HF_CONFIG_NAME), hf)
    path = os.path.join(directory, TABLE_NAME)
    if table is not None:
        table.check(head.target.vocab_size)
        table.save(path)
    elif os.path.exists(path):
        os.remove(path)  # a table left by an earlier save would pair with the wrong head


def _hf_config(target) -> dict | None:
    cfg, _ = EG.text_parts(target)
    try:
        if EG.family_of(cfg) == "chameleon":
            from ports.families import chameleon as CH

            d = CH.config_to_hf(cfg)
        else:
            from ports.core.config import text_config_to_hf

            d = text_config_to_hf(cfg)
    except Exception:  # a config the ports cannot write: the head is complete without it
        return None
    d["num_hidden_layers"] = 1
    return d


def _read_weights(directory: str) -> dict[str, np.ndarray]:
    """The tensors of `directory`'s model.safetensors, else its pytorch_model.bin (through torch); float32 numpy."""
    st = os.path.join(directory, WEIGHTS_NAME)
    pt = os.path.join(directory, TORCH_WEIGHTS_NAME)
    if os.path.exists(st):
        return H.read_weights(st)
    if os.path.exists(pt):
        return {k: v.astype(np.float32) for k, v in H.read_torch_weights(pt).items()}
    raise ValueError(f"{directory} holds no EAGLE head weights ({WEIGHTS_NAME} or {TORCH_WEIGHTS_NAME})")


def _check_foreign_config(directory: str, target) -> None:
    path = os.path.join(directory, HF_CONFIG_NAME)
    if not os.path.exists(path):
        return  # the tensors' shapes are checked anyway
    with open(path) as f:
        d = json.load(f)
    d = d.get("text_config", d) if isinstance(d.get("text_config"), dict) else d
    cfg, _ = EG.text_parts(target)
    theirs = {"hidden_size": d.get("hidden_size"), "num_attention_heads": d.get("num_attention_heads")}
    ours = {"hidden_size": cfg.hidden_size, "num_attention_heads": cfg.num_heads}
    diff = [f"{k} {theirs[k]} (target: {ours[k]})" for k in ours if theirs[k] is not None and theirs[k] != ours[k]]
    if diff:
        raise ValueError(f"the EAGLE head in {directory} was made for another target: its config.json has "
                         + ", ".join(diff))
    n = d.get("num_hidden_layers")
    if n is not None and int(n) != 1:
        raise ValueError(f"the head in {directory} has num_hidden_layers={n}; an EAGLE-1 head has one decoder layer")


def load_head(directory: str, target, dtype=None) -> EG.EagleHead:
    """A head saved by `save_head`, or a foreign EAGLE / LANTERN checkpoint directory (module docstring), for
    `target` (ValueError when it was made for another), in `dtype` (default: the target's)."""
    directory = str(directory)
    if not os.path.isdir(directory):
        raise ValueError(f"{directory} is not a directory")
    _, lm = EG.text_parts(target)
    dt = np.dtype(dtype or lm["embed"].dtype)
    meta_path = os.path.join(directory, CONFIG_NAME)
    if os.path.exists(meta_path):
        meta = H.read_meta(meta_path, FORMAT, "EAGLE head")
        sig = EG.FeatureHeadTarget(**meta["target"])
        EG.EagleHead({}, meta["family"], bool(meta["input_norm"]), sig).check(target)  # before reading the weights
        if not os.path.exists(os.path.join(directory, WEIGHTS_NAME)):
            raise ValueError(f"{directory} holds no EAGLE head weights ({WEIGHTS_NAME} is missing)")
        head = from_torch_state_dict(_read_weights(directory), target, bool(meta["input_norm"]))
        head = head.replace(target=sig)
    else:
        _check_foreign_config(directory, target)
        head = from_torch_state_dict(_read_weights(directory), target)
    head = head.replace(params=jax.tree.map(lambda a: jnp.asarray(a, dt), head.params))
    head.check(target)
    return head


def load_drafter(directory: str, target):
    """(head, neighbour table or None) of a directory `save_head` wrote (or a foreign head without a table); the
    table is checked against the target's vocabulary and, for a Chameleon target with its VQ model, codebook."""
    from jspec.parts.neighbours import NeighbourTable

    head = load_head(directory, target)
    path = os.path.join(str(directory), TABLE_NAME)
    if not os.path.exists(path):
        return head, None
    cfg, params = EG.text_parts(target)
    codebook = None
    if isinstance(params, dict) and "vqmodel" in params:
        from ports.families import vqgan as VQ

        codebook = np.asarray(jax.device_get(VQ.codebook(params["vqmodel"])))
    return head, NeighbourTable.load(path, vocab_size=cfg.vocab_size, codebook=codebook)


def frequent_tokens(counts, n: int) -> np.ndarray:
    """The ids of the n most frequent tokens of `counts` [V] (ties: the lower id first), sorted."""
    counts = np.asarray(counts)
    if counts.ndim != 1 or not 1 <= n <= counts.size:
        raise ValueError(f"a draft vocabulary of {n} tokens out of counts of shape {counts.shape}")
    return np.sort(np.argsort(-counts, kind="stable")[:n]).astype(np.int32)


def same_params(a: EG.EagleHead, b: EG.EagleHead) -> bool:
    """Whether two heads hold identical parameters (structure, shapes, dtypes and values)."""
    la, ta = jax.tree.flatten(a.params)
    lb, tb = jax.tree.flatten(b.params)
    return ta == tb and all(x.shape == y.shape and x.dtype == y.dtype and bool(np.array_equal(np.asarray(x),
                                                                                             np.asarray(y)))
                            for x, y in zip(la, lb))


