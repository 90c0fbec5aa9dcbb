"""HF checkpoints: `load_hf` streams safetensors tensor by tensor into a params pytree and checks that every
checkpoint tensor was consumed and every parameter filled with the right shape; `save_hf` writes the reverse (HF
layout). `stream_checkpoint` is the checked tensor stream every source format (safetensors, GGUF) goes through.

The family's `param_shapes` and `hf_key_map` describe the checkpoint layout (one matrix per projection); the
loaders return the run layout (`ports.core.fused`: q/k/v and gate/up fused per decoder layer), which `save_hf` turns
back.
"""
from __future__ import annotations

import functools
import json
import os
import re
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ports.core import fused as FU
from ports.core.hf_layout import (expected_hf_shape, hf_shape_to_ours, hf_to_ours, key_mismatch_error, ours_shape_to_hf,
                             ours_to_hf)
from ports.model import Model, family, resolve_dtype
from ports.core.scanned import is_scanned, unscan_layers
from ports.core.param_paths import empty_like_shapes, get_path, layers_path, leaf_paths, set_path, without_layers
from ports.core.safetensors_io import FLOAT_DTYPES, SafetensorsFile, checkpoint_files, write_safetensors


def read_json(path: str) -> dict:
    with open(path) as f:
        try:
            out = json.load(f)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(out, dict):
        raise ValueError(f"{path}: holds a JSON {type(out).__name__}, not an object")
    return out


def read_hf_config(directory: str) -> dict:
    """config.json merged with generation_config.json's token ids (the EOS transformers' generate uses)."""
    path = os.path.join(directory, "config.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{directory}: no config.json (is this an HF checkpoint directory?)")
    cfg = read_json(path)
    gen_path = os.path.join(directory, "generation_config.json")
    if os.path.exists(gen_path):
        gen = read_json(gen_path)
        for k in ("eos_token_id", "bos_token_id", "pad_token_id"):
            if gen.get(k) is not None:
                cfg[k] = gen[k]
    return cfg


class SourceTensor(NamedTuple):
    """One tensor a checkpoint source holds, known from its header alone (nothing read yet)."""

    name: str  # the `hf_key_map` name it loads as (after the family's renames)
    label: str  # how errors name it: the source's own spelling
    shape: tuple  # in the HF layout
    read: Callable[[], np.ndarray]  # the tensor, HF layout
    bad_dtype: str | None = None  # the source's dtype when it cannot load as floating point (None: it can)


def stream_checkpoint(source: str, hf: dict, entries: list[SourceTensor], dtype, progress: bool,
                      spell: Callable[[str], str] = lambda name: name):
    """(hf config dict, config, family, tensors) of a checkpoint whose tensors `entries` lists; `tensors(
    skip_layers=())` iterates over (param path, our-layout numpy array). What `load_stream` and `convert_stream`
    take, whatever the source format.

    Every entry is checked against the architecture of `hf` first, so missing, unexpected, mis-shaped, non-float
    or duplicated tensors are one ValueError listing them all (missing ones named by `spell(hf name)`, the
    source's spelling, each name once) before any tensor is read. The iterator then reads one tensor at a time, in
    our layout and dtype; tensors of the decoder layers in `skip_layers` are not read (a resumed conversion).
    """
    fam = family(hf.get("model_type"))
    cfg = fam.config_from_hf(hf)
    dt = np.dtype(resolve_dtype(dtype))
    shapes = fam.param_shapes(cfg)
    kmap = {name: (path, tr) for name, path, tr in fam.hf_key_map(cfg)}
    ignored = [re.compile(p) for p in fam.ignored_keys]
    if getattr(cfg, "tie_word_embeddings", False):
        ignored.append(re.compile(r"(^|\.)lm_head\.weight$"))

    if fam.split_hf_tensor is not None:
        entries = split_entries(entries, fam.split_hf_tensor)
    unexpected, bad_shape, bad_dtype, duplicated, seen, plan = [], [], [], [], set(), []
    for e in entries:
        if e.name not in kmap:
            if not any(p.search(e.name) for p in ignored):
                unexpected.append(e.label)
            continue
        if e.name in seen:
            duplicated.append(e.label)
            continue
        seen.add(e.name)
        path, tr = kmap[e.name]
        want, got = tuple(get_path(shapes, path)), tuple(e.shape)
        if len(got) != len(want) or hf_shape_to_ours(got, tr) != want:
            bad_shape.append(f"{e.label}: checkpoint {got}, expected {expected_hf_shape(want, tr)}")
        elif e.bad_dtype is not None:
            bad_dtype.append(f"{e.label}: {e.bad_dtype}")
        else:
            plan.append((e.read, path, tr))
    missing = list(dict.fromkeys(spell(n) for n in kmap if n not in seen))
    if missing or unexpected or bad_shape or bad_dtype or duplicated:
        raise key_mismatch_error(f"checkpoint {source} does not match {hf.get('model_type')} params:",
                                 missing, unexpected, bad_shape, bad_dtype, duplicated)
    lp = layers_path(shapes)

    def tensors(skip_layers=()):
        items = [row for row in plan if not (row[1][:len(lp)] == lp and row[1][len(lp)] in skip_layers)]
        if progress:
            from tqdm import tqdm

            items = tqdm(items, desc=f"reading {os.path.basename(os.path.normpath(source))}", unit="tensor")
        for read, path, tr in items:
            yield path, np.ascontiguousarray(hf_to_ours(read(), tr), dtype=dt)

    return hf, cfg, fam, tensors


def split_entries(entries: list[SourceTensor], split: Callable) -> list[SourceTensor]:
    """`entries` with each tensor that `split(name, shape)` cuts into pieces (a family's `split_hf_tensor`)
    replaced by its pieces, in order. The pieces of one tensor read it once: the last tensor read is kept until
    a piece of another one is read (the loaders read entries in order)."""
    held: dict = {}

    def read_piece(e: SourceTensor, take):
        if held.get("name") != e.label:
            held.clear()
            held.update(name=e.label, array=e.read())
        return take(held["array"])

    out = []
    for e in entries:
        pieces = split(e.name, tuple(e.shape))
        if pieces is None:
            out.append(e)
            continue
        out += [SourceTensor(name, f"{e.label} ({name})", tuple(shape), functools.partial(read_piece, e, take),
                             e.bad_dtype) for name, shape, take in pieces]
    return out


def stream_hf(directory: str, dtype, progress: bool):
    """`stream_checkpoint` of an HF checkpoint directory (config.json + safetensors; a truncated file is a
    ValueError before any tensor is read)."""
    hf = read_hf_config(directory)
    fam = family(hf.get("model_type"))
    entries = []
    for f in [SafetensorsFile(p) for p in checkpoint_files(directory)]:
        for file_name in f.keys():
            dt = f.dtype(file_name)
            entries.append(SourceTensor(fam.rename_hf_key(file_name), file_name, tuple(f.shape(file_name)),
                                        functools.partial(f.get, file_name), None if dt in FLOAT_DTYPES else dt))
    return stream_checkpoint(directory, hf, entries, dtype, progress)


def load_hf(directory: str, dtype=None, *, device_put: Callable[[tuple, np.ndarray], jax.Array] | None = None,
            progress: bool = False, revision: str | None = None, local_files_only: bool | None = None,
            cache_dir: str | None = None) -> Model:
    """Load an HF checkpoint directory (config.json + safetensors, single or sharded), or a Hub repo id "org/name"
    (at `revision`, from the Hub cache `cache_dir`; fetched unless `local_files_only` or $HF_HUB_OFFLINE:
    `ports.io.hub.resolve`), as a `Model`.

    Streams tensor by tensor: each tensor is read, transformed to our layout, cast and moved to the device before
    the next one is read. `device_put(path, array)` can place each param (e.g. onto a sharding).
    `progress` shows a progress bar over the checkpoint's tensors.
    Raises ValueError listing missing / unexpected / mis-shaped tensors.
    """
    from ports.io import hub

    directory = hub.resolve(directory, revision, local_files_only=local_files_only, cache_dir=cache_dir)
    return load_stream(stream_hf(directory, dtype, progress), device_put)


def load_stream(stream, device_put: Callable[[tuple, np.ndarray], jax.Array] | None = None) -> Model:
    """The `Model` of a `stream_checkpoint` stream, each tensor placed by `device_put(path, array)` (default: the
    default device) before the next one is read."""
    hf, cfg, fam, tensors = stream
    params = empty_like_shapes(FU.fused_shapes(cfg, fam.param_shapes(cfg)))
    put = device_put or (lambda path, arr: jnp.asarray(arr))
    for path, item in layer_stream(cfg, fam.param_shapes(cfg), tensors()):
        for sub, arr in (leaf_paths(item) if isinstance(item, dict) else [((), item)]):
            set_path(params, path + sub, put(path + sub, arr))
    return Model(cfg, params, hf)


def layer_stream(cfg, shapes, tensors):
    """The checkpoint's (path, array) stream, grouped: tensors outside the decoder layers pass through as they come;
    a layer's tensors wait on the host until the layer is complete, which then comes out whole as (layers path +
    (i,), layer dict), in the run layout (`ports.core.fused`; a model without a text decoder keeps its layers as read).
    `shapes`: the checkpoint layout's (`param_shapes`)."""
    lp = layers_path(shapes)
    layer_shapes = get_path(shapes, lp)
    want = [len(jax.tree.leaves(s, is_leaf=lambda x: isinstance(x, tuple))) for s in layer_shapes]
    open_layers: dict[int, Any] = {}
    filled = [0] * len(layer_shapes)
    fuse = FU.has_decoder(cfg)
    for path, arr in tensors:
        if path[:len(lp)] != lp:
            yield path, arr
            continue
        i = path[len(lp)]
        layer = open_layers.setdefault(i, empty_like_shapes(layer_shapes[i]))
        set_path(layer, path[len(lp) + 1:], arr)
        filled[i] += 1
        if filled[i] == want[i]:
            layer = open_layers.pop(i)
            yield lp + (i,), FU.fuse_layer(cfg, layer) if fuse else layer


def save_hf(model: Model, directory: str, dtype=None) -> None:
    """Write `model` as an HF checkpoint (config.json + model.safetensors) that transformers loads (a scanned
    model's layers are written one by one, as the checkpoint holds them; a Lumina-mGPT Chameleon keeps its own
    QK-norm layout, see ports.families.chameleon)."""
    model = unscan_layers(model) if is_scanned(model) else model
    view = getattr(model.config, "save_hf_view", None)  # a family's say on the layout it writes (Chameleon's)
    if view is not None:
        model = view(model)
    os.makedirs(directory, exist_ok=True)
    fam = model.family
    rows = fam.hf_key_map(model.config)
    out_dtype = np.dtype(dtype) if dtype is not None else np.dtype(model.dtype)
    params = _checkpoint_view(model)
    shapes, src = {}, {}
    for name, path, tr in rows:
        shape = tuple(get_path(params, path).shape)
        shapes[name] = (ours_shape_to_hf(shape, tr), out_dtype)
        src[name] = (path, tr)

    def fetch(name):
        path, tr = src[name]
        arr = np.asarray(jax.device_get(get_path(params, path)))
        return ours_to_hf(arr, tr)

    write_safetensors(os.path.join(directory, "model.safetensors"), shapes, fetch)
    hf = dict(model.hf_config) or fam.config_to_hf(model.config)
    hf["torch_dtype"] = hf["dtype"] = str(out_dtype) if out_dtype != np.dtype("bfloat16") else "bfloat16"
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(hf, f, indent=2)


class _LazyLayers:
    """A decoder layer list read in the checkpoint layout: each fused layer is split when first indexed (on the
    device, one layer at a time; the last one is kept)."""

    def __init__(self, cfg, layers):
        self.cfg, self.layers, self.last = cfg, layers, (None, None)

    def __getitem__(self, i):
        if self.last[0] != i:
            self.last = (i, FU.unfuse_layer(self.cfg, self.layers[i]))
        return self.last[1]

    def __len__(self):
        return len(self.layers)


def _checkpoint_view(model: Model) -> dict:
    """model.params with its decoder layers in the checkpoint layout (`hf_key_map` paths address it)."""
    lp = layers_path(model.params)
    view = without_layers(model.params, lp)
    set_path(view, lp, _LazyLayers(model.config, get_path(model.params, lp)))
    return view
