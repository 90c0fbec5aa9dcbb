"""The synthetic world (`world`), its tokenizer (`tokenizer`), training / evaluation data (`data`), and the shipped
model pairs, trained on the world by scripts/train_zoo.py and stored in HF layout (bf16) under jspec/zoo/<name>/:

    from jspec import zoo
    target, draft = zoo.load("text-target"), zoo.load("text-draft")     # ports.Model, float32
    tok = zoo.tokenizer("text-target")                                   # transformers tokenizer of that model
    zoo.available()                                                      # the names shipped in this install

`zoo.tokenizer` is also the tokenizer module (`zoo.tokenizer.load_tokenizer`, `zoo.tokenizer.make_processor`,
...); calling it with a model name loads that model's tokenizer.
"""
from __future__ import annotations

import types
from pathlib import Path

from jspec.zoo import tokenizer as _tokenizer_module

MODEL_NAMES = ("text-target", "text-draft", "image-target", "image-draft")
ZOO_DIR = Path(__file__).resolve().parent


def available() -> list[str]:
    """The zoo models shipped in this install (a directory with config.json and weights)."""
    return [n for n in MODEL_NAMES if (ZOO_DIR / n / "config.json").exists()
            and (ZOO_DIR / n / "model.safetensors").exists()]


def model_dir(name: str) -> Path:
    """The directory of a shipped zoo model; ValueError naming the available ones otherwise."""
    have = available()
    if name not in have:
        what = "is not shipped in this install" if name in MODEL_NAMES else "is not a zoo model"
        raise ValueError(f"zoo model {name!r} {what}; available: {', '.join(have) or 'none'}"
                         + (f" (known names: {', '.join(MODEL_NAMES)})" if name not in MODEL_NAMES else ""))
    return ZOO_DIR / name


def load(name: str, dtype=None):
    """A shipped zoo model as a `ports.Model` (`ports.load_hf` of its directory; float32 unless `dtype`)."""
    import jax.numpy as jnp

    import ports

    return ports.load_hf(str(model_dir(name)), dtype=jnp.float32 if dtype is None else dtype)


class _TokenizerModule(types.ModuleType):
    """`jspec.zoo.tokenizer`: the tokenizer module, callable with a zoo model name."""

    def __call__(self, name: str):
        """The transformers tokenizer shipped with zoo model `name` (AutoTokenizer of its directory)."""
        return self.load_tokenizer(model_dir(name))


_tokenizer_module.__class__ = _TokenizerModule
tokenizer = _tokenizer_module

__all__ = ["MODEL_NAMES", "available", "load", "model_dir", "tokenizer"]
