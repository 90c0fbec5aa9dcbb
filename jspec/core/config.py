"""`DecodeConfig`: everything about one decode but the target, the prompt and the strategy, as one object.

`jspec.decode` and `jspec.start` take these fields as their keywords (declared here once: `decode`'s signature is
made from them) or `start` a config whole. The numbers that can be checked without the target are checked
when it is made, before any compute.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

DEFAULT_PREFILL_CHUNK = 4096  # prompts longer than this are prefilled in chunks of it (activations bounded by it)
PROFILES = (False, True, "host", "program")


def check_prefill_chunk(chunk) -> int | None:
    """The prefill chunk `decode` takes ("auto", None or a positive int) as an int or None."""
    if isinstance(chunk, str) and chunk == "auto":
        return DEFAULT_PREFILL_CHUNK
    if chunk is None:
        return None
    if isinstance(chunk, bool) or not isinstance(chunk, (int, np.integer)) or chunk < 1:
        raise ValueError(f"prefill_chunk must be a positive number of tokens, 'auto' or None, got {chunk!r}")
    return int(chunk)


def max_positions(target) -> int | None:
    """The positions the target was trained for (None where there is no fixed bound: no such field, or dynamic
    RoPE scaling, which exists to run past it)."""
    text = getattr(target.config, "text", target.config)
    rope = getattr(text, "rope", None)
    if getattr(rope, "rope_type", "default") == "dynamic":
        return None
    return getattr(text, "max_position_embeddings", None)


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """A decode's settings (`jspec.decode` documents each keyword)."""

    # limits
    max_new_tokens: int = 64  # tokens generated per row at most
    eos_token_id: Any = None  # None: the checkpoint's EOS ids; () never stops; an id or a tuple of ids
    max_cache_len: int | None = None  # a cap on the KV cache (a prompt that does not fit raises)
    # sampling
    temperature: float = 0.0  # 0: greedy
    top_k: int | None = None
    top_p: float | None = None
    key: Any = None  # one PRNG key (row b draws from fold_in(key, b)) or one per row
    # what the prompt does not say
    draft_prompt: Any = None  # the draft's own view of each row's prompt (speculative strategies)
    guidance: Any = None  # jspec.CFG: classifier-free guidance
    constraint: Any = None  # e.g. jspec.ImageGrammar: a mask on each generated position's logits
    # speculation per row
    speculate: Any = None  # [B] bools: rows marked False decode as AR inside the batch (None: every row drafts)
    # placement
    mesh: Any = None  # shard the target over it by `rules`, replicate the draft
    rules: Any = None  # logical axis rules (default jspec.core.sharding.DEFAULT_RULES; a dict overrides entries)
    # prefill
    prefill_chunk: int | None | str = "auto"  # fill the cache this many prompt tokens at a time ("auto", None: one)
    pad_prompt_to: int = 16  # prompt widths padded up to a multiple of this (nearby lengths share programs)
    # profiling
    profile: bool | str = False  # True / "host": phase by phase with host syncs; "program": timed in the program
    compile_loop: bool | None = None  # compile the decode loop beside the prefill (None: unless profiled by host)

    def __post_init__(self):
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, (int, np.integer)) \
                or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens!r}")
        if isinstance(self.pad_prompt_to, bool) or not isinstance(self.pad_prompt_to, (int, np.integer)) \
                or self.pad_prompt_to < 1:
            raise ValueError(f"pad_prompt_to must be a positive integer, got {self.pad_prompt_to!r}")
        check_prefill_chunk(self.prefill_chunk)
        if self.profile not in PROFILES:
            raise ValueError(f"profile must be False, True (or 'host') or 'program', got {self.profile!r}")

    @property
    def loop_ahead(self) -> bool:
        """Whether `start` compiles the decode loop beside the prefill (`compile_loop`; by default, unless the loop
        is run phase by phase from the host)."""
        return self.profile not in (True, "host") if self.compile_loop is None else bool(self.compile_loop)

    @property
    def chunk(self) -> int | None:
        """The prefill chunk as a number of tokens, or None."""
        return check_prefill_chunk(self.prefill_chunk)

    def replace(self, **changes) -> "DecodeConfig":
        return dataclasses.replace(self, **changes)
