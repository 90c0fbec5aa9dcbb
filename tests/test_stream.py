"""jspec.stream: the decode loop in chunks of target steps; each row's pieces concatenate to jspec.decode's tokens
(AR, Chain, Tree; greedy and sampled; a ragged batch with a row stopping at EOS), one compiled program serves every
chunk, and bad arguments are refused."""
import jax
import numpy as np
import pytest

import jspec
from jspec import streaming as ST
from tiny_pairs import PROMPTS, tiny_pair


@pytest.fixture(scope="module")
def pair():
    return tiny_pair()


def _joined(pieces, B):
    return [np.concatenate([p[b] for p in pieces]) for b in range(B)]


@pytest.mark.parametrize("name", ["ar", "chain", "tree"])
def test_streamed_pieces_are_decodes_tokens(pair, name):
    target, draft = pair
    strat = {"ar": None, "chain": jspec.Chain(draft, gamma=3),
             "tree": jspec.Tree(draft, tree=[[0], [1], [0, 0], [1, 0], [0, 0, 0]])}[name]
    eos = int(jspec.decode(target, PROMPTS, max_new_tokens=17, eos_token_id=()).tokens[0, 5])  # stops row 0 early
    fn = ST._chunk_ar if strat is None else ST._chunk_sd
    for kw in (dict(), dict(temperature=1.0, key=jax.random.key(3))):
        want = jspec.decode(target, PROMPTS, strategy=strat, max_new_tokens=17, eos_token_id=(eos,), **kw)
        s = jspec.stream(target, PROMPTS, strat, max_new_tokens=17, every=2, eos_token_id=(eos,), **kw)
        before = fn._cache_size()
        pieces = list(s)
        assert fn._cache_size() <= before + 1  # one program for every chunk (none new once compiled)
        got = _joined(pieces, len(PROMPTS))
        for b in range(len(PROMPTS)):
            np.testing.assert_array_equal(got[b], want.tokens[b, :want.lengths[b]])
        assert [len(p) for p in pieces[0]] == [1] * len(PROMPTS)  # the prefill's token first
        assert s.chunks == len(pieces) - 1 and s.chunks >= int(want.stats["steps"].max()) // 2
        np.testing.assert_array_equal(s.output.tokens, want.tokens)
        with pytest.raises(RuntimeError, match="runs its decode once"):
            list(s)
        np.testing.assert_array_equal(s.output.stats["accepted"], want.stats["accepted"])
        if not kw:
            assert want.lengths[0] == 6 and len(got[0]) == 6  # the EOS row stopped; the others went on
        n = fn._cache_size()
        list(jspec.stream(target, PROMPTS, strat, max_new_tokens=17, every=3, eos_token_id=(eos,), **kw))
        assert fn._cache_size() == n  # another chunk size: the same program


def test_bad_arguments(pair):
    target, _ = pair
    with pytest.raises(ValueError, match="every must be"):
        jspec.stream(target, PROMPTS, every=0)
    with pytest.raises(ValueError, match="does not profile"):
        jspec.stream(target, PROMPTS, profile=True)
    with pytest.raises(ValueError, match="max_new_tokens"):
        jspec.stream(target, PROMPTS, max_new_tokens=0)
