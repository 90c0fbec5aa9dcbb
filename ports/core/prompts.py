"""Turning user prompts into right-padded token arrays with per-row lengths, with clear errors."""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

MODALITY_KEYS = ("pixel_values", "image_sizes", "image_grid_thw", "pixel_values_videos", "video_grid_thw",
                 "batch_num_images", "second_per_grid_ts", "mm_token_type_ids",
                 "vision_keep", "position_ids", "rope_deltas")  # the last three: Qwen2-VL pruned draft prompts


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _batch(ids, name: str) -> np.ndarray:
    """ids as a [B, T] array ([T] becomes one row); ValueError naming `name` for any other rank."""
    ids = np.asarray(ids)
    if ids.ndim == 1:
        ids = ids[None]
    if ids.ndim != 2:
        raise ValueError(f"{name} must be [T] or [B, T] token ids, got shape {ids.shape}")
    return ids


def check_input_keys(model: str, inputs: Mapping[str, Any], raw_keys, prepared_keys) -> None:
    """ValueError naming `model`, what it takes and the rest unless every key of `inputs` is one of `raw_keys` (the
    processor output); the message says so when some are `prepared_keys` (inputs prepared already)."""
    unknown = sorted(set(inputs) - set(raw_keys))
    if unknown:
        hint = " (inputs already prepared: pass the processor output)" if set(unknown) & set(prepared_keys) else ""
        raise ValueError(f"{model} takes {list(raw_keys)}; got unsupported {unknown}{hint}")


def normalize_prompt(prompt: Any, vocab_size: int, pad_to: int = 16) -> tuple[np.ndarray, np.ndarray, dict]:
    """Return (tokens [B, T_pad] int32 right-padded with 0, lengths [B] int32, modality inputs).

    Accepts an int array [T] or [B, T]; a list of token lists (ragged rows); or a mapping with `input_ids` (an
    array, or a list of ragged rows) and an optional `attention_mask` (left or right padding, as HF tokenizers and
    processors return), plus modality arrays.
    T_pad is rounded up to a multiple of `pad_to` so nearby prompt lengths share one compilation.
    """
    extra = {}
    if prompt is None or isinstance(prompt, (str, bytes)):
        raise ValueError(f"prompt must be token ids (an int array, a list of token lists, or a tokenizer's output), "
                         f"got {type(prompt).__name__}" + ("; tokenize the text first" if prompt is not None else ""))
    if isinstance(prompt, Mapping):
        if "input_ids" not in prompt:
            raise ValueError(f"prompt mapping has no 'input_ids' (keys: {sorted(prompt)})")
        raw = prompt["input_ids"]
        mask = prompt.get("attention_mask")
        if isinstance(raw, (list, tuple)) and raw and not np.isscalar(raw[0]) and mask is None:
            rows = [np.asarray(r) for r in raw]  # ragged rows, unpadded
        else:
            ids = _batch(raw, "input_ids")
            if mask is None:
                mask = np.ones_like(ids)
            else:
                mask = np.asarray(mask)
                mask = mask[None] if mask.ndim == 1 else mask
                if mask.shape != ids.shape:
                    raise ValueError(f"attention_mask has shape {mask.shape}, input_ids {ids.shape}: they must match")
                if not np.isin(mask, (0, 1)).all():
                    raise ValueError(f"attention_mask must hold 0 / 1 (or booleans), got values "
                                     f"{sorted(set(np.unique(mask).tolist()) - {0, 1})[:5]}")
            rows = []
            for b in range(ids.shape[0]):
                where = np.flatnonzero(mask[b])
                if where.size and where[-1] - where[0] + 1 != where.size:
                    raise ValueError(f"attention_mask row {b} has holes; only left or right padding is supported")
                rows.append(ids[b, where])
        extra = {k: np.asarray(v) for k, v in prompt.items() if k not in ("input_ids", "attention_mask")}
        unknown = [k for k in extra if k not in MODALITY_KEYS]
        if unknown:
            raise ValueError(f"prompt mapping has unsupported keys {unknown}")
        for k, v in extra.items():
            if np.issubdtype(v.dtype, np.floating) and not np.isfinite(v).all():
                raise ValueError(f"prompt {k} has {int(np.size(v) - np.isfinite(v).sum())} NaN or infinite values")
    elif isinstance(prompt, (list, tuple)) and prompt and not np.isscalar(prompt[0]):
        rows = [np.asarray(r) for r in prompt]
    else:
        rows = list(_batch(prompt, "prompt"))
    if not rows:
        raise ValueError("prompt is empty (no rows)")
    for b, r in enumerate(rows):
        if r.ndim != 1:
            raise ValueError(f"prompt row {b} must be 1-D token ids, got shape {r.shape}")
        if r.size == 0:
            raise ValueError(f"prompt row {b} is empty")
        if not np.issubdtype(r.dtype, np.integer):
            raise ValueError(f"prompt row {b} must hold integer token ids, got dtype {r.dtype}")
        if r.min() < 0 or r.max() >= vocab_size:
            raise ValueError(f"prompt row {b} has token ids outside the model vocabulary [0, {vocab_size}): "
                             f"min {r.min()}, max {r.max()}")
    lengths = np.array([r.size for r in rows], np.int32)
    T = round_up(int(lengths.max()), pad_to)
    tokens = np.zeros((len(rows), T), np.int32)
    for b, r in enumerate(rows):
        tokens[b, :r.size] = r
    return tokens, lengths, extra


def model_prompt(model, prompt, who: str = "", pad_to: int = 16):
    """(tokens, lengths, modality inputs as device arrays) of a prompt for `model`, checked on the host; `who`
    prefixes error messages (e.g. "draft ")."""
    import jax.numpy as jnp

    tokens, lengths, extra = normalize_prompt(prompt, model.config.vocab_size, pad_to)
    fam = model.family
    if extra and fam.prompt_embeds is None:
        raise ValueError(f"{who}model_type {model.config.model_type!r} takes text only; got inputs {sorted(extra)}")
    if fam.prepare_inputs is not None:
        extra = fam.prepare_inputs(model.config, tokens, lengths, extra)
    return tokens, lengths, {k: jnp.asarray(v) for k, v in extra.items()}
