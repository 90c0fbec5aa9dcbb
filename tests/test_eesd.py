"""EESD: the early-exit drafter runs the target's own first N layers (a head that copies the rest of the target
drafts exactly what the target would, so every draft is accepted), holds no copy of them, saves and loads in the
PyTorch layout, and refuses what it cannot run; the Beta-TS controller's posterior update table and its draft-length
distribution; the depth a controller picks changes no compiled program. Greedy == AR, rows independent, exact
sampling and the 8-device mesh: tests/strategies.py registers EESD with the conformance suite."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
import ports
from jspec import api
from jspec.parts.controllers import Record
from jspec.parts.controllers import calibration as CAL
from jspec.parts.controllers.draft_length import BetaTS, FixedK, leading_ones
from jspec.parts.drafters import early_exit as EE
from ports.core import layers as LY
from tiny_pairs import CFG, PROMPTS, tiny_pair


@pytest.fixture(scope="module")
def pair():
    return tiny_pair()


@pytest.mark.parametrize("fast", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["chain", "and_tree"])
def test_a_head_that_copies_the_rest_of_the_target_drafts_what_the_target_says(pair, fast):
    """Exit after layer 1 of 3 with a head of the target's layers 2-3, norm and LM head: the drafter computes the
    target's own function through the shared layers' two-source attention, so every draft is accepted (greedy and
    sampled), in a chain and in a tree."""
    target, _ = pair
    head = EE.init_head(target, exit_layer=1, num_layers=2)
    ar = jspec.decode(target, PROMPTS, max_new_tokens=20, eos_token_id=())
    for tree in (None, [[0], [1], [0, 0], [1, 0], [0, 0, 0]])[:1 if fast else 2]:
        strat = jspec.EESD(head, controller=4, k_max=4, tree=tree)
        out = jspec.decode(target, PROMPTS, strat, max_new_tokens=20, eos_token_id=())
        np.testing.assert_array_equal(out.tokens, ar.tokens)
        full = 5 if tree is None else 4     # depth 4 (chain, FixedK(4)) or the tree's depth 3, + the bonus
        acc = out.stats["accepted"]
        assert (acc[:, :3] == full).all(), acc
        sampled = jspec.decode(target, PROMPTS, strat, max_new_tokens=20, eos_token_id=(), temperature=1.0,
                               key=jax.random.key(4))
        assert (sampled.stats["accepted"][:, :3] == full).all()


def test_two_source_attention_equals_attention_over_the_joined_cache():
    rng = np.random.default_rng(0)
    B, T, H, KVH, Dh, Sa, Sb = 2, 3, 4, 2, 8, 7, 5
    q = jnp.asarray(rng.normal(size=(B, T, H, Dh)), jnp.float32)
    ka, va = (jnp.asarray(rng.normal(size=(B * KVH, Sa, Dh)), jnp.float32) for _ in range(2))
    kb, vb = (jnp.asarray(rng.normal(size=(B * KVH, Sb, Dh)), jnp.float32) for _ in range(2))
    vis_a = jnp.asarray(rng.random((B, T, Sa)) < 0.6).at[:, :, 0].set(True)
    vis_b = jnp.asarray(rng.random((B, T, Sb)) < 0.5)
    got = EE.two_source_attention(q, ka, va, vis_a, kb, vb, vis_b)
    want = LY.attention(q, jnp.concatenate([ka, kb], 1), jnp.concatenate([va, vb], 1),
                       jnp.concatenate([vis_a, vis_b], -1))
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_the_drafter_holds_only_its_own_layers_and_head(pair):
    target, _ = pair
    D, V = CFG.hidden_size, CFG.vocab_size
    layer_bytes = sum(a.nbytes for a in jax.tree.leaves(target.params["layers"][0]))
    for k in (0, 1, 2):
        drafter = EE.EarlyExitDrafter(EE.init_head(target, exit_layer=1, num_layers=k))
        held = sum(a.nbytes for a in jax.tree.leaves(drafter))
        assert held == k * layer_bytes + 4 * (D + D * V)
    assert EE.init_head(target, 1, 0).num_params == D + D * V   # the head-only ablation


def test_a_head_sharing_the_target_lm_head(pair, tmp_path):
    """`share_lm_head`: the head holds no LM head and drafts through the target's (a head of the target's layers 2-3
    and norm over it is the target's own function: every draft accepted); it saves without `lm_head.weight`, loads
    as shared, and its logits need the target's LM params."""
    target, _ = pair
    D = CFG.hidden_size
    layer_bytes = sum(a.nbytes for a in jax.tree.leaves(target.params["layers"][0]))
    tied = ports.random_model(dataclasses.replace(CFG, tie_word_embeddings=True), key=3, std=0.3)
    for t in (target, tied):  # the target's untied LM head, and its embedding table (SmolLM2's case)
        head = EE.init_head(t, exit_layer=1, num_layers=2, share_lm_head=True)
        assert head.shares_lm_head and "lm_head" not in head.params
        assert sum(a.nbytes for a in jax.tree.leaves(EE.EarlyExitDrafter(head))) == 2 * layer_bytes + 4 * D
        ar = jspec.decode(t, PROMPTS, max_new_tokens=16, eos_token_id=())
        out = jspec.decode(t, PROMPTS, jspec.EESD(head, controller=4, k_max=4), max_new_tokens=16, eos_token_id=())
        np.testing.assert_array_equal(out.tokens, ar.tokens)
        assert (out.stats["accepted"][:, :2] == 5).all(), out.stats["accepted"]
    head = EE.init_head(target, exit_layer=1, num_layers=2, share_lm_head=True)
    EE.save_head(head, target, str(tmp_path / "h"))
    assert "lm_head.weight" not in EE.torch_state_dict(head, CFG)
    back = EE.load_head(str(tmp_path / "h"), target)
    assert back.shares_lm_head and back.num_params == head.num_params
    with pytest.raises(ValueError, match="shares the target's LM head: pass"):
        EE.head_logits(back.params, jnp.zeros((1, 1, D)))
    with pytest.raises(ValueError, match=r"lack \['lm_head.weight'\]"):
        EE.from_torch_state_dict(EE.torch_state_dict(head, CFG), CFG, 1, head.target)
    with pytest.raises(ValueError, match="shares the target's LM head"):
        EE.from_torch_state_dict(EE.torch_state_dict(EE.init_head(target, 1), CFG), CFG, 1, head.target, True)


def test_bad_inputs_are_refused(pair):
    target, draft = pair
    with pytest.raises(ValueError, match="out of range"):
        EE.init_head(target, exit_layer=3)
    with pytest.raises(ValueError, match="out of range"):
        EE.init_head(target, exit_layer=0)
    with pytest.raises(ValueError, match="k_max"):
        jspec.EESD(EE.init_head(target, 1), k_max=0)
    with pytest.raises(ValueError, match="fixed draft length"):
        jspec.decode(target, PROMPTS, jspec.EESD(EE.init_head(target, 1), controller=0), max_new_tokens=4)
    other = ports.random_model(CFG, key=77)
    with pytest.raises(ValueError, match="made for another target"):
        jspec.decode(other, PROMPTS, jspec.EESD(EE.init_head(target, 1)), max_new_tokens=4)
    with pytest.raises(ValueError, match="LLaMA-family"):
        EE.text_model(type("M", (), {"config": type("C", (), {"model_type": "chameleon"})(), "params": {}})())
    with pytest.raises(ValueError, match="draft_prompt does not apply"):
        jspec.decode(target, PROMPTS, jspec.EESD(EE.init_head(target, 1)), max_new_tokens=4, draft_prompt=PROMPTS)


def test_head_saves_and_loads_in_the_pytorch_layout(pair, tmp_path):
    target, _ = pair
    head = EE.init_head(target, exit_layer=1, num_layers=1)
    head = head.replace(params=jax.tree.map(lambda a: a + 0.01 * jnp.arange(a.size).reshape(a.shape) / a.size,
                                            head.params))
    EE.save_head(head, target, str(tmp_path / "h"))
    sd = EE.torch_state_dict(head, CFG)
    assert sd["lm_head.weight"].shape == (CFG.vocab_size, CFG.hidden_size)
    assert sd["layers.0.self_attn.q_proj.weight"].shape == (CFG.num_heads * CFG.head_dim, CFG.hidden_size)
    assert {"norm.weight", "layers.0.mlp.down_proj.weight", "layers.0.input_layernorm.weight"} <= set(sd)
    back = EE.load_head(str(tmp_path / "h"), target)
    assert back.exit_layer == 1 and back.target == head.target
    for a, b in zip(jax.tree.leaves(head.params), jax.tree.leaves(back.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="made for another target"):
        EE.load_head(str(tmp_path / "h"), ports.random_model(CFG, key=5))
    with pytest.raises(ValueError, match="holds no early-exit head"):
        EE.load_head(str(tmp_path), target)


def _record(accepted, drafted, active=None):
    a = jnp.asarray(accepted, jnp.int32)
    z = jnp.zeros_like(a)
    return Record(accepted=a, committed=a + 1, active=jnp.ones(a.shape, bool) if active is None else
                  jnp.asarray(active), depth=jnp.asarray(drafted), drafted=jnp.asarray(drafted), path=z[:, None],
                  on_path=z[:, None] > 0, tokens=z[:, None])


def test_beta_ts_update_table():
    """alpha += accepted; beta += min(2, drafted - accepted): all accepted 0, the last rejected 1, an earlier one 2
    (`clean`: 1 for any rejection); finished rows are left alone."""
    ts = BetaTS(1.0, 1.0)
    s = ts.init(5, 8)
    s = ts.observe(s, _record([5, 4, 1, 0, 3], [5, 5, 5, 3, 5], [True, True, True, True, False]))
    np.testing.assert_array_equal(s.alpha, [6, 5, 2, 1, 1])
    np.testing.assert_array_equal(s.beta, [1, 2, 3, 3, 1])
    clean = BetaTS(1.0, 1.0, clean=True)
    c = clean.observe(clean.init(3, 8), _record([5, 4, 1], [5, 5, 5]))
    np.testing.assert_array_equal(c.beta, [1, 2, 2])


def test_v_d_r_d_and_hm_are_eq_11_and_12_and_their_harmonic_mean():
    """On a hand-built decode: v_d = right drafts / drafted (Eq. 11), r_d = right drafts / output tokens (Eq. 12),
    HM = 2 v_d r_d / (v_d + r_d) x 100; a row that drafted and never hit has 0, one that never drafted NaN."""
    B, steps = 3, 4
    out = np.arange(B * 12).reshape(B, 12) % 7
    n_out = np.array([9, 3, 1])  # row 0: prefill token + 3 + 1 + 4; row 1: prefill + 1 + 1; row 2: prefill only
    committed = np.array([[3, 1, 4, 0], [1, 1, 0, 0], [0, 0, 0, 0]])  # per step, the bonus included
    drafted = np.array([12, 8, 0])
    st = api.finish(out, n_out, steps, committed, drafted, 12, 0, {}, depth=4).stats
    right = np.array([(3 - 1) + (1 - 1) + (4 - 1), 0, 0])  # accepted drafts: each step's committed less its bonus
    np.testing.assert_array_equal(st["accepted_drafts"], right)
    np.testing.assert_allclose(st["acceptance_rate"][:2], [5 / 12, 0.0])  # v_d
    np.testing.assert_allclose(st["r_d"][:2], [5 / 9, 0.0])
    np.testing.assert_allclose(st["hm"][:2], [100 * 2 * (5 / 12) * (5 / 9) / (5 / 12 + 5 / 9), 0.0])
    np.testing.assert_allclose(st["hm"][0], 47.6190476, rtol=1e-7)  # 1800 / 3780 x 100, by hand
    assert np.isnan(st["acceptance_rate"][2]) and np.isnan(st["r_d"][2]) and np.isnan(st["hm"][2])
    np.testing.assert_allclose(st["mean_accepted"][:2], [8 / 3, 1.0])
    # per draft position (vLLM's and SGLang's): rounds whose path reached it; row 0's paths reached 2, 0 and 3
    np.testing.assert_array_equal(st["accepted_per_position"], [[2, 2, 1, 0], [0, 0, 0, 0], [0, 0, 0, 0]])
    np.testing.assert_allclose(st["acceptance_per_position"][:2], [[2 / 3, 2 / 3, 1 / 3, 0], [0, 0, 0, 0]])
    assert np.isnan(st["acceptance_per_position"][2]).all()


def test_beta_ts_draft_lengths_follow_the_posterior():
    """With the posterior concentrated at theta, P(depth > i) = theta^i (capped at the plan's depth); a round drafts
    at least one token."""
    assert list(leading_ones(jnp.asarray([[1, 1, 0, 1], [0, 1, 1, 1], [1, 1, 1, 1]], bool))) == [2, 0, 4]
    theta, K, B = 0.7, 6, 20000
    ts = BetaTS(theta * 1e5, (1 - theta) * 1e5)
    depth = np.asarray(ts.decide(ts.init(B, K), jax.random.split(jax.random.key(0), B)).depth)  # a key per row
    assert depth.min() >= 1 and depth.max() == K
    for i in range(1, K):
        assert abs((depth > i).mean() - theta ** i) < 0.015, i
    flat = BetaTS(1.0, 1.0)       # uniform theta: P(depth > 1) = E[theta] = 1/2
    d = np.asarray(flat.decide(flat.init(B, K), jax.random.split(jax.random.key(1), B)).depth)
    assert abs((d > 1).mean() - 0.5) < 0.015


@pytest.mark.slow  # the conformance suite proves it for eesd_cali in the default run
def test_controllers_change_the_depth_without_recompiling(pair):
    target, draft = pair
    head = EE.init_head(target, 1, 1)
    outs = {}
    for i, ctl in enumerate((FixedK(jnp.int32(2)), FixedK(jnp.int32(5)))):
        outs[i] = jspec.decode(target, PROMPTS, jspec.EESD(head, controller=ctl, k_max=8), max_new_tokens=16)
        if i == 0:
            n = api._decode_sd._cache_size(), api._prefill_sd._cache_size()
    assert (api._decode_sd._cache_size(), api._prefill_sd._cache_size()) == n
    assert (outs[0].stats["depth"] == 2).all() and (outs[1].stats["depth"] == 5).all()
    for a0 in (1.0, 9.0):
        jspec.decode(target, PROMPTS, jspec.EESD(head, controller=BetaTS(a0, 1.0), k_max=8), max_new_tokens=16)
        if a0 == 1.0:
            n = api._decode_sd._cache_size()
    assert api._decode_sd._cache_size() == n
    # Beta-TS in place of a separate draft's fixed gamma (EESD Table 5)
    chain = jspec.decode(target, PROMPTS, jspec.Chain(draft, gamma=8, controller=BetaTS()), max_new_tokens=16)
    np.testing.assert_array_equal(chain.tokens, outs[0].tokens)
    assert len(set(chain.stats["depth"][0].tolist())) > 1


def test_verify_buckets_cover_the_levels():
    from jspec.parts.plans import StaticPlan
    from jspec.parts.trees import build_tree, chain

    plan = StaticPlan.of(build_tree(chain(32)))
    assert plan.verify_buckets == ((2, 3), (8, 9), (32, 33))  # each bucket is a target forward: 4x apart
    tree = StaticPlan.of(build_tree([[0], [1], [0, 0], [1, 0], [0, 0, 0]]))
    assert tree.verify_buckets == ((2, 5), (3, 6))


def test_exit_layer_hidden_states_come_from_the_target_prefill(pair):
    """The drafter asks the target's prefill for layer N's states; a prefill hook asking for another layer gets
    its own beside them."""
    target, _ = pair
    head = EE.init_head(target, 2, 1)
    parts = dataclasses.replace(jspec.EESD(head, k_max=4).parts(), prefill=_AsksLayer1())
    assert api._prefill_asks(parts, None, None, None, 2) == {"hidden_layers": (1, 2)}
    out = jspec.decode(target, PROMPTS, parts, max_new_tokens=8, eos_token_id=())
    np.testing.assert_array_equal(out.tokens, jspec.decode(target, PROMPTS, max_new_tokens=8, eos_token_id=()).tokens)


class _AsksLayer1(jspec.PrefillHook):
    def asks(self, tokens, lengths, inputs):
        return {"hidden_layers": (1,)}

    def draft_prompt(self, prefill, prompt):
        assert prefill.hidden_at(1).shape == prefill.hidden_at(2).shape
        return prompt


# --------------------------------------------------------------------------------------------------- Cali-TS


def _cali(target, bias, **kw):
    """A Cali-TS whose predictor says `bias` (2-way logits) whatever the states (W_p = 0)."""
    pred = CAL.init_predictor(jax.random.key(0), target.config.hidden_size)
    return CAL.CaliTS(pred.replace(wp=jnp.zeros_like(pred.wp), bp=jnp.asarray(bias, jnp.float32)), **kw)


def test_cali_ts_blend_limits():
    """Eq. 6-7: no verification yet -> mu = theta_M, sigma^2 = sigma_M^2; many -> mu -> theta_hat, sigma^2 -> 0;
    in between mu lies between the two and sigma^2 = 1 / (1 / sigma_M^2 + n / sigma_S^2)."""
    tm, th, sm, ss = 0.9, 0.3, 0.2, 0.5
    mu, var = CAL.blend(tm, 0.0, th, sm, ss)
    assert np.isclose(mu, tm) and np.isclose(var, sm ** 2)
    mu, var = CAL.blend(tm, 1e7, th, sm, ss)
    assert abs(mu - th) < 1e-5 and var < 1e-7
    for n in (1.0, 5.0, 30.0):
        mu, var = CAL.blend(tm, n, th, sm, ss)
        assert th < mu < tm
        assert np.isclose(1 / var, 1 / sm ** 2 + n / ss ** 2, rtol=1e-5)
    assert CAL.blend(tm, 5.0, th, sm, ss)[0] < CAL.blend(tm, 1.0, th, sm, ss)[0]


def test_cali_ts_running_rate(pair):
    """theta_hat = (theta0 + sum accepted) / (1 + sum Beta-TS trials); the literal Eq. 8 counts every committed
    token a success and goes to 1 even when nothing is ever accepted; finished rows are left alone."""
    target, _ = pair
    ts = _cali(target, [0.0, 0.0])
    s = ts.observe(ts.init(3, 8), _record([5, 1, 0], [5, 5, 5], [True, True, False]))
    np.testing.assert_allclose(s.theta_hat, [(0.5 + 5) / 6, (0.5 + 1) / 4, 0.5])
    np.testing.assert_array_equal(s.n, [1, 1, 0])
    lit = _cali(target, [0.0, 0.0], literal_eq8=True)
    s = lit.init(1, 8)
    for _ in range(200):
        s = lit.observe(s, _record([0], [5]))
    assert s.theta_hat[0] > 0.99
    d = ts.init(1, 8)
    for _ in range(200):
        d = ts.observe(d, _record([0], [5]))
    assert d.theta_hat[0] < 0.01


def test_cali_ts_ends_drafts_where_the_predictor_says_and_keeps_the_output(pair):
    """A predictor sure of rejection drafts one token a round (theta ~ N(0, sigma_M^2) clipped, so mostly 1); one
    sure of acceptance drafts to k_max (sigma_S large: the running rate barely moves mu); the depth is decided level
    by level inside the draft and the output is the target's (greedy) in a chain and a tree; the predictor's
    numbers are data (no recompilation)."""
    target, _ = pair
    head = EE.init_head(target, 1, 1)
    ar = jspec.decode(target, PROMPTS, max_new_tokens=24, eos_token_id=())
    depths = {}
    for name, bias in (("never", [8.0, -8.0]), ("always", [-8.0, 8.0])):
        out = jspec.decode(target, PROMPTS, jspec.EESD(head, controller=_cali(target, bias, sigma_m=0.01, sigma_s=50.0),
                                                         k_max=4),
                           max_new_tokens=24, eos_token_id=())
        np.testing.assert_array_equal(out.tokens, ar.tokens)
        depths[name] = out.stats["depth"]
        if name == "never":
            n = api._decode_sd._cache_size()
    assert api._decode_sd._cache_size() == n
    assert (depths["never"] == 1).mean() > 0.9
    assert (depths["always"] == 4).mean() > 0.9
    tree = jspec.EESD(head, controller=_cali(target, [0.0, 0.0]), k_max=4, tree=[[0], [1], [0, 0], [1, 0], [0, 0, 0]])
    np.testing.assert_array_equal(jspec.decode(target, PROMPTS, tree, max_new_tokens=24, eos_token_id=()).tokens,
                                  ar.tokens)


def test_cali_ts_saves_beside_the_head_and_is_checked(pair, tmp_path):
    target, draft = pair
    head = EE.init_head(target, 1, 1)
    EE.save_head(head, target, str(tmp_path))
    with pytest.raises(ValueError, match="calibration predictor"):
        jspec.EESD(EE.load_head(str(tmp_path), target), controller="cali").parts()
    pred = CAL.init_predictor(jax.random.key(3), target.config.hidden_size)
    CAL.save_calibration(pred, str(tmp_path))
    loaded = EE.load_head(str(tmp_path), target)
    for a, b in zip(jax.tree.leaves(pred), jax.tree.leaves(loaded.calibration)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    parts = jspec.EESD(loaded, controller="cali").parts()
    assert isinstance(parts.controller, CAL.CaliTS) and parts.drafter.head.calibration is None
    with pytest.raises(ValueError, match="does not give them"):   # a separate draft has no head states to read
        jspec.decode(target, PROMPTS, jspec.Chain(draft, gamma=4, controller=parts.controller), max_new_tokens=4)
    with pytest.raises(ValueError, match="cannot stop there"):
        jspec.decode(target, PROMPTS, jspec.DynamicTree(draft, depth=3, top_k=2, total=4,
                                                         controller=parts.controller), max_new_tokens=4)


@pytest.mark.slow
def test_the_zoo_heads_load_and_decode_as_the_target():
    """Every shipped early-exit head loads against the zoo text target (the main one with its Cali-TS predictor), and
    Cali-TS decodes the target's own greedy tokens with it."""
    from jspec.tools import zoo

    target = zoo.load("text-target")
    heads = sorted(p for p in zoo.ZOO_DIR.iterdir() if (p / EE.CONFIG_NAME).exists())
    assert {p.name for p in heads} >= {"text-target-eesd-n1", "text-target-eesd-n1-k0", "text-target-eesd-n2",
                                       "text-target-eesd-n1-open"}
    loaded = {p.name: EE.load_head(str(p), target) for p in heads}
    assert loaded["text-target-eesd-n1-k0"].num_layers == 0 and loaded["text-target-eesd-n2"].exit_layer == 2
    main = loaded["text-target-eesd-n1"]
    assert main.calibration is not None
    prompts = [np.arange(3, 12), np.arange(20, 26)]
    ar = jspec.decode(target, prompts, max_new_tokens=12)
    out = jspec.decode(target, prompts, jspec.EESD(main, controller="cali", k_max=8), max_new_tokens=12)
    np.testing.assert_array_equal(out.tokens, ar.tokens)
