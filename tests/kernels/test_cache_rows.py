"""`ports.cpu.rows`: in-place cache row writes and path moves on XLA:CPU, against the XLA ops they replace."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ports import cache as kvc
from ports import cpu
from ports.cpu import rows as CR

pytestmark = pytest.mark.skipif(not cpu.available(), reason="the CPU kernel library is not available here")


def _xla_write(buf, new, start):  # written out here rather than taken from the module under test
    return jax.vmap(lambda b, n, s: jax.lax.dynamic_update_slice(b, n, (s, 0)))(buf, new.astype(buf.dtype), start)


def _xla_move(buf, src, start):
    return _xla_write(buf, jnp.take_along_axis(buf, src[:, :, None], axis=1), start)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_write_rows_equals_dynamic_update_slice(dtype):
    """Several buffers of different update widths in one call, starts past the end clamped as XLA clamps them."""
    rng = np.random.default_rng(0)
    N, S, D = 6, 20, 16
    bufs = tuple(jnp.asarray(rng.normal(size=(N, S, D)), dtype) for _ in range(3))
    news = tuple(jnp.asarray(rng.normal(size=(N, t, D)), jnp.float32) for t in (1, 5, 3))
    start = jnp.asarray([0, 4, 17, 19, 25, -2], jnp.int32)  # 17, 19, 25: clamped for T > 1; -2 to 0
    got = jax.jit(CR.write_rows)(bufs, news, start)
    for g, b, n in zip(got, bufs, news):
        assert g.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(_xla_write(b, n, start), np.float32))


def test_move_rows_equals_gather_then_write():
    """Sources that overlap the destinations are read before any write; every buffer moves the same slots."""
    rng = np.random.default_rng(1)
    N, S, D = 4, 24, 8
    bufs = tuple(jnp.asarray(rng.normal(size=(N, S, D)), jnp.float32) for _ in range(2))
    start = jnp.asarray([3, 10, 0, 15], jnp.int32)
    src = start[:, None] + jnp.asarray([[0, 2, 1, 5], [1, 2, 3, 4], [4, 0, 2, 1], [2, 2, 6, 3]], jnp.int32)
    got = jax.jit(CR.move_rows)(bufs, src, start)
    for g, b in zip(got, bufs):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(_xla_move(b, src, start)))


def test_writes_in_a_loop_leave_other_slots_alone():
    """In a jitted loop (the buffer carried, as a decode loop carries the cache) each step changes only its slots."""
    N, S, D = 2, 16, 16
    buf = jnp.full((N, S, D), -1.0)

    def step(i, b):
        new = jnp.full((N, 1, D), i, jnp.float32) + jnp.arange(N, dtype=jnp.float32)[:, None, None] * 100
        return CR.write_rows((b,), (new,), jnp.full((N,), i, jnp.int32))[0]

    out = np.asarray(jax.jit(lambda b: jax.lax.fori_loop(0, 10, step, b))(buf))
    want = np.full((N, S, D), -1.0, np.float32)
    for i in range(10):
        want[:, i] = i + np.arange(N)[:, None] * 100
    np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("stacked", [False, True])
def test_the_cache_functions_match_with_the_kernel_switched_off(monkeypatch, stacked):
    """`write_layer`, `write_pending` and `commit_path` give the same cache through the kernel as through XLA, for a
    per-layer cache and a scanned model's stacked one."""
    rng = np.random.default_rng(2)
    B, H, S, D, L, T = 2, 2, 32, 16, 3, 4
    ks = jnp.asarray(rng.normal(size=(L, B * H, S, D)), jnp.float32)
    vs = jnp.asarray(rng.normal(size=(L, B * H, S, D)), jnp.float32)
    cache = kvc.init_cache(L, B, H, S, D, jnp.float32, stacked=stacked)
    cache = cache.replace(k=ks if stacked else list(ks), v=vs if stacked else list(vs),
                          length=jnp.asarray([5, 9], jnp.int32))
    k_new = jnp.asarray(rng.normal(size=(B, H, T, D)), jnp.float32)
    v_new = jnp.asarray(rng.normal(size=(B, H, T, D)), jnp.float32)
    pend = jnp.asarray(rng.normal(size=(2, L, B * H, T, D)), jnp.float32)
    path = jnp.asarray([[0, 2, 3, 1], [1, 3, 0, 2]], jnp.int32)

    def run(c):
        if not stacked:  # a stacked cache's layers are written inside the scan, one slice at a time
            kb, vb = kvc.write_layer(c.k[0], c.v[0], k_new, v_new, c.length)
            c = c.replace(k=[kb] + c.k[1:], v=[vb] + c.v[1:])
        c = kvc.write_pending(c, pend[0] if stacked else list(pend[0]), pend[1] if stacked else list(pend[1]))
        return kvc.commit_path(c, path, jnp.asarray([3, 2], jnp.int32))

    with_kernel = jax.jit(run)(cache)
    monkeypatch.setenv(cpu.SWITCH, "0")
    assert not cpu.enabled()
    without = jax.jit(run)(cache)
    np.testing.assert_array_equal(np.asarray(jnp.stack(list(with_kernel.k))), np.asarray(jnp.stack(list(without.k))))
    np.testing.assert_array_equal(np.asarray(jnp.stack(list(with_kernel.v))), np.asarray(jnp.stack(list(without.v))))
    assert not np.array_equal(np.asarray(jnp.stack(list(without.k))), np.asarray(ks))  # the writes did write
    np.testing.assert_array_equal(np.asarray(with_kernel.length), [8, 11])


def test_tangents_are_the_writes_of_the_tangents():
    """Differentiable: the JVP of a write is the same write of the tangents (the ops are linear)."""
    N, S, D = 2, 8, 16
    buf, new = jnp.ones((N, S, D)), jnp.full((N, 2, D), 3.0)
    start = jnp.asarray([1, 5], jnp.int32)
    f = lambda b, n: CR.write_rows((b,), (n,), start)[0].sum() * 2.0  # noqa: E731
    gb, gn = jax.grad(f, argnums=(0, 1))(buf, new)
    want_b = np.full((N, S, D), 2.0, np.float32)
    want_b[0, 1:3] = want_b[1, 5:7] = 0.0
    np.testing.assert_array_equal(np.asarray(gb), want_b)
    np.testing.assert_array_equal(np.asarray(gn), np.full((N, 2, D), 2.0, np.float32))
