"""`Model(config, params)`, the family registry, and HF / orbax checkpoint I/O.

`load_hf` streams safetensors tensor by tensor into a params pytree and checks that every checkpoint tensor was
consumed and every parameter filled with the right shape. `save_hf` writes the reverse (HF layout). `save` / `load`
use orbax (params) + config.json, and `load` can restore straight onto shardings.

The family's `param_shapes` and `hf_key_map` describe the checkpoint layout (one matrix per projection); the
loaders return the run layout (`ports.fused`: q/k/v and gate/up fused per decoder layer), which `save` / `load`
keep and `save_hf` turns back.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ports import config as C
from ports import fused as FU
from ports import chameleon
from ports import llama
from ports import llava
from ports import llava_next
from ports import qwen2_vl
from ports.safetensors_io import FLOAT_DTYPES, SafetensorsFile, checkpoint_files, write_safetensors


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


_TEXT = Family(C.text_config_from_hf, C.text_config_to_hf, llama.param_shapes, llama.init_params, llama.forward,
               llama.hf_key_map, llama.IGNORED_HF_KEYS, llama.kv_layout,
               lambda cfg, params, tokens: llama.embed(params, tokens), llama.unembed)
_LLAVA = Family(llava.config_from_hf, llava.config_to_hf, llava.param_shapes, llava.init_params, llava.forward,
                llava.hf_key_map, llava.IGNORED_HF_KEYS, llava.kv_layout, llava.embed, llava.unembed,
                llava.rename_hf_key, llava.prepare_inputs, llava.prompt_embeds, llava.compact_prompt)
_CHAMELEON = Family(chameleon.config_from_hf, chameleon.config_to_hf, chameleon.param_shapes, chameleon.init_params,
                    chameleon.forward, chameleon.hf_key_map, chameleon.IGNORED_HF_KEYS, chameleon.kv_layout,
                    chameleon.embed, chameleon.unembed, prepare_inputs=chameleon.prepare_inputs,
                    prompt_embeds=chameleon.prompt_embeds)
_LLAVA_NEXT = Family(llava_next.config_from_hf, llava_next.config_to_hf, llava_next.param_shapes,
                     llava_next.init_params, llava.forward, llava_next.hf_key_map, llava_next.IGNORED_HF_KEYS,
                     llava.kv_layout, llava.embed, llava.unembed, llava_next.rename_hf_key, llava_next.prepare_inputs,
                     llava_next.prompt_embeds, llava_next.compact_prompt)
_QWEN_VL = Family(qwen2_vl.config_from_hf, qwen2_vl.config_to_hf, qwen2_vl.param_shapes, qwen2_vl.init_params,
                  qwen2_vl.forward, qwen2_vl.hf_key_map, qwen2_vl.IGNORED_HF_KEYS, qwen2_vl.kv_layout,
                  qwen2_vl.embed, qwen2_vl.unembed, qwen2_vl.rename_hf_key, qwen2_vl.prepare_inputs,
                  qwen2_vl.prompt_embeds, qwen2_vl.compact_prompt)
FAMILIES: dict[str, Family] = {"llama": _TEXT, "qwen2": _TEXT, "llava": _LLAVA, "llava_next": _LLAVA_NEXT,
                               "llava_next_video": _LLAVA_NEXT, "llava_onevision": _LLAVA_NEXT,
                               "chameleon": _CHAMELEON, "qwen2_vl": _QWEN_VL, "qwen2_5_vl": _QWEN_VL}


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

    def forward(self, *args, **kwargs):
        """Family forward: see `ports.llama.forward` for the contract."""
        return self.family.forward(self.config, self.params, *args, **kwargs)


def random_model(config, key: jax.Array | int = 0, dtype=jnp.float32, std: float = 0.02) -> Model:
    """A model with random params (tests, demos, benchmarks)."""
    if isinstance(key, int):
        key = jax.random.key(key)
    fam = family(config.model_type)
    return Model(config, FU.fuse_params(config, fam.init_params(config, key, dtype, std)), fam.config_to_hf(config))


def _resolve_dtype(dtype):
    if dtype is None:
        return jnp.float32
    return jnp.dtype(dtype)


def _read_json(path: str) -> dict:
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
    cfg = _read_json(path)
    gen_path = os.path.join(directory, "generation_config.json")
    if os.path.exists(gen_path):
        gen = _read_json(gen_path)
        for k in ("eos_token_id", "bos_token_id", "pad_token_id"):
            if gen.get(k) is not None:
                cfg[k] = gen[k]
    return cfg


# Key-map transforms, each an axis permutation taking the HF tensor to our param (None = as is):
# "T" a Linear weight [out, in] -> [in, out]; "conv" a Conv2d kernel [out, in, kh, kw] -> [in, kh, kw, out].
TRANSFORMS: dict[str, tuple[int, ...]] = {"T": (1, 0), "conv": (1, 2, 3, 0)}


def hf_to_ours(arr, transform: str | None):
    """An HF tensor (numpy / jax array) in our layout."""
    return arr if transform is None else arr.transpose(TRANSFORMS[transform])


def ours_to_hf(arr, transform: str | None):
    """Inverse of `hf_to_ours`."""
    return arr if transform is None else arr.transpose(tuple(np.argsort(TRANSFORMS[transform])))


def hf_shape_to_ours(shape: tuple, transform: str | None) -> tuple:
    return tuple(shape) if transform is None else tuple(shape[i] for i in TRANSFORMS[transform])


def ours_shape_to_hf(shape: tuple, transform: str | None) -> tuple:
    return tuple(shape) if transform is None else tuple(shape[i] for i in np.argsort(TRANSFORMS[transform]))


def _set_path(tree, path, value):
    node = tree
    for p in path[:-1]:
        node = node[p]
    node[path[-1]] = value


def key_mismatch_error(header: str, missing: list, unexpected: list, bad_shape: list, bad_dtype: list = (),
                       duplicated: list = ()) -> ValueError:
    """One error listing every missing, unexpected, mis-shaped, mis-typed and duplicated tensor (the first 20 of
    each)."""
    lines = [header]
    for what, names in (("missing keys", missing), ("unexpected keys", unexpected), ("wrong shapes", bad_shape),
                        ("not floating point", bad_dtype), ("in more than one file", duplicated)):
        if names:
            lines.append(f"  {what} ({len(names)}): {names[:20]}{' ...' if len(names) > 20 else ''}")
    return ValueError("\n".join(lines))


def _get_path(tree, path):
    for p in path:
        tree = tree[p]
    return tree


def _empty_like_shapes(shapes):
    if isinstance(shapes, dict):
        return {k: _empty_like_shapes(v) for k, v in shapes.items()}
    if isinstance(shapes, list):
        return [_empty_like_shapes(v) for v in shapes]
    return None


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
    source's spelling) before any tensor is read. The iterator then reads one tensor at a time, in our layout
    and dtype; tensors of the decoder layers in `skip_layers` are not read (a resumed conversion).
    """
    fam = family(hf.get("model_type"))
    cfg = fam.config_from_hf(hf)
    dt = np.dtype(_resolve_dtype(dtype))
    shapes = fam.param_shapes(cfg)
    kmap = {name: (path, tr) for name, path, tr in fam.hf_key_map(cfg)}
    ignored = [re.compile(p) for p in fam.ignored_keys]
    if getattr(cfg, "tie_word_embeddings", False):
        ignored.append(re.compile(r"(^|\.)lm_head\.weight$"))

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
        want, got = tuple(_get_path(shapes, path)), tuple(e.shape)
        if len(got) != len(want) or hf_shape_to_ours(got, tr) != want:
            bad_shape.append(f"{e.label}: checkpoint {got}, expected {ours_shape_to_hf(want, tr)}")
        elif e.bad_dtype is not None:
            bad_dtype.append(f"{e.label}: {e.bad_dtype}")
        else:
            plan.append((e.read, path, tr))
    missing = [spell(n) for n in kmap if n not in seen]
    if missing or unexpected or bad_shape or bad_dtype or duplicated:
        raise key_mismatch_error(f"checkpoint {source} does not match {hf.get('model_type')} params:",
                                 missing, unexpected, bad_shape, bad_dtype, duplicated)
    lp = _layers_path(shapes)

    def tensors(skip_layers=()):
        items = [row for row in plan if not (row[1][:len(lp)] == lp and row[1][len(lp)] in skip_layers)]
        if progress:
            from tqdm import tqdm

            items = tqdm(items, desc=f"reading {os.path.basename(os.path.normpath(source))}", unit="tensor")
        for read, path, tr in items:
            yield path, np.ascontiguousarray(hf_to_ours(read(), tr), dtype=dt)

    return hf, cfg, fam, tensors


def _stream_hf(directory: str, dtype, progress: bool):
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
    `ports.hub.resolve`), as a `Model`.

    Streams tensor by tensor: each tensor is read, transformed to our layout, cast and moved to the device before
    the next one is read. `device_put(path, array)` can place each param (e.g. onto a sharding).
    `progress` shows a progress bar over the checkpoint's tensors.
    Raises ValueError listing missing / unexpected / mis-shaped tensors.
    """
    from ports import hub

    directory = hub.resolve(directory, revision, local_files_only=local_files_only, cache_dir=cache_dir)
    return load_stream(_stream_hf(directory, dtype, progress), device_put)


def load_stream(stream, device_put: Callable[[tuple, np.ndarray], jax.Array] | None = None) -> Model:
    """The `Model` of a `stream_checkpoint` stream, each tensor placed by `device_put(path, array)` (default: the
    default device) before the next one is read."""
    hf, cfg, fam, tensors = stream
    params = _empty_like_shapes(FU.fused_shapes(cfg, fam.param_shapes(cfg)))
    put = device_put or (lambda path, arr: jnp.asarray(arr))
    for path, item in _layer_stream(cfg, fam.param_shapes(cfg), tensors()):
        for sub, arr in (_leaf_paths(item) if isinstance(item, dict) else [((), item)]):
            _set_path(params, path + sub, put(path + sub, arr))
    return Model(cfg, params, hf)


def _layer_stream(cfg, shapes, tensors):
    """The checkpoint's (path, array) stream, grouped: tensors outside the decoder layers pass through as they come;
    a layer's tensors wait on the host until the layer is complete, which then comes out whole as (layers path +
    (i,), layer dict), in the run layout (`ports.fused`; a model without a text decoder keeps its layers as read).
    `shapes`: the checkpoint layout's (`param_shapes`)."""
    lp = _layers_path(shapes)
    layer_shapes = _get_path(shapes, lp)
    want = [len(jax.tree.leaves(s, is_leaf=lambda x: isinstance(x, tuple))) for s in layer_shapes]
    open_layers: dict[int, Any] = {}
    filled = [0] * len(layer_shapes)
    fuse = FU.has_decoder(cfg)
    for path, arr in tensors:
        if path[:len(lp)] != lp:
            yield path, arr
            continue
        i = path[len(lp)]
        layer = open_layers.setdefault(i, _empty_like_shapes(layer_shapes[i]))
        _set_path(layer, path[len(lp) + 1:], arr)
        filled[i] += 1
        if filled[i] == want[i]:
            layer = open_layers.pop(i)
            yield lp + (i,), FU.fuse_layer(cfg, layer) if fuse else layer


def _leaf_paths(tree) -> list[tuple[tuple, Any]]:
    """(path of keys / indices, leaf) of every leaf of a nested dict / list."""
    return [(tuple(getattr(k, "key", getattr(k, "idx", None)) for k in kp), leaf)
            for kp, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]]


_layers_path = FU.layers_path


def _without_layers(tree, lp: tuple):
    """A shallow copy of the params tree with the decoder layer list emptied."""
    out = dict(tree)
    if len(lp) == 2:
        out[lp[0]] = dict(out[lp[0]])
        out[lp[0]][lp[1]] = []
    else:
        out[lp[0]] = []
    return out


def _write_config(model_or_hf, directory: str) -> None:
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(model_or_hf, f, indent=2)


def _orbax_save(path: str, tree) -> None:
    import orbax.checkpoint as ocp

    ckpt = ocp.StandardCheckpointer()
    ckpt.save(path, tree, force=True)
    ckpt.wait_until_finished()


# A jspec checkpoint directory is complete when COMPLETE exists: `save` and `convert_hf` write it last (and remove
# it first), so a directory an interrupted write left behind never loads as a model. CONVERTING records an
# unfinished conversion (its source, dtype and config) so that running the same conversion again resumes it.
COMPLETE = "jspec-checkpoint.json"
CONVERTING = "jspec-converting.json"


def _json_dump(obj, path: str) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, indent=2)
    os.replace(path + ".tmp", path)


def _written_layers(layers_dir: str) -> set[int]:
    """The layers whose orbax checkpoint is complete (orbax renames a layer's temporary directory to its index
    once it is fully written)."""
    return {int(n) for n in os.listdir(layers_dir) if n.isdigit()} if os.path.isdir(layers_dir) else set()


def _start_writing(directory: str, job: dict | None = None) -> set[int]:
    """Prepare `directory` for a checkpoint write; the layers already written, when `job` (a conversion's
    source, dtype and config) is the unfinished conversion recorded there. Anything else jspec wrote there
    before (a complete or a stale checkpoint) is removed, so nothing old mixes into the new one."""
    import shutil

    os.makedirs(directory, exist_ok=True)
    progress, layers_dir = os.path.join(directory, CONVERTING), os.path.join(directory, "layers")
    if os.path.exists(os.path.join(directory, COMPLETE)):
        os.remove(os.path.join(directory, COMPLETE))
    resumed = job is not None and os.path.exists(progress) and _read_json(progress) == job
    if not resumed:
        for name in ("layers", "params"):
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
        if job is not None:
            _json_dump(job, progress)
        return set()
    done = _written_layers(layers_dir)
    for name in os.listdir(layers_dir) if os.path.isdir(layers_dir) else ():
        if not name.isdigit():  # a temporary directory an interrupted write left
            shutil.rmtree(os.path.join(layers_dir, name), ignore_errors=True)
    return done


def _finish_writing(directory: str, cfg, num_layers: int, dtype: str) -> None:
    _json_dump({"format": 1, "model_type": cfg.model_type, "num_layers": num_layers, "dtype": dtype},
               os.path.join(directory, COMPLETE))
    if os.path.exists(os.path.join(directory, CONVERTING)):
        os.remove(os.path.join(directory, CONVERTING))


def convert_hf(hf_dir: str, out_dir: str, dtype=None, progress: bool = False, revision: str | None = None,
               cache_dir: str | None = None) -> tuple[Any, int]:
    """HF checkpoint (a directory or a Hub repo id: `ports.hub.resolve`) -> jspec checkpoint (what `save`
    writes), streaming: each decoder layer is written as soon as
    its tensors are read, so host memory holds one layer plus the non-layer params (embeddings, head), never the
    model. An interrupted conversion resumes when run again with the same source, dtype and config (the layers it
    wrote are kept and not read again); `load` refuses the directory until the conversion completes. Returns
    (config, number of parameters)."""
    from ports import hub

    hf_dir = hub.resolve(hf_dir, revision, cache_dir=cache_dir)
    stream = _stream_hf(hf_dir, dtype, progress)  # checks every header before anything is written
    return convert_stream(stream, hf_dir, out_dir, dtype, progress)


def convert_stream(stream, source: str, out_dir: str, dtype=None, progress: bool = False) -> tuple[Any, int]:
    """Write the `stream_checkpoint` stream of `source` as a jspec checkpoint in `out_dir`, as `convert_hf`
    describes (streaming, resumable); returns (config, number of parameters)."""
    out_dir = os.path.abspath(out_dir)
    hf, cfg, fam, tensors = stream
    job = {"source": os.path.abspath(source), "dtype": np.dtype(_resolve_dtype(dtype)).name, "config": hf}
    done = _start_writing(out_dir, job)
    if done and progress:
        print(f"resuming: {len(done)} layers of {out_dir} already written")
    shapes = fam.param_shapes(cfg)
    lp = _layers_path(shapes)
    _write_config(hf, out_dir)
    rest = _without_layers(_empty_like_shapes(shapes), lp)
    is_shape = lambda x: isinstance(x, tuple)
    n_params = sum(int(np.prod(s)) for i in done for s in jax.tree.leaves(_get_path(shapes, lp)[i], is_leaf=is_shape))
    for path, item in _layer_stream(cfg, shapes, tensors(done)):
        if isinstance(item, dict):
            n_params += sum(a.size for a in jax.tree.leaves(item))
            _orbax_save(os.path.join(out_dir, "layers", f"{path[-1]:05d}"), item)
        else:
            n_params += item.size
            _set_path(rest, path, item)
    _orbax_save(os.path.join(out_dir, "params"), rest)
    _finish_writing(out_dir, cfg, len(_get_path(shapes, lp)), job["dtype"])
    return cfg, n_params


def save_hf(model: Model, directory: str, dtype=None) -> None:
    """Write `model` as an HF checkpoint (config.json + model.safetensors) that transformers loads."""
    os.makedirs(directory, exist_ok=True)
    fam = model.family
    rows = fam.hf_key_map(model.config)
    out_dtype = np.dtype(dtype) if dtype is not None else np.dtype(model.dtype)
    params = _checkpoint_view(model)
    shapes, src = {}, {}
    for name, path, tr in rows:
        shape = tuple(_get_path(params, path).shape)
        shapes[name] = (ours_shape_to_hf(shape, tr), out_dtype)
        src[name] = (path, tr)

    def fetch(name):
        path, tr = src[name]
        arr = np.asarray(jax.device_get(_get_path(params, path)))
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
    lp = _layers_path(model.params)
    view = _without_layers(model.params, lp)
    _set_path(view, lp, _LazyLayers(model.config, _get_path(model.params, lp)))
    return view


def save(model: Model, directory: str) -> None:
    """A jspec checkpoint (what `jspec convert` writes): config.json, an orbax checkpoint `params/` of everything
    but the decoder layers, and one orbax checkpoint per layer under `layers/`, so conversion can stream."""
    directory = os.path.abspath(directory)
    _start_writing(directory)
    _write_config(model.hf_config or model.family.config_to_hf(model.config), directory)
    lp = _layers_path(model.params)
    layers = _get_path(model.params, lp)
    for i, layer in enumerate(layers):  # in the run layout `load` restores, however sharded
        fused = FU.fuse_layer(model.config, layer) if FU.has_decoder(model.config) else layer
        _orbax_save(os.path.join(directory, "layers", f"{i:05d}"), fused)
    _orbax_save(os.path.join(directory, "params"), _without_layers(model.params, lp))
    _finish_writing(directory, model.config, len(layers), np.dtype(model.dtype).name)


def check_complete(directory: str) -> None:
    """FileNotFoundError unless `directory` holds a complete jspec checkpoint, saying what it holds instead."""
    if os.path.exists(os.path.join(directory, COMPLETE)):
        return
    progress = os.path.join(directory, CONVERTING)
    if os.path.exists(progress):
        job = _read_json(progress)
        n = len(_written_layers(os.path.join(directory, "layers")))
        raise FileNotFoundError(
            f"{directory}: an unfinished conversion ({n} layers written, no {COMPLETE}); run `jspec convert "
            f"{job['source']} {directory}` again to finish it")
    if os.path.isdir(os.path.join(directory, "layers")):
        raise FileNotFoundError(f"{directory}: an incomplete jspec checkpoint (no {COMPLETE}: its writing was "
                                "interrupted); save or convert it again")
    raise FileNotFoundError(f"{directory} is not a jspec checkpoint (no layers/); write one with `jspec convert`")


def load(directory: str, dtype=None, shardings=None) -> Model:
    """Restore a `save`d / `jspec convert`ed model; `shardings` (a pytree like params, e.g.
    `jspec.sharding.param_shardings`) restores straight onto devices, each reading only its shards."""
    import orbax.checkpoint as ocp

    directory = os.path.abspath(directory)
    check_complete(directory)
    hf = read_hf_config(directory)
    fam = family(hf.get("model_type"))
    cfg = fam.config_from_hf(hf)
    shapes = FU.fused_shapes(cfg, fam.param_shapes(cfg))
    dt = _resolve_dtype(dtype)
    is_shape = lambda x: isinstance(x, tuple)
    if shardings is None:
        dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree.map(lambda s: dev, shapes, is_leaf=is_shape)
    abstract = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s, dt, sharding=sh), shapes, shardings,
                            is_leaf=is_shape)
    lp = _layers_path(shapes)
    layers_dir = os.path.join(directory, "layers")
    ckpt = ocp.StandardCheckpointer()
    params = ckpt.restore(os.path.join(directory, "params"), _without_layers(abstract, lp))
    layers = [ckpt.restore(os.path.join(layers_dir, f"{i:05d}"), a) for i, a in enumerate(_get_path(abstract, lp))]
    if len(lp) == 2:
        params[lp[0]][lp[1]] = layers
    else:
        params[lp[0]] = layers
    return Model(cfg, params, hf)


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
    from ports import cache as kvc

    B, T = tokens.shape
    layers, kvh, hd = model.kv_layout
    cache = kvc.init_cache(layers, B, kvh, T, hd, model.dtype)
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    embeds = None
    if inputs:
        pe = model.family.prompt_embeds(model.config, model.params, tokens, inputs)
        embeds = pe.embeds
        if getattr(pe, "positions", None) is not None:  # e.g. Qwen2-VL's M-RoPE ids [3, B, T]
            positions = pe.positions
    return model.forward(tokens, positions, cache, embeds=embeds, fresh=True).logits
