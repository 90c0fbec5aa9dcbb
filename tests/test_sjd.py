"""Speculative Jacobi decoding (jspec.SJD: SJD and MC-SJD): greedy equals AR on a ragged batch, as text and as an image
under CFG and the grammar; sampling is exact by enumeration for maximal and independent coupling and both window
initialisations, on text and under CFG with the image grammar, and a coupling that does not keep the new
distribution is rejected by the same check; maximal coupling is a coupling (keeps the old token with probability
sum min(p, q), draws p); it commits more tokens per step than independent drafting; rounds do not recompile."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from jspec import api
from jspec.core import rowkeys as RK
from jspec.parts.drafters import jacobi as J
from sampling_check import (CH_IMAGE_PREFIX, PROMPT, ROWS, check, close_pair, empirical, exact_joint, guided_joint,
                            joint_index, tiny_chameleon)
from tiny_pairs import PROMPTS, tiny_pair

N = 4  # tokens counted: the prefill's, then three decided by Jacobi rounds (window 3: two rounds or more)


@pytest.fixture(scope="module")
def pair():
    return tiny_pair()


@pytest.mark.parametrize("coupling", ["maximal", "independent"])
def test_greedy_equals_ar_on_a_ragged_batch(pair, coupling):
    target, _ = pair
    eos = int(jspec.decode(target, PROMPTS, max_new_tokens=17, eos_token_id=()).tokens[0, 5])
    ar = jspec.decode(target, PROMPTS, max_new_tokens=17, eos_token_id=(eos,))
    sd = jspec.decode(target, PROMPTS, strategy=jspec.SJD(window=4, coupling=coupling), max_new_tokens=17,
                      eos_token_id=(eos,))
    np.testing.assert_array_equal(sd.tokens, ar.tokens)
    np.testing.assert_array_equal(sd.lengths, ar.lengths)
    alone = jspec.decode(target, PROMPTS[1], strategy=jspec.SJD(window=4, coupling=coupling), max_new_tokens=17,
                         eos_token_id=(eos,))
    np.testing.assert_array_equal(alone.tokens[0], sd.tokens[1])


def test_rounds_do_not_recompile(pair):
    target, _ = pair
    jspec.decode(target, PROMPTS, strategy=jspec.SJD(window=4), max_new_tokens=17, temperature=1.0,
                 key=jax.random.key(0))
    n = api._decode_sd._cache_size(), api._prefill_sd._cache_size()
    rng = np.random.default_rng(0)
    for i in range(2):
        jspec.decode(target, [rng.integers(0, 97, len(p)) for p in PROMPTS], strategy=jspec.SJD(window=4),
                     max_new_tokens=17, temperature=1.0, key=jax.random.key(i + 1))
    assert (api._decode_sd._cache_size(), api._prefill_sd._cache_size()) == n


def test_maximal_coupling_keeps_the_old_token_as_often_as_possible_and_draws_p():
    """Per position: P(keep x) = sum_v min(p(v), q(v)) (the maximal coupling's overlap), and the new token ~ p."""
    rng = np.random.default_rng(0)
    G, V, B = 3, 5, 40000
    p = rng.dirichlet(np.ones(V), size=G).astype(np.float32)
    q = rng.dirichlet(np.ones(V), size=G).astype(np.float32)
    keys = RK.for_rows(jax.random.key(0), B)
    x = RK.categorical(RK.fold(keys, 9), jnp.log(jnp.broadcast_to(q, (B, G, V))))
    y = np.asarray(J.maximal_coupling(keys, jnp.broadcast_to(p, (B, G, V)), x, jnp.broadcast_to(q, (B, G, V)),
                                      jnp.ones((B, G), bool)))
    for g in range(G):
        freq = np.bincount(y[:, g], minlength=V) / B
        np.testing.assert_allclose(freq, p[g], atol=0.012)
        np.testing.assert_allclose((y[:, g] == np.asarray(x)[:, g]).mean(), np.minimum(p[g], q[g]).sum(), atol=0.012)


EXACT = [("maximal", "random"), ("maximal", "uniform"), ("independent", "random"),
         pytest.param("independent", "uniform", marks=pytest.mark.slow)]


@pytest.mark.parametrize("coupling,init", EXACT)
def test_sampling_is_exact_by_enumeration(coupling, init):
    """The first four tokens (three from Jacobi rounds, a window of 3) follow the target's enumerated joint at T 1."""
    target, _ = close_pair()
    counts, out = empirical(target, jspec.SJD(window=3, coupling=coupling, init=init), jax.random.key(0), n=N)
    first = out.stats["accepted"][:, 0]
    assert (first == 1).mean() > 0.05 and (first >= 3).mean() > 0.01, np.bincount(first)
    check(counts, exact_joint(target, N))


def test_sampling_is_exact_under_top_k_and_temperature():
    target, _ = close_pair()
    warpers = dict(temperature=0.8, top_k=4)
    counts, _ = empirical(target, jspec.SJD(window=3, init="uniform"), jax.random.key(2), n=N, **warpers)
    check(counts, exact_joint(target, N, **warpers))


def _residual_from_p(key, p, x, q, has_x):
    """A broken coupling: keeps x as maximal coupling does, but otherwise draws from p, not norm(max(0, p - q)):
    the new token no longer follows the p the rule is told it came from."""
    at = lambda d: jnp.take_along_axis(d, x[..., None], axis=-1)[..., 0]  # noqa: E731
    keep = has_x & (RK.uniform(RK.split(key, 2)[:, 0], x.shape[1:]) * at(q) <= at(p))
    return jnp.where(keep, x, RK.categorical(RK.split(key, 2)[:, 1], J._log(p))).astype(jnp.int32)


def test_a_coupling_that_does_not_draw_p_is_rejected(monkeypatch):
    """The negative control of the exactness check: the same decode with the broken coupling is refuted."""
    target, _ = close_pair()
    monkeypatch.setattr(J, "maximal_coupling", _residual_from_p)
    counts, _ = empirical(target, jspec.SJD(window=3, init="uniform"), jax.random.key(0), n=N, rows=2 * ROWS)
    check(counts, exact_joint(target, N), exact=False)


def test_maximal_coupling_commits_more_per_step_than_independent():
    """MC-SJD's point: on a target whose consecutive Jacobi iterates agree often, coupled drafts are kept and
    accepted more than fresh ones (same rows, same key)."""
    target, _ = close_pair()
    got = {}
    for coupling in ("maximal", "independent"):
        out = jspec.decode(target, np.tile(PROMPT, (400, 1)), strategy=jspec.SJD(window=4, coupling=coupling),
                           max_new_tokens=40, temperature=1.0, key=jax.random.key(1), eos_token_id=())
        got[coupling] = 40 / out.stats["steps"].mean()
    assert got["maximal"] > 1.05 * got["independent"], got


# ---------------------------------------------------------------- CFG + the image grammar (Lumina-mGPT's default)

def test_greedy_image_equals_ar_under_cfg():
    from test_imagegen import PREFIX, make_model, prompts

    target = make_model(0)
    ar = jspec.generate_image(target, prompts(), 3, 4, temperature=0.0, image_prefix_ids=PREFIX)
    for coupling in ("maximal", "independent"):
        sd = jspec.generate_image(target, prompts(), 3, 4, strategy=jspec.SJD(window=5, coupling=coupling),
                                  temperature=0.0, image_prefix_ids=PREFIX)
        np.testing.assert_array_equal(sd.tokens, ar.tokens)
        assert np.all(sd.stats["steps"] < ar.tokens.shape[1] - 1)  # forced grammar tokens are drafted and accepted


@pytest.mark.parametrize("coupling", ["maximal", pytest.param("independent", marks=pytest.mark.slow)])
def test_cfg_and_image_grammar_are_exact(coupling):
    """CFG 3 over a 2 x 2 grid (the forced end-of-row inside the counted tokens), T 1 with top-k 5: the window's
    random starts are drawn among the image codes the grammar allows, and the tokens follow the guided, constrained,
    warped target exactly."""
    target = tiny_chameleon()
    gram = jspec.images.grammar(target.config, 2, 2)
    cond = np.array([9, 12, 30, 11] + CH_IMAGE_PREFIX)
    seqs, p = guided_joint(target, cond, np.array(CH_IMAGE_PREFIX), 3.0, gram, N, top_k=5)
    cells = joint_index(seqs, N, target.vocab_size)
    out = jspec.decode(target, np.tile(cond, (ROWS, 1)), jspec.SJD(window=3, coupling=coupling), max_new_tokens=N,
                       temperature=1.0, top_k=5, key=jax.random.key(4), eos_token_id=(),
                       guidance=jspec.CFG(3.0, CH_IMAGE_PREFIX), constraint=gram)
    drawn = joint_index(out.tokens, N, target.vocab_size)
    assert np.isin(drawn, cells).all()  # every draw follows the grammar
    first = out.stats["accepted"][:, 0]
    assert (first >= 3).mean() > 0.01, np.bincount(first)
    check(np.bincount(np.searchsorted(cells, drawn), minlength=len(cells)), p)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="coupling"):
        jspec.SJD(coupling="optimal")
    with pytest.raises(ValueError, match="init"):
        jspec.SJD(init="zeros")
    with pytest.raises(ValueError, match="window"):
        jspec.SJD(window=0)
