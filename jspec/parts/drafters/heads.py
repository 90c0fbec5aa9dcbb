"""What every trained draft head shares (EAGLE-1 feature heads, EESD early-exit heads, Cali-TS predictors, and
heads to come): the target's text model behind a wrapper, how a head tells its target's weights from another's,
and the on-disk form (a safetensors file in the PyTorch key layout beside a JSON file naming format and target)."""
from __future__ import annotations

import json
import os
from typing import Any

import jax
import numpy as np

LLAVA_TYPES = ("llava", "llava_next", "llava_next_video", "llava_onevision")


def text_model(target, model_types: tuple[str, ...], needs: str) -> tuple[Any, dict]:
    """(text config, language-model params) of `target` (through a guided wrapper): the model itself when its
    `model_type` is one of `model_types`, a LLaVA model's language model; else ValueError "`needs`; the target
    is ..."."""
    model = getattr(target, "model", target)  # a guided wrapper holds its model
    cfg, params = getattr(model, "config", None), getattr(model, "params", None)
    kind = getattr(cfg, "model_type", None)
    if kind in model_types:
        return cfg, params
    if kind in LLAVA_TYPES:
        return cfg.text, params["lm"]
    raise ValueError(f"{needs}; the target is {kind or type(target).__name__!r}")


def num_params(params) -> int:
    return int(sum(np.prod(a.shape) for a in jax.tree.leaves(params)))


def same_fingerprint(a: float, b: float) -> bool:
    """Whether two weight fingerprints come from one target (they agree to 1e-2 relative: float32 and bfloat16
    copies of one model do)."""
    return abs(a - b) <= 1e-2 * max(1.0, abs(a))


def check_made_for(what: str, made, given) -> None:
    """ValueError when a head made for the target signature `made` (`eagle.FeatureHeadTarget`) is given a
    target of signature `given`: another width or vocabulary, or other weights (`same_fingerprint`)."""
    if (given.hidden_size, given.vocab_size) != tuple(made[1:3]):
        raise ValueError(f"this {what} was made for another target ({made.describe()}); the target given is "
                         f"{given.describe()}")
    if not same_fingerprint(given.fingerprint, made.fingerprint):
        raise ValueError(f"this {what} was made for another target's weights ({made.describe()}); the target given "
                         f"is {given.describe()}")


def write_weights(path: str, tensors: dict[str, np.ndarray], dtype=None) -> None:
    """`tensors` (name -> numpy array) as one safetensors file, cast to `dtype` when given."""
    from ports.core.safetensors_io import write_safetensors

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    out = np.dtype(dtype) if dtype is not None else None
    shapes = {n: (a.shape, out or a.dtype) for n, a in tensors.items()}
    write_safetensors(path, shapes, lambda n: tensors[n] if out is None else tensors[n].astype(out))


def read_weights(path: str, dtype=None) -> dict[str, np.ndarray]:
    """The tensors of one safetensors file as numpy arrays (cast to `dtype` when given)."""
    from ports.core.safetensors_io import SafetensorsFile

    f = SafetensorsFile(path)
    return {k: np.asarray(f.get(k)) if dtype is None else np.asarray(f.get(k)).astype(dtype) for k in f.keys()}


def read_torch_weights(path: str) -> dict[str, np.ndarray]:
    """The tensors of a PyTorch state-dict pickle (pytorch_model.bin) as numpy arrays, floating ones as float32;
    ValueError when torch is missing or the file holds no state dict."""
    try:
        import torch
    except ImportError:
        raise ValueError(f"{path} is a PyTorch pickle and torch is not installed: install torch, or convert it to "
                         "model.safetensors") from None
    sd = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(sd, dict):
        raise ValueError(f"{path} does not hold a state dict (got {type(sd).__name__})")
    return {k: (v.detach().float() if v.is_floating_point() else v.detach()).numpy() for k, v in sd.items()
            if hasattr(v, "detach")}


def write_meta(path: str, meta: dict) -> None:
    with open(path, "w") as f:
        json.dump(meta, f, indent=2)


def read_meta(path: str, fmt: str | None = None, what: str = "head") -> dict:
    """The JSON object at `path`; ValueError when it is missing, not JSON, or (given `fmt`) of another format."""
    from ports.io.hf_checkpoint import read_json

    if not os.path.exists(path):
        raise ValueError(f"{os.path.dirname(path) or '.'} holds no {what} ({os.path.basename(path)} is missing)")
    meta = read_json(path)
    if fmt is not None and meta.get("format") != fmt:
        raise ValueError(f"{path} is not an {what} ({meta.get('format')!r}, expected {fmt!r})")
    return meta
