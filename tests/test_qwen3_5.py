"""Qwen3.5's hybrid language models (`qwen3_5_text`, `qwen3_5_moe_text`): Gated DeltaNet linear attention beside
gated full attention, and exact speculative decoding over the recurrent state.

- parity with transformers 5.23 (torch reference kernels): logits of a 150-token ragged batch (the chunked form:
  three blocks of 64), dense and MoE; a prefill then one-token steps, and a chunked prefill, give the one-pass logits;
  transformers' greedy generate; save_hf loads in transformers; bad configs name their field;
- the mechanism, on random numbers: a tree's forward gives every node the delta rule's output along its own path
  (against the token-by-token recurrence), and `advance` commits the state after an accepted path only;
- speculative decoding on a tiny target whose rows accept different lengths: Chain, a static tree, DynamicTree,
  DFlash's DDTree, an EAGLE-3 chain, SJD and a guarded chain give AR's greedy tokens on a ragged batch of 3; chain
  and tree sampling draw the target's exact joint (enumeration over a 6-token vocabulary).
A mutant that commits the state after the whole draft (tests/mutants.py `recurrent-whole-draft`) fails them.
"""
import dataclasses
import functools
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import jspec
import ports
from jspec.core import prefill as PR
from jspec.parts.drafters import mtp as MT
from ports.core import cache as kvc
from ports.families import qwen3 as Q3
from ports.families import qwen3_5 as Q5
from ports.core import recurrent as RC
from conftest import hf_greedy, perturb
from sampling_check import chi2_pvalue, empirical, exact_joint, total_variation
from strategies import SMALL_TREE, dflash_head, eagle3_head, every_third_dropped, guarded
from tiny_pairs import PROMPTS

V = 97
SMALL = dict(vocab_size=V, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=12,
             linear_num_key_heads=2, linear_num_value_heads=4, max_position_embeddings=512,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                              "mrope_section": [1, 1, 0], "mrope_interleaved": True})
KINDS = {"dense": dict(SMALL, intermediate_size=96),
         "moe": dict(SMALL, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                     shared_expert_intermediate_size=40)}


@functools.lru_cache(maxsize=None)
def hf_pair(kind: str, tmp: str):
    """(transformers model, jspec model loaded from its save_pretrained) for `kind`, weights perturbed so that every
    norm, gate and decay matters."""
    cls = {"dense": (transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM),
           "moe": (transformers.Qwen3_5MoeTextConfig, transformers.Qwen3_5MoeForCausalLM)}[kind]
    torch.manual_seed(0)
    hf = perturb(cls[1](cls[0](**KINDS[kind])).eval(), seed=1, scale=0.1)
    hf.save_pretrained(f"{tmp}/{kind}")
    return hf, ports.load_hf(f"{tmp}/{kind}")


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return str(tmp_path_factory.mktemp("qwen3_5"))


def _hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor(ids)).logits.float().numpy()


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_logits_match_transformers_over_the_chunked_form(kind, tmp):
    hf, model = hf_pair(kind, tmp)
    assert model.config.linear_layers == (0, 1, 2) and model.kv_layout == (1, 2, 16)
    ids = np.random.RandomState(0).randint(0, V, (2, 150))
    np.testing.assert_allclose(ports.logits(model, ids), _hf_logits(hf, ids), atol=2e-4, rtol=1e-4)


def test_prefill_then_single_steps_and_a_chunked_prefill_match_one_pass(tmp):
    """Ragged prompts prefilled (the state stops at each row's length), then 6 tokens fed one forward each, give
    transformers' logits over the whole rows; a prefill 16 tokens at a time gives the one-pass cache."""
    hf, model = hf_pair("dense", tmp)
    rng = np.random.RandomState(1)
    lengths = np.array([70, 23])
    T = int(lengths.max())
    rows = [rng.randint(0, V, n + 6) for n in lengths]
    tokens = jnp.asarray(np.stack([np.pad(r[:n], (0, T - n)) for r, n in zip(rows, lengths)]))
    cache = PR.new_cache_for(model, 2, 128)
    logits, _, cache = PR.prefill(model, tokens, jnp.asarray(lengths), cache)
    _, _, chunked = PR.prefill(model, tokens, jnp.asarray(lengths), PR.new_cache_for(model, 2, 128), chunk=16)
    for a, b in zip(jax.tree.leaves(cache.rec), jax.tree.leaves(chunked.rec)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
    ours = [np.asarray(logits)]
    for j in range(6):
        step = jnp.asarray([r[n + j] for r, n in zip(rows, lengths)])[:, None]
        fo = model.forward(step, kvc.positions(cache, jnp.zeros((2, 1), jnp.int32)), cache)
        cache = kvc.commit(fo.cache, jnp.ones((2,), jnp.int32))
        ours.append(np.asarray(fo.logits[:, 0]))
    for b, (r, n) in enumerate(zip(rows, lengths)):
        ref = _hf_logits(hf, r[None])[0, n - 1:]
        np.testing.assert_allclose(np.stack([o[b] for o in ours]), ref, atol=2e-4, rtol=1e-4)


def test_greedy_decode_equals_transformers_generate(tmp):
    hf, model = hf_pair("moe", tmp)
    prompt = np.random.RandomState(2).randint(0, V, 11)
    out = jspec.decode(model, [prompt], max_new_tokens=12, eos_token_id=())
    np.testing.assert_array_equal(out.tokens[0], hf_greedy(hf, prompt, 12))


def test_save_hf_loads_in_transformers(tmp):
    hf, model = hf_pair("moe", tmp)
    ports.save_hf(model, f"{tmp}/saved")
    back = transformers.Qwen3_5MoeForCausalLM.from_pretrained(f"{tmp}/saved").eval()
    ids = np.random.RandomState(3).randint(0, V, (1, 20))
    np.testing.assert_allclose(_hf_logits(back, ids), _hf_logits(hf, ids), atol=1e-5)
    assert ports.load_hf(f"{tmp}/saved").config == model.config


@pytest.mark.parametrize("change, field", [
    ({"layer_types": ["linear_attention"] * 3}, "layer_types"),
    ({"linear_num_value_heads": 3}, "linear_num_value_heads"),
    ({"attn_output_gate": False}, "attn_output_gate"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"linear_conv_kernel_dim": 1}, "linear_conv_kernel_dim"),
])
def test_bad_configs_name_their_field(change, field):
    with pytest.raises(ValueError, match=field):
        Q5.config_from_hf({**KINDS["dense"], "model_type": "qwen3_5_text", **change})


# ------------------------------------------------------------------------------------------ the mechanism


def _recurrent(S, q, k, v, g, beta):
    """transformers' token-by-token rule for one sequence: outputs [T, H, dv] and the final state (numpy)."""
    out = []
    for t in range(q.shape[0]):
        S = S * np.exp(g[t])[:, None, None]
        delta = (v[t] - np.einsum("hde,hd->he", S, k[t])) * beta[t][:, None]
        S = S + k[t][:, :, None] * delta[:, None, :]
        out.append(np.einsum("hde,hd->he", S, q[t]))
    return np.stack(out), S


def _random_rule_inputs(T, H=3, dk=4, dv=5, seed=0):
    r = np.random.RandomState(seed)
    unit = lambda a: a / np.linalg.norm(a, axis=-1, keepdims=True)  # noqa: E731
    return (r.randn(H, dk, dv).astype(np.float32), unit(r.randn(T, H, dk)).astype(np.float32),
            unit(r.randn(T, H, dk)).astype(np.float32), r.randn(T, H, dv).astype(np.float32),
            -r.rand(T, H).astype(np.float32), r.rand(T, H).astype(np.float32))


def test_a_tree_forward_gives_each_node_its_own_paths_output_and_advance_commits_one_path():
    parent = [-1, 0, 0, 1, 1, 2, 3]  # a tree of 7 nodes
    T = len(parent)
    S0, q, k, v, g, beta = _random_rule_inputs(T)
    anc = np.zeros((T, T), bool)
    for t in range(T):
        s = t
        while s >= 0:
            anc[t, s], s = True, parent[s]
    o, d = RC.delta_block(*(jnp.asarray(a)[None] for a in (S0, q, k, v, g, beta)), jnp.asarray(anc)[None])
    for t in range(T):
        path = [s for s in range(T) if anc[t, s]]
        ref, end = _recurrent(S0, q[path], k[path], v[path], g[path], beta[path])
        np.testing.assert_allclose(np.asarray(o[0, t]), ref[-1], atol=1e-5)
    leaf_path = [0, 1, 3, 6]
    new = RC.Pending(jnp.zeros((1, 1, T, 2)), jnp.asarray(k)[None, None], d[None], jnp.asarray(g)[None, None])
    state = RC.State(jnp.zeros((1, 1, 3, 2)), jnp.asarray(S0)[None, None])
    src = jnp.asarray([leaf_path + [0]])
    for n in (1, 3, 4):
        _, end = _recurrent(S0, *(a[leaf_path[:n]] for a in (q, k, v, g, beta)))
        np.testing.assert_allclose(np.asarray(RC.advance(state, new, src, jnp.asarray([n])).ssm[0, 0]), end,
                                   atol=1e-5)
    kept = RC.advance(state, new, src, jnp.asarray([0]))
    np.testing.assert_array_equal(np.asarray(kept.ssm), np.asarray(state.ssm))


def test_the_conv_taps_follow_each_nodes_path_into_the_committed_inputs():
    parent = [-1, 0, 0, 1, 3]
    anc = np.zeros((5, 5), bool)
    for t in range(5):
        s = t
        while s >= 0:
            anc[t, s], s = True, parent[s]
    idx = np.asarray(RC.conv_taps(jnp.asarray(anc)[None], 4))[0] - 3  # new token s at s, committed at -3..-1
    np.testing.assert_array_equal(idx, [[-3, -2, -1, 0], [-2, -1, 0, 1], [-2, -1, 0, 2], [-1, 0, 1, 3],
                                        [0, 1, 3, 4]])


def _loop_lengths(jaxpr) -> list:
    """The trip counts of every scan in a jaxpr, nested ones included, and -1 for each while loop."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            out.append(eqn.params["length"])
        elif eqn.primitive.name == "while":
            out.append(-1)
        for v in eqn.params.values():
            for sub in (v if isinstance(v, (list, tuple)) else [v]):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    out += _loop_lengths(inner)
    return out


def test_long_sequences_run_in_blocks_without_a_loop_over_tokens():
    """A 200-token sequence (four blocks) equals the token-by-token rule; a 2,048-token prefill of the model runs
    scans of 32 blocks at most: no step per token."""
    T = 200
    S0, q, k, v, g, beta = _random_rule_inputs(T, seed=4)
    g = g * 0.05
    args = tuple(jnp.asarray(a)[None] for a in (S0, q, k, v, g, beta))
    o, d = RC.sequence_rule(*args)
    ref, end = _recurrent(S0, q, k, v, g, beta)
    np.testing.assert_allclose(np.asarray(o[0]), ref, atol=1e-4)
    np.testing.assert_allclose(np.asarray(RC.end_state(args[0], args[2], d, args[4])[0]), end, atol=1e-4)
    target, _, _ = damped_pair()
    tokens = jnp.zeros((1, 2048), jnp.int32)
    jaxpr = jax.make_jaxpr(lambda t: PR.prefill(target, t, jnp.asarray([2000]), PR.new_cache_for(target, 1, 2048)))
    lengths = _loop_lengths(jaxpr(tokens).jaxpr)
    assert lengths and max(lengths) == 2048 // RC.CHUNK, lengths  # (the while loops: attention's key blocks)


# ------------------------------------------------------------------------------------------ speculative decoding


@functools.lru_cache(maxsize=None)
def damped_pair():
    """(target, draft, AR's greedy tokens on PROMPTS): a tiny random qwen3_5_text whose layers' branches are damped
    (0.003) so that a one-layer qwen3 draft with the target's embedding, final norm and head (a bigram model)
    agrees with it often but not always."""
    target = ports.random_model(Q5.config_from_hf({**KINDS["dense"], "model_type": "qwen3_5_text"}), key=3, std=0.3)
    for layer in target.params["layers"]:
        for name in ("lin_out", "wo", "w_down"):
            if name in layer:
                layer[name] = layer[name] * 0.003
    cfg = Q3.config_from_hf(dict(model_type="qwen3", vocab_size=V, hidden_size=64, intermediate_size=48,
                                 num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16))
    draft = ports.random_model(cfg, key=1, std=0.3)
    layer = dict(draft.params["layers"][0], wo=draft.params["layers"][0]["wo"] * 0,
                 w_down=draft.params["layers"][0]["w_down"] * 0)
    draft = ports.Model(cfg, {**draft.params, "layers": [layer], "embed": target.params["embed"],
                              "lm_head": target.params["lm_head"], "final_norm": 1 + target.params["final_norm"]})
    ar = jspec.decode(target, PROMPTS, max_new_tokens=16, eos_token_id=()).tokens
    return target, draft, ar


def bigram_mtp(target):
    """An MTP head (random, then fc passing the token embedding on and the layer's branches zeroed) that drafts
    what the target's embedding and head say follows the token it reads: the damped target's bigram guess, so its
    chains and trees are accepted in part, and deeper levels read the tokens drafted before them."""
    head = MT.init_head(target, jax.random.key(5), scale=0.3)
    D = target.config.hidden_size
    layer = dict(head.params["layers"][0])
    layer.update(wo=layer["wo"] * 0, w_down=layer["w_down"] * 0)
    fc = jnp.zeros((2 * D, D)).at[:D].set(jnp.eye(D))
    return head.replace(params=dict(head.params, fc=fc, layers=[layer]))


STRATEGIES = {
    "chain": lambda t, d: jspec.Chain(d, gamma=3),
    "tree": lambda t, d: jspec.Tree(d, tree=SMALL_TREE),
    "dynamic_tree": lambda t, d: jspec.DynamicTree(d, depth=3, top_k=3, total=8),
    "dflash_ddtree": lambda t, d: jspec.DFlash(dflash_head(t), tree="ddtree", top_k=3, total=8, depth=3),
    "eagle3_chain": lambda t, d: jspec.Eagle3(eagle3_head(t, every_third_dropped(t)), tree="chain", depth=3),
    "sjd": lambda t, d: jspec.SJD(window=3),
    "guarded_chain": lambda t, d: guarded(jspec.Chain(d, gamma=3)),
    "mtp_chain": lambda t, d: jspec.Chain(bigram_mtp(t), gamma=3),
    "mtp_tree": lambda t, d: jspec.Tree(bigram_mtp(t), tree=SMALL_TREE),
}


# the default run: a model draft's chain and tree, DFlash's DDTree (a drafter reading the hybrid's hidden states),
# the MTP chain and the guard; the others' paths are these (DynamicTree and the MTP tree: a tree's commit; EAGLE-3:
# the hidden states; SJD: a window chain)
SLOW = ("dynamic_tree", "eagle3_chain", "sjd", "mtp_tree")


@pytest.mark.parametrize("name", [n if n not in SLOW else pytest.param(n, marks=pytest.mark.slow)
                                  for n in sorted(STRATEGIES)])
def test_speculative_decoding_over_the_hybrid_target_equals_ar(name):
    target, draft, ar = damped_pair()
    out = jspec.decode(target, PROMPTS, strategy=STRATEGIES[name](target, draft), max_new_tokens=16,
                       eos_token_id=())
    np.testing.assert_array_equal(out.tokens, ar)
    if name in ("chain", "tree", "dynamic_tree", "guarded_chain", "mtp_chain", "mtp_tree"):  # rows accept unlike
        accepted = out.stats["accepted"][out.stats["accepted"] > 0]
        assert accepted.max() >= 3 and (accepted < accepted.max()).any(), out.stats["accepted"]


def test_rows_told_not_to_speculate_take_ar_steps_over_the_hybrid_target():
    """`speculate=` masks: the middle row takes AR steps (a verify of its root alone, its state advanced by one token)
    beside rows that draft a tree, and every row writes AR's tokens."""
    target, draft, ar = damped_pair()
    out = jspec.decode(target, PROMPTS, strategy=jspec.Tree(draft, tree=SMALL_TREE), max_new_tokens=16,
                       eos_token_id=(), speculate=[True, False, True])
    np.testing.assert_array_equal(out.tokens, ar)
    assert out.stats["accepted"][1].max() == 1 and out.stats["accepted"][[0, 2]].max() >= 3, out.stats["accepted"]


@functools.lru_cache(maxsize=None)
def tiny_vocab_hybrid():
    """(target, draft, the exact joint of 4 tokens after sampling_check.PROMPT) over 6 tokens: a one-linear-layer,
    one-attention-layer qwen3_5_text and a one-layer qwen3 draft of its embedding and head."""
    cfg = Q5.config_from_hf({**KINDS["dense"], "model_type": "qwen3_5_text", "vocab_size": 6,
                             "num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"]})
    target = ports.random_model(cfg, key=10, std=0.4)
    dc = Q3.config_from_hf(dict(model_type="qwen3", vocab_size=6, hidden_size=64, intermediate_size=16,
                                num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8))
    draft = ports.random_model(dc, key=11, std=0.2)
    draft = ports.Model(dc, {**draft.params, "embed": target.params["embed"], "lm_head": target.params["lm_head"],
                             "final_norm": 1 + target.params["final_norm"]})
    return target, draft, exact_joint(target, 4)


@pytest.mark.parametrize("name", ["chain", pytest.param("tree", marks=pytest.mark.slow)])
def test_sampling_over_the_hybrid_target_is_exact(name):
    """12000 rows at temperature 1: the first 4 tokens' joint is the target's; rejections at the root and accepted
    depth-2 paths both occur."""
    target, draft, p = tiny_vocab_hybrid()
    strategy = jspec.Chain(draft, gamma=3) if name == "chain" else jspec.Tree(draft, tree=SMALL_TREE)
    counts, out = empirical(target, strategy, jax.random.key(0), n=4)
    first = out.stats["accepted"][:, 0]
    assert (first == 1).mean() > 0.05 and (first >= 3).mean() > 0.01, np.bincount(first)
    assert chi2_pvalue(counts, p) > 1e-3, (chi2_pvalue(counts, p), total_variation(counts, p))


def test_a_recurrent_cache_refuses_what_it_cannot_do():
    target, _, _ = damped_pair()
    cache = PR.new_cache_for(target, 1, 16)
    tok, pos = jnp.zeros((1, 2), jnp.int32), jnp.zeros((1, 2), jnp.int32)
    with pytest.raises(ValueError, match="write_offset"):
        target.forward(tok, pos, cache, write_offset=1)
    with pytest.raises(ValueError, match="recurrent state"):
        target.forward(tok, pos, dataclasses.replace(cache, rec=None))


@pytest.mark.parametrize("slow", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["default", "slow"])
def test_strategies_on_an_8_device_mesh(slow):
    """tests/qwen3_5_sharded_checks.py on 8 forced CPU devices: the unsharded AR tokens from a chain on the dense
    target (every strategy above, and a chain on the MoE target, under -m slow)."""
    here = os.path.dirname(__file__)
    proc = subprocess.run([sys.executable, os.path.join(here, "qwen3_5_sharded_checks.py")] + (["--slow"] if slow else []),
                          env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True, timeout=1200,
                          cwd=os.path.dirname(here))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    passed = json.loads(proc.stdout.strip().splitlines()[-1])["passed"]
    assert len(passed) == (len(STRATEGIES) + 1 if slow else 1), passed


# ------------------------------------------------------------------------------------------ the MTP head


def _with_mtp(directory: str, layer, drop: str = "", extra: str = "", n: int = 1):
    """The checkpoint in `directory` with transformers' `MtpLayer` `layer` written under Qwen3.5's mtp.* names
    (without `drop`, with a spare tensor `extra`) and mtp_num_hidden_layers = n."""
    from ports.core.safetensors_io import SafetensorsFile, write_safetensors

    rename = {"eh_proj.weight": "mtp.fc.weight", "enorm.weight": "mtp.pre_fc_norm_embedding.weight",
              "hnorm.weight": "mtp.pre_fc_norm_hidden.weight", "post_norm.weight": "mtp.norm.weight"}
    path = os.path.join(directory, "model.safetensors")
    f = SafetensorsFile(path)
    tensors = {k: f.get(k) for k in f.keys()}
    for k, v in layer.state_dict().items():
        tensors[rename.get(k, k.replace("mtp_block.", "mtp.layers.0."))] = v.detach().numpy().astype(np.float32)
    tensors.pop(drop, None)
    if extra:
        tensors[extra] = np.zeros((3,), np.float32)
    write_safetensors(path, {k: (a.shape, a.dtype) for k, a in tensors.items()}, tensors.__getitem__)
    conf = json.load(open(os.path.join(directory, "config.json")))
    json.dump({**conf, "mtp_num_hidden_layers": n}, open(os.path.join(directory, "config.json"), "w"))


@functools.lru_cache(maxsize=None)
def _mtp_layer():
    from transformers.modeling_layers import MtpLayer
    from transformers.models.qwen3_5 import modeling_qwen3_5 as M

    conf = transformers.Qwen3_5TextConfig(**{**KINDS["dense"], "num_hidden_layers": 1,
                                             "layer_types": ["full_attention"]})
    conf._attn_implementation = "sdpa"  # causal over a sequence without a mask
    torch.manual_seed(4)
    return perturb(MtpLayer(conf, M.Qwen3_5DecoderLayer, M.Qwen3_5RMSNorm, 0).eval(), 2, 0.1)


def test_the_mtp_head_loads_from_the_targets_checkpoint_and_matches_transformers_mtp_layer(tmp):
    """The head read from the target's own files (mtp.* only) computes transformers' `MtpLayer` (Qwen3.5's
    layout) over a sequence: f = norm(layer(fc([norm(e(x_{t+1})); norm(h_t)]))); its chain and tree equal AR."""
    hf, _ = hf_pair("dense", tmp)
    d = f"{tmp}/with_mtp"
    hf.save_pretrained(d)
    layer = _mtp_layer()
    _with_mtp(d, layer)
    target = ports.load_hf(d)
    head = MT.load_head(d, target)
    ids = np.random.RandomState(5).randint(0, V, (1, 12))
    with torch.no_grad():
        h = hf(torch.tensor(ids), output_hidden_states=True).hidden_states[-1]  # under the final norm
        emb = hf.model.embed_tokens(torch.tensor(ids[:, 1:]))
        pos = torch.arange(1, 12)[None]
        ref = layer(emb, h[:, :-1], position_embeddings=hf.model.rotary_emb(emb, pos[None].expand(3, 1, -1)),
                    attention_mask=None, position_ids=pos, past_key_values=None).numpy()
    cache = kvc.init_cache(1, 1, 2, 16, 16, jnp.float32)
    f, _ = MT.head_forward(head, jnp.take(target.params["embed"], ids[:, 1:], axis=0), jnp.asarray(h.numpy())[:, :-1],
                           jnp.arange(1, 12)[None], cache, fresh=True)
    np.testing.assert_allclose(np.asarray(f), ref, atol=2e-5)
    ar = jspec.decode(target, PROMPTS, max_new_tokens=10, eos_token_id=()).tokens
    for strategy in (jspec.Chain(head, gamma=3), jspec.Tree(head, tree=SMALL_TREE)):
        out = jspec.decode(target, PROMPTS, strategy=strategy, max_new_tokens=10, eos_token_id=())
        np.testing.assert_array_equal(out.tokens, ar)


@pytest.mark.parametrize("case, message", [
    (dict(drop="mtp.norm.weight"), r"missing keys \(1\).*mtp.norm.weight"),
    (dict(extra="mtp.layers.0.spare.weight"), r"unexpected keys \(1\).*spare"),
    (dict(n=0), "mtp_num_hidden_layers = 0"),
])
def test_an_mtp_head_that_does_not_match_is_refused_naming_what(case, message, tmp):
    hf, _ = hf_pair("dense", tmp)
    d = f"{tmp}/bad_mtp_{len(os.listdir(tmp))}"
    hf.save_pretrained(d)
    _with_mtp(d, _mtp_layer(), **case)
    with pytest.raises(ValueError, match=message):
        MT.load_head(d, ports.load_hf(d))


def test_a_real_qwen3_5_checkpoints_mtp_tensors_are_the_heads():
    """masidyai/qwen3.5-9b-masidy (a Qwen3.5-9B fine-tune, ../shared/real_layouts): its index's mtp.* names are
    exactly the MTP head's, for the layers its text config declares."""
    import pathlib

    folder = pathlib.Path(__file__).resolve().parents[2] / "shared" / "real_layouts" / "next" / "masidyai__qwen3.5-9b-masidy"
    if not folder.is_dir():
        pytest.skip(f"no real layout at {folder}")
    text = dict(json.loads((folder / "config.json").read_text())["text_config"])
    cfg = Q5.config_from_hf(text)
    names = {n for n in json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
             if n.startswith("mtp.")}
    assert cfg.mtp_layers == 1 and names == {row[0] for row in MT.key_map(cfg, cfg.mtp_layers)}
