"""scripts/train_zoo.py's LLaVA recipe: the LM starts from a zoo text model, stays frozen during the alignment stage
(only the tower and projector move, weight decay included) and trains after it; a text model of the wrong shape is
refused with the shapes named."""
from __future__ import annotations

import dataclasses
import importlib.util
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tz():
    spec = importlib.util.spec_from_file_location("train_zoo", ROOT / "scripts" / "train_zoo.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["train_zoo"] = mod        # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


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
    from jspec import zoo

    ref = zoo.load("text-draft").params
    assert not _moved(jax.device_get(lm), jax.device_get(ref))


def test_scene_labels_describe_the_scene(tz):
    """The tower's pretraining targets are in range and determine the scene: different scenes, different labels."""
    import random

    from jspec.zoo import world as W

    rng = random.Random(0)
    seen: dict[bytes, str] = {}
    for i in range(600):
        s = W.SCENE_MAKERS[("shapes", "text", "chart")[i % 3]](rng)
        y = tz.scene_labels(s)
        assert y.shape == (len(tz.LABEL_CLASSES),) and (y >= 0).all() and (y < np.array(tz.LABEL_CLASSES)).all()
        assert seen.setdefault(y.tobytes(), s.key()) == s.key()
    assert len(set(seen.values())) > 400


def test_tower_head_reads_each_cell_from_its_own_token(tz):
    """Image token j is grid cell j: the pretraining logits of cell j's colour/shape/size/row/column slots move when
    token j's features move and no other cell's do; every slot's padding classes stay out of reach."""
    from jspec.zoo import world as W

    dv, cells = 8, W.GRID ** 2
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


def test_answer_weights_per_token_and_per_example(tz):
    """Per token: every answer token weighs the same. Per example: each packed example's answer tokens share an equal
    part, so a one-token answer weighs as much as a long one; padding and prompt tokens weigh nothing."""
    seg = np.array([[1, 1, 1, 1, 2, 2, 0], [1, 1, 2, 2, 2, 3, 3]], np.int32)
    mask = np.array([[0, 1, 1, 1, 0, 1, 0], [0, 1, 0, 0, 1, 0, 0]], np.float32)   # row 1, segment 3: no answer
    tok = np.asarray(tz.answer_weights(jnp.asarray(seg), jnp.asarray(mask), False))
    np.testing.assert_allclose(tok, mask / mask.sum())
    ex = np.asarray(tz.answer_weights(jnp.asarray(seg), jnp.asarray(mask), True))
    np.testing.assert_allclose(ex.sum(), 1.0, rtol=1e-6)
    assert (ex[mask == 0] == 0).all()
    np.testing.assert_allclose(ex[0, 1:4], 1 / 12)            # 4 examples with answers; 3 tokens share one quarter
    np.testing.assert_allclose([ex[0, 5], ex[1, 1], ex[1, 4]], 1 / 4)


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
    assert not np.array_equal(after["layers"][1]["wq"], after["layers"][0]["wq"])
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
    from jspec import zoo

    assert not _moved(jax.device_get(params), jax.device_get(zoo.load("text-draft").params))
    wrong = dataclasses.replace(p, lm=dict(p.lm, layers=3))
    with pytest.raises(SystemExit, match="do not fit this preset"):
        tz.start_from(wrong, tz.new_model(wrong, 0))
