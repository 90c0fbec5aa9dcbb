"""bf16 weights on the CPU: weight products accumulate in float32 and a one-row product runs as two
(`ports.core.layers.weight_dot`); the rows do not depend on each other, and speculative decoding keeps AR's tokens."""
import jax
import jax.numpy as jnp
import numpy as np

import jspec
import ports
from ports.core import layers as LY
from tiny_pairs import PROMPTS, tiny_pair


def _bf16(model):
    return ports.Model(model.config, jax.tree.map(lambda a: a.astype(jnp.bfloat16), model.params), model.hf_config)


def _cpu_flags() -> set:
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


# XLA:CPU's bf16 products of 2 and 3 rows sum each row alike on AVX2 and AVX-512 (BF16 included: AMD Zen 4); on a
# Xeon with AMX (oneDNN's tiles) 7 of 48 sums differed in the last bit, so there only the tolerance holds
ROWS_ALIKE = "amx_bf16" not in _cpu_flags()


def test_a_one_row_product_equals_its_row_in_a_batch_and_the_f32_product():
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((64, 48)), jnp.bfloat16)
    xs = jnp.asarray(rng.standard_normal((3, 1, 64)), jnp.bfloat16)
    batch = LY.weight_dot("btd,dn->btn", xs, w, jnp.float32)
    for i in range(3):
        one = LY.weight_dot("btd,dn->btn", xs[i:i + 1], w, jnp.float32)
        assert one.shape == (1, 1, 48) and one.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(one[0]), np.asarray(batch[i]), rtol=1e-6, atol=1e-5)
        if ROWS_ALIKE:
            np.testing.assert_array_equal(np.asarray(one[0]), np.asarray(batch[i]))
    ref = np.asarray(xs, np.float32) @ np.asarray(w, np.float32)  # the same bf16 inputs, exact f32 products
    np.testing.assert_allclose(np.asarray(batch), ref, rtol=1e-5, atol=1e-4)  # accumulated in float32
    assert LY.linear(xs[:1], w).dtype == jnp.bfloat16  # a bf16 layer hands bf16 on, as HF's does
    tied = LY.weight_dot("btd,vd->btv", xs[:1], w.T, jnp.float32)  # the LM head against a [V, D] table
    np.testing.assert_allclose(np.asarray(tied[0]), np.asarray(batch[0]), rtol=1e-6, atol=1e-5)
    if ROWS_ALIKE:
        np.testing.assert_array_equal(np.asarray(tied[0]), np.asarray(batch[0]))


def test_bf16_model_decodes_near_f32_and_speculation_keeps_its_tokens():
    target, draft = tiny_pair()
    t16, d16 = _bf16(target), _bf16(draft)
    ids = np.asarray(PROMPTS[1])[None]
    lf, lb = ports.logits(target, ids), ports.logits(t16, ids)
    scale = np.abs(lf).max()
    assert np.abs(lb - lf).max() < 0.05 * scale  # bf16 weights and activations: a few bf16 ulps of the logits
    ar = jspec.decode(t16, PROMPTS, max_new_tokens=16, eos_token_id=())
    for strat in (jspec.Chain(d16, gamma=4), jspec.Tree(d16, tree="mc_sim_7b_63")):
        out = jspec.decode(t16, PROMPTS, strat, max_new_tokens=16, eos_token_id=())
        np.testing.assert_array_equal(out.tokens, ar.tokens)
