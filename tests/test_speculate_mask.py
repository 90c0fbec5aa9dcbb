"""`decode(speculate=mask)`: rows marked False draft nothing and take AR steps inside the same ragged batch; the
others decode as the strategy alone; a step where no row drafts verifies the root alone."""
import jax
import numpy as np
import pytest

import jspec
from tiny_pairs import PROMPTS, tiny_pair

MASK = np.array([True, False, True])


@pytest.fixture(scope="module")
def pair():
    return tiny_pair()


@pytest.mark.parametrize("make", [lambda d: jspec.Chain(d, gamma=3),
                                  lambda d: jspec.Tree(d, tree=[[0], [1], [0, 0], [1, 0]]),
                                  lambda d: jspec.DynamicTree(d, depth=3, top_k=2, total=5),
                                  lambda d: jspec.PromptLookup(max_ngram=2, gamma=3)],
                         ids=["chain", "tree", "dynamic", "lookup"])
def test_masked_rows_decode_as_ar_and_the_others_as_the_strategy(pair, make):
    target, draft = pair
    strategy = make(draft)
    ar = jspec.decode(target, PROMPTS, max_new_tokens=12, eos_token_id=())
    alone = jspec.decode(target, PROMPTS, strategy, max_new_tokens=12, eos_token_id=())
    out = jspec.decode(target, PROMPTS, strategy, max_new_tokens=12, eos_token_id=(), speculate=MASK)
    np.testing.assert_array_equal(out.tokens, ar.tokens)  # greedy SD is AR's tokens, masked or not
    np.testing.assert_array_equal(out.tokens, alone.tokens)
    assert (out.stats["drafted"][~MASK] == 0).all()  # the masked row offered the target nothing
    assert (out.stats["steps"][~MASK] == 12 - 1).all()  # one token per step after the prefill's: AR's steps
    np.testing.assert_array_equal(out.stats["drafted"][MASK], alone.stats["drafted"][MASK])
    np.testing.assert_array_equal(out.stats["steps"][MASK], alone.stats["steps"][MASK])


def test_no_row_speculating_is_ar_and_a_bad_mask_is_refused(pair):
    target, draft = pair
    ar = jspec.decode(target, PROMPTS, max_new_tokens=8, eos_token_id=())
    out = jspec.decode(target, PROMPTS, jspec.Chain(draft, gamma=3), max_new_tokens=8, eos_token_id=(),
                       speculate=np.zeros(3, bool))
    np.testing.assert_array_equal(out.tokens, ar.tokens)
    assert (out.stats["drafted"] == 0).all()
    for bad in (np.ones(2, bool), np.ones(3, np.int32), [[True, False, True]]):
        with pytest.raises(ValueError, match="speculate must be one bool per row"):
            jspec.decode(target, PROMPTS, jspec.Chain(draft, gamma=3), max_new_tokens=4, speculate=bad)


def test_a_step_where_no_row_drafts_verifies_one_token(pair):
    """The plan under a mask picks its verify width from the rows that draft: with every row masked the step's
    program runs the root-only width (a negative control: the unmasked plan verifies its whole chain)."""
    from jspec.parts.plans import StaticPlan
    from jspec.parts.protocols import Decision, Proposal

    plan = jspec.Chain(pair[1], gamma=3).parts().plan
    B = 3
    _, tree, _, _ = plan._tree(B, None)
    valid = np.zeros((B, plan.num_nodes), bool)
    valid[:, 0] = True
    prop = Proposal(np.zeros((B, plan.num_nodes), np.int32), valid, tree, None, None, None,
                    decision=Decision(depth=np.zeros(B, np.int32)))
    done = np.zeros(B, bool)
    sizes, pick = plan.with_skips().verify_size(prop, done)
    assert sizes[int(pick)] == 1
    assert isinstance(plan, StaticPlan) and not plan.trim
    sizes, pick = plan.verify_size(prop, done)
    assert sizes[int(pick)] > 1
