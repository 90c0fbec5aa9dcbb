"""The guard (`jspec.Guarded`, `jspec.parts.controllers.guard`, `jspec.costs`): its decision rule, its estimates,
the measured cost table and its disk cache; guarded strategies stay AR's tokens whether the guard speculates, stops
speculating or switches between the two, and a step where no row drafts is exact when sampled."""
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import struct

import jspec
from jspec.engine.costs import CostTable
from jspec.parts.controllers.guard import Guard, expected_tokens
from jspec.parts.protocols import Record
from provenance_check import assert_provenance
from sampling_check import V, chi2_pvalue, close_pair, exact_joint, joint_index, tiny_vocab_pair
from strategies import eagle3_head, eagle_head, eesd_head
from toy_parts import ScheduledDepth
from tiny_pairs import PROMPTS, tiny_pair

CHEAP = (1.0, 1.05, 1.1, 1.15)  # a round at depth 0 .. 3, in AR steps: drafting pays from a low acceptance
DEAR = (1.0, 3.0, 5.0, 7.0)  # drafting never pays at a plausible acceptance
EVEN = (1.0, 1.5, 2.0, 2.5)  # drafting pays while the first draft is accepted more than half the time
NEAR = (1.0, 1.99, 2.99, 3.99)  # drafting pays only above 0.99 acceptance: a row tries once, then stops


def table(step_s):
    return CostTable(1.0, tuple(step_s))


@pytest.fixture(scope="module")
def pair():
    return tiny_pair()


def state(alpha, active=None, seen=1.0):
    """Estimates `alpha`, each position observed `seen` times (0: never, so the choice counts it as accepted)."""
    alpha = jnp.asarray(alpha, jnp.float32)
    s = Guard(jnp.asarray(CHEAP)).init(*alpha.shape)
    return s.replace(alpha=alpha, active=jnp.ones(alpha.shape[0], bool) if active is None else jnp.asarray(active),
                     seen=jnp.full(alpha.shape, seen, jnp.float32))


def record(accepted, depth, active=None):
    accepted, depth = jnp.asarray(accepted, jnp.int32), jnp.asarray(depth, jnp.int32)
    B, D = accepted.shape[0], 3
    return Record(accepted=accepted, committed=accepted + 1, active=jnp.ones(B, bool) if active is None else
                  jnp.asarray(active), depth=depth, drafted=depth, path=jnp.zeros((B, D + 1), jnp.int32),
                  on_path=jnp.zeros((B, D + 1), bool), tokens=jnp.zeros((B, D + 1), jnp.int32))


def test_expected_tokens_and_the_choice_per_row_and_per_batch():
    E = expected_tokens(jnp.asarray([[0.5, 0.5, 0.5]]))
    np.testing.assert_allclose(E, [[1.0, 1.5, 1.75, 1.875]])
    s = state([[0.9, 0.9, 0.9], [0.05, 0.0, 0.0]])
    # the batch pays one width: row 0 drafts to 3, row 1 (hopeless) drafts nothing
    assert Guard(jnp.asarray(CHEAP)).choose(s).tolist() == [3, 0]
    assert Guard(jnp.asarray(DEAR)).choose(s).tolist() == [0, 0]  # no depth pays: an AR step for every row
    # a row's own best depth: 1 when only the first draft is likely
    assert Guard(jnp.asarray(EVEN)).choose(state([[0.9, 0.1, 0.1]])).tolist() == [1]
    # the batch's depth is what pays summed over its rows: one good row among three bad ones is not enough
    s = state([[0.7, 0.7, 0.7]] + [[0.0, 0.0, 0.0]] * 3)
    assert Guard(jnp.asarray(EVEN)).choose(s).tolist() == [0, 0, 0, 0]
    # ... unless the bad rows have finished
    s = state([[0.7, 0.7, 0.7]] + [[0.0, 0.0, 0.0]] * 3, [True, False, False, False])
    assert Guard(jnp.asarray(EVEN)).choose(s)[0] > 0
    # an inner controller's depth caps the guard's
    assert Guard(jnp.asarray(CHEAP)).choose(state([[0.9] * 3]), jnp.asarray([2])).tolist() == [2]


def test_positions_never_observed_count_as_accepted_so_a_fresh_row_tries_its_drafter():
    """A fresh row (nothing observed) drafts to the depth that pays were every draft accepted, even where the prior
    would pay for none; once observed, the estimates decide; an unobserved position behind a rejected one adds
    nothing."""
    prior = [[0.5, 0.5, 0.5]]
    assert Guard(jnp.asarray(EVEN)).choose(state(prior)).tolist() == [0]  # the prior alone: no depth pays
    assert Guard(jnp.asarray(EVEN)).choose(state(prior, seen=0.0)).tolist() == [3]  # unobserved: tried in full
    assert Guard(jnp.asarray(NEAR)).choose(state(prior, seen=0.0)).tolist() == [1]  # 2 tokens for 1.99 steps
    assert Guard(jnp.asarray(DEAR)).choose(state(prior, seen=0.0)).tolist() == [0]  # no acceptance makes DEAR pay
    s = state([[0.9, 0.05, 0.5]]).replace(seen=jnp.asarray([[3.0, 3.0, 0.0]]))  # the third never reached
    assert Guard(jnp.asarray(EVEN)).choose(s).tolist() == [1]


def test_estimates_move_where_a_round_looked_and_drift_back_elsewhere():
    g = Guard(jnp.asarray(CHEAP), rate=0.5, prior=0.5, drift=0.1)
    s = g.init(3, 3)
    B, D = 3, 3
    rec = record([3, 1, 0], [3, 3, 0])
    a = np.asarray(g.observe(s, rec).alpha)
    np.testing.assert_allclose(a[0], [0.75, 0.75, 0.75])  # every position reached and accepted
    np.testing.assert_allclose(a[1], [0.75, 0.25, 0.5])  # 1 accepted, the 2nd rejected, the 3rd never reached
    np.testing.assert_allclose(a[2], [0.5, 0.5, 0.5])  # drafted nothing: nothing learnt, the prior stays
    low = s.replace(alpha=jnp.zeros((B, D)))
    # a drafting row's positions its round did not reach drift back towards the prior; a row that drafted nothing
    # keeps its estimates (it waits for its next try)
    np.testing.assert_allclose(np.asarray(g.observe(low, record([0, 0, 0], [1, 1, 0])).alpha),
                               [[0.0, 0.05, 0.05], [0.0, 0.05, 0.05], [0.0, 0.0, 0.0]])


def test_the_first_rounds_weigh_as_a_mean_then_as_an_average_of_the_last_few():
    """With the prior worth 2 rounds, the estimate is the mean of the rounds so far (the prior included) while
    that weighs a new round more than `rate`; after that each round weighs `rate`."""
    g = Guard(jnp.asarray(CHEAP), rate=0.1, prior=0.5, prior_rounds=2.0, retry=1000, max_wait=1000)
    s = g.init(1, 3)
    got = []
    for _ in range(12):  # the first draft rejected every round
        s = g.observe(s, record([0], [1]))
        got.append(float(s.alpha[0, 0]))
    mean = [1.0 / (n + 2) for n in range(1, 9)]  # 1 (the prior's 2 x 0.5) over n + 2 rounds
    np.testing.assert_allclose(got[:8], mean, rtol=1e-5)
    np.testing.assert_allclose(got[8:], [mean[-1] * 0.9 ** k for k in range(1, 5)], rtol=1e-5)


def test_a_row_that_stopped_tries_again_each_time_twice_as_late_until_a_try_holds():
    g = Guard(jnp.asarray(CHEAP), rate=0.5, prior=0.5, retry=2, max_wait=8)
    s = g.init(1, 3).replace(alpha=jnp.zeros((1, 3)))
    restarts = []
    for r in range(1, 31):  # rounds without drafts: the estimates restart from the prior at each try
        s = g.observe(s, record([0], [0]))
        if float(s.alpha[0, 0]) == 0.5:
            restarts.append(r)
            s = s.replace(alpha=jnp.zeros((1, 3)))  # the try failed: the row stops again
    assert restarts == [2, 6, 14, 22, 30]  # waits of 2, 4, 8, then 8 (max_wait)
    finished = g.observe(s, record([0], [0], active=[False]))
    assert int(finished.idle[0]) == int(s.idle[0])  # a finished row counts nothing
    for _ in range(2):  # a try that holds for `retry` drafting rounds sets the wait back to `retry`
        s = g.observe(s, record([1], [1]))
    assert int(s.wait[0]) == 2 and int(s.idle[0]) == 0


@pytest.mark.parametrize("name", ["chain", "tree", "lookup", "eesd"])
def test_guarded_greedy_is_ar_whether_it_speculates_or_not(pair, name):
    target, draft = pair
    prompts = PROMPTS
    if name == "eesd":  # an early exit after the first of two layers
        target, draft = tiny_vocab_pair(2)
        prompts = [np.array([1, 4, 2, 5]), np.array([3, 1]), np.array([2, 2, 5, 1, 0])]
    make = {"chain": lambda: jspec.Chain(draft, gamma=3),
            "tree": lambda: jspec.Tree(draft, tree=[[0], [1], [0, 0], [1, 0], [0, 0, 0]]),
            "lookup": lambda: jspec.PromptLookup(max_ngram=2, gamma=3),
            "eesd": lambda: jspec.EESD(eesd_head(target), k_max=3)}[name]
    strategy = make()
    ar = jspec.decode(target, prompts, max_new_tokens=16, eos_token_id=())
    seen = {}
    # "even": each round follows the last one's first draft (rate 1) and a row that stops tries again 2 rounds later
    for name, costs, kw in (("cheap", CHEAP, {}), ("dear", DEAR, {}), ("near", NEAR, {}),
                            ("even", EVEN, dict(rate=1.0, prior=0.8, retry=2))):
        out = jspec.decode(target, prompts, jspec.Guarded(strategy, costs=table(costs), **kw),
                           max_new_tokens=16, eos_token_id=())
        np.testing.assert_array_equal(out.tokens, ar.tokens)
        spec = out.stats["speculated"]
        seen[name] = (spec.any(), (~spec).any())
        if name == "dear":  # no acceptance makes a round pay: the AR program
            assert (out.stats["drafted"] == 0).all() and not spec.any()
            assert spec.shape == out.stats["accepted"].shape
        if name == "near":  # each row tries its drafter once, then the estimates stop it (no retry within 16 tokens)
            assert spec[:, 0].all() and not spec[:, 1:].any(), spec
    assert seen["cheap"][0]
    assert seen["even"] == (True, True), seen  # it switched between speculating and AR steps within a decode


DEFERRING = {  # the drafters that keep a feed of their own, and so may leave an AR round's token unread
    "chain": lambda t, d: jspec.Chain(d, gamma=3),
    "tree": lambda t, d: jspec.Tree(d, tree=[[0], [1], [0, 0], [1, 0], [0, 0, 0]]),
    "eagle_chain": lambda t, d: jspec.Chain(eagle_head(t), gamma=3),
    "eagle3_chain": lambda t, d: jspec.Eagle3(eagle3_head(t), tree="chain", depth=3),
    "eesd": lambda t, d: jspec.EESD(eesd_head(t), controller=3, k_max=3),
}


def reads_at_once(drafter):
    """`drafter` with the protocol's own `catch_up` (its `root`): every round without drafts reads its token."""
    import dataclasses

    from jspec.parts.protocols import Drafter

    cls = struct.dataclass(type("ReadsAtOnce", (type(drafter),), {"catch_up": Drafter.catch_up}))
    return cls(**{f.name: getattr(drafter, f.name) for f in dataclasses.fields(drafter)})


@pytest.mark.parametrize("name", [n if n not in ("tree", "eagle3_chain") else pytest.param(n, marks=pytest.mark.slow)
                                  for n in DEFERRING])  # (a tree and EAGLE-3's feed: the same FeedDrafter path)
def test_rounds_without_drafts_leave_their_tokens_unread_and_change_no_later_draft(name):
    """AR rounds in streaks shorter and longer than `defers`: the drafter reads nothing in them while it has room
    (its unread count grows by one a round), and every later round drafts exactly what it drafts when each AR round
    reads at once (the control): the same accepted counts, round by round, and AR's tokens."""
    from jspec import api
    from jspec.engine import profiling as PF

    target, draft = tiny_vocab_pair(2) if name == "eesd" else tiny_pair()
    prompts = [np.array([1, 4, 2, 5]), np.array([3, 1]), np.array([2, 2, 5, 1, 0])] if name == "eesd" else PROMPTS
    parts = DEFERRING[name](target, draft).parts()
    ar = jspec.decode(target, prompts, max_new_tokens=24, eos_token_id=())
    plan = (3, 0, 0, 2, 0, 0, 0, 0, 0, 0, 3, 1, 0)  # streaks of 2 and 6 AR rounds
    runs = {}
    for label, drafter, defers in (("control", reads_at_once(parts.drafter), 3), ("own feed", parts.drafter, 0),
                                   ("3 slots", parts.drafter, 3)):
        s = parts.replace(drafter=drafter, controller=ScheduledDepth(plan, defers))
        out = jspec.decode(target, prompts, s, max_new_tokens=24, eos_token_id=())
        np.testing.assert_array_equal(out.tokens, ar.tokens)
        runs[label] = out.stats["accepted"]
    np.testing.assert_array_equal(runs["own feed"], runs["control"])
    np.testing.assert_array_equal(runs["3 slots"], runs["control"])
    # the unread tokens after the first streak: one more per AR round than after the drafting round before it
    st = api.start(target, prompts, parts.replace(controller=ScheduledDepth(plan, 3)), max_new_tokens=24,
                   eos_token_id=())
    waiting = []
    for n in (1, 3):
        state = PF._repeat("sd_step", st.ctx, st.static, st.dyn, st.target, (st.state, None, None), n)[0]
        waiting.append(np.asarray(state.aux.draft.n_pending))
        assert np.asarray(state.aux.draft.deferred).all() == (n == 3)
    np.testing.assert_array_equal(waiting[1], waiting[0] + 2)


def test_where_no_round_can_pay_the_guard_never_drafts_and_elsewhere_it_can():
    """`CostTable.drafting_can_pay` is the guard's own bound: for tables it rules out, no acceptance estimate (1.0
    included) and no batch makes `Guard.choose` draft; for tables it lets through, a high enough estimate does."""
    rng = np.random.default_rng(0)
    ruled_out = let_through = 0
    for _ in range(300):
        D = int(rng.integers(1, 5))
        s0 = float(rng.uniform(0.5, 2.0))
        per = rng.uniform(0.6, 1.6, D) * np.arange(2, D + 2)  # a round at depth k: around k + 1 rounds without drafts
        costs = (s0,) + tuple(float(x) for x in per * s0)
        t = CostTable(1.0, costs)
        g = Guard(jnp.asarray(costs, jnp.float32))
        B = int(rng.integers(1, 4))
        alphas = [np.ones((B, D)), rng.uniform(0, 1, (B, D)), np.full((B, D), 0.999)]
        if not t.drafting_can_pay():
            ruled_out += 1
            for a in alphas:
                assert (np.asarray(g.choose(g.init(B, D).replace(alpha=jnp.asarray(a, jnp.float32)))) == 0).all(), \
                    (costs, a)
        else:
            let_through += 1
            full = g.init(B, D).replace(alpha=jnp.ones((B, D), jnp.float32))
            assert (np.asarray(g.choose(full)) > 0).all(), costs
    assert ruled_out > 30 and let_through > 30
    assert not table((1.0, 2.01, 3.01)).drafting_can_pay()
    assert table((1.0, 2.0, 3.5)).drafting_can_pay()  # a tie is left to the device's rule


def test_a_guard_that_cannot_draft_runs_the_ar_program(pair):
    """Where no round can pay, `decode` runs AR's program: AR's tokens greedy and AR's very samples (same key), no
    draft, the guard's stats (depth 0, nothing speculated) at every step; a table that can pay keeps the strategy."""
    from jspec import api

    target, draft = pair
    chain = jspec.Chain(draft, gamma=3)
    st = api.start(target, PROMPTS, jspec.Guarded(chain, costs=table(DEAR)), max_new_tokens=8, eos_token_id=())
    assert st.parts is None and st.idle_guard == 3
    assert api.start(target, PROMPTS, jspec.Guarded(chain, costs=table(NEAR)), max_new_tokens=8,
                     eos_token_id=()).parts is not None
    assert api.start(target, PROMPTS, jspec.Guarded(chain, costs=table(DEAR), force=0), max_new_tokens=8,
                     eos_token_id=()).parts is not None  # a forced depth is what the cost measurement times
    for kw in ({}, dict(temperature=1.0, key=jax.random.key(3))):
        ar = jspec.decode(target, PROMPTS, max_new_tokens=12, eos_token_id=(), **kw)
        out = jspec.decode(target, PROMPTS, jspec.Guarded(chain, costs=table(DEAR)), max_new_tokens=12,
                           eos_token_id=(), **kw)
        np.testing.assert_array_equal(out.tokens, ar.tokens)
        assert (out.stats["drafted"] == 0).all() and out.stats["speculated_share"].tolist() == [0.0] * len(PROMPTS)
        assert out.stats["depth"].shape == out.stats["accepted"].shape and not out.stats["depth"].any()
        assert out.stats["accepted_per_position"].shape == (len(PROMPTS), 3)
    streamed = jspec.stream(target, PROMPTS, jspec.Guarded(chain, costs=table(DEAR)), max_new_tokens=12, every=4,
                            eos_token_id=())
    list(streamed)
    np.testing.assert_array_equal(streamed.output.tokens,
                                  jspec.decode(target, PROMPTS, max_new_tokens=12, eos_token_id=()).tokens)
    assert not streamed.output.stats["speculated"].any()


def test_sampling_stays_exact_when_no_row_drafts_and_when_half_the_rows_do():
    target, draft = close_pair()
    prompt = np.array([1, 4, 2])
    p = exact_joint(target, 3, prompt)
    rows = 6000
    for mask in (np.zeros(rows, bool), np.arange(rows) % 2 == 0):
        out = jspec.decode(target, np.tile(prompt, (rows, 1)), jspec.Chain(draft, gamma=2), max_new_tokens=3,
                           temperature=1.0, key=jax.random.key(1), eos_token_id=(), speculate=mask)
        counts = np.bincount(joint_index(out.tokens, 3), minlength=V ** 3)
        assert chi2_pvalue(counts, p) > 1e-3
        assert (out.stats["drafted"][~mask] == 0).all()


@pytest.mark.parametrize("rule", ["residual", "q1"])
def test_sampling_stays_exact_while_the_guard_switches_to_ar_rounds_and_back(rule):
    """The guard's own decisions, not a mask: each round follows the last one's first draft (rate 1), a row whose
    draft was rejected steps as AR and tries again one round later. Over 6,000 rows the first three tokens follow
    the target's exact distribution, and the rows' depths show both kinds of round and drafting after AR rounds
    (a rejection, an AR round, a try: the third token comes from a drafting round that follows an AR round)."""
    target, draft = close_pair()
    prompt = np.array([1, 4, 2])
    p = exact_joint(target, 3, prompt)
    rows = 6000
    s = jspec.Guarded(jspec.Chain(draft, gamma=2, rule=rule), costs=table(EVEN[:3]), rate=1.0, prior=0.8, retry=1,
                      max_wait=1)
    out = jspec.decode(target, np.tile(prompt, (rows, 1)), s, max_new_tokens=4, temperature=1.0,
                       key=jax.random.key(2), eos_token_id=())  # 4: the third round may draft (2 tokens left)
    counts = np.bincount(joint_index(out.tokens[:, :3], 3), minlength=V ** 3)
    assert chi2_pvalue(counts, p) > 1e-3
    depth, acc = np.asarray(out.stats["depth"]), np.asarray(out.stats["accepted"])
    live = acc > 0
    assert (depth[live] > 0).any() and (depth[live] == 0).any()  # both kinds of round were sampled through
    back = [(live[b, i] & live[b, i + 1]) and depth[b, i] == 0 and depth[b, i + 1] > 0
            for b in range(rows) for i in range(depth.shape[1] - 1)]
    assert sum(back) > rows // 20, sum(back)  # rows drafted again after an AR round
    assert not np.array_equal(out.stats["speculated_share"], np.ones(rows))


def test_the_cost_table_is_measured_per_depth_and_cached_on_disk(pair, tmp_path, monkeypatch):
    monkeypatch.setenv("JSPEC_COSTS_DIR", str(tmp_path))
    target, draft = pair
    s = jspec.Chain(draft, gamma=2)
    heard = []
    t = jspec.costs.measure(target, s, batch=2, prompt_len=12, reps=(2, 4), runs=1, progress=heard.append)
    assert len(t.step_s) == 3 and t.ar_s > 0 and all(x > 0 for x in t.step_s)
    assert t.drafted == (0.0, 1.0, 2.0)  # each forced depth offered that many drafts per row and round
    assert len(heard) == 2 and len(list(tmp_path.glob("*.json"))) == 1
    assert_provenance(json.loads(next(tmp_path.glob("*.json")).read_text())["provenance"])
    again = jspec.costs.measure(target, s, batch=2, prompt_len=12)
    assert again == t  # read back, not measured again
    assert jspec.costs.measure(target, s, batch=3, prompt_len=12, reps=(2, 4), runs=1).key != t.key
    from jspec.tools.report import cost_plot

    assert "depth" in t.format() and cost_plot(t, str(tmp_path / "c.png"))
    g = jspec.Guarded(s)
    jspec.decode(target, PROMPTS[:2], g, max_new_tokens=4, eos_token_id=())  # 2 rows, 14 tokens: the first table
    assert len(list(tmp_path.glob("*.json"))) == 2
    longer = [np.arange(20) % 97, np.arange(25) % 97]  # another cache length bucket: measured on the first call
    out = jspec.decode(target, longer, g, max_new_tokens=8, eos_token_id=())
    assert len(list(tmp_path.glob("*.json"))) == 3
    np.testing.assert_array_equal(out.tokens, jspec.decode(target, longer, max_new_tokens=8, eos_token_id=()).tokens)


def test_a_dear_round_is_timed_over_fewer_rounds():
    from jspec.engine.costs import rounds_for

    assert rounds_for(1.0, 4, 16) == (4, 16) and rounds_for(1.3, 4, 16) == (4, 16)  # a round cheaper than AR's
    assert rounds_for(0.5, 4, 16) == (2, 8) and rounds_for(1 / 25, 4, 16) == (1, 2) and rounds_for(0.0, 4, 16) == (1, 2)
    pairs = [rounds_for(x, 4, 16) for x in np.linspace(0.01, 1.0, 50)]
    assert all(1 <= a < b <= 16 for a, b in pairs) and pairs == sorted(pairs)


def test_a_table_key_depends_on_shapes_not_on_objects(pair):
    """Models and strategies built anew (another process's) find the same table on disk: the key holds no object's
    identity (the models' HF config enters by its content)."""
    from jspec.engine.costs import table_key

    def key(target, draft, gamma=2, hf=None):
        if hf is not None:
            target = dataclasses.replace(target, hf_config=hf, _hf_aux=None)
        return table_key(target, jspec.Chain(draft, gamma=gamma).parts(), 2, 12, 24)

    fresh = tiny_pair()
    assert key(*pair) == key(*fresh)
    assert key(*pair, hf={"a": 1}) == key(*fresh, hf={"a": 1})
    assert key(*pair, gamma=3) != key(*pair) and key(*pair, hf={"a": 2}) != key(*pair, hf={"a": 1})


def test_a_strategy_is_measured_within_the_models_positions(pair, tmp_path, monkeypatch):
    monkeypatch.setenv("JSPEC_COSTS_DIR", str(tmp_path))
    target, draft = pair
    mpe = target.config.max_position_embeddings
    s = jspec.Chain(draft, gamma=3)
    long = mpe - 2 - 4 * 10  # room for 10 rounds of 4 tokens: the default 16 would run past the positions
    t = jspec.costs.measure(target, s, batch=1, prompt_len=long, runs=1)
    assert len(t.step_s) == 4 and all(x > 0 for x in t.step_s) and t.drafted[1:] == (1.0, 2.0, 3.0)
    with pytest.raises(ValueError, match="leaves room for 1 rounds of depth 3 within the model's max_position"):
        jspec.costs.measure(target, s, batch=1, prompt_len=mpe - 2 - 4 - 2, runs=1, cache=False)


def test_bad_guards_are_refused(pair):
    target, draft = pair
    with pytest.raises(ValueError, match="Guarded wraps a speculative strategy"):
        jspec.Guarded(jspec.AR())
    with pytest.raises(ValueError, match="rate must be in"):
        jspec.Guarded(jspec.Chain(draft, gamma=2), rate=2.0)
    with pytest.raises(ValueError, match="covers depths 0 .. 3; the strategy drafts to depth 2"):
        jspec.decode(target, PROMPTS, jspec.Guarded(jspec.Chain(draft, gamma=2), costs=table(CHEAP)))


@pytest.mark.parametrize("rule", ["residual", "q1"])
@pytest.mark.parametrize("temperature,top_p", [(0.0, None), (1.0, None), (0.7, 0.9)])
def test_the_root_verdict_equals_the_rules_verdict_on_a_tree_that_offers_nothing(rule, temperature, top_p):
    """A round where no row drafts skips the walk over every node (`Rule.accept_root`): the same path, count and
    bonus token as the rule's own verdict on that tree, key for key; a tree that offers a draft differs."""
    from jspec.core import rowkeys as RK
    from jspec.core import sampling as SM
    from jspec.parts import rules, trees
    from jspec.parts.protocols import Proposal

    B, Vv = 4, 37
    tree = trees.build_tree([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
    t = trees.device_tree(tree, B)
    N, D, M = t.parent.shape[1], int(tree.depth.max()), t.children.shape[2]
    r = rules.as_rule(rule)
    cfg, sp = SM.make_sampling(temperature, None, top_p)
    logits = jax.random.normal(jax.random.PRNGKey(1), (B, N, Vv)) * 3
    q = jax.nn.softmax(jax.random.normal(jax.random.PRNGKey(2), (B, N, Vv)), axis=-1)
    tokens = jax.random.randint(jax.random.PRNGKey(3), (B, N), 0, Vv)
    only_root = jnp.zeros((B, N), bool).at[:, 0].set(True)
    prop = Proposal(tokens, only_root, t, q, None, jnp.zeros((B, Vv)))
    g = jnp.argmax(logits[:, 0], axis=-1)
    offers = prop._replace(tokens=tokens.at[:, 1].set(g), valid=only_root.at[:, 1].set(True))
    bonuses, took = set(), 0
    for seed in range(8):
        key = RK.for_rows(jax.random.PRNGKey(seed), B)
        full = r.accept(key, prop, logits, D, cfg, sp)
        root = r.accept_root(key, logits[:, 0], D, M, cfg, sp)
        for a, b in zip(full, root):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        bonuses.update(np.asarray(root.bonus).tolist())
        took += int(np.sum(np.asarray(r.accept(key, offers, logits, D, cfg, sp).accepted)))
    assert took > 0  # the control: a tree that offers the root's argmax gets drafts accepted
    assert (len(bonuses) > B) == (not cfg.greedy)  # sampled bonuses vary with the key, greedy ones do not


def _caches(started):
    return started.state.cache, started.state.aux.draft.cache


@pytest.mark.parametrize("make", ["chain", "tree", "layer_skip_tree"])
def test_each_cache_is_as_long_as_its_own_writes(pair, make):
    """The target's cache holds the committed tokens and the verify's scratch, as AR's does (a guarded round that
    drafts nothing reads no more of it than an AR step); the drafter's holds its catch-up feed too (the guard's
    deferred rounds). At the fullest the target's cache gets, the tokens are AR's."""
    from jspec import api
    from jspec.parts.drafters import layer_skip
    from strategies import SMALL_TREE, guarded

    target, draft = pair
    inner = {"chain": lambda: jspec.Chain(draft, gamma=3), "tree": lambda: jspec.Tree(draft, tree=SMALL_TREE),
             "layer_skip_tree": lambda: jspec.Tree(layer_skip.SkipDrafter((1,)), tree=SMALL_TREE)}[make]()
    strategy, longest = guarded(inner), max(len(p) for p in PROMPTS)
    needs = strategy.parts().needs
    assert needs.per_step >= needs.scratch + 24  # the deferred feed is the drafter's alone
    n = 40
    st = api.start(target, PROMPTS, strategy, max_new_tokens=n, eos_token_id=())
    ar = api.start(target, PROMPTS, None, max_new_tokens=n, eos_token_id=())
    tc, dc = _caches(st)
    assert tc.max_len == ar.state.cache.max_len == 64
    if dc is not None:
        assert dc.max_len >= longest + n + needs.per_step > tc.max_len
    # the fullest the target's cache gets (prompts unpadded: the widest is the longest); one token more needs more
    kw = dict(max_new_tokens=64 - longest - needs.scratch, eos_token_id=(), pad_prompt_to=1)
    assert _caches(api.start(target, PROMPTS, strategy, **kw))[0].max_len == 64
    assert _caches(api.start(target, PROMPTS, strategy, **{**kw, "max_new_tokens": kw["max_new_tokens"] + 1}))[0] \
        .max_len == 128
    out = jspec.decode(target, PROMPTS, strategy, **kw)
    np.testing.assert_array_equal(out.tokens, jspec.decode(target, PROMPTS, **kw).tokens)
    assert np.max(out.stats["accepted"]) >= 2
