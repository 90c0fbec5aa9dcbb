"""Each seam of the engine proven with a toy plug-in written against its protocol (tests/toy_parts.py): a
controller that reads the step record, a rule rebuilt from the hooks, a plan with per-row trees, a two-view
drafter, a prefill hook that reads the target's attention; and new numbers in a part do not recompile."""
import dataclasses

import jax
import jax.numpy as jnp
from flax import struct
import numpy as np
import pytest

import jspec
import ports
from jspec import api
from jspec.parts.drafters import ModelDrafter
from jspec.parts.plans import StaticPlan
from jspec.parts.trees import Layout, build_tree, chain
from sampling_check import exactness, tiny_vocab_pair
from tiny_pairs import PROMPTS, tiny_pair
from tolerances import assert_f32_close
from toy_parts import (AttendedPrompt, CycleDepth, FixedTrees, RecordingController, Relaxed, ResampleFromTarget,
                       ResidualByHooks, StopAt, TwoViews, attended, per_row_trees)

@pytest.fixture(scope="module")
def pair():
    return tiny_pair()


@pytest.fixture(scope="module")
def tiny():
    return tiny_vocab_pair()


def _full_logp(model, prompt, generated):
    """log p(generated[i] | prompt, generated[:i]) for i >= 1 from one full-sequence forward."""
    seq = np.concatenate([prompt, generated])[None]
    lp = np.asarray(jax.nn.log_softmax(ports.logits(model, seq)[0], axis=-1))
    L = len(prompt)
    return np.array([lp[L - 1 + i, generated[i]] for i in range(1, len(generated))])


def test_controller_reads_the_record(pair):
    """The record's target and draft distributions at the accepted path are the ones a full forward gives at
    those positions, for every committed token."""
    target, draft = pair
    ar = jspec.decode(target, PROMPTS, max_new_tokens=20, eos_token_id=())
    for strat in (jspec.Chain(draft, gamma=3, controller=RecordingController()),
                  jspec.Tree(draft, tree="mc_sim_7b_63", controller=RecordingController())):
        s = api.start(target, PROMPTS, strat, max_new_tokens=20, eos_token_id=())
        state = s.run()
        rec = jax.device_get(state.aux.ctrl)
        out = np.asarray(state.out)
        np.testing.assert_array_equal(out[:, :20], ar.tokens)
        for b, prompt in enumerate(PROMPTS):
            gen = out[b, :20]
            assert rec["n"][b] == 19  # every token after the prefill's came from a step's record
            assert_f32_close(rec["t"][b, :19], _full_logp(target, prompt, gen), atol=2e-4)
            known = rec["q_known"][b, :19]
            assert known.sum() >= 10  # most positions were drafted from (not the bonus after a fully accepted leaf)
            assert_f32_close(rec["q"][b, :19][known], _full_logp(draft, prompt, gen)[known], atol=2e-4)


def test_rule_from_hooks_is_exact_and_a_wrong_rule_is_caught(tiny):
    target, draft = tiny
    pval, tv, out = exactness(target, dataclasses.replace(jspec.Chain(draft, gamma=2), rule=ResidualByHooks()))
    assert pval > 1e-3, (pval, tv)
    assert out.stats["mean_accepted"].mean() > 1.1
    pval, tv, _ = exactness(target, dataclasses.replace(jspec.Chain(draft, gamma=2), rule=ResampleFromTarget()))
    assert pval < 1e-6, (pval, tv)  # the same check fails a rule that resamples from p after a rejection


@pytest.mark.slow  # SAGE's per-row trees prove it in the default suite (conformance entry "sage", tests/test_sage.py)
def test_per_row_trees_from_the_controller(pair):
    """Row 0 drafts a 3-deep chain, row 1 three siblings with one child each, in one layout and one program."""
    target, draft = pair
    layout = Layout(widths=(3, 3, 1), children=(3, 1, 1))
    chain3 = [(1, 0, 0), (4, 1, 0), (7, 4, 0)]
    wide = [(1, 0, 0), (2, 0, 1), (3, 0, 2), (4, 1, 0), (5, 2, 0), (6, 3, 0)]
    trees = per_row_trees(layout.levels, [chain3, wide])
    strat = jspec.Speculative(ModelDrafter(draft), StaticPlan.of(build_tree(chain(1), layout)), "residual",
                              FixedTrees(trees))
    ar = jspec.decode(target, PROMPTS, max_new_tokens=24, eos_token_id=())
    sd = jspec.decode(target, PROMPTS, strategy=strat, max_new_tokens=24, eos_token_id=())
    np.testing.assert_array_equal(sd.tokens, ar.tokens)
    steps, acc = sd.stats["steps"], sd.stats["accepted"]
    assert sd.stats["drafted"].tolist() == [3 * steps[0], 6 * steps[1], 3 * steps[2]]
    # each row steps exactly as its tree run alone as a plain strategy (the chain also padded into the layout)
    plain = {t: jspec.decode(target, PROMPTS, strategy=s, max_new_tokens=24, eos_token_id=()).stats["accepted"]
             for t, s in (("chain", jspec.Chain(draft, gamma=3)),
                          ("padded", jspec.Tree(draft, tree=chain(3), budget=layout)),
                          ("wide", jspec.Tree(draft, tree=[[0], [1], [2], [0, 0], [1, 0], [2, 0]])))}
    np.testing.assert_array_equal(plain["padded"], plain["chain"])
    for b, t in ((0, "chain"), (1, "wide"), (2, "chain")):
        np.testing.assert_array_equal(acc[b, :steps[b]], plain[t][b, :steps[b]])


def test_two_view_drafter_greedy_and_exact(pair, tiny):
    target, draft = pair
    views = lambda d, w: jspec.Speculative(TwoViews(ModelDrafter(d), ModelDrafter(d), jnp.asarray(w)),
                                           StaticPlan.of(build_tree(chain(3))))
    ar = jspec.decode(target, PROMPTS, max_new_tokens=16)
    sd = jspec.decode(target, PROMPTS, strategy=views(draft, [0.5, 0.5]), max_new_tokens=16)
    np.testing.assert_array_equal(sd.tokens, ar.tokens)
    n = api._decode_sd._cache_size()
    other = jspec.decode(target, PROMPTS, strategy=views(draft, [0.9, 0.1]), max_new_tokens=16)
    assert api._decode_sd._cache_size() == n  # new weights, same program
    np.testing.assert_array_equal(other.tokens, ar.tokens)
    assert not np.array_equal(other.stats["accepted"], sd.stats["accepted"])  # the weights do change the drafts
    t, d = tiny
    pval, tv, out = exactness(t, views(d, [0.3, 0.7]))
    assert pval > 1e-3, (pval, tv)
    assert out.stats["mean_accepted"].mean() > 1.1


def test_prefill_hook_sees_the_target_attention(pair):
    """The hook picks the draft's prompt from the target prefill's attention inside the prefill program: the same
    decode as handing that prompt over by hand."""
    target, draft = pair
    hooked = dataclasses.replace(jspec.Chain(draft, gamma=3).parts(), prefill=AttendedPrompt())
    sd = jspec.decode(target, PROMPTS, strategy=hooked, max_new_tokens=16)
    by_hand = jspec.decode(target, PROMPTS, strategy=jspec.Chain(draft, gamma=3), max_new_tokens=16,
                           draft_prompt=attended(target, PROMPTS))
    np.testing.assert_array_equal(sd.tokens, jspec.decode(target, PROMPTS, max_new_tokens=16).tokens)
    np.testing.assert_array_equal(sd.stats["accepted"], by_hand.stats["accepted"])
    full = jspec.decode(target, PROMPTS, strategy=jspec.Chain(draft, gamma=3), max_new_tokens=16)
    assert not np.array_equal(full.stats["accepted"], sd.stats["accepted"])  # the pruned view drafts differently


def test_new_numbers_in_a_rule_or_controller_do_not_recompile(pair, tiny):
    target, draft = pair
    base = jspec.Chain(draft, gamma=4)
    a = jspec.decode(target, PROMPTS, strategy=dataclasses.replace(base, controller=CycleDepth(jnp.int32(3))),
                     max_new_tokens=20, eos_token_id=())
    n = api._decode_sd._cache_size()
    b = jspec.decode(target, PROMPTS, strategy=dataclasses.replace(base, controller=CycleDepth(jnp.int32(2))),
                     max_new_tokens=20, eos_token_id=())
    assert api._decode_sd._cache_size() == n
    for out, period in ((a, 3), (b, 2)):  # the decided depths are in the stats, per row and step
        steps = out.stats["steps"][0]
        np.testing.assert_array_equal(out.stats["depth"][0, :steps], 1 + np.arange(steps) % period)
    t, d = tiny
    prompt = np.tile([1, 4, 2], (2000, 1))
    runs = {}
    for lam in (1.0, 3.0):
        strat = dataclasses.replace(jspec.Chain(d, gamma=2), rule=Relaxed(jnp.float32(lam)))
        runs[lam] = jspec.decode(t, prompt, strategy=strat, max_new_tokens=6, temperature=1.0, eos_token_id=(),
                                 key=jax.random.key(3))
        if lam == 1.0:
            n = api._decode_sd._cache_size()
    assert api._decode_sd._cache_size() == n
    assert runs[3.0].stats["acceptance_rate"].mean() > runs[1.0].stats["acceptance_rate"].mean() + 0.05


def test_a_part_without_its_base_class_is_named(pair):
    """A duck-typed drafter (every method, no base) is refused before any compute, naming the base to subclass."""
    target, draft = pair

    class Loose:
        def __getattr__(self, name):
            return getattr(ModelDrafter(draft), name)

    parts = dataclasses.replace(jspec.Chain(draft, gamma=2).parts(), drafter=Loose())
    with pytest.raises(ValueError, match="must be a jspec.parts.drafters.Drafter"):
        jspec.decode(target, PROMPTS[0], parts, max_new_tokens=4)


@struct.dataclass
class SeesGenerated(ModelDrafter):
    """Drafts the token generated two steps before `last` (the generated text, `DraftEnv.out`), else the model's."""

    def root(self, env, ds):
        logp, aux, ds = ModelDrafter.root(self, env, ds)
        assert env.out is not None and env.n_out.shape == env.last.shape
        prev = jnp.take_along_axis(env.out, jnp.maximum(env.n_out - 2, 0)[:, None], axis=1)[:, 0]
        forced = jnp.where(jnp.arange(logp.shape[-1])[None] == prev[:, None], 0.0, -jnp.inf)
        return jnp.where((env.n_out >= 2)[:, None, None], forced[:, None], logp), aux, ds


def test_a_drafter_sees_the_generated_tokens(pair):
    """The drafter reads the committed text from `DraftEnv.out`: drafting the token two before `last` is lossless
    and its first drafts are exactly those tokens."""
    target, draft = pair
    parts = dataclasses.replace(jspec.Chain(draft, gamma=1).parts(), drafter=SeesGenerated(draft))
    out = jspec.decode(target, PROMPTS, parts, max_new_tokens=12, eos_token_id=())
    ar = jspec.decode(target, PROMPTS, max_new_tokens=12, eos_token_id=())
    np.testing.assert_array_equal(out.tokens, ar.tokens)
    toks, acc = np.asarray(ar.tokens), np.asarray(out.stats["accepted"])
    assert (acc == 2).any()  # row 0 repeats a token two apart: some drafts are accepted
    for b in range(len(PROMPTS)):
        pos = 1  # the first token comes from the prefill
        for c in acc[b]:
            if c == 2:  # the step's draft (position pos) was accepted: it was the token two before it
                assert pos >= 2 and toks[b, pos] == toks[b, pos - 2]
            pos += int(c)


def test_needs_are_worked_out_from_the_parts(pair):
    """`Speculative.needs` says what the step computes from all its parts at once: the controller's asks, whether
    the rule draws, who reads the target's hidden states, whether drafts stop per level, the cache slots a step
    uses."""
    from jspec.parts.controllers import Asks
    from jspec.parts.drafters.eagle import EagleDrafter

    target, draft = pair
    chain = jspec.Chain(draft, gamma=3).parts()
    n = chain.needs
    assert (n.asks, n.draws, n.hidden, n.prefill_hidden, n.stops, n.depth) == (Asks(), True, False, False, False, 3)
    assert n.scratch == chain.plan.scratch and n.per_step == chain.plan.scratch + 3 + 1
    assert not jspec.Chain(draft, gamma=3, rule="q1").parts().needs.draws
    rec = jspec.Tree(draft, tree="mc_sim_7b_63", controller=RecordingController()).parts().needs
    assert rec.asks.target_logits and rec.asks.draft_probs and rec.depth == 5 and not rec.stops
    eagle = dataclasses.replace(chain, drafter=EagleDrafter(None))
    assert eagle.needs.hidden and not eagle.needs.prefill_hidden  # the drafter reads them, the controller not
    assert dataclasses.replace(chain, controller=StopAt(jnp.int32(2))).needs.stops


def test_a_stopped_draft_is_the_step_s_one_depth(pair):
    """A controller's per-level stop lowers the depth the proposal carries (`decision.depth`): the kept stats, the
    record and what was drafted all say depth 2 under a depth-4 plan, and the tokens stay AR's."""
    target, draft = pair
    ar = jspec.decode(target, PROMPTS, max_new_tokens=16, eos_token_id=())
    for strat in (jspec.Chain(draft, gamma=4, controller=StopAt(jnp.int32(2))),
                  jspec.Tree(draft, tree=[[0], [1], [0, 0], [0, 0, 0], [0, 0, 0, 0]], controller=StopAt(jnp.int32(2)))):
        out = jspec.decode(target, PROMPTS, strat, max_new_tokens=16, eos_token_id=())
        np.testing.assert_array_equal(out.tokens, ar.tokens)
        steps = np.asarray(out.stats["steps"])
        depth, acc = np.asarray(out.stats["depth"]), np.asarray(out.stats["accepted"])
        for b in range(len(PROMPTS)):
            assert (depth[b, :steps[b]] == 2).all()
            assert acc[b, :steps[b]].max() <= 3  # at most 2 drafts + the bonus
        assert acc.max() == 3  # some step accepted both drafts: the limit, not a shorter draft, capped it


def test_a_part_written_against_the_old_method_names_is_named():
    """A controller defining `plan` (now `decide`) or a rule overriding `verify` (now `accept`) would be silently
    ignored by the engine: it is refused before any compute, naming the new method."""
    from jspec.parts.controllers import Controller, Decision

    class Old(Controller):
        def plan(self, state, key):
            return Decision()

    target, draft = tiny_pair()
    with pytest.raises(ValueError, match="now `decide`"):
        jspec.decode(target, PROMPTS, jspec.Chain(draft, gamma=2, controller=Old()), max_new_tokens=4)
    jspec.decode(target, PROMPTS, jspec.Chain(draft, gamma=2, controller=jspec.FixedK(2)), max_new_tokens=4)
