"""Which service may import which, checked on the source: every ``import`` and
``from ... import`` statement of every module under gateway/, scheduler/,
gpu_worker/, vae_worker/ and services/ (inside functions and ``TYPE_CHECKING``
blocks too), read with ``ast``.

* services/ is the shared kernel: it imports no service.
* The workers (gpu_worker/, vae_worker/) and the HTTP API (http_api/, a client of
  the gateway over gRPC) import no other service: not the scheduler, not the
  gateway, not each other.
* The scheduler imports neither the gateway nor a worker.
* The gateway imports no worker, and of the scheduler only the pure policy modules
  it estimates with (``GATEWAY_USES``); those, and what they import of the
  scheduler in turn, stay pure (``PURE``): no service code comes with them.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("gateway", "http_api", "scheduler", "gpu_worker", "vae_worker", "services")
SERVICES = ("gateway", "http_api", "scheduler", "gpu_worker", "vae_worker")
# The scheduler modules the gateway may import: what it needs to estimate a job's
# wait and admit it (a fleet snapshot from records, its views, the policy and
# admission, costs and learned durations).
GATEWAY_USES = frozenset(
    {
        "scheduler",
        "scheduler.admission",
        "scheduler.costs",
        "scheduler.facts",
        "scheduler.learning",
        "scheduler.policy",
        "scheduler.views",
    }
)
# Pure policy code: frozen snapshots in, decisions out; no I/O, no service.
PURE = GATEWAY_USES | {
    "scheduler.estimates",
    "scheduler.forecast",
    "scheduler.preemption",
    "scheduler.snapshot",
    "scheduler.warm_planner",
}


@dataclass(frozen=True)
class Import:
    path: str  # of the importing file, from the repository root
    line: int
    statement: str  # as written (unparsed)
    module: str  # the module it imports, resolved: "from scheduler import policy" imports "scheduler.policy"

    @property
    def top(self) -> str:
        return self.module.split(".")[0]

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.statement}  (imports {self.module})"


def module_of(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str, root: Path) -> bool:
    base = root.joinpath(*name.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def imports_of(path: Path, root: Path = ROOT) -> Iterator[Import]:
    tree = ast.parse(path.read_text(), filename=str(path))
    where = str(path.relative_to(root))
    here = module_of(path, root)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(where, node.lineno, ast.unparse(node), alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the package, up level - 1
                parts = package.split(".")
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join([*parts, *([node.module] if node.module else [])])
            else:
                base = node.module or ""
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                module = submodule if is_module(submodule, root) else base
                yield Import(where, node.lineno, ast.unparse(node), module)


def sources(*packages: str) -> list[Path]:
    return sorted(p for package in packages for p in (ROOT / package).rglob("*.py"))


def imports_in(*packages: str) -> list[Import]:
    return [i for path in sources(*packages) for i in imports_of(path)]


def report(violations: Iterable[Import], rule: str) -> str:
    return f"{rule}:\n" + "\n".join(f"  {v}" for v in violations)


def test_every_package_is_read() -> None:
    for package in PACKAGES:
        assert sources(package), f"no Python file under {package}/"
    # The scanner sees the gateway's imports of the scheduler as they are written.
    seen = {(i.statement, i.module) for i in imports_in("gateway") if i.top == "scheduler"}
    assert ("from scheduler import admission, facts, policy", "scheduler.policy") in seen


def test_imports_are_resolved(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    for name in ("__init__.py", "mod.py", "sub/__init__.py", "sub/leaf.py"):
        (pkg / name).write_text("")
    (pkg / "sub" / "leaf.py").write_text(
        "import os.path\n"
        "from pkg import mod, CONSTANT\n"
        "from . import sibling\n"
        "from .. import mod as m\n"
        "from ..mod import thing\n"
        "def f():\n"
        "    from pkg.sub import leaf\n"
    )
    found = [(i.line, i.module) for i in imports_of(pkg / "sub" / "leaf.py", tmp_path)]
    assert found == [
        (1, "os.path"),
        (2, "pkg.mod"),
        (2, "pkg"),
        (3, "pkg.sub"),
        (4, "pkg.mod"),
        (5, "pkg.mod"),
        (7, "pkg.sub.leaf"),
    ]


def test_the_shared_kernel_imports_no_service() -> None:
    bad = [i for i in imports_in("services") if i.top in SERVICES]
    assert not bad, report(bad, "services/ (the shared kernel) imports a service")


@pytest.mark.parametrize("worker", ["gpu_worker", "vae_worker", "http_api"])
def test_a_worker_imports_no_other_service(worker: str) -> None:
    bad = [i for i in imports_in(worker) if i.top in SERVICES and i.top != worker]
    assert not bad, report(bad, f"{worker} imports another service")


def test_the_scheduler_imports_neither_the_gateway_nor_a_worker() -> None:
    bad = [i for i in imports_in("scheduler") if i.top in {"gateway", "gpu_worker", "vae_worker"}]
    assert not bad, report(bad, "scheduler imports the gateway or a worker")


def test_the_gateway_imports_no_worker_and_only_the_scheduler_s_pure_policy() -> None:
    gateway = imports_in("gateway")
    bad = [i for i in gateway if i.top in {"gpu_worker", "vae_worker"}]
    bad += [i for i in gateway if i.top == "scheduler" and i.module not in GATEWAY_USES]
    assert not bad, report(bad, f"gateway imports a worker, or of the scheduler more than {sorted(GATEWAY_USES)}")


def test_what_the_gateway_uses_of_the_scheduler_brings_no_service_code() -> None:
    """The scheduler modules the gateway imports, and what they import of the
    scheduler, transitively, are pure policy modules."""
    reached: dict[str, Import] = {}  # module -> the import that first reached it
    todo = [i for i in imports_in("gateway") if i.top == "scheduler"]
    while todo:
        found = todo.pop()
        if found.module in reached:
            continue
        reached[found.module] = found
        base = ROOT.joinpath(*found.module.split("."))
        path = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
        todo += [i for i in imports_of(path) if i.top == "scheduler"]
    bad = [i for module, i in sorted(reached.items()) if module not in PURE]
    assert not bad, report(bad, f"the gateway's scheduler imports reach beyond {sorted(PURE)}")
