"""Vision-token selection (SpecVLM Sec. 3.2 and its ablations): the two-stage selector against a plain numpy
transcription of the spec on random scores, its limits (top_p = 0: one stage-I token then the uniform stride; a
large top_p: the top-K by attention), exact budgets for every selector on ragged rows, and refusals."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.strategies import pruning as PR


def reference(a, ratio, top_p):
    """Spec 2.2 written out: stage I top-p on the attention mass capped at K, stage II floor(linspace) over the rest."""
    V = len(a)
    K = int(V * (1 - ratio) + 1e-6)
    order = np.argsort(-a, kind="stable")
    cs = np.cumsum(a[order])
    c = min(int(np.searchsorted(cs, top_p * cs[-1], side="left")) + 1, K)
    rest = np.setdiff1d(np.arange(V), order[:c])
    u = K - c
    picks = [rest[(i * (len(rest) - 1)) // (u - 1)] if u > 1 else rest[0] for i in range(u)]
    return np.sort(np.concatenate([order[:c], np.asarray(picks, int)])).astype(int)


SELECT = jax.jit(lambda a, n, ratio, top_p: PR.select(a, n, ratio, "specvlm", top_p))


def test_two_stage_selection_matches_the_spec():
    """Random scores of 20-400 tokens (ragged rows of one padded batch), ratios 0-0.95, top_p 0-0.9."""
    rng = np.random.default_rng(0)
    Vmax = 400
    for ratio in (0.0, 0.3, 0.6, 0.8, 0.9, 0.95):
        for trial in range(6):
            n = rng.integers(20, Vmax + 1, size=4)
            a = np.zeros((4, Vmax), np.float32)
            for b in range(4):
                a[b, :n[b]] = rng.dirichlet(np.full(n[b], rng.choice([0.05, 0.5, 5.0])))
            top_p = float(rng.choice([0.0, 0.1, 0.4, 0.5, 0.9]))
            m = np.asarray(SELECT(a, n, ratio, top_p))
            for b in range(4):
                want = reference(a[b, :n[b]], ratio, top_p)
                np.testing.assert_array_equal(np.flatnonzero(m[b]), want)
                assert len(want) == int(n[b] * (1 - ratio) + 1e-6)


def test_limits_of_top_p():
    rng = np.random.default_rng(0)
    a = rng.random(200).astype(np.float32)
    K = 20
    zero = PR.specvlm_keep(a, 0.9, top_p=0.0)
    top = int(np.argmax(a))
    assert top in zero and len(zero) == K
    rest = np.setdiff1d(np.arange(200), [top])
    np.testing.assert_array_equal(np.setdiff1d(zero, [top]), rest[(np.arange(K - 1) * (len(rest) - 1)) // (K - 2)])
    full = PR.specvlm_keep(a, 0.9, top_p=1.0)
    np.testing.assert_array_equal(full, np.sort(np.argsort(-a, kind="stable")[:K]))


@pytest.mark.parametrize("method", PR.SELECTORS)
def test_every_selector_keeps_its_budget_on_ragged_rows(method):
    V, ratio = 96, 0.75
    n = jnp.asarray([96, 50, 8])
    scores = jax.random.uniform(jax.random.key(1), (3, V))
    m = np.asarray(jax.jit(lambda s, n: PR.select(s, n, ratio, method, key=jax.random.key(2), frame_tokens=8))(
        scores, n))
    for b, nb in enumerate(np.asarray(n)):
        k = int(nb * (1 - ratio))
        assert not m[b, nb:].any()
        if method == "frames":
            kept = np.flatnonzero(m[b])
            frames = kept.reshape(-1, 8)
            assert len(kept) == (k // 8) * 8 and (frames // 8 == frames[:, :1] // 8).all()  # whole frames
        else:
            assert m[b].sum() == k, (b, m[b].sum(), k)
    if method in ("front", "end"):
        assert m[1, :12].all() if method == "front" else m[1, 38:50].all()
    idx = np.asarray(PR.keep_indices(jnp.asarray(m), 24))
    assert (idx[0] == np.flatnonzero(m[0])).all() and (idx[2, 2:] == -1).all()


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match=r"in \[0, 1\)"):
        PR.specvlm_keep(np.ones(10), 1.0)
    with pytest.raises(ValueError, match="unknown vision-token selector"):
        PR.select(jnp.ones((1, 4)), 4, 0.5, "tokens")
    with pytest.raises(ValueError, match="needs a key"):
        PR.select(jnp.ones((1, 4)), 4, 0.5, "random")
