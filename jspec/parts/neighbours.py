"""Latent neighbours of VQ image codes (LANTERN / LANTERN++): the k nearest codes of every code in the VQ codebook,
and a table of them in token-id space that the relaxed acceptance rules of `jspec.parts.rules` read.

`neighbour_codes(codebook, k)` ranks, for each code, the other codes by their distance in the raw codebook (L2 by
default, as LANTERN's `entrypoints/generate_codebook.py` does with `torch.cdist` and the diagonal set to +inf;
"cosine" optionally). Self is excluded, ties go to the lower code index, and the ranking runs on the device in row
blocks (a [block, d] slab against all L codes), so no L x L matrix is ever built (Chameleon has 8192 codes).

`NeighbourTable` maps token ids to token ids: row t holds the token ids of the kmax nearest codes of token t's code,
nearest first, and -1 where t is not an image token. It is a pytree (the ids are a leaf, so a rule holding it is
one compiled program whatever the table); `num_codes`, `kmax`, `metric` and a `fingerprint` of the codebook are
static metadata, so a table made for another vocabulary or codebook is refused (`check`). `save` / `load` keep it
as an .npz beside a drafter.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

METRICS = ("l2", "cosine")


@functools.partial(jax.jit, static_argnames=("k", "metric"))
def _block_neighbours(slab: jax.Array, rows: jax.Array, codes: jax.Array, k: int, metric: str) -> jax.Array:
    """[block, k] indices of the k nearest codes (self excluded) of the slab's codes; rows [block] their indices."""
    hi = jax.lax.Precision.HIGHEST
    if metric == "l2":
        # squared distance |a|^2 + |c|^2 - 2 a.c: the same order as the distance itself
        d = (jnp.sum(slab * slab, axis=1)[:, None] + jnp.sum(codes * codes, axis=1)[None, :]
             - 2.0 * jnp.matmul(slab, codes.T, precision=hi))
    else:
        unit = lambda x: x / jnp.maximum(jnp.linalg.norm(x, axis=1, keepdims=True), 1e-12)  # noqa: E731
        d = 1.0 - jnp.matmul(unit(slab), unit(codes).T, precision=hi)
    d = jnp.where(rows[:, None] == jnp.arange(codes.shape[0])[None, :], jnp.inf, d)
    # top_k puts the lower index first among equal values: ties go to the lower code index
    return jax.lax.top_k(-d, k)[1].astype(jnp.int32)


def neighbour_codes(codebook, k: int, metric: str = "l2", block: int = 1024) -> np.ndarray:
    """[L, k] int32: for each of the L codes of `codebook` [L, d], the k nearest other codes, nearest first (self
    excluded, ties broken by the lower index). Computed on the device `block` rows at a time."""
    cb = np.asarray(codebook)
    if cb.ndim != 2:
        raise ValueError(f"a codebook is a 2-D [codes, dim] array, got shape {cb.shape}")
    L = cb.shape[0]
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k < L:
        raise ValueError(f"k must be an integer in [1, {L - 1}] (the other codes of a {L}-code codebook), got {k!r}")
    if metric not in METRICS:
        raise ValueError(f"unknown neighbour metric {metric!r}; use one of {METRICS}")
    if isinstance(block, bool) or not isinstance(block, (int, np.integer)) or block < 1:
        raise ValueError(f"block must be a positive integer, got {block!r}")
    block = int(min(block, L))
    codes = jnp.asarray(cb, jnp.float32)
    out = []
    for s in range(0, L, block):
        slab = codes[s:s + block]
        n = slab.shape[0]
        if n < block:  # pad the last slab to the block size (one compiled shape); padded rows are dropped
            slab = jnp.pad(slab, ((0, block - n), (0, 0)))
        rows = jnp.arange(s, s + block, dtype=jnp.int32)
        out.append(np.asarray(_block_neighbours(slab, rows, codes, int(k), metric))[:n])
    return np.concatenate(out, axis=0)


def _fingerprint_parts(codebook) -> tuple[float, float]:
    cb = np.asarray(codebook, np.float64)
    corner = cb[:16, :16]
    w = 1.0 + np.arange(corner.size, dtype=np.float64).reshape(corner.shape) / corner.size
    return float(np.sum(corner * w)), float(np.sqrt(np.sum((corner * w) ** 2)))


def codebook_fingerprint(codebook) -> float:
    """A number that tells codebooks apart: a position-weighted sum of the codebook's first 16 x 16 corner.
    Compared with a tolerance of 2% of the weighted corner's norm (`same_codebook`), so the same codebook in bf16,
    f16 or f32 matches while another one (other values, other row order) does not, with high probability."""
    return round(_fingerprint_parts(codebook)[0], 6)


def same_codebook(fingerprint: float, codebook) -> bool:
    """Whether `codebook` has this fingerprint (within the tolerance of `codebook_fingerprint`)."""
    fp, scale = _fingerprint_parts(codebook)
    return abs(fp - fingerprint) <= 0.02 * scale + 1e-6


@struct.dataclass
class NeighbourTable:
    """Latent neighbours in token-id space (see the module docstring).

    ids: [V, kmax] int32, the token ids of each image token's kmax nearest codes, nearest first; -1 on rows of
    non-image tokens (they have no neighbours, so a relaxed rule never relaxes them) and on unused entries.
    """

    ids: jax.Array
    num_codes: int = struct.field(pytree_node=False)
    kmax: int = struct.field(pytree_node=False)
    metric: str = struct.field(pytree_node=False, default="l2")
    fingerprint: float = struct.field(pytree_node=False, default=0.0)

    @property
    def vocab_size(self) -> int:
        return int(self.ids.shape[0])

    @classmethod
    def from_codebook(cls, codebook, k: int, token_of_code, vocab_size: int, metric: str = "l2",
                      block: int = 1024) -> "NeighbourTable":
        """The table of `codebook` [L, d]'s k nearest codes per code, in the token ids `token_of_code` [L] gives
        (code i is token token_of_code[i]) over a vocabulary of `vocab_size` tokens."""
        cb = np.asarray(codebook)
        tok = np.asarray(token_of_code)
        if cb.ndim != 2:
            raise ValueError(f"a codebook is a 2-D [codes, dim] array, got shape {cb.shape}")
        if tok.shape != (cb.shape[0],):
            raise ValueError(f"token_of_code must give one token id per code: shape {tok.shape}, codebook has "
                             f"{cb.shape[0]} codes")
        if np.any(tok < 0) or np.any(tok >= vocab_size):
            raise ValueError(f"token_of_code holds ids outside the vocabulary [0, {vocab_size})")
        if len(np.unique(tok)) != len(tok):
            raise ValueError("token_of_code maps two codes to one token id")
        nb = neighbour_codes(cb, k, metric, block)  # [L, k] code indices
        ids = np.full((int(vocab_size), int(k)), -1, np.int32)
        ids[tok] = tok[nb]
        return cls(jnp.asarray(ids), int(cb.shape[0]), int(k), metric, codebook_fingerprint(cb))

    @classmethod
    def for_chameleon(cls, cfg, codebook, k: int, metric: str = "l2", block: int = 1024) -> "NeighbourTable":
        """The table of a Chameleon-family model (Chameleon, Anole, Lumina-mGPT): `cfg` its `ChameleonConfig`
        (code i is BPE token cfg.image_token_ids[i], see `ports.families.chameleon.codes_to_bpe`), `codebook` its VQGAN
        codebook [L, d] (`ports.families.vqgan.codebook(params["vqmodel"])`)."""
        from ports.families import chameleon as CH

        if not cfg.image_token_ids:
            raise ValueError("the chameleon config has no image tokens (vocabulary_map IMGIMG... entries): it cannot "
                             "map codes to token ids")
        L = len(cfg.image_token_ids)
        tok = np.asarray(CH.codes_to_bpe(cfg, np.arange(L)))
        table = cls.from_codebook(codebook, k, tok, cfg.vocab_size, metric, block)
        # the port's inverse map sends every neighbour back to a code (a consistency check of the mapping)
        assert np.all(np.asarray(CH.bpe_to_codes(cfg, tok)) == np.arange(L))
        return table

    def check(self, vocab_size: int, codebook=None) -> None:
        """Raise ValueError if the table is for another vocabulary size or (when given) another codebook."""
        if int(vocab_size) != self.vocab_size:
            raise ValueError(f"the neighbour table is for a vocabulary of {self.vocab_size} tokens, the model has "
                             f"{int(vocab_size)}: build the table for this model (NeighbourTable.from_codebook)")
        if codebook is not None:
            cb = np.asarray(codebook)
            if cb.ndim != 2 or cb.shape[0] != self.num_codes or not same_codebook(self.fingerprint, cb):
                raise ValueError(f"the neighbour table was built from another codebook ({self.num_codes} codes, "
                                 f"fingerprint {self.fingerprint}; this one: {cb.shape[0] if cb.ndim else '?'} codes, "
                                 f"fingerprint {codebook_fingerprint(cb) if cb.ndim == 2 else '?'})")

    def save(self, path: str) -> None:
        """Write the table to `path` (.npz: the ids and the metadata)."""
        np.savez(path, ids=np.asarray(self.ids, np.int32), num_codes=np.int64(self.num_codes),
                 kmax=np.int64(self.kmax), metric=np.str_(self.metric), fingerprint=np.float64(self.fingerprint))

    @classmethod
    def load(cls, path: str, vocab_size: int | None = None, codebook=None) -> "NeighbourTable":
        """A table written by `save`; with `vocab_size` / `codebook` also checked against them (`check`)."""
        with np.load(path, allow_pickle=False) as f:
            missing = {"ids", "num_codes", "kmax", "metric", "fingerprint"} - set(f.files)
            if missing:
                raise ValueError(f"{path} is not a neighbour table (missing {sorted(missing)})")
            ids = np.asarray(f["ids"], np.int32)
            table = cls(jnp.asarray(ids), int(f["num_codes"]), int(f["kmax"]), str(f["metric"]),
                        float(f["fingerprint"]))
        if ids.ndim != 2 or ids.shape[1] != table.kmax:
            raise ValueError(f"{path}: ids of shape {ids.shape} do not match kmax={table.kmax}")
        if vocab_size is not None or codebook is not None:
            table.check(table.vocab_size if vocab_size is None else vocab_size, codebook)
        return table
