"""Imports go only downward through the layers of docs/architecture.md (Layers), and never in a
cycle; the layer map is the table in that section.

Every module under ``shared_core/``, ``langchain_specrag/`` and ``llamaindex_specrag/`` is parsed
with :mod:`ast`; an edge is any import of a project module: top-level, lazy (inside a function),
under ``if TYPE_CHECKING:``, or a string naming a module (``importlib.import_module`` targets,
PEP 562 ``_LAZY`` maps, ``"module:attr"`` registries). An edge to a higher layer, or any cycle,
fails with the offending edge(s) named.
"""

from __future__ import annotations

import ast
import functools
import re
import textwrap
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("shared_core", "langchain_specrag", "llamaindex_specrag")

DOC = ROOT / "docs" / "architecture.md"
# a row of the doc's layer table: | `module or package prefix` | layer | role |
_ROW = re.compile(r"^\| `([A-Za-z_][\w.]*)` \| (\d) \| (.+?) \|$")
UNMAPPED = "module {} has no layer: add its row to docs/architecture.md (section Layers)"


def layer_rows(text: str) -> list[tuple[str, int, str]]:
    """(module or package prefix, layer, role) for each row of the *Layers* section's tables."""
    section = text.split("\n## Layers\n", 1)[1].split("\n## ", 1)[0]
    matches = (_ROW.match(line.strip()) for line in section.splitlines())
    return [(m[1], int(m[2]), m[3]) for m in matches if m]


# module (or package prefix) -> (layer, role), read from docs/architecture.md. Longest prefix
# wins; the bare "shared_core" row names only the package's own __init__, so a new top-level
# module needs its own row.
LAYERS: dict[str, tuple[int, str]] = {
    name: (layer, role) for name, layer, role in layer_rows(DOC.read_text(encoding="utf-8"))}
_EXACT_ONLY = {"shared_core"}

# (importer, imported) -> why the upward edge is tolerated for now. Keep this empty; an entry
# whose edge no longer exists fails the test so the list cannot go stale.
ALLOWED_UPWARD: dict[tuple[str, str], str] = {}


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    line: int
    kind: str  # "top-level", "lazy", "type-checking" or "string"

    def __str__(self) -> str:
        return f"{self.source} -> {self.target} (line {self.line}, {self.kind} import)"


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def discover(root: Path, packages: Iterable[str] = PACKAGES) -> dict[str, Path]:
    """Project module name -> file, for every ``.py`` under the packages."""
    return {module_name(p, root): p for pkg in packages for p in sorted((root / pkg).rglob("*.py"))}


def layer_of(module: str, layers: Mapping[str, tuple[int, str]] = LAYERS) -> int | None:
    parts = module.split(".")
    for end in range(len(parts), 0, -1):
        prefix = ".".join(parts[:end])
        if prefix in layers and (end == len(parts) or prefix not in _EXACT_ONLY):
            return layers[prefix][0]
    return None


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _kinds(tree: ast.Module) -> dict[ast.AST, str]:
    """Each node's context: inside a function (lazy), under TYPE_CHECKING, else top level."""
    kinds: dict[ast.AST, str] = {}

    def visit(node: ast.AST, kind: str) -> None:
        kinds[node] = kind
        for child in ast.iter_child_nodes(node):
            child_kind = kind
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                child_kind = "lazy"
            elif isinstance(node, ast.If) and _is_type_checking(node.test) and child in node.body:
                child_kind = "type-checking"
            visit(child, child_kind)

    visit(tree, "top-level")
    return kinds


def _resolve_from(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - node.level + 1]
    return ".".join([*base, node.module] if node.module else base)


def imports_of(module: str, source: str, known: set[str], is_package: bool = False) -> list[Edge]:
    """Edges from ``module`` to project modules in ``known`` (see the module docstring)."""
    tree = ast.parse(source)
    kinds = _kinds(tree)
    edges: list[Edge] = []

    def add(target: str, node: ast.AST, kind: str | None = None) -> None:
        edge = Edge(module, target, getattr(node, "lineno", 0), kind or kinds[node])
        if target in known and target != module and edge not in edges:
            edges.append(edge)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve_from(node, module, is_package)
            for alias in node.names:
                full = f"{base}.{alias.name}"
                add(full if full in known else base, node)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            add(node.value.split(":")[0], node, "string")
    return edges


@functools.cache
def project_edges(root: Path = ROOT) -> tuple[Edge, ...]:
    files = discover(root)
    known = set(files)
    return tuple(edge for name, path in files.items()
                 for edge in imports_of(name, path.read_text(encoding="utf-8"), known,
                                        path.name == "__init__.py"))


def find_cycles(edges: Iterable[Edge]) -> list[list[Edge]]:
    """One cycle (as its edges) per strongly connected component with a cycle (Tarjan)."""
    graph: dict[str, dict[str, Edge]] = {}
    for e in edges:
        graph.setdefault(e.source, {}).setdefault(e.target, e)
        graph.setdefault(e.target, {})
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def strongconnect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    return [_cycle_in(graph, c) for c in components]


def _cycle_in(graph: Mapping[str, Mapping[str, Edge]], component: set[str]) -> list[Edge]:
    """A shortest cycle through the component's first module (breadth-first search)."""
    start = min(component)
    parent: dict[str, Edge] = {}
    queue = [start]
    while queue:
        v = queue.pop(0)
        for w, edge in sorted(graph[v].items()):
            if w == start:
                path = [edge]
                while path[0].source != start:
                    path.insert(0, parent[path[0].source])
                return path
            if w in component and w not in parent:
                parent[w] = edge
                queue.append(w)
    raise AssertionError(component)  # unreachable: a component with >1 module has a cycle


def violations(edges: Iterable[Edge], layer: Callable[[str], int | None] = layer_of,
               allowed: Mapping[tuple[str, str], str] = ALLOWED_UPWARD) -> list[str]:
    """Every problem as one line: unmapped modules, upward edges, cycles."""
    edges = list(edges)
    problems = sorted({UNMAPPED.format(m)
                       for e in edges for m in (e.source, e.target) if layer(m) is None})
    for e in edges:
        src, dst = layer(e.source), layer(e.target)
        if src is not None and dst is not None and dst > src \
                and (e.source, e.target) not in allowed:
            problems.append(f"upward import: {e} goes from layer {src} to layer {dst}")
    for cycle in find_cycles(edges):
        chain = " -> ".join([cycle[0].source] + [e.target for e in cycle])
        problems.append(f"import cycle: {chain}; edges: " + "; ".join(map(str, cycle)))
    return problems


# ----------------------------------------------------------------------------- the real tree


def test_every_module_has_a_layer() -> None:
    unmapped = sorted(m for m in discover(ROOT) if layer_of(m) is None)
    assert not unmapped, f"add rows for these modules to docs/architecture.md (Layers): {unmapped}"


def test_the_layer_table_names_existing_modules_once() -> None:
    """The doc's table is the layer map: no row twice, none for a module that is gone."""
    rows = layer_rows(DOC.read_text(encoding="utf-8"))
    names = [name for name, _, _ in rows]
    assert len(set(names)) == len(names), sorted({n for n in names if names.count(n) > 1})
    assert {"shared_core.config": 0, "shared_core.engines": 3, "langchain_specrag": 5}.items() \
        <= {name: layer for name, layer, _ in rows}.items()
    modules = set(discover(ROOT))
    stale = sorted(n for n in names if n not in modules)
    assert not stale, f"docs/architecture.md (Layers) has rows for missing modules: {stale}"


def test_imports_only_go_down_and_never_cycle() -> None:
    edges = project_edges()
    assert len(edges) > 50, "the parser found too few imports; is it reading the tree?"
    problems = violations(edges)
    assert not problems, "layering violations:\n" + "\n".join(problems)


def test_allowed_upward_edges_still_exist() -> None:
    present = {(e.source, e.target) for e in project_edges()}
    stale = sorted(set(ALLOWED_UPWARD) - present)
    assert not stale, f"remove these fixed edges from ALLOWED_UPWARD: {stale}"


# ----------------------------------------------------------------------------- the checker fails


def _edge(source: str, target: str) -> Edge:
    return Edge(source, target, 1, "top-level")


def test_planted_upward_edge_is_reported() -> None:
    edges = [_edge("shared_core.engines.baseline", "shared_core.runtime.models"),
             _edge("shared_core.config", "shared_core.runtime.models")]
    problems = violations(edges)
    assert len(problems) == 1
    assert "shared_core.config -> shared_core.runtime.models" in problems[0]
    assert "layer 0 to layer 1" in problems[0]


def test_planted_cycle_is_reported_with_its_edges() -> None:
    edges = [_edge("shared_core.engines.a", "shared_core.engines.b"),
             _edge("shared_core.engines.b", "shared_core.engines.c"),
             _edge("shared_core.engines.c", "shared_core.engines.a"),
             _edge("shared_core.engines.c", "shared_core.runtime.torch.session")]
    problems = violations(edges)
    assert len(problems) == 1
    assert ("shared_core.engines.a -> shared_core.engines.b -> shared_core.engines.c"
            " -> shared_core.engines.a") in problems[0]


def test_the_old_cycle_would_fail() -> None:
    """engine -> train_drafter -> bench -> engine: two upward edges and one cycle."""
    edges = [_edge("shared_core.engines.speculative_rag", "shared_core.tools.train_drafter"),
             _edge("shared_core.tools.train_drafter", "shared_core.bench.specrag"),
             _edge("shared_core.bench.specrag", "shared_core.engines.speculative_rag")]
    problems = violations(edges)
    assert sum(p.startswith("upward import") for p in problems) == 1
    assert sum(p.startswith("import cycle") for p in problems) == 1
    assert "shared_core.engines.speculative_rag -> shared_core.tools.train_drafter" in problems[0]


def test_allow_list_and_unmapped_modules() -> None:
    edge = _edge("shared_core.engines.x", "shared_core.frontend.serving")
    assert violations([edge], allowed={(edge.source, edge.target): "temporary"}) == []
    assert violations([_edge("shared_core.newthing", "shared_core.config")]) == [
        UNMAPPED.format("shared_core.newthing")]


def test_parser_sees_lazy_type_checking_string_and_relative_imports(tmp_path: Path) -> None:
    pkg = tmp_path / "shared_core"
    (pkg / "engines").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "config.py").write_text("")
    (pkg / "frontend").mkdir()
    (pkg / "frontend" / "serving.py").write_text("")
    (pkg / "runtime").mkdir()
    (pkg / "runtime" / "models.py").write_text("")
    (pkg / "engines" / "__init__.py").write_text('_LAZY = {"X": "shared_core.engines.eng"}\n')
    (pkg / "engines" / "eng.py").write_text(textwrap.dedent("""
        from typing import TYPE_CHECKING
        from .. import config
        if TYPE_CHECKING:
            from shared_core.runtime.models import LM
        def load():
            from shared_core.frontend.serving import loaded_model
        REGISTRY = {"a": "shared_core.config:thing"}
    """))
    files = discover(tmp_path, ["shared_core"])
    edges = [e for name, path in files.items()
             for e in imports_of(name, path.read_text(), set(files), path.name == "__init__.py")]
    found = {(e.source, e.target, e.kind) for e in edges}
    assert found == {
        ("shared_core.engines", "shared_core.engines.eng", "string"),
        ("shared_core.engines.eng", "shared_core.config", "top-level"),
        ("shared_core.engines.eng", "shared_core.runtime.models", "type-checking"),
        ("shared_core.engines.eng", "shared_core.frontend.serving", "lazy"),
        ("shared_core.engines.eng", "shared_core.config", "string"),
    }
    problems = violations(edges)
    assert problems == [
        "upward import: shared_core.engines.eng -> shared_core.frontend.serving (line 7, lazy import)"
        " goes from layer 3 to layer 4"]
