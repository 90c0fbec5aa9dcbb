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


def test_init_lm_refuses_a_text_model_of_another_shape(tz):
    p = _tiny(tz, init_lm="text-draft")
    if not (tz.ZOO_DIR / "text-draft" / "config.json").exists():
        pytest.skip("the zoo text draft is not shipped in this install")
    with pytest.raises(SystemExit, match="do not fit the LM"):
        tz.init_lm(p, tz.new_model(p, 0))


def test_init_lm_loads_the_shipped_text_lm(tz):
    if not (tz.ZOO_DIR / "text-draft" / "config.json").exists():
        pytest.skip("the zoo text draft is not shipped in this install")
    p = dataclasses.replace(tz.PRESETS["image-draft"])
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
    """Image token j is grid cell j: the pretraining logits of cell j's colour/shape/size slots move when token j's
    features move and no other cell's do; every slot's padding classes stay out of reach."""
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
        assert set(np.flatnonzero(diff[tz.CELL_SLOTS.ravel()])) == {3 * j, 3 * j + 1, 3 * j + 2}
        assert diff[tz.REST_SLOTS].all()                                 # the scene-level slots read every token
