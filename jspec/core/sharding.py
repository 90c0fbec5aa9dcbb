"""Sharding over a device mesh with logical axis rules (the maxtext scheme, written for jspec's pytrees).

Every parameter and KV-cache dimension carries a logical axis name (`batch`, `seq`, `heads`, `kv_heads`,
`head_dim`, `embed`, `mlp`, `vocab`, `layers`, and a mixture-of-experts layer's `expert` and `moe_mlp`); one rules
table maps each name to mesh axes (`data`, `fsdp`, `expert`, `tensor`): by default the experts split over
`expert` and each expert's intermediate dimension over `tensor`. A dimension is split over its mesh axes only when
its logical size (heads, not heads x head_dim) is divisible by their product; otherwise it is replicated, which is
the correct fallback when, e.g., kv_heads < tensor size. Anything without a rule (norms, vision towers, projectors,
the VQ tokenizer) is replicated; so is a small draft (`replicate`). Decoding then runs the same jitted program: XLA
partitions it from the params' shardings and the cache constraints the engine declares (`Placement`).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ports.core.scanned import is_scanned

MESH_AXES = ("data", "fsdp", "expert", "tensor")

# logical axis -> mesh axes it is split over (in order)
DEFAULT_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("batch", ("data",)),
    ("embed", ("fsdp",)),
    ("heads", ("tensor",)),
    ("kv_heads", ("tensor",)),
    ("mlp", ("tensor",)),
    ("expert", ("expert",)),
    ("moe_mlp", ("tensor",)),
    ("vocab", ("tensor",)),
    ("seq", ()),
    ("head_dim", ()),
    ("layers", ()),
)

# decoder leaf name -> logical axes of its dimensions (ports' [in, out] matrices)
DECODER_AXES: dict[str, tuple[str | None, ...]] = {
    "embed": ("vocab", "embed"),
    "lm_head": ("embed", "vocab"),
    "wq": ("embed", "heads"), "wk": ("embed", "kv_heads"), "wv": ("embed", "kv_heads"), "wo": ("heads", "embed"),
    "bq": ("heads",), "bk": ("kv_heads",), "bv": ("kv_heads",),
    "w_attn_gate": ("embed", "heads"),  # Muse Glimmer's attention gate: one column per query head feature
    "wqg": ("embed", "heads"), "bqg": ("heads",),  # Qwen3.5's query and output gate, whole heads (`ports.families.qwen3_5`)
    "w_gate": ("embed", "mlp"), "w_up": ("embed", "mlp"), "w_down": ("mlp", "embed"),
    "b_gate": ("mlp",), "b_up": ("mlp",),
    # the run layout (`ports.core.fused`): split by KV-head groups, so each device holds whole groups
    "wqkv": ("embed", "kv_heads", None, "head_dim"), "bqkv": ("kv_heads", None, "head_dim"),
    "w_gate_up": ("embed", None, "mlp"), "b_gate_up": (None, "mlp"),
    # a mixture-of-experts layer (`ports.core.moe`): the router, and the experts stacked [E, ...]
    "router": ("embed", None),
    "we_gate": ("expert", "embed", "moe_mlp"), "we_up": ("expert", "embed", "moe_mlp"),
    "we_down": ("expert", "moe_mlp", "embed"),
}

CACHE_AXES = ("batch", "kv_heads", "seq", "head_dim")


def host_get(tree):
    """`jax.device_get(tree)`, also where a leaf spans devices of other processes (multi-controller runs after
    `jax.distributed.initialize()`): those leaves are all-gathered in one collective, so every process gets the
    global values. Every process must call it with the same tree (as every multi-controller call)."""
    leaves, treedef = jax.tree.flatten(tree)
    far = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array) and not x.is_fully_addressable]
    if not far:
        return jax.device_get(tree)
    from jax.experimental import multihost_utils

    got = multihost_utils.process_allgather([leaves[i] for i in far], tiled=True)
    for i, g in zip(far, got):
        leaves[i] = np.asarray(g)
    return jax.device_get(jax.tree.unflatten(treedef, leaves))


def check_same_everywhere(what: str, *arrays) -> None:
    """Under `jax.distributed` with several processes: ValueError unless every process passed equal `arrays` (a
    multi-controller program needs the same inputs on every host). One small collective; nothing to do in one
    process."""
    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils

    h = np.zeros((4,), np.int64)
    for i, a in enumerate(arrays):
        a = np.asarray(a).astype(np.int64).ravel()
        h[0] += a.size * (i + 1)
        h[1 + i % 3] += int((a * (np.arange(a.size) % 9973 + 1)).sum() % (2 ** 61))
    seen = np.asarray(multihost_utils.process_allgather(h))
    if not (seen == seen[:1]).all():
        raise ValueError(f"the processes passed different {what} (process {jax.process_index()} of "
                         f"{jax.process_count()}): under jax.distributed every host must pass the same inputs")


def make_mesh(data: int = 1, fsdp: int = 1, tensor: int = 1, devices: Sequence | None = None,
              expert: int = 1) -> Mesh:
    """A ("data", "fsdp", "expert", "tensor") mesh over the first data*fsdp*expert*tensor devices (all processes'
    devices under `jax.distributed`: every host runs the same program)."""
    n = data * fsdp * expert * tensor
    devices = list(jax.devices() if devices is None else devices)
    if n < 1 or n > len(devices):
        raise ValueError(f"mesh data={data} x fsdp={fsdp} x expert={expert} x tensor={tensor} needs {n} devices; "
                         f"{len(devices)} available")
    return Mesh(np.array(devices[:n]).reshape(data, fsdp, expert, tensor), MESH_AXES)


def rules_table(rules=None) -> dict[str, tuple[str, ...]]:
    """DEFAULT_RULES with the entries of `rules` (a mapping or pairs; a str value means one mesh axis) replaced."""
    table = dict(DEFAULT_RULES)
    if rules is not None:
        table.update({k: tuple(v) if isinstance(v, (tuple, list)) else (v,) for k, v in dict(rules).items()})
    return table


def logical_units(cfg) -> dict[str, int]:
    """How many indivisible units each logical axis of a language model has (heads, not heads x head_dim)."""
    text = getattr(cfg, "text", cfg)
    # (a Qwen3.5-MoE's only dense MLP is its shared expert)
    mlp = text.intermediate_size or getattr(text, "shared_expert_intermediate_size", 0)
    units = {"heads": text.num_heads, "kv_heads": text.num_kv_heads, "mlp": mlp,
             "vocab": text.vocab_size, "embed": text.hidden_size}
    if getattr(text, "num_experts", 0):
        units.update(expert=text.num_experts, moe_mlp=text.moe_intermediate_size)
    return units


def spec_for(axes: Sequence[str | None], units: Mapping[str, int], mesh: Mesh, rules=None) -> P:
    """PartitionSpec of one array: each logical axis gets its mesh axes when its units divide their size and no
    earlier dimension already took them; otherwise that dimension is replicated."""
    table = rules_table(rules)
    used: set[str] = set()
    out = []
    for ax in axes:
        mesh_axes = tuple(m for m in table.get(ax, ()) if m in mesh.shape and mesh.shape[m] > 1) if ax else ()
        size = math.prod(mesh.shape[m] for m in mesh_axes)
        n = units.get(ax) if ax else None
        if not mesh_axes or n is None or n % size or used & set(mesh_axes):
            out.append(None)
            continue
        used |= set(mesh_axes)
        out.append(mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes)
    return P(*out)


def _lm_subtree(model) -> tuple:
    """Where the language model's params sit: under "lm" for VLMs (LLaVA), at the top for decoders."""
    return ("lm",) if isinstance(model.params, dict) and "lm" in model.params else ()


def param_axes(model) -> Any:
    """A pytree like `model.params` of per-leaf logical axes (None: replicated)."""
    sub = _lm_subtree(model)

    def axes(path, leaf):
        keys = tuple(getattr(k, "key", getattr(k, "idx", None)) for k in path)
        if keys[:len(sub)] != sub:
            return None
        name = keys[-1]
        ax = DECODER_AXES.get(name) if isinstance(name, str) else None
        return ax if ax is not None and len(ax) == np.ndim(leaf) else None

    return jax.tree_util.tree_map_with_path(axes, model.params)


def param_shardings(model, mesh: Mesh, rules=None) -> Any:
    """NamedShardings (a pytree like params) from the logical axis rules."""
    units = logical_units(model.config)
    ax_tree = param_axes(model)
    return jax.tree.map(lambda leaf, ax: NamedSharding(mesh, P() if ax is None else spec_for(ax, units, mesh, rules)),
                        model.params, ax_tree, is_leaf=lambda x: x is None or isinstance(x, tuple))


def _qkv_split_lost(model, mesh: Mesh, rules=None) -> bool:
    """Whether fused q/k/v (`ports.core.fused`) would be replicated where separate wq would split by heads."""
    layers = _get(model.params, _lm_subtree(model) + ("layers",))
    if not layers or "wqkv" not in layers[0]:
        return False
    units = logical_units(model.config)
    fused = spec_for(DECODER_AXES["wqkv"], units, mesh, rules)
    return fused[1] is None and spec_for(DECODER_AXES["wq"], units, mesh, rules)[1] is not None


def _get(tree, path):
    for k in path:
        tree = tree.get(k) if isinstance(tree, dict) else None
    return tree


def run_layout(model, mesh: Mesh, rules=None):
    """The model in the layout it is sharded in on `mesh`: as loaded (q/k/v fused by KV-head group), except where
    the KV heads cannot split over the tensor axes and the query heads can: then q/k/v are separate matrices again
    (wq split by heads, wk / wv replicated), so a 16-way split of 8 KV heads keeps wq's memory split. Abstract
    params (ShapeDtypeStructs) work too."""
    if not _qkv_split_lost(model, mesh, rules):
        return model
    from ports.core import fused as FU

    fn = lambda p: FU.unfuse_params(model.config, p, mlp=False)  # noqa: E731
    abstract = isinstance(jax.tree.leaves(model.params)[0], jax.ShapeDtypeStruct)
    params = jax.eval_shape(fn, model.params) if abstract else fn(model.params)
    return dataclasses.replace(model, params=params, _hf_aux=model._hf_aux)


def shard(model, mesh: Mesh, rules=None):
    """The model with its params placed on `mesh` by the rules (each device holds only its shards), in
    `run_layout`."""
    if is_scanned(model):
        raise ValueError("a model with scanned (stacked) layers cannot be sharded yet: pass "
                         "ports.core.scanned.unscan_layers(model) with a mesh")
    model = run_layout(model, mesh, rules)
    shardings = param_shardings(model, mesh, rules)
    return dataclasses.replace(model, params=jax.device_put(model.params, shardings), _hf_aux=model._hf_aux)


def is_sharded_on(model, mesh: Mesh) -> bool:
    """Whether some param of `model` is split over `mesh` (e.g. placed by `shard(model, mesh)`)."""
    for x in jax.tree.leaves(getattr(model, "params", None)):
        sh = getattr(x, "sharding", None)
        if isinstance(sh, NamedSharding) and sh.mesh == mesh and any(a is not None for a in sh.spec):
            return True
    return False


def replicate(model, mesh: Mesh):
    """The model with every param replicated on `mesh` (a small draft)."""
    sh = NamedSharding(mesh, P())
    return dataclasses.replace(model, params=jax.device_put(model.params, sh), _hf_aux=model._hf_aux)


@dataclasses.dataclass(frozen=True)
class Placement:
    """Static (hashable) sharding plan of one decode call: the engine constrains the target's KV cache to it at
    prefill and after every step, and keeps the draft's cache replicated."""

    mesh: Mesh
    rules: tuple = DEFAULT_RULES

    def logical_cache_spec(self, cache) -> P:
        """The cache's spec over its logical axes (CACHE_AXES: batch, kv_heads, seq, head_dim)."""
        units = {"batch": cache.batch, "kv_heads": cache.kv_heads}
        return spec_for(CACHE_AXES, units, self.mesh, self.rules)

    def cache_spec(self, cache) -> P:
        """The spec of the stored [B * KVH, S, Dh] buffers: the flat rows split over the batch's mesh axes, then the
        kv heads'. Rows are b-major, so when the batch is split (or B = 1) each device holds exactly its batch rows'
        kv heads, as the logical spec says; otherwise the split is by row blocks (same values, other placement)."""
        b, h, seq, hd = self.logical_cache_spec(cache)
        rows = tuple(a for ax in (b, h) for a in ((ax,) if isinstance(ax, str) else (ax or ())))
        return P(rows[0] if len(rows) == 1 else (rows or None), seq, hd)

    def constrain_cache(self, cache, replicated: bool = False):
        spec = P() if replicated else self.cache_spec(cache)
        kv = NamedSharding(self.mesh, spec)
        row = NamedSharding(self.mesh, P() if replicated else P(self.logical_cache_spec(cache)[0]))
        wsc = jax.lax.with_sharding_constraint
        if cache.rec is not None:  # a hybrid model's recurrent state [L, B, ...]: rows over the batch's axes
            lead = NamedSharding(self.mesh, P() if replicated else P(None, self.logical_cache_spec(cache)[0]))
            cache = cache.replace(rec=jax.tree.map(lambda a: wsc(a, lead), cache.rec))
        if cache.stacked:  # one [L, ...] array each: the layer axis is not split
            kv = NamedSharding(self.mesh, P(None, *spec))
            return cache.replace(k=wsc(cache.k, kv), v=wsc(cache.v, kv), length=wsc(cache.length, row),
                                 start=wsc(cache.start, row), pos_offset=wsc(cache.pos_offset, row))
        return cache.replace(k=[wsc(b, kv) for b in cache.k], v=[wsc(b, kv) for b in cache.v],
                             length=wsc(cache.length, row), start=wsc(cache.start, row),
                             pos_offset=wsc(cache.pos_offset, row))


def constrain(placement: Placement | None, cache, replicated: bool = False):
    """`placement.constrain_cache(cache)`, or the cache unchanged without a placement."""
    return cache if placement is None else placement.constrain_cache(cache, replicated)
