"""The synthetic world (`world`), its tokenizer (`tokenizer`), training / evaluation data (`data`), and the shipped
model pairs, trained on the world by scripts/train_zoo.py and stored in HF layout (bf16) in the `jspec-zoo`
distribution (`jspec_zoo/<name>/`; a checkout's `assets/zoo`):

    from jspec.tools import zoo
    target, draft = zoo.load("text-target"), zoo.load("text-draft")     # ports.Model, float32
    tok = zoo.load_tokenizer("text-target")                              # transformers tokenizer of that model
    proc = zoo.load_processor("image-target")                            # LlavaProcessor (image models)
    zoo.available()                                                      # the names shipped in this install

`jspec.tools.zoo.evaluate` measures the pairs (exact match, acceptance per scenario and view). `jspec.tools.zoo.video` holds the
video clips, their tasks and the Qwen2.5-VL-style prompts of the video pair (trained by scripts/train_zoo.py's
video-target / video-draft presets; `video.VideoEncoder().prompts(examples)` is its processor).
"""
from __future__ import annotations

from pathlib import Path

from jspec.tools import assets
from jspec.tools.zoo import tokenizer as _tokenizer_module

MODEL_NAMES = ("text-target", "text-draft", "image-target", "image-draft", "video-target", "video-draft",
               "video-draft-weak")
ZOO_DIR: Path | None = assets.directory(assets.ZOO)  # None when jspec-zoo is not installed


def available() -> list[str]:
    """The zoo models shipped in this install (a directory with config.json and weights)."""
    if ZOO_DIR is None:
        return []
    return [n for n in MODEL_NAMES if (ZOO_DIR / n / "config.json").exists()
            and (ZOO_DIR / n / "model.safetensors").exists()]


def weights_dir(name: str) -> Path:
    """The folder of zoo entry `name` (a model pair member or a trained head such as "text-target-eesd-n1");
    ValueError saying how to install the zoo when it is absent."""
    if ZOO_DIR is None or not (ZOO_DIR / name).is_dir():
        raise ValueError(f"zoo entry {name!r} is not installed: {assets.install_hint(assets.ZOO)}")
    return ZOO_DIR / name


def model_dir(name: str) -> Path:
    """The directory of a shipped zoo model; ValueError naming the available ones otherwise."""
    have = available()
    if name not in have:
        what = "is not shipped in this install" if name in MODEL_NAMES else "is not a zoo model"
        raise ValueError(f"zoo model {name!r} {what}; available: {', '.join(have) or 'none'}"
                         + (f" (known names: {', '.join(MODEL_NAMES)})" if name not in MODEL_NAMES else "")
                         + ("" if have else f"; {assets.install_hint(assets.ZOO)}"))
    return ZOO_DIR / name


def load(name: str, dtype=None):
    """A shipped zoo model as a `ports.Model` (`ports.load_hf` of its directory; float32 unless `dtype`)."""
    import jax.numpy as jnp

    import ports

    return ports.load_hf(str(model_dir(name)), dtype=jnp.float32 if dtype is None else dtype)


def load_tokenizer(name: str):
    """The transformers tokenizer shipped with zoo model `name` (AutoTokenizer of its directory)."""
    return _tokenizer_module.load_tokenizer(model_dir(name))


def load_processor(name: str):
    """The transformers processor shipped with an image zoo model (AutoProcessor of its directory: LlavaProcessor)."""
    from transformers import AutoProcessor

    d = model_dir(name)
    if not (d / "processor_config.json").exists() and not (d / "preprocessor_config.json").exists():
        if '"qwen2_5_vl"' in (d / "config.json").read_text():
            raise ValueError(f"zoo model {name!r} is a video model: its prompts come from "
                             "jspec.tools.zoo.video.VideoEncoder().prompts(examples) (Qwen2.5-VL processor output)")
        raise ValueError(f"zoo model {name!r} is a text model: it has no processor; use load_tokenizer")
    return AutoProcessor.from_pretrained(str(d))


__all__ = ["MODEL_NAMES", "available", "load", "load_processor", "load_tokenizer", "model_dir", "weights_dir"]
