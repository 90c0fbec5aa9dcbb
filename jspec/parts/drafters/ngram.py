"""Prompt lookup: drafts copied from the text itself (the prompt and the tokens generated so far), no draft model.

The drafter keeps every committed token of its row (`hist`, the newest one, `last`, aside). At the root it takes
the longest suffix of the text, of at most `max_ngram` and at least `min_ngram` tokens, that occurred before, and
proposes what followed each earlier occurrence: the root's distribution is the count of each continuation token
over those occurrences (among equal counts, the later ones weigh more), so a chain drafts the most frequent continuation and a tree's
branches the next ones. Below the root a node continues the copy it came from: the token after its source
position, a one-hot distribution, until the copy reaches the newest committed token; nothing is drafted past a
copy's end (the node's children get probability zero, which the plan treats as undrafted). With `depths`, a copy
also stops at the depth allowed for the length of the suffix that matched: a one-token match is a weak guess, a
three-token match a likely repetition, so a step can draft a few tokens after the first and many after the second
(a trimmed plan then verifies only as deep as some row drafted).

The distributions are real (the plan draws from them and the rule reads them), so every lossless rule stays exact:
greedy decoding equals AR, sampling draws from the target's distribution.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jspec.parts.protocols import Catchup, DraftEnv, Drafter, Prepared, Setup, TargetPrefill
from jspec.parts.drafters.text import append_accepted, start_text, with_last

_TIE = 1e-3  # each occurrence weighs 1 + _TIE * (its position / the text's length): counts first, then recency


@struct.dataclass
class NgramState:
    hist: jax.Array  # [B, H] committed tokens before `last`, in order
    n: jax.Array  # [B] how many
    roots: jax.Array  # [B, H] bool: positions whose token continues a match of the root's suffix
    src: jax.Array  # [B, S] per draft scratch slot: the text position its node copies, -1 none
    cap: jax.Array  # [B] this step's deepest draft (`NgramDrafter.depths` of the root's match length)


def suffix_matches(seq: jax.Array, n: jax.Array, max_ngram: int, min_ngram: int,
                   with_length: bool = False):
    """[B, L] bool: positions c < n whose preceding g tokens equal the text's last g tokens, for the largest g in
    [min_ngram, max_ngram] with any such position in the row (none: all False). Position c's token is then a
    continuation of that suffix; the suffix itself is excluded (c < n). With `with_length`, also that g per row
    [B] (0: no match)."""
    B, L = seq.shape
    pos = jnp.arange(L)[None, :]
    found = jnp.zeros((B, L), bool)
    have = jnp.zeros((B,), bool)
    length = jnp.zeros((B,), jnp.int32)
    for g in range(max_ngram, min_ngram - 1, -1):
        same = (pos >= g) & (pos < n[:, None]) & (n[:, None] > g)
        for j in range(1, g + 1):  # seq[c - j] == seq[n - j]
            tail = jnp.take_along_axis(seq, jnp.maximum(n[:, None] - j, 0), axis=1)
            same = same & (jnp.pad(seq, ((0, 0), (j, 0)))[:, :L] == tail)
        take = ~have & jnp.any(same, axis=1)
        found = jnp.where(take[:, None], same, found)
        length = jnp.where(take, g, length)
        have = have | take
    return (found, length) if with_length else found


def reference_draft(text: list[int], max_ngram: int, gamma: int, depths=None, min_ngram: int = 1
                    ) -> tuple[int, list[int]]:
    """The chain a `NgramDrafter` drafts after `text`, in plain Python: (the matched suffix length g, 0 for none;
    the copy). The most weighted continuation of the longest suffix seen before, copied from its latest source until
    the copy reaches the end of the text, `gamma` tokens at most (and depths[g - 1] with `depths`). The definition
    the tests hold the drafter to, and what the match statistics of docs/results/spec-bench-prompt-lookup.md replayed
    over recorded answers."""
    n = len(text)
    for g in range(max_ngram, min_ngram - 1, -1):
        if n <= g:
            continue
        tail = list(text[n - g:])
        found = [c for c in range(g, n) if list(text[c - g:c]) == tail]
        if not found:
            continue
        weight: dict[int, float] = {}
        for c in found:
            weight[text[c]] = weight.get(text[c], 0.0) + 1.0 + _TIE * c / n
        tok = max(weight, key=lambda t: (weight[t], -t))
        src = max(c for c in found if text[c] == tok)
        limit = gamma if depths is None else min(gamma, depths[g - 1])
        out = [tok]
        while len(out) < limit and src + 1 < n:
            src += 1
            out.append(text[src])
        return g, out
    return 0, []


def lookup_proposal(max_ngram: int = 3, gamma: int = 4, min_ngram: int = 1):
    """Prompt lookup's chain as a `jspec.TokenDrafter` proposal, `propose(tokens, lengths) -> (draft, valid)`: the
    chain `reference_draft` defines (what `NgramDrafter` drafts under a chain plan), written over the text alone.
    It compares every pair of text positions, [B, L, L] per step, where `NgramDrafter` counts into the vocabulary:
    a demonstration of the adapter more than a replacement for it."""
    def propose(seq, n):
        B, L = seq.shape
        found = suffix_matches(seq, n, max_ngram, min_ngram)  # [B, L]
        weight = jnp.where(found, 1.0 + _TIE * jnp.arange(L)[None] / n[:, None], 0.0)
        same = seq[:, :, None] == seq[:, None, :]  # [B, L, L]
        total = jnp.where(found, jnp.einsum("bcd,bd->bc", same.astype(jnp.float32), weight), -1.0)
        best = jnp.max(total, axis=1, keepdims=True)
        tok = jnp.min(jnp.where(found & (total == best), seq, jnp.iinfo(jnp.int32).max), axis=1)  # ties: lowest id
        pos = jnp.arange(L)[None]
        src = jnp.max(jnp.where(found & (seq == tok[:, None]), pos, -1), axis=1)  # its latest source
        at = src[:, None] + jnp.arange(gamma)[None]
        draft = jnp.take_along_axis(seq, jnp.clip(at, 0, L - 1), axis=1)
        return draft, (src[:, None] >= 0) & (at < n[:, None])
    return propose


@struct.dataclass
class NgramDrafter(Drafter):
    """Prompt-lookup drafting (see the module docstring); any static plan: a chain copies one match, a tree one
    match per branch."""

    max_ngram: int = struct.field(pytree_node=False, default=3)
    min_ngram: int = struct.field(pytree_node=False, default=1)
    depths: tuple | None = struct.field(pytree_node=False, default=None)  # deepest draft after a g-token match,
    # g = 1 .. max_ngram (None: the plan's depth)

    def check(self, target) -> None:
        if not 1 <= self.min_ngram <= self.max_ngram <= 64:
            raise ValueError(f"prompt lookup needs 1 <= min_ngram <= max_ngram <= 64, got min_ngram="
                             f"{self.min_ngram}, max_ngram={self.max_ngram}")
        if self.depths is not None and (len(self.depths) != self.max_ngram or
                                        any(not isinstance(d, (int, np.integer)) or d < 1 for d in self.depths)):
            raise ValueError(f"prompt lookup depths needs one positive draft depth per match length 1 .. "
                             f"max_ngram={self.max_ngram}, got {self.depths!r}")

    def map_models(self, fn) -> "NgramDrafter":
        return self

    def prepare(self, setup: Setup) -> Prepared:
        if setup.inputs:
            raise ValueError("prompt lookup copies from the token text; the prompt has "
                             f"{sorted(setup.inputs)} inputs it cannot read (use a draft model)")
        return Prepared(self, (setup.tokens, setup.lengths), int(np.max(setup.lengths)), setup.tokens.shape[1])

    def init(self, env: DraftEnv, prefill: TargetPrefill, prompt, max_len: int) -> NgramState:
        tokens, lengths = prompt
        B = tokens.shape[0]
        hist, n = start_text(tokens, lengths, max_len)
        return NgramState(hist, n, jnp.zeros((B, max_len + 1), bool),
                          jnp.full((B, max(env.needs.scratch, 1)), -1, jnp.int32), jnp.zeros((B,), jnp.int32))

    def _vocab(self, env: DraftEnv) -> int:
        return env.target.vocab_size

    def root(self, env: DraftEnv, st: NgramState):
        seq, n = with_last(st.hist, st.n, env.last)
        B, L = seq.shape
        found, g = suffix_matches(seq, n, self.max_ngram, self.min_ngram, with_length=True)
        cap = jnp.asarray((0,) + tuple(self.depths or (1 << 20,) * self.max_ngram), jnp.int32)[g]
        weight = jnp.where(found, 1.0 + _TIE * jnp.arange(L)[None] / n[:, None], 0.0)
        counts = jnp.zeros((B, self._vocab(env)), jnp.float32).at[jnp.arange(B)[:, None], seq].add(weight)
        logp = jnp.where(counts > 0, jnp.log(counts / jnp.maximum(counts.sum(-1, keepdims=True), 1e-30)), -jnp.inf)
        return logp[:, None], None, st.replace(roots=found, cap=cap)

    def level(self, env: DraftEnv, st: NgramState, tokens, depth, mask, offset: int, run):
        seq, n = with_last(st.hist, st.n, env.last)
        B, K = tokens.shape
        L = seq.shape[1]
        # the parent's scratch slot: the node's nearest ancestor before the level (-1: the root)
        slot = jnp.arange(mask.shape[-1])[None, None, :]
        parent = jnp.max(jnp.where(mask.astype(bool) & (slot < offset), slot, -1), axis=-1, initial=-1)
        from_root = jnp.max(jnp.where(st.roots[:, None, :] & (seq[:, None, :] == tokens[:, :, None]),
                                      jnp.arange(L)[None, None], -1), axis=-1)  # the most recent source
        up = jnp.take_along_axis(st.src, jnp.maximum(parent, 0), axis=1) + 1
        up_ok = (up >= 1) & (up < n[:, None]) & (jnp.take_along_axis(seq, jnp.clip(up, 0, L - 1), axis=1) == tokens)
        src = jnp.where(parent < 0, from_root, jnp.where(up_ok, up, -1))
        st = st.replace(src=jax.lax.dynamic_update_slice(st.src, src.astype(jnp.int32), (0, offset)))
        nxt = src + 1
        ok = (src >= 0) & (nxt < n[:, None]) & (depth + 1 <= st.cap[:, None])  # the children sit one deeper
        tok = jnp.take_along_axis(seq, jnp.clip(nxt, 0, L - 1), axis=1)
        logp = jnp.where(ok[..., None] & (jnp.arange(self._vocab(env))[None, None] == tok[..., None]), 0.0, -jnp.inf)
        return logp, None, st

    def commit(self, env: DraftEnv, st: NgramState, c: Catchup) -> NgramState:
        """Appends the step's root and its accepted drafts (the bonus is the next `last`)."""
        hist, n = append_accepted(st.hist, st.n, c)
        return st.replace(hist=hist, n=n)
