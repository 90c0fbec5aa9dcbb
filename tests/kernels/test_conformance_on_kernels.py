"""One pass of the conformance suite's first invariant with the CPU kernels on: greedy == AR on a ragged batch, each
row as if alone (`tests/test_conformance.py` runs it, and the rest, on XLA's ops). One strategy per kind of program
the kernels serve: a draft model's chain (few-row products, chain commits) and static tree (path commits), a dynamic
tree, EAGLE-3's fused-feature head, EESD's shared layers, prompt lookup (no draft model), SAGE's packed verify;
`JSPEC_CPU_KERNELS=1 pytest tests/test_conformance.py` runs every entry."""
import pytest

import test_conformance
from test_conformance import _free_programs_per_test, pair  # noqa: F401

KINDS = ["chain", "tree", "dynamic", "eagle3_chain", "eesd_beta", "prompt_lookup", "sage"]


@pytest.mark.parametrize("name", KINDS)
def test_greedy_equals_ar_and_rows_are_independent(pair, name):  # noqa: F811
    assert name in test_conformance.REGISTRY
    test_conformance.test_greedy_equals_ar_and_rows_are_independent(pair, name)
