"""Training a block drafter (`jspec.parts.drafters.dflash.DFlashHead`) on a frozen target, from cached features.

1. Features, once (`FeatureStore.build`): the target runs over every training sequence and its residual streams at
   the head's context layers are stored, memory-mapped (float16 when they fit, else float32), with the tokens and
   the answer mask. Training never runs the target: a step reads its rows from the store.
2. Batches (`batches`): `batch` sequences a step, in a per-epoch shuffled order that depends only on the seed and
   the position in the stream (a resumed run reads what an uninterrupted one does). Each sequence gets `anchors`
   random anchor positions a among those whose next token is one the target wrote.
3. Loss (`loss_terms`): every block [anchor token, mask x (block - 1)] at positions a .. a + block - 1 attends to
   the context entries before a and to its own block in both directions (one forward for all blocks of a batch,
   under a block mask); position k's output is scored against the sequence's token at a + k over the draft
   vocabulary:

       loss = sum_{blocks, k} w_k * CE(token_{a+k}, q_k) / sum w_k,   w_k = exp(-(k - 1) / gamma)

   where a term counts when its token is one the target wrote and lies inside the sequence (DFlash's Eq. for the
   block-wise loss; gamma 7 for blocks of 16, 5 for 10, 4 for 8, as the authors set it). A token outside the draft
   vocabulary cannot be drafted: it is left out of the loss and counts as a miss.
4. Logged: loss, top1_k per position, and the held-out acceptance as a greedy chain would see it: accept_k, the
   share of blocks whose first k drafts are all right, and tau = 1 + sum_k accept_k (tokens a step would commit).

Everything of the head trains (fc, its norms, its layers with their q / k norms); the target's embedding (the mask
token's row included: the mask positions' input, as the authors have it) and LM head are frozen. The loop,
optimizer, checkpoints, exact resume and progress are `jspec.tools.train.trainer`'s.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jspec.parts.drafters import dflash as DF
from jspec.parts.drafters import eagle as EG
from jspec.tools.train import eagle as ET
from jspec.tools.train import trainer as jt
from ports.core import cache as kvc
from ports.core import layers as LY
from ports.families import llama

FP16_MAX = 6.0e4  # features stored as float16 when every value's magnitude is below this


def default_gamma(block: int) -> float:
    """The loss decay for a block size: the authors' 7 for 16, 5 for 10, 4 for 8, linear in between and beyond."""
    return float(np.interp(block, [8, 10, 16], [4.0, 5.0, 7.0], left=None, right=None)) if block <= 16 else \
        7.0 + (block - 16) / 3.0


# ---------------------------------------------------------------------------------------------- the feature store


class FeatureStore:
    """The target's states at some layers over a set of token sequences, memory-mapped from `directory`:
    feats [N, n * D] (float16 or float32), ids [N] int32, mask [N] float32 (mask[j] = 1: token j + 1 is one the
    target wrote), offsets [R + 1] (record r holds rows offsets[r] .. offsets[r + 1])."""

    def __init__(self, directory: str | Path):
        d = Path(directory)
        meta_path = d / "features.json"
        if not meta_path.exists():
            raise ValueError(f"{d} holds no feature store (features.json is missing)")
        self.dir = d
        self.meta = json.loads(meta_path.read_text())
        n, width = int(self.meta["rows"]), int(self.meta["width"])
        self.feats = np.memmap(d / "feats.bin", dtype=np.dtype(self.meta["dtype"]), mode="r", shape=(n, width))
        self.ids = np.load(d / "ids.npy", mmap_mode="r")
        self.mask = np.load(d / "mask.npy", mmap_mode="r")
        self.offsets = np.load(d / "offsets.npy")

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def record(self, r: int, limit: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(feats [L, n * D] float32, ids [L], mask [L]) of record r, cut to `limit` rows."""
        a, b = int(self.offsets[r]), int(self.offsets[r + 1])
        if limit is not None:
            b = min(b, a + limit)
        return np.asarray(self.feats[a:b], np.float32), np.asarray(self.ids[a:b]), np.asarray(self.mask[a:b])

    @staticmethod
    def key(target, layers: Sequence[int], items) -> str:
        """What a store is for: the target's signature, the layers and a digest of the token sequences."""
        h = hashlib.sha256(json.dumps([DF.signature(target)._asdict(), list(layers)]).encode())
        for ids, m in items:
            h.update(np.asarray(ids, np.int32).tobytes())
            h.update(np.asarray(m, np.float32).tobytes())
        return h.hexdigest()[:16]

    @classmethod
    def build(cls, target, items, layers: Sequence[int], directory: str | Path, batch: int = 8, pad_to: int = 64,
              progress: bool = True) -> "FeatureStore":
        """The store of `items` ((ids, mask) per sequence) under `directory`, computed with one target forward per
        batch of sequences (widths padded to a multiple of `pad_to`), or read back when it is already there for the
        same target, layers and sequences."""
        from tqdm import tqdm

        d = Path(directory)
        key = cls.key(target, layers, items)
        if (d / "features.json").exists():
            store = cls(d)
            if store.meta.get("key") == key:
                return store
        d.mkdir(parents=True, exist_ok=True)
        cfg, lm = DF.text_parts(target)
        lengths = np.array([len(ids) for ids, _ in items], np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        width = len(layers) * cfg.hidden_size
        tmp = np.lib.format.open_memmap(d / "feats.tmp.npy", mode="w+", dtype=np.float32,
                                        shape=(int(offsets[-1]), width))
        order = np.argsort(-lengths, kind="stable")  # similar lengths together: little padding
        bar = tqdm(total=int(offsets[-1]), desc="target features", unit="tok", disable=not progress,
                   mininterval=2.0)
        for s in range(0, len(order), batch):
            rows = order[s:s + batch]
            T = int(-(-lengths[rows].max() // pad_to) * pad_to)
            ids = np.zeros((len(rows), T), np.int32)
            for i, r in enumerate(rows):
                ids[i, :lengths[r]] = items[r][0]
            h = np.asarray(_features(cfg, tuple(int(i) for i in layers), lm, jnp.asarray(ids)))
            for i, r in enumerate(rows):
                tmp[offsets[r]:offsets[r + 1]] = h[i, :lengths[r]]
            bar.update(int(lengths[rows].sum()))
        bar.close()
        peak = float(np.max(np.abs(tmp))) if len(tmp) else 0.0
        dtype = np.float16 if peak < FP16_MAX else np.float32
        out = np.memmap(d / "feats.bin", dtype=dtype, mode="w+", shape=tmp.shape)
        for s in range(0, len(tmp), 65536):
            out[s:s + 65536] = tmp[s:s + 65536]
        out.flush()
        del out, tmp
        os.remove(d / "feats.tmp.npy")
        np.save(d / "ids.npy", np.concatenate([np.asarray(i, np.int32) for i, _ in items]))
        np.save(d / "mask.npy", np.concatenate([np.asarray(m, np.float32) for _, m in items]))
        np.save(d / "offsets.npy", offsets)
        (d / "features.json").write_text(json.dumps({
            "key": key, "rows": int(offsets[-1]), "width": width, "dtype": np.dtype(dtype).name,
            "layers": [int(i) for i in layers], "records": len(items), "peak_abs": peak,
            "target": DF.signature(target)._asdict()}, indent=1))
        return cls(d)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _features(cfg, layers: tuple, lm: dict, ids: jax.Array) -> jax.Array:
    """The target's states at `layers` over token rows ids [B, T] (one fresh forward), concatenated, float32."""
    B, T = ids.shape
    cache = kvc.init_cache(cfg.num_layers, B, cfg.num_kv_heads, T, cfg.head_dim, lm["embed"].dtype)
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    fo = llama.forward(cfg, lm, ids, pos, cache, hidden_layers=layers, compute_logits=False, fresh=True)
    return jnp.concatenate(fo.hidden, axis=-1).astype(jnp.float32)


# ---------------------------------------------------------------------------------------------- batches


def batches(store: FeatureStore, records: Sequence[int], batch: int, seq_len: int, anchors: int, block: int,
            seed: int, start: int = 0):
    """`fit`'s batches (batch, next index, supervised tokens) from stream index `start` on: rows of `records` in an
    order shuffled per epoch by (seed, epoch), each cut to `seq_len`, with `anchors` anchor positions drawn by
    (seed, index) among those whose next token the target wrote (-1: none left)."""
    records = np.asarray(records)
    n = len(records)
    if n == 0:
        raise ValueError("no training records")
    width = int(store.meta["width"])
    i = start
    while True:
        h = np.zeros((batch, seq_len, width), np.float32)
        ids = np.zeros((batch, seq_len), np.int32)
        mask = np.zeros((batch, seq_len), np.float32)
        lengths = np.zeros((batch,), np.int32)
        anc = np.full((batch, anchors), -1, np.int32)
        supervised = 0
        for b in range(batch):
            epoch, at = divmod(i + b, n)
            r = records[np.random.default_rng((seed, epoch)).permutation(n)[at]]
            f, t, m = store.record(int(r), seq_len)
            L = len(t)
            h[b, :L], ids[b, :L], mask[b, :L], lengths[b] = f, t, m, L
            cand = np.flatnonzero(m[:L - 1] > 0)
            if cand.size:
                pick = np.random.default_rng((seed, i + b, 1)).choice(cand, min(anchors, cand.size), replace=False)
                anc[b, :pick.size] = np.sort(pick)
            supervised += int(min(anchors, cand.size)) * (block - 1)
        i += batch
        yield {"h": h, "ids": ids, "mask": mask, "lengths": lengths, "anchors": anc}, i, supervised


# ---------------------------------------------------------------------------------------------- the loss


@dataclasses.dataclass(frozen=True)
class BlockOptions:
    """block: the anchor and block - 1 mask positions per block; gamma: the loss decay over positions."""

    block: int = 16
    gamma: float = 7.0


def block_outputs(head: DF.DFlashHead, embed: jax.Array, batch: dict, block: int) -> tuple[jax.Array, jax.Array]:
    """(the head's final-normed states [B, A, block, D] of every anchor's block, the block tokens' targets
    [B, A, block] = the sequence's tokens at a .. a + block - 1 (-1 outside it)): one forward of all blocks, each
    seeing the context entries before its anchor and its own block."""
    ids, lengths, anc = batch["ids"], batch["lengths"], batch["anchors"]
    B, T = ids.shape
    A = anc.shape[1]
    Q = A * block
    a = jnp.maximum(anc, 0)
    c = DF.context(head, batch["h"])  # [B, T, D]
    ks, vs = DF.context_kv(head, c.astype(embed.dtype), jnp.broadcast_to(jnp.arange(T), (B, T)))
    off = jnp.arange(block)
    pos = (a[:, :, None] + off[None, None]).reshape(B, Q)
    x = jnp.concatenate([jnp.take(embed, jnp.take_along_axis(ids, a, axis=1), axis=0)[:, :, None],
                         jnp.broadcast_to(embed[head.mask_token], (B, A, block - 1, embed.shape[-1]))],
                        axis=2).reshape(B, Q, -1)
    j = jnp.arange(T)
    ctx_vis = (j[None, None, :] < a[:, :, None]) & (j[None, None, :] < lengths[:, None, None])  # [B, A, T]
    ctx_vis = jnp.repeat(ctx_vis, block, axis=1)  # [B, Q, T]
    blk = jnp.arange(Q) // block
    own = jnp.broadcast_to(blk[:, None] == blk[None, :], (B, Q, Q))
    w = head.config.sliding_window
    if w is not None:  # the head's window: positions less than w apart
        ctx_vis = ctx_vis & (pos[:, :, None] - j[None, None, :] < w)
        own = own & (jnp.abs(pos[:, :, None] - pos[:, None, :]) < w)
    visible = jnp.concatenate([ctx_vis, own], axis=-1)

    pad = lambda a: jnp.pad(LY.kv_rows(a), ((0, 0), (0, Q), (0, 0)))  # noqa: E731  the blocks go after the context
    kb, vb, start = [pad(k) for k in ks], [pad(v) for v in vs], jnp.full((B,), T, jnp.int32)
    f = DF.block_states(head, x, pos, lambda i: (kb[i], vb[i], start, visible)).reshape(B, A, block, -1)
    tgt_pos = a[:, :, None] + off[None, None]
    inside = (tgt_pos < lengths[:, None, None]) & (anc[:, :, None] >= 0)
    tgt = jnp.where(inside, jnp.take_along_axis(ids, jnp.minimum(tgt_pos, T - 1).reshape(B, -1), axis=1
                                                ).reshape(B, A, block), -1)
    return f, tgt


def loss_terms(head: DF.DFlashHead, embed: jax.Array, rows: jax.Array, index_of: jax.Array, batch: dict,
               opts: BlockOptions):
    """(loss, metrics) of one batch (module docstring). rows: the draft vocabulary's LM-head rows [Vd, D];
    index_of: each target id's row in them [V] (-1: outside the draft vocabulary)."""
    block = opts.block
    f, tgt = block_outputs(head, embed, batch, block)
    B, A = tgt.shape[:2]
    f, tgt = f[:, :, 1:], tgt[:, :, 1:]  # position k = 1 .. block - 1 predicts the token at a + k
    anc = jnp.maximum(batch["anchors"], 0)
    T = batch["ids"].shape[1]
    # the term of position k counts when token a + k is one the target wrote: mask[a + k - 1] = 1
    mpos = jnp.minimum(anc[:, :, None] + jnp.arange(block - 1)[None, None], T - 1)
    wrote = jnp.take_along_axis(batch["mask"], mpos.reshape(B, -1), axis=1).reshape(tgt.shape) > 0
    valid = (tgt >= 0) & wrote
    label = jnp.where(tgt >= 0, index_of[jnp.maximum(tgt, 0)], -1)
    logits = LY.weight_dot("bakd,vd->bakv", f, rows, jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, jnp.maximum(label, 0)[..., None], axis=-1)[..., 0]
    decay = jnp.exp(-jnp.arange(block - 1, dtype=jnp.float32) / opts.gamma)
    w = jnp.where(valid & (label >= 0), decay[None, None], 0.0)
    loss = jnp.sum(nll * w) / jnp.maximum(jnp.sum(w), 1e-6)
    right = (jnp.argmax(logits, -1) == label) & (label >= 0)
    full = jnp.all(valid, axis=-1)  # blocks whose every position counts: a greedy chain's acceptance
    prefix = jnp.cumprod(right.astype(jnp.float32), axis=-1)
    vf = valid.astype(jnp.float32)
    aux = {"loss": loss, "weight": jnp.sum(w)}
    for k in range(block - 1):
        aux[f"top1_{k + 1}"] = (jnp.sum(right[..., k] * vf[..., k]), jnp.sum(vf[..., k]))
    nf = jnp.sum(full)
    for k in range(block - 1):
        aux[f"accept_{k + 1}"] = (jnp.sum(prefix[..., k] * full), nf)
    aux["tau"] = (jnp.sum((1.0 + jnp.sum(prefix, axis=-1)) * full), nf)
    return loss, aux


def _head(spec, params, vocab):
    config, layers, target, block, mask_token = spec
    return DF.DFlashHead(params, config, layers, target, block, vocab, mask_token)


def _loss(static, params, vocab, embed, rows, index_of, batch):
    spec, opts = static
    loss, aux = loss_terms(_head(spec, params, vocab), embed, rows, index_of, batch, opts)
    out = {"loss": loss}
    for k in range(1, min(opts.block, 4)):
        s, n = aux[f"top1_{k}"]
        out[f"top1_{k}"] = s / jnp.maximum(n, 1.0)
    return loss, out


def _sums(static, params, vocab, embed, rows, index_of, batch):
    spec, opts = static
    _, aux = loss_terms(_head(spec, params, vocab), embed, rows, index_of, batch, opts)
    out = {"loss": (aux["loss"] * aux["weight"], aux["weight"])}
    out.update({k: v for k, v in aux.items() if k not in ("loss", "weight")})
    return out


def make_steps(head: DF.DFlashHead, tx, opts: BlockOptions) -> jt.Steps:
    """train(params, opt_state, lr, vocab, embed, rows, index_of, batch), eval(params, vocab, embed, rows,
    index_of, batch): `jspec.tools.train.trainer.make_steps` of the block loss."""
    spec = (head.config, head.target_layers, head.target, head.block, head.mask_token)
    return jt.make_steps(_loss, _sums, (spec, opts), tx)


def vocab_tables(target, head: DF.DFlashHead) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(draft vocabulary ids [Vd], their LM-head rows [Vd, D] float32, each target id's index [V] or -1)."""
    cfg, lm = DF.text_parts(target)
    ids = jnp.arange(cfg.vocab_size, dtype=jnp.int32) if head.vocab is None else head.vocab
    rows = EG.vocab_rows(cfg, lm, ids).astype(jnp.float32)
    index_of = jnp.full((cfg.vocab_size,), -1, jnp.int32).at[ids].set(jnp.arange(ids.shape[0], dtype=jnp.int32))
    return ids, rows, index_of


def start_head(target, key: jax.Array, num_layers: int = 2, block: int = 16, target_layers=None,
               draft_vocab=None, norm_scale: float = 0.1, mask_token: int | None = None) -> DF.DFlashHead:
    """The head training starts from: `dflash.init_head`'s random one (float32) with its final norm's weights at
    `norm_scale`, so that its first distributions are near uniform rather than confidently wrong."""
    head = DF.init_head(target, key, num_layers, block, target_layers, draft_vocab, dtype=jnp.float32,
                        mask_token=mask_token)
    return head.replace(params=dict(head.params, norm=head.params["norm"] * norm_scale))


def fit_head(target, store: FeatureStore, train_records, workdir, *, head: DF.DFlashHead, steps: int | None = None,
             minutes: float | None = None, lr: float = 6e-4, warmup: int | None = None, seed: int = 0,
             resume: bool = True, batch_size: int = 8, seq_len: int = 512, anchors: int = 8,
             opts: BlockOptions | None = None, heldout: Sequence[dict] | None = None, log_every: int = 10,
             ckpt_minutes: float = 3.0, progress: bool = True, name: str = "dflash", argv: list[str] | None = None,
             interrupt_at: int | None = None, max_steps: int | None = None) -> tuple[DF.DFlashHead, dict]:
    """Train `head` for `target` on the store's `train_records` (`jspec.tools.train.trainer.fit`: a time budget
    or a number of steps, orbax checkpoints in workdir, exact resume); returns (head, run meta). heldout: batches
    (`batches`) evaluated at every checkpoint: heldout_loss, _top1_k, _accept_k, _tau."""
    opts = opts or BlockOptions(head.block, default_gamma(head.block))
    if opts.block != head.block:
        raise ValueError(f"the options' block {opts.block} is not the head's {head.block}")
    if int(store.meta["width"]) != len(head.target_layers) * head.config.hidden_size or \
            list(store.meta["layers"]) != list(head.target_layers):
        raise ValueError(f"{store.dir} holds features of layers {store.meta['layers']}; the head reads "
                         f"{list(head.target_layers)}")
    workdir = ET.start_run(workdir, resume, steps, minutes)
    head = head.replace(params=jax.tree.map(lambda a: jnp.array(a, jnp.float32), head.params))
    head.check(target)
    _, lm = DF.text_parts(target)
    embed = jnp.asarray(lm["embed"], jnp.float32)
    vocab, rows, index_of = vocab_tables(target, head)
    tx = jt.adamw(0.0)
    meta = jt.new_meta(name, seed, steps, lr, ET.default_warmup(warmup, steps), block=head.block, gamma=opts.gamma,
                       anchors=anchors, target_layers=list(head.target_layers), layers=head.config.num_layers,
                       draft_vocab=head.draft_vocab_size, target=head.target._asdict(), mask_token=head.mask_token)
    train_step, eval_step = make_steps(head, tx, opts)

    def step(params, opt_state, batch, lr_now, i):
        return train_step(params, opt_state, lr_now, head.vocab, embed, rows, index_of, batch)

    evaluate_fn = None
    if heldout:
        evaluate_fn = lambda s: jt.evaluate(eval_step, s["params"], heldout, head.vocab, embed, rows,  # noqa: E731
                                            index_of)
    data = lambda start: batches(store, train_records, batch_size, seq_len, anchors, head.block, seed,  # noqa: E731
                                 start)
    state, meta = ET.run(step, {"params": head.params, "opt_state": tx.init(head.params)}, meta, workdir, data,
                         batch_size=batch_size, seq_len=seq_len, pack=False, steps=steps, lr=lr, minutes=minutes,
                         evaluate_fn=evaluate_fn, ckpt_minutes=ckpt_minutes, log_every=log_every, name=name,
                         progress=progress, argv=argv, interrupt_at=interrupt_at, max_steps=max_steps)
    return head.replace(params=state["params"]), meta


def heldout_batches(store: FeatureStore, records, batch: int, seq_len: int, anchors: int, block: int, n: int,
                    seed: int = 1) -> list[dict]:
    """`n` fixed batches of the held-out `records`."""
    it = batches(store, records, batch, seq_len, anchors, block, seed)
    return [next(it)[0] for _ in range(n)]


def plot_acceptance(log: str | Path, out: str | Path, title: str) -> Path | None:
    """A PNG of the held-out acceptance per draft position (accept_k) at each checkpoint of a run's log."""
    from jspec.tools import report

    rows = [r for r in jt.read_log(log) if "heldout_tau" in r]
    if not rows:
        return None
    ks = sorted(int(k.rsplit("_", 1)[1]) for k in rows[-1] if k.startswith("heldout_accept_"))
    with report.figure(str(out), figsize=(7, 4)) as fa:
        if fa is None:
            return None
        ax = fa[1][0, 0]
        for r in rows[-4:] if len(rows) > 4 else rows:
            ax.plot(ks, [r[f"heldout_accept_{k}"] for k in ks], "o-", ms=3,
                    label=f"step {r['step']}: tau {r['heldout_tau']:.2f}")
        ax.set_xlabel("draft position k")
        ax.set_ylabel("share of blocks with drafts 1..k right")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    return Path(out)
