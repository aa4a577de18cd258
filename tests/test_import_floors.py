"""sudu's import graph, read from the code: every import statement of every module (module level, function level
and TYPE_CHECKING blocks alike) must point to the module's own floor or one below it, and no set of modules may
import each other in a circle. FLOORS is the one list of the floors; docs/architecture.md draws it."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "sudu"

# top to bottom; a module belongs to the floor of the longest prefix that names it ("sudu" alone: the package's
# own __init__, the Python API)
FLOORS: list[tuple[str, tuple[str, ...]]] = [
    ("entry points", ("sudu", "sudu.cli", "sudu.commands")),
    ("bench", ("sudu.bench",)),
    ("cluster", ("sudu.cluster",)),
    ("server", ("sudu.server",)),
    ("engine", ("sudu.engine", "sudu.cuda.step", "sudu.cuda.invariance")),
    ("cache", ("sudu.cache",)),
    ("structured output and tools", ("sudu.structured", "sudu.tools")),
    ("models", ("sudu.models",)),
    ("layers", ("sudu.layers",)),
    ("quant and GPU kernels", ("sudu.quant", "sudu.cuda", "sudu.ops")),
    ("CPU kernels", ("sudu.kernels",)),
    ("weights", ("sudu.weights",)),
    ("media", ("sudu.media",)),
    ("base", ("sudu.tokenizer", "sudu.config", "sudu.model_config", "sudu.sampling", "sudu.errors", "sudu.paths",
              "sudu.host")),
]


def modules(root: Path = SRC) -> dict[str, Path]:
    out = {}
    for f in root.rglob("*.py"):
        parts = list(f.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


def import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the sudu modules it imports (a package's import of its own children counts; a child's import
    of its parent package does not, since importing a child runs its parents anyway)."""

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, f in mods.items():
        is_pkg = f.name == "__init__.py"
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = m.split(".") if is_pkg else m.split(".")[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    mod = ".".join(base + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                targets = [f"{mod}.{a.name}" for a in node.names] + [mod]
            else:
                continue
            for t in targets:
                if t.split(".")[0] != "sudu":
                    continue
                r = resolve(t)
                if r and r != m and not m.startswith(r + ".") and r != "sudu":
                    graph[m].add(r)
    return graph


def floor_of(module: str) -> int:
    best, best_len = None, -1
    for i, (_, prefixes) in enumerate(FLOORS):
        for p in prefixes:
            matches = module == p if p == "sudu" else (module == p or module.startswith(p + "."))
            if matches and len(p) > best_len:
                best, best_len = i, len(p)
    if best is None:
        raise KeyError(module)
    return best


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_every_module_has_a_floor():
    unplaced = []
    for m in modules():
        try:
            floor_of(m)
        except KeyError:
            unplaced.append(m)
    assert not unplaced, f"modules on no floor (add their room to FLOORS and docs/architecture.md): {unplaced}"


def test_no_import_circles():
    found = circles(import_graph(modules()))
    assert not found, "import circles:\n" + "\n".join(", ".join(c) for c in found)


def test_every_import_points_down():
    upward = [f"{m} ({FLOORS[floor_of(m)][0]}) imports {t} ({FLOORS[floor_of(t)][0]})"
              for m, targets in sorted(import_graph(modules()).items()) for t in sorted(targets)
              if floor_of(t) < floor_of(m)]
    assert not upward, "imports of a higher floor:\n" + "\n".join(upward)


def test_architecture_doc_names_every_floor():
    doc = (SRC.parent / "docs" / "architecture.md").read_text()
    missing = [name for name, _ in FLOORS if name not in doc]
    assert not missing, f"docs/architecture.md does not name the floors {missing}"


@pytest.mark.parametrize("source, expect", [
    ({"a": "import sudu.b\n", "b": "from sudu import a\n"}, [["sudu.a", "sudu.b"]]),
    ({"a": "def f():\n    from sudu.b import x\n", "b": "from . import c\n", "c": "import sudu.a\n"},
     [["sudu.a", "sudu.b", "sudu.c"]]),
    ({"a": "import sudu.b\n", "b": "import os\n"}, []),
])
def test_the_checker_finds_circles_hidden_in_functions(tmp_path, source, expect):
    """The checker itself, on planted packages: a circle through a function-level or relative import is found."""
    pkg = tmp_path / "sudu"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for name, text in source.items():
        (pkg / f"{name}.py").write_text(text)
    assert circles(import_graph(modules(pkg))) == expect


def test_the_checker_finds_an_upward_import():
    """A layer that imports the engine is reported (the floors, not only the circles, are checked)."""
    assert floor_of("sudu.layers.attention") > floor_of("sudu.engine.llm_engine")
    assert floor_of("sudu.cuda.step") == floor_of("sudu.engine.scheduler")
    assert floor_of("sudu") < floor_of("sudu.bench.cli")
