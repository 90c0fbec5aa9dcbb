"""LANTERN / LANTERN++ (jspec.parts.neighbours, jspec.parts.rules.LanternRule / LanternPP): the latent-neighbour table against a
brute force, the relaxed acceptance probability against its closed form, q~ <= lambda r, the residual modes against
numpy references of the spec and of the official code, exactness at lambda = 1 / delta = 0 (static and dynamic
trees; under CFG + the image grammar in `-m slow`) with a lambda = 3 negative control, greedy == AR, one compiled
program whatever lambda, and clear errors."""
import dataclasses

import jax
import numpy as np
import jax.numpy as jnp
import pytest

import jspec
from jspec.parts import rules as Vf
from jspec.parts.neighbours import NeighbourTable, codebook_fingerprint, neighbour_codes
from jspec.engine.strategy import split
from jspec.parts.trees import build_tree, chain, device_tree
from sampling_check import CH_IMAGE_PREFIX, V as TV, exactness, guided_joint, tiny_chameleon, tiny_chameleon_config, tiny_vocab_pair

SMALL_TREE = [[0], [1], [0, 0], [1, 0]]


# ------------------------------------------------------------------------------------------------ neighbour table


def brute_neighbours(cb: np.ndarray, k: int, metric: str) -> np.ndarray:
    cb = cb.astype(np.float64)
    if metric == "l2":
        d = np.sqrt(((cb[:, None] - cb[None]) ** 2).sum(-1))
    else:
        u = cb / np.linalg.norm(cb, axis=1, keepdims=True)
        d = 1.0 - u @ u.T
    np.fill_diagonal(d, np.inf)
    return np.argsort(d, axis=1, kind="stable")[:, :k]  # stable: ties to the lower index


@pytest.mark.parametrize("metric", ["l2", "cosine"])
def test_neighbour_codes_equal_brute_force(metric):
    cb = np.random.default_rng(0).normal(size=(300, 8)).astype(np.float32)
    nb = neighbour_codes(cb, 9, metric, block=64)  # 5 blocks, the last one partial
    assert nb.shape == (300, 9) and nb.dtype == np.int32
    np.testing.assert_array_equal(nb, brute_neighbours(cb, 9, metric))
    assert not np.any(nb == np.arange(300)[:, None])  # self never appears


def test_neighbour_ties_go_to_the_lower_index():
    """Small integer codes: many exactly equal distances (and duplicate codes, at distance 0)."""
    cb = np.random.default_rng(1).integers(0, 3, (70, 2)).astype(np.float32)
    nb = neighbour_codes(cb, 12, "l2", block=32)
    np.testing.assert_array_equal(nb, brute_neighbours(cb, 12, "l2"))
    assert not np.any(nb == np.arange(70)[:, None])


def test_chameleon_table_puts_neighbours_at_token_ids(tmp_path):
    from ports.families import chameleon as CH

    rng = np.random.default_rng(2)
    K, img0 = 40, 60
    cfg = CH.config_from_hf(tiny_chameleon_config(V=128, img0=img0, K=K))
    # shuffle the code -> token map so that a table indexed by code instead of token id would show
    perm = rng.permutation(K)
    cfg = dataclasses.replace(cfg, image_token_ids=tuple(int(img0 + p) for p in perm))
    cb = rng.normal(size=(K, 5)).astype(np.float32)
    table = NeighbourTable.for_chameleon(cfg, cb, 4, block=16)
    ids = np.asarray(table.ids)
    assert ids.shape == (128, 4) and table.kmax == 4 and table.num_codes == K and table.metric == "l2"
    ref = brute_neighbours(cb, 4, "l2")
    tok = np.asarray(cfg.image_token_ids)
    for c in range(K):
        np.testing.assert_array_equal(ids[tok[c]], tok[ref[c]])
        np.testing.assert_array_equal(np.asarray(CH.bpe_to_codes(cfg, ids[tok[c]])), ref[c])
    image = np.asarray(CH.image_logit_mask(cfg))
    assert np.all(ids[~image] == -1) and np.all(ids[image] >= 0)
    # save / load beside a drafter, then the checks against vocabulary and codebook
    path = str(tmp_path / "neighbours.npz")
    table.save(path)
    back = NeighbourTable.load(path, vocab_size=128, codebook=cb)
    np.testing.assert_array_equal(np.asarray(back.ids), ids)
    assert (back.num_codes, back.kmax, back.metric, back.fingerprint) == (K, 4, "l2", table.fingerprint)
    table.check(128, cb.astype(np.float16).astype(np.float32))  # the same codebook in another float width
    with pytest.raises(ValueError, match="vocabulary of 128"):
        table.check(129)
    for other in (cb[::-1], rng.normal(size=cb.shape), cb + 1.0):  # row order, values
        with pytest.raises(ValueError, match="another codebook"):
            NeighbourTable.load(path, codebook=other)
        assert codebook_fingerprint(other) != table.fingerprint
    with pytest.raises(ValueError, match="another codebook"):
        table.check(128, cb[:-1])


def test_neighbour_errors():
    cb = np.zeros((10, 3), np.float32)
    for bad_k in (0, 10, -1):
        with pytest.raises(ValueError, match="k must be"):
            neighbour_codes(cb, bad_k)
    with pytest.raises(ValueError, match="2-D"):
        neighbour_codes(np.zeros(10), 2)
    with pytest.raises(ValueError, match="metric"):
        neighbour_codes(cb, 2, metric="l1")
    with pytest.raises(ValueError, match="one token id per code"):
        NeighbourTable.from_codebook(cb, 2, np.arange(9), 20)


# ------------------------------------------------------------------------------------------ rules: closed forms


def hand_table(V, image, nb_rows) -> NeighbourTable:
    """A table from explicit rows: nb_rows {token: [neighbour tokens]}, other image tokens padded, -1 elsewhere."""
    kmax = max(len(r) for r in nb_rows.values())
    ids = np.full((V, kmax), -1, np.int32)
    for t in image:
        others = [u for u in image if u != t][:kmax]
        ids[t] = nb_rows.get(t, others)
    return NeighbourTable(jnp.asarray(ids), len(image), kmax, "l2", 0.0)


# x = 3 with neighbours 5, 2, 7 of masses .05, .04, .2; r(x) = .1; the draft puts .5 on x
HAND_V = 8
HAND = hand_table(HAND_V, [2, 3, 4, 5, 6, 7], {3: [5, 2, 7]})
R_ROOT = np.array([.2, .1, .04, .1, .15, .05, .16, .2], np.float32)
Q_ROOT = np.array([.1, .05, .05, .5, .1, .05, .1, .05], np.float32)


@jax.jit
def _accepted(keys, rule, x):
    """A depth-1 tree with one child x: whether `verify.stochastic` accepts it, for each key (the rule is an
    argument: one program per rule class and draft mode)."""
    t = device_tree(build_tree(chain(1)), 1)
    tokens = jnp.stack([jnp.zeros((), jnp.int32), x])[None]
    p = jnp.stack([jnp.asarray(R_ROOT), jnp.full(HAND_V, 1.0 / HAND_V)])[None]
    q = jnp.stack([jnp.asarray(Q_ROOT), jnp.full(HAND_V, 1.0 / HAND_V)])[None]
    valid = jnp.ones((1, 2), bool)
    return jax.vmap(lambda key: Vf.stochastic(key[None], tokens, p, q, valid, t, 1, rule).accepted[0])(keys)


def acceptance_rate(rule, x=3, n=20000):
    return float(np.mean(np.asarray(_accepted(jax.random.split(jax.random.key(0), n), rule, jnp.int32(x))))), n


@pytest.mark.parametrize("rule, alpha", [
    (Vf.LanternPPRule(HAND, 3, 2.0), 0.38),  # bound .1: S = .05, .09, .29 -> m* = 2, q~ = .19
    (Vf.LanternPPRule(HAND, 3, 4.0), 0.78),  # bound .3: m* = 3, q~ = .39
    (Vf.LanternPPRule(HAND, 1, 4.0), 0.30),  # k = 1: q~ = .15
    (Vf.LanternPPRule(HAND, 3, 1.0), 0.20),  # lambda = 1: no relaxation
    (Vf.LanternRule(HAND, 3, 0.07), 0.30),  # delta .07: m* = 1
    (Vf.LanternPPRule(HAND, 3, 2.0, drafts="deterministic"), 0.19),  # q' = 1: min(1, q~)
    (Vf.LanternRule(HAND, 3, 0.1, drafts="deterministic"), 0.19),
])
def test_acceptance_probability_is_min_one_relaxed_over_draft(rule, alpha):
    rate, n = acceptance_rate(rule)
    assert abs(rate - alpha) < 5 * np.sqrt(alpha * (1 - alpha) / n) + 1e-9, (rate, alpha)


def test_non_image_tokens_are_never_relaxed():
    r = jnp.asarray(R_ROOT)[None]
    for x in (0, 1):  # rows of -1
        assert float(Vf.LanternPPRule(HAND, 3, 50.0).target_mass(r, jnp.array([x]))[0]) == pytest.approx(R_ROOT[x])


# ------------------------------------------------------------------------------- rules against numpy references


V_R, IMG_R, K_MAX = 40, np.arange(8, 40), 6


def random_table(rng) -> NeighbourTable:
    """A table of a random codebook over a random code -> token map; one fingerprint for all (the tests compile
    once: the fingerprint is static metadata)."""
    cb = rng.normal(size=(len(IMG_R), 3))
    return NeighbourTable.from_codebook(cb, K_MAX, rng.permutation(IMG_R), V_R).replace(fingerprint=0.0)


def dyadic(rng, shape, zeros=0.2):
    """Distributions with masses in multiples of 1 / 4096 (sums are exact in float32) and some exact zeros."""
    w = rng.integers(1, 50, shape) * (rng.random(shape) > zeros)
    w[..., 0] += 1
    out = np.zeros(shape)
    for idx in np.ndindex(shape[:-1]):
        c = np.floor(w[idx] / w[idx].sum() * 4096)
        c[np.argmax(c)] += 4096 - c.sum()
        out[idx] = c / 4096
    return out.astype(np.float32)


def np_relax(r, ids, x, k, bound):
    """(neighbours in the window, m*, q~(x)) per the spec, by a loop."""
    nb = []
    for t in ids[x][:k]:
        if t < 0:
            break
        nb.append(int(t))
    m, s = 0, 0.0
    for j, t in enumerate(nb):
        if s + r[t] <= bound:
            s += r[t]
            m = j + 1
        else:
            break
    return nb, m, r[x] + s


def np_norm(a, fallback):
    s = a.sum()
    return a / s if s > 1e-30 else fallback


def np_reject(mode, drafts, r, q, ids, x, k, bound):
    """The residual (and the draft distribution) after x is rejected: the spec's principled rule and the official
    code's modes, written from the code (r: target, q: draft, as in jspec)."""
    nb, m, qt = np_relax(r, ids, x, k, bound)
    full = [int(t) for t in ids[x][:k + 1] if t >= 0]  # nearest_latents[x, :lantern_k + 1]
    r0 = r.astype(np.float64)  # every mode falls back to the residual before the rejection (as `Residual`)
    r = r0.copy()
    q = q.astype(np.float64).copy()
    if drafts == "deterministic":
        r[x] = 0
        if mode == "principled":
            r[nb[:m]] = 0
        elif m >= 1:
            r[full] = 0
        return np_norm(r, r0), q
    new_q = q.copy()
    new_q[x] = 0
    new_q = np_norm(new_q, q)
    if mode == "principled":
        r[nb[:m]] = 0
        r[x] = qt
    elif mode == "lumina_code" and m >= 1:
        r[full] = 0
    elif mode == "llamagen_code" and m >= 1:
        q[full] = 0
    return np_norm(np.maximum(r - q, 0), r0), new_q


def make_rule(cls, table, k, b, mode="principled", drafts="sampled"):
    return cls(table, k, b, residual=mode, drafts=drafts)


@pytest.fixture(scope="module")
def batched():
    """jit'd (relax, reject) of a rule over a batch; compiled once per rule class and mode (k, bound are data).
    Each class gets its own jitted function: JAX's treedefs of two dataclasses with equal fields compare equal
    (Lantern and LanternPP), so one jit cache could hand a Lantern call LanternPP's program."""
    fns = {}

    def per_class(name, fn):
        def call(rule, *args):
            key = (name, type(rule))
            if key not in fns:
                fns[key] = jax.jit(fn)
            return fns[key](rule, *args)
        return call

    return (per_class("relax", lambda rule, r, x: rule.relax(r, x)[2:]),
            per_class("reject", lambda rule, r, q, x: rule.reject(r, q, x)))


def test_relaxed_mass_bounds_and_m_star_match_the_spec(batched):
    """q~(x) in [r(x), lambda r(x)] (LANTERN++), q~(x) - r(x) <= delta (LANTERN), m* and q~ equal to a loop."""
    relax, _ = batched
    rng = np.random.default_rng(3)
    for trial in range(30):
        table = random_table(rng)
        ids = np.asarray(table.ids)
        r = dyadic(rng, (16, V_R)) if trial % 2 else rng.dirichlet(np.full(V_R, 0.3), 16).astype(np.float32)
        x = rng.integers(0, V_R, 16)
        k = int(rng.integers(0, K_MAX + 1))
        lam = float(rng.choice([1.0, 1.5, 2.0, 3.0, 10.0])) if trial % 2 else float(rng.uniform(1, 20))
        delta = float(rng.choice([0.0, 1 / 64, 1 / 16, 0.25]))
        m, qt = map(np.asarray, relax(Vf.LanternPPRule(table, k, lam), jnp.asarray(r), jnp.asarray(x)))
        rx = r[np.arange(16), x]
        assert np.all(qt >= rx) and np.all(qt <= lam * rx * (1 + 1e-6) + 1e-12)
        for b in range(16):
            _, m_ref, qt_ref = np_relax(r[b], ids, x[b], k, (lam - 1) * rx[b])
            if trial % 2:  # dyadic masses: every sum and comparison is exact
                assert m[b] == m_ref and qt[b] == np.float32(qt_ref)
            else:
                assert abs(qt[b] - qt_ref) < 1e-6
        m, qt = map(np.asarray, relax(Vf.LanternRule(table, k, delta), jnp.asarray(r), jnp.asarray(x)))
        assert np.all(qt >= rx) and np.all(qt - rx <= delta + 1e-7)
        if trial % 2:
            for b in range(16):
                _, m_ref, qt_ref = np_relax(r[b], ids, x[b], k, delta)
                assert m[b] == m_ref and qt[b] == np.float32(qt_ref)


@pytest.mark.parametrize("mode", Vf.RESIDUAL_MODES)
@pytest.mark.parametrize("drafts", Vf.DRAFT_MODES)
def test_residual_modes_equal_numpy_references(batched, mode, drafts):
    _, reject = batched
    rng = np.random.default_rng(4)
    for trial in range(6):
        table = random_table(rng)
        ids = np.asarray(table.ids)
        r, q = dyadic(rng, (12, V_R)), dyadic(rng, (12, V_R), zeros=0.0)
        x = np.where(np.arange(12) < 10, rng.choice(IMG_R, 12), rng.integers(0, 8, 12))  # 2 non-image rows
        k = int(rng.integers(1, K_MAX))  # code modes zero k + 1 <= kmax neighbours
        lam = float(rng.choice([1.5, 2.0, 3.0, 8.0]))
        new_r, new_q = map(np.asarray, reject(make_rule(Vf.LanternPPRule, table, k, lam, mode, drafts),
                                              jnp.asarray(r), jnp.asarray(q), jnp.asarray(x)))
        for b in range(12):
            ref_r, ref_q = np_reject(mode, drafts, r[b], q[b], ids, x[b], k, (lam - 1) * r[b, x[b]])
            np.testing.assert_allclose(new_r[b], ref_r, atol=2e-6)
            np.testing.assert_allclose(new_q[b], ref_q, atol=2e-6)


def test_principled_residual_is_the_residual_of_the_relaxed_target(batched):
    """Where x can be rejected (q~(x) < q'(x)): norm(max(q~ - q', 0)) with q~ the target with A's mass moved onto
    x, which is also norm(max(r - q', 0)) after zeroing r on A - {x}."""
    _, reject = batched
    rng = np.random.default_rng(5)
    table = random_table(rng)
    ids = np.asarray(table.ids)
    r = rng.dirichlet(np.full(V_R, 0.5), 64).astype(np.float32)
    x = rng.choice(IMG_R, 64)
    q = rng.dirichlet(np.full(V_R, 0.5), 64).astype(np.float32)
    q[np.arange(64), x] += 3.0  # the draft is sure of x: q~(x) < q'(x)
    q /= q.sum(1, keepdims=True)
    new_r = np.asarray(reject(Vf.LanternPPRule(table, 4, 3.0), jnp.asarray(r), jnp.asarray(q), jnp.asarray(x))[0])
    for b in range(64):
        nb, m, qt = np_relax(r[b], ids, x[b], 4, 2.0 * r[b, x[b]])
        assert qt < q[b, x[b]]
        tilde = r[b].astype(np.float64).copy()
        tilde[nb[:m]] = 0
        tilde[x[b]] = qt
        np.testing.assert_allclose(tilde.sum(), 1.0, atol=1e-6)  # q~ is a distribution
        np.testing.assert_allclose(new_r[b], np_norm(np.maximum(tilde - q[b], 0), None), atol=2e-6)
        zeroed = r[b].astype(np.float64).copy()
        zeroed[nb[:m]] = 0
        np.testing.assert_allclose(new_r[b], np_norm(np.maximum(zeroed - q[b], 0), None), atol=2e-6)
    assert np.mean([np_relax(r[b], ids, x[b], 4, 2.0 * r[b, x[b]])[1] for b in range(64)]) > 0.5  # relaxed


def test_modes_agree_with_the_exact_rules_when_nothing_is_relaxed():
    """m* = 0 (lambda = 1, delta = 0 or k = 0 on a target with no zero mass): every mode is `Residual` (sampled
    drafts) or `Q1` (deterministic drafts), bit for bit."""
    rng = np.random.default_rng(6)
    table = random_table(rng)
    r = jnp.asarray(rng.dirichlet(np.full(V_R, 0.5), 32).astype(np.float32))
    q = jnp.asarray(rng.dirichlet(np.full(V_R, 0.5), 32).astype(np.float32))
    x = jnp.asarray(rng.choice(IMG_R, 32))
    rules = [Vf.LanternPPRule(table, 4, 1.0), Vf.LanternRule(table, 4, 0.0), Vf.LanternPPRule(table, 0, 5.0)]
    for base in rules:
        for mode in Vf.RESIDUAL_MODES:
            for drafts, exact in (("sampled", Vf.Residual()), ("deterministic", Vf.Q1())):
                rule = base.replace(residual=mode, drafts=drafts)
                assert np.all(np.asarray(rule.relax(r, x)[2]) == 0)
                np.testing.assert_array_equal(rule.target_mass(r, x), exact.target_mass(r, x))
                np.testing.assert_array_equal(rule.draft_mass(q, x), exact.draft_mass(q, x))
                for a, b in zip(rule.reject(r, q, x), exact.reject(r, q, x)):
                    np.testing.assert_array_equal(a, b)


def test_new_bounds_do_not_recompile(models):
    table = random_table(np.random.default_rng(7))
    traces = []

    @jax.jit
    def mass(rule, r, x):
        traces.append(1)
        return rule.target_mass(r, x)

    r = jnp.full((2, V_R), 1.0 / V_R)
    x = jnp.array([8, 9])
    outs = [mass(Vf.LanternPPRule(table, k, lam), r, x) for lam, k in ((1.0, 2), (3.0, 4), (2.5, 6))]
    assert len(traces) == 1
    assert float(outs[0][0]) < float(outs[1][0])
    tab2 = table.replace(ids=jnp.roll(table.ids, 1, axis=1))  # other ids, same codebook metadata: data too
    mass(Vf.LanternPPRule(tab2, 3, 2.0), r, x)
    assert len(traces) == 1
    # jspec's strategy split keeps lambda, k, delta and the ids as dynamic leaves: one static key
    _, draft = models
    tab = tiny_table()
    s1, _ = split(jspec.Tree(draft, tree=SMALL_TREE, rule=Vf.LanternPPRule(tab, 2, 1.0)).parts())
    s2, _ = split(jspec.Tree(draft, tree=SMALL_TREE, rule=Vf.LanternPPRule(tab, 1, 3.0)).parts())
    assert s1 == s2 and hash(s1) == hash(s2)
    s3, _ = split(jspec.Tree(draft, tree=SMALL_TREE, rule=Vf.LanternPPRule(tab, 1, 3.0, residual="lumina_code")).parts())
    assert s3 != s1


# ------------------------------------------------------------------------------------ decoding: exactness, greedy


def tiny_table(k=3) -> NeighbourTable:
    """Tokens 2..5 of the 6-token test vocabulary are image tokens (four codes); 0 and 1 are text."""
    cb = np.random.default_rng(1).normal(size=(4, 3))
    return NeighbourTable.from_codebook(cb, k, np.arange(2, 6), TV)


@pytest.fixture(scope="module")
def models():
    return tiny_vocab_pair()


def test_lantern_pp_static_tree_exact_at_lambda_one_and_not_at_three(models):
    target, draft = models
    tab = tiny_table()
    pval, _, out = exactness(target, jspec.Tree(draft, tree=SMALL_TREE, rule=Vf.LanternPPRule(tab, 2, 1.0)),
                             jax.random.key(2))
    assert pval > 1e-3
    pval3, tv3, out3 = exactness(target, jspec.Tree(draft, tree=SMALL_TREE, rule=Vf.LanternPPRule(tab, 2, 3.0)),
                                 jax.random.key(2))
    assert pval3 < 1e-8 and tv3 > 0.025  # the negative control: a large relaxation is measurably lossy
    assert out3.stats["acceptance_rate"].mean() > out.stats["acceptance_rate"].mean()


def test_lantern_pp_dynamic_tree_exact_at_lambda_one_and_not_at_three(models):
    target, draft = models
    tab = tiny_table()
    make = lambda lam: jspec.DynamicTree(draft, depth=2, top_k=2, total=4,  # noqa: E731
                                         rule=Vf.LanternPPRule(tab, 2, lam, drafts="deterministic"))
    pval, _, out = exactness(target, make(1.0), jax.random.key(3))
    assert pval > 1e-3
    pval3, tv3, out3 = exactness(target, make(3.0), jax.random.key(3))
    assert pval3 < 1e-8 and tv3 > 0.025
    assert out3.stats["acceptance_rate"].mean() > out.stats["acceptance_rate"].mean()


@pytest.mark.slow
@pytest.mark.parametrize("mode", Vf.RESIDUAL_MODES)
def test_lantern_delta_zero_is_exact(models, mode):
    """LANTERN at delta = 0, every residual mode, static (sampled) and dynamic (deterministic) trees."""
    target, draft = models
    tab = tiny_table()
    pval, _, _ = exactness(target, jspec.Tree(draft, tree=SMALL_TREE, rule=Vf.LanternRule(tab, 2, 0.0, residual=mode)),
                           jax.random.key(4))
    assert pval > 1e-3
    dyn = jspec.DynamicTree(draft, depth=2, top_k=2, total=4,
                            rule=Vf.LanternRule(tab, 2, 0.0, residual=mode, drafts="deterministic"))
    pval, _, _ = exactness(target, dyn, jax.random.key(5))
    assert pval > 1e-3


def test_greedy_equals_ar(models):
    target, draft = models
    tab = tiny_table()
    prompts = np.random.default_rng(9).integers(0, TV, (3, 4))
    ar = jspec.decode(target, prompts, max_new_tokens=10, eos_token_id=())
    sd = jspec.decode(target, prompts, jspec.Tree(draft, tree=SMALL_TREE, rule=Vf.LanternPPRule(tab, 3, 3.0)),
                      max_new_tokens=10, eos_token_id=())
    np.testing.assert_array_equal(sd.tokens, ar.tokens)


def test_clear_errors(models):
    target, draft = models
    tab = tiny_table()
    tree = lambda rule: jspec.Tree(draft, tree=SMALL_TREE, rule=rule)  # noqa: E731
    cases = [(Vf.LanternPPRule(tab, 2, 0.5), "lam must be >= 1"), (Vf.LanternRule(tab, 2, -0.1), "delta must be >= 0"),
             (Vf.LanternPPRule(tab, 4, 2.0), "k=4 neighbours but the table holds 3"),
             (Vf.LanternPPRule(tab, -1, 2.0), "non-negative integer"), (Vf.LanternPPRule(tab, 1.5, 2.0), "non-negative"),
             (Vf.LanternPPRule(tab, 2, 2.0, residual="lumina"), "unknown residual mode"),
             (Vf.LanternPPRule(tab, 2, 2.0, drafts="greedy"), "unknown drafts"),
             (Vf.LanternPPRule(tab, 3, 2.0, residual="llamagen_code"), "k \\+ 1 = 4"),
             (Vf.LanternPPRule(np.zeros((6, 3)), 2, 2.0), "NeighbourTable")]
    for rule, msg in cases:
        with pytest.raises(ValueError, match=msg):
            rule.check()
        with pytest.raises(ValueError, match=msg):  # refused before any compute
            jspec.decode(target, [[1, 2]], tree(rule), max_new_tokens=2, temperature=1.0, key=jax.random.key(0))
    with pytest.raises(ValueError, match="DynamicTree supports"):  # sampled drafts cannot verify a dynamic tree
        jspec.decode(target, [[1, 2]], jspec.DynamicTree(draft, depth=2, top_k=2, total=4,
                                                         rule=Vf.LanternPPRule(tab, 2, 2.0)), max_new_tokens=2)
    wide = NeighbourTable.from_codebook(np.random.default_rng(0).normal(size=(4, 3)), 2, np.arange(2, 6), TV + 1)
    with pytest.raises(ValueError, match="vocabulary of 7"):
        Vf.LanternPPRule(wide, 2, 2.0).check(vocab_size=TV)
    with pytest.raises(ValueError, match="vocabulary of 7"):  # caught when the rule meets the target's logits
        jspec.decode(target, [[1, 2]], tree(Vf.LanternPPRule(wide, 2, 2.0)), max_new_tokens=2, temperature=1.0,
                     key=jax.random.key(0))
    with pytest.raises(ValueError, match="another codebook"):
        Vf.LanternPPRule(tab, 2, 2.0).check(vocab_size=TV, codebook=np.ones((4, 3)))
    assert Vf.as_rule(Vf.LanternPPRule(tab, 2, 2.0)).draws and not Vf.LanternPPRule(tab, 2, 2.0, drafts="deterministic").draws
    assert not Vf.LanternPPRule(tab, 2, 2.0).exact


# ------------------------------------------------------------------------------ CFG + the image grammar (exact)


CH_ROWS, CH_COLS = 2, 2
CH_PREFIX = CH_IMAGE_PREFIX


@pytest.fixture(scope="module")
def chameleon_pair():
    return tiny_chameleon(0, 0.15), tiny_chameleon(1, 0.3, hidden_size=16, num_hidden_layers=1)


@pytest.mark.parametrize("tree", ["static", pytest.param("dynamic", marks=pytest.mark.slow)])
def test_exact_under_cfg_and_image_grammar(chameleon_pair, tree):
    """A tiny Chameleon target and draft under CFG 3 and Lumina-mGPT's grammar (2 x 2 grid: image, image,
    end-of-row): LANTERN++ at lambda = 1 samples the guided, constrained target exactly, on a static tree and (with
    deterministic drafts) an EAGLE-2 dynamic tree; lambda = 3 does not."""
    from ports.families import vqgan as VQ
    from sampling_check import chi2_pvalue

    target, draft = chameleon_pair
    cfg = target.config
    table = NeighbourTable.for_chameleon(cfg, VQ.codebook(target.params["vqmodel"]), 3)
    gram = jspec.images.grammar(cfg, CH_ROWS, CH_COLS)
    cond = np.array([9, 12, 30, 11] + CH_PREFIX)
    seqs, p = guided_joint(target, cond, np.array(CH_PREFIX), 3.0, gram)
    Vsz = cfg.vocab_size
    index = seqs[:, 0] * Vsz * Vsz + seqs[:, 1] * Vsz + seqs[:, 2]
    rows = 12000

    def measure(strategy, key):
        out = jspec.decode(target, np.tile(cond, (rows, 1)), strategy, max_new_tokens=3, temperature=1.0, key=key,
                           eos_token_id=(), guidance=jspec.CFG(3.0, CH_PREFIX), constraint=gram)
        t = out.tokens
        counts = np.bincount(t[:, 0] * Vsz * Vsz + t[:, 1] * Vsz + t[:, 2], minlength=Vsz ** 3)
        full = np.zeros(Vsz ** 3)
        full[index] = p
        return chi2_pvalue(counts, full), 0.5 * np.abs(counts / rows - full).sum(), out

    static = lambda lam: jspec.Tree(draft, tree=SMALL_TREE, rule=Vf.LanternPPRule(table, 3, lam))  # noqa: E731
    dynamic = lambda lam: jspec.DynamicTree(draft, depth=2, top_k=2, total=4,  # noqa: E731
                                            rule=Vf.LanternPPRule(table, 3, lam, drafts="deterministic"))
    for make in {"static": (static,), "dynamic": (dynamic,)}[tree]:
        pval, _, out = measure(make(1.0), jax.random.key(11))
        assert pval > 1e-3
        pval3, tv3, _ = measure(make(3.0), jax.random.key(11))
        assert pval3 < 1e-8, (pval3, tv3)
