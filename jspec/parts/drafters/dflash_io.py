"""Block drafters (`jspec.parts.drafters.dflash.DFlashHead`) on disk, in the layout of the DFlash authors' drafters:

- `config.json`: the head's decoder config in Hugging Face's LLaMA / Qwen2 fields (`num_hidden_layers` its own
  layers), `architectures: ["DFlashDraftModel"]`, `block_size`, `dflash_config.target_layer_ids` (the authors'
  convention: id i is the output of the target's layer i, counted from 0, so jspec's `target_layers` less one),
  and `jspec` (the target's signature, the draft vocabulary's size, how it was trained);
- `model.safetensors`: `fc.weight` [D, n * D], `hidden_norm.weight`, `norm.weight`, `layers.{i}.*` (Hugging Face
  LLaMA names), `mask_embedding` [D] (the mask position's input: the authors add a mask token to the
  vocabulary instead) and, for a reduced draft vocabulary, `draft_vocab` [Vd] (the target ids it scores).

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
from ports import llama
from ports.config import text_config_from_hf, text_config_to_hf

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
FORMAT = "jspec-dflash-head"


def _layer_rows(hcfg) -> list[tuple[str, tuple, str | None]]:
    return [(n, path, tr) for n, path, tr in llama.hf_key_map(hcfg, prefix="") if path[0] == "layers"]


def state_dict(head: DF.DFlashHead) -> dict[str, np.ndarray]:
    """The head's tensors under the names the module docstring lists, numpy."""
    get = lambda a: np.asarray(jax.device_get(a))  # noqa: E731
    p = head.params
    out = {"fc.weight": get(p["fc"]).T, "hidden_norm.weight": get(p["hidden_norm"]), "norm.weight": get(p["norm"]),
           "mask_embedding": get(p["mask"])}
    for name, (_, i, key), tr in _layer_rows(head.config):
        a = get(p["layers"][i][key])
        out[name] = a.T if tr == "T" else a
    if head.vocab is not None:
        out["draft_vocab"] = get(head.vocab).astype(np.int64)
    return out


def save_head(head: DF.DFlashHead, directory: str, *, dtype=None, extra: dict | None = None) -> str:
    """Write `head` to `directory` (config.json + model.safetensors, cast to `dtype` when given: the draft
    vocabulary stays int64); returns the directory."""
    os.makedirs(directory, exist_ok=True)
    conf = text_config_to_hf(head.config)
    conf.update(architectures=["DFlashDraftModel"], block_size=int(head.block),
                dflash_config={"target_layer_ids": [int(i) - 1 for i in head.target_layers]},
                jspec={"format": FORMAT, "target": head.target._asdict(), "draft_vocab": head.draft_vocab_size,
                       **(extra or {})})
    H.write_meta(os.path.join(directory, CONFIG_NAME), conf)
    sd = state_dict(head)
    if dtype is not None:
        sd = {k: v if v.dtype.kind == "i" else v.astype(jnp.dtype(dtype)) for k, v in sd.items()}
    H.write_weights(os.path.join(directory, WEIGHTS_NAME), sd)
    return directory


def load_head(directory: str, target, dtype=None) -> DF.DFlashHead:
    """The head in `directory` (written by `save_head`), checked against `target`; its floats as `dtype` (default
    the target's). ValueError naming what is missing or does not fit."""
    conf = H.read_meta(os.path.join(directory, CONFIG_NAME), what="block drafter")
    meta = conf.get("jspec", {})
    if meta.get("format") != FORMAT or "dflash_config" not in conf:
        raise ValueError(f"{directory}/{CONFIG_NAME} is not a jspec block drafter's (format {meta.get('format')!r})")
    hcfg = DF.head_config(text_config_from_hf(conf), int(conf["num_hidden_layers"]))
    path = os.path.join(directory, WEIGHTS_NAME)
    if not os.path.exists(path):
        raise ValueError(f"{directory} holds no {WEIGHTS_NAME}")
    sd = H.read_weights(path)
    need = {"fc.weight", "hidden_norm.weight", "norm.weight", "mask_embedding"} | {n for n, _, _ in _layer_rows(hcfg)}
    missing = sorted(need - set(sd))
    if missing:
        raise ValueError(f"{path} lacks {missing[:4]}{' ...' if len(missing) > 4 else ''}")
    extra = sorted(set(sd) - need - {"draft_vocab"})
    if extra:
        raise ValueError(f"{path} holds tensors a block drafter does not have: {extra[:4]}")
    cfg, lm = DF.text_parts(target)
    dt = dtype or lm["embed"].dtype
    f = lambda a: jnp.asarray(a, dt)  # noqa: E731
    layers = [dict() for _ in range(hcfg.num_layers)]
    for name, (_, i, key), tr in _layer_rows(hcfg):
        layers[i][key] = f(sd[name].T if tr == "T" else sd[name])
    params = {"fc": f(sd["fc.weight"].T), "hidden_norm": f(sd["hidden_norm.weight"]), "layers": layers,
              "norm": f(sd["norm.weight"]), "mask": f(sd["mask_embedding"])}
    t = meta["target"]
    sig = EG.FeatureHeadTarget(t["model_type"], int(t["hidden_size"]), int(t["vocab_size"]), float(t["fingerprint"]))
    vocab = None if "draft_vocab" not in sd else jnp.asarray(sd["draft_vocab"], jnp.int32)
    head = DF.DFlashHead(params, hcfg, tuple(int(i) + 1 for i in conf["dflash_config"]["target_layer_ids"]), sig,
                         int(conf["block_size"]), vocab)
    if params["fc"].shape != (len(head.target_layers) * cfg.hidden_size, hcfg.hidden_size):
        raise ValueError(f"{path}: fc.weight is {tuple(sd['fc.weight'].shape)}, not [D, n * D] for the "
                         f"{len(head.target_layers)} target layers config.json names")
    head.check(target)
    return head
