"""`ports.cpu.dot`: the few-row float32 kernel behind XLA's FFI, and weight_dot's routing to it (`ports.cpu.product`)."""
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ports import cpu
from ports.cpu import dot as CD
from ports import layers as LY

pytestmark = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                reason="no C++ compiler here: the kernel cannot build and XLA's dot is used")


def test_the_kernel_builds_where_a_compiler_is(monkeypatch):
    assert cpu.available()
    assert cpu.enabled()
    monkeypatch.setenv(cpu.SWITCH, "0")
    assert not cpu.enabled() and cpu.available()


def _ref(x, w, nk):
    return np.asarray(x, np.float64) @ (np.asarray(w, np.float64).T if nk else np.asarray(w, np.float64))


@pytest.mark.parametrize("nk", [False, True])
@pytest.mark.parametrize("m,k,n", [(1, 64, 96), (3, 37, 45), (7, 576, 300), (12, 130, 17), (13, 48, 256),
                                   (16, 200, 1030)])
def test_matches_float64_reference(nk, m, k, n):
    """Every shape class: vector and scalar column tails, contracted lengths off the SIMD width and the unroll,
    row counts across the register groups."""
    rng = np.random.default_rng(m * 1000 + k + n)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((n, k) if nk else (k, n)).astype(np.float32)
    y = np.asarray(jax.jit(CD.dot, static_argnums=2)(jnp.asarray(x), jnp.asarray(w), nk))
    ref = _ref(x, w, nk)
    bound = 4 * k * np.finfo(np.float32).eps * (np.abs(x) @ np.abs(w.T if nk else w))
    assert y.shape == (m, n)
    assert np.all(np.abs(y - ref) <= bound + 1e-30)


@pytest.mark.parametrize("nk", [False, True])
def test_a_row_does_not_depend_on_its_neighbours(nk):
    """Each row of a 16-row call equals the same row computed alone and in a 5-row call, bit for bit."""
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((16, 576)).astype(np.float32))
    w = jnp.asarray(rng.standard_normal((1000, 576) if nk else (576, 1000)).astype(np.float32))
    f = jax.jit(CD.dot, static_argnums=2)
    full = np.asarray(f(x, w, nk))
    for i in (0, 7, 15):
        np.testing.assert_array_equal(np.asarray(f(x[i:i + 1], w, nk))[0], full[i])
    np.testing.assert_array_equal(np.asarray(f(x[3:8], w, nk)), full[3:8])


def test_bad_operands_are_named():
    x = jnp.ones((2, 8), jnp.float32)
    with pytest.raises(ValueError, match="do not contract"):
        CD.dot(x, jnp.ones((9, 4), jnp.float32))
    with pytest.raises(ValueError, match="at most 16 rows"):
        CD.dot(jnp.ones((17, 8), jnp.float32), jnp.ones((8, 4), jnp.float32))
    with pytest.raises(ValueError, match="float32"):
        CD.dot(x.astype(jnp.bfloat16), jnp.ones((8, 4), jnp.bfloat16))


def test_gradients_and_vmap():
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((3, 40)).astype(np.float32))
    w = jnp.asarray(rng.standard_normal((40, 24)).astype(np.float32))
    loss = lambda x, w: jnp.sum(jnp.sin(CD.dot(x, w)))  # noqa: E731
    loss_ref = lambda x, w: jnp.sum(jnp.sin(x @ w))  # noqa: E731
    for a, b in zip(jax.grad(loss, (0, 1))(x, w), jax.grad(loss_ref, (0, 1))(x, w)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    xs = jnp.stack([x, 2 * x])
    np.testing.assert_allclose(jax.vmap(CD.dot, (0, None))(xs, w), jnp.einsum("bmk,kn->bmn", xs, w), rtol=1e-5,
                               atol=1e-5)


def _uses_kernel(fn, *args) -> bool:
    return CD.TARGET in jax.jit(fn).lower(*args).as_text()


@pytest.mark.parametrize("spec,xs,ws,nk", [
    ("...d,dn->...n", (1, 3, 32), (32, 48), False),
    ("...d,dif->...if", (2, 4, 32), (32, 2, 40), False),
    ("btd,dkgh->btkgh", (2, 3, 32), (32, 2, 3, 8), False),
    ("btd,vd->btv", (1, 1, 32), (100, 32), True),
    ("btd,dv->btv", (4, 4, 32), (32, 100), False),
])
def test_weight_dot_routes_few_row_products_to_the_kernel(spec, xs, ws, nk):
    """weight_dot's row products of 2..16 rows (1..16 for [N, K] weights) call the kernel and equal the einsum;
    more rows, one row of a [K, N] weight, and bf16 stay with XLA."""
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal(xs).astype(np.float32))
    w = jnp.asarray(rng.standard_normal(ws).astype(np.float32))
    f = lambda x, w: LY.weight_dot(spec, x, w)  # noqa: E731
    assert _uses_kernel(f, x, w)
    np.testing.assert_allclose(f(x, w), jnp.einsum(spec, x, w), rtol=1e-5, atol=1e-5)
    many = jnp.concatenate([x] * (CD.MAX_ROWS // int(np.prod(xs[:-1])) + 1), axis=0)
    assert not _uses_kernel(f, many, w)
    one = x.reshape(-1, xs[-1])[:1].reshape((1,) * (len(xs) - 1) + xs[-1:])
    assert _uses_kernel(f, one, w) == nk
    assert not _uses_kernel(f, x.astype(jnp.bfloat16), w.astype(jnp.bfloat16))


def test_other_einsums_stay_with_xla():
    x = jnp.ones((2, 3, 8), jnp.float32)
    assert cpu._row_product("btd,dn->bnt") is None  # output axes reordered
    assert cpu._row_product("btd,ed->bte") is True
    assert cpu._row_product("btd,dn->btn") is False
    assert cpu._row_product("btd,dd->btd") is None
    assert cpu.product("btd,dn->bnt", x, jnp.ones((8, 5))) is None
