"""Qwen2-VL / Qwen2.5-VL prompts without torchvision.

transformers builds a Qwen2-VL processor only with its video processor, which imports torchvision; where
torchvision is missing, `AutoProcessor` fails even for text and images. `QwenVLInputs` reads the same
checkpoint files (tokenizer, `preprocessor_config.json`, `video_preprocessor_config.json`) and gives the processor's
output: images through transformers' Pillow image processor; video frames resized (Pillow bicubic to transformers'
`smart_resize` size), rescaled, normalised and patchified as `Qwen2VLVideoProcessor` lays them out;
placeholders expanded to `t * h * w / merge^2` tokens; `mm_token_type_ids` and, for Qwen2.5-VL, `second_per_grid_ts`."""
from __future__ import annotations

import json
import os

import numpy as np

FAMILIES = ("qwen2_vl", "qwen2_5_vl")
VIDEO_DEFAULTS = {"size": {"shortest_edge": 128 * 28 * 28, "longest_edge": 28 * 28 * 768}, "fps": 2.0,
                  "patch_size": 14, "merge_size": 2, "temporal_patch_size": 2,
                  "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711]}


def family_of(path: str) -> str | None:
    """The Qwen VL family ("qwen2_vl" / "qwen2_5_vl") of the checkpoint at `path`, else None."""
    try:
        with open(os.path.join(path, "config.json")) as f:
            kind = json.load(f).get("model_type")
    except (OSError, ValueError):
        return None
    return kind if kind in FAMILIES else None


def video_pixels(frames: np.ndarray, patch: int, merge: int, temporal: int, mean, std, size: dict,
                 resize: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """(pixel rows float32 [t * h * w, 3 * temporal * patch^2], grid int64 [3] = (t, h, w)) of uint8 frames
    [N, H, W, 3]: resized to transformers' `smart_resize` size, rescaled to [0, 1], normalised, the last frame
    repeated to a multiple of `temporal`, and laid out per temporal group in merge x merge blocks, each row
    (channel, time, y, x)."""
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    frames = np.asarray(frames)
    if frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"video frames have shape {frames.shape}: expected [frames, height, width, 3]")
    n, H, W = frames.shape[:3]
    if resize:
        h, w = smart_resize(H, W, factor=patch * merge, min_pixels=size["shortest_edge"],
                            max_pixels=size["longest_edge"])
        if (h, w) != (H, W):
            frames = np.stack([np.asarray(Image.fromarray(f.astype(np.uint8)).resize((w, h), Image.BICUBIC))
                               for f in frames])
    x = (frames.astype(np.float32) / 255.0 - np.asarray(mean, np.float32)) / np.asarray(std, np.float32)
    x = x.transpose(0, 3, 1, 2)
    if pad := -n % temporal:
        x = np.concatenate([x, np.repeat(x[-1:], pad, axis=0)])
    c, h, w = x.shape[1:]
    if h % (patch * merge) or w % (patch * merge):
        raise ValueError(f"{h} x {w} frames are not multiples of patch * merge = {patch * merge}")
    gt, gh, gw = len(x) // temporal, h // patch, w // patch
    x = x.reshape(gt, temporal, c, gh // merge, merge, patch, gw // merge, merge, patch)
    x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return np.ascontiguousarray(x.reshape(gt * gh * gw, c * temporal * patch * patch)), np.array([gt, gh, gw])


def video_settings(path: str) -> dict:
    """Qwen2VLVideoProcessor's settings for the checkpoint at `path`, from the first file transformers reads:
    processor_config.json's "video_processor", video_preprocessor_config.json, preprocessor_config.json; its class
    defaults for what none sets."""
    out = dict(VIDEO_DEFAULTS)
    saved = None
    for name, key in (("processor_config.json", "video_processor"), ("video_preprocessor_config.json", None),
                      ("preprocessor_config.json", None)):
        f = os.path.join(path, name)
        if os.path.exists(f):
            with open(f) as fh:
                d = json.load(fh)
            saved = d.get(key) if key else d
            if saved is not None:
                break
    saved = saved or {}
    out.update({k: v for k, v in saved.items() if k in out and v is not None})
    for old, new in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")):
        if saved.get(old) is not None:
            out["size"] = dict(out["size"], **{new: saved[old]})
    return out


class QwenVLInputs:
    """A Qwen2-VL / Qwen2.5-VL processor from the checkpoint's files that needs no torchvision; called like the
    transformers processor: `(text=[...], images=[...], videos=[frames, ...], return_tensors="np")`."""

    def __init__(self, path: str, fps: float | None = None):
        from transformers import AutoTokenizer
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        self.family = family_of(path)
        if self.family is None:
            raise ValueError(f"{path} is not a Qwen2-VL / Qwen2.5-VL checkpoint (config.json's model_type)")
        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.image_processor = Qwen2VLImageProcessorPil.from_pretrained(path, local_files_only=True)
        self.video = video_settings(path)
        if fps is not None:
            self.video["fps"] = fps
        self.merge_size = self.video["merge_size"]
        self.chat_template = getattr(self.tokenizer, "chat_template", None)
        tok = self.tokenizer
        self.image_token = getattr(tok, "image_token", None) or "<|image_pad|>"
        self.video_token = getattr(tok, "video_token", None) or "<|video_pad|>"
        self.image_token_id = tok.convert_tokens_to_ids(self.image_token)
        self.video_token_id = tok.convert_tokens_to_ids(self.video_token)

    def apply_chat_template(self, messages, **kw):
        return self.tokenizer.apply_chat_template(messages, **kw)

    def videos(self, videos) -> dict:
        v = self.video
        px, grids = zip(*[video_pixels(f, v["patch_size"], v["merge_size"], v["temporal_patch_size"],
                                       v["image_mean"], v["image_std"], v["size"]) for f in videos])
        out = {"pixel_values_videos": np.concatenate(px), "video_grid_thw": np.stack(grids)}
        if self.family == "qwen2_5_vl":
            out["second_per_grid_ts"] = np.full(len(grids), v["temporal_patch_size"] / v["fps"], np.float32)
        return out

    def _expand(self, text: str, token: str, grids: list) -> str:
        parts = text.split(token)
        if len(parts) - 1 > len(grids):
            raise ValueError(f"the prompt has more {token} placeholders than the {len(grids)} given")
        out = parts[0]
        for part in parts[1:]:
            out += token * int(np.prod(grids.pop(0)) // self.merge_size ** 2) + part
        return out

    def __call__(self, text, images=None, videos=None, return_tensors: str = "np", **kw) -> dict:
        texts = [text] if isinstance(text, str) else list(text)
        out: dict = {}
        grids = {self.image_token: [], self.video_token: []}
        if images:
            ib = self.image_processor(images=list(images), return_tensors="np")
            out.update(pixel_values=np.asarray(ib["pixel_values"]), image_grid_thw=np.asarray(ib["image_grid_thw"]))
            grids[self.image_token] = list(out["image_grid_thw"])
        if videos:
            out.update(self.videos(videos))
            grids[self.video_token] = list(out["video_grid_thw"])
        for token, g in grids.items():
            n = sum(t.count(token) for t in texts)
            if n != len(g):
                raise ValueError(f"the prompt has {n} {token} placeholders for {len(g)} "
                                 f"{'images' if token == self.image_token else 'videos'}")
            texts = [self._expand(t, token, g) for t in texts]
        enc = self.tokenizer(texts, padding=len(texts) > 1, return_tensors="np", **kw)
        ids = np.asarray(enc["input_ids"])
        out.update(input_ids=ids, attention_mask=np.asarray(enc["attention_mask"]),
                   mm_token_type_ids=np.where(ids == self.image_token_id, 1,
                                              np.where(ids == self.video_token_id, 2, 0)).astype(np.int64))
        return out
