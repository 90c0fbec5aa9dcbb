"""EESD self-distillation: train an early-exit head on top of the target's frozen first N layers.

The loss is one hard-label next-token cross-entropy (EESD 2.2) over a mix of open text and text the target itself
generated with the LLM-QAT hybrid (`self_distillation_texts`: the first few tokens greedy, the rest sampled). The
shared layers are frozen: their states H^N are computed under `stop_gradient` inside the step (N of the target's
layers, a small share of a full forward), and only the head's layers, norm and LM head train. The loop, the
optimizer and the checkpoints are `jspec.tools.train.trainer`'s.

Batches are dicts of [B, T] arrays: input_ids, targets (the next token of the same sequence), weights (1 where
`targets` is a real next token), segment_ids (1, 2, ... per packed sequence, 0 on padding) and positions.
"""
from __future__ import annotations

from typing import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ports.core import cache as kvc
from jspec.tools.train import trainer as jt
from jspec.parts.drafters.early_exit import EarlyExitHead, head_forward, text_model
from ports.families import llama


def exit_states(cfg, lm: dict, n: int, batch: dict) -> jax.Array:
    """H^n [B, T, D]: the target's residual stream after its first n layers over the packed batch (no gradient)."""
    B, T = batch["input_ids"].shape
    cache = kvc.init_cache(n, B, cfg.num_kv_heads, T, cfg.head_dim, lm["embed"].dtype)
    fo = llama.forward(cfg, {"embed": lm["embed"], "layers": lm["layers"][:n]}, batch["input_ids"],
                       batch["positions"], cache, jt.segment_mask(batch["segment_ids"]), hidden_layers=(n,),
                       compute_logits=False, fresh=True)
    return jax.lax.stop_gradient(fo.hidden[0])


def head_logits(cfg, params: dict, h: jax.Array, batch: dict, lm: dict | None = None) -> jax.Array:
    """The head's logits over H^n; `lm`: the target's LM params (a head that shares its LM head reads it there,
    frozen: it is not among the trained `params`)."""
    B, T, _ = h.shape
    cache = None
    if params["layers"]:
        cache = kvc.init_cache(len(params["layers"]), B, cfg.num_kv_heads, T, cfg.head_dim, h.dtype)
    return head_forward(cfg, params, h, batch["positions"], cache, jt.segment_mask(batch["segment_ids"]),
                        fresh=cache is not None, lm=lm)[0]


def loss_fn(cfg, n: int, params: dict, lm: dict, batch: dict):
    """(mean cross-entropy over the weighted next tokens, {"loss": it, "acc": top-1 accuracy})."""
    logits = head_logits(cfg, params, exit_states(cfg, lm, n, batch), batch, lm)
    nll = jt.token_nll(logits, batch["targets"])
    w = batch["weights"]
    loss = jt.masked_mean(nll, w)
    acc = jt.masked_mean((jnp.argmax(logits, -1) == batch["targets"]).astype(jnp.float32), w)
    return loss, {"loss": loss, "acc": acc}


def _loss(static, params, lm, batch):
    return loss_fn(*static, params, lm, batch)


def _sums(static, params, lm, batch):
    """Cross-entropy, top-1 accuracy and agreement (the head's top-1 equals the target's own: a proxy of the
    greedy acceptance rate), each summed over the weighted tokens, with their weight."""
    cfg, n = static
    logits = head_logits(cfg, params, exit_states(cfg, lm, n, batch), batch, lm)
    full = llama.forward(cfg, lm, batch["input_ids"], batch["positions"],
                         kvc.init_cache(cfg.num_layers, *batch["input_ids"].shape[:1], cfg.num_kv_heads,
                                        batch["input_ids"].shape[1], cfg.head_dim, lm["embed"].dtype),
                         jt.segment_mask(batch["segment_ids"]), fresh=True).logits
    w = batch["weights"]
    pred = jnp.argmax(logits, -1)
    return {"loss": ((jt.token_nll(logits, batch["targets"]) * w).sum(), w.sum()),
            "acc": (((pred == batch["targets"]) * w).sum(), w.sum()),
            "agreement": (((pred == jnp.argmax(full, -1)) * w).sum(), w.sum())}


def make_steps(cfg, n: int, tx: optax.GradientTransformation) -> jt.Steps:
    """`jspec.tools.train.trainer.make_steps` of the early-exit head's loss: train(params, opt_state, lr, lm,
    batch), eval(params, lm, batch)."""
    return jt.make_steps(_loss, _sums, (cfg, n), tx)


def self_distillation_texts(target, prompts: Sequence[np.ndarray], max_new_tokens: int, greedy_first: int = 4,
                            temperature: float = 1.0, key=None, eos_token_id=None, batch_size: int = 32,
                            progress: bool = True, pad_prompt_to: int = 16) -> list[np.ndarray]:
    """Prompt + the target's own continuation, per prompt (the LLM-QAT hybrid: the first `greedy_first` tokens
    greedy, the rest sampled at `temperature`), each ending at its EOS or after `max_new_tokens`. The prompt's
    length is len(prompts[i]): `pack(..., starts=)` trains on the continuation alone."""
    import jspec
    from tqdm import tqdm

    key = jax.random.key(0) if key is None else key
    out = []
    for i in tqdm(range(0, len(prompts), batch_size), desc="target generations", disable=not progress):
        rows = [np.asarray(p, np.int32) for p in prompts[i:i + batch_size]]
        head = jspec.decode(target, rows, max_new_tokens=greedy_first, eos_token_id=eos_token_id,
                            pad_prompt_to=pad_prompt_to)
        cont = [np.concatenate([r, head.tokens[b, :head.lengths[b]]]) for b, r in enumerate(rows)]
        ended = head.lengths < greedy_first
        if max_new_tokens <= greedy_first:  # all greedy
            out.extend(cont)
            continue
        rest = jspec.decode(target, cont, max_new_tokens=max_new_tokens - greedy_first, temperature=temperature,
                            key=jax.random.fold_in(key, i), eos_token_id=eos_token_id, pad_prompt_to=pad_prompt_to)
        for b, c in enumerate(cont):
            out.append(c if ended[b] else np.concatenate([c, rest.tokens[b, :rest.lengths[b]]]))
    return out


def pack(seqs: Sequence[np.ndarray], batch_size: int, seq_len: int, start: int = 0,
         starts: Sequence[int] | None = None) -> Iterator[tuple[dict, int]]:
    """Endless fixed-shape batches of `seqs` packed next-fit into rows (cycling; sequences longer than seq_len are
    cut to it), from sequence index `start` on; yields (batch, next index). Every next token is weighted, or, with
    `starts`, those of sequence i from position starts[i] on (a prompt's continuation)."""
    if not len(seqs):
        raise ValueError("pack needs at least one sequence")
    i = start
    while True:
        b = {k: np.zeros((batch_size, seq_len), np.int32) for k in ("input_ids", "targets", "segment_ids",
                                                                    "positions")}
        w = np.zeros((batch_size, seq_len), np.float32)
        for r in range(batch_size):
            used, seg = 0, 0
            while True:
                s = np.asarray(seqs[i % len(seqs)])[:seq_len]
                if used + len(s) > seq_len and used:
                    break
                seg += 1
                L = len(s)
                b["input_ids"][r, used:used + L] = s
                b["targets"][r, used:used + L - 1] = s[1:]
                first = 0 if starts is None else max(int(starts[(i) % len(seqs)]) - 1, 0)
                w[r, used + first:used + L - 1] = 1.0
                b["segment_ids"][r, used:used + L] = seg
                b["positions"][r, used:used + L] = np.arange(L)
                used += L
                i += 1
        b["weights"] = w
        yield b, i


def answer_streams(seqs: Sequence[np.ndarray], starts: Sequence[int], batch_size: int, seq_len: int, start: int = 0,
                   held_batches: int = 4) -> tuple[Iterator[tuple[dict, int]], list[dict]]:
    """(train stream, held-out batches) of prompt + answer sequences whose answers start at `starts` (answers
    weighted; the last 5% of the sequences held out, at least one). ValueError for fewer than two sequences or
    for one longer than `seq_len` (packing would cut its answer)."""
    if len(seqs) < 2:
        raise ValueError(f"{len(seqs)} answered sequences: at least 2 are needed (one is held out)")
    longest = max(len(q) for q in seqs)
    if longest > seq_len:
        over = sum(len(q) > seq_len for q in seqs)
        raise ValueError(f"{over} of {len(seqs)} sequences are longer than seq_len {seq_len} (the longest: "
                         f"{longest} tokens): use a seq_len of {longest} or more")
    cut = max(1, len(seqs) // 20)
    stream = pack(seqs[:-cut], batch_size, seq_len, start, starts[:-cut])
    held = pack(seqs[-cut:], batch_size, seq_len, 0, starts[-cut:])
    return stream, [next(held)[0] for _ in range(held_batches)]


def mix(a: Iterator[tuple[dict, int]], b: Iterator[tuple[dict, int]] | None, share_b: float
        ) -> Iterator[tuple[dict, tuple[int, int], int]]:
    """Batches whose first rows come from `a` and the last round(share_b * B) from `b`; yields (batch, (a's next
    index, b's next index), real tokens)."""
    ib = 0
    for (x, ia) in a:
        if b is not None and share_b > 0:
            y, ib = next(b)
            k = int(round(share_b * x["input_ids"].shape[0]))
            x = {key: np.concatenate([x[key][:x[key].shape[0] - k], y[key][:k]]) for key in x}
        yield x, (ia, ib), int((x["segment_ids"] > 0).sum())


def evaluate(eval_step, params, lm, batches) -> dict:
    """Held-out heldout_loss, heldout_acc and heldout_agreement over `batches`."""
    return jt.evaluate(eval_step, params, batches, lm)


def head_target_lm(target, head: EarlyExitHead):
    """(text config, LM params) of `target`, checked against the head."""
    head.check(target)
    return text_model(target)
