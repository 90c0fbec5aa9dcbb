"""The packages' layering: the stack, bottom to top, is `ports/core` -> `ports/families` -> `ports.model` (the
registry) -> `ports/io` -> `ports` (its public names) -> `jspec/core` -> `jspec/parts` -> `jspec/engine` ->
`jspec/strategies` -> the modules directly in `jspec/` (the api: `api`, `costs`, `images`, `streaming`) ->
`jspec/tools`. Every import statement of the packages, those inside functions included, goes to its own layer or
one below, and the import graph has no cycle; `import jspec` loads nothing under `jspec/tools`; no module of the
packages names `scripts/` or `tests/` (what a tool needs ships inside the package); at most 8 modules sit directly
in `jspec/`; no module imports another's private name; every preset users name is defined under
`jspec/strategies`, and neither the api nor the engine asks a strategy's type (`isinstance`); the packages hold no
native (C / C++ / CUDA) source: XLA's ops are the one path on every device."""
import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STACK = ("ports.core", "ports.families", "ports.model", "ports.io", "ports", "jspec.core", "jspec.parts", "jspec.engine", "jspec.strategies", "jspec", "jspec.tools")


def under(name: str, pkg: str) -> bool:
    return name == pkg or name.startswith(pkg + ".")


def loaded_after(statement: str) -> list[str]:
    code = f"import sys; {statement}; print(' '.join(sorted(m for m in sys.modules if m.split('.')[0] in " \
           "('jspec', 'ports'))))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    return out.stdout.split()


def test_ports_imports_nothing_of_jspec():
    mods = loaded_after("import ports")
    assert "ports.families.llama" in mods
    assert [m for m in mods if m.split(".")[0] == "jspec"] == []


def test_import_jspec_loads_no_tool():
    mods = loaded_after("import jspec")
    assert "jspec.engine.step" in mods and "jspec.strategies.eesd" in mods
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


def imports(mods: dict[str, Path], every: bool = False) -> tuple[dict[str, set], list]:
    """(module -> the modules its module-level statements import (`every`: any statement, inside functions too),
    [(module, source, private name)] anywhere)."""
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
            if every or id(n) in top:
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


def layer(name: str) -> int:
    """The module's place in `STACK` (a module directly in `jspec/`, or `jspec` itself, is the api's)."""
    return max((len(pkg), i) for i, pkg in enumerate(STACK) if under(name, pkg))[1]


def all_imports(mods: dict[str, Path]) -> dict[str, set]:
    """module -> every module of the packages it imports, at module level or inside a function (`imports` with
    every statement counted)."""
    return imports(mods, every=True)[0]


def layer_violations(graph: dict[str, set]) -> list[tuple[str, str]]:
    """(module, imported module) pairs where the import goes up the stack."""
    return sorted((m, d) for m, deps in graph.items() for d in deps if layer(d) > layer(m))


def test_every_import_goes_down_the_stack_and_none_forms_a_cycle():
    graph = all_imports(modules())
    assert "jspec.tools.train.trainer" in graph["jspec.tools.train.layer_skip"]  # a function-level import counts
    assert "jspec.api" in graph["jspec.costs"] and "jspec.core.sampling" in graph["jspec.parts.rules"]
    assert layer_violations(graph) == []
    assert cycles(graph) == []


def test_the_stack_rules_find_a_planted_upward_import_and_cycle():
    graph = all_imports(modules())
    graph["jspec.core.sampling"] = graph["jspec.core.sampling"] | {"jspec.api"}  # sampling calling decode
    assert layer_violations(graph) == [("jspec.core.sampling", "jspec.api")]
    assert any("jspec.core.sampling" in c and "jspec.api" in c for c in cycles(graph))
    assert layer_violations({"ports.families.llama": {"jspec.core.sampling"}, "jspec.tools.demo": {"jspec.api"},
                             "jspec.engine.step": {"jspec.strategies.sage"}}) == [
        ("jspec.engine.step", "jspec.strategies.sage"), ("ports.families.llama", "jspec.core.sampling")]


def strategy_classes() -> set[str]:
    """Names of the strategy classes: those defined by the engine's strategy module and under jspec/strategies."""
    import jspec
    from jspec.engine.strategy import Strategy

    return {n for n in dir(jspec) if isinstance(getattr(jspec, n), type) and issubclass(getattr(jspec, n), Strategy)}


def type_checks(path: Path, names: set[str]) -> list[str]:
    """`isinstance` / `issubclass` calls in a module whose class argument names one of `names`."""
    found = []
    for n in ast.walk(ast.parse(path.read_text())):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in ("isinstance", "issubclass") \
                and len(n.args) == 2:
            named = {x.id if isinstance(x, ast.Name) else x.attr for x in ast.walk(n.args[1])
                     if isinstance(x, (ast.Name, ast.Attribute))}
            found += sorted(named & names)
    return found


def test_presets_live_in_strategies_and_neither_api_nor_engine_asks_a_strategys_type(tmp_path):
    import jspec

    names = strategy_classes()
    assert {"AR", "Chain", "Guarded", "PromptLookup", "SAGE", "Speculative", "Strategy"} <= names
    homes = {n: getattr(jspec, n).__module__ for n in names - {"Speculative", "Strategy"}}
    assert {n: m for n, m in homes.items() if not under(m, "jspec.strategies")} == {}
    mods = modules()
    asked = {m: c for m, p in mods.items() if (m == "jspec.api" or under(m, "jspec.engine"))
             and (c := type_checks(p, names))}
    assert asked == {}
    planted = tmp_path / "planted.py"
    planted.write_text("def f(s):\n    return isinstance(s, (Guarded, jspec.AR)) or isinstance(s, int)\n")
    assert type_checks(planted, names) == ["AR", "Guarded"]


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
    assert "ports.core.cache" in graph["ports.families.llama"] and "jspec.parts.plans" in graph["jspec.engine.strategy"]
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
