"""DDTree (Ringel et al., arXiv 2604.12989) over a block drafter, in a decode: every round verifies the `total`
best paths as one tree, not the argmax chain. Which paths it keeps is tests/test_dflash.py's
(`test_best_paths_are_the_most_probable_ones`); greedy == AR and exact sampling are the conformance suite's."""
import numpy as np

import jspec
from strategies import dflash_head
from tiny_pairs import PROMPTS, tiny_pair


def test_every_round_verifies_total_nodes_and_the_tree_takes_fewer_rounds_than_the_chain():
    target, _ = tiny_pair()
    head = dflash_head(target)  # block 5: four draft positions
    ar = jspec.decode(target, PROMPTS, max_new_tokens=16, eos_token_id=())
    chain = jspec.decode(target, PROMPTS, jspec.DFlash(head), max_new_tokens=16, eos_token_id=())
    tree = jspec.decode(target, PROMPTS, jspec.DFlash(head, tree="ddtree", top_k=3, total=8), max_new_tokens=16,
                        eos_token_id=())
    np.testing.assert_array_equal(tree.tokens, ar.tokens)
    steps = lambda out: (np.asarray(out.stats["accepted"]) > 0).sum(axis=1)  # noqa: E731
    # 3 candidates at each of 4 positions give 3 + 8 + 8 + 8 nodes to choose from: a full tree of 8 every round
    np.testing.assert_array_equal(tree.stats["drafted"], 8 * steps(tree))
    np.testing.assert_array_equal(chain.stats["drafted"], 4 * steps(chain))
    # the same tokens in fewer target forwards: some round accepted a path off the argmax chain
    assert steps(tree).sum() < steps(chain).sum(), (steps(tree), steps(chain))
