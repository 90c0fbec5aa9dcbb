"""Block drafters (`jspec.DFlash`): DDTree's choice of paths, VLM targets, bad input. Greedy == AR, exact sampling,
meshes and recompilation are the conformance suite's (tests/strategies.py registers dflash_chain and dflash_ddtree);
training is tests/test_dflash_train.py's."""
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
import ports
from jspec.parts.drafters import dflash
from ports.core import cache as kvc
from ports.families import llama
from jspec.parts.plans import best_paths
from strategies import dflash_head
from tiny_pairs import PROMPTS, tiny_pair


def _paths(tokens, valid, tree, b):
    """The set of root-to-node token paths of row b's valid nodes."""
    out = set()
    parent, toks = np.asarray(tree.parent[b]), np.asarray(tokens[b])
    for i in np.flatnonzero(np.asarray(valid[b]))[1:]:
        path, j = [], i
        while j > 0:
            path.append(int(toks[j - 1]))
            j = parent[j]
        out.add(tuple(reversed(path)))
    return out


@pytest.mark.parametrize("top_k,total", [(5, 12), (2, 6), (3, 30)])
def test_best_paths_are_the_most_probable_ones(top_k, total):
    """Against enumeration: the kept nodes are the `total` best prefixes (sum of per-position log-probs) over each
    position's top_k tokens; with a depth limit, the best no deeper than it."""
    logp = jax.nn.log_softmax(3.0 * jax.random.normal(jax.random.key(top_k), (2, 3, 5)), axis=-1)
    limit = jnp.asarray([3, 2])
    kids, valid, tree = best_paths(logp, top_k, total, limit)
    lp = np.asarray(logp)
    for b in range(2):
        allowed = [np.argsort(-lp[b, d])[:top_k] for d in range(3)]
        cands = [p for n in range(1, int(limit[b]) + 1) for p in itertools.product(*allowed[:n])]
        score = {p: sum(lp[b, d, t] for d, t in enumerate(p)) for p in cands}
        want = set(sorted(cands, key=lambda p: -score[p])[:total])
        assert _paths(kids, valid, tree, b) == want
        depth = np.asarray(tree.depth[b])[np.asarray(valid[b])]
        assert depth.max() <= int(limit[b])


def _block_after(target, head, ids):
    """The head's final-normed block states [block, D] after the committed tokens ids[:-1], anchored at ids[-1]."""
    cfg, lm = dflash.text_parts(target)
    T = len(ids) - 1
    tokens = jnp.asarray(ids[None, :T], jnp.int32)
    cache = kvc.init_cache(cfg.num_layers, 1, cfg.num_kv_heads, T, cfg.head_dim, jnp.float32)
    fo = llama.forward(cfg, lm, tokens, jnp.arange(T)[None], cache, hidden_layers=head.target_layers,
                       compute_logits=False, fresh=True)
    hc = head.config
    own = kvc.init_cache(hc.num_layers, 1, hc.num_kv_heads, T + head.block, hc.head_dim, jnp.float32)
    own = dflash.write_context(head, own, jnp.concatenate(fo.hidden, axis=-1)).replace(length=jnp.asarray([T]))
    return np.asarray(dflash.block_forward(head, lm, jnp.asarray(ids[-1:]), own, head.block)[0])


def test_every_draft_position_reads_the_context():
    """Two texts of the same length ending in the same anchor token: every draft position's state differs between
    them, as each mask position attends to the context entries (a drafter whose positions after the anchor ignore
    the context would draft the same block after any text)."""
    target, _ = tiny_pair()
    head = dflash.init_head(target, jax.random.key(1), num_layers=1, block=5, scale=0.3)
    a = np.asarray([3, 14, 15, 92, 65, 35, 8], np.int32)
    b = np.asarray([27, 18, 28, 1, 82, 84, 8], np.int32)
    fa, fb = _block_after(target, head, a), _block_after(target, head, b)
    gap = np.abs(fa - fb).max(axis=-1)  # [block]
    assert (gap[1:] > 1e-2 * np.abs(fa).max()).all(), gap


def _vlm_prompt(name):
    if name == "image":
        from jspec.tools.zoo import data as ZD
        from jspec.tools.zoo import evaluate as ZE

        pair = ZE.load_pair("image")
        return pair.target, ZE.batch_prompt(pair.encoder, ZD.eval_set("vqa", 2) + ZD.eval_set("two_image", 1))
    from jspec.tools import zoo
    from jspec.tools.zoo import video as ZV

    return zoo.load("video-target"), ZV.VideoEncoder().prompts(ZV.eval_set(3))


@pytest.mark.parametrize("name", ["image", "video"])
def test_vlm_targets_greedy_equal_ar(name):
    """A LLaVA target (images, one row with two) and a Qwen2.5-VL target (videos, M-RoPE), ragged rows: the block
    drafter reads the target's states over the image and video tokens, and chain and DDTree give AR's tokens."""
    target, prompt = _vlm_prompt(name)
    ar = jspec.decode(target, prompt, max_new_tokens=12)
    head = dflash_head(target)
    for strat in (jspec.DFlash(head), jspec.DFlash(head, tree="ddtree", top_k=3, total=8)):
        out = jspec.decode(target, prompt, strategy=strat, max_new_tokens=12)
        np.testing.assert_array_equal(out.tokens, ar.tokens)


def test_bfloat16_head_and_target():
    """A bfloat16 head drafts for a bfloat16 target, whose greedy output it keeps."""
    target, _ = tiny_pair()
    t16 = ports.Model(target.config, jax.tree.map(lambda a: a.astype(jnp.bfloat16), target.params),
                      target.hf_config)
    head = dflash_head(t16)
    head = head.replace(params=jax.tree.map(lambda a: a.astype(jnp.bfloat16), head.params))
    ar = jspec.decode(t16, PROMPTS, max_new_tokens=12, eos_token_id=())
    out = jspec.decode(t16, PROMPTS, strategy=jspec.DFlash(head), max_new_tokens=12, eos_token_id=())
    np.testing.assert_array_equal(out.tokens, ar.tokens)


def test_bad_input_is_refused():
    target, draft = tiny_pair()
    head = dflash_head(target)  # block 5: four draft positions
    with pytest.raises(ValueError, match="made for another target"):
        jspec.decode(target, PROMPTS, strategy=jspec.DFlash(dflash.init_head(tiny_other(), jax.random.key(0))),
                     max_new_tokens=4)
    with pytest.raises(ValueError, match=r"depth must be an integer in \[1, 4\]"):
        jspec.DFlash(head, depth=5)
    with pytest.raises(ValueError, match="4 deep; a block of 3"):
        jspec.DFlash(head, tree=[[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]], block=3).parts()
    with pytest.raises(ValueError, match="q1"):
        jspec.decode(target, PROMPTS, strategy=jspec.DFlash(head, tree="ddtree", rule="residual"), max_new_tokens=4)
    with pytest.raises(ValueError, match="needs more candidates"):
        best_paths(jnp.zeros((1, 2, 9)), 2, 7)
    with pytest.raises(ValueError, match="block must be"):
        dflash.init_head(target, jax.random.key(0), block=1)
    with pytest.raises(ValueError, match="reads target layers"):
        dflash.init_head(target, jax.random.key(0), target_layers=(9,)).check(target)
    with pytest.raises(ValueError, match="tree must be one of"):
        jspec.DFlash(head, tree="dynamic")


def tiny_other():
    return ports.random_model(ports.TextConfig(model_type="llama", vocab_size=97, hidden_size=32, intermediate_size=48,
                                               num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16), key=5)
