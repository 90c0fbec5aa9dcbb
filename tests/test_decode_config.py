"""`jspec.DecodeConfig`: decode's keywords as one object, declared once. `decode`'s keywords are its fields (its
signature is made from them), `start` takes the object (or the keywords, not both), and the numbers that need no
target are refused when it is made."""
import dataclasses
import inspect

import numpy as np
import pytest

import jspec
from jspec import api
from tiny_pairs import PROMPTS, tiny_pair


def test_start_with_a_config_decodes_what_decode_does():
    target, draft = tiny_pair()
    cfg = jspec.DecodeConfig(max_new_tokens=9, eos_token_id=(), pad_prompt_to=32)
    strategy = jspec.Chain(draft, gamma=3)
    state = jspec.start(target, PROMPTS, strategy, cfg).run()
    out = jspec.decode(target, PROMPTS, strategy, max_new_tokens=9, eos_token_id=(), pad_prompt_to=32)
    np.testing.assert_array_equal(np.asarray(state.out)[:, :9], out.tokens)
    kw = api.start(target, PROMPTS, strategy, max_new_tokens=9, eos_token_id=(), pad_prompt_to=32)
    assert kw.ctx == api.start(target, PROMPTS, strategy, cfg).ctx  # the same static context, so the same programs
    with pytest.raises(ValueError, match="not both"):
        jspec.start(target, PROMPTS, strategy, cfg, max_new_tokens=4)


@pytest.mark.parametrize("bad,match", [(dict(max_new_tokens=0), "max_new_tokens must be >= 1"),
                                       (dict(pad_prompt_to=0), "pad_prompt_to must be a positive integer"),
                                       (dict(prefill_chunk=-3), "prefill_chunk must be a positive number"),
                                       (dict(profile="yes"), "profile must be")])
def test_bad_settings_are_named_when_the_config_is_made(bad, match):
    with pytest.raises(ValueError, match=match):
        jspec.DecodeConfig(**bad)
    with pytest.raises(ValueError, match=match):  # and through decode's keywords, before any compute
        jspec.decode(None, PROMPTS, **bad)


def test_decodes_keywords_are_the_configs_fields_declared_once():
    fields = [f.name for f in dataclasses.fields(jspec.DecodeConfig)]
    params = inspect.signature(jspec.decode).parameters
    assert list(params) == ["target", "prompt", "strategy"] + fields
    assert {n: params[n].default for n in fields} == {f.name: f.default for f in dataclasses.fields(jspec.DecodeConfig)}
    source = inspect.getsource(api.decode)
    assert "max_cache_len" not in source.split('"""')[0] + source.split('"""')[2]  # no setting written out again
    with pytest.raises(TypeError, match=r"unknown keyword\(s\) \['max_new'\].*max_new_tokens"):
        jspec.decode(None, PROMPTS, max_new=3)
    assert jspec.DecodeConfig().loop_ahead and not jspec.DecodeConfig(profile=True).loop_ahead
    assert jspec.DecodeConfig(profile=True, compile_loop=True).loop_ahead
