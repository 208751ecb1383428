"""The shape of the library: floors without a circle, modules a reader can hold, and the course kept apart.

The import graph is read from the source (every `import`, at the top of a module or inside a function, and the
parts a lazy package face imports on first use), so a circle hidden inside a function counts as one.
"""

from __future__ import annotations

import ast
import functools
import re
import subprocess
import sys
from pathlib import Path

LIBRARY = Path(__file__).resolve().parents[2] / "tunekit"
MAX_LINES = 400  # a module a reader holds in their head; more is two modules
COURSE = "tunekit_course"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(LIBRARY.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def library_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(LIBRARY.rglob("*.py"))}


@functools.cache
def all_modules() -> dict[str, Path]:
    """The library's modules and the course's."""
    return {**library_modules(), **{module_name(p): p for p in sorted((LIBRARY.parent / COURSE).rglob("*.py"))}}


def imports_of(path: Path) -> list[tuple[str, int]]:
    """(module imported, line) for every import in the file, at any depth, and a package face's lazy parts.
    `from tunekit.data import records` imports `tunekit.data.records`; `from tunekit.data.records import x`,
    `tunekit.data.records`."""
    modules = all_modules()
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found += [(f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module,
                       node.lineno) for a in node.names]
        elif isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
    if path.name == "__init__.py" and (parts := re.search(r"^PARTS = \((.*?)\)", path.read_text(), re.DOTALL | re.MULTILINE)):
        package = module_name(path)
        found += [(f"{package}.{name}", 0) for name in re.findall(r'"(\w+)"', parts[1])]
    return found


def import_graph(modules: dict[str, Path] | None = None) -> dict[str, set[str]]:
    """{module: the modules of `modules` it imports}; `modules` defaults to the library's."""
    modules = library_modules() if modules is None else modules
    return {name: {t for t, _ in imports_of(path) if t in modules and t != name} for name, path in modules.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each a circle of imports."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def assert_no_circle(graph: dict[str, set[str]]) -> None:
    found = circles(graph)
    assert not found, "import circles: " + "; ".join(
        " <-> ".join(c) + " (" + ", ".join(f"{a} -> {b}" for a in c for b in sorted(graph[a]) if b in c) + ")"
        for c in found)


def test_the_library_has_no_import_circle():
    graph = import_graph()
    assert "tunekit.train" in graph and "tunekit.data.records" in graph["tunekit.prepare"]
    assert_no_circle(graph)


def test_the_course_and_the_library_together_have_no_import_circle():
    """The course's modules sit on the library and on each other in floors: a module that runs whole runs
    (fullrun) above the one that reads their folders (runlog), the claims below the notebook helpers that print
    them. The library's course commands (`tunekit results`, `bench --compare`, ...) reach down into the course, so
    a course module that imported the command line back would close a circle through them."""
    graph = import_graph(all_modules())
    assert "tunekit_course.fullrun" in graph and "tunekit_course.runlog" in graph["tunekit_course.fullrun"]
    assert_no_circle(graph)


def test_the_circle_finder_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_library_module_is_longer_than_a_reader_holds():
    long = {name: n for name, path in library_modules().items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"library modules over {MAX_LINES} lines (split them): {long}"


ENTRY = ("tunekit.commands",)  # the command line's course commands reach the course, inside their functions


def test_the_library_never_imports_the_course():
    for name, path in library_modules().items():
        for target, line in imports_of(path):
            if target.split(".")[0] == COURSE:
                assert name in ENTRY, f"{path}:{line} imports {target}: the library never imports the course"
        top = [n for n in ast.parse(path.read_text()).body if isinstance(n, (ast.Import, ast.ImportFrom))]
        assert not [n for n in top if COURSE in ast.unparse(n)], f"{path} imports the course at the top"


def test_importing_the_library_loads_no_course_module():
    """`import tunekit` and every library module, in a fresh process: nothing of the course in sys.modules."""
    names = sorted(library_modules())
    code = ("import importlib, sys\n"
            f"for name in {names!r}:\n    importlib.import_module(name)\n"
            f"print(sorted(m for m in sys.modules if m.split('.')[0] == {COURSE!r}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.strip() == "[]", out.stdout
