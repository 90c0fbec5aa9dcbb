"""`jspec.DecodeConfig`: decode's keywords as one object. `decode` keeps its keywords, `start` takes the object (or
the keywords, not both), and the numbers that need no target are refused when it is made."""
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
