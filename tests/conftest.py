"""Shared fixtures: tiny random HF models saved to disk, loaded through ports.load_hf."""
from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def _compile_less():
    """The suite compiles hundreds of small programs, so compiling dominates it. Two settings, made before JAX is
    imported and inherited by pytest-xdist workers and test subprocesses:
    - LLVM's expensive passes are skipped (`JAX_DISABLE_MOST_OPTIMIZATIONS`) and XLA:CPU's fusions are emitted by
      its older emitters (`--xla_cpu_use_fusion_emitters=false`, a third less compile time over the conformance
      tests): the HLO program, and with it every number a test compares, is the one users run; only the machine
      code is made differently.
    - One compile cache for the whole run, so a program that several tests build (the same tiny model under the
      same strategy) compiles once across tests and workers. The directory is removed when the run ends; set
      `JAX_COMPILATION_CACHE_DIR` yourself to keep one across runs."""
    os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
    if "xla_cpu_use_fusion_emitters" not in os.environ.get("XLA_FLAGS", ""):  # the older emitters compile a third
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_use_fusion_emitters=false").strip()
    if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
        path = tempfile.mkdtemp(prefix="jspec-tests-xla-")
        os.environ["JAX_COMPILATION_CACHE_DIR"] = path
        atexit.register(shutil.rmtree, path, ignore_errors=True)
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    if "JSPEC_COSTS_DIR" not in os.environ:  # the guard's cost tables (`jspec.costs`): measured here, not read from ~
        path = tempfile.mkdtemp(prefix="jspec-tests-costs-")
        os.environ["JSPEC_COSTS_DIR"] = path
        atexit.register(shutil.rmtree, path, ignore_errors=True)


_compile_less()

import numpy as np
import pytest
import torch
import transformers

import ports

torch.set_num_threads(2)

import mutants  # noqa: E402

mutants.apply_from_env()  # JSPEC_MUTANT=<name>: run the tests under one of tests/mutants.py's mutants


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


def hf_batch_logits(hf_model, batch: dict) -> np.ndarray:
    """transformers' float logits of a processor batch (every key passed as a tensor)."""
    with torch.no_grad():
        return hf_model(**{k: torch.tensor(v) for k, v in batch.items()}).logits.float().numpy()


def hf_logits(hf_model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return hf_model(torch.tensor(tokens)).logits.float().numpy()


def hf_greedy(hf_model, prompt: np.ndarray, max_new: int, eos=None, **generate_kwargs) -> np.ndarray:
    """transformers' greedy generate for one 1-D prompt; returns the new tokens (EOS included, no padding). The
    attention mask is explicit: transformers would otherwise take prompt tokens equal to the pad id for padding."""
    x = torch.tensor(prompt[None])
    with torch.no_grad():
        out = hf_model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new, do_sample=False,
                                eos_token_id=eos, pad_token_id=0 if eos is None else eos, **generate_kwargs)
    return out[0, len(prompt):].numpy()


def write_layered_checkpoint(directory, layers: int) -> int:
    """An HF LLaMA checkpoint of random tensors written one at a time; returns its size in bytes."""
    cfg = ports.TextConfig(model_type="llama", vocab_size=4096, hidden_size=256, intermediate_size=688,
                           num_layers=layers, num_heads=4, num_kv_heads=4, head_dim=64, eos_token_ids=())
    directory.mkdir()
    fam = ports.FAMILIES["llama"]
    shapes = fam.param_shapes(cfg)
    from ports.core.hf_layout import ours_shape_to_hf
    from ports.core.param_paths import get_path
    from ports.core.safetensors_io import write_safetensors

    table = {n: (ours_shape_to_hf(tuple(get_path(shapes, p)), tr), np.dtype(np.float32))
             for n, p, tr in fam.hf_key_map(cfg)}
    rng = np.random.default_rng(0)
    write_safetensors(str(directory / "model.safetensors"), table,
                      lambda n: rng.normal(0, 0.02, table[n][0]).astype(np.float32))
    with open(directory / "config.json", "w") as f:
        json.dump(ports.text_config_to_hf(cfg), f)
    return sum(int(np.prod(s)) * 4 for s, _ in table.values())


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


def eager_attentions(hf_model, batch: dict) -> np.ndarray:
    """[layers, B, H, T, T] attention probabilities of an HF forward on `batch` (numpy arrays) under its eager
    attention; the model goes back to SDPA after."""
    hf_model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            att = hf_model(**{k: torch.tensor(v) for k, v in batch.items()}, output_attentions=True).attentions
    finally:
        hf_model.set_attn_implementation("sdpa")
    return np.stack([a.numpy() for a in att])


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
