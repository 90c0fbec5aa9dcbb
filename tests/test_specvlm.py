"""SpecVLM: the pruning hook reads the target's own prefill attention, compacts the draft's prompt in-program
exactly as the host `prune_prompt` does, and greedy decoding gives the target's AR tokens at every ratio, in both
position modes, with a separate draft (Std.-SD) and with the target drafting for itself (Self-SD)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jspec
import ports
from jspec.core import prefill as PR
from jspec.parts.drafters import Setup, TargetPrefill
from jspec.parts.drafters.model import ModelDrafter
from jspec.strategies.specvlm import SpecVLM, VisionPruning
from ports.core.prompts import model_prompt
from ports.families import qwen2_vl as QW

import test_llava_next as LN
import test_llava_next_video as NV
from conftest import eager_attentions
from test_pruning import reference as selection
from test_qwen2_vl import IMG, VID, build, frames, image, torch_batch
from test_qwen2_vl import built, hf_models, jx_models  # noqa: F401  (module fixtures: tiny Qwen2.5-VL pair)

SMALL_TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 0, 0, 0]]


def video_batch():
    """Two ragged rows, each with a video (8 and 4 frames) and text after it; the second also has an image."""
    return build(["w1 <video> w2 w3 w4", "w5 <image> w6 w7 <video> w8 w9 w10 w11 w12"],
                 images=[image(40, 56, 3)], videos=[frames(8, seed=21), frames(4, 28, 56, seed=22)],
                 seconds=[0.5, 1.0])


def prepared_hook(target, draft, batch, **kw) -> tuple[VisionPruning, tuple]:
    tokens, lengths, inputs = model_prompt(target, batch, "")
    drafter = ModelDrafter(draft)
    prep = drafter.prepare(Setup(target, batch, tokens, lengths, inputs, None, None, None, None))
    hook = VisionPruning(**kw).prepare(Setup(target, batch, tokens, lengths, inputs, None, None, None, None), prep)
    return hook, (tokens, lengths, inputs), prep


def target_prefill(target, hook, tokens, lengths, inputs) -> TargetPrefill:
    cache = PR.new_cache_for(target, tokens.shape[0], tokens.shape[1])
    asks = hook.asks(jnp.asarray(tokens), jnp.asarray(lengths), inputs)
    logits, fo, cache = PR.prefill(target, jnp.asarray(tokens), jnp.asarray(lengths), cache,
                                     jax.tree.map(jnp.asarray, inputs), **asks)
    return TargetPrefill(logits, fo.hidden, fo.attn, jnp.asarray(tokens), jnp.asarray(lengths), cache)


# ------------------------------------------------------------------------------------------ scores


def test_scores_equal_mean_attention_of_an_explicit_forward(hf_models, jx_models):
    """a_j from the hook (one prefill, reduced per layer) == the mean over layers, heads and the post-video text
    queries of transformers' eager attention probabilities, on each video token; ragged rows each by its own L."""
    target = jx_models["q25"]
    hf = hf_models["q25"]
    hf.config._attn_implementation = "eager"
    hf.model.language_model.config._attn_implementation = "eager"
    batch = video_batch()
    hook, (tokens, lengths, inputs), _ = prepared_hook(target, jx_models["q25_draft"], batch, ratio=0.5)
    a, n = hook.scores(target_prefill(target, hook, tokens, lengths, inputs))
    with torch.no_grad():
        att = hf(**torch_batch(batch), output_attentions=True).attentions
    probs = np.mean(np.stack([x.numpy() for x in att]), axis=(0, 2))  # [B, T, T]: mean over layers and heads
    for b in range(tokens.shape[0]):
        ids = tokens[b, :lengths[b]]
        vid = np.flatnonzero(ids == VID)
        L = np.arange(vid[-1] + 1, lengths[b])
        want = probs[b][L][:, vid].mean(axis=0)
        assert int(n[b]) == len(vid)
        np.testing.assert_allclose(np.asarray(a[b, :len(vid)]), want, rtol=2e-4, atol=1e-6)


# ------------------------------------------------------------------------------------------ compaction


@pytest.mark.parametrize("positions", ["original", "renumbered"])
def test_in_program_compaction_equals_host_prune_prompt(jx_models, positions):
    """The hook's pruned draft prompt (tokens, M-RoPE ids, rope deltas, prefill logits) equals `prune_prompt` given
    the same kept tokens; each row keeps exactly int(|V| (1 - r)) video tokens and every text and image token."""
    target, draft = jx_models["q25"], jx_models["q25_draft"]
    batch = video_batch()
    hook, (tokens, lengths, inputs), prep = prepared_hook(target, draft, batch, ratio=0.7, positions=positions)
    prefill = target_prefill(target, hook, tokens, lengths, inputs)
    keep = np.asarray(hook.keep(prefill))
    a, n_vis = (np.asarray(x) for x in hook.scores(prefill))
    for b in range(tokens.shape[0]):  # the hook keeps SpecVLM's selection on the target's own attention
        np.testing.assert_array_equal(np.flatnonzero(keep[b]), selection(a[b, :n_vis[b]], 0.7, hook.top_p))
    d_tokens, d_lengths, d_inputs = jax.jit(hook.draft_prompt)(prefill, jax.tree.map(jnp.asarray, prep.prompt))
    n = np.isin(tokens, [VID]).sum(1)
    assert keep.sum(1).tolist() == [int(k) for k in np.floor(n * 0.3 + 1e-3)]
    keep_bt = np.zeros(tokens.shape, bool)
    for b in range(tokens.shape[0]):
        keep_bt[b, np.flatnonzero(tokens[b] == VID)] = keep[b, :n[b]]
    keep_bt |= tokens == IMG  # images are not pruned (modality="video")
    ref = QW.prune_prompt(draft.config, batch, keep_bt, positions=positions)
    D = ref["input_ids"].shape[1]
    assert d_tokens.shape[1] == hook.width == D
    np.testing.assert_array_equal(np.asarray(d_lengths), ref["attention_mask"].sum(1))
    np.testing.assert_array_equal(np.asarray(d_tokens) * ref["attention_mask"], ref["input_ids"])
    np.testing.assert_array_equal(np.asarray(d_inputs["mrope_positions"]), ref["position_ids"])
    np.testing.assert_array_equal(np.asarray(d_inputs["mrope_offset"]), ref["rope_deltas"])
    cache = PR.new_cache_for(draft, 2, D)
    ours, _, _ = PR.prefill(draft, d_tokens, d_lengths, cache, d_inputs)
    want = ports.logits(draft, ref)[np.arange(2), ref["attention_mask"].sum(1) - 1]
    np.testing.assert_allclose(np.asarray(ours), want, atol=5e-5, rtol=1e-5)


def test_stage_one_count_and_the_family_top_p(jx_models):
    """`top_p=None` takes the paper's lambda_r for the draft's family (0.5 on Qwen2.5-VL, 0.4 on LLaVA); the decode's
    stats give each row's vision tokens, the kept ones and stage I's count, which equals the spec's count on the
    target's own scores: the whole budget at top_p 1 (stage II idle), a few tokens at top_p 0.05 (stage II keeps
    the rest); greedy output equals AR either way."""
    from jspec.strategies.specvlm import family_top_p

    target, draft = jx_models["q25"], jx_models["q25_draft"]
    assert (family_top_p("qwen2_5_vl"), family_top_p("qwen2_vl"), family_top_p("llava_onevision")) == (0.5, 0.5, 0.4)
    batch = video_batch()
    hook, (tokens, lengths, inputs), _ = prepared_hook(target, draft, batch, ratio=0.5)
    assert hook.top_p == 0.5
    a, n_vis = (np.asarray(x) for x in hook.scores(target_prefill(target, hook, tokens, lengths, inputs)))
    ar = jspec.decode(target, batch, max_new_tokens=8)
    counts = {}
    for top_p in (1.0, 0.05):
        out = jspec.decode(target, batch, SpecVLM(draft, ratio=0.5, top_p=top_p, tree=SMALL_TREE), max_new_tokens=8)
        np.testing.assert_array_equal(out.tokens, ar.tokens)
        K = np.floor(n_vis * 0.5 + 1e-3).astype(int)
        np.testing.assert_array_equal(out.stats["vision_tokens"], n_vis)
        np.testing.assert_array_equal(out.stats["kept_vision_tokens"], K)
        for b in range(len(n_vis)):  # the spec's stage I: the top-scored holding top_p of the mass, capped at K
            cs = np.cumsum(np.sort(a[b, :n_vis[b]])[::-1])
            c = min(int(np.searchsorted(cs, top_p * cs[-1], side="left")) + 1, K[b])
            assert out.stats["stage_one"][b] == c, (top_p, b)
        counts[top_p] = np.asarray(out.stats["stage_one"])
    assert (counts[1.0] == K).all() and (counts[0.05] < K).all()
    assert "stage_one" not in jspec.decode(target, batch, SpecVLM(draft, ratio=0.5, select="uniform",
                                                                  tree=SMALL_TREE), max_new_tokens=4).stats


# ------------------------------------------------------------------------------------------ decoding


@pytest.mark.parametrize("ratio,positions,std", [
    (0.9, "original", True), (0.0, "original", False), (0.95, "renumbered", True),
    pytest.param(0.0, "renumbered", False, marks=pytest.mark.slow),
    pytest.param(0.0, "original", True, marks=pytest.mark.slow),
    pytest.param(0.5, "renumbered", True, marks=pytest.mark.slow),
    pytest.param(0.95, "original", False, marks=pytest.mark.slow),
    pytest.param(0.9, "original", False, marks=pytest.mark.slow),
    pytest.param(0.6, "renumbered", False, marks=pytest.mark.slow),
])
def test_greedy_specvlm_equals_ar_qwen(jx_models, ratio, positions, std):
    """Qwen2.5-VL, ragged video batch: greedy SpecVLM (Std.-SD with the small draft, or Self-SD) gives greedy AR's
    tokens; the draft's cache is shorter than the target's by what pruning removed."""
    target = jx_models["q25"]
    draft = jx_models["q25_draft"] if std else None
    batch = video_batch()
    ar = jspec.decode(target, batch, max_new_tokens=12)
    strategy = SpecVLM(draft, ratio=ratio, tree=SMALL_TREE, positions=positions)
    sd = jspec.decode(target, batch, strategy=strategy, max_new_tokens=12)
    np.testing.assert_array_equal(sd.tokens, ar.tokens)
    if ratio == 0 and draft is None:  # Self-SD keeping every token drafts what the target says
        deepest = max(len(p) for p in SMALL_TREE) + 1
        for b, n_steps in enumerate(sd.stats["steps"]):  # every round but the last (cut by max_new_tokens) in full
            assert (sd.stats["accepted"][b, :n_steps - 1] == deepest).all(), sd.stats["accepted"]
    started = jspec.api.start(target, batch, strategy, max_new_tokens=12)
    t_len, d_len = started.state.cache.k[0].shape[1], started.state.aux.draft.cache.k[0].shape[1]
    n = int(np.isin(batch["input_ids"], [VID]).sum(1).max())
    assert t_len - d_len >= (0 if ratio == 0 else int(n * ratio) - 1)


def ov_video_rows(frames: int = 3, seed: int = 0):
    """Two OneVision rows with the same clip length and ragged text around the video."""
    rng = np.random.default_rng(seed)
    n = LN.video_tokens(frames)
    rows = [np.concatenate([[1, 2], [LN.VID] * n, [4, 5, 6]]), np.concatenate([[7], [LN.VID] * n, [8, 9, 10, 11, 12]])]
    return {"input_ids": rows,
            "pixel_values_videos": rng.normal(size=(2, frames, 3, 30, 30)).astype(np.float32)}


@pytest.fixture(scope="module")
def ov_models(tmp_path_factory):
    from conftest import saved_and_loaded

    return saved_and_loaded({"ov": LN.tiny_ov(10), "ov_draft": LN.tiny_ov(11)}, tmp_path_factory.mktemp("ov"))[1]


@pytest.mark.parametrize("ratio,std", [(0.9, False), (0.9, True), pytest.param(0.0, True, marks=pytest.mark.slow),
                                       pytest.param(0.95, False, marks=pytest.mark.slow),
                                       pytest.param(0.95, True, marks=pytest.mark.slow)])
def test_greedy_specvlm_equals_ar_onevision(ov_models, ratio, std):
    """LLaVA-OneVision video (the trailing newline is a video token and prunable), ragged rows, Self-SD and a
    separate OneVision draft (its own tower and LM): greedy SpecVLM gives greedy AR's tokens; `positions='original'`
    is refused for a model without M-RoPE."""
    target = ov_models["ov"]
    batch = ov_video_rows()
    ar = jspec.decode(target, batch, max_new_tokens=10)
    draft = ov_models["ov_draft"] if std else None
    sd = jspec.decode(target, batch, strategy=SpecVLM(draft, ratio=ratio, tree=SMALL_TREE), max_new_tokens=10)
    np.testing.assert_array_equal(sd.tokens, ar.tokens)
    with pytest.raises(ValueError, match="renumbered"):
        jspec.decode(target, batch, strategy=SpecVLM(None, positions="original"), max_new_tokens=2)


@pytest.fixture(scope="module")
def nv_models(tmp_path_factory):
    """LLaVA-NeXT-Video: a target and a smaller draft of the same vocabulary, each with its own tower and pooler."""
    from conftest import saved_and_loaded

    return saved_and_loaded({"nv": NV.tiny_nv(40), "nv_draft": NV.tiny_nv(43, layers=1, hidden=32)},
                            tmp_path_factory.mktemp("nv"))


def test_nextvideo_scores_equal_mean_attention_of_an_explicit_forward(nv_models):
    """NeXT-Video (pooled frames, no newline): a_j == the mean over layers, heads and post-video text queries of
    transformers' eager attention probabilities on each video token, per ragged row."""
    hf_all, jx = nv_models
    hf = hf_all["nv"]
    batch = NV.nv_batch(["w1 w2 <video> w3 w4 w5", "w6 <video> w7"], frames=3, seed=1)
    hook, (tokens, lengths, inputs), _ = prepared_hook(jx["nv"], jx["nv_draft"], batch, ratio=0.5)
    a, n = hook.scores(target_prefill(jx["nv"], hook, tokens, lengths, inputs))
    probs = eager_attentions(hf, batch).mean(axis=(0, 2))
    for b in range(2):
        vid = np.flatnonzero(tokens[b, :lengths[b]] == LN.VID)
        want = probs[b][np.arange(vid[-1] + 1, lengths[b])][:, vid].mean(axis=0)
        assert int(n[b]) == len(vid) == 12
        np.testing.assert_allclose(np.asarray(a[b, :len(vid)]), want, rtol=2e-4, atol=1e-6)


@pytest.mark.parametrize("ratio,std", [(0.9, True), pytest.param(0.0, False, marks=pytest.mark.slow),
                                       pytest.param(0.95, False, marks=pytest.mark.slow),
                                       pytest.param(0.5, True, marks=pytest.mark.slow)])
def test_greedy_specvlm_equals_ar_nextvideo(nv_models, ratio, std):
    """LLaVA-NeXT-Video, ragged rows with an image before the clip in one: greedy SpecVLM (a NeXT-Video draft with
    its own tower and pooler, or Self-SD) gives greedy AR's tokens; the frames selector reads its 4 tokens per
    frame from the config."""
    target = nv_models[1]["nv"]
    batch = NV.nv_batch(["w1 <video> w2 w3", "w4 <image> w5 <video> w6 w7 w8 w9"], frames=4,
                        images=[LN.image(40, 90, 7)], seed=3)
    ar = jspec.decode(target, batch, max_new_tokens=10)
    draft = nv_models[1]["nv_draft"] if std else None
    sd = jspec.decode(target, batch, strategy=SpecVLM(draft, ratio=ratio, tree=SMALL_TREE), max_new_tokens=10)
    np.testing.assert_array_equal(sd.tokens, ar.tokens)
    if ratio == 0.9:
        hook, _, _ = prepared_hook(target, nv_models[1]["nv_draft"], batch, ratio=0.5, select="frames")
        assert hook.frame_tokens == NV.FRAME_TOKENS


@pytest.mark.slow
@pytest.mark.parametrize("select", ["uniform", "attention", "random", "front", "middle", "end", "frames"])
def test_ablation_selectors_decode_exactly(jx_models, select):
    target, draft = jx_models["q25"], jx_models["q25_draft"]
    batch = video_batch()
    ar = jspec.decode(target, batch, max_new_tokens=8)
    # the two clips have 6 and 8 tokens per temporal patch: `frames` needs the count given (one clip size infers it)
    kw = {"frame_tokens": 6} if select == "frames" else {}
    sd = jspec.decode(target, batch, strategy=SpecVLM(draft, ratio=0.8, select=select, tree="chain5", **kw),
                      max_new_tokens=8)
    np.testing.assert_array_equal(sd.tokens, ar.tokens)
    if select == "frames":
        one = build(["w1 <video> w2 w3"], videos=[frames(8, seed=4)])
        hook, _, _ = prepared_hook(target, draft, one, ratio=0.5, select="frames")
        assert hook.frame_tokens == 6
        with pytest.raises(ValueError, match="frame_tokens"):
            prepared_hook(target, draft, batch, ratio=0.5, select="frames")


# ------------------------------------------------------------------------------------------ bad inputs


def test_bad_inputs_raise_clear_errors(jx_models):
    target, draft = jx_models["q25"], jx_models["q25_draft"]
    for ratio in (1.0, -0.1, 1.5):
        with pytest.raises(ValueError, match=r"pruning ratio must be in \[0, 1\)"):
            SpecVLM(draft, ratio=ratio)
    with pytest.raises(ValueError, match="selector"):
        SpecVLM(draft, select="best")
    no_video = build(["w1 <image> w2 w3"], images=[image(40, 56, 1)])
    with pytest.raises(ValueError, match="no video tokens"):
        jspec.decode(target, no_video, strategy=SpecVLM(draft), max_new_tokens=2)
    other_vocab = ports.random_model(ports.text_config_from_hf(
        {"model_type": "qwen2", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
         "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 120}), 0)
    with pytest.raises(ValueError, match="vocabularies differ"):
        jspec.decode(target, video_batch(), strategy=SpecVLM(other_vocab), max_new_tokens=2)
    text_draft = ports.random_model(ports.text_config_from_hf(
        {"model_type": "qwen2", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
         "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": target.config.vocab_size}), 0)
    with pytest.raises(ValueError, match="reads video or images"):
        jspec.decode(target, video_batch(), strategy=SpecVLM(text_draft), max_new_tokens=2)


def _zoo_image_prompt(n_vqa: int):
    from jspec.tools.zoo import data as ZD
    from jspec.tools.zoo import evaluate as ZE

    pair = ZE.load_pair("image")
    return pair, ZE.batch_prompt(pair.encoder, ZD.eval_set("vqa", n_vqa) + ZD.eval_set("two_image", 1))


def test_llava15_image_pruning_on_the_zoo_pair():
    """LLaVA-1.5 (the zoo's image pair), image tokens pruned (`modality="image"`, SAGE's image setting): greedy
    SpecVLM and SAGE + pruning give AR's tokens on a ragged batch with a two-image row."""
    pair, prompt = _zoo_image_prompt(1)
    ar = jspec.decode(pair.target, prompt, max_new_tokens=12)
    for s in (SpecVLM(pair.draft, ratio=0.8, modality="image", tree=SMALL_TREE),
              jspec.SAGE(pair.draft, d_max=5, n_max=32, prune_ratio=0.8, prune_modality="image")):
        np.testing.assert_array_equal(jspec.decode(pair.target, prompt, s, max_new_tokens=12).tokens, ar.tokens)
    with pytest.raises(ValueError, match="not both"):
        jspec.SAGE(pair.draft, prune_ratio=0.9, prefill=VisionPruning(0.9))
    with pytest.raises(ValueError, match="pruning ratio"):
        jspec.SAGE(pair.draft, prune_ratio=1.0)


@pytest.mark.slow
def test_pruning_reaches_the_draft_and_ratio_zero_is_the_plain_tree():
    """Keeping every token drafts exactly as the unpruned tree; pruning 80% changes the drafts (not the output)."""
    pair, prompt = _zoo_image_prompt(2)
    full = jspec.decode(pair.target, prompt, strategy=jspec.Tree(pair.draft, tree=SMALL_TREE), max_new_tokens=16)
    runs = {r: jspec.decode(pair.target, prompt, max_new_tokens=16,
                            strategy=SpecVLM(pair.draft, ratio=r, modality="image", tree=SMALL_TREE))
            for r in (0.0, 0.8)}
    for out in runs.values():
        np.testing.assert_array_equal(out.tokens, full.tokens)
    np.testing.assert_array_equal(runs[0.0].stats["accepted"], full.stats["accepted"])
    assert not np.array_equal(runs[0.8].stats["accepted"], full.stats["accepted"])
