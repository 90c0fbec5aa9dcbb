"""The packages' layering: `ports` (models, their KV cache and prompt handling) imports nothing of `jspec`;
`import jspec` loads the engine, not the zoo, training, benchmarks, demo or memory planner; module-level imports
form no cycle; no module imports another's private name."""
import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOOLS = ("jspec.zoo", "jspec.train", "jspec.bench", "jspec.bench_gpu", "jspec.bench_long", "jspec.bench_specbench",
         "jspec.demo", "jspec.memory", "jspec.methods.eagle_train", "jspec.methods.eesd_train",
         "jspec.methods.cali_train")


def loaded_after(statement: str) -> list[str]:
    code = f"import sys; {statement}; print(' '.join(sorted(m for m in sys.modules if m.split('.')[0] in " \
           "('jspec', 'ports'))))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    return out.stdout.split()


def test_ports_imports_nothing_of_jspec():
    mods = loaded_after("import ports")
    assert "ports.llama" in mods
    assert [m for m in mods if m.split(".")[0] == "jspec"] == []


def test_import_jspec_loads_the_engine_only():
    mods = loaded_after("import jspec")
    assert "jspec.speculative" in mods
    assert [m for m in mods if any(m == t or m.startswith(t + ".") for t in TOOLS)] == []


def modules() -> dict[str, Path]:
    out = {}
    for pkg in ("jspec", "ports"):
        for p in (ROOT / pkg).rglob("*.py"):
            name = ".".join(p.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = p
    return out


def imports(mods: dict[str, Path]) -> tuple[dict[str, set], list]:
    """(module -> the modules its module-level statements import, [(module, source, private name)] anywhere)."""
    def known(name):
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph, private = {}, []
    for m, path in mods.items():
        tree = ast.parse(path.read_text())
        top = {id(n) for stmt in tree.body if not isinstance(stmt, (ast.FunctionDef, ast.ClassDef))
               for n in ast.walk(stmt)}
        deps = set()
        for n in ast.walk(tree):
            if isinstance(n, ast.ImportFrom) and n.module:
                base = n.module
                if n.level:
                    pkg = m if path.name == "__init__.py" else m.rpartition(".")[0]
                    base = pkg.rsplit(".", n.level - 1)[0] + "." + n.module if n.level > 1 else pkg + "." + n.module
                targets = [known(f"{base}.{a.name}") or known(base) for a in n.names]
                private += [(m, base, a.name) for a in n.names if a.name.startswith("_") and known(base) != m]
            elif isinstance(n, ast.Import):
                targets = [known(a.name) for a in n.names]
            else:
                continue
            if id(n) in top:
                deps |= {t for t in targets if t and t != m}
        for t in list(deps):  # importing a.b.c runs a and a.b first
            parts = t.split(".")
            deps |= {".".join(parts[:i]) for i in range(1, len(parts)) if not m.startswith(".".join(parts[:i]))}
        graph[m] = deps & set(mods)
    return graph, private


def cycles(graph: dict[str, set]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles_and_no_private_imports():
    graph, private = imports(modules())
    assert "ports.cache" in graph["ports.llama"] and "jspec.plans" in graph["jspec.strategy"]
    assert cycles(graph) == []
    assert private == []


def test_the_cycle_check_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
