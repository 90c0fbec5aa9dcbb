"""Exact sampling through the engine's deep paths, against exact enumeration.

The first generated token is drawn at prefill from the target alone, so these tests count the joint of the first four
tokens: tokens 2-4 are decided by speculative verification, whole depth-3 paths of chains, static and dynamic trees
accepted or rejected, under temperature, top-k and top-p (the reference warps with transformers' own warpers). The same
holds under classifier-free guidance with Lumina-mGPT's image grammar, and for a LLaVA target reading an image; the
sharded mesh's case runs in tests/sharded_checks.py. Each check asserts a chi-square p-value and a total-variation
distance within what exact sampling of the same size gives; each family has a negative control that the same check
rejects."""
import jax
import numpy as np
import pytest

import jspec
from sampling_check import (CH_IMAGE_PREFIX, IMAGE_PROMPT, PIXELS, PROMPT, V, VLM_V, check, close_pair, empirical,
                            exact_joint, guided_joint, image_joint, joint_index, noisy_copy, tiny_chameleon, tiny_llava)
from toy_parts import ResampleFromTarget

N = 4  # tokens counted: the prefill's, then three or more decided by speculative verification
ROWS = 20000
DEEP_TREE = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]

STRATEGIES = {
    "chain3": lambda d: jspec.Chain(d, gamma=3),
    "tree_depth3": lambda d: jspec.Tree(d, tree=DEEP_TREE),
    "dynamic_depth3": lambda d: jspec.DynamicTree(d, depth=3, top_k=3, total=8),
}
SETTINGS = {
    "T1": {},
    "T0.6": dict(temperature=0.6),
    "T1.5_topk3": dict(temperature=1.5, top_k=3),
    "topp0.8": dict(top_p=0.8),
    "T0.8_topk4_topp0.9": dict(temperature=0.8, top_k=4, top_p=0.9),
}
DEFAULT = {("chain3", "topp0.8"), ("tree_depth3", "T0.8_topk4_topp0.9"), ("dynamic_depth3", "T1.5_topk3")}
CASES = [pytest.param(s, w, marks=() if (s, w) in DEFAULT else pytest.mark.slow, id=f"{s}-{w}")
         for s in STRATEGIES for w in SETTINGS]


@pytest.fixture(scope="module")
def models():
    return close_pair()


def _verified_depth(out) -> np.ndarray:
    """Tokens the first speculative step committed per row (accepted drafts plus the target's own token)."""
    return np.asarray(out.stats["accepted"])[:, 0]


@pytest.mark.parametrize("strategy,setting", CASES)
def test_three_verified_tokens_are_exact(models, strategy, setting):
    target, draft = models
    warpers = SETTINGS[setting]
    p = exact_joint(target, N, **warpers)
    counts, out = empirical(target, STRATEGIES[strategy](draft), jax.random.key(7), N, ROWS, **dict(warpers))
    depth = _verified_depth(out)
    assert (depth >= 3).sum() >= 200 and (depth == 1).sum() >= 200  # whole depth-3 paths accepted, and rejections
    check(counts, p)


def test_negative_controls(models):
    """The same check rejects (a) a residual that resamples from the target after a rejection, under warpers, and
    (b) exact SD counts against a reference that omits the top-k warper: it sees both."""
    target, draft = models
    warpers = dict(temperature=0.8, top_k=4, top_p=0.9)
    wrong = jspec.Chain(draft, gamma=3, rule=ResampleFromTarget())
    counts, _ = empirical(target, wrong, jax.random.key(7), N, ROWS, **dict(warpers))
    check(counts, exact_joint(target, N, **warpers), exact=False)
    counts, _ = empirical(target, jspec.Chain(draft, gamma=3), jax.random.key(7), N, ROWS, top_k=3)
    check(counts, exact_joint(target, N, top_k=3))
    check(counts, exact_joint(target, N), exact=False)


def test_ragged_batch_every_row_is_exact(models):
    """Three prompts of lengths 1, 3 and 5 interleaved in one batch: each prompt's rows sample its own joint."""
    target, draft = models
    prompts = [np.array([3]), PROMPT, np.array([5, 0, 2, 2, 1])]
    rows = 7000
    batch = [prompts[i % 3] for i in range(3 * rows)]
    warpers = dict(temperature=0.9, top_k=5)
    out = jspec.decode(target, batch, strategy=jspec.Tree(draft, tree=DEEP_TREE), max_new_tokens=N,
                       key=jax.random.key(3), eos_token_id=(), **warpers)
    assert (_verified_depth(out) >= 3).sum() >= 200
    idx = joint_index(out.tokens, N)
    for i, prompt in enumerate(prompts):
        counts = np.bincount(idx[i::3], minlength=V ** N)
        check(counts, exact_joint(target, N, prompt=prompt, **warpers))
    # and a row's draws are not another prompt's: row 0's prompt against row 1's joint is rejected
    check(np.bincount(idx[0::3], minlength=V ** N), exact_joint(target, N, prompt=prompts[1], **warpers), exact=False)


# ------------------------------------------------------------- CFG + the image grammar (Lumina-mGPT's default)


@pytest.fixture(scope="module")
def guided_pair():
    target = tiny_chameleon()
    return target, noisy_copy(target, 0.05)


@pytest.mark.slow
def test_cfg_and_image_grammar_are_exact(guided_pair):
    """CFG 3 over a 2 x 2 image grid (image, image, end-of-row, image: the forced token in the middle of a verified
    path), T = 1 with top-k 5 as Lumina-mGPT samples: a depth-3 tree's tokens follow the guided, constrained,
    warped target exactly; a residual that resamples from the target does not."""
    target, draft = guided_pair
    gram = jspec.images.grammar(target.config, 2, 2)
    cond = np.array([9, 12, 30, 11] + CH_IMAGE_PREFIX)
    seqs, p = guided_joint(target, cond, np.array(CH_IMAGE_PREFIX), 3.0, gram, N, top_k=5)
    cells = joint_index(seqs, N, target.vocab_size)  # the grammar's support, ascending

    def counts(rule):
        out = jspec.decode(target, np.tile(cond, (ROWS, 1)), jspec.Tree(draft, tree=DEEP_TREE, rule=rule),
                           max_new_tokens=N, temperature=1.0, top_k=5, key=jax.random.key(4), eos_token_id=(),
                           guidance=jspec.CFG(3.0, CH_IMAGE_PREFIX), constraint=gram)
        drawn = joint_index(out.tokens, N, target.vocab_size)
        assert np.isin(drawn, cells).all()  # every draw follows the grammar
        return np.bincount(np.searchsorted(cells, drawn), minlength=len(cells)), out

    got, out = counts("residual")
    depth = _verified_depth(out)
    assert (depth >= 3).sum() >= 200 and (depth == 1).sum() >= 200, np.bincount(depth)
    check(got, p)
    check(counts(ResampleFromTarget())[0], p, exact=False)


# ------------------------------------------------------------------------------------ a VLM target with an image


@pytest.mark.slow
def test_vlm_target_with_an_image_is_exact():
    """A LLaVA target and a close LLaVA draft, both reading the image: chain gamma 3 at T 0.9 + top-k 4 samples the
    image-conditioned joint exactly; the wrong residual does not, and the exact draws do not fit the joint of the
    same prompt with a blank image."""
    target = tiny_llava(10, 0.4)
    draft = noisy_copy(target, 0.15)
    warpers = dict(temperature=0.9, top_k=4)
    p = image_joint(target, IMAGE_PROMPT, PIXELS, N, **warpers)
    prompt = {"input_ids": np.tile(IMAGE_PROMPT, (ROWS, 1)), "pixel_values": np.repeat(PIXELS, ROWS, 0)}

    def counts(rule):
        out = jspec.decode(target, prompt, jspec.Chain(draft, gamma=3, rule=rule), max_new_tokens=N,
                           key=jax.random.key(6), eos_token_id=(), **warpers)
        return np.bincount(joint_index(out.tokens, N, VLM_V), minlength=VLM_V ** N), out

    got, out = counts("residual")
    depth = _verified_depth(out)
    assert (depth >= 3).sum() >= 200 and (depth == 1).sum() >= 200, np.bincount(depth)
    check(got, p)
    check(counts(ResampleFromTarget())[0], p, exact=False)
    check(got, image_joint(target, IMAGE_PROMPT, np.zeros_like(PIXELS), N, **warpers), exact=False)
