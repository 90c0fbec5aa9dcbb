"""SAGE: the confidence of Eq. 7-9, the planner against a plain recursive transcription of the paper's tree
construction (both probability readings) and its invariants over random alphas and distributions, the slot budget,
the history rule, greedy == AR at forced alphas (0, between, 1) on a ragged batch, an early-exit drafter under a
SAGE plan, the stats, and refusals. The conformance suite (tests/strategies.py) adds greedy == AR per row, exact
sampling, no recompilation and the 8-device mesh; the VLM tests add LLaVA, OneVision and Qwen2.5-VL (image, video)."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from jspec.parts.controllers import Record
from jspec.parts.controllers.entropy_tree import EntropyTree, TreeSpec, confidence
from jspec.parts.trees import MC_SIM_7B_63
from tiny_pairs import PROMPTS, tiny_pair

INIT = tuple(tuple(p) for p in MC_SIM_7B_63)


@pytest.fixture(scope="module")
def pair():
    return tiny_pair()


def reference_tree(p, alpha, d_max, d_min=3, w_min=2, w_max=10, k=10, n_max=64, theta0=0.1,
                   threshold="cumulative"):
    """The paper's recursive expansion, written out plainly: (D, W, rank paths in depth-first order). Probabilities
    and thresholds in float32 as on device (a uniform p sits exactly on theta_l)."""
    f = np.float32
    p = [f(x) for x in p]
    r = lambda x: int(math.floor(x + 0.5))  # noqa: E731
    D = min(max(r(d_min + alpha * (d_max - d_min)), d_min), d_max)
    W = min(max(r(w_min + (1 - alpha) * (w_max - w_min)), 1), k)
    out = []

    def expand(path, cum, loc, lvl):
        if lvl > D:
            return
        pp = cum if threshold == "cumulative" else loc
        wl = W if lvl == 1 else min(max(r(W * (0.5 + pp) / lvl), 1), k)
        for rank in range(wl):
            c = f(cum * p[rank])
            if (c if threshold == "cumulative" else p[rank]) > f(theta0 * lvl) / f(D):
                if len(out) >= n_max:
                    return
                out.append(path + (rank,))
                expand(path + (rank,), c, p[rank], lvl + 1)

    expand((), f(1.0), f(1.0), 1)
    return D, W, out


def paths_of(tree, b=None):
    parent, rank, valid = (np.asarray(x if b is None else x[b]) for x in tree)

    def path(i):
        return () if i == 0 else path(parent[i]) + (int(rank[i]),)

    return [path(i) for i in np.flatnonzero(valid) if i > 0]


def random_inputs(n, k, seed):
    rng = np.random.default_rng(seed)
    conc = rng.choice([0.03, 0.3, 1.0, 30.0], size=n)
    p = np.stack([np.sort(rng.dirichlet(np.full(k, c)))[::-1] for c in conc]).astype(np.float32)
    p[0], p[1] = np.eye(k)[0], np.full(k, 1 / k)  # one-hot and uniform
    alpha = rng.choice([0.0, 1.0, 0.5, -1], size=n)
    alpha = np.where(alpha < 0, rng.random(n), alpha).astype(np.float32)
    return p, alpha


def test_confidence_is_one_for_one_hot_zero_for_uniform_and_in_between():
    k = 10
    assert float(confidence(jnp.eye(k)[0])) == pytest.approx(1.0)
    assert float(confidence(jnp.full((k,), 0.3))) == pytest.approx(0.0, abs=1e-6)
    p = jnp.asarray([0.5, 0.5] + [0.0] * 8)
    assert float(confidence(p)) == pytest.approx(1 - math.log(2) / math.log(10), abs=1e-6)
    top = np.asarray(jax.random.dirichlet(jax.random.key(0), jnp.ones(k), (200,))) * 3.0  # any scale
    q = top / top.sum(-1, keepdims=True)
    want = 1 + (q * np.log(q)).sum(-1) / math.log(k)  # Eq. 7-9: 1 - H(renormalised top-k) / log k
    np.testing.assert_allclose(np.asarray(confidence(jnp.asarray(top))), want, atol=1e-5)


@pytest.mark.parametrize("threshold", ["cumulative", "local"])
def test_planner_equals_the_papers_recursive_expansion_and_keeps_its_invariants(threshold):
    """Batched planner vs the recursive transcription over random (p, alpha, d_max); then per tree: <= n_max nodes,
    depth <= D, prefix-closed, ranks < W_l, every node passes theta_l, and it fits the layout."""
    spec = TreeSpec(init_tree=INIT, threshold=threshold)
    n = 160
    p, alpha = random_inputs(n, spec.k, seed=1 if threshold == "cumulative" else 2)
    d_max = np.random.default_rng(3).integers(spec.d_min, spec.d_cap + 1, n).astype(np.int32)
    got = jax.jit(jax.vmap(spec.plan))(jnp.asarray(p), jnp.asarray(alpha), jnp.asarray(d_max))
    sizes = []
    for b in range(n):
        D, W, want = reference_tree([float(x) for x in p[b]], float(alpha[b]), int(d_max[b]), threshold=threshold)
        paths = paths_of(got.tree, b)
        assert sorted(paths) == sorted(want), (b, alpha[b], d_max[b])
        assert (int(got.depth[b]), int(got.width[b]), int(got.nodes[b])) == (D, W, len(want))
        assert len(paths) <= spec.n_max and all(len(q) <= D for q in paths)
        assert all(q[:-1] in set(paths) | {()} for q in paths)
        for q in paths:
            cum = np.float32(1.0)
            for lvl, rank in enumerate(q, 1):
                wl = W if lvl == 1 else min(max(math.floor(W * (0.5 + (cum if threshold == "cumulative"
                                                                       else p[b][q[lvl - 2]])) / lvl + 0.5), 1), 10)
                cum *= p[b][rank]
                assert rank < wl
            assert (cum if threshold == "cumulative" else p[b][q[-1]]) > np.float32(0.1 * len(q)) / D
        sizes.append(len(paths))
    # wide and narrow trees both occurred; the local reading's trees reach the n_max cut
    assert max(sizes) >= (12 if threshold == "cumulative" else spec.n_max) and min(sizes) <= 8


def test_the_slot_budget_holds_the_widest_trees_of_every_reachable_setting():
    """The planner never drops a node for lack of slots (it keeps every node the recursive expansion keeps) even on
    the inputs that fill each level most: uniform, flat-headed and geometric p at every reachable (d_max, D, W)."""
    spec = TreeSpec(init_tree=INIT)
    k = spec.k
    heads = [np.full(k, 1 / k)] + [np.r_[np.full(m, 0.95 / m), np.full(k - m, 0.05 / (k - m))] for m in (2, 3, 5)]
    heads += [0.5 ** np.arange(1, k + 1), 0.8 ** np.arange(k)]
    heads = np.stack([h / h.sum() for h in heads]).astype(np.float32)
    rows = []
    for dm, D, W in spec.reachable():
        a = 0.0 if dm == spec.d_min else (D - spec.d_min) / (dm - spec.d_min)
        if round(spec.w_min + (1 - a) * (spec.w_max - spec.w_min)) == W:
            rows += [(h, a, dm) for h in heads]
    p = jnp.asarray(np.stack([r[0] for r in rows]))
    got = jax.jit(jax.vmap(spec.plan))(p, jnp.asarray([r[1] for r in rows], jnp.float32),
                                         jnp.asarray([r[2] for r in rows], jnp.int32))
    for b, (h, a, dm) in enumerate(rows):
        _, _, want = reference_tree([float(x) for x in h], float(np.float32(a)), dm)
        assert int(got.nodes[b]) == len(want)
    assert spec.layout.num_nodes < 8 * spec.n_max  # not a blanket n_max per level


def record(accepted, active=None, topk=None):
    B = len(accepted)
    z = jnp.zeros((B,), jnp.int32)
    return Record(accepted=jnp.asarray(accepted, jnp.int32), committed=z, active=jnp.ones((B,), bool)
                  if active is None else jnp.asarray(active), depth=z, drafted=z, path=jnp.zeros((B, 9), jnp.int32),
                  on_path=jnp.zeros((B, 2), bool), tokens=jnp.zeros((B, 9), jnp.int32),
                  root_topk=jnp.tile(jnp.eye(10)[0], (B, 1)) if topk is None else topk)


def test_history_rule_moves_d_max_by_one_on_full_windows_with_hysteresis():
    ctrl = EntropyTree(TreeSpec(init_tree=INIT))
    s = ctrl.init(3, 8)
    for step in range(25):  # row 0 accepts 1 per round (< 2), row 1 accepts 2.5 on average, row 2 finished
        s = ctrl.observe(s, record([1, 2 + step % 2, 0], active=[True, True, False]))
        if step < 9:
            assert s.d_max.tolist() == [8, 8, 8]  # the window is not full yet
    assert s.d_max.tolist() == [3, 8, 8]  # one step down per round from round 10, floored at d_min
    for step in range(12):
        s = ctrl.observe(s, record([5, 2, 0], active=[True, True, False]))
    assert s.d_max.tolist() == [8, 8, 8]  # up one per round from the 6th (mean > 3), capped at d_cap
    assert s.first.tolist() == [False, False, True]
    low = EntropyTree(TreeSpec(init_tree=INIT), d_start=4)  # started below its cap, the rule can climb
    s = low.init(2, 8)
    assert s.d_max.tolist() == [4, 4]
    seen = []
    for _ in range(16):
        s = low.observe(s, record([5, 2]))
        seen.append(s.d_max.tolist())
    assert seen[8] == [4, 4] and seen[9] == [5, 4] and seen[12] == [8, 4] and seen[15] == [8, 4]
    assert jspec.SAGE(None, d_start=4).controller().init(1, 8).d_max.tolist() == [4]
    off = EntropyTree(TreeSpec(init_tree=INIT), history=False)
    s = off.init(1, 8)
    for _ in range(15):
        s = off.observe(s, record([0]))
    assert int(s.d_max[0]) == 8


def test_alpha_and_the_proxy_come_from_the_rounds_root_distribution():
    ctrl = EntropyTree(TreeSpec(init_tree=INIT))
    top = jnp.asarray([[4.0, 4.0] + [0.0] * 8, [1.0] * 10])  # unnormalised top-k
    s = ctrl.observe(ctrl.init(2, 8), record([0, 0], topk=top))
    np.testing.assert_allclose(s.alpha, [1 - math.log(2) / math.log(10), 0.0], atol=1e-6)
    np.testing.assert_allclose(s.p[0, :2], [0.5, 0.5])
    plan = jax.jit(ctrl.decide)
    d = plan(s, jax.random.key(0))
    assert d.info["width"].tolist() == [round(2 + (1 - float(s.alpha[0])) * 8), 10]
    first = plan(ctrl.init(2, 8), jax.random.key(0))  # round 1: the initial static tree
    assert sorted(paths_of(first.tree, 0)) == sorted(INIT) and first.depth.tolist() == [5, 5]


@pytest.mark.parametrize("alpha", [pytest.param(0.0, marks=pytest.mark.slow),
                                   pytest.param(0.35, marks=pytest.mark.slow), 1.0,
                                   pytest.param(None, marks=pytest.mark.slow)],
                         ids=["a0", "a035", "a1", "adaptive"])
def test_greedy_sage_equals_ar_at_every_alpha(pair, alpha):
    target, draft = pair
    ar = jspec.decode(target, PROMPTS, max_new_tokens=24, eos_token_id=())
    out = jspec.decode(target, PROMPTS, jspec.SAGE(draft, d_max=6, n_max=40, window=3, force_alpha=alpha),
                       max_new_tokens=24, eos_token_id=())
    np.testing.assert_array_equal(out.tokens, ar.tokens)
    st = out.stats
    planned = st["depth"][:, 1:]
    assert (st["nodes"][:, 1:] <= 40).all() and (planned >= 3).all() and (planned <= st["d_max"][:, 1:]).all()
    reach = st["reach"][:, 1:]  # the deepest node the threshold kept: within D, and D itself when alpha = 1
    assert (reach >= 1).all() and (reach <= planned).all() and (st["reach"][:, 0] == 5).all()
    # a round accepts no deeper than its tree reaches
    acc = st["accepted"][:, 1:st["reach"].shape[1]]
    assert ((acc - 1 <= reach[:, :acc.shape[1]]) | (acc == 0)).all()
    steps = st["steps"]
    # the engine drafts the trees the controller planned: every node offered, each round's own tree
    assert st["drafted"].tolist() == [int(st["nodes"][b, :steps[b]].sum()) for b in range(len(steps))]
    if alpha == 0.0:
        assert (planned == 3).all() and (st["width"][:, 1:] == 10).all()
    if alpha == 1.0:
        assert (st["width"][:, 1:] == 2).all()
    assert (st["nodes"][:, 0] == 25).all() and np.isnan(st["alpha"][:, 0]).all()


@pytest.mark.slow
def test_an_early_exit_drafter_under_a_sage_plan_equals_ar(pair):
    from strategies import eesd_head

    target, _ = pair
    ar = jspec.decode(target, PROMPTS, max_new_tokens=16, eos_token_id=())
    out = jspec.decode(target, PROMPTS, jspec.SAGE(eesd_head(target), d_max=5, n_max=30), max_new_tokens=16,
                       eos_token_id=())
    np.testing.assert_array_equal(out.tokens, ar.tokens)
    assert out.stats["mean_accepted"].mean() > 1.2


@pytest.mark.slow
def test_mean_nodes_confidence_and_the_static_tree_switch(pair):
    target, draft = pair
    ar = jspec.decode(target, PROMPTS[:2], max_new_tokens=12, eos_token_id=())
    for strat in (jspec.SAGE(draft, d_max=5, n_max=30, confidence="mean_nodes"),
                  jspec.SAGE(draft, d_max=5, n_max=30, adaptive_tree=False)):
        out = jspec.decode(target, PROMPTS[:2], strat, max_new_tokens=12, eos_token_id=())
        np.testing.assert_array_equal(out.tokens, ar.tokens)
        if strat.adaptive_tree:
            assert np.isfinite(out.stats["alpha"][:, 1:]).all()
        else:
            assert (out.stats["nodes"] == 25).all()


@pytest.mark.parametrize("kw, match", [
    ({"d_min": 6, "d_max": 5}, "d_min <= d_max"), ({"k": 1}, "k >= 2"), ({"n_max": 10}, "initial tree"),
    ({"n_max": 300}, "<= 256"), ({"w_max": 12}, "w_max <= k"), ({"threshold": "max"}, "threshold"),
    ({"confidence": "leaf"}, "confidence"), ({"d_max": 4}, "deeper than d_max"), ({"d_start": 2}, "d_start"),
    ({"d_start": 9}, "d_start"), ({"force_alpha": 1.5}, "force_alpha")])
def test_bad_settings_are_refused_before_any_compute(pair, kw, match):
    with pytest.raises(ValueError, match=match):
        jspec.SAGE(pair[1], **kw)


def test_k_above_the_vocabulary_and_node_outputs_on_a_dynamic_tree_are_refused(pair):
    target, draft = pair
    with pytest.raises(ValueError, match="exceeds the vocabulary"):
        jspec.decode(target, PROMPTS, jspec.SAGE(draft, k=100, w_max=10), max_new_tokens=4)
    bad = jspec.DynamicTree(draft, depth=3, top_k=2, total=4).parts().replace(
        controller=EntropyTree(TreeSpec(init_tree=INIT), "mean_nodes"))
    with pytest.raises(ValueError, match="does not keep them"):
        jspec.decode(target, PROMPTS, bad, max_new_tokens=4)
