"""Strategies over Qwen3 and Qwen3-MoE targets (issue 105, item 2): on a tiny random `qwen3` (head_dim not hidden /
heads, tied embeddings, a sliding layer) and `qwen3_moe` (a dense layer, 8 experts, top 2), drafters in the layouts
their authors publish load (z-lab's DFlash, an EAGLE-3 head in `speculators`' and in the EAGLE repository's
layout, written by hand with random values), and Chain / Tree with a small Qwen3 draft, DFlash's chain and DDTree,
EAGLE-3 as a chain and as a tree, and a guarded chain all give AR's greedy tokens on a ragged batch of 3; the same
on an 8-device mesh with the MoE's experts split over the `expert` axis (tests/qwen3_sharded_checks.py, a
subprocess); and on a tiny-vocabulary qwen3_moe, sampled chain and tree decoding draw the target's exact
distribution (tests/sampling_check.py's enumeration). The default run covers the MoE target; what other files cover
for the dense one, DFlash's DDTree, EAGLE-3 and the guard sampled, and most of the mesh run under -m slow."""
import functools
import json
import os
import subprocess
import sys
from typing import NamedTuple

import jax
import numpy as np
import pytest

import jspec
import ports
from jspec.parts.drafters import eagle3 as E3
from ports.families import qwen3 as Q3
from qwen3_pairs import (DRAFT_IDS, KINDS, NAMES, PROMPTS, SPECULATORS_AUX, mesh_names, qwen3_draft, random_dirs,
                         strategies, tiny_target, useful_heads)
from sampling_check import chi2_pvalue, empirical, exact_joint, noisy_copy, total_variation
from strategies import SMALL_TREE, dflash_head, eagle3_head, every_third_dropped, guarded
from tolerances import assert_clear_margins

NEW = 16


@pytest.fixture(autouse=True)
def _free_programs_per_test():
    yield
    jax.clear_caches()  # as tests/test_conformance.py: many small programs, freed per test


class Case(NamedTuple):
    kind: str
    target: object
    draft: object  # the one-layer qwen3 draft model
    ar: np.ndarray  # AR's greedy tokens on PROMPTS
    tmp: object  # a scratch directory


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    """kind -> its `Case`, built once per module."""
    built = {}

    def get(kind: str) -> Case:
        if kind not in built:
            target = tiny_target(kind)
            ar = jspec.decode(target, PROMPTS, max_new_tokens=NEW, eos_token_id=()).tokens
            assert_clear_margins(target, PROMPTS, ar)  # exact equality below is decided by the engine, not rounding
            built[kind] = Case(kind, target, qwen3_draft(target), ar, tmp_path_factory.mktemp(kind))
        return built[kind]

    return get


_HEADS = {}


def _useful(c: Case):
    """The registry's drafters for c's target, through the published layouts (`qwen3_pairs.useful_heads`), once."""
    if c.kind not in _HEADS:
        _HEADS[c.kind] = useful_heads(c.target, str(c.tmp / "useful"))
    return _HEADS[c.kind]


def _decode(target, strategy):
    return jspec.decode(target, PROMPTS, strategy=strategy, max_new_tokens=NEW, eos_token_id=())


PUBLISHED = ("dflash", "eagle3_speculators", "eagle3_eagle")


@pytest.mark.parametrize("kind,decoded", [
    ("qwen3_moe", PUBLISHED[1:]), ("qwen3", PUBLISHED[1:2]),
    # z-lab's layout decodes on the MoE below (a head read from it) and on a dense qwen3 in test_dflash_io.py
    pytest.param("qwen3_moe", PUBLISHED[:1], marks=pytest.mark.slow),
    pytest.param("qwen3", PUBLISHED[::2], marks=pytest.mark.slow)])
def test_published_drafters_load_for_qwen3_targets_and_decode_as_ar(cases, kind, decoded):
    """Hand-written directories with random values, field for field as the drafters for Qwen3 targets are
    published: z-lab's DFlash (Qwen3 layers, target_layer_ids 0 and 2), speculators' EAGLE-3 (layers 0, 1, 3,
    norm_before_residual, a Qwen3 verifier) and the EAGLE repository's (midlayer.*, no layer ids: the default ones),
    both EAGLE-3 heads over a 33-token draft vocabulary (d2t / t2d) with LLaMA layers of the target's head_dim and
    no window. Each loads with those settings; those `decoded` decode the ragged batch to AR's tokens (DFlash as a
    chain, the speculators head in EAGLE-3's dynamic tree, the EAGLE layout's as a chain)."""
    c = cases(kind)
    heads = random_dirs(c.target, str(c.tmp / "random"))
    df, spec, eg = heads
    assert (df.target_layers, df.block, df.mask_token, df.config.num_layers) == ((1, 3), 5, 96, 2)
    assert all("q_norm" in p and "k_norm" in p for p in df.params["layers"])
    assert spec.aux_layers == SPECULATORS_AUX and spec.norm_before_residual and not spec.norm_output
    assert eg.aux_layers == E3.default_aux_layers(c.target.config.num_layers) == (2, 1, 0)
    for h in (spec, eg):
        np.testing.assert_array_equal(np.asarray(h.vocab), DRAFT_IDS)
        hc = h.config
        assert (hc.model_type, hc.head_dim, hc.sliding_window, hc.rope.theta, hc.intermediate_size) == (
            "llama", 24, None, 1e6, 160)
        assert type(hc) is ports.TextConfig and "q_norm" not in h.params["layers"][0]
        assert h.target.model_type == kind
    strats = {"dflash": jspec.DFlash(df), "eagle3_speculators": jspec.Eagle3(spec, depth=3, top_k=3, total=8),
              "eagle3_eagle": jspec.Eagle3(eg, tree="chain", depth=3)}
    for name in decoded:
        np.testing.assert_array_equal(_decode(c.target, strats[name]).tokens, c.ar, err_msg=name)


@pytest.mark.parametrize("kind,name", [(k, n) if k == "qwen3_moe" else pytest.param(k, n, marks=pytest.mark.slow)
                                       for k in KINDS for n in NAMES])
def test_every_strategy_equals_ar_on_a_ragged_batch(cases, kind, name):
    """Chain and Tree with the one-layer Qwen3 draft, DFlash's chain and DDTree (a head read from z-lab's layout),
    EAGLE-3 as a chain (read from speculators' layout) and as a static tree (from the EAGLE repository's) and a
    guarded chain (a hand-made cost table) give AR's tokens on the ragged batch, with drafts accepted. The MoE
    target by default; the dense one under -m slow (its Chain / Tree: test_qwen3.py; its DFlash: test_dflash_io.py;
    its EAGLE-3 heads: the test above)."""
    c = cases(kind)
    strat = strategies(c.draft, _useful(c))[name]
    out = _decode(c.target, strat)
    np.testing.assert_array_equal(out.tokens, c.ar)
    assert out.stats["mean_accepted"].max() > 1.0, out.stats["mean_accepted"]


# ------------------------------------------------------------------------------------------ exact sampling


@functools.lru_cache(maxsize=None)
def tiny_vocab_moe():
    """(target, draft, the exact joint of 4 tokens after sampling_check.PROMPT) over 6 tokens: a one-layer
    qwen3_moe (4 experts, top 2) and a noisy copy of it, close enough that whole paths are accepted and far enough
    that every depth rejects (sampling_check.close_pair's recipe)."""
    cfg = Q3.config_from_hf({"model_type": "qwen3_moe", "vocab_size": 6, "hidden_size": 16, "intermediate_size": 24,
                             "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
                             "head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8,
                             "norm_topk_prob": True, "bos_token_id": None, "eos_token_id": None})
    assert cfg.is_sparse(0)
    target = ports.random_model(cfg, key=10, std=0.4)
    return target, noisy_copy(target), exact_joint(target, 4)


SAMPLED = {
    "chain": lambda t, d: jspec.Chain(d, gamma=3),
    "tree": lambda t, d: jspec.Tree(d, tree=SMALL_TREE),
    "dflash_ddtree": lambda t, d: jspec.DFlash(dflash_head(t), tree="ddtree", top_k=3, total=8, depth=3),
    "eagle3_chain": lambda t, d: jspec.Eagle3(eagle3_head(t, every_third_dropped(t)), tree="chain", depth=3),
    "guarded_tree": lambda t, d: guarded(jspec.Tree(d, tree=SMALL_TREE)),
}


@pytest.mark.parametrize("name", ["chain", "tree"] + [pytest.param(n, marks=pytest.mark.slow) for n in
                                                       ("dflash_ddtree", "eagle3_chain", "guarded_tree")])
def test_sampling_on_a_moe_target_is_exact(name):
    """12000 rows sampled at temperature 1: the first 4 tokens' joint (3 decided by verification) is the
    target's, by enumeration over the 6-token vocabulary; both rejections at the root and accepted depth-2 paths
    occur."""
    target, draft, p = tiny_vocab_moe()
    counts, out = empirical(target, SAMPLED[name](target, draft), jax.random.key(0), n=4)
    pval, tv = chi2_pvalue(counts, p), total_variation(counts, p)
    first = out.stats["accepted"][:, 0]
    assert (first == 1).mean() > 0.05 and (first >= 3).mean() > 0.01, np.bincount(first)
    assert pval > 1e-3, (pval, tv)


# ------------------------------------------------------------------------------------------ the mesh


@pytest.mark.parametrize("slow", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["default", "slow"])
def test_every_strategy_on_an_8_device_mesh_with_the_experts_split(slow):
    """tests/qwen3_sharded_checks.py on 8 forced CPU devices: the qwen3_moe target's experts split over `expert` (and
    their width over `tensor`, rows over `data`); the strategies give the unsharded AR tokens (the default ones
    here, the rest and the dense qwen3 target under -m slow)."""
    here = os.path.dirname(__file__)
    script = os.path.join(here, "qwen3_sharded_checks.py")
    proc = subprocess.run([sys.executable, script] + (["--slow"] if slow else []),
                          env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True, timeout=1200,
                          cwd=os.path.dirname(here))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"placement": 1, "passed": mesh_names(slow)}
