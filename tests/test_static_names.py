"""Every name a function reads as a global is bound at its module's top level or is a builtin.

A static check over jspec/, ports/, scripts/ and tests/ (nothing is imported): it catches a helper moved away from
the import it needed, which otherwise shows only when that code path runs (a training script's rarely used phase,
say). Names bound by `from m import *` cannot be known statically; no module here uses it.
"""
from __future__ import annotations

import ast
import builtins
import dis
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FILES = sorted(p for d in ("jspec", "ports", "scripts", "tests") for p in (ROOT / d).rglob("*.py"))
MODULE_DUNDERS = {"__file__", "__name__", "__doc__", "__spec__", "__package__", "__loader__", "__path__",
                  "__builtins__", "__cached__", "__annotations__", "__dict__"}


def module_bindings(tree: ast.Module) -> set[str]:
    """Names bound at module level (statements nested in if / try / with / for / while blocks included, function
    and class bodies not), plus names a function declares `global` and assigns."""
    names: set[str] = set()

    def targets(node):
        for n in ast.walk(node):
            if isinstance(n, ast.Name):
                names.add(n.id)

    def top(stmts):
        for s in stmts:
            if isinstance(s, (ast.Import, ast.ImportFrom)):
                for a in s.names:
                    names.add(a.asname or a.name.split(".")[0])
            elif isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(s.name)
            elif isinstance(s, ast.Assign):
                for t in s.targets:
                    targets(t)
            elif isinstance(s, (ast.AnnAssign, ast.AugAssign)):
                targets(s.target)
            elif isinstance(s, (ast.For, ast.AsyncFor)):
                targets(s.target)
            elif isinstance(s, (ast.With, ast.AsyncWith)):
                for item in s.items:
                    if item.optional_vars is not None:
                        targets(item.optional_vars)
            elif isinstance(s, ast.Try) or type(s).__name__ == "TryStar":
                for h in s.handlers:
                    if h.name:
                        names.add(h.name)
            for field in ("body", "orelse", "finalbody"):
                if not isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    top(getattr(s, field, []) or [])
            for h in getattr(s, "handlers", []):
                top(h.body)
    top(tree.body)
    for n in ast.walk(tree):
        if isinstance(n, ast.Global):
            names.update(n.names)
        elif isinstance(n, ast.NamedExpr):
            names.add(n.target.id)
    return names


def global_reads(code: types.CodeType):
    """(name, line) of every LOAD_GLOBAL in `code`'s functions, nested ones included (module-level code excluded:
    it runs on import)."""
    stack = [c for c in code.co_consts if isinstance(c, types.CodeType)]
    while stack:
        c = stack.pop()
        line = c.co_firstlineno
        for ins in dis.get_instructions(c):
            if ins.starts_line:
                line = ins.starts_line
            if ins.opname == "LOAD_GLOBAL":
                yield ins.argval, line
        stack.extend(k for k in c.co_consts if isinstance(k, types.CodeType))


def unbound_reads(path: Path) -> list[tuple[str, int]]:
    """(name, line) of each global read in `path`'s functions that nothing binds."""
    src = path.read_text()
    known = module_bindings(ast.parse(src, str(path))) | set(dir(builtins)) | MODULE_DUNDERS
    code = compile(src, str(path), "exec", dont_inherit=True)
    return sorted({(name, line) for name, line in global_reads(code) if name not in known})


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_globals_read_are_bound(path):
    assert not unbound_reads(path), [f"{path.relative_to(ROOT)}:{line}: {name}" for name, line in unbound_reads(path)]


def test_the_check_finds_a_missing_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import os\n\ndef f():\n    from json import dumps\n    return dumps(os.sep)\n\n"
                   "def g():\n    return dumps(1)\n")
    assert unbound_reads(bad) == [("dumps", 8)]
