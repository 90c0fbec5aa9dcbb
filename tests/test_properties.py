"""Property tests (hypothesis): random tree shapes, gammas, batch sizes, prompt lengths, EOS positions and token
budgets on the tiny pair. Greedy speculative decoding equals greedy AR; a row's tokens do not depend on the other
rows of its batch, greedy or sampled with one key per row; the same key gives the same sampled tokens.

The default suite runs a few derandomized examples per property (each example compiles its own programs); the
`slow` twins run many random ones (`pytest -m slow`).
"""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import jspec
from tiny_pairs import CFG, tiny_pair

V = CFG.vocab_size
FEW = dict(deadline=None, derandomize=True, database=None,
           suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
MANY = settings(max_examples=40, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


def twins(body, examples=2, **drawn):
    """`body`'s default-suite test (`examples` derandomized examples) and its `slow` twin (many random ones)."""
    few = settings(max_examples=examples, **FEW)
    return few(given(**drawn)(body)), pytest.mark.slow(MANY(given(**drawn)(body)))


@pytest.fixture(scope="module")
def pair():
    return tiny_pair()


@st.composite
def trees(draw, max_depth=4, max_nodes=10):
    """A valid draft tree as a path list: each new node hangs under an existing node (or the root) above
    `max_depth`, with the next free rank among its siblings."""
    paths, children = [], {(): 0}
    for _ in range(draw(st.integers(1, max_nodes))):
        parents = [p for p in children if len(p) < max_depth]
        parent = draw(st.sampled_from(parents))
        node = parent + (children[parent],)
        children[parent] += 1
        children[node] = 0
        paths.append(list(node))
    return paths


strategies_ = st.one_of(
    st.builds(lambda g: ("chain", g), st.integers(1, 6)),
    st.builds(lambda t: ("tree", t), trees()),
    st.builds(lambda d, k, extra: ("dynamic", (d, k, min(k + extra, k + (d - 1) * k * k))),  # within its pool
              st.integers(1, 4), st.integers(1, 4), st.integers(0, 6)),
)


def make(kind, arg, draft):
    if kind == "chain":
        return jspec.Chain(draft, gamma=arg)
    if kind == "tree":
        return jspec.Tree(draft, tree=arg)
    depth, top_k, total = arg
    return jspec.DynamicTree(draft, depth=depth, top_k=top_k, total=total)


batches = st.lists(st.lists(st.integers(0, V - 1), min_size=1, max_size=12), min_size=1, max_size=4)


def greedy_sd_equals_ar_and_rows_are_alone(pair, spec, prompts, max_new, eos_at, keep):
    target, draft = pair
    prompts = [np.asarray(p) for p in prompts]
    strat = make(*spec, draft)
    eos = ()
    if eos_at is not None:  # a token AR emits in row 0, so that row (at least) stops early
        first = jspec.decode(target, prompts, max_new_tokens=max_new, eos_token_id=())
        eos = (int(first.tokens[0, eos_at % max_new]),)
    ar = jspec.decode(target, prompts, max_new_tokens=max_new, eos_token_id=eos)
    sd = jspec.decode(target, prompts, strategy=strat, max_new_tokens=max_new, eos_token_id=eos)
    np.testing.assert_array_equal(sd.tokens, ar.tokens)
    np.testing.assert_array_equal(sd.lengths, ar.lengths)
    rows = sorted({k % len(prompts) for k in keep})  # a sub-batch: each row as it was beside the others
    sub = jspec.decode(target, [prompts[b] for b in rows], strategy=strat, max_new_tokens=max_new, eos_token_id=eos)
    np.testing.assert_array_equal(sub.tokens, sd.tokens[rows])


case = dict(spec=strategies_, prompts=batches, max_new=st.integers(1, 20), eos_at=st.none() | st.integers(0, 19),
            keep=st.lists(st.integers(0, 3), min_size=1, max_size=3))


test_greedy_sd_equals_ar_and_rows_are_alone, test_greedy_sd_equals_ar_and_rows_are_alone_many = twins(
    greedy_sd_equals_ar_and_rows_are_alone, examples=3, **case)


def same_key_same_tokens(pair, spec, prompts, seed, temperature):
    import jax

    target, draft = pair
    prompts = [np.asarray(p) for p in prompts]
    run = lambda k: jspec.decode(target, prompts, strategy=make(*spec, draft), max_new_tokens=12,  # noqa: E731
                                 temperature=temperature, key=jax.random.key(k), eos_token_id=())
    a, b = run(seed), run(seed)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.stats["accepted"], b.stats["accepted"])
    others = [run(seed + i).tokens for i in (1, 2, 3)]
    assert any(not np.array_equal(o, a.tokens) for o in others)  # the key is really used


def sampled_rows_are_alone(pair, spec, prompts, seed, temperature, keep):
    """With one key per row, a row's sampled tokens (and its accepted counts) are the same in a sub-batch."""
    import jax

    target, draft = pair
    prompts = [np.asarray(p) for p in prompts]
    keys = jax.random.split(jax.random.key(seed), len(prompts))
    run = lambda ps, ks: jspec.decode(target, ps, strategy=make(*spec, draft), max_new_tokens=12,  # noqa: E731
                                      temperature=temperature, key=ks, eos_token_id=())
    full = run(prompts, keys)
    rows = sorted({k % len(prompts) for k in keep})
    sub = run([prompts[b] for b in rows], keys[np.asarray(rows)])
    np.testing.assert_array_equal(sub.tokens, full.tokens[rows])
    steps = min(sub.stats["accepted"].shape[1], full.stats["accepted"].shape[1])
    np.testing.assert_array_equal(sub.stats["accepted"][:, :steps], full.stats["accepted"][rows, :steps])


sampled = dict(spec=strategies_, prompts=batches, seed=st.integers(0, 2 ** 20), temperature=st.floats(0.5, 2.0))

test_same_key_same_tokens, test_same_key_same_tokens_many = twins(same_key_same_tokens, **sampled)


rows_case = dict(sampled, keep=st.lists(st.integers(0, 3), min_size=1, max_size=3))

test_sampled_rows_are_alone, test_sampled_rows_are_alone_many = twins(sampled_rows_are_alone, **rows_case)
