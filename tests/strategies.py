"""The conformance registry: every strategy, present and future, joins tests/test_conformance.py by one
`register` call here. From then on the suite proves for it, with no new test code: greedy == AR on a ragged batch
(each row as if alone), on one device and on a mesh of 8 forced CPU devices; exact sampling when it claims it; no
recompilation after warm-up; a clear error for a draft of another vocabulary.

`make(target, draft)` builds the strategy from a tiny (target, draft) pair: the draft shares the target's
vocabulary and disagrees with it often enough that drafts are both accepted and rejected.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

import jspec
from jspec.parts.drafters import ModelDrafter
from jspec.parts.plans import StaticPlan
from jspec.parts.trees import Layout, build_tree, chain
from toy_parts import CycleDepth, FixedTrees, TwoViews, per_row_trees
from jspec.parts.controllers.calibration import CaliTS, init_predictor
from jspec.parts.drafters.early_exit import init_head
from jspec.parts.drafters import dflash, eagle, eagle3, layer_skip


@dataclasses.dataclass(frozen=True)
class Entry:
    make: Callable
    exact: bool  # claims to sample the target's distribution exactly
    separate_draft: bool = True  # drafts with a model of its own (the vocabulary check applies)
    target_layers: int = 1  # layers of the tiny-vocabulary target of the sampling test (an early exit needs 2)
    slow: bool = False  # a variant of another entry: its per-strategy tests (and its mesh run) are `-m slow`
    sampling_prompt: tuple | None = None  # the sampling test's prompt (default sampling_check.PROMPT)


REGISTRY: dict[str, Entry] = {}


def register(name: str, make: Callable, exact: bool, separate_draft: bool = True, target_layers: int = 1,
             slow: bool = False, sampling_prompt: tuple | None = None) -> None:
    if name in REGISTRY:
        raise ValueError(f"strategy {name!r} is registered twice")
    REGISTRY[name] = Entry(make, exact, separate_draft, target_layers, slow, sampling_prompt)


SMALL_TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0]]
BUDGET = Layout(widths=(3, 3, 1), children=(3, 2, 1))

register("chain", lambda t, d: jspec.Chain(d, gamma=3), exact=True)
register("chain_q1", lambda t, d: jspec.Chain(d, gamma=2, rule="q1"), exact=True,
         slow=True)  # tree_q1 proves the q = 1 rule in the default suite (a chain is a one-child tree)
register("tree", lambda t, d: jspec.Tree(d, tree=SMALL_TREE), exact=True)
register("tree_q1", lambda t, d: jspec.Tree(d, tree=[[0], [1], [0, 0], [0, 1], [1, 0]], rule="q1"), exact=True)
register("tree_mc_sim", lambda t, d: jspec.Tree(d, tree="mc_sim_7b_63"), exact=True,
         slow=True)  # the named tree: SAGE's first round drafts it in the default suite
register("tree_in_budget", lambda t, d: jspec.Tree(d, tree=SMALL_TREE, budget=BUDGET), exact=True, slow=True)
register("dynamic", lambda t, d: jspec.DynamicTree(d, depth=3, top_k=3, total=8), exact=True)
register("chain_depth_controller", lambda t, d: jspec.Chain(d, gamma=4, controller=CycleDepth(jnp.int32(3))),
         exact=True, slow=True)  # eesd_cali and sage prove per-row depth limits in the default suite
register("dynamic_depth_controller",
         lambda t, d: jspec.DynamicTree(d, depth=3, top_k=2, total=5, controller=CycleDepth(jnp.int32(2))),
         exact=True, slow=True)
register("per_row_trees", lambda t, d: jspec.Speculative(
    ModelDrafter(d), StaticPlan.of(build_tree(chain(1), BUDGET)), "residual",
    FixedTrees(per_row_trees(BUDGET.levels, [[(1, 0, 0), (4, 1, 0), (7, 4, 0)],
                                             [(1, 0, 0), (2, 0, 1), (4, 1, 0), (5, 1, 1), (6, 2, 0)]]))),
    exact=True, slow=True)  # tests/test_parts.py proves per-row trees in the default suite
register("two_views", lambda t, d: jspec.Speculative(TwoViews(ModelDrafter(d), ModelDrafter(d), jnp.asarray([.4, .6])),
                                                     StaticPlan.of(build_tree(chain(3)))), exact=True,
         slow=True)  # tests/test_parts.py proves the two-view drafter greedy and exact in the default suite


def eesd_head(target, num_layers=1, share_lm_head=False):
    """An early-exit head after the target's first layer, nudged off the target's own layers so that drafts are
    both accepted and rejected."""
    head = init_head(target, exit_layer=1, num_layers=num_layers, share_lm_head=share_lm_head)
    leaves, tree = jax.tree.flatten(head.params)
    keys = jax.random.split(jax.random.key(7), len(leaves))
    noisy = [a + 0.3 * jnp.std(a) * jax.random.normal(k, a.shape, a.dtype) for a, k in zip(leaves, keys)]
    return head.replace(params=jax.tree.unflatten(tree, noisy))


register("eesd_beta", lambda t, d: jspec.EESD(eesd_head(t), k_max=5), exact=True, separate_draft=False,
         target_layers=2, slow=True)  # EESD's default: Beta-TS draft lengths (eesd_cali decides them inside the draft)
register("eesd_fixed_tree", lambda t, d: jspec.EESD(eesd_head(t), controller=2, k_max=3, tree=[[0], [1], [0, 0], [1, 0]]),
         exact=True, separate_draft=False, target_layers=2, slow=True)
register("eesd_head_only", lambda t, d: jspec.EESD(eesd_head(t, 0), controller=3, k_max=4), exact=True,
         separate_draft=False, target_layers=2, slow=True)
register("eesd_shared_lm_head", lambda t, d: jspec.EESD(eesd_head(t, share_lm_head=True), k_max=4), exact=True,
         separate_draft=False, target_layers=2, slow=True)  # tests/test_eesd.py proves it greedy in the default suite
def cali_ts(target):
    """Cali-TS with a random predictor whose stop bits depend on the drafted tokens' head states (a draft length
    that depends on the drafts themselves: still exact)."""
    pred = init_predictor(jax.random.key(11), target.config.hidden_size)
    return CaliTS(pred.replace(wp=40.0 * pred.wp), sigma_m=0.05)


register("eesd_cali", lambda t, d: jspec.EESD(eesd_head(t), controller=cali_ts(t), k_max=5), exact=True,
         separate_draft=False, target_layers=2, slow=True)  # (EESD's own: tests/test_eesd.py, by default)
register("chain_beta_ts", lambda t, d: jspec.Chain(d, gamma=6, controller=jspec.BetaTS()), exact=True, slow=True)


SAGE_SMALL = dict(d_min=2, d_max=4, w_min=2, w_max=4, k=4, n_max=12, init_tree=[[0], [1], [0, 0], [1, 0], [0, 0, 0]],
                  window=2)
register("sage", lambda t, d: jspec.SAGE(d, **SAGE_SMALL), exact=True, slow=True)  # (tests/test_sage.py by default)
register("sage_residual", lambda t, d: jspec.SAGE(d, rule="residual", **SAGE_SMALL), exact=True, slow=True)
# TABED's drafter and weight policy on text prompts: one view (the prompt as is), the grid policy over it; the
# multi-view settings are proven on image prompts in tests/test_tabed.py
register("tabed_one_view", lambda t, d: jspec.TABED(d, views=("M",), weights="grid", gamma=3), exact=True,
         slow=True)

def eagle_head(target):
    """An untrained EAGLE head that still drafts some accepted tokens: the target's first layer over the token
    embedding alone (fc = [I; 0]), which is close to the target on the tiny pairs (their later layers are damped)."""
    head = eagle.init_head(target, jax.random.key(3))
    D = target.config.hidden_size
    fc = jnp.concatenate([jnp.eye(D), jnp.zeros((D, D))], 0).astype(head.params["fc"].dtype)
    return head.replace(params=dict(head.params, fc=fc, layer=dict(target.params["layers"][0])))


# EAGLE-1's feature head over the target's own features (LANTERN++'s drafter), on a small static tree; slow, since
# eagle_tree_vocab runs the same tree and head (over a reduced vocabulary) by default
register("eagle_head", lambda t, d: jspec.Speculative(
    eagle.EagleDrafter(eagle_head(t)), StaticPlan.of(build_tree([[0], [1], [0, 0], [1, 0], [0, 0, 0]]))),
    exact=True, separate_draft=False, slow=True)

def every_third_dropped(target):
    """A draft vocabulary of the target's tokens without every third id (EAGLE-3's reduced vocabulary, in small)."""
    V = target.config.vocab_size
    return np.arange(V)[np.arange(V) % 3 != 2]


# the same head as `Tree`'s draft, over a reduced draft vocabulary: q is zero on a third of the tokens
register("eagle_tree_vocab", lambda t, d: jspec.Tree(eagle_head(t).with_vocab(every_third_dropped(t)),
                                                    tree=[[0], [1], [0, 0], [1, 0], [0, 0, 0]]),
         exact=True, separate_draft=False)
# SAGE's trees over the head
register("sage_eagle", lambda t, d: jspec.SAGE(eagle_head(t), **SAGE_SMALL), exact=True, separate_draft=False,
         slow=True)
# EAGLE-2's dynamic tree over the head (the q = 1 rule)
register("eagle_dynamic", lambda t, d: jspec.DynamicTree(eagle_head(t), depth=3, top_k=3, total=8), exact=True,
         separate_draft=False, slow=True)

def eagle3_head(target, vocab=None):
    """An untrained EAGLE-3 head that still drafts some accepted tokens: it passes on the token two back (fc picks
    the embedding stream, layer 0, at the entry's feature position; the layer's branches are damped) and scores it
    against the target's embedding, so it guesses repeats and two-token cycles, which the tiny targets write."""
    L = target.config.num_layers
    head = eagle3.init_head(target, jax.random.key(7), aux_layers=(0, L // 2, L), draft_vocab=vocab, scale=0.3)
    D = target.config.hidden_size
    emb = target.params["embed"]
    fc = jnp.zeros((3 * D, D)).at[:D].set(jnp.eye(D)).astype(head.params["fc"].dtype)
    layer = dict(head.params["layers"][0])
    layer.update(wo=layer["wo"] * 0.1, w_down=layer["w_down"] * 0.1)
    rows = emb if head.vocab is None else emb[head.vocab]
    return head.replace(params=dict(head.params, fc=fc, layers=[layer], lm_head=rows))


# EAGLE-3's head: a chain over a reduced draft vocabulary; (slow) EAGLE-3's own dynamic tree and a static tree
register("eagle3_chain", lambda t, d: jspec.Eagle3(eagle3_head(t, every_third_dropped(t)), tree="chain", depth=3),
         exact=True, separate_draft=False)
register("eagle3_dynamic", lambda t, d: jspec.Eagle3(eagle3_head(t), depth=3, top_k=3, total=8), exact=True,
         separate_draft=False, slow=True)  # the dynamic plan over a feature head: eagle_dynamic's path, slow too
register("eagle3_tree", lambda t, d: jspec.Eagle3(eagle3_head(t), tree=[[0], [1], [0, 0], [1, 0], [0, 0, 0]]),
         exact=True, separate_draft=False, slow=True)
register("sage_eagle3", lambda t, d: jspec.SAGE(eagle3_head(t), **SAGE_SMALL), exact=True, separate_draft=False,
         slow=True)

# prompt lookup: drafts copied from the text (no draft model), a chain and a tree of several matches; their
# sampling prompts repeat what the tiny-vocabulary target tends to write, so copies are drafted and accepted
register("prompt_lookup", lambda t, d: jspec.PromptLookup(max_ngram=2, gamma=4), exact=True, separate_draft=False,
         sampling_prompt=(1, 4, 2, 5, 3, 5, 3, 5))
register("prompt_lookup_tree", lambda t, d: jspec.PromptLookup(max_ngram=2, gamma=3, branches=3), exact=True,
         separate_draft=False, sampling_prompt=(5, 3, 5, 0, 5, 5, 3, 5, 2, 2, 5))



@functools.lru_cache(maxsize=None)  # one function per k: a TokenDrafter's function is part of its programs' key
def copy_last(k: int):
    """A `TokenDrafter` function: propose the text's last k tokens again (the README's five-line example)."""
    def propose(tokens, lengths):
        idx = jnp.clip(lengths[:, None] - k + jnp.arange(k)[None], 0, tokens.shape[1] - 1)
        return jnp.take_along_axis(tokens, idx, axis=1), jnp.broadcast_to(lengths[:, None] >= k, idx.shape)
    return propose


# a drafter from one function over the text (jspec.TokenDrafter): a chain and a static tree (the tree drafts its chain)
register("token_drafter", lambda t, d: jspec.Chain(jspec.TokenDrafter(copy_last(2)), gamma=3), exact=True,
         separate_draft=False, sampling_prompt=(1, 4, 5, 4, 5, 4, 5, 4))
register("token_drafter_tree", lambda t, d: jspec.Tree(jspec.TokenDrafter(copy_last(2)), tree=SMALL_TREE),
         exact=True, separate_draft=False, sampling_prompt=(1, 4, 5, 4, 5, 4, 5, 4),
         slow=True)  # the tree drafts the chain's proposal; tests/test_token_drafter.py decodes it greedy

def dflash_head(target, block=5):
    """An untrained block drafter that still drafts some accepted tokens: its context is the target's own final
    features (the last layer's stream under the target's final norm), every query attends to all of them alike
    (zero queries), and the values carry their projection on the LM head's leading singular directions, so each
    draft position predicts roughly the token the context predicted most: the repeats the tiny targets write."""
    cfg, lm = dflash.text_parts(target)
    D, Dh, kvh = cfg.hidden_size, cfg.head_dim, cfg.num_kv_heads
    head = dflash.init_head(target, jax.random.key(3), num_layers=1, block=block, target_layers=(cfg.num_layers,))
    w = np.asarray(lm["embed"]).T if cfg.tie_word_embeddings else np.asarray(lm["lm_head"])
    lead = np.linalg.svd(w, full_matrices=False)[0][:, :kvh * Dh].astype(np.float32)
    lead = np.pad(lead, ((0, 0), (0, kvh * Dh - lead.shape[1])))  # [D, kvh * Dh]
    group = cfg.num_heads // kvh
    wo = np.concatenate([lead[:, (h // group) * Dh:(h // group + 1) * Dh].T for h in range(cfg.num_heads)], axis=0)
    layer = dict(head.params["layers"][0])
    # the block's own entries (the anchor's and the mask token's embeddings) are damped (attn_norm 0.1), so that the
    # mean is mostly the context's, and their residual is outweighed by the attention's output (wo scaled up)
    layer.update(wq=jnp.zeros_like(layer["wq"]), wv=jnp.asarray(lead), wo=jnp.asarray(30.0 * wo),
                 w_down=jnp.zeros_like(layer["w_down"]), attn_norm=0.1 * jnp.ones_like(layer["attn_norm"]))
    return head.replace(params=dict(head.params, fc=jnp.eye(D), hidden_norm=lm["final_norm"], layers=[layer]))


# a block drafter (DFlash): its chain, its DDTree and (slow) a static tree over its per-position distributions
register("dflash_chain", lambda t, d: jspec.DFlash(dflash_head(t)), exact=True, separate_draft=False)
register("dflash_ddtree", lambda t, d: jspec.DFlash(dflash_head(t), tree="ddtree", top_k=3, total=8, depth=3),
         exact=True, separate_draft=False)
register("dflash_tree", lambda t, d: jspec.DFlash(dflash_head(t), tree=[[0], [1], [0, 0], [1, 0], [0, 0, 0]]),
         exact=True, separate_draft=False, slow=True)

# layer skipping in the target's own cache (Draft & Verify): the drafter writes the target's scratch slots
register("layer_skip_chain", lambda t, d: jspec.Chain(layer_skip.SkipDrafter((1,)), gamma=3), exact=True,
         separate_draft=False, target_layers=2)
register("layer_skip_tree", lambda t, d: jspec.Tree(layer_skip.SkipDrafter((1,)), tree=SMALL_TREE), exact=True,
         separate_draft=False, target_layers=2, slow=True)

# speculative Jacobi decoding: the target drafts a window of its own next tokens (no draft model); MC-SJD's maximal
# coupling by default, SJD's independent draws (tests/test_sjd.py proves both exact and greedy in the default suite)
register("sjd", lambda t, d: jspec.SJD(window=3), exact=True, separate_draft=False)
register("sjd_independent", lambda t, d: jspec.SJD(window=3, coupling="independent", init="uniform"), exact=True,
         separate_draft=False, slow=True)

SHARDED_CHECKS = {"chain", "tree"}  # tests/sharded_checks.py decodes these on two meshes in the default suite


def mesh_entries(slow: bool) -> list[str]:
    """The entries tests/conformance_mesh.py runs: the default ones without those tests/sharded_checks.py already
    decodes on a mesh, or with `slow` the slow ones and those."""
    return sorted(n for n, e in REGISTRY.items() if (e.slow or n in SHARDED_CHECKS) == slow)


def guarded(strategy, step=0.05, rate=0.5, retry=2):
    """`strategy` under the guard with a cost table that makes drafting pay from a low acceptance (a round at
    depth d costs 1 + step * d AR steps), so that rows speculate at first, drop to AR steps after rejections
    (rate 0.5: two rejections in a row) and try again 2 rounds later, 4, 8, ... (`retry`): a short decode
    switches both ways."""
    from jspec.engine.costs import CostTable

    D = strategy.parts().plan.max_depth
    return jspec.Guarded(strategy, costs=CostTable(1.0, tuple(1.0 + step * d for d in range(D + 1))), rate=rate,
                          retry=retry)


# the guard is one hook and one round path for every strategy: guarded_chain and guarded_eagle3 prove it in the
# default suite (with a model draft and an EAGLE feed with its side input), tests/test_guard.py covers an early-exit
# feed, trees and deferral; the other guarded entries are slow
register("guarded_chain", lambda t, d: guarded(jspec.Chain(d, gamma=3)), exact=True)
register("guarded_tree", lambda t, d: guarded(jspec.Tree(d, tree=SMALL_TREE)), exact=True, slow=True)
register("guarded_eesd", lambda t, d: guarded(jspec.EESD(eesd_head(t), k_max=4)), exact=True, separate_draft=False,
         target_layers=2, slow=True)
# the EAGLE heads keep a feed of their own: the guard's AR rounds leave it unread (`Guarded.defer`)
register("guarded_eagle3", lambda t, d: guarded(jspec.Eagle3(eagle3_head(t, every_third_dropped(t)), tree="chain",
                                                             depth=3)), exact=True, separate_draft=False)
register("guarded_eagle_tree", lambda t, d: guarded(jspec.Tree(eagle_head(t), tree=SMALL_TREE)), exact=True,
         separate_draft=False, slow=True)
register("guarded_lookup", lambda t, d: guarded(jspec.PromptLookup(max_ngram=2, gamma=3)), exact=True,
         separate_draft=False, slow=True, sampling_prompt=(1, 4, 2, 5, 3, 5, 3, 5))
register("guarded_dflash", lambda t, d: guarded(jspec.DFlash(dflash_head(t))), exact=True, separate_draft=False,
         slow=True)
register("guarded_dflash_tree", lambda t, d: guarded(jspec.DFlash(dflash_head(t), tree="ddtree", top_k=3, total=8,
                                                                   depth=3)),
         exact=True, separate_draft=False, slow=True)
register("guarded_sjd", lambda t, d: guarded(jspec.SJD(window=3)), exact=True, separate_draft=False, slow=True)
register("guarded_layer_skip", lambda t, d: guarded(jspec.Chain(layer_skip.SkipDrafter((1,)), gamma=3)), exact=True,
         separate_draft=False, target_layers=2, slow=True)
