"""Prompt lookup (`jspec.PromptLookup`, `jspec.parts.drafters.ngram`): the drafts are the text's own continuations, the
target verifies only as deep as something was drafted, and decoding stays lossless (the conformance registry's
"prompt_lookup" entries prove greedy == AR, rows as if alone, exact sampling, a mesh and no recompilation)."""
from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pytest

import jspec
import ports
from jspec import api
from jspec.parts.drafters import DraftEnv
from jspec.parts.drafters.ngram import NgramDrafter, NgramState, reference_draft, suffix_matches
from tiny_pairs import PROMPTS, tiny_pair

V = 16


def _reference_matches(seq, n, max_ngram, min_ngram):
    """Positions c < n whose preceding g tokens equal the last g, for the largest g with any (plain Python)."""
    for g in range(max_ngram, min_ngram - 1, -1):
        if n <= g:
            continue
        tail = list(seq[n - g:n])
        found = [c for c in range(g, n) if list(seq[c - g:c]) == tail]
        if found:
            return found
    return []


def test_suffix_matches_equal_a_direct_search():
    rng = np.random.default_rng(0)
    for trial in range(40):
        L = 24
        seq = rng.integers(0, 3 if trial % 2 else 5, (4, L))
        n = rng.integers(1, L + 1, 4)
        got = np.asarray(suffix_matches(jnp.asarray(seq), jnp.asarray(n), 3, 1 + trial % 2))
        for b in range(4):
            want = _reference_matches(seq[b], n[b], 3, 1 + trial % 2)
            assert np.flatnonzero(got[b]).tolist() == want, (seq[b], n[b])


def _state(text, scratch=8, width=32):
    hist = np.zeros((1, width), np.int32)
    hist[0, :len(text)] = text
    return NgramState(jnp.asarray(hist), jnp.asarray([len(text)], jnp.int32), jnp.zeros((1, width + 1), bool),
                      jnp.full((1, scratch), -1, jnp.int32), jnp.zeros((1,), jnp.int32))


def _env(last):
    return DraftEnv(None, None, SimpleNamespace(vocab_size=V), None, jnp.asarray([last], jnp.int32))


def _chain(drafter, st, env, depth):
    """Greedy chain drafting through the drafter's own root and level calls: the tokens it proposes."""
    logp, _, st = drafter.root(env, st)
    out = []
    for d in range(depth):
        if not np.isfinite(np.asarray(logp)[0, 0]).any():
            break
        tok = int(np.argmax(np.asarray(logp)[0, 0]))
        out.append(tok)
        mask = jnp.asarray(np.tri(d + 1, dtype=bool)[None, d:d + 1])  # the node sees the chain above it
        logp, _, st = drafter.level(env, st, jnp.asarray([[tok]]), jnp.asarray([[d + 1]]), mask, d, None)
    return out


def test_a_chain_copies_the_matched_continuation_until_the_newest_token():
    # text 5 6 7 8 5 6 | last 7: the suffix (5 6 7) occurred at the start, so the draft copies 8 5 6 7 and stops
    # where the copy reaches the newest committed token
    drafter = NgramDrafter(max_ngram=3)
    assert _chain(drafter, _state([5, 6, 7, 8, 5, 6]), _env(7), 8) == [8, 5, 6, 7]
    # the longest suffix wins over more frequent short ones: "9" is followed by 1 twice, "2 9" by 3 once
    assert _chain(drafter, _state([9, 1, 9, 1, 2, 9, 3, 4, 2]), _env(9), 3) == [3, 4, 2]
    assert _chain(drafter, _state([1, 2, 3]), _env(4), 3) == []  # nothing to copy: no draft


def test_depths_stop_a_copy_at_the_depth_of_its_match_length():
    drafter = NgramDrafter(max_ngram=3, depths=(1, 2, 3))
    assert _chain(drafter, _state([5, 6, 7, 8, 5, 6]), _env(7), 8) == [8, 5, 6]  # a 3-token match: 3 drafts
    assert _chain(drafter, _state([4, 9, 1, 2, 3, 5, 6]), _env(4), 8) == [9]  # a 1-token match ("4"): 1 draft
    assert _chain(drafter, _state([2, 4, 9, 1, 2, 3, 5, 2]), _env(4), 8) == [9, 1]  # "2 4" matched: 2 drafts
    with pytest.raises(ValueError, match="depths"):
        jspec.PromptLookup(max_ngram=3, gamma=4, depths=(1, 2))
    with pytest.raises(ValueError, match="depths"):
        jspec.PromptLookup(max_ngram=2, gamma=4, depths=(1, 5))


def test_the_root_distribution_counts_continuations_and_a_tree_follows_each():
    drafter = NgramDrafter(max_ngram=2)
    # "1 2" was followed by 3 twice and by 4 once
    st = _state([1, 2, 3, 0, 1, 2, 4, 5, 1, 2, 3, 6, 1])
    logp, _, st = drafter.root(_env(2), st)
    p = np.exp(np.asarray(logp)[0, 0])
    assert set(np.flatnonzero(p > 0)) == {3, 4}
    w3, w4 = 2 + 1e-3 * (2 + 10) / 14, 1 + 1e-3 * 6 / 14  # counts, then positions (text of 14 with `last`)
    assert p[3] == pytest.approx(w3 / (w3 + w4), rel=1e-6) and p[4] == pytest.approx(w4 / (w3 + w4), rel=1e-5)
    # two branches: 3 continues with its latest source (6), 4 with 5
    logp, _, st = drafter.level(_env(2), st, jnp.asarray([[3, 4]]), jnp.asarray([[1, 1]]),
                                jnp.asarray([[[True, False], [False, True]]]), 0, None)
    assert np.argmax(np.asarray(logp)[0], -1).tolist() == [6, 5]
    assert np.isfinite(np.asarray(logp)[0]).sum(-1).tolist() == [1, 1]  # one-hot below the root


def test_commit_appends_the_root_and_the_accepted_drafts():
    target, _ = tiny_pair()
    text = np.asarray([3, 4, 5, 3, 4, 5, 3, 4], np.int32)
    s = api.start(target, text, jspec.PromptLookup(max_ngram=2, gamma=3), max_new_tokens=12, eos_token_id=())
    st = s.run()
    ds = st.aux.draft
    n = int(ds.n[0])
    gen = np.asarray(st.out)[0, :int(st.n_out[0])]
    # everything committed but the newest token, which is the next root
    np.testing.assert_array_equal(np.asarray(ds.hist)[0, :n], np.concatenate([text, gen])[:n])
    assert n == len(text) + len(gen) - 1


def test_nothing_drafted_costs_an_ar_width_verify():
    """A prompt whose text never repeats: nothing is drafted, and the target verifies the root alone (the smallest
    bucket), not the whole chain."""
    target, _ = tiny_pair()
    strat = jspec.PromptLookup(max_ngram=3, gamma=6, min_ngram=3)
    plan = strat.parts().plan
    assert plan.verify_buckets[0] == (0, 1)
    out = jspec.decode(target, np.arange(10, 30), strat, max_new_tokens=3, eos_token_id=())
    ar = jspec.decode(target, np.arange(10, 30), max_new_tokens=3, eos_token_id=())
    np.testing.assert_array_equal(out.tokens, ar.tokens)
    # no trigram ending in a generated token can have occurred before (the prompt's tokens are distinct, and its
    # last two only end it), so nothing is drafted and every step commits one token
    assert out.stats["drafted"][0] == 0
    assert (out.stats["accepted"][0, :out.stats["steps"][0]] == 1).all()
    # the proposal of a fresh state drafts nothing, so the plan picks width 1
    from jspec.parts.plans import Proposal
    tree = plan._tree(1, None)[1]
    prop = Proposal(jnp.zeros((1, plan.num_nodes), jnp.int32), jnp.zeros((1, plan.num_nodes), bool).at[:, 0].set(True),
                    tree, None, None, jnp.zeros((1, 4)))
    sizes, pick = plan.verify_size(prop, jnp.asarray([False]))
    assert sizes[int(pick)] == 1
    prop = prop._replace(valid=prop.valid.at[:, :4].set(True))  # the root and depths 1..3 drafted
    sizes, pick = plan.verify_size(prop, jnp.asarray([False]))
    assert plan.verify_buckets == ((0, 1), (2, 3), (6, 7))
    assert sizes[int(pick)] == 7  # depth 3 takes the next bucket, the deepest: root + 6 chain nodes


def cycling_target():
    """A target whose greedy text cycles through 11 -> 23 -> 35 -> 47 -> 59 -> 11 (a bigram model: its layers
    write nothing, its head maps each token's embedding to the next token's logit), with slightly noisy rows so
    that its text is not a pure copy everywhere."""
    target, _ = tiny_pair()
    cycle = [11, 23, 35, 47, 59]
    nxt = np.arange(97)
    nxt[cycle] = cycle[1:] + cycle[:1]
    p = dict(target.params)
    p["layers"] = [dict(layer, wo=layer["wo"] * 0, w_down=layer["w_down"] * 0) for layer in p["layers"]]
    embed = np.asarray(p["embed"])
    head = np.zeros((embed.shape[1], 97), np.float32)
    head[:, nxt] = embed.T / np.sqrt(embed.shape[1])  # the logit of nxt[x] is x's embedding against itself
    head += 0.3 * np.random.default_rng(0).normal(size=head.shape).astype(np.float32) / np.sqrt(embed.shape[1])
    p["lm_head"] = jnp.asarray(head)
    return ports.Model(target.config, p, target.hf_config)


@pytest.mark.parametrize("depths", [None, (1, 2, 4)])
def test_every_step_accepts_what_the_copied_draft_predicts(depths):
    """The tokens committed per target step equal a plain-Python simulation of prompt lookup against the target's
    greedy text: each step drafts the reference's copy, accepts its longest prefix that AR agrees with, and adds
    the bonus. A drafter that copied from the wrong place, or a plan that lost drafts, changes the sequence."""
    target = cycling_target()
    rows = [np.asarray([11, 23, 35, 47, 59] * 3, np.int32), np.asarray([3, 11, 5, 23, 35, 7, 47, 59, 11], np.int32),
            np.asarray(PROMPTS[1].tolist() * 2, np.int32)]
    N, gamma = 24, 4
    ar = jspec.decode(target, rows, max_new_tokens=N, eos_token_id=())
    pld = jspec.decode(target, rows, jspec.PromptLookup(max_ngram=3, gamma=gamma, depths=depths),
                       max_new_tokens=N, eos_token_id=())
    np.testing.assert_array_equal(pld.tokens, ar.tokens)
    for b, prompt in enumerate(rows):
        gen = ar.tokens[b].tolist()
        done, want = 1, []  # the prefill committed the first token
        while done < N:
            draft = reference_draft(prompt.tolist() + gen[:done], 3, gamma, depths)[1]
            a = 0
            while a < len(draft) and done + a < N and draft[a] == gen[done + a]:
                a += 1
            step = min(a + 1, N - done)
            want.append(step)
            done += step
        got = pld.stats["accepted"][b, :pld.stats["steps"][b]].tolist()
        assert got == want, (b, got, want)
        assert max(want) >= (gamma + 1 if b < 2 else 1)  # rows 0 and 1 cycle: whole copies were accepted


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="min_ngram"):
        jspec.PromptLookup(max_ngram=2, min_ngram=3)
    with pytest.raises(ValueError, match="gamma"):
        jspec.PromptLookup(gamma=0)
    with pytest.raises(ValueError, match="branches"):
        jspec.PromptLookup(branches=0)
