"""`jspec.TokenDrafter`: a drafter from one function over the token text. A function that knows the answer (AR's
own continuation, every third token spoiled) has its drafts accepted up to the first wrong one under Chain and a
static tree, ragged batch, AR's tokens; a function returning the wrong shapes is a clear error. The five-line
copy-the-last-k drafter: the conformance registry (greedy == AR, exact sampling) and the README's example
(tests/test_docs_examples.py)."""
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from tiny_pairs import tiny_pair

REPEATS = [[1, 4, 5, 4, 5, 4, 5, 4, 5], [2, 7, 2, 7, 2], [3, 3, 6, 3, 3, 6, 3, 3, 6, 3, 3]]


def oracle(rows, ar_tokens, width: int = 3):
    """propose: the true continuation (prompt + AR's tokens) at each row's length, every third position spoiled."""
    L = max(len(r) for r in rows) + ar_tokens.shape[1] + width
    full = np.zeros((len(rows), L), np.int32)
    for b, r in enumerate(rows):
        full[b, :len(r) + ar_tokens.shape[1]] = np.concatenate([r, ar_tokens[b]])
    spoil = (np.arange(L) % 3 == 2)[None]
    table = jnp.asarray(np.where(spoil, (full + 1) % 97, full))

    def propose(tokens, lengths):
        idx = jnp.clip(lengths[:, None] + jnp.arange(width)[None], 0, L - 1)
        return jnp.take_along_axis(table[: tokens.shape[0]], idx, axis=1), jnp.ones(idx.shape, bool)
    return propose


@pytest.mark.parametrize("plan", ["chain", "tree"])
def test_right_drafts_are_accepted_up_to_the_first_wrong_one(plan):
    target, _ = tiny_pair()
    ar = jspec.decode(target, REPEATS, max_new_tokens=20, eos_token_id=())
    drafter = jspec.TokenDrafter(oracle(REPEATS, ar.tokens))
    strategy = jspec.Chain(drafter, gamma=3) if plan == "chain" else jspec.Tree(drafter, tree=[[0], [1], [0, 0],
                                                                                              [0, 0, 0]])
    out = jspec.decode(target, REPEATS, strategy, max_new_tokens=20, eos_token_id=())
    np.testing.assert_array_equal(out.tokens, ar.tokens)
    acc = np.asarray(out.stats["accepted"])
    assert acc.max() == 3 and acc[acc > 0].mean() > 2.0  # 2 right drafts + the bonus, a wrong one every third


def test_a_proposal_of_the_wrong_shape_is_named():
    target, _ = tiny_pair()
    wrong = jspec.TokenDrafter(lambda tokens, lengths: (tokens[0, :2], jnp.ones((2,), bool)))
    with pytest.raises(ValueError, match=r"propose must return draft \[B, G\] and valid \[B, G\]"):
        jspec.decode(target, REPEATS, jspec.Chain(wrong, gamma=2), max_new_tokens=4)


def test_prompt_lookups_chain_written_as_a_token_drafter_drafts_what_prompt_lookup_does():
    """`ngram.lookup_proposal` through the adapter: the same tokens and the same accepted drafts at every step as
    `jspec.PromptLookup`'s chain (`NgramDrafter`), on repetitive ragged prompts where the copies pay."""
    from jspec.parts.drafters import ngram

    target, _ = tiny_pair()
    kw = dict(max_new_tokens=24, eos_token_id=())
    ours = jspec.decode(target, REPEATS, jspec.Chain(jspec.TokenDrafter(ngram.lookup_proposal(3, 4)), gamma=4), **kw)
    pld = jspec.decode(target, REPEATS, jspec.PromptLookup(gamma=4), **kw)
    np.testing.assert_array_equal(ours.tokens, pld.tokens)
    np.testing.assert_array_equal(np.asarray(ours.stats["accepted"]), np.asarray(pld.stats["accepted"]))
    assert np.asarray(pld.stats["accepted"]).max() > 1  # some copies were accepted, so the drafts were compared
