"""LANTERN / LANTERN++ as strategies of `jspec.generate_image` and `jspec.decode`: greedy == AR, the relaxation
raises acceptance and keeps the grammar, the dynamic-tree and separate-draft variants, presets and clear errors.
The rules themselves are proven in tests/test_lantern_rules.py, the EAGLE head in tests/test_eagle.py."""
import jax
import numpy as np
import pytest

import jspec
from jspec import images as IG
from jspec.parts.drafters import eagle as EG
from jspec.parts.neighbours import NeighbourTable
from ports.families import vqgan as VQ
from test_imagegen import COLS, PREFIX, ROWS, check_grammar, make_model, prompts


def flat_model(seed, std=0.1):
    """`make_model`'s tiny Chameleon with smaller weights: image-token distributions spread over several codes,
    as visual AR models' are (a peaked target leaves the relaxation nothing to accept)."""
    import ports
    from ports.families import chameleon as CH

    m = make_model(seed)
    return IG._generating(ports.Model(m.config, CH.init_params(m.config, jax.random.key(seed), std=std),
                                      m.hf_config))


@pytest.fixture(scope="module")
def setup():
    target = flat_model(0)
    head = EG.init_head(target, jax.random.key(4), noise=0.3)
    table = NeighbourTable.for_chameleon(target.config, VQ.codebook(target.params["vqmodel"]), 3)
    return target, head, table


def _gen(target, strategy, key=0, temperature=1.0, n=4):
    rows = (prompts() * n)[:n]
    return jspec.generate_image(target, rows, ROWS, COLS, strategy=strategy, key=jax.random.key(key),
                                temperature=temperature, top_k=None, image_prefix_ids=PREFIX)


def test_greedy_equals_ar(setup):
    target, head, table = setup
    ar = _gen(target, None, temperature=0.0)
    for s in (jspec.LanternPP(head, table, k=3, lam=5.0), jspec.Lantern(head, table, k=3, delta=0.5, tree="dynamic")):
        np.testing.assert_array_equal(_gen(target, s, temperature=0.0).tokens, ar.tokens)


def test_relaxation_accepts_more_and_keeps_the_grammar(setup):
    """Over the same keys, lambda = 4 accepts more drafts per step than lambda = 1 (the exact rule), and every
    sample still follows the image grammar; a separate Chameleon draft takes the rule too."""
    target, head, table = setup
    acc = {}
    for lam in (1.0, 4.0):
        outs = [_gen(target, jspec.LanternPP(head, table, k=3, lam=lam, tree="mc_sim_7b_63"), key=s, n=8)
                for s in range(3)]
        for o in outs:
            check_grammar(o.tokens)
        acc[lam] = np.mean([np.nanmean(o.stats["mean_accepted"]) for o in outs])
    assert acc[4.0] > acc[1.0] + 0.05, acc
    draft = IG._generating(make_model(1, layers=1, hidden=16))
    out = _gen(target, jspec.LanternPP(draft, table, k=3, lam=3.0, tree=[[0], [1], [0, 0]]))
    check_grammar(out.tokens)


def test_new_lambda_does_not_recompile(setup):
    target, head, table = setup
    from jspec import api

    _gen(target, jspec.LanternPP(head, table, k=3, lam=2.0, tree=[[0], [0, 0]]))
    n = api._decode_sd._cache_size(), api._prefill_sd._cache_size()
    _gen(target, jspec.LanternPP(head, table, k=2, lam=3.5, tree=[[0], [0, 0]]), key=1)
    _gen(target, jspec.LanternPP(head, table, k=0, lam=1.0, tree=[[0], [0, 0]]), key=2)
    assert (api._decode_sd._cache_size(), api._prefill_sd._cache_size()) == n


def test_presets_and_errors(setup):
    target, head, table = setup
    p = jspec.strategies.lantern.lumina_preset("lumina-mgpt-7b-768")
    assert (p["k"], p["lam"], p["tree"], p["cfg_scale"], p["top_k"]) == (10, 3.0, "naive_extend_57", 3.0, 2000)
    with pytest.raises(ValueError, match="no LANTERN\\+\\+ preset"):
        jspec.strategies.lantern.lumina_preset("llama-2-7b")
    bad = [(jspec.LanternPP(head, table, lam=0.5, k=2), "lam must be >= 1"),
           (jspec.Lantern(head, table, delta=-0.1, k=2), "delta must be >= 0"),
           (jspec.LanternPP(head, table, k=4), "k=4 neighbours but the table holds 3"),
           (jspec.LanternPP(head, None, k=2), "needs table="),
           (jspec.LanternPP(head, table, k=2, residual="nope"), "unknown residual mode")]
    for strat, msg in bad:
        with pytest.raises(ValueError, match=msg):
            _gen(target, strat, n=1)
    other = NeighbourTable.from_codebook(np.eye(6, dtype=np.float32), 2, np.arange(6) + 10, 60)
    with pytest.raises(ValueError, match="vocabulary of 60 tokens"):
        _gen(target, jspec.LanternPP(head, other, k=2), n=1)
    with pytest.raises(ValueError, match="draft must be"):
        jspec.LanternPP("not a drafter", table).parts()
