"""The EAGLE-1 feature-head drafter: its draft distributions are the teacher-forced head's, greedy SD == AR,
sampling is exact, CFG streams, storage in PyTorch's key layout, and clear errors."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
import ports
from jspec import api
from ports.core import cache as kvc
from jspec.parts.drafters import eagle as EG
from jspec.parts.plans import StaticPlan
from jspec.parts.trees import build_tree, chain
from sampling_check import exactness, tiny_vocab_pair
from tiny_pairs import PROMPTS, tiny_pair
from tolerances import assert_f32_close
from toy_parts import RecordingController


@pytest.fixture(scope="module")
def pair():
    target, _ = tiny_pair()
    head = EG.init_head(target, jax.random.key(1), noise=0.3)
    # perturb the copied layer so the head is not the target's last layer
    layer = jax.tree.map(lambda a: a * (1 + 0.2 * np.sin(np.arange(a.size).reshape(a.shape))), head.params["layer"])
    return target, head.replace(params=dict(head.params, layer=layer))


def eagle(head, tree, rule="residual", controller=None):
    return jspec.Speculative(EG.EagleDrafter(head), StaticPlan.of(build_tree(tree)), rule, controller)


NMAX = 64  # reference sequences are padded to this length: under causal attention padding never changes a prefix


@jax.jit
def _features_padded(target, seq):
    cfg, lm = EG.text_parts(target)
    cache = kvc.init_cache(cfg.num_layers, 1, cfg.num_kv_heads, NMAX, cfg.head_dim, jnp.float32)
    fo = target.forward(seq[None], jnp.arange(NMAX)[None], cache, fresh=True, hidden_layers=(cfg.num_layers,))
    return EG.features(cfg, lm, fo.hidden[0])[0]


@jax.jit
def _head_padded(target, head, tokens, feats):
    """f-hat [NMAX, D] of entries (tokens[j], feats[j]), causal."""
    cfg, lm = EG.text_parts(target)
    cache = kvc.init_cache(1, 1, cfg.num_kv_heads, NMAX, cfg.head_dim, jnp.float32)
    x, _ = EG.head_forward(cfg, head, lm["embed"][tokens][None], feats[None], jnp.arange(1, NMAX + 1)[None], cache,
                          fresh=True)
    return x[0], EG.lm_logits(cfg, lm, x)[0]


def _pad(seq):
    assert len(seq) <= NMAX
    return jnp.asarray(np.pad(np.asarray(seq, np.int32), (0, NMAX - len(seq))))


def _head_logits(target, head, seq, root: int, k: int) -> np.ndarray:
    """The head's logits for the token after seq[root + k] as EAGLE drafts it: true entries (seq[j], f[j - 1]) up
    to the root, then k drafted entries, each paired with the f-hat of the entry before it."""
    f = _features_padded(target, _pad(seq))
    tokens = _pad(seq[1:])  # entry i holds seq[i + 1]
    feats = f  # entry i pairs with f[i]
    for i in range(k + 1):
        x, logits = _head_padded(target, head, tokens, feats)
        n = root + i  # entries 0 .. n - 1 are final
        feats = feats.at[n].set(x[n - 1])
    return np.asarray(logits[root + k - 1])


def _head_logp(target, head, seq, root: int, k: int) -> np.ndarray:
    return np.asarray(jax.nn.log_softmax(_head_logits(target, head, seq, root, k)))


def _steps(acc_row, n_gen):
    """(generated index t, its step's root index c - 1 in the generated tokens, depth k - 1) per committed token."""
    c = 1
    for n in acc_row:
        for k in range(n):
            if c + k < n_gen:
                yield c + k, c - 1, k
        c += n


def test_draft_distributions_are_the_teacher_forced_heads(pair):
    """Every committed token's draft log-prob, at the root and below it, equals a from-scratch computation of the
    head over the true features up to the step's root and its own f-hat after it: the pairing of tokens with
    features survives commits, partial acceptance, finished rows and trees."""
    target, head = pair
    ar = jspec.decode(target, PROMPTS, max_new_tokens=16, eos_token_id=())
    for tree in (chain(3), [[0], [1], [0, 0], [1, 0], [0, 0, 0]]):
        s = api.start(target, PROMPTS, eagle(head, tree, controller=RecordingController()), max_new_tokens=16,
                      eos_token_id=())
        state = s.run()
        rec, out, acc = jax.device_get((state.aux.ctrl, state.out, state.accepted))
        np.testing.assert_array_equal(out[:, :16], ar.tokens)
        checked = 0
        for b, prompt in enumerate(PROMPTS):
            seq = np.concatenate([prompt, out[b, :16]])
            for t, root, k in _steps(acc[b], 16):
                if rec["q_known"][b, t - 1]:
                    ref = _head_logp(target, head, seq, len(prompt) + root, k)
                    assert_f32_close(rec["q"][b, t - 1], ref[seq[len(prompt) + t]], atol=2e-4)
                    checked += 1
        assert checked >= 20


@pytest.mark.slow  # the conformance entry "eagle_tree_vocab" and the CFG test below prove greedy == AR
def test_greedy_equals_ar_on_trees(pair):
    target, head = pair
    ar = jspec.decode(target, PROMPTS, max_new_tokens=20, eos_token_id=())
    for tree in ("mc_sim_7b_63",):  # naive_extend_57 runs under CFG below
        out = jspec.decode(target, PROMPTS, eagle(head, tree), max_new_tokens=20, eos_token_id=())
        np.testing.assert_array_equal(out.tokens, ar.tokens)


@pytest.mark.slow  # the conformance entry "eagle_tree_vocab" runs the same exactness check
def test_sampling_is_exact():
    target, _ = tiny_vocab_pair()
    head = EG.init_head(target, jax.random.key(2), noise=0.5)
    pval, tv, out = exactness(target, eagle(head, [[0], [1], [0, 0], [0, 1]]))
    assert pval > 1e-3, (pval, tv)
    assert out.stats["mean_accepted"].mean() > 1.05


@pytest.mark.slow  # tests/test_eagle_train.py shows a trained head accepted more in the default suite
def test_a_trained_like_head_is_accepted_more(pair):
    """A head whose layer equals the target's last layer on a 1-layer target, fed its own features, predicts much
    better than a random one (a sanity check that features, not noise, drive it)."""
    cfg = dataclasses.replace(ports.TextConfig(model_type="llama", vocab_size=97, hidden_size=64,
                                               intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
                                               head_dim=16))
    target = ports.random_model(cfg, key=3, std=0.3)
    good = EG.init_head(target, jax.random.key(0), noise=0.0)
    bad = good.replace(params=jax.tree.map(lambda a: jax.random.normal(jax.random.key(9), a.shape) * 0.3,
                                           good.params))
    runs = [jspec.decode(target, PROMPTS, eagle(h, chain(4)), max_new_tokens=24, eos_token_id=())
            for h in (good, bad)]
    assert runs[0].stats["mean_accepted"].mean() > runs[1].stats["mean_accepted"].mean()


def test_errors(pair):
    target, head = pair
    other = ports.random_model(dataclasses.replace(target.config, hidden_size=32, head_dim=8), key=5)
    with pytest.raises(ValueError, match="another target"):
        jspec.decode(other, PROMPTS, eagle(head, chain(2)), max_new_tokens=4)
    same_shape = ports.random_model(target.config, key=11)
    with pytest.raises(ValueError, match="another target's weights"):
        jspec.decode(same_shape, PROMPTS, eagle(head, chain(2)), max_new_tokens=4)
    with pytest.raises(ValueError, match="draft_prompt"):
        jspec.decode(target, PROMPTS, eagle(head, chain(2)), max_new_tokens=4, draft_prompt=PROMPTS)


def test_cfg_streams_and_the_image_grammar():
    """Under CFG and the image grammar, each committed token's draft log-prob is the two streams' teacher-forced
    head logits combined (uncond + s (cond - uncond)) and constrained; greedy SD == AR image generation."""
    from jspec import images as IG
    from jspec.core.guidance import CFG
    from test_imagegen import COLS, PREFIX, ROWS, make_model, prompts

    target = IG._generating(make_model(0))
    head = EG.init_head(target, jax.random.key(4), noise=0.3)
    gram = IG.grammar(target.config, ROWS, COLS)
    conds = [np.concatenate([p, PREFIX]) for p in prompts()]
    scale = 3.0
    s = api.start(target, conds, eagle(head, chain(3), controller=RecordingController()),
                  max_new_tokens=gram.length, eos_token_id=(gram.eoi,), guidance=CFG(scale, PREFIX), constraint=gram)
    state = s.run()
    rec, out, acc = jax.device_get((state.aux.ctrl, state.out, state.accepted))
    n = gram.length
    ar = jspec.generate_image(target, prompts(), ROWS, COLS, temperature=0.0, image_prefix_ids=PREFIX)
    np.testing.assert_array_equal(out[:, :n], ar.tokens)
    checked = 0
    for b, cond in enumerate(conds):
        gen = out[b, :n]
        for t, root, k in _steps(acc[b], n):
            if not rec["q_known"][b, t - 1] or t % (COLS + 1) == COLS:
                continue  # forced end-of-row tokens have log-prob 0 under any logits
            lc = _head_logits(target, head, np.concatenate([cond, gen]), len(cond) + root, k)
            lu = _head_logits(target, head, np.concatenate([PREFIX, gen]), len(PREFIX) + root, k)
            g = gram.apply(jnp.asarray(lu + scale * (lc - lu))[None, None], jnp.asarray([[t]]))[0, 0]
            ref = float(jax.nn.log_softmax(g)[gen[t]])
            if ref < -60:  # the recorded probability underflows float32
                assert rec["q"][b, t - 1] < -60
                continue
            assert_f32_close(rec["q"][b, t - 1], ref, atol=1e-3)
            checked += 1
    assert checked >= 8
    sd = jspec.generate_image(target, prompts(), ROWS, COLS, strategy=eagle(head, "naive_extend_57"),
                              temperature=0.0, image_prefix_ids=PREFIX)
    np.testing.assert_array_equal(sd.tokens, ar.tokens)


def test_a_draft_vocabulary_scores_its_tokens_only(pair):
    """With a draft vocabulary, the drafter's LM head gives the full head's logits at its tokens and the lowest
    float32 elsewhere; decoding over it gives each committed token outside it no draft probability (the whole
    vocabulary's head gives it some), and greedy decoding still equals AR."""
    target, head = pair
    cfg, lm = EG.text_parts(target)
    ids = np.arange(0, cfg.vocab_size, 2)
    f = jax.random.normal(jax.random.key(4), (2, 3, cfg.hidden_size))
    full = np.asarray(EG.lm_logits(cfg, lm, f))
    small = np.asarray(EG.lm_logits(cfg, lm, f, (jnp.asarray(ids), EG.vocab_rows(cfg, lm, jnp.asarray(ids)))))
    assert_f32_close(small[..., ids], full[..., ids], atol=1e-5)
    assert (small[..., 1::2] == np.finfo(np.float32).min).all()

    vhead = head.with_vocab(ids[::-1])  # any order: kept sorted
    np.testing.assert_array_equal(np.asarray(vhead.vocab), ids)
    ar = jspec.decode(target, PROMPTS, max_new_tokens=16, eos_token_id=())
    q_odd = {}
    for name, h in (("all", head), ("even", vhead)):
        s = api.start(target, PROMPTS, jspec.Chain(h, gamma=3, controller=RecordingController()),
                      max_new_tokens=16, eos_token_id=())
        state = s.run()
        rec, out = jax.device_get((state.aux.ctrl, state.out))
        np.testing.assert_array_equal(out[:, :16], ar.tokens)
        odd = rec["q_known"][:, :15].astype(bool) & (out[:, 1:16] % 2 == 1)  # q of generated token t at t - 1
        assert odd.sum() >= 5
        q_odd[name] = rec["q"][:, :15][odd]
    assert (q_odd["all"] > -1e3).all()
    assert (q_odd["even"] < -1e30).all()


def test_draft_vocabulary_errors(pair):
    _, head = pair
    V = head.target.vocab_size
    for bad in ([], [0, V], [-1, 2], [0.5, 1.0]):
        with pytest.raises(ValueError, match="draft vocabulary"):
            head.with_vocab(bad)
    assert head.with_vocab([3, 1]).with_vocab(None).vocab is None
