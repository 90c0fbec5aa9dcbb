"""Speculative decoding: greedy SD == greedy AR, draft = target accepts everything, tree buffers, hooks
(controllers, draft views, profiling), compile once."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
import ports
from flax import struct

from jspec import api
from jspec.parts.plans import DynamicPlan, StaticPlan
from jspec.parts.trees import MC_SIM_7B_63, NAIVE_EXTEND_57, build_tree, chain, layout_of, tree_from_pool
from tiny_pairs import CFG, PROMPTS, tiny_pair
from toy_parts import CycleDepth

@pytest.fixture(scope="module")
def pair():
    return tiny_pair()


# (chain3, mc_sim, custom and dyn4x3 are what the conformance suite proves for its registered strategies: slow here)
@pytest.mark.parametrize("make", [
    # chains of every gamma 1-6 are drawn by tests/test_properties.py; conformance runs gamma 3
    pytest.param(lambda d: jspec.Chain(d, gamma=1), marks=pytest.mark.slow),
    pytest.param(lambda d: jspec.Chain(d, gamma=3), marks=pytest.mark.slow),
    pytest.param(lambda d: jspec.Chain(d, gamma=6), marks=pytest.mark.slow),
    pytest.param(lambda d: jspec.Tree(d, tree="mc_sim_7b_63"), marks=pytest.mark.slow),
    pytest.param(lambda d: jspec.Tree(d, tree="naive_extend_57"), marks=pytest.mark.slow),
    pytest.param(lambda d: jspec.Tree(d, tree=[[0], [1], [0, 0], [0, 1], [1, 0]]), marks=pytest.mark.slow),
    pytest.param(lambda d: jspec.DynamicTree(d, depth=4, top_k=3, total=10), marks=pytest.mark.slow),
    pytest.param(lambda d: jspec.DynamicTree(d, depth=6, top_k=8, total=40), marks=pytest.mark.slow),
    lambda d: jspec.DynamicTree(d, depth=5, top_k=6, total=8)],  # its draft beam has more slots than the tree nodes
    ids=["chain1", "chain3", "chain6", "mc_sim", "extend57", "custom", "dyn4x3", "dyn6x8", "dyn_narrow"])
def test_greedy_sd_equals_greedy_ar(pair, make):
    target, draft = pair
    strat = make(draft)
    ar = jspec.decode(target, PROMPTS, max_new_tokens=23)  # not a multiple of the step
    sd = jspec.decode(target, PROMPTS, strategy=strat, max_new_tokens=23)
    np.testing.assert_array_equal(sd.tokens, ar.tokens)
    np.testing.assert_array_equal(sd.lengths, ar.lengths)
    assert np.all(sd.stats["mean_accepted"] >= 1.0)
    # each row alone gives the same as in the batch, and a shorter budget its prefix
    alone = jspec.decode(target, PROMPTS[1], strategy=strat, max_new_tokens=8)
    np.testing.assert_array_equal(alone.tokens[0], sd.tokens[1, :8])


def test_truncated_draft_is_partly_accepted(pair):
    target, draft = pair
    sd = jspec.decode(target, PROMPTS, strategy=jspec.Chain(draft, gamma=4), max_new_tokens=40)
    # real speculation happened: more than the bonus on average, less than everything
    assert np.all(sd.stats["mean_accepted"] > 1.2) and np.all(sd.stats["mean_accepted"] < 5.0)
    assert np.all(sd.stats["acceptance_rate"] > 0) and np.all(sd.stats["acceptance_rate"] < 1)


@pytest.mark.slow  # the conformance suite decodes every registered strategy with a row that stops at EOS
def test_eos_mid_step(pair):
    target, draft = pair
    free = jspec.decode(target, PROMPTS, max_new_tokens=30, eos_token_id=())
    eos = int(free.tokens[1, 6])
    ar = jspec.decode(target, PROMPTS, max_new_tokens=30, eos_token_id=eos)
    assert ar.lengths[1] <= 7
    for strat in (jspec.Chain(draft, gamma=5), jspec.Tree(draft), jspec.Chain(target, gamma=5)):
        sd = jspec.decode(target, PROMPTS, strategy=strat, max_new_tokens=30, eos_token_id=eos)
        np.testing.assert_array_equal(sd.tokens, ar.tokens)
        np.testing.assert_array_equal(sd.lengths, ar.lengths)


@pytest.mark.parametrize("gamma", [1, 4])
def test_draft_equal_target_accepts_everything(pair, gamma):
    target, _ = pair
    max_new = 1 + 5 * (gamma + 1)  # the prefill token, then 5 full steps
    sd = jspec.decode(target, PROMPTS, strategy=jspec.Chain(target, gamma=gamma), max_new_tokens=max_new)
    assert sd.stats["steps"].tolist() == [5, 5, 5]
    assert np.all(sd.stats["accepted"] == gamma + 1)
    np.testing.assert_allclose(sd.stats["mean_accepted"], gamma + 1)
    np.testing.assert_allclose(sd.stats["acceptance_rate"], 1.0)
    assert sd.stats["drafted"].tolist() == [5 * gamma] * 3
    tree = jspec.decode(target, PROMPTS, strategy=jspec.Tree(target), max_new_tokens=1 + 4 * 6)
    assert np.all(tree.stats["accepted"] == 6)  # depth 5 + bonus


def test_tree_buffers_match_slow_reference():
    for paths in (MC_SIM_7B_63, NAIVE_EXTEND_57, chain(4), [[0], [1], [2], [1, 0], [1, 1], [1, 1, 0]]):
        t = build_tree(paths)
        order = sorted({tuple(p) for p in paths}, key=lambda p: (len(p), p))
        nodes = [()] + order
        assert t.num_nodes == len(nodes)
        for i, p in enumerate(nodes):
            assert t.depth[i] == len(p)
            anc = {nodes.index(p[:k]) for k in range(len(p) + 1)}
            assert set(np.flatnonzero(t.ancestor[i])) == anc
            if p:
                assert t.parent[i] == nodes.index(p[:-1]) and t.rank[i] == p[-1]
                assert t.children[t.parent[i], p[-1]] == i
        for d, (s, e) in enumerate(t.levels):
            assert np.all(t.depth[s:e] == d) and (e - s) == sum(len(p) == d for p in nodes)
    assert build_tree("mc_sim_7b_63").num_nodes == 26 and build_tree("naive_extend_57").num_nodes == 58
    # a chain commits its accepted drafts where the verify wrote them; any branching needs the path gathered
    assert build_tree(chain(4)).is_chain and build_tree(chain(1), layout_of(chain(4))).is_chain
    assert not any(build_tree(p).is_chain for p in ([[0], [1]], [[0], [0, 0], [1]], "mc_sim_7b_63"))


def test_bad_trees_and_pairs(pair):
    target, draft = pair
    with pytest.raises(ValueError, match="no parent path"):
        build_tree([[0], [0, 0, 0]])
    with pytest.raises(ValueError, match="rank 2 without rank 1"):
        build_tree([[0], [2]])
    with pytest.raises(ValueError, match="gamma"):
        jspec.Chain(draft, gamma=0)
    with pytest.raises(ValueError, match="unknown tree"):
        jspec.decode(target, PROMPTS[0], strategy=jspec.Tree(draft, tree="nope"))
    import dataclasses

    other = ports.random_model(dataclasses.replace(CFG, vocab_size=50, num_layers=1), key=3)
    with pytest.raises(ValueError, match="vocabularies differ"):
        jspec.decode(target, PROMPTS[0], strategy=jspec.Chain(other, gamma=2))


def test_no_recompilation_across_calls(pair):
    target, draft = pair
    strat = jspec.Chain(draft, gamma=3)
    jspec.decode(target, PROMPTS, strategy=strat, max_new_tokens=12)
    n = api._decode_sd._cache_size(), api._prefill_sd._cache_size()
    rng = np.random.default_rng(0)
    jspec.decode(target, [rng.integers(0, 97, len(p)) for p in PROMPTS], strategy=strat, max_new_tokens=12)
    jspec.decode(target, PROMPTS, strategy=jspec.Chain(draft, gamma=3), max_new_tokens=12, key=jax.random.key(1))
    assert (api._decode_sd._cache_size(), api._prefill_sd._cache_size()) == n


def test_dynamic_tree_from_pool_matches_slow_reference():
    rng = np.random.default_rng(0)
    B, P, total, D = 3, 30, 12, 8
    parent = np.full((B, P), -1, np.int32)
    depth = np.ones((B, P), np.int32)
    score = np.zeros((B, P), np.float32)
    for b in range(B):
        for i in range(P):
            j = rng.integers(-1, i) if i else -1
            parent[b, i] = j
            depth[b, i] = 1 if j < 0 else depth[b, j] + 1
            score[b, i] = (0 if j < 0 else score[b, j]) + np.log(rng.uniform(0.05, 1.0))
    score[1, 3] = -np.inf  # unusable candidate: it and its descendants must come out invalid
    score[2, :] = np.where(np.arange(P) < 8, score[2, :], -np.inf)  # fewer usable candidates than `total`
    for b in range(B):  # descendants of -inf candidates are -inf too
        for i in range(P):
            if parent[b, i] >= 0 and not np.isfinite(score[b, parent[b, i]]):
                score[b, i] = -np.inf
    D = int(depth.max())
    sel, valid, t = jax.jit(tree_from_pool, static_argnums=(3, 4, 5))(
        jnp.asarray(parent), jnp.asarray(depth), jnp.asarray(score), total, D, P)
    sel, valid = np.asarray(sel), np.asarray(valid)
    for b in range(B):
        order = np.argsort(-score[b], kind="stable")[:total]
        want = sorted(order.tolist())
        assert sel[b].tolist() == want
        node = {p: i + 1 for i, p in enumerate(want)}
        for i, p in enumerate(want, start=1):
            assert valid[b, i] == np.isfinite(score[b, p])
            if not valid[b, i]:
                continue
            par = 0 if parent[b, p] < 0 else node[parent[b, p]]
            assert t.parent[b, i] == par and par < i  # parents before children
            assert t.depth[b, i] == depth[b, p]
            chain_, j = {i, 0}, p
            while parent[b, j] >= 0:
                j = parent[b, j]
                chain_.add(node[j])
            assert set(np.flatnonzero(np.asarray(t.ancestor[b, i]))) == chain_
        for i in range(total + 1):
            kids = [k for k in range(1, total + 1) if valid[b, k] and t.parent[b, k] == i]
            got = [int(c) for c in np.asarray(t.children[b, i]) if c >= 0]
            assert got == kids


@pytest.mark.parametrize("make", [
    pytest.param(lambda d, c: jspec.Chain(d, gamma=4, controller=c), marks=pytest.mark.slow),
    lambda d, c: jspec.Tree(d, tree="mc_sim_7b_63", controller=c),
    pytest.param(lambda d, c: jspec.DynamicTree(d, depth=4, top_k=3, total=10, controller=c), marks=pytest.mark.slow)],
    ids=["chain", "tree", "dynamic"])
def test_controller_limits_depth_without_recompiling(pair, make):
    target, draft = pair
    ar = jspec.decode(target, PROMPTS, max_new_tokens=20, eos_token_id=())
    sd = jspec.decode(target, PROMPTS, strategy=make(draft, CycleDepth(4)), max_new_tokens=20, eos_token_id=())
    np.testing.assert_array_equal(sd.tokens, ar.tokens)
    n = api._decode_sd._cache_size()
    jspec.decode(target, PROMPTS[::-1], strategy=make(draft, CycleDepth(4)), max_new_tokens=20, eos_token_id=())
    assert api._decode_sd._cache_size() == n  # new limits every step, one compilation
    sd2 = jspec.decode(target, PROMPTS, strategy=make(target, CycleDepth(4)), max_new_tokens=20, eos_token_id=())
    np.testing.assert_array_equal(sd2.tokens, ar.tokens)
    acc = sd2.stats["accepted"]
    dynamic = isinstance(make(draft, None), jspec.DynamicTree)
    for b in range(len(PROMPTS)):  # draft = target: each step accepts its depth limit, plus the bonus
        steps = sd2.stats["steps"][b]
        limits = 1 + np.arange(steps) % 4
        if dynamic:  # (the reranked tree may keep the argmax chain less deep than the limit)
            assert np.all(acc[b, :steps] <= limits + 1) and np.all(acc[b, :steps][limits == 1] == 2)
            assert np.any(acc[b, :steps] >= 4)
        else:  # the last step may hit the token budget
            np.testing.assert_array_equal(acc[b, :steps - 1], limits[:-1] + 1)
    if isinstance(make(draft, None), jspec.Chain):
        for b in range(len(PROMPTS)):
            assert sd.stats["drafted"][b] == sum(1 + np.arange(sd.stats["steps"][b]) % 4)


def test_dynamic_tree_with_draft_equal_target(pair):
    target, _ = pair
    sd = jspec.decode(target, PROMPTS, strategy=jspec.DynamicTree(target, depth=5, top_k=2, total=9),
                      max_new_tokens=30, eos_token_id=())
    # the draft's argmax chain is the target's and is accepted as deep as the reranked tree keeps it; its first
    # node is the best-scored candidate, always kept (each row's last step may be cut by the token budget)
    for b, steps in enumerate(sd.stats["steps"]):
        assert np.all(sd.stats["accepted"][b, :steps - 1] >= 2)
    assert np.all(sd.stats["mean_accepted"] > 3.0)
    assert sd.stats["drafted"].tolist() == [9 * s for s in sd.stats["steps"]]


def test_draft_prompt_view(pair):
    target, draft = pair
    ar = jspec.decode(target, PROMPTS, max_new_tokens=16)
    short = [p[-3:] for p in PROMPTS]  # the draft sees only the last three prompt tokens
    sd = jspec.decode(target, PROMPTS, strategy=jspec.Chain(draft, gamma=3), max_new_tokens=16, draft_prompt=short)
    np.testing.assert_array_equal(sd.tokens, ar.tokens)
    same = jspec.decode(target, PROMPTS, strategy=jspec.Chain(target, gamma=3), max_new_tokens=17,
                        draft_prompt=PROMPTS)
    assert np.all(same.stats["acceptance_rate"] == 1.0)
    other = jspec.decode(target, PROMPTS, strategy=jspec.Chain(target, gamma=3), max_new_tokens=16,
                         draft_prompt=[np.array([5, 6]), np.array([7]), np.array([8, 9, 10])])
    np.testing.assert_array_equal(other.tokens, ar.tokens)
    assert other.stats["acceptance_rate"].mean() < 1.0  # the draft really continued its own view
    with pytest.raises(ValueError, match="draft_prompt has 1 rows, the prompt has 3"):
        jspec.decode(target, PROMPTS, strategy=jspec.Chain(draft, gamma=3), draft_prompt=PROMPTS[0])
    with pytest.raises(ValueError, match="draft_prompt needs a speculative strategy"):
        jspec.decode(target, PROMPTS, draft_prompt=PROMPTS)


@pytest.mark.parametrize("kind", ["chain", pytest.param("dynamic", marks=pytest.mark.slow)])
def test_profile_mode_times_phases_and_keeps_tokens(pair, kind):
    target, draft = pair
    strat = {"chain": jspec.Chain(draft, gamma=3), "dynamic": jspec.DynamicTree(draft, depth=3, top_k=2, total=6)}[kind]
    fast = jspec.decode(target, PROMPTS, strategy=strat, max_new_tokens=12)
    for mode in (True, "program"):  # host-synced phases; phases repeated inside one program (from the state that
        # the fused loop then decodes: it must be left as it was)
        prof = jspec.decode(target, PROMPTS, strategy=strat, max_new_tokens=12, profile=mode)
        np.testing.assert_array_equal(prof.tokens, fast.tokens)
        np.testing.assert_array_equal(prof.stats["accepted"], fast.stats["accepted"])
        phases = [prof.stats[k] for k in ("draft_s", "verify_s", "other_s")]
        if mode is True:  # host-timed: each phase is a sum of real durations, all inside the decode's wall time
            assert all(t > 0 for t in phases) and sum(phases) <= prof.stats["decode_s"], (phases, prof.stats)
        else:  # in-program slopes (clamped at 0 where a loaded host's noise wins): the drafting and the verify
            assert all(np.isfinite(phases)) and phases[0] + phases[1] > 0, phases
    assert "draft_s" not in fast.stats
    fast = jspec.decode(target, PROMPTS, max_new_tokens=12)
    for mode in (True, "program"):                                            # AR: timed step by step alike
        prof = jspec.decode(target, PROMPTS, max_new_tokens=12, profile=mode)
        np.testing.assert_array_equal(prof.tokens, fast.tokens)
        assert "step_s" not in fast.stats and np.isfinite(prof.stats["step_s"])
        if mode is True:  # host-timed steps add up positive durations (an in-program slope of a sub-millisecond
            assert prof.stats["step_s"] > 0  # step can be lost in a loaded machine's noise and clamped at 0)
    with pytest.raises(ValueError, match="profile must be"):
        jspec.decode(target, PROMPTS, max_new_tokens=4, profile="gpu")


def test_composition_control_times_each_body_and_leaves_the_state(pair):
    from jspec import api
    from jspec.engine import profiling as PF

    target, draft = pair
    strat = jspec.Chain(draft, gamma=3)
    fast = jspec.decode(target, PROMPTS, strategy=strat, max_new_tokens=10, eos_token_id=())
    s = api.start(target, PROMPTS, strat, max_new_tokens=10, eos_token_id=())
    c = PF.composition_control(s, reps=(1, 3), runs=1)
    assert set(c) == {"draft", "step", "draft+ar", "ar+ar"}
    assert all(np.isfinite(v) for v in c.values()) and max(c.values()) > 0, c  # slopes, clamped at 0 alone
    # the control repeats phases from the state without consuming it: the loop then decodes it as decode does
    np.testing.assert_array_equal(np.asarray(s.run().out)[:, :fast.tokens.shape[1]], fast.tokens)


def test_call_costs_fits_whole_calls(pair):
    from jspec.tools import call_costs as PF

    target, draft = pair
    ar = PF.call_costs(target, [PROMPTS], max_new=(4, 9), rounds=1)
    assert sorted(s for s, _ in ar["points"]) == [3, 8]           # EOS off: max_new - 1 steps after the prefill
    sd = PF.call_costs(target, [PROMPTS], jspec.Chain(draft, gamma=3), max_new=(4, 16), rounds=1)
    (s1, _), (s2, _) = sorted(sd["points"])
    assert 1 <= s1 < s2 <= 15
    for c in (ar, sd):                                            # two points: the line passes through both
        for steps, secs in c["points"]:                           # (a slope's sign is timing noise on a tiny model)
            assert c["per_call_s"] + c["per_step_s"] * steps == pytest.approx(secs, rel=1e-6, abs=1e-9)
        assert c["zero_step_s"] > 0 and c["prefill_s"] > 0
    with pytest.raises(ValueError, match="max_new values that differ"):
        PF.call_costs(target, [PROMPTS], max_new=(4,), rounds=1)


def test_bad_dynamic_tree(pair):
    target, draft = pair
    with pytest.raises(ValueError, match="exceeds the 12 candidates"):
        jspec.decode(target, PROMPTS[0], strategy=jspec.DynamicTree(draft, depth=2, top_k=3, total=13))
    with pytest.raises(ValueError, match="rule='q1' only"):
        jspec.decode(target, PROMPTS[0], strategy=jspec.DynamicTree(draft, rule="residual"))
    with pytest.raises(ValueError, match="depth must be a positive integer"):
        jspec.decode(target, PROMPTS[0], strategy=jspec.DynamicTree(draft, depth=0))


def _refeed(base):
    """`base` plan reporting no node as fed: the draft feeds the whole accepted path again (the reference)."""
    @struct.dataclass
    class Refeed(base):
        pending_width = property(lambda self: self.max_depth + 1)

        def propose(self, *args):
            prop, ds = super().propose(*args)
            return prop._replace(fed=None), ds

    return Refeed


_REFEED = {StaticPlan: _refeed(StaticPlan), DynamicPlan: _refeed(DynamicPlan)}


def _refeeding(strategy):
    parts = strategy.parts()
    plan = _REFEED[type(parts.plan)](**{f.name: getattr(parts.plan, f.name) for f in dataclasses.fields(parts.plan)})
    return parts.replace(plan=plan)


@pytest.mark.parametrize("tree,controller", [
    ("chain", None), pytest.param("chain", CycleDepth(4), marks=pytest.mark.slow),
    pytest.param("mc_sim_7b_63", None, marks=pytest.mark.slow),
    pytest.param("mc_sim_7b_63", CycleDepth(3), marks=pytest.mark.slow),
    pytest.param("dynamic", None, marks=pytest.mark.slow), pytest.param("dynamic", CycleDepth(4), marks=pytest.mark.slow),
    pytest.param("sage", None, marks=pytest.mark.slow)],
    ids=["chain", "chain-limited", "tree", "tree-limited", "dynamic", "dynamic-limited", "sage"])
def test_committed_draft_kv_equals_feeding_again(pair, tree, controller):
    """The accepted nodes the draft fed while drafting are committed from its scratch instead of fed again: the
    draft then proposes what it would have proposed after a re-feed, so every step accepts as many tokens."""
    target, draft = pair
    if tree == "dynamic":
        reuse = jspec.DynamicTree(draft, depth=5, top_k=3, total=12, controller=controller)
    elif tree == "sage":  # per-row trees packed for the verify: `fed` moves with its nodes
        reuse = jspec.SAGE(draft, d_max=5, n_max=30, k=6, w_max=6)
    else:
        paths = tuple(tuple(p) for p in chain(5)) if tree == "chain" else tree
        reuse = jspec.Tree(draft, tree=paths, controller=controller)
    refeed = _refeeding(reuse)
    assert reuse.parts().plan.pending_width == 2 and refeed.plan.pending_width == refeed.plan.max_depth + 1
    # an EOS that ends row 0 early, so finished rows sit beside running ones for some steps
    ar = jspec.decode(target, PROMPTS, max_new_tokens=40, eos_token_id=())
    eos = int(ar.tokens[0, 6])
    a = jspec.decode(target, PROMPTS, strategy=reuse, max_new_tokens=40, eos_token_id=(eos,))
    b = jspec.decode(target, PROMPTS, strategy=refeed, max_new_tokens=40, eos_token_id=(eos,))
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.stats["steps"], b.stats["steps"])
    np.testing.assert_array_equal(a.stats["accepted"], b.stats["accepted"])
    assert 1.5 < np.mean(a.stats["accepted"][a.stats["accepted"] > 0]) < 5  # partly accepted: it can fail
    assert a.lengths[0] <= 7 and a.lengths.max() > a.lengths[0]


def test_op_costs_attributes_the_loop_to_its_operations(pair):
    from jspec import api
    from jspec.engine import profiling as PF

    target, draft = pair
    for strat in (None, jspec.Chain(draft, gamma=3)):
        c = PF.op_costs(api.start(target, PROMPTS, strat, max_new_tokens=10, eos_token_id=()), top=None)
        assert 1 <= c["steps"] <= 9 and (strat is not None or c["steps"] == 9)   # EOS off: AR takes max_new - 1
        ops = c["ops"]
        assert ops and all(r["us_per_step"] >= 0 and r["per_step"] > 0 for r in ops)
        assert [r["us_per_step"] for r in ops] == sorted((r["us_per_step"] for r in ops), reverse=True)
        # every layer's projections run each step: the target's [B, D] x [D, ...] products are among the operations
        B, D = len(PROMPTS), target.config.hidden_size
        dots = [r for r in ops if "dot_general" in r["op"]]
        assert dots and all(r["per_step"] >= 1 for r in dots)
        assert any(r["shape"].startswith(f"f32[{B},") for r in dots), [r["shape"] for r in dots]
        assert not any(r["op"] in ("while", "conditional") for r in ops)   # containers would count their bodies
    assert PF._hlo_instructions('  %dot.5 = f32[2,8]{1,0} dot(%a, %b), metadata={op_name="jit(f)/btd,dv->btv/'
                               'dot_general"}') == {"dot.5": ("f32[2,8]{1,0}", "btd,dv->btv/dot_general")}


def test_the_jspec_logger_reports_times_and_shapes_and_nothing_is_printed(pair, caplog, capsys):
    """INFO: each decode's prefill and loop times and throughput; DEBUG: the static shape it compiled for; the
    library itself writes nothing to stdout or stderr."""
    import logging

    target, draft = pair
    with caplog.at_level(logging.DEBUG, logger="jspec"):
        out = jspec.decode(target, PROMPTS, strategy=jspec.Chain(draft, gamma=3), max_new_tokens=6, eos_token_id=())
    info = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO and r.name == "jspec.api"]
    debug = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG and r.name == "jspec.api"]
    assert len(info) == 1 and f"{int(out.lengths.sum())} new tokens in {int(out.stats['steps'].max())} steps" in info[0]
    assert "tokens/s" in info[0] and "Chain" in info[0]
    assert len(debug) == 1 and "of depth 3" in debug[0] and f"{len(PROMPTS)} rows" in debug[0]
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="jspec"):
        jspec.decode(target, PROMPTS, max_new_tokens=4)
    assert not caplog.records
