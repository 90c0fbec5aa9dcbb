"""jspec checkpoints (orbax): `save` / `load` (which can restore straight onto shardings) and `convert_hf`, the
streaming, resumable conversion from an HF checkpoint. A directory holds config.json, an orbax checkpoint
`params/` of everything but the decoder layers, and one orbax checkpoint per layer under `layers/`, in the run
layout (`ports.core.fused`)."""
from __future__ import annotations

import json
import os
from typing import Any

import jax
import numpy as np

from ports.core import fused as FU
from ports.io.hf_checkpoint import layer_stream, read_hf_config, read_json, stream_hf
from ports.model import Model, family, resolve_dtype
from ports.core.scanned import is_scanned, unscan_layers
from ports.core.param_paths import empty_like_shapes, get_path, layers_path, set_path, without_layers


def write_config(model_or_hf, directory: str) -> None:
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(model_or_hf, f, indent=2)


def orbax_save(path: str, tree) -> None:
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
    resumed = job is not None and os.path.exists(progress) and read_json(progress) == job
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
    """HF checkpoint (a directory or a Hub repo id: `ports.io.hub.resolve`) -> jspec checkpoint (what `save`
    writes), streaming: each decoder layer is written as soon as
    its tensors are read, so host memory holds one layer plus the non-layer params (embeddings, head), never the
    model. An interrupted conversion resumes when run again with the same source, dtype and config (the layers it
    wrote are kept and not read again); `load` refuses the directory until the conversion completes. Returns
    (config, number of parameters)."""
    from ports.io import hub

    hf_dir = hub.resolve(hf_dir, revision, cache_dir=cache_dir)
    stream = stream_hf(hf_dir, dtype, progress)  # checks every header before anything is written
    return convert_stream(stream, hf_dir, out_dir, dtype, progress)


def convert_stream(stream, source: str, out_dir: str, dtype=None, progress: bool = False) -> tuple[Any, int]:
    """Write the `stream_checkpoint` stream of `source` as a jspec checkpoint in `out_dir`, as `convert_hf`
    describes (streaming, resumable); returns (config, number of parameters)."""
    out_dir = os.path.abspath(out_dir)
    hf, cfg, fam, tensors = stream
    job = {"source": os.path.abspath(source), "dtype": np.dtype(resolve_dtype(dtype)).name, "config": hf}
    done = _start_writing(out_dir, job)
    if done and progress:
        print(f"resuming: {len(done)} layers of {out_dir} already written")
    shapes = fam.param_shapes(cfg)
    lp = layers_path(shapes)
    write_config(hf, out_dir)
    rest = without_layers(empty_like_shapes(shapes), lp)
    is_shape = lambda x: isinstance(x, tuple)
    n_params = sum(int(np.prod(s)) for i in done for s in jax.tree.leaves(get_path(shapes, lp)[i], is_leaf=is_shape))
    for path, item in layer_stream(cfg, shapes, tensors(done)):
        if isinstance(item, dict):
            n_params += sum(a.size for a in jax.tree.leaves(item))
            orbax_save(os.path.join(out_dir, "layers", f"{path[-1]:05d}"), item)
        else:
            n_params += item.size
            set_path(rest, path, item)
    orbax_save(os.path.join(out_dir, "params"), rest)
    _finish_writing(out_dir, cfg, len(get_path(shapes, lp)), job["dtype"])
    return cfg, n_params


def save(model: Model, directory: str) -> None:
    """A jspec checkpoint (what `jspec convert` writes): config.json, an orbax checkpoint `params/` of everything
    but the decoder layers, and one orbax checkpoint per layer under `layers/`, so conversion can stream (a scanned
    model's layers too: `load` restores the unrolled layout)."""
    model = unscan_layers(model) if is_scanned(model) else model
    directory = os.path.abspath(directory)
    _start_writing(directory)
    write_config(model.hf_config or model.family.config_to_hf(model.config), directory)
    lp = layers_path(model.params)
    layers = get_path(model.params, lp)
    for i, layer in enumerate(layers):  # in the run layout `load` restores, however sharded
        fused = FU.fuse_layer(model.config, layer) if FU.has_decoder(model.config) else layer
        orbax_save(os.path.join(directory, "layers", f"{i:05d}"), fused)
    orbax_save(os.path.join(directory, "params"), without_layers(model.params, lp))
    _finish_writing(directory, model.config, len(layers), np.dtype(model.dtype).name)


def check_complete(directory: str) -> None:
    """FileNotFoundError unless `directory` holds a complete jspec checkpoint, saying what it holds instead."""
    if os.path.exists(os.path.join(directory, COMPLETE)):
        return
    progress = os.path.join(directory, CONVERTING)
    if os.path.exists(progress):
        job = read_json(progress)
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
    `jspec.core.sharding.param_shardings`) restores straight onto devices, each reading only its shards; without
    them, on this process's first device."""
    import orbax.checkpoint as ocp

    directory = os.path.abspath(directory)
    check_complete(directory)
    hf = read_hf_config(directory)
    fam = family(hf.get("model_type"))
    cfg = fam.config_from_hf(hf)
    shapes = FU.fused_shapes(cfg, fam.param_shapes(cfg))
    dt = resolve_dtype(dtype)
    is_shape = lambda x: isinstance(x, tuple)
    if shardings is None:
        dev = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])  # this process's: multi-host safe
        shardings = jax.tree.map(lambda s: dev, shapes, is_leaf=is_shape)
    abstract = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s, dt, sharding=sh), shapes, shardings,
                            is_leaf=is_shape)
    lp = layers_path(shapes)
    layers_dir = os.path.join(directory, "layers")
    ckpt = ocp.StandardCheckpointer()
    params = ckpt.restore(os.path.join(directory, "params"), without_layers(abstract, lp))
    layers = [ckpt.restore(os.path.join(layers_dir, f"{i:05d}"), a) for i, a in enumerate(get_path(abstract, lp))]
    if len(lp) == 2:
        params[lp[0]][lp[1]] = layers
    else:
        params[lp[0]] = layers
    return Model(cfg, params, hf)
