"""Streaming: the decode loop run in chunks of target steps, each chunk's newly committed tokens handed to the
caller as it ends (`jspec.stream`).

Every chunk runs the same compiled loop as `decode`'s, with the step to stop at as a traced argument: one compile
serves every chunk, and the host syncs once per chunk, never per step. The pieces a row yields, concatenated, are
the tokens `jspec.decode` returns for it with the same arguments."""
from __future__ import annotations

import functools
import time
from typing import Iterator

import jax
import numpy as np

from jspec import api
from jspec.engine import loop
from jspec.core import sharding as SH
from jspec.engine import step as SD
from jspec.engine.strategy import merge


@functools.partial(jax.jit, static_argnames=("ctx",), donate_argnames=("state",))
def _chunk_ar(ctx, target, state, until):
    return loop.run_loop(ctx, lambda s: loop.ar_step(ctx, target, s), state, until)


@functools.partial(jax.jit, static_argnames=("ctx", "static"), donate_argnames=("state",))
def _chunk_sd(ctx, static, dyn, target, state, until):
    parts = merge(static, dyn)
    return loop.run_loop(ctx, lambda s: SD.sd_step(ctx, parts, target, s), state, until)


class Stream:
    """Iterate for lists of B int32 arrays, the tokens each row committed since the previous item (empty where a
    row committed nothing: finished, or the chunk ended first). The first item is each row's first token (from
    the prefill). After the last item `output` holds the whole `DecodeOutput` (tokens, lengths, stats) that
    `jspec.decode` would have returned."""

    def __init__(self, started: api.Started, every: int, max_new_tokens: int, strategy):
        self._r, self.every, self._max_new, self._strategy = started, every, max_new_tokens, strategy
        self.output: api.DecodeOutput | None = None
        self.chunks = 0

    @staticmethod
    def _advance(r, state, until):
        if r.parts is None:
            return _chunk_ar(r.ctx, r.target, state, until)
        return _chunk_sd(r.ctx, r.static, r.dyn, r.target, state, until)

    def __iter__(self) -> Iterator[list[np.ndarray]]:
        if self._r is None:
            raise RuntimeError("a Stream runs its decode once: call jspec.stream again to decode again")
        r, self._r = self._r, None  # the loop consumes the state
        state = r.state
        t0 = time.perf_counter()
        out, n_out, step, done = SH.host_get((state.out, state.n_out, state.step, state.done))
        sent = np.asarray(n_out).copy()
        yield [np.asarray(out[b, :sent[b]], np.int32) for b in range(len(sent))]
        while int(step) < r.ctx.max_steps and not bool(np.all(done)):
            state = self._advance(r, state, np.int32(int(step) + self.every))
            out, n_out, step, done = SH.host_get((state.out, state.n_out, state.step, state.done))
            self.chunks += 1
            piece = [np.asarray(out[b, sent[b]:n_out[b]], np.int32) for b in range(len(sent))]
            sent = np.asarray(n_out).copy()
            yield piece
        accepted, drafted, (decided, prefilled) = SH.host_get(
            (state.accepted, state.drafted, api.aux_stats(state, r)))
        steps = int(step)
        decided = {k: v[:, :steps] for k, v in decided.items()}
        self.output = api.finish(out, n_out, steps, accepted, drafted, self._max_new, r.pad,
                                  {"prefill_s": r.prefill_s, "decode_s": time.perf_counter() - t0,
                                   "chunks": self.chunks, **(r.prep_stats or {}), **prefilled, **decided},
                                  depth=r.depth)


def stream(target, prompt, strategy=None, max_new_tokens: int = 64, every: int = 8, **kwargs) -> Stream:
    """`jspec.decode`'s generation (same arguments, in `kwargs`: temperature, key, eos_token_id, mesh, ...), handed
    back as it goes: iterating the returned `Stream` yields each row's newly committed tokens every `every` target
    steps (one host sync per chunk). The checks and the prefill run here, before the first item."""
    if isinstance(every, bool) or not isinstance(every, (int, np.integer)) or every < 1:
        raise ValueError(f"every must be a positive number of target steps, got {every!r}")
    if kwargs.get("profile"):
        raise ValueError("stream does not profile: use jspec.decode(..., profile=...)")
    kwargs.pop("profile", None)
    started = api.start(target, prompt, strategy, max_new_tokens=max_new_tokens, compile_loop=False, **kwargs)
    return Stream(started, int(every), max_new_tokens, strategy)


__all__ = ["Stream", "stream"]
