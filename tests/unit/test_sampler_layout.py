"""The sampler's layout (gpu_worker/), checked on the source: every ``import`` and
``from ... import`` statement of every module under it, read with ``ast``
(``tests.unit.test_boundaries.imports_of``), inside functions and ``TYPE_CHECKING``
blocks too.

* No import circle among its modules, however long and however guarded: a circle
  under ``TYPE_CHECKING`` or inside a function is still two modules that cannot be
  read, tested or moved one without the other.
* Nor among its subpackages (``dispatch``, ``jobs``, ``denoising``, ``families``...,
  each module at the top its own): they stack, each on those below it.
* The denoising loop (``gpu_worker.denoising``) is the same for every model family:
  it imports no family and nothing of the job handling around it.
* Each model family (``gpu_worker.families``) stands alone behind the ``Denoiser``
  seam: a family imports no other.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import pairwise
from pathlib import Path

from tests.unit.test_boundaries import ROOT, Import, imports_of, module_of

PACKAGE = "gpu_worker"
# What the denoising loop may import of the sampler: the loop itself, what its
# members checkpoint, how a family's model loads, and the adapters its network holds.
LOOP_USES = ("gpu_worker.denoising", "gpu_worker.checkpoints", "gpu_worker.models.model_cache", "gpu_worker.adapters")


def import_graph(root: Path, package: str = PACKAGE) -> dict[str, dict[str, Import]]:
    """Per module of ``package`` under ``root``, the modules of ``package`` it
    imports, each with the first statement that does."""
    graph: dict[str, dict[str, Import]] = {}
    for path in sorted((root / package).rglob("*.py")):
        edges = graph.setdefault(module_of(path, root), {})
        for found in imports_of(path, root):
            if found.top == package:
                edges.setdefault(found.module, found)
    return graph


def cycles(graph: dict[str, dict[str, Import]]) -> list[list[str]]:
    """The circles of imports: in each group of modules that import each other
    (Tarjan's strongly connected components), the shortest circle through each of
    its modules, each once, as ``[a, b, ..., a]`` from its first module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for imported in sorted(graph.get(module, {})):
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in on_stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == module:
                    break
            if len(group) > 1 or module in graph.get(module, {}):
                groups.append(sorted(group))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    found: list[list[str]] = []
    for group in sorted(groups):
        for module in group:
            circle = _circle(graph, group, module)
            first = circle.index(min(circle))
            circle = [*circle[first:-1], *circle[:first], circle[first]]
            if circle not in found:
                found.append(circle)
    return found


def _circle(graph: dict[str, dict[str, Import]], group: list[str], start: str) -> list[str]:
    """The shortest circle through ``start``, within its group (breadth first)."""
    members = set(group)
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for module in frontier:
            for imported in sorted(graph.get(module, {})):
                if imported not in members or imported in came_from:
                    continue
                came_from[imported] = module
                if imported == start:
                    path = [start]
                    while path[-1] != start or len(path) == 1:
                        path.append(came_from[path[-1]])
                    return path[::-1]
                following.append(imported)
        frontier = following
    raise AssertionError(f"no circle through {start} in {group}")  # a component always has one


def describe(graph: dict[str, dict[str, Import]], circle: list[str]) -> str:
    links = "\n".join(f"    {graph[a][b]}" for a, b in pairwise(circle))
    return f"  {' -> '.join(circle)}\n{links}"


def subpackages(graph: dict[str, dict[str, Import]], package: str = PACKAGE) -> dict[str, dict[str, Import]]:
    """``graph`` with each subpackage of ``package`` one node (a module at its top
    stays one of its own), and the imports within a node left out."""

    def node(module: str) -> str:
        return ".".join(module.split(".")[:2])

    collapsed: dict[str, dict[str, Import]] = {}
    for module, edges in sorted(graph.items()):
        out = collapsed.setdefault(node(module), {})
        for imported, found in sorted(edges.items()):
            if node(imported) != node(module):
                out.setdefault(node(imported), found)
    return collapsed


def report(found: Iterable[Import], rule: str) -> str:
    return f"{rule}:\n" + "\n".join(f"  {i}" for i in found)


def test_the_sampler_has_no_import_circle() -> None:
    graph = import_graph(ROOT)
    assert len(graph) > 40, sorted(graph)  # every module was read
    found = cycles(graph)
    assert not found, "import circles among gpu_worker's modules:\n" + "\n".join(describe(graph, c) for c in found)


def test_the_subpackages_stack_without_a_circle() -> None:
    graph = subpackages(import_graph(ROOT))
    assert {"gpu_worker.denoising", "gpu_worker.families", "gpu_worker.jobs"} <= graph.keys(), sorted(graph)
    found = cycles(graph)
    assert not found, "import circles among gpu_worker's subpackages:\n" + "\n".join(describe(graph, c) for c in found)


def test_the_denoising_loop_knows_no_family_and_no_job_handling() -> None:
    graph = import_graph(ROOT)
    bad = [
        i
        for module, edges in graph.items()
        if module.startswith("gpu_worker.denoising")
        for imported, i in edges.items()
        if not imported.startswith(LOOP_USES)
    ]
    assert not bad, report(bad, f"the denoising loop imports more of the sampler than {LOOP_USES}")


def test_a_family_imports_no_other_family() -> None:
    graph = import_graph(ROOT)
    bad = [
        i
        for module, edges in graph.items()
        if module.startswith("gpu_worker.families.")
        for imported, i in edges.items()
        if imported.startswith("gpu_worker.families") and imported != module
    ]
    assert not bad, report(bad, "a model family imports another")


def test_circles_are_found_and_named(tmp_path: Path) -> None:
    """Under ``TYPE_CHECKING``, inside a function, through a package's
    ``from pkg import module``, and a module that imports itself."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.sub.b import B\n",
        "sub/__init__.py": "",
        "sub/b.py": "def f():\n    from pkg import c\n",
        "c.py": "from pkg.a import A\n",
        "leaf.py": "import os\nfrom pkg import a\n",
        "selfish.py": "from pkg import selfish\n",
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    graph = import_graph(tmp_path, "pkg")
    assert cycles(graph) == [["pkg.a", "pkg.sub.b", "pkg.c", "pkg.a"], ["pkg.selfish", "pkg.selfish"]]
    # Collapsed to subpackages: pkg.sub imports pkg.c, which imports pkg.a, which imports pkg.sub.
    assert cycles(subpackages(graph, "pkg")) == [["pkg.a", "pkg.sub", "pkg.c", "pkg.a"]]
    assert "pkg/sub/b.py:2: from pkg import c  (imports pkg.c)" in describe(graph, cycles(graph)[0])
