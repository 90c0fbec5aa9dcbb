"""The mutation harness (tests/mutants.py): each mutant replaces what it names, and under each the default tests of
its method fail (slow: one pytest run of the method's files per mutant), so a refactor that makes those tests
hollow is caught."""
import os
import subprocess
import sys

import pytest

import mutants

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.parametrize("name", sorted(mutants.MUTANTS))
def test_each_mutant_replaces_what_it_names_and_undoes_it(name):
    m = mutants.MUTANTS[name]
    owner = m.owner()
    before = owner.__dict__[m.attr]
    undo = mutants.apply(name)
    try:
        assert owner.__dict__[m.attr] is not before
    finally:
        undo()
    assert owner.__dict__[m.attr] is before
    assert all(os.path.exists(os.path.join(os.path.dirname(HERE), f)) for f in m.files)
    with pytest.raises(ValueError, match="unknown mutant"):
        mutants.apply("no-such-mutant")


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(mutants.MUTANTS))
def test_the_default_tests_of_each_method_fail_under_its_mutant(name):
    m = mutants.MUTANTS[name]
    root = os.path.dirname(HERE)
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-m", "not slow", "-p", "no:cacheprovider", "-n", "0",
           *m.files]
    proc = subprocess.run(cmd, cwd=root, env=dict(os.environ, JSPEC_MUTANT=name), capture_output=True, text=True,
                          timeout=1800)
    tail = proc.stdout[-3000:] + proc.stderr[-2000:]
    assert proc.returncode == 1, f"{name} ({m.why}): the tests did not fail\n{tail}"  # 1: tests ran and failed
    assert " failed" in proc.stdout, tail
