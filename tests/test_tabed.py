"""TABED: the prompt views, the pooled tower features, the weight policies against a numpy reference, greedy == AR
on the zoo image pair and on drafts in the llava-hf layout, exact sampling with images, and clear errors."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from jspec import api
from jspec.parts.controllers import Record
from jspec.parts.controllers.combined import Both
from jspec.parts.controllers.ensemble import EnsembleWeights, simplex_grid
from jspec.parts.drafters.views import build_views, image_runs
from jspec.tools.zoo import evaluate as ZE
from jspec.strategies.tabed import METHODS, TABED, block_efficiency, expected_speedup
from ports.families import llava
from flax import struct

from jspec.parts.controllers import Asks, Controller, Decision
from jspec.parts.drafters.views import pooled_model
from sampling_check import IMAGE_PROMPT, IMG, PIXELS, VLM_V, check, image_joint, llava_logits, tiny_llava
from tolerances import assert_f32_close

ZOO_NEWLINE = 204  # the zoo tokenizer's "\n"


# ----------------------------------------------------------------------------------------- tiny LLaVA pairs

V = VLM_V


# ------------------------------------------------------------------------------------------------- zoo pair


@pytest.fixture(scope="module")
def zoo():
    pair = ZE.load_pair("image")
    exs = ZE.scenario_examples("image", 2)
    batch = [exs["caption"][0], exs["two_image"][0], exs["vqa"][1]]  # 1, 2 and 1 images; ragged
    return pair, ZE.batch_prompt(pair.encoder, batch)


def _ar(pair, prompt, n=24):
    return jspec.decode(pair.target, prompt, max_new_tokens=n)


def _same(a, b):
    return all(np.array_equal(a.tokens[r, :a.lengths[r]], b.tokens[r, :b.lengths[r]]) for r in range(len(a.lengths)))


# -------------------------------------------------------------------------------------------------- tests


def test_pooled_features_average_the_patch_grid():
    rng = np.random.default_rng(1)
    f = rng.normal(size=(2, 16, 5)).astype(np.float32)  # a 4 x 4 grid: plain 2 x 2 windows
    want = f.reshape(2, 2, 2, 2, 2, 5).mean(axis=(2, 4)).reshape(2, 4, 5)
    np.testing.assert_allclose(np.asarray(llava.pool_features(jnp.asarray(f), 4, 2)), want, rtol=1e-6, atol=1e-6)
    g = rng.normal(size=(1, 9, 3)).astype(np.float32)  # 3 x 3 -> 2 x 2 with adaptive (overlapping) bins
    grid = g.reshape(3, 3, 3)
    want = np.array([[grid[a:a + 2, b:b + 2].mean(axis=(0, 1)) for b in (0, 1)] for a in (0, 1)]).reshape(1, 4, 3)
    np.testing.assert_allclose(np.asarray(llava.pool_features(jnp.asarray(g), 3, 2)), want, rtol=1e-6, atol=1e-6)
    m = tiny_llava(0, 0.3, pool_grid=4)
    assert m.config.tokens_per_image == 16 and m.config.pooled(2).tokens_per_image == 4
    feats, _ = llava.image_features(m.config, m.params, jnp.asarray(rng.normal(size=(1, 3, 28, 28)), jnp.float32))
    pooled, _ = llava.image_features(m.config.pooled(2), m.params, jnp.asarray(
        rng.normal(size=(1, 3, 28, 28)), jnp.float32))
    assert feats.shape[1] == 16 and pooled.shape[1] == 4
    with pytest.raises(ValueError, match="positive integer"):
        m.config.pooled(0)


def test_views_rewrite_each_image_in_order(zoo):
    pair, prompt = zoo
    fake = lambda images: [[700 + i, 800 + i] for i in range(images["pixel_values"].shape[0])]  # noqa: E731
    views, stats = build_views(pair.draft, pair.target, prompt, ("M", "T", "P", "C"), ZOO_NEWLINE, 2, fake)
    (mt, ml, mi), (tt, tl, ti), (pt, pl, pi), (ct, cl, ci) = views
    n_img = [1, 2, 1]
    per = pair.draft.config.tokens_per_image
    assert list(ml - tl) == [k * (per - 1) for k in n_img]  # one newline per image
    assert list(ml - pl) == [k * (per - 4) for k in n_img]  # 3 x 3 grid pooled to 2 x 2
    assert list(cl - tl) == [k for k in n_img]  # two caption ids instead of one newline
    assert not ti and not ci and pi["pixel_values"].shape[0] == 4 and "caption_s" in stats
    for b in range(3):
        m_row = mt[b, :ml[b]]
        runs = image_runs(m_row, pair.draft.config.image_token_id, [per] * n_img[b])
        assert len(runs) == n_img[b]
        t_row = list(tt[b, :tl[b]])
        assert t_row.count(ZOO_NEWLINE) >= n_img[b] and pair.draft.config.image_token_id not in t_row
    row = list(ct[1, :cl[1]])  # row 1 holds images 1 and 2 (row-major over the batch), each as its caption
    assert [t for t in row if t >= 700] == [701, 801, 702, 802]


def _record(rng, B, P, m, Vv, accepted):
    tl = rng.normal(size=(B, P, Vv)).astype(np.float32) * 2
    aux = jax.nn.log_softmax(rng.normal(size=(B, P, m, Vv)).astype(np.float32) * 2, axis=-1)
    a = np.asarray(accepted, np.int32)
    return Record(accepted=jnp.asarray(a), committed=jnp.asarray(a + 1), active=jnp.ones((B,), bool),
                  depth=jnp.full((B,), P - 1), drafted=jnp.full((B,), P - 1), path=jnp.zeros((B, P), jnp.int32),
                  on_path=jnp.zeros((B, P), bool), tokens=jnp.zeros((B, P), jnp.int32), target_logits=jnp.asarray(tl),
                  draft_known=jnp.asarray(np.arange(P)[None] < P - 1) & (jnp.arange(P)[None] <= a[:, None]),
                  draft_aux=aux)


def _np_scores(rec, cand):
    p = np.asarray(jax.nn.softmax(rec.target_logits, axis=-1), np.float64)
    q_views = np.exp(np.asarray(rec.draft_aux, np.float64))
    out = []
    for w in cand:
        q = np.einsum("bpkv,k->bpv", q_views, w)
        kl = np.sum(np.where(p > 0, p * (np.log(p) - np.log(np.maximum(q, 1e-300))), 0), axis=-1)
        tvd = 0.5 * np.abs(p - q).sum(-1)
        out.append(np.stack([kl, tvd, (q.argmax(-1) == p.argmax(-1)).astype(float)], -1))
    return np.stack(out, -1)  # [B, P, 3, J]


def test_weight_policies_match_a_numpy_reference():
    np.testing.assert_allclose(simplex_grid(2, 10)[:, 1], np.arange(11) / 10)
    assert simplex_grid(3, 4).shape == (15, 3) and np.allclose(simplex_grid(3, 4).sum(1), 1)
    rng = np.random.default_rng(3)
    B, P, m, Vv = 3, 4, 2, 11
    recs = [_record(rng, B, P, m, Vv, rng.integers(0, P, B)) for _ in range(3)]
    ctrls = {c: EnsembleWeights.make(m, "grid", 10, c) for c in ("kld", "tvd", "num-accepted", "num-accepted-kld")}
    ctrls["inverse"] = EnsembleWeights.make(m, "inverse", tau=0.5)
    ctrls["inverse-softmax"] = EnsembleWeights.make(m, "inverse", inverse="softmax", tau=0.5)
    ctrls["window"] = EnsembleWeights.make(m, "grid", 10, "kld", window=3)
    for name, c in ctrls.items():
        st = c.init(B, P - 1)
        first = c.decide(st, None).weights
        np.testing.assert_allclose(first, 0.5)  # uniform before any verified position
        tot = 0.0
        for rec in recs:
            st = c.observe(st, rec)
            sc = _np_scores(rec, np.asarray(c.candidates))
            cnt = np.asarray(rec.draft_known) & (np.arange(P)[None] <= np.asarray(rec.accepted)[:, None])
            tot = tot + np.where(cnt[..., None, None], sc, 0).sum(1)
        if name == "window":
            continue
        kl, tvd, match = tot[:, 0], tot[:, 1], tot[:, 2]
        got = np.asarray(c.decide(st, None).weights)
        cand = np.asarray(c.candidates)
        if name == "kld":
            want = cand[kl.argmin(1)]
        elif name == "tvd":
            want = cand[tvd.argmin(1)]
        elif name == "num-accepted":
            want = cand[match.argmax(1)]
        elif name == "num-accepted-kld":
            want = cand[np.where(match >= match.max(1, keepdims=True), kl, np.inf).argmin(1)]
        elif name == "inverse":
            inv = (1 / kl) ** (1 / 0.5)
            want = inv / inv.sum(1, keepdims=True)
        else:
            z = (1 / kl) / 0.5
            want = np.exp(z - z.max(1, keepdims=True)) / np.exp(z - z.max(1, keepdims=True)).sum(1, keepdims=True)
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=1e-6, err_msg=name)
        np.testing.assert_allclose(np.asarray(st["sums"]), tot, rtol=2e-4, atol=1e-5, err_msg=name)


def test_a_finite_window_sums_the_last_positions():
    rng = np.random.default_rng(4)
    B, P, m, Vv, h = 2, 4, 2, 7, 3
    c = EnsembleWeights.make(m, "grid", 4, "kld", window=h)
    st = c.init(B, P - 1)
    rows = [[] for _ in range(B)]
    for acc in ([3, 0], [0, 2], [1, 1], [3, 3]):
        rec = _record(rng, B, P, m, Vv, acc)
        st = c.observe(st, rec)
        sc = _np_scores(rec, np.asarray(c.candidates))
        cnt = np.asarray(rec.draft_known) & (np.arange(P)[None] <= np.asarray(rec.accepted)[:, None])
        for b in range(B):
            rows[b] += [sc[b, j] for j in range(P) if cnt[b, j]]
    want = np.stack([np.sum(r[-h:], axis=0) for r in rows])
    np.testing.assert_allclose(np.asarray(c._totals(st)), want, rtol=2e-4, atol=1e-5)


@struct.dataclass
class ViewRecorder(Controller):
    """Keeps each step's per-view draft log-probabilities along the accepted path: `plan` reports the previous
    step's (out.stats "view_logp" [B, steps, D+1, m, V], "view_accepted", "view_known")."""

    m: int = struct.field(pytree_node=False)
    vocab: int = struct.field(pytree_node=False)

    @property
    def asks(self) -> Asks:
        return Asks(draft_aux=True, draft_probs=True)  # draft_known comes with draft_probs

    def init(self, batch: int, max_depth: int):
        return {"view_logp": jnp.zeros((batch, max_depth + 1, self.m, self.vocab), jnp.float32),
                "view_accepted": jnp.zeros((batch,), jnp.int32),
                "view_known": jnp.zeros((batch, max_depth + 1), bool)}

    def decide(self, state, key) -> Decision:
        return Decision(info=dict(state))

    def observe(self, state, record):
        return {"view_logp": record.draft_aux, "view_accepted": record.accepted.astype(jnp.int32),
                "view_known": record.draft_known}


ROW_PROMPTS = [IMAGE_PROMPT, np.array([1, 5, IMG, IMG, IMG, IMG, 2, 6, 4, 4])]
ROW_PIXELS = np.concatenate([PIXELS, np.random.default_rng(1).normal(size=PIXELS.shape).astype(np.float32)])


def test_each_views_draft_distribution_is_a_fresh_forward_of_the_draft_on_that_view():
    """Along every accepted path of a greedy decode (ragged rows, several steps), the drafter's per-view
    distributions equal one full forward of the draft over that view's prompt and the committed tokens: M the
    prompt with its image, T the image run replaced by a newline, P the image pooled 2 x 2 (one feature), C the
    run replaced by the image's caption. So each view's prompt, ragged cache and commits are its own."""
    target, draft = tiny_llava(10, 0.4), tiny_llava(11, 0.6)
    caption = dict(before=[1], after=[2], max_new_tokens=3, eos_token_id=())
    cap = jspec.ModelCaptioner(draft, **caption)
    views = ("M", "T", "P", "C")
    strat = TABED(draft, views=views, weights=(0.4, 0.3, 0.2, 0.1), newline_id=3, gamma=3, captioner=cap)
    parts = strat.parts().replace(controller=ViewRecorder(len(views), VLM_V))
    n_new = 12
    out = jspec.decode(target, {"input_ids": ROW_PROMPTS, "pixel_values": ROW_PIXELS}, strategy=parts,
                       max_new_tokens=n_new, eos_token_id=())
    st = out.stats
    checked = 0
    for b, prompt in enumerate(ROW_PROMPTS):
        pix = ROW_PIXELS[b:b + 1]
        run = np.flatnonzero(prompt == IMG)
        before, after = prompt[:run[0]], prompt[run[-1] + 1:]
        cap_ids = jspec.decode(draft, {"input_ids": [[1] + [IMG] * len(run) + [2]], "pixel_values": pix},
                               max_new_tokens=3, eos_token_id=()).tokens[0]
        view_prompts = {"M": (draft, prompt, pix),
                        "T": (draft, np.concatenate([before, [3], after]), None),
                        "P": (pooled_model(draft, 2), np.concatenate([before, [IMG], after]), pix),
                        "C": (draft, np.concatenate([before, cap_ids, after]), None)}
        gen = out.tokens[b, :out.lengths[b]]
        for k, v in enumerate(views):
            model, vp, vpix = view_prompts[v]
            ref = llava_logits(model, vp, vpix, gen[None])[0]
            ref = np.asarray(jax.nn.log_softmax(ref, axis=-1))
            for s in range(1, int(st["steps"][b])):  # plan s reports step s - 1
                c = 1 + int(st["accepted"][b, :s - 1].sum())  # tokens committed before step s - 1
                for j in range(int(st["view_accepted"][b, s]) + 1):
                    if st["view_known"][b, s, j]:
                        assert_f32_close(st["view_logp"][b, s, j, k], ref[len(vp) + c + j - 1], atol=2e-5,
                                         err_msg=f"row {b} view {v} step {s - 1} node {j}")
                        checked += 1
    assert checked >= 2 * 4 * 4  # 2 rows x 4 views x several steps and depths


def test_the_weights_decide_which_view_drafts():
    """The target drafting for itself through two views: weight on M (its own prompt) accepts every draft; weight
    on T (the image replaced by a newline) drafts another model's guesses and accepts fewer."""
    target = tiny_llava(10, 0.4)
    prompt = {"input_ids": ROW_PROMPTS, "pixel_values": ROW_PIXELS}
    runs = {w: jspec.decode(target, prompt, max_new_tokens=16, eos_token_id=(),
                            strategy=TABED(target, views=("M", "T"), weights=w, newline_id=3, gamma=3))
            for w in ((1.0, 0.0), (0.0, 1.0))}
    m_only, t_only = runs[(1.0, 0.0)].stats, runs[(0.0, 1.0)].stats
    for b, n_steps in enumerate(m_only["steps"]):
        assert (m_only["accepted"][b, :n_steps - 1] == 4).all(), m_only["accepted"]  # gamma + bonus, last cut
    assert t_only["accepted_drafts"].sum() < m_only["accepted_drafts"].sum()
    np.testing.assert_array_equal(runs[(0.0, 1.0)].tokens, runs[(1.0, 0.0)].tokens)


def test_greedy_equals_ar_for_adaptive_ensembles(zoo):
    pair, prompt = zoo
    ar = _ar(pair, prompt)
    cap = ZE.captioner(pair, 24)
    for name in ("MTCP*",):  # all four views, the inverse policy (MT*'s grid: the SAGE and sampling tests)
        strat = TABED.method(name, pair.draft, newline_id=ZOO_NEWLINE, captioner=cap)
        out = jspec.decode(pair.target, prompt, strategy=strat, max_new_tokens=24)
        assert _same(out, ar), name
        m = len(METHODS[name][0])
        w = out.stats["weights"]
        assert w.shape[0] == 3 and w.shape[2] == m
        np.testing.assert_allclose(w[:, 0], 1.0 / m)  # the first block is uniform
        np.testing.assert_allclose(w.sum(-1), 1.0, rtol=1e-5)
        acc = out.stats["accepted"]
        assert block_efficiency(out) == pytest.approx(acc.sum() / (acc > 0).sum())  # tokens per target step
        assert block_efficiency([out, out]) == pytest.approx(block_efficiency(out))  # blocks pooled over outputs
    assert out.stats["caption_s"] > 0
    s = api.start(pair.target, prompt, TABED(pair.draft, views=("M", "T"), newline_id=ZOO_NEWLINE),
                  max_new_tokens=8)
    assert s.state.aux.draft.cache.batch == 2 * 3  # the views are rows of one draft batch


@pytest.mark.slow
def test_greedy_equals_ar_every_method_and_under_trees(zoo):
    pair, prompt = zoo
    ar = _ar(pair, prompt)
    cap = ZE.captioner(pair, 24)
    for name in METHODS:
        out = jspec.decode(pair.target, prompt, max_new_tokens=24,
                           strategy=TABED.method(name, pair.draft, newline_id=ZOO_NEWLINE, captioner=cap))
        assert _same(out, ar), name
    for kw in (dict(window=4), dict(criterion="tvd"), dict(weights="inverse", inverse="softmax"),
               dict(tree=[[0], [1], [0, 0], [1, 0], [0, 0, 0]])):
        out = jspec.decode(pair.target, prompt, max_new_tokens=24,
                           strategy=TABED(pair.draft, newline_id=ZOO_NEWLINE, **kw))
        assert _same(out, ar), kw


def test_under_a_sage_tree_with_adaptive_weights(zoo):
    """The multi-view drafter under SAGE's per-row trees, SAGE's controller and the weight policy side by side."""
    pair, prompt = zoo
    tab = TABED(pair.draft, views=("M", "T"), newline_id=ZOO_NEWLINE)
    sage = jspec.SAGE(tab, d_min=2, d_max=4, w_min=2, w_max=4, k=4, n_max=12,
                      init_tree=[[0], [1], [0, 0], [1, 0], [0, 0, 0]], window=2)
    assert isinstance(sage.parts().controller, Both)
    out = jspec.decode(pair.target, prompt, strategy=sage, max_new_tokens=24)
    assert _same(out, _ar(pair, prompt))
    w = out.stats["weights"]
    assert w.shape[2] == 2 and not np.allclose(w[0, 1:out.stats["steps"][0]], 0.5)  # the policy decided
    assert out.stats["nodes"].shape == w.shape[:2]  # SAGE's own decisions are kept beside the weights
    with pytest.raises(ValueError, match="re-picked by its controller"):  # the drafter alone would run MT* as MT
        tab.drafter()
    fixed = TABED(pair.draft, views=("M", "T"), weights=(0.7, 0.3), newline_id=ZOO_NEWLINE).drafter()
    assert np.allclose(np.asarray(fixed.weights), (0.7, 0.3))


def test_sampling_is_exact_with_images_for_fixed_and_adaptive_weights():
    target, draft = tiny_llava(10, 0.4), tiny_llava(11, 0.6)
    p = image_joint(target, IMAGE_PROMPT, PIXELS)
    rows = 8000
    prompt = {"input_ids": np.tile(IMAGE_PROMPT, (rows, 1)), "pixel_values": np.repeat(PIXELS, rows, 0)}

    def counts(model, strat):
        out = jspec.decode(model, prompt, strategy=strat, max_new_tokens=3, temperature=1.0, eos_token_id=(),
                           key=jax.random.key(5))
        idx = out.tokens[:, 0] * V * V + out.tokens[:, 1] * V + out.tokens[:, 2]
        return np.bincount(idx, minlength=V ** 3), out

    for strat in (TABED(draft, views=("M", "T", "P"), weights=(0.2, 0.5, 0.3), newline_id=3, gamma=3),
                  TABED(draft, views=("M", "T"), weights="grid", newline_id=3, gamma=3)):
        c, out = counts(target, strat)
        check(c, p)  # chi-square and total variation within what an exact sampler of this size shows
        assert out.stats["mean_accepted"].mean() > 1.1  # drafts were accepted and rejected
        assert out.stats["mean_accepted"].mean() < 2.9
    check(counts(draft, None)[0], p, exact=False)  # negative control: the draft's own samples are told apart


def _two_sample_pvalue(a, b, min_expected=5.0):
    """p-value of the chi-square test that histograms `a` and `b` (same bins) are draws from one distribution:
    bins whose expected count in either sample is under `min_expected` are pooled into one bin."""
    from scipy import stats

    tab = np.stack([a, b]).astype(np.float64)
    rare = tab.sum(0) * tab.sum(1).min() / tab.sum() < min_expected
    tab = np.concatenate([tab[:, ~rare], tab[:, rare].sum(1, keepdims=True)], axis=1)
    tab = tab[:, tab.sum(0) > 0]
    return float(stats.chi2_contingency(tab, correction=False).pvalue)


@pytest.mark.slow  # (sampling with moving weights: test_sampling_is_exact_with_images_for_fixed_and_adaptive_weights)
def test_sampling_stays_exact_while_the_adaptive_weights_move_over_many_blocks():
    """Sampled TABED is lossless while its weight policy acts: with gamma 1 (MT*'s grid) and 2 (the inverse policy
    over M, T, P), 11 new tokens give every row at least 4 blocks, the weights leave uniform and keep moving
    between blocks, and the joint distribution of the last two generated tokens (a marginal of the full sequence,
    which losslessness fixes to the target's) matches plain sampling of the target by a two-sample chi-square
    test. The draft's own samples, compared the same way, are told apart (the comparison has power)."""
    target, draft = tiny_llava(10, 0.4), tiny_llava(11, 0.6)
    rows, n = 8000, 11
    prompt = {"input_ids": np.tile(IMAGE_PROMPT, (rows, 1)), "pixel_values": np.repeat(PIXELS, rows, 0)}

    def last_two(model, strat, seed):
        out = jspec.decode(model, prompt, strategy=strat, max_new_tokens=n, temperature=1.0, eos_token_id=(),
                           key=jax.random.key(seed))
        assert (out.lengths == n).all()
        return np.bincount(out.tokens[:, n - 2] * V + out.tokens[:, n - 1], minlength=V * V), out

    ref, _ = last_two(target, None, 1)  # plain autoregressive sampling of the target
    for seed, strat in ((4, TABED(draft, views=("M", "T"), weights="grid", newline_id=3, gamma=1)),
                        (5, TABED(draft, views=("M", "T", "P"), weights="inverse", newline_id=3, gamma=2))):
        c, out = last_two(target, strat, seed)
        steps, w = out.stats["steps"], out.stats["weights"]
        assert steps.min() >= 4, np.bincount(steps)
        m = w.shape[2]
        np.testing.assert_allclose(w[:, 0], 1.0 / m)  # the first block is uniform, later ones are the policy's
        later = (np.arange(w.shape[1])[None] >= 1) & (np.arange(w.shape[1])[None] < steps[:, None])
        moved = later & (np.abs(w - 1.0 / m).max(-1) > 1e-3)  # [B, steps]: a later block off uniform
        assert (moved.sum(1) >= 2).mean() > 0.9, moved.sum(1)  # most rows drafted with re-picked weights
        changed = later[:, 2:] & (np.abs(w[:, 2:] - w[:, 1:-1]).max(-1) > 1e-3)  # block s vs block s - 1, s >= 2
        assert changed.any(1).mean() > 0.5, changed.sum(1)  # and the weights kept moving between blocks
        acc = out.stats["mean_accepted"].mean()
        assert 1.1 < acc < strat.gamma + 0.9, acc  # drafts were accepted and rejected
        pval = _two_sample_pvalue(c, ref)
        assert pval > 1e-4, (strat.weights, pval)
    pval = _two_sample_pvalue(last_two(draft, None, 3)[0], ref)
    assert pval < 1e-6, pval  # negative control: the draft's own samples are told apart


def test_new_weights_do_not_recompile(zoo):
    pair, prompt = zoo
    a = jspec.decode(pair.target, prompt, max_new_tokens=16,
                     strategy=TABED(pair.draft, weights=(0.9, 0.1), newline_id=ZOO_NEWLINE))
    n = api._decode_sd._cache_size()
    b = jspec.decode(pair.target, prompt, max_new_tokens=16,
                     strategy=TABED(pair.draft, weights=(0.1, 0.9), newline_id=ZOO_NEWLINE))
    assert api._decode_sd._cache_size() == n
    assert _same(a, b)
    np.testing.assert_allclose(a.stats["weights"][0, 0], [0.9, 0.1])


def test_drafts_in_the_llava_hf_layout(tmp_path):
    """The paper's drafts are LlavaForConditionalGeneration checkpoints (a small LLaMA LM, a CLIP tower, an MLP
    projector): one in that layout loads and drafts every view; greedy == AR."""
    from test_llava import image_prompt, pair

    _, target, draft = pair(str(tmp_path))
    a, pa = image_prompt(1, seed=1)
    b, pb = image_prompt(2, seed=2)
    prompt = {"input_ids": [a, b], "pixel_values": np.concatenate([pa, pb])}
    ar = jspec.decode(target, prompt, max_new_tokens=12, eos_token_id=())
    fake = lambda images: [[5, 6 + i] for i in range(images["pixel_values"].shape[0])]  # noqa: E731
    out = jspec.decode(target, prompt, max_new_tokens=12, eos_token_id=(),
                       strategy=TABED.method("MTCP*", draft, newline_id=13, captioner=fake))
    np.testing.assert_array_equal(out.tokens, ar.tokens)


def test_metrics():
    class Out:
        def __init__(self, acc):
            self.stats = {"accepted": np.asarray(acc)}

    assert block_efficiency([Out([[3, 1, 0]]), Out([[2, 0, 0]])]) == pytest.approx(2.0)
    assert expected_speedup(2.292, 5, 0.063) == pytest.approx(1.743, abs=1e-3)  # the paper's MT* average


def test_clear_errors(zoo):
    pair, prompt = zoo
    text_prompt = [np.array([1, 4, 20, 30])]
    with pytest.raises(ValueError, match="unknown weight policy"):
        TABED(pair.draft, weights="best")
    with pytest.raises(ValueError, match="views must be distinct"):
        TABED(pair.draft, views=("M", "X"))
    with pytest.raises(ValueError, match="unknown criterion"):
        TABED(pair.draft, criterion="bleu")
    with pytest.raises(ValueError, match="one entry per view|fixed weights"):
        jspec.decode(pair.target, prompt, strategy=TABED(pair.draft, weights=(1.0, 0.0, 0.0), newline_id=1))
    with pytest.raises(ValueError, match="newline_id"):
        jspec.decode(pair.target, prompt, strategy=TABED(pair.draft))
    with pytest.raises(ValueError, match="captioner"):
        jspec.decode(pair.target, prompt, strategy=TABED(pair.draft, views=("M", "C")))
    with pytest.raises(ValueError, match="has none"):
        jspec.decode(pair.target, text_prompt, strategy=TABED(pair.draft, newline_id=ZOO_NEWLINE))
    from jspec.tools import zoo as ZOO

    text_draft = ZOO.load("text-draft")
    with pytest.raises(ValueError, match="text-only"):
        jspec.decode(pair.target, prompt, strategy=TABED(text_draft, newline_id=ZOO_NEWLINE))


@pytest.mark.slow
def test_on_an_8_device_mesh():
    """Two views of the zoo draft on a (data=2, tensor=2) mesh of forced CPU devices: the tokens of one device."""
    import os
    import subprocess
    import sys

    code = """
import os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import numpy as np, jspec
from jspec.tools.zoo import evaluate as ZE
pair = ZE.load_pair("image")
exs = ZE.scenario_examples("image", 2)
prompt = ZE.batch_prompt(pair.encoder, [exs["caption"][0], exs["two_image"][0], exs["vqa"][1], exs["caption"][1]])
ar = jspec.decode(pair.target, prompt, max_new_tokens=16)
strat = jspec.TABED.method("MT*", pair.draft, newline_id=204)
out = jspec.decode(pair.target, prompt, strategy=strat, max_new_tokens=16, mesh=jspec.make_mesh(data=2, tensor=2))
assert np.array_equal(out.tokens, ar.tokens)
print("ok")
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-3000:]
