"""One pass of the conformance suite's first invariant with the CPU kernels on: greedy == AR on a ragged batch, each
row as if alone, for every registered strategy (`tests/test_conformance.py` runs it, and the rest, on XLA's ops)."""
from test_conformance import _free_programs_per_test, pair, test_greedy_equals_ar_and_rows_are_independent  # noqa: F401
