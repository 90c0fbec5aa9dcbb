"""The packages' layering, as rules over directories: `ports` imports nothing of `jspec`; nothing under
`jspec/engine` or `jspec/parts` (nor `jspec/api.py`) imports `jspec/methods` or `jspec/tools`, and no method imports
a tool; `import jspec` loads nothing under `jspec/tools`; no module of the packages names `scripts/` or `tests/`
(what a tool needs ships inside the package); at most 8 modules sit directly in `jspec/`; module-level imports
form no cycle; no module imports another's private name; the packages hold no native (C / C++ / CUDA) source:
XLA's ops are the one path on every device."""
import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
UPPER = {"jspec.engine": ("jspec.methods", "jspec.tools"), "jspec.parts": ("jspec.methods", "jspec.tools"),
         "jspec.api": ("jspec.methods", "jspec.tools"), "jspec.methods": ("jspec.tools",), "ports": ("jspec",)}


def under(name: str, pkg: str) -> bool:
    return name == pkg or name.startswith(pkg + ".")


def loaded_after(statement: str) -> list[str]:
    code = f"import sys; {statement}; print(' '.join(sorted(m for m in sys.modules if m.split('.')[0] in " \
           "('jspec', 'ports'))))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    return out.stdout.split()


def test_ports_imports_nothing_of_jspec():
    mods = loaded_after("import ports")
    assert "ports.llama" in mods
    assert [m for m in mods if m.split(".")[0] == "jspec"] == []


def test_import_jspec_loads_no_tool():
    mods = loaded_after("import jspec")
    assert "jspec.engine.step" in mods and "jspec.methods.eesd" in mods
    assert [m for m in mods if under(m, "jspec.tools")] == []
    assert "jspec.tools.models" in loaded_after("import jspec; jspec.models.entry")  # loads on first use


def test_at_most_eight_modules_directly_in_jspec():
    top = sorted(p.name for p in (ROOT / "jspec").glob("*.py"))
    assert len(top) <= 8, top


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


def all_imports(mods: dict[str, Path]) -> dict[str, set]:
    """module -> every module of the packages it imports, at module level or inside a function."""
    out = {}
    for m, path in mods.items():
        deps = set()
        for n in ast.walk(ast.parse(path.read_text())):
            if isinstance(n, ast.ImportFrom) and n.module and not n.level:
                deps |= {n.module} | {f"{n.module}.{a.name}" for a in n.names}
            elif isinstance(n, ast.Import):
                deps |= {a.name for a in n.names}
        out[m] = {d for d in deps if d.split(".")[0] in ("jspec", "ports")}
    return out


def layer_violations(graph: dict[str, set]) -> list[tuple[str, str]]:
    return sorted((m, d) for m, deps in graph.items() for d in deps for low, high in UPPER.items()
                  if under(m, low) and any(under(d, h) for h in high))


def test_lower_layers_import_no_higher_one():
    graph = all_imports(modules())
    assert "jspec.tools.train.trainer" in graph["jspec.tools.train.layer_skip"]
    assert layer_violations(graph) == []


def test_the_layer_rule_finds_an_engine_importing_a_tool():
    graph = {"jspec.engine.loop": {"jspec.tools.zoo"}, "jspec.parts.plans": {"jspec.methods.sage"},
             "jspec.tools.demo": {"jspec.engine.loop"}, "ports.llama": {"jspec.api"}}
    assert layer_violations(graph) == [("jspec.engine.loop", "jspec.tools.zoo"),
                                       ("jspec.parts.plans", "jspec.methods.sage"), ("ports.llama", "jspec.api")]


def checkout_paths(path: Path) -> list[str]:
    """String constants in a module's code (docstrings aside) that name the checkout's scripts/ or tests/."""
    tree = ast.parse(path.read_text())
    docs = {id(b.body[0].value) for b in ast.walk(tree)
            if isinstance(b, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)) and b.body
            and isinstance(b.body[0], ast.Expr) and isinstance(b.body[0].value, ast.Constant)}
    return [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
            and id(n) not in docs and (n.value in ("scripts", "tests") or n.value.startswith(("scripts/", "tests/")))]


def test_no_module_reads_scripts_or_tests():
    found = {m: c for m, p in modules().items() if (c := checkout_paths(p))}
    assert found == {}


def test_no_import_cycles_and_no_private_imports():
    graph, private = imports(modules())
    assert "ports.cache" in graph["ports.llama"] and "jspec.parts.plans" in graph["jspec.engine.strategy"]
    assert cycles(graph) == []
    assert private == []


def test_the_cycle_check_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_class_name_is_defined_twice_in_jspec():
    where: dict[str, list[str]] = {}
    for m, path in modules().items():
        if m.split(".")[0] == "jspec":
            for n in ast.walk(ast.parse(path.read_text())):
                if isinstance(n, ast.ClassDef):
                    where.setdefault(n.name, []).append(m)
    assert {name: ms for name, ms in where.items() if len(ms) > 1} == {}


NATIVE = (".c", ".cc", ".cpp", ".cxx", ".h", ".hh", ".hpp", ".cu", ".cuh")


def test_no_native_code():
    """No C / C++ / CUDA source in the packages, scripts or tests: nothing is compiled at import or first use."""
    found = [str(p.relative_to(ROOT)) for d in ("jspec", "ports", "scripts", "tests") for p in (ROOT / d).rglob("*")
             if p.suffix in NATIVE]
    assert found == []
