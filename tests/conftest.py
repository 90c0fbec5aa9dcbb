"""Shared fixtures: tiny random HF models saved to disk, loaded through ports.load_hf."""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import numpy as np
import pytest
import torch
import transformers

import ports

torch.set_num_threads(2)


def tiny_hf(kind: str = "llama", seed: int = 0, **overrides):
    """A tiny random transformers model (eval mode, f32). initializer_range is large so logits are not flat."""
    torch.manual_seed(seed)
    base = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=101, initializer_range=0.25, max_position_embeddings=256,
                bos_token_id=None, eos_token_id=None, pad_token_id=None)
    base.update(overrides)
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**base))
    elif kind == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**base))
    else:
        raise ValueError(kind)
    return model.eval()


def perturb(module, seed: int, scale: float = 0.2):
    """Add seeded noise to every parameter of a torch module, so that biases, norm scales and offsets all matter
    in a parity comparison (HF initialises many of them to 0 or 1)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return module


def save_and_load(hf_model, directory, **save_kwargs):
    hf_model.save_pretrained(str(directory), **save_kwargs)
    return ports.load_hf(str(directory))


def hf_logits(hf_model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return hf_model(torch.tensor(tokens)).logits.float().numpy()


def hf_greedy(hf_model, prompt: np.ndarray, max_new: int, eos=None) -> np.ndarray:
    """transformers' greedy generate for one 1-D prompt; returns the new tokens (EOS included, no padding)."""
    with torch.no_grad():
        out = hf_model.generate(torch.tensor(prompt[None]), max_new_tokens=max_new, do_sample=False,
                                eos_token_id=eos, pad_token_id=0 if eos is None else eos)
    return out[0, len(prompt):].numpy()


def saved_and_loaded(hf_models: dict, root) -> tuple[dict, dict]:
    """({name: HF model}, {name: jspec model}): each HF model saved under root/name and read back by load_hf."""
    for name, model in hf_models.items():
        model.save_pretrained(str(root / name))
    return hf_models, {name: ports.load_hf(str(root / name)) for name in hf_models}


def assert_masked_parity(hf_model, model, batch: dict, atol: float, rtol: float):
    """ports.logits equals the HF forward on a processor batch, at the positions its attention_mask keeps."""
    ours = ports.logits(model, batch)
    with torch.no_grad():
        ref = hf_model(**{k: torch.tensor(v) for k, v in batch.items()}).logits.numpy()
    mask = batch["attention_mask"].astype(bool)
    np.testing.assert_allclose(ours[mask], ref[mask], atol=atol, rtol=rtol)


@pytest.fixture(scope="session")
def llama_pair(tmp_path_factory):
    """(hf_model, jspec model) for a tiny GQA LLaMA."""
    hf = tiny_hf("llama", seed=1)
    return hf, save_and_load(hf, tmp_path_factory.mktemp("llama"))


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
    """Drop jax's compiled programs after each test module: one process runs the whole suite, and keeping every
    module's executables grew it past 5 GB (and XLA:CPU once crashed compiling late in such a process)."""
    yield
    import gc

    import jax

    jax.clear_caches()
    gc.collect()


@pytest.fixture(scope="module")
def tz():
    """scripts/train_zoo.py as a module (registered in sys.modules: its dataclasses look their module up)."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "scripts" / "train_zoo.py"
    spec = importlib.util.spec_from_file_location("train_zoo", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["train_zoo"] = mod
    spec.loader.exec_module(mod)
    return mod
