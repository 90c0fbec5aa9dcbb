"""One switch (`JSPEC_CPU_KERNELS`): the same greedy tokens with the CPU kernels on (every loader packs the weights;
the products, attention and cache writes go to the kernels) as with them off (XLA's ops), on the zoo's text and image
pairs and on SmolLM2-135M-Instruct, and through every loader."""
import jax
import numpy as np
import pytest

import jspec
import ports
from jspec.tools import models, zoo
from jspec.tools.zoo import data as ZD
from ports import cpu

REAL = "smollm2-135m-instruct"


def _both(load, decode):
    """decode(load()) with the kernels on, then off (programs traced under the other setting dropped first)."""
    on_model = load()
    on = decode(on_model)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(cpu.SWITCH, "0")
        jax.clear_caches()
        off_model = load()
        off = decode(off_model)
    jax.clear_caches()
    first = lambda m: getattr(m, "target", m[0] if isinstance(m, tuple) else m)  # noqa: E731
    assert cpu.is_packed(first(on_model)) and not cpu.is_packed(first(off_model))
    return on, off


def test_the_zoo_text_pair_decodes_the_same_tokens_either_way():
    tok = zoo.load_tokenizer("text-target")
    enc = ZD.Encoder(tok, view="T")
    prompts = [enc.prompt(ex)["input_ids"][0] for ex in ZD.eval_set("text", 3, tasks=list(ZD.TEXT_TASKS))]

    def decode(pair):
        target, draft = pair
        kw = dict(max_new_tokens=24)
        return [np.asarray(jspec.decode(target, prompts, s, **kw).tokens)
                for s in (jspec.AR(), jspec.Chain(draft, gamma=4))]

    on, off = _both(lambda: (zoo.load("text-target"), zoo.load("text-draft")), decode)
    for a, b in zip(on, off):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(on[0], on[1])  # and speculation keeps AR's tokens


def test_the_zoo_image_pair_decodes_the_same_tokens_either_way():
    """A LLaVA target and draft (their language models packed with the kernels on, the vision towers as they are)
    on VQA and caption prompts."""
    from jspec.tools.zoo import evaluate as ZE

    exs = ZD.eval_set("vqa", 2) + ZD.eval_set("caption", 1)

    def decode(pair):
        prompt = ZE.batch_prompt(pair.encoder, exs)
        return [np.asarray(jspec.decode(pair.target, prompt, s, max_new_tokens=16).tokens)
                for s in (jspec.AR(), jspec.Chain(pair.draft, gamma=4))]

    on, off = _both(lambda: ZE.load_pair("image"), decode)
    for a, b in zip(on, off):
        np.testing.assert_array_equal(a, b)


@pytest.mark.skipif(not models.available(REAL), reason=f"needs the real checkpoint: run `jspec fetch {REAL}`")
def test_smollm2_decodes_the_same_tokens_either_way():
    _, tok = models.load(REAL)
    chat = [{"role": "user", "content": "Give three tips for learning a language."}]
    ids = np.asarray(tok.apply_chat_template(chat, add_generation_prompt=True)["input_ids"], np.int32)

    def decode(model):
        return [np.asarray(jspec.decode(model, ids, s, max_new_tokens=24).tokens)
                for s in (jspec.AR(), jspec.PromptLookup(gamma=4))]

    on, off = _both(lambda: models.load(REAL)[0], decode)
    for a, b in zip(on, off):
        np.testing.assert_array_equal(a, b)


def test_every_loader_gives_the_same_layout(tmp_path):
    """load_hf, load (orbax) and load_gguf pack with the kernels on, and none does with them off."""
    model = ports.random_model(ports.TextConfig(model_type="llama", vocab_size=64, hidden_size=32,
                                                intermediate_size=48, num_layers=2, num_heads=2, num_kv_heads=1,
                                                head_dim=16), key=1)
    ports.save_hf(model, str(tmp_path / "hf"))
    ports.save(model, str(tmp_path / "orbax"))
    loaders = [lambda: ports.load_hf(str(tmp_path / "hf")), lambda: ports.load(str(tmp_path / "orbax"))]
    if models.available(REAL):
        loaders.append(lambda: ports.load_gguf(models.path(REAL)))
    for load in loaders:
        assert cpu.is_packed(load())
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(cpu.SWITCH, "0")
        for load in loaders:
            assert not cpu.is_packed(load())
