"""scripts/train_zoo.py's LLaVA recipe: the LM starts from a zoo text model, stays frozen during the alignment stage
(only the tower and projector move, weight decay included) and trains after it; a text model of the wrong shape is
refused with the shapes named."""
from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _tiny(tz, **kw):
    return tz.Preset("image", dict(hidden=32, layers=1, heads=2, ffn=64), dict(hidden=32, layers=1, heads=2, ffn=64),
                     tasks=("vqa_colour", "caption"), view="M", batch=2, seq_len=96, warmup=1, **kw)


def _moved(a, b) -> bool:
    return any(not np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_alignment_stage_freezes_only_the_lm(tz):
    p = _tiny(tz, align_steps=1, lm_lr_scale=0.5)
    model = tz.new_model(p, 0)
    tx = tz.make_optimizer(p)
    train_step, _ = tz.make_steps(model.config, tx)
    batch = next(tz.stream(p, "train", 0, 0))[0]
    assert "pixel_values" in batch
    before = jax.device_get(model.params)
    params, opt = jax.tree.map(np.copy, before), tx.init(model.params)
    params, opt, _ = train_step(params, opt, batch, np.float32(1e-2), np.float32(0.0))     # aligning
    aligned = jax.device_get(params)
    assert not _moved(before["lm"], aligned["lm"])
    assert _moved(before["vision"], aligned["vision"]) and _moved(before["projector"], aligned["projector"])
    params, opt, _ = train_step(params, opt, batch, np.float32(1e-2), np.float32(0.5))     # after it
    assert _moved(aligned["lm"], jax.device_get(params)["lm"])


def test_pretrained_tower_stays_frozen_while_aligning(tz):
    """With a pretrained tower (LLaVA's frozen CLIP), the alignment steps move the projector only; afterwards the
    tower moves at its own scale. A tower trained from scratch learns while aligning."""
    p = _tiny(tz, align_steps=1, lm_lr_scale=0.5, tower_lr_scale=0.1, tower_steps=5)
    assert tz.stage_scales(p, 0) == (0.0, 0.0) and tz.stage_scales(p, 1) == (0.5, 0.1)
    assert tz.stage_scales(dataclasses.replace(p, tower_steps=0), 0) == (0.0, 0.1)
    model = tz.new_model(p, 0)
    tx = tz.make_optimizer(p)
    train_step, _ = tz.make_steps(model.config, tx)
    batch = next(tz.stream(p, "train", 0, 0))[0]
    before = jax.device_get(model.params)
    params, opt = jax.tree.map(np.copy, before), tx.init(model.params)
    params, opt, _ = train_step(params, opt, batch, np.float32(1e-2), *map(np.float32, tz.stage_scales(p, 0)))
    aligned = jax.device_get(params)
    assert not _moved(before["lm"], aligned["lm"]) and not _moved(before["vision"], aligned["vision"])
    assert _moved(before["projector"], aligned["projector"])
    params, opt, _ = train_step(params, opt, batch, np.float32(1e-2), *map(np.float32, tz.stage_scales(p, 1)))
    after = jax.device_get(params)
    assert _moved(aligned["vision"], after["vision"]) and _moved(aligned["lm"], after["lm"])


def test_init_lm_refuses_a_text_model_of_another_shape(tz):
    p = _tiny(tz, init_lm="text-draft")
    if not (tz.export_dir("text-draft") / "config.json").exists():
        pytest.skip("the zoo text draft is not shipped in this install")
    with pytest.raises(SystemExit, match="do not fit the LM"):
        tz.init_lm(p, tz.new_model(p, 0))


def test_init_lm_loads_the_shipped_text_lm(tz):
    if not (tz.export_dir("text-draft") / "config.json").exists():
        pytest.skip("the zoo text draft is not shipped in this install")
    # the image draft's recipe over the shipped text draft (its own init_lm, text-draft-base, is a stage that only
    # a training machine has)
    p = dataclasses.replace(tz.PRESETS["image-draft"], init_lm="text-draft", lm=tz.PRESETS["text-draft"].lm)
    model = tz.new_model(p, 0)
    lm = tz.init_lm(p, model)
    from jspec.tools import zoo

    ref = zoo.load("text-draft").params
    assert not _moved(jax.device_get(lm), jax.device_get(ref))


def test_scene_labels_describe_the_scene(tz):
    """The tower's pretraining targets are in range and determine the scene: different scenes, different labels."""
    import random

    from jspec.tools.zoo import world as ZW

    rng = random.Random(0)
    seen: dict[bytes, str] = {}
    for i in range(600):
        s = ZW.SCENE_MAKERS[("shapes", "text", "chart")[i % 3]](rng)
        y = tz.scene_labels(s)
        assert y.shape == (len(tz.LABEL_CLASSES),) and (y >= 0).all() and (y < np.array(tz.LABEL_CLASSES)).all()
        assert seen.setdefault(y.tobytes(), s.key()) == s.key()
    assert len(set(seen.values())) > 400


def test_tower_head_reads_each_cell_from_its_own_token(tz):
    """Image token j is grid cell j: the pretraining logits of cell j's colour/shape/size/row/column slots move when
    token j's features move and no other cell's do; every slot's padding classes stay out of reach."""
    from jspec.tools.zoo import world as ZW

    dv, cells = 8, ZW.GRID ** 2
    head = tz.init_tower_head(dv, jax.random.key(0))
    head = jax.tree.map(lambda w: w + 0.1, head)                        # no zero biases hiding a dependence
    feats = np.asarray(jax.random.normal(jax.random.key(1), (2, cells, dv)))
    base = np.asarray(tz.tower_head_logits(head, feats))
    assert base.shape == (2, len(tz.LABEL_CLASSES), max(tz.LABEL_CLASSES))
    valid = np.arange(base.shape[-1])[None, :] < np.array(tz.LABEL_CLASSES)[:, None]
    assert (base[:, ~valid] == -1e9).all() and (base[:, valid] > -1e8).all()
    for j in (0, 4, cells - 1):
        moved = feats.copy()
        moved[:, j] += 1.0
        diff = np.abs(np.asarray(tz.tower_head_logits(head, moved)) - base).max(axis=(0, 2)) > 1e-6
        A = tz.CELL_SLOTS.shape[1]
        assert set(np.flatnonzero(diff[tz.CELL_SLOTS.ravel()])) == set(range(A * j, A * j + A))
        assert diff[tz.REST_SLOTS].all()                                 # the scene-level slots read every token


def test_depth_growth_keeps_the_function_and_trains(tz):
    """A grown model computes its source's logits exactly at step 0 (the twins' output projections are zero), owns
    its buffers (the train step donates them) and its twins learn; a source of the wrong depth is refused."""
    small = tz.Preset("text", dict(hidden=32, layers=2, heads=2, ffn=64), batch=2, seq_len=64, warmup=1)
    big = dataclasses.replace(small, lm=dict(small.lm, layers=4))
    src = tz.new_model(small, 0)
    model = tz.new_model(big, 1)
    params = tz.grow_params(src.params, 4)
    assert jax.tree.map(lambda x: x.shape, params) == jax.tree.map(lambda x: x.shape, model.params)
    batch = next(tz.stream(small, "train", 0, 0))[0]
    np.testing.assert_allclose(tz.logits_fn(model.config, params, batch), tz.logits_fn(src.config, src.params, batch),
                               atol=1e-6)
    tx = tz.make_optimizer(big)
    train_step, _ = tz.make_steps(model.config, tx)
    before = jax.device_get(params)
    params, _, _ = train_step(params, tx.init(params), batch, np.float32(1e-2), np.float32(1.0))
    after = jax.device_get(params)
    assert _moved(before["layers"][1]["wo"], after["layers"][1]["wo"])
    assert not np.array_equal(after["layers"][1]["wqkv"], after["layers"][0]["wqkv"])
    with pytest.raises(SystemExit, match="doubles the layers"):
        tz.grow_params(src.params, 3)


def test_prompt_loss_adds_the_question_tokens_only(tz):
    """`prompt_mask` marks the prompt's text tokens (never an answer token, an image token, padding or a special
    token); `prompt_loss` adds their mean cross-entropy to the objective while the reported loss stays the answers'."""
    p = _tiny(tz)
    batch = next(tz.stream(p, "train", 0, 0))[0]
    pm = np.asarray(tz.prompt_mask(batch))
    t, m, seg = batch["targets"], batch["target_mask"], batch["segment_ids"]
    assert pm.sum() > 0
    assert (pm * m).sum() == 0 and (pm[seg == 0] == 0).all()
    assert (t[pm > 0] >= 6).all() and not np.isin(t[pm > 0], [0, 1, 2, 3, 4, 5]).any()
    # every real text target that is not an answer is in the mask
    assert ((t >= 6) & (seg > 0) & (m == 0)).sum() == pm.sum()
    model = tz.new_model(p, 0)
    plain, aux0 = tz.loss_fn(model.config, model.params, batch)
    full, aux1 = tz.loss_fn(model.config, model.params, batch, prompt_loss=0.5)
    np.testing.assert_allclose(aux0[0], aux1[0])
    logp = jax.nn.log_softmax(tz.logits_fn(model.config, model.params, batch), axis=-1)
    nll = -np.take_along_axis(np.asarray(logp), t[..., None], axis=-1)[..., 0]
    np.testing.assert_allclose(full - plain, 0.5 * (nll * pm).sum() / pm.sum(), rtol=1e-5)


def test_init_from_starts_from_an_exported_model_of_the_same_shape(tz):
    if not (tz.export_dir("text-draft") / "config.json").exists():
        pytest.skip("the zoo text draft is not shipped in this install")
    p = dataclasses.replace(tz.PRESETS["text-draft"], grow_from=None, init_from="text-draft")
    params = tz.start_from(p, tz.new_model(p, 0))
    from jspec.tools import zoo

    assert not _moved(jax.device_get(params), jax.device_get(zoo.load("text-draft").params))
    wrong = dataclasses.replace(p, lm=dict(p.lm, layers=3))
    with pytest.raises(SystemExit, match="do not fit this preset"):
        tz.start_from(wrong, tz.new_model(wrong, 0))


def test_focus_loss_supervises_one_heads_attention(tz):
    """`target_focus` marks answer targets with the row position of their object's image token (same example,
    earlier); `focus_logprobs` is the port's own attention of that head (checked against the forward's attention
    probabilities); `focus_loss` adds exactly its weight x `focus_nll` to the objective."""
    p = dataclasses.replace(_tiny(tz, focus_loss=0.3, focus_head=(0, 1)), tasks=("vqa_colour", "vqa_count"))
    batch = next(tz.stream(p, "train", 0, 0))[0]
    f, seg = batch["target_focus"], batch["segment_ids"]
    b, t = np.nonzero(f >= 0)
    assert len(b) > 0 and (batch["target_mask"][b, t] == 1).all()
    assert (batch["input_ids"][b, f[b, t]] == 3).all() and (f[b, t] < t).all() and (seg[b, f[b, t]] == seg[b, t]).all()
    assert "target_focus" not in next(tz.stream(_tiny(tz), "train", 0, 0))[0]

    model = tz.new_model(p, 0)
    cfg, lm = model.config.text, model.params["lm"]
    x = tz.forward_fn(model.config, model.params, batch, (0,)).hidden[0]
    probs = np.exp(np.asarray(jnp.stack([tz.focus_logprobs(cfg, lm["layers"][0], x, batch, h) for h in (0, 1)])))
    w = np.zeros(f.shape, np.float32)
    rows = sorted(set(b.tolist()))
    for r in rows:
        w[r, t[b == r][0]] = 1.0
    embeds = tz.image_embeds(model.config, model.params, batch["input_ids"], batch["pixel_values"])
    B, T = f.shape
    cache = tz.kvc.init_cache(1, B, cfg.num_kv_heads, T, cfg.head_dim, jnp.float32)
    attn = tz.llama.forward(cfg, lm, batch["input_ids"], batch["positions"], cache, tz.segment_mask(seg),
                            embeds=embeds, attn_query_weights=jnp.asarray(w)).attn
    for r in rows:
        np.testing.assert_allclose(probs[:, r, t[b == r][0]].mean(0), np.asarray(attn)[r], atol=1e-5)

    plain, aux0 = tz.loss_fn(model.config, model.params, batch)
    full, aux1 = tz.loss_fn(model.config, model.params, batch, focus_loss=0.3, focus_head=(0, 1))
    np.testing.assert_allclose(aux0[0], aux1[0])
    expect = -np.log(probs[1, b, t, f[b, t]]).mean()
    np.testing.assert_allclose(full - plain, 0.3 * expect, rtol=1e-4)


def test_focus_readout_reads_the_heads_own_write(tz):
    """`head_write` is what a head adds to the residual stream (with the MLP's output zeroed, the layer's heads'
    writes sum to the layer's change of the stream); the readout term is the cross-entropy of the attribute-word
    targets under the LM head applied to that write alone."""
    p = dataclasses.replace(_tiny(tz, focus_loss=0.3, focus_head=(0, 1)), tasks=("vqa_colour", "vqa_size"))
    batch = next(tz.stream(p, "train", 0, 0))[0]
    model = tz.new_model(p, 0)
    cfg = model.config.text
    lm = {**model.params["lm"], "layers": [{**model.params["lm"]["layers"][0],
                                            "w_down": jnp.zeros_like(model.params["lm"]["layers"][0]["w_down"])}]}
    params = {**model.params, "lm": lm}
    x0, x1 = tz.forward_fn(model.config, params, batch, (0, 1)).hidden
    writes = [tz.head_write(cfg, lm["layers"][0], x0, tz.focus_logprobs(cfg, lm["layers"][0], x0, batch, h), h)
              for h in (0, 1)]
    seen = np.asarray(tz.segment_mask(batch["segment_ids"])).any(-1)  # padding sees nothing: its output is moot
    assert seen.any() and not seen.all()
    np.testing.assert_allclose(np.asarray(writes[0] + writes[1])[seen], np.asarray(x1 - x0)[seen], atol=1e-5)

    ids = tz.attribute_ids()
    from jspec.tools.zoo import tokenizer as TK
    words = {TK.load_tokenizer().decode([int(i)]).strip() for i in ids}
    assert {"red", "circle", "big", "small", "top", "center", "yes"} <= words and "The" not in words
    _, readout = tz.focus_nll(cfg, lm, x0, batch, 0, 1, jnp.asarray(ids))
    on = (batch["target_focus"] >= 0) & np.isin(batch["targets"], ids)
    assert on.sum() > 0 and on.sum() < (batch["target_focus"] >= 0).sum()     # the answers' other words are left out
    logp = np.asarray(jax.nn.log_softmax(tz.llama.unembed(cfg, lm, writes[1]), -1))
    expect = -np.take_along_axis(logp, batch["targets"][..., None], -1)[..., 0][on].mean()
    np.testing.assert_allclose(readout, expect, rtol=1e-5)
    full, aux = tz.loss_fn(model.config, params, batch, focus_loss=0.3, focus_head=(0, 1), focus_readout=0.2)
    plain, _ = tz.loss_fn(model.config, params, batch)
    np.testing.assert_allclose(full - plain, 0.3 * aux[3] + 0.2 * aux[4], rtol=1e-5)
    np.testing.assert_allclose(aux[4], expect, rtol=1e-5)
