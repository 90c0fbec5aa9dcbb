"""Provenance (jspec.core.provenance): what it records, and that a cost table's cache key tells two CPU models
apart. The benches, cost tables and training runs are read back for it in tests/test_bench.py, tests/test_guard.py
and tests/test_train.py."""
import json

import numpy as np

import jspec
from jspec.engine import costs
from jspec.core import provenance as PV
from provenance_check import assert_provenance
from tiny_pairs import tiny_pair


def test_provenance_names_the_machine_versions_switches_and_commit(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_max_isa=AVX2")
    monkeypatch.setenv("JSPEC_SOMETHING", "1")
    monkeypatch.setenv("UNRELATED_VARIABLE", "x")
    p = PV.provenance()
    assert_provenance(p)
    assert p["env"]["XLA_FLAGS"] == "--xla_cpu_max_isa=AVX2" and p["env"]["JSPEC_SOMETHING"] == "1"
    assert "UNRELATED_VARIABLE" not in p["env"]
    assert json.loads(json.dumps(p)) == p  # JSON-ready


def test_cost_table_keys_differ_between_cpu_models_and_xla_flags(monkeypatch):
    target, draft = tiny_pair()
    parts = jspec.Chain(draft, gamma=2).parts()
    key = costs.table_key(target, parts, 2, 12)
    assert costs.table_key(target, parts, 2, 12) == key
    monkeypatch.setattr(PV, "device_model", lambda: "cpu: another CPU [avx2]")
    other = costs.table_key(target, parts, 2, 12)
    assert other != key
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_max_isa=SSE4_2")
    assert costs.table_key(target, parts, 2, 12) not in (key, other)
    assert costs.table_key(target, parts, 3, 12) != costs.table_key(target, parts, 2, 12)
    np.testing.assert_equal(costs.probe_prompt(97, 12, 2), costs.probe_prompt(97, 12, 2))
