"""The three floors, bertfuse.kernels <- bertfuse.bert <- bertfuse.bench: no module of kernels/, bert/ or bench/
imports (at the top or inside a function) in a circle, kernels imports neither of the others, bert not bench, and
neither reaches a private name of kernels (what they use of it is its public surface). Every import of them names
them by their package, `bertfuse`: none names a bare `kernels`, `bert` or `bench`, which other distributions own."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kernels", "bert", "bench")


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(("bertfuse",) + (parts[:-1] if parts[-1] == "__init__" else parts))


def _floor(module: str) -> str | None:
    """Which of the three parts a module name is in ("bertfuse.kernels.attention": "kernels"), else None."""
    top, _, rest = module.partition(".")
    part = rest.split(".")[0]
    return part if top == "bertfuse" and part in PACKAGES else None


MODULES = {_module(f): f for p in PACKAGES for f in sorted((ROOT / p).rglob("*.py"))}


def _imports(name: str):
    """(line, module imported, names taken from it) for each import in module `name` of one of our packages."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            if _floor(base):
                for a in node.names:  # `from kernels import launches` imports a module
                    full = f"{base}.{a.name}"
                    yield node.lineno, full if full in MODULES else base, [] if full in MODULES else [a.name]
        elif isinstance(node, ast.Import):
            for a in node.names:
                if _floor(a.name):
                    yield node.lineno, a.name, []


def _graph() -> dict:
    return {m: {imported for _, imported, _ in _imports(m) if imported != m} for m in MODULES}


def _cycle(graph: dict) -> list | None:
    """One import circle of the graph, as its modules in order, or None."""
    state = {}

    def visit(m, path):
        state[m] = "open"
        for n in sorted(graph.get(m, ())):
            if state.get(n) == "open":
                return path[path.index(n):] + [n]
            if n not in state and (found := visit(n, path + [n])):
                return found
        state[m] = "done"
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m, [m])):
            return found
    return None


def test_no_module_imports_in_a_circle():
    assert _cycle(_graph()) is None, " -> ".join(_cycle(_graph()))


def test_the_circle_finder_finds_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_each_floor_imports_only_the_floors_below_it():
    below = {"kernels": set(), "bert": {"kernels"}, "bench": {"kernels", "bert"}}
    assert {_floor(m) for m in MODULES} == set(PACKAGES)
    for m in MODULES:
        floor = _floor(m)
        for line, imported, _ in _imports(m):
            other = _floor(imported)
            assert other == floor or other in below[floor], f"{MODULES[m]}:{line}: {m} imports {imported}"


def test_bert_and_bench_use_no_private_name_of_kernels():
    for m in MODULES:
        if _floor(m) == "kernels":
            continue
        for line, imported, names in _imports(m):
            if _floor(imported) == "kernels":
                private = [p for p in imported.split(".") + names if p.startswith("_")]
                assert not private, f"{MODULES[m]}:{line}: {m} imports {imported} {names}"
    for m in MODULES:  # nor reaches one through an attribute: kernels.x._y, ops.kernels_package()._y
        if _floor(m) != "kernels":
            text = MODULES[m].read_text()
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                    source = ast.get_source_segment(text, node.value) or ""
                    assert "kernels" not in source, f"{MODULES[m]}:{node.lineno}: {source}.{node.attr}"


def test_no_file_imports_a_bare_kernels_bert_or_bench():
    """`import kernels` is Hugging Face's hub-kernel package wherever it is installed; ours is bertfuse.kernels."""
    files = [f for d in ("bertfuse", "tests", *PACKAGES) for f in sorted((ROOT / d).rglob("*.py"))]
    files.append(ROOT / "conftest.py")
    assert len(files) > len(MODULES)
    for f in files:
        for node in ast.walk(ast.parse(f.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module]
            bare = [n for n in names if n.split(".")[0] in PACKAGES]
            assert not bare, f"{f}:{node.lineno}: imports {bare}"


def test_an_import_of_each_floor_counts_as_one():
    """The module names the checks above read are the ones the code imports (a wrong prefix checks nothing)."""
    edges = {(m, imported) for m in MODULES for _, imported, _ in _imports(m)}
    assert ("bertfuse.bert.hf.compute", "bertfuse.bert.model.ops") in edges
    assert any(_floor(a) == "bench" and _floor(b) == "kernels" for a, b in edges)
    assert sum(1 for a, b in edges if _floor(a) != _floor(b)) > 20
