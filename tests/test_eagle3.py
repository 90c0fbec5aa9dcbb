"""EAGLE-3 heads: parity with vLLM's `speculators` (its EAGLE-3 model's draft logits, both directions of its
format), the EAGLE repository's layout, the drafter's draft distributions against training-time test unrolled,
round trips and clear errors. Greedy == AR and exact sampling: the conformance registry (tests/strategies.py)."""
import functools
import json
import os
import shutil
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
import ports
from jspec import api
from jspec.parts.drafters import eagle as EG
from jspec.parts.drafters import eagle3 as E3
from jspec.parts.drafters import eagle3_io as IO
from jspec.parts.drafters import heads as H
from ports.core import cache as kvc
from tiny_pairs import PROMPTS, tiny_pair
from tolerances import assert_f32_close
from toy_parts import RecordingController

HERE = os.path.dirname(__file__)
DATA = os.path.join(HERE, "data", "eagle3-speculators")  # made by `scripts/eagle3_reference.py make` (speculators 0.9.0)
ROOT = os.path.dirname(HERE)


@pytest.fixture(scope="module")
def verifier():
    return ports.load_hf(os.path.join(DATA, "verifier"))


def _ttt(head, target, hidden, tokens, steps):
    """The head's training-time-test logits on the reference's inputs (its tail padded with token 0, as
    `speculators` pads its teacher-forced tokens)."""
    toks = np.pad(tokens, ((0, 0), (0, steps - 1)))
    return [np.asarray(x) for x in E3.ttt_logits(head, target.params["embed"], jnp.asarray(hidden),
                                                 jnp.asarray(toks), steps)]


def _assert_same_logits(head, target, ref):
    steps = sum(k.startswith("logits_") for k in ref)
    assert steps == 3
    ours = _ttt(head, target, ref["hidden"], ref["tokens"], steps)
    ids = np.asarray(head.vocab)
    np.testing.assert_array_equal(ids, ref["draft_ids"])
    outside = np.setdiff1d(np.arange(head.target.vocab_size), ids)
    for s in range(steps):
        theirs = ref[f"logits_{s}"][0]
        mine = ours[s][0][:, ids]
        err = np.abs(mine - theirs).max() / np.abs(theirs).max()
        assert err <= 1e-4, (s, err)
        assert (ours[s][0][:, outside] == np.finfo(np.float32).min).all()  # no draft mass outside its vocabulary


def test_a_speculators_head_drafts_its_own_logits(verifier):
    """A head `speculators` built and saved (random weights, a 64-of-256 draft vocabulary, layers 1, 3 and 5)
    loads with its settings, and our training-time test gives the draft logits its model computed, at every
    one of 3 steps (its own hidden states fed back)."""
    head = IO.load_head(os.path.join(DATA, "head"), verifier)
    assert head.aux_layers == (1, 3, 5) and head.draft_vocab_size == 64 and head.config.num_layers == 1
    assert "embed" not in head.params  # its stored embedding is the verifier's: the target's is read
    _assert_same_logits(head, verifier, np.load(os.path.join(DATA, "reference.npz")))


def test_the_eagle_repository_layout_is_the_same_head(verifier, tmp_path):
    """The EAGLE repository's files for the same head (its decoder layer as `midlayer.*`, a flat LLaMA config with
    draft_vocab_size, no layer ids), written here from the speculators checkpoint by renaming, load to the same
    head; `save_head(fmt="eagle")` writes those files back."""
    src = os.path.join(DATA, "head")
    conf = json.load(open(os.path.join(src, "config.json")))
    flat = {**conf["transformer_layer_config"], "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": 64}
    tensors = H.read_weights(os.path.join(src, "model.safetensors"))
    theirs = {("midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k): v for k, v in tensors.items()}
    d = tmp_path / "eagle"
    d.mkdir()
    H.write_weights(str(d / "model.safetensors"), theirs)
    H.write_meta(str(d / "config.json"), flat)
    with pytest.raises(ValueError, match="not three distinct layers"):  # (2, 3, 3) for a 6-layer target
        IO.load_head(str(d), verifier)
    head = IO.load_head(str(d), verifier, aux_layers=(1, 3, 5))
    ref = IO.load_head(src, verifier)
    assert _same(head, ref)
    import torch  # the EAGLE repository ships pytorch_model.bin

    pt = tmp_path / "eagle-pt"
    pt.mkdir()
    torch.save({k: torch.from_numpy(np.asarray(v)) for k, v in theirs.items()}, str(pt / "pytorch_model.bin"))
    H.write_meta(str(pt / "config.json"), flat)
    assert _same(IO.load_head(str(pt), verifier, aux_layers=(1, 3, 5)), ref)
    out = tmp_path / "ours"
    IO.save_head(head, str(out), "eagle", target=verifier)
    back = H.read_weights(str(out / "model.safetensors"))
    assert sorted(back) == sorted(k for k in theirs if k != IO.EMBED_KEY)
    for k, v in back.items():
        np.testing.assert_array_equal(v, theirs[k])
    written = json.load(open(out / "config.json"))
    assert written["draft_vocab_size"] == 64 and written["hidden_size"] == 64 and written["num_hidden_layers"] == 1


def _same(a, b) -> bool:
    la, ta = jax.tree.flatten(a.params)
    lb, tb = jax.tree.flatten(b.params)
    return ta == tb and all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb)) and \
        a.aux_layers == b.aux_layers and np.array_equal(np.asarray(a.vocab), np.asarray(b.vocab))


def test_speculators_round_trip_keeps_every_setting(verifier, tmp_path):
    """A head with two decoder layers, per-layer fc norms, norm_before_residual, norm_output and its own
    embedding comes back equal from the speculators format; a plain head leaves the embedding out unless asked."""
    head = E3.init_head(verifier, jax.random.key(3), aux_layers=(0, 2, 6), num_layers=2,
                        draft_vocab=np.arange(0, 256, 5), norm_before_residual=True)
    p = dict(head.params, fc_norm=1 + 0.1 * jax.random.normal(jax.random.key(4), (3, 64)),
             embed=verifier.params["embed"] * 1.5)
    fancy = head.replace(params=p, norm_output=True)
    IO.save_head(fancy, str(tmp_path / "a"), target=verifier)
    back = IO.load_head(str(tmp_path / "a"), verifier)
    assert _same(back, fancy) and back.norm_before_residual and back.norm_output and back.config.num_layers == 2
    conf = json.load(open(tmp_path / "a" / "config.json"))
    assert conf["fc_norm"] and conf["norm_output"] and conf["eagle_aux_hidden_state_layer_ids"] == [0, 2, 6]
    IO.save_head(head, str(tmp_path / "b"), target=verifier)
    assert IO.EMBED_KEY not in H.read_weights(str(tmp_path / "b" / "model.safetensors"))
    IO.save_head(head, str(tmp_path / "c"), target=verifier, embed=True)
    stored = H.read_weights(str(tmp_path / "c" / "model.safetensors"))
    np.testing.assert_array_equal(stored[IO.EMBED_KEY], np.asarray(verifier.params["embed"]))
    assert "embed" not in IO.load_head(str(tmp_path / "c"), verifier).params  # the target's own: not kept twice
    IO.save_head(head, str(tmp_path / "d"), target=verifier, dtype="bfloat16")
    assert IO.load_head(str(tmp_path / "d"), verifier, dtype=jnp.bfloat16).params["fc"].dtype == jnp.bfloat16


NMAX = 64
_ttt4 = jax.jit(lambda head, embed, h, toks: E3.ttt_logits(head, embed, h, toks, 4))


@functools.partial(jax.jit, static_argnames="layers_idx")
def _states(target, seq, layers_idx):
    cfg = target.config
    cache = kvc.init_cache(cfg.num_layers, 1, cfg.num_kv_heads, NMAX, cfg.head_dim, jnp.float32)
    fo = target.forward(seq[None], jnp.arange(NMAX)[None], cache, fresh=True, hidden_layers=layers_idx)
    return jnp.concatenate(fo.hidden, axis=-1)


def test_draft_distributions_are_training_time_tests():
    """Every committed token's draft log-prob in a decode (chains and a tree, partial acceptance, finished rows)
    equals training-time test computed from scratch: entries with the target's fused states up to the step's
    root, then the head's own states below it. This pins what the drafter feeds the head at the prefill, at each
    catch-up (the fused states verification returns at the accepted nodes) and at each level."""
    target, _ = tiny_pair()
    L = target.config.num_layers
    vocab = np.arange(97)[np.arange(97) % 4 > 0]
    head = E3.init_head(target, jax.random.key(1), aux_layers=(0, 1, L), draft_vocab=vocab, scale=0.3)
    ar = jspec.decode(target, PROMPTS, max_new_tokens=16, eos_token_id=())
    for tree in ("chain", [[0], [1], [0, 0], [1, 0], [0, 0, 0]]):
        strat = jspec.Eagle3(head, tree=tree, depth=3, controller=RecordingController())
        state = api.start(target, PROMPTS, strat, max_new_tokens=16, eos_token_id=()).run()
        rec, out, acc = jax.device_get((state.aux.ctrl, state.out, state.accepted))
        np.testing.assert_array_equal(out[:, :16], ar.tokens)
        checked = 0
        for b, prompt in enumerate(PROMPTS):
            seq = np.concatenate([prompt, out[b, :16]])
            padded = jnp.asarray(np.pad(seq, (0, NMAX - len(seq))).astype(np.int32))
            h = _states(target, padded, head.aux_layers)
            toks = np.pad(np.asarray(padded)[None], ((0, 0), (0, 4)))
            logp = [np.asarray(jax.nn.log_softmax(x[0])) for x in _ttt4(head, target.params["embed"], h,
                                                                            jnp.asarray(toks))]
            c = 1
            for n in acc[b]:
                for k in range(n):
                    t = c + k
                    if t < 16 and rec["q_known"][b, t - 1]:
                        root = len(prompt) + c - 1  # the step's root: the newest committed token's index
                        tok = seq[len(prompt) + t]
                        if tok not in vocab:  # outside the draft vocabulary: never drafted
                            assert rec["q"][b, t - 1] == -np.inf
                            continue
                        ref = logp[k][root - 1][tok]  # entry root - 1 holds the root token
                        assert_f32_close(rec["q"][b, t - 1], ref, atol=2e-4)
                        checked += 1
                c += n
        assert checked >= 15, checked


def test_errors(verifier, tmp_path):
    src = os.path.join(DATA, "head")
    other = ports.random_model(ports.TextConfig(model_type="llama", vocab_size=256, hidden_size=32,
                                                intermediate_size=64, num_layers=6, num_heads=2, num_kv_heads=1,
                                                head_dim=16), key=1)
    with pytest.raises(ValueError, match="this EAGLE-3 head is 64 wide; the target is 32"):
        IO.load_head(src, other)
    shallow = ports.random_model(ports.TextConfig(model_type="llama", vocab_size=256, hidden_size=64,
                                                  intermediate_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
                                                  head_dim=16), key=1)
    with pytest.raises(ValueError, match=r"reads target layers \[1, 3, 5\]; the target has 4 layers"):
        IO.load_head(src, shallow)
    d = tmp_path / "broken"
    shutil.copytree(src, d)
    t = H.read_weights(str(d / "model.safetensors"))
    del t["layers.0.hidden_norm.weight"]
    H.write_weights(str(d / "model.safetensors"), t)
    with pytest.raises(ValueError, match="missing.*layers.0.hidden_norm.weight"):
        IO.load_head(str(d), verifier)
    conf = json.load(open(os.path.join(src, "config.json")))
    H.write_meta(str(d / "config.json"), {**conf, "speculators_model_type": "mtp"})
    with pytest.raises(ValueError, match="'mtp' speculator, not an EAGLE-3 head"):
        IO.load_head(str(d), verifier)
    H.write_meta(str(d / "config.json"), {**conf, "transformer_layer_config": {
        **conf["transformer_layer_config"], "model_type": "qwen3"}})
    with pytest.raises(ValueError, match="'qwen3'"):
        IO.load_head(str(d), verifier)
    with pytest.raises(ValueError, match="neither an EAGLE-3 head directory nor a Hugging Face repo id"):
        IO.load_head(str(tmp_path / "nowhere" / "at" / "all"), verifier)
    with pytest.raises(ValueError, match="head must be an Eagle3Head"):
        jspec.Eagle3(EG.init_head(verifier, jax.random.key(0)))
    head = IO.load_head(src, verifier)
    with pytest.raises(ValueError, match="made for another target"):
        jspec.decode(other, [np.arange(4)], jspec.Eagle3(head), max_new_tokens=4)
    with pytest.raises(ValueError, match="unknown EAGLE-3 head format"):
        IO.save_head(head, str(tmp_path / "x"), "vllm")
    with pytest.raises(ValueError, match="one-layer heads"):
        IO.save_head(head.replace(norm_output=True), str(tmp_path / "y"), "eagle")
    with pytest.raises(ValueError, match="not three distinct layers"):
        E3.default_aux_layers(4)
    assert E3.default_aux_layers(30) == (2, 15, 27)


# ------------------------------------------------------------------------------------- against `speculators`


def speculators_python() -> str:
    """A Python with `speculators` 0.9.0 (its pins conflict with jspec's): $JSPEC_SPECULATORS_PYTHON, else the
    environment `scripts/speculators_env.sh` makes under ~/.cache/jspec (made here when missing: a few minutes,
    from the package registry)."""
    py = os.environ.get("JSPEC_SPECULATORS_PYTHON")
    if py:
        return py
    env = os.path.join(os.path.expanduser("~"), ".cache", "jspec", "speculators-env")
    py = os.path.join(env, "bin", "python")
    if not os.path.exists(py):
        subprocess.run(["bash", os.path.join(ROOT, "scripts", "speculators_env.sh"), env], check=True, timeout=1800)
    return py


def _reference(args, tmp):
    proc = subprocess.run([speculators_python(), os.path.join(ROOT, "scripts", "eagle3_reference.py")] + args,
                          env=dict(os.environ, HF_HUB_OFFLINE="1"), capture_output=True, text=True, timeout=600,
                          cwd=tmp)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]


@pytest.mark.slow  # builds or reuses a second environment with speculators and torch (~1.5 GB)
def test_speculators_loads_what_jspec_saves_and_jspec_what_it_makes(verifier, tmp_path):
    """Both directions live: a random head jspec saves in the speculators format (norm_before_residual, a reduced
    vocabulary, layers 2, 3 and 6) loads in `speculators` and its draft logits match ours; and a head
    `speculators` makes now (another seed) loads here with matching logits."""
    head = E3.init_head(verifier, jax.random.key(5), aux_layers=(2, 3, 6), draft_vocab=np.arange(3, 200, 3),
                        scale=0.1, norm_before_residual=True)
    head = head.replace(params=dict(head.params, norm=head.params["norm"] * 1.3))
    out = tmp_path / "jspec-head"
    IO.save_head(head, str(out), target=verifier, verifier=os.path.join(DATA, "verifier"))
    _reference(["logits", str(out), os.path.join(DATA, "verifier"), str(out)], str(tmp_path))
    _assert_same_logits(head, verifier, np.load(out / "reference.npz"))
    made = tmp_path / "made"
    _reference(["make", str(made), "--seed", "11"], str(tmp_path))
    target = ports.load_hf(str(made / "verifier"))
    _assert_same_logits(IO.load_head(str(made / "head"), target), target, np.load(made / "reference.npz"))


def test_a_qwen2_target_gets_a_llama_head(tmp_path):
    """A Qwen2 target (attention biases) gets a head of bias-free LLaMA layers, as the heads vLLM serves for Qwen2
    are; it drafts losslessly and round-trips through the speculators format."""
    import dataclasses

    from tiny_pairs import CFG

    target = ports.random_model(dataclasses.replace(CFG, model_type="qwen2", qkv_bias=True), key=4, std=0.3)
    head = E3.init_head(target, jax.random.key(0), aux_layers=(0, 1, 3), scale=0.3)
    assert head.config.model_type == "llama" and not head.config.qkv_bias and "bqkv" not in head.params["layers"][0]
    IO.save_head(head, str(tmp_path / "h"), target=target)
    back = IO.load_head(str(tmp_path / "h"), target)
    assert _same(back, head) and back.vocab is None
    ar = jspec.decode(target, PROMPTS, max_new_tokens=8, eos_token_id=())
    out = jspec.decode(target, PROMPTS, jspec.Eagle3(back, tree="chain", depth=2), max_new_tokens=8, eos_token_id=())
    np.testing.assert_array_equal(out.tokens, ar.tokens)
