"""Text-to-image generation (jspec.generate_image, jspec.core.guidance): the Lumina-mGPT grammar holds for every sample,
CFG equals a step-by-step reference built from full-sequence logits, CFG at scale 1 equals no CFG, and greedy
speculative strategies with a small Chameleon draft reproduce greedy AR under CFG and the grammar."""
import dataclasses

import jax
import numpy as np
import pytest

import jspec
import ports
from ports.families import chameleon as CH
from ports.families import vqgan as VQ
from test_chameleon import BOI, EOI, IMG0, K, NEWLINE, SIZE0, hf_config

ROWS, COLS = 3, 4  # non-square, so a swapped row/column would show
PREFIX = [BOI, SIZE0 + 1, SIZE0 + 2]


def make_model(seed: int, layers: int = 2, hidden: int = 32) -> ports.Model:
    d = hf_config(num_hidden_layers=layers, hidden_size=hidden).to_dict()
    cfg = CH.config_from_hf(d)
    params = CH.init_params(cfg, jax.random.key(seed), std=0.3)
    return ports.Model(cfg, params, d)


@pytest.fixture(scope="module")
def target():
    return make_model(0)


@pytest.fixture(scope="module")
def draft():
    return make_model(1, layers=1, hidden=16)


def prompts():
    rng = np.random.default_rng(3)
    return [rng.integers(8, IMG0, 9), rng.integers(8, IMG0, 5)]  # ragged


def check_grammar(tokens: np.ndarray, rows=ROWS, cols=COLS):
    assert tokens.shape[1] == rows * (cols + 1) + 1
    grid = tokens[:, :-1].reshape(-1, rows, cols + 1)
    assert np.all(grid[:, :, cols] == NEWLINE)
    assert np.all((grid[:, :, :cols] >= IMG0) & (grid[:, :, :cols] < IMG0 + K))
    assert np.all(tokens[:, -1] == EOI)


def reference_greedy(model, conds, unconds, scale, steps, rows=ROWS, cols=COLS):
    """Greedy decoding by full-sequence forwards of both streams, CFG-combined and grammar-masked by hand."""
    gen_model = dataclasses.replace(model, config=dataclasses.replace(model.config, suppress_image_logits=False),
                                    _hf_aux=None)
    outs = []
    for cond, unc in zip(conds, unconds):
        gen = []
        for g in range(steps):
            width = 64
            seqs = [list(cond) + gen, list(unc) + gen]
            batch = np.zeros((2, width), np.int64)
            for i, s in enumerate(seqs):
                batch[i, :len(s)] = s
            lg = ports.logits(gen_model, batch)
            c, u = lg[0, len(seqs[0]) - 1], lg[1, len(seqs[1]) - 1]
            x = u + scale * (c - u)
            row = cols + 1
            allowed = np.zeros_like(x, bool)
            if g < rows * row and g % row < cols:
                allowed[IMG0:IMG0 + K] = True
            elif g < rows * row:
                allowed[NEWLINE] = True
            elif g == rows * row:
                allowed[EOI] = True
            else:
                allowed[:] = True
            gen.append(int(np.argmax(np.where(allowed, x, -np.inf))))
        outs.append(gen)
    return np.array(outs)


def test_greedy_cfg_matches_stepwise_reference(target):
    out = jspec.generate_image(target, prompts(), ROWS, COLS, cfg_scale=3.0, temperature=0.0,
                               image_prefix_ids=PREFIX)
    check_grammar(out.tokens)
    conds = [np.concatenate([p, PREFIX]) for p in prompts()]
    ref = reference_greedy(target, conds, [PREFIX, PREFIX], 3.0, out.tokens.shape[1])
    np.testing.assert_array_equal(out.tokens, ref)
    assert out.codes.shape == (2, ROWS, COLS)
    np.testing.assert_array_equal(out.codes, out.tokens[:, :-1].reshape(2, ROWS, COLS + 1)[:, :, :COLS] - IMG0)


def test_cfg_with_a_longer_uncond_prompt_matches_reference(target):
    """The conditional stream starts later than the unconditional one (right alignment both ways)."""
    rng = np.random.default_rng(5)
    cond, unc = rng.integers(8, IMG0, 4), rng.integers(8, IMG0, 11)
    gen_target = dataclasses.replace(target, config=dataclasses.replace(target.config, suppress_image_logits=False),
                                     _hf_aux=None)
    out = jspec.decode(gen_target, [cond], max_new_tokens=6, eos_token_id=(),
                       guidance=jspec.CFG(2.0, [unc]))
    steps = 6
    gen = []
    for _ in range(steps):
        seqs = [list(cond) + gen, list(unc) + gen]
        batch = np.zeros((2, 32), np.int64)
        for i, s in enumerate(seqs):
            batch[i, :len(s)] = s
        lg = ports.logits(gen_target, batch)
        c, u = lg[0, len(seqs[0]) - 1], lg[1, len(seqs[1]) - 1]
        gen.append(int(np.argmax(u + 2.0 * (c - u))))
    np.testing.assert_array_equal(out.tokens[0], gen)


def test_sampling_respects_grammar_and_scale_one_equals_no_cfg(target):
    key = jax.random.key(7)
    out = jspec.generate_image(target, prompts(), ROWS, COLS, cfg_scale=3.0, key=key, top_k=20,
                               image_prefix_ids=PREFIX)
    check_grammar(out.tokens)
    no_cfg = jspec.generate_image(target, prompts(), ROWS, COLS, cfg_scale=None, key=key, image_prefix_ids=PREFIX)
    one = jspec.generate_image(target, prompts(), ROWS, COLS, cfg_scale=1.0, key=key, image_prefix_ids=PREFIX)
    check_grammar(no_cfg.tokens)
    np.testing.assert_array_equal(one.tokens, no_cfg.tokens)
    greedy_none = jspec.generate_image(target, prompts(), ROWS, COLS, cfg_scale=None, temperature=0.0,
                                       image_prefix_ids=PREFIX)
    greedy_one = jspec.generate_image(target, prompts(), ROWS, COLS, cfg_scale=1.0, temperature=0.0,
                                      image_prefix_ids=PREFIX)
    np.testing.assert_array_equal(greedy_one.tokens, greedy_none.tokens)
    assert not np.array_equal(out.tokens, no_cfg.tokens)  # guidance changes the samples


@pytest.mark.parametrize("make", [lambda d: jspec.Chain(d, gamma=3),
                                  pytest.param(lambda d: jspec.Tree(d, tree="chain5"), marks=pytest.mark.slow),
                                  lambda d: jspec.Tree(d, tree=[[0], [1], [0, 0], [0, 1], [1, 0]]),
                                  pytest.param(lambda d: jspec.DynamicTree(d, depth=3, top_k=3, total=8),
                                               marks=pytest.mark.slow)])  # test_lantern: dynamic trees under CFG
def test_greedy_speculative_equals_greedy_ar_under_cfg(target, draft, make):
    ar = jspec.generate_image(target, prompts(), ROWS, COLS, temperature=0.0, image_prefix_ids=PREFIX)
    sd = jspec.generate_image(target, prompts(), ROWS, COLS, strategy=make(draft), temperature=0.0,
                              image_prefix_ids=PREFIX)
    np.testing.assert_array_equal(sd.tokens, ar.tokens)
    assert np.all(sd.stats["steps"] < ar.tokens.shape[1] - 1)  # forced grammar tokens are drafted and accepted


def test_speculative_sampling_respects_grammar(target, draft):
    out = jspec.generate_image(target, prompts(), ROWS, COLS, strategy=jspec.Tree(draft, tree="chain5"),
                               key=jax.random.key(1), image_prefix_ids=PREFIX)
    check_grammar(out.tokens)
    # forced end-of-row / end-of-image tokens are drafted with certainty, so steps accept more than one token
    assert np.nanmean(out.stats["mean_accepted"]) > 1.0


def test_default_lumina_prefix_and_pixels(target, tmp_path):
    cfg = target.config
    f = cfg.vq.downsample
    rows = cols = 32 // f  # one 32-px Lumina size unit
    assert CH.__name__ and jspec.images.image_prefix(cfg, rows, cols) == [BOI, SIZE0 + 1, SIZE0 + 1]
    vq_params = VQ.init_params(cfg.vq, jax.random.key(2))
    out = jspec.generate_image(target, prompts()[:1], rows, cols, key=jax.random.key(0),
                               decoder=(cfg.vq, vq_params))
    check_grammar(out.tokens, rows, cols)
    assert out.images.shape == (1, rows * f, cols * f, 3) and out.images.dtype == np.uint8
    direct = VQ.to_uint8(VQ.decode_jit(cfg.vq, vq_params, out.codes))
    np.testing.assert_array_equal(out.images, direct)
    paths = out.save_png(str(tmp_path))
    from PIL import Image
    np.testing.assert_array_equal(np.asarray(Image.open(paths[0])), out.images[0])


def test_bad_inputs(target):
    with pytest.raises(ValueError, match="32-px size unit"):
        jspec.generate_image(target, prompts(), 3, 4)
    no_vocab = dataclasses.replace(target, config=dataclasses.replace(target.config, image_newline_token_id=None),
                                   _hf_aux=None)
    with pytest.raises(ValueError, match="end-of-row"):
        jspec.generate_image(no_vocab, prompts(), ROWS, COLS, image_prefix_ids=PREFIX)
    text = ports.Model(ports.core.config.text_config_from_hf({"model_type": "llama", "vocab_size": 96,
                                                        "hidden_size": 16, "intermediate_size": 32,
                                                        "num_hidden_layers": 1, "num_attention_heads": 2}),
                       None)
    with pytest.raises(ValueError, match="chameleon"):
        jspec.generate_image(text, prompts(), ROWS, COLS)
    with pytest.raises(ValueError, match="uncond_prompt"):
        jspec.decode(target, prompts(), guidance=jspec.CFG(3.0))
    with pytest.raises(ValueError, match="rows"):
        jspec.decode(target, prompts(), guidance=jspec.CFG(3.0, [[1, 2], [3, 4], [5, 6]]))


def test_guided_forward_logits_equal_combined_full_sequence_logits(target):
    """Prefill and a 3-token step of the guided wrapper against u + s (c - u) from full-sequence forwards, for a
    ragged batch whose rows have the longer prompt in different streams."""
    from jspec.core import guidance as GD
    from jspec.core import prefill as PR
    from ports.core.prompts import normalize_prompt

    gm = jspec.images._generating(target)
    rng = np.random.default_rng(11)
    conds = [rng.integers(8, IMG0, 9), rng.integers(8, IMG0, 5)]
    uncs = [rng.integers(8, IMG0, 3), rng.integers(8, IMG0, 11)]
    new = rng.integers(8, IMG0, (2, 3))
    tokens, lengths, _ = normalize_prompt(conds, V := gm.vocab_size)
    g = GD.guide(gm, lengths, jspec.CFG(2.5, uncs), None)
    cache = PR.new_cache_for(g, 2, 64)
    first, _, cache = PR.prefill(g, jax.numpy.asarray(tokens), jax.numpy.asarray(lengths), cache)
    step = g.forward(jax.numpy.asarray(new), cache.length[:, None] + np.arange(3)[None], cache).logits
    for b in range(2):
        seqs = [np.concatenate([conds[b], new[b]]), np.concatenate([uncs[b], new[b]])]
        batch = np.zeros((2, 16), np.int64)
        for i, s in enumerate(seqs):
            batch[i, :len(s)] = s
        lg = ports.logits(gm, batch)
        comb = lambda off: lg[1, len(uncs[b]) - 1 + off] + 2.5 * (lg[0, len(conds[b]) - 1 + off]
                                                                - lg[1, len(uncs[b]) - 1 + off])
        np.testing.assert_allclose(np.asarray(first[b]), comb(0), rtol=1e-4, atol=1e-4)
        for t in range(3):
            np.testing.assert_allclose(np.asarray(step[b, t]), comb(t + 1), rtol=1e-4, atol=1e-4)
    assert first.shape == (2, V)
