"""Every dotted name `jspec.x...` / `ports.x...` the docs write in backticks (README.md and docs/*.md; the dated
pages under docs/results/ record what ran then and are left out), and every such name in a docstring of the
`jspec` and `ports` packages, names a module that exists or an attribute of one: the longest prefix that is a
module is imported and the rest looked up on it (a dataclass field counts as an attribute). Paths the same text
writes as `jspec/...` or `ports/...` exist in the checkout. A renamed or moved module shows up here before a reader
follows a stale name."""
import ast
import importlib
import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NAME = re.compile(r"(?<![\w.\-/])(?:jspec|ports)(?:\.[A-Za-z_]\w*)+")
PATH = re.compile(r"(?<![\w.\-/~])(?:jspec|ports)/[\w./-]*")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
SPAN = re.compile(r"(`+)(.+?)\1", re.S)


def doc_pages() -> list[Path]:
    return [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))


def names_in_markdown(text: str, pattern: re.Pattern = NAME) -> list[tuple[int, str]]:
    """(line, name) for each dotted jspec / ports name (`pattern`) inside a code span or a fenced block."""
    found = []

    def take(chunk: str, start: int):
        for m in pattern.finditer(chunk):
            found.append((text.count("\n", 0, start + m.start()) + 1, m.group()))

    for block in FENCE.finditer(text):
        take(block.group(), block.start())
    rest = FENCE.sub(lambda b: re.sub(r"[^\n]", " ", b.group()), text)  # same offsets and lines, fences blanked
    for span in SPAN.finditer(rest):
        take(span.group(2), span.start(2))
    return found


def names_in_docstrings(path: Path, pattern: re.Pattern = NAME) -> list[tuple[int, str]]:
    """(line, name) for each dotted jspec / ports name (`pattern`) in the module's, its classes' and its functions'
    docstrings."""
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                doc = first.value.value
                for m in pattern.finditer(doc):
                    found.append((first.lineno + doc.count("\n", 0, m.start()), m.group()))
    return found


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def resolves(name: str) -> bool:
    """Whether `name` is a module, or an attribute (at any depth) of the longest module that prefixes it."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        mod = ".".join(parts[:i])
        if not _is_module(mod):
            continue
        if i == len(parts):
            return True
        obj = importlib.import_module(mod)
        for attr in parts[i:]:
            if hasattr(obj, attr):
                obj = getattr(obj, attr)
            elif isinstance(obj, type) and (attr in getattr(obj, "__dataclass_fields__", {})
                                            or any(attr in getattr(c, "__annotations__", {}) for c in obj.__mro__)):
                return True  # a dataclass field or an annotated attribute: an instance's, not the class's
            else:
                return False
        return True
    return False


def exists(path: str) -> bool:
    """Whether a `jspec/...` / `ports/...` path names a file or folder of the checkout."""
    return (ROOT / path.rstrip(".")).exists()


def missing(found: dict[str, list[tuple[int, str]]], check=resolves) -> list[str]:
    """'file:line: name' for each name that does not resolve (`check`)."""
    cache: dict[str, bool] = {}
    out = []
    for where, names in found.items():
        for line, name in names:
            if name not in cache:
                cache[name] = check(name)
            if not cache[name]:
                out.append(f"{where}:{line}: {name}")
    return out


def sources() -> list[Path]:
    return [p for pkg in ("jspec", "ports") for p in sorted((ROOT / pkg).rglob("*.py"))]


def test_names_in_the_docs_exist():
    found = {str(p.relative_to(ROOT)): names_in_markdown(p.read_text()) for p in doc_pages()}
    assert sum(len(v) for v in found.values()) > 50  # the scan sees the docs' names
    assert missing(found) == []


def test_paths_in_the_docs_exist():
    found = {str(p.relative_to(ROOT)): names_in_markdown(p.read_text(), PATH) for p in doc_pages()}
    assert sum(len(v) for v in found.values()) > 20
    assert missing(found, exists) == []


def test_names_in_docstrings_exist():
    found = {str(p.relative_to(ROOT)): names_in_docstrings(p) for p in sources()}
    assert sum(len(v) for v in found.values()) > 50
    assert missing(found) == []


def test_paths_in_docstrings_exist():
    found = {str(p.relative_to(ROOT)): names_in_docstrings(p, PATH) for p in sources()}
    assert sum(len(v) for v in found.values()) > 5
    assert missing(found, exists) == []


def test_a_planted_missing_name_is_reported(tmp_path):
    page = "Steps run in `jspec.engine.nowhere`; decode is `jspec.decode(target, prompt)`.\n\n" \
           "```python\nfrom jspec.engine.step import sd_step\nx = ports.load_hf\n```\n"
    found = names_in_markdown(page)
    assert [n for _, n in found] == ["jspec.engine.step", "ports.load_hf", "jspec.engine.nowhere", "jspec.decode"]
    assert missing({"page.md": found}) == ["page.md:1: jspec.engine.nowhere"]
    planted = tmp_path / "planted.py"
    planted.write_text('"""Times phases with `jspec.engine.profiling`\nand `jspec.engine.nowhere.f`."""\n')
    assert missing({"planted.py": names_in_docstrings(planted)}) == ["planted.py:2: jspec.engine.nowhere.f"]
    assert resolves("jspec.models.REGISTRY") and resolves("jspec.parts.protocols.DraftEnv.out")
    paths = names_in_markdown("The loop is `jspec/engine/loop.py`; rules were `jspec/methods/`.", PATH)
    assert missing({"page.md": paths}, exists) == ["page.md:1: jspec/methods/"]
