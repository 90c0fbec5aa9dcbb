"""The CPU kernels' tests: here the kernels are switched on (the rest of the suite runs XLA's ops, as GPU and TPU
users do; `tests/conftest.py`). Programs traced with the switch off are dropped first, so none is reused here."""
import jax
import pytest

from ports import cpu


@pytest.fixture(autouse=True, scope="module")
def _kernels_on():
    if not cpu.available():
        pytest.skip("the CPU kernel library cannot be built here (no C++ compiler)")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(cpu.SWITCH, "1")
        jax.clear_caches()
        yield
    jax.clear_caches()
