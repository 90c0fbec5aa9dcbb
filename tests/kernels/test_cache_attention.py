"""The CPU attention kernel over a KV cache (`ports.cpu.attention`, `ports/cpu/csrc/cache_attention.cc`), as
`ports.layers.attention` and `attention_deferred` run it: a float64 reference, one softmax over two segments, rows
that see nothing, and each row's result independent of the rows beside it."""
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ports import cpu
from ports.cpu import cache_attention as CA
from ports import layers as LY

pytestmark = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                reason="no C++ compiler here: the kernel cannot build and XLA's einsums are used")


def reference(q, k, v, vis, kvh):
    """float64 grouped-query attention; a row that sees nothing gives zeros."""
    B, T, H, D = q.shape
    G = H // kvh
    out = np.zeros((B, T, H, D))
    for b in range(B):
        for t in range(T):
            if not vis[b, t].any():
                continue
            for h in range(H):
                n = b * kvh + h // G
                s = np.where(vis[b, t], k[n].astype(np.float64) @ q[b, t, h] / np.sqrt(D), -np.inf)
                p = np.exp(s - s.max())
                out[b, t, h] = (p / p.sum()) @ v[n]
    return out


def operands(B, T, H, KVH, D, S, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, T, H, D)).astype(np.float32)
    k = rng.standard_normal((B * KVH, S, D)).astype(np.float32)
    v = rng.standard_normal((B * KVH, S, D)).astype(np.float32)
    vis = rng.random((B, T, S)) < 0.6
    return q, k, v, vis


@pytest.mark.parametrize("B,T,H,KVH,D,S", [(1, 1, 9, 3, 64, 1000), (2, 4, 6, 2, 64, 300), (3, 5, 4, 4, 16, 37),
                                           (1, 7, 8, 1, 128, 530)])
def test_matches_float64_reference(B, T, H, KVH, D, S):
    """Slot counts off the 16-slot groups and the 256-slot work units, G from 1 to 8, D from 16 to 128."""
    q, k, v, vis = operands(B, T, H, KVH, D, S)
    vis[-1, -1] = False  # a row that sees nothing
    f = jax.jit(LY.attention)
    assert "jspec_cache_attention" in f.lower(q, k, v, vis).as_text()
    y = np.asarray(f(q, k, v, vis))
    np.testing.assert_allclose(y, reference(q, k, v, vis, KVH), atol=2e-6, rtol=1e-5)
    assert not y[-1, -1].any()


def test_a_deferred_block_shares_the_cache_softmax():
    """attention_deferred (two segments: the cache, and new keys / values under a causal mask) equals attention over
    the two concatenated."""
    B, T, H, KVH, D, S = 2, 4, 6, 2, 64, 300
    q, k, v, vis = operands(B, T, H, KVH, D, S, seed=1)
    rng = np.random.default_rng(2)
    kn = rng.standard_normal((B * KVH, T, D)).astype(np.float32)
    vn = rng.standard_normal((B * KVH, T, D)).astype(np.float32)
    causal = np.tril(np.ones((T, T), bool))[None].repeat(B, 0)
    y = np.asarray(jax.jit(LY.attention_deferred)(q, k, v, kn, vn, LY.Deferred(jnp.asarray(vis),
                                                                               jnp.asarray(causal))))
    ref = reference(q, np.concatenate([k, kn], 1), np.concatenate([v, vn], 1), np.concatenate([vis, causal], -1),
                    KVH)
    np.testing.assert_allclose(y, ref, atol=2e-6, rtol=1e-5)


def test_a_row_does_not_depend_on_its_neighbours():
    """A verify of T tokens attends, row by row, bit for bit as T one-token steps over the same cache do."""
    q, k, v, vis = operands(2, 6, 9, 3, 64, 700, seed=3)
    f = jax.jit(LY.attention)
    full = np.asarray(f(q, k, v, vis))
    for t in range(6):
        np.testing.assert_array_equal(np.asarray(f(q[:, t:t + 1], k, v, vis[:, t:t + 1]))[:, 0], full[:, t])


@pytest.mark.parametrize("T", [4, 11])
def test_a_verify_over_a_cache_equals_its_one_token_steps(T):
    """A verify as the decode loop runs it: the cache's rows see [start, length) of 1,000 slots (whole 256-slot work
    units past the length, and the first 16-slot groups before the start, see nothing), the new tokens see each
    other causally (a second segment), one batch row's last token sees only the new block. T = 4 puts 12 rows in one
    vector's lanes, T = 11 33 rows in two (and one row alone): every row equals its one-token call bit for bit and
    the float64 reference."""
    B, H, KVH, D, S = 2, 9, 3, 64, 1000
    q, k, v, _ = operands(B, T, H, KVH, D, S, seed=12)
    start, length = np.array([37, 0]), np.array([530, 700])
    vis = np.stack([np.broadcast_to((np.arange(S) >= s) & (np.arange(S) < n), (T, S)) for s, n in zip(start, length)])
    vis[1, -1] = False
    rng = np.random.default_rng(13)
    kn = rng.standard_normal((B * KVH, T, D)).astype(np.float32)
    vn = rng.standard_normal((B * KVH, T, D)).astype(np.float32)
    causal = np.tril(np.ones((T, T), bool))[None].repeat(B, 0)
    f = jax.jit(lambda q, vis, new: LY.attention_deferred(q, k, v, kn[:, :q.shape[1]], vn[:, :q.shape[1]],
                                                          LY.Deferred(vis, new)))
    assert "jspec_cache_attention" in f.lower(q, vis, causal).as_text()
    full = np.asarray(f(q, vis, causal))
    ref = reference(q, np.concatenate([k, kn], 1), np.concatenate([v, vn], 1), np.concatenate([vis, causal], -1),
                    KVH)
    np.testing.assert_allclose(full, ref, atol=2e-6, rtol=1e-5)
    for t in range(T):  # token t alone: the cache and the new tokens up to it (the others are invisible)
        new = np.zeros((B, 1, T), bool)
        new[:, 0, :t + 1] = True
        one = np.asarray(jax.jit(lambda q, vis, new: LY.attention_deferred(q, k, v, kn, vn, LY.Deferred(vis, new)))(
            q[:, t:t + 1], vis[:, t:t + 1], new))
        np.testing.assert_array_equal(one[:, 0], full[:, t])


def test_what_the_kernel_does_not_take_stays_with_xla(monkeypatch):
    q, k, v, vis = operands(1, 2, 4, 2, 64, 40)
    qg = jnp.zeros((2, 65, 64), jnp.float32)
    assert CA.attention_applies(qg[:, :64], jnp.asarray(k), jnp.asarray(v))
    assert CA.attention_applies(qg, jnp.asarray(k), jnp.asarray(v))  # many rows: the long-query kernel
    assert not CA.attention_applies(qg, *(jnp.asarray(a) for a in (k, v, k, v)))  # many rows, two segments
    assert not CA.attention_applies(qg[:, :4, :24], jnp.asarray(k[..., :24]), jnp.asarray(v[..., :24]))
    assert not CA.attention_applies(qg[:, :4].astype(jnp.bfloat16), jnp.asarray(k), jnp.asarray(v))
    monkeypatch.setenv(cpu.SWITCH, "0")
    assert not CA.attention_applies(qg[:, :4], jnp.asarray(k), jnp.asarray(v))
    assert "jspec_cache_attention" not in jax.jit(LY.attention).lower(q, k, v, vis).as_text()
    # attention scores for SpecVLM's pruning are XLA's
    monkeypatch.setenv(cpu.SWITCH, "1")
    txt = jax.jit(LY.attention).lower(q, k, v, vis, jnp.ones((1, 2), jnp.float32)).as_text()
    assert "jspec_cache_attention" not in txt


def test_gradients_are_the_reference_attentions():
    """Training runs through the kernel (the zoo's and the heads' trainers attend over caches): its gradients are
    those of the same attention in XLA einsums."""
    q, k, v, vis = operands(2, 3, 6, 2, 16, 40, seed=4)
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    _, _, qg = LY._group_queries(q, k.shape[0])
    w = jnp.asarray(np.random.default_rng(5).standard_normal(qg.shape).astype(np.float32))

    def loss(fn):
        return lambda q, k, v: jnp.sum(jnp.sin(fn(q, k, v)) * w)

    ours = jax.grad(loss(lambda q, k, v: CA.attention(q, [(k, v, vis)], 0.25)), (0, 1, 2))(qg, k, v)
    ref = jax.grad(loss(lambda q, k, v: CA.attention_reference(q, (k,), (v,), (jnp.asarray(vis),), 0.25)),
                   (0, 1, 2))(qg, k, v)
    for a, b in zip(ours, ref):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(CA.attention(qg, [(k, v, vis)], 0.25),
                               CA.attention_reference(qg, (k,), (v,), (jnp.asarray(vis),), 0.25), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("B,T,H,KVH,D,S,causal", [(1, 40, 9, 3, 64, 40, True), (2, 30, 6, 2, 32, 75, False),
                                                  (1, 70, 4, 1, 128, 70, True), (2, 23, 8, 2, 16, 23, True)])
def test_many_query_rows_match_float64_reference(B, T, H, KVH, D, S, causal):
    """More than 64 query rows per cache row (a prefill) go to the long-query kernel: causal prompts with a padded
    start, and an arbitrary mask (blocks with holes), rows off the 16-row blocks, a row that sees nothing."""
    q, k, v, vis = operands(B, T, H, KVH, D, S, seed=7)
    if causal:
        t, j = np.arange(T)[:, None], np.arange(S)[None]
        vis = np.stack([(j <= t) & (j >= start) for start in (0, 3)[:B]])
    vis[-1, -1] = False
    f = jax.jit(LY.attention)
    assert "jspec_long_attention" in f.lower(q, k, v, vis).as_text()
    y = np.asarray(f(q, k, v, vis))
    np.testing.assert_allclose(y, reference(q, k, v, vis, KVH), atol=3e-6, rtol=1e-5)
    assert not y[-1, -1].any()


def test_a_prefill_row_does_not_depend_on_its_neighbours():
    """The long-query kernel's rows sum in an order set by the slots alone: a prompt's first 50 positions attend
    bit for bit as a 50-token prompt's do, though the two group their rows into other 16-row blocks."""
    q, k, v, _ = operands(1, 90, 9, 3, 64, 90, seed=8)
    causal = np.tril(np.ones((90, 90), bool))[None]
    f = jax.jit(LY.attention)
    full = np.asarray(f(q, k, v, causal))
    part = np.asarray(f(q[:, :50], k[:, :50], v[:, :50], causal[:, :50, :50]))
    np.testing.assert_array_equal(part, full[:, :50])


def test_a_fresh_prefill_attends_through_the_long_kernel():
    """write_and_attend on an empty cache: the short path (a [B, T, T] mask) and the structural causal one (long
    prompts) both run the kernel and give the float64 reference; the gradients are the einsum reference's."""
    B, T, H, KVH, D, S = 2, 40, 6, 2, 32, 64
    q, k, v, _ = operands(B, T, H, KVH, D, S, seed=9)
    kn = np.random.default_rng(10).standard_normal((B, T, KVH, D)).astype(np.float32)
    vn = np.random.default_rng(11).standard_normal((B, T, KVH, D)).astype(np.float32)
    start = jnp.asarray([0, 5])
    t, j = np.arange(T)[:, None], np.arange(T)[None]
    vis = np.stack([(j <= t) & (j >= s) for s in (0, 5)])
    want = reference(q, LY.kv_rows(jnp.asarray(kn)), LY.kv_rows(jnp.asarray(vn)), vis, KVH)
    kb = jnp.zeros((B * KVH, S, D), jnp.float32)
    for visible in (jnp.asarray(np.pad(vis, ((0, 0), (0, 0), (0, S - T)))), LY.Causal(start)):
        f = jax.jit(lambda q, k, v: LY.write_and_attend(q, k, v, kb, kb, jnp.zeros((B,), jnp.int32), visible,
                                                        fresh=True))
        assert "jspec_long_attention" in f.lower(q, kn, vn).as_text()
        y, k_buf, _ = f(q, kn, vn)
        y = np.array(y)
        y[1, :5] = 0  # rows before their start see nothing (the structural path leaves them undefined)
        np.testing.assert_allclose(y, np.where(vis.any(-1)[..., None, None], want, 0), atol=3e-6, rtol=1e-5)
        np.testing.assert_array_equal(np.asarray(k_buf)[:, :T], np.asarray(LY.kv_rows(jnp.asarray(kn))))
    vis_j = jnp.asarray(vis)
    ours = jax.grad(lambda q: jnp.sum(jnp.sin(CA.attention(q, [(LY.kv_rows(jnp.asarray(kn)),
                                                                 LY.kv_rows(jnp.asarray(vn)), vis_j)], 0.3))))(
        jnp.asarray(q))
    ref = jax.grad(lambda q: jnp.sum(jnp.sin(CA._ungroup(CA.attention_reference(
        CA._group(q, KVH), (LY.kv_rows(jnp.asarray(kn)),), (LY.kv_rows(jnp.asarray(vn)),), (vis_j,), 0.3),
        q.shape))))(jnp.asarray(q))
    np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-6)


def test_the_kernel_and_xla_agree_on_rows_that_see_nothing(monkeypatch):
    """A query row that sees no slot gets zeros from both (XLA's softmax over all-masked scores gave a uniform mix of
    the values), through `attention` and `attention_deferred`; the other rows agree to rounding."""
    q, k, v, vis = operands(2, 3, 4, 2, 64, 50, seed=5)
    vis[0, 1] = False
    vis[1, 2] = False
    new = np.zeros((2, 3, 3), bool)
    kn, vn = k[:, :3].copy(), v[:, :3].copy()
    deferred = lambda q: LY.attention_deferred(q, k, v, kn, vn, LY.Deferred(vis, new))  # noqa: E731
    kernel = [np.asarray(jax.jit(lambda q: LY.attention(q, k, v, vis))(q)), np.asarray(jax.jit(deferred)(q))]
    monkeypatch.setenv(cpu.SWITCH, "0")
    xla = [np.asarray(jax.jit(lambda q: LY.attention(q, k, v, vis))(q)), np.asarray(jax.jit(deferred)(q))]
    for a, b in zip(kernel, xla):
        assert not a[0, 1].any() and not a[1, 2].any() and not b[0, 1].any() and not b[1, 2].any()
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=2e-6)
        assert np.abs(b[0, 0]).max() > 0.1  # the rows that see something are not zero
