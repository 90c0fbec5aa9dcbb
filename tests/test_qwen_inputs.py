"""Qwen2-VL / Qwen2.5-VL prompts without torchvision (`jspec.tools.cli.qwen_inputs`): video frames laid out as
transformers' image processor lays each frame (resize included), the settings transformers reads, placeholder
errors, and `jspec decode --video` end to end on a saved tiny Qwen2.5-VL checkpoint."""
import json

import numpy as np
import pytest
import transformers
from PIL import Image

import jax
import jspec
import ports
from jspec.tools import cli
from jspec.tools.cli import qwen_inputs as QI
import test_qwen2_vl as Q

SIZE = {"shortest_edge": 28 * 28, "longest_edge": 56 * 84}


def frames(n: int, h: int, w: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, h, w, 3), dtype=np.uint8)


@pytest.mark.parametrize("n,h,w", [(3, 40, 50), (4, 28, 56)])
def test_each_frame_is_laid_out_as_the_image_processor_lays_it(n, h, w):
    """Row r's time slot t of a video holds frame 2g + t as transformers' image processor (which repeats one
    image over both slots) gives it: same resize, normalisation and patch order; an odd last frame is repeated."""
    ip = Q.processor().image_processor
    v = frames(n, h, w)
    px, grid = QI.video_pixels(v, Q.PATCH, Q.MERGE, 2, ip.image_mean, ip.image_std, SIZE)
    assert grid[0] == (n + 1) // 2
    per_group = int(grid[1] * grid[2])
    px = px.reshape(grid[0], per_group, 3, 2, Q.PATCH * Q.PATCH)
    for g in range(grid[0]):
        for t in range(2):
            f = min(2 * g + t, n - 1)
            ref = ip(images=[Image.fromarray(v[f])], return_tensors="np")
            assert list(ref["image_grid_thw"][0]) == [1, grid[1], grid[2]]
            r = np.asarray(ref["pixel_values"]).reshape(per_group, 3, 2, Q.PATCH * Q.PATCH)
            np.testing.assert_allclose(px[g, :, :, t], r[:, :, 0], atol=1e-5)


def test_settings_come_from_the_file_transformers_reads(tmp_path):
    assert QI.video_settings(str(tmp_path)) == QI.VIDEO_DEFAULTS
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"min_pixels": 100, "max_pixels": 200,
                                                                  "patch_size": 7}))
    s = QI.video_settings(str(tmp_path))
    assert (s["size"], s["patch_size"]) == ({"shortest_edge": 100, "longest_edge": 200}, 7)
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps({"size": SIZE, "fps": 4.0}))
    s = QI.video_settings(str(tmp_path))
    assert (s["size"], s["patch_size"], s["fps"]) == (SIZE, 14, 4.0)


def save_checkpoint(tmp_path):
    """A tiny Qwen2.5-VL checkpoint directory as the Hub lays one out, without a video processor file."""
    Q.tiny_q25(0).save_pretrained(tmp_path)
    Q.tokenizer().save_pretrained(tmp_path)
    Q.processor().image_processor.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "preprocessor_config.json").read_text())
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(cfg | {"processor_class": "Qwen2_5_VLProcessor"}))
    return tmp_path


def test_placeholders_must_match_the_videos(tmp_path):
    proc = QI.QwenVLInputs(str(save_checkpoint(tmp_path)))
    with pytest.raises(ValueError, match="1 <\\|video_pad\\|> placeholders for 2 videos"):
        proc(text=["w1 <|video_pad|>"], videos=[frames(2, 28, 28), frames(2, 28, 28)])
    with pytest.raises(ValueError, match="expected \\[frames, height, width, 3\\]"):
        proc(text=["w1 <|video_pad|>"], videos=[frames(2, 28, 28)[..., 0]])


def test_decode_a_video_prompt_from_the_command_line(tmp_path, capsys):
    """`jspec decode --video DIR` on a Qwen2.5-VL checkpoint whose transformers processor cannot load here: the
    prompt equals the hand-built one of the port's parity tests (2 s per group at 1 fps), and Chain's tokens equal
    AR's on it."""
    d = save_checkpoint(tmp_path / "ckpt")
    with pytest.raises(ImportError):  # the path this fallback serves
        transformers.AutoProcessor.from_pretrained(d, local_files_only=True)
    v = frames(3, 28, 56, seed=3)
    (tmp_path / "clip").mkdir()
    for i, f in enumerate(v):
        Image.fromarray(f).save(tmp_path / "clip" / f"{i:03d}.png")
    text = "w1 w7 <|vision_start|><|video_pad|><|vision_end|> w2 w3"
    proc = QI.QwenVLInputs(str(d), fps=1.0)
    got = proc(text=[text], videos=[v])
    want = Q.build(["w1 w7 <video> w2 w3"], videos=[v], seconds=[2.0])
    for k in ("input_ids", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts", "mm_token_type_ids"):
        np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), atol=1e-6, err_msg=k)

    model = ports.load_hf(str(d))
    ref = jspec.decode(model, {k: v for k, v in want.items() if k != "attention_mask"}, max_new_tokens=6,
                       key=jax.random.key(0))
    assert cli.main(["decode", "--model", str(d), "--draft", str(d), "--video", str(tmp_path / "clip"),
                     "--video-fps", "1", "--prompt", text, "--max-new-tokens", "6", "--gamma", "3"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["tokens"] == [int(t) for t in np.asarray(ref.tokens)[0, :6]]
    assert out["tokens_per_step"] > 1.0
