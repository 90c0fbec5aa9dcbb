"""jspec.core.compilation: per-backend XLA options for prefills, and the persistent compilation cache."""
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from jspec import api
from jspec.core import compilation as CJ

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _normed_matmul(x, w):
    return (x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-6)) @ w


def _fusions_with_reduce(hlo: str) -> list[str]:
    """Names of the fused computations that hold both a dot and a reduce."""
    out, name, body = [], None, []
    for line in hlo.splitlines() + [""]:
        if line.startswith("%") or line.startswith("ENTRY") or not line.strip():
            if name and any(" dot(" in b for b in body) and any(" reduce(" in b for b in body):
                out.append(name)
            name, body = (line.split()[0] if line.startswith("%") else None), []
        else:
            body.append(line)
    return out


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the option is XLA:CPU's; this backend is not a CPU")
def test_prefill_option_keeps_the_norms_reduction_out_of_the_matmul():
    x, w = jnp.ones((4096, 64)), jnp.ones((64, 64))  # XLA fuses the two from some 4k rows on (2k: not)
    default = jax.jit(_normed_matmul).lower(x, w).compile().as_text()
    prefill = CJ.jit(_normed_matmul, options=CJ.PREFILL).lower(x, w).compile().as_text()
    assert _fusions_with_reduce(default), "XLA:CPU no longer fuses the norm into the dot: the option may be moot"
    assert not _fusions_with_reduce(prefill)
    np.testing.assert_allclose(CJ.jit(_normed_matmul, options=CJ.PREFILL)(x, w), _normed_matmul(x, w), rtol=1e-6)


def test_backend_jit_compiles_per_backend_and_forwards_the_jitted_functions_attributes():
    calls = []

    @CJ.jit(options={"cpu": {}}, static_argnames=("n",))
    def f(x, n):
        calls.append(n)
        return x * n

    assert f.__name__ == "f" and f.__wrapped__ is not None
    assert float(f(jnp.float32(2), n=3)) == 6.0 and float(f(jnp.float32(4), n=3)) == 12.0
    assert calls == [3] and f._cache_size() == 1  # traced once; `_cache_size` is the jitted function's
    assert isinstance(api._prefill_ar, CJ.BackendJit) and isinstance(api._prefill_sd, CJ.BackendJit)


CHILD = textwrap.dedent("""
    import sys, jax, jax.numpy as jnp
    sys.path.insert(0, {root!r})
    from jspec.core import compilation as CJ
    hits = []
    jax.monitoring.register_event_listener(lambda name, **kw: hits.append(name) if name.endswith("cache_hits") else 0)
    CJ.enable_cache({path!r}, min_compile_s=0)
    f = jax.jit(lambda x: jnp.sin(x) @ x.T + {salt})
    f(jnp.ones((8, 8))).block_until_ready()
    print(len(hits))
""")


def test_enable_cache_lets_a_second_process_load_the_compiled_program(tmp_path):
    path = str(tmp_path / "xla")
    child = CHILD.format(root=ROOT, path=path, salt=float(np.random.default_rng().integers(1 << 20)))
    runs = [subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=300)
            for _ in range(2)]
    for r in runs:
        assert r.returncode == 0, r.stderr[-2000:]
    first, second = (int(r.stdout.split()[-1]) for r in runs)
    assert first == 0 and second >= 1  # the second loads what the first compiled (its `ones` too)
    assert os.listdir(path)


def test_the_cli_enables_the_cache_named_by_the_environment(tmp_path):
    path = str(tmp_path / "cli-cache")
    code = textwrap.dedent(f"""
        import sys, jax
        sys.path.insert(0, {ROOT!r})
        from jspec.tools import cli
        try:
            cli.main(["bench", "long", "--runs", "0"])
        except SystemExit:
            pass
        print(jax.config.jax_compilation_cache_dir)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**os.environ, CJ.CACHE_ENV: path})
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split()[-1] == path and os.path.isdir(path)


def test_the_decode_loop_compiles_once_beside_the_prefill():
    """`start` compiles the loop ahead on a thread (from the prefill's output shapes); the loop's call then finds
    that program: one compile of each, and the tokens of a start without the compile ahead."""
    from tests.tiny_pairs import PROMPTS, tiny_pair

    target, draft = tiny_pair()
    compiles = []

    def listener(name, secs, **kw):
        if name.endswith("backend_compile_duration"):
            compiles.append(kw.get("fun_name"))

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        for strategy, new in ((None, 37), (jspec.Chain(draft, gamma=3), 41)):  # lengths no other test decodes
            compiles.clear()
            r = api.start(target, PROMPTS, strategy, max_new_tokens=new, eos_token_id=())
            assert r.ahead is not None
            tokens = jax.device_get(r.run().out)
            assert r.ahead.error is None
            loop_name = "jit(_decode_ar)" if strategy is None else "jit(_decode_sd)"
            assert compiles.count(loop_name) == 1, compiles
            assert compiles.count(loop_name.replace("decode", "prefill")) == 1, compiles
            plain = api.start(target, PROMPTS, strategy, max_new_tokens=new, eos_token_id=(), compile_loop=False)
            assert plain.ahead is None
            np.testing.assert_array_equal(jax.device_get(plain.run().out), tokens)
            assert compiles.count(loop_name) == 1, compiles  # the second start's loop is the same program
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
