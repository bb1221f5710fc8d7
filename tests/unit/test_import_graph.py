"""The import graph: dependencies point the way DESIGN.md says, and nothing imports in a loop.

An AST pass over every module of the `recover` namespace (folders mapped in pyproject.toml).
Every import counts, also one inside a function or under `if TYPE_CHECKING:`: a lazy import
only hides a loop, and a type-only one still ties two modules' designs together.
"""

from __future__ import annotations

import ast
import tomllib
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

FORBIDDEN = {
    # The agent and the trainer talk to the controller only over gRPC or the agent channel.
    "recover.agent": {"recover.controller", "recover.cli", "recover.bench", "recover.client",
                      "recover.workloads", "recover.relay"},
    "recover.trainer": {"recover.controller", "recover.agent", "recover.cli", "recover.bench",
                        "recover.client", "recover.workloads", "recover.relay"},
    "recover.controller": {"recover.agent", "recover.cli", "recover.bench", "recover.client",
                           "recover.workloads", "recover.relay"},
    # A rack's relay: the controller's door (gate) towards agents, the agent's link and
    # fencing rules towards the leader; nothing of training.
    "recover.relay": {"recover.trainer", "recover.cli", "recover.bench", "recover.client",
                      "recover.workloads"},
    "recover.common": {"recover.controller", "recover.agent", "recover.trainer", "recover.cli",
                       "recover.bench", "recover.client", "recover.workloads", "recover.relay"},
    "recover.proto": {"recover.controller", "recover.agent", "recover.trainer", "recover.cli",
                      "recover.bench", "recover.client", "recover.workloads", "recover.common",
                      "recover.relay"},
    # The library of benchmarks is used by the command line, never the other way round.
    "recover.bench": {"recover.cli"},
    "recover.client": {"recover.cli", "recover.bench"},
    # Workloads are ordinary users of the public API.
    "recover.workloads": {"recover.controller", "recover.agent", "recover.cli", "recover.bench",
                          "recover.client"},
}

KNOWN_MODULE_CYCLES: set[frozenset[str]] = set()
"""Import loops tolerated for now (none left): the test fails when one appears, and when
one listed here disappears, to keep the list honest."""


def modules() -> dict[str, Path]:
    """Module name -> file, for every module of the namespace (generated stubs left out)."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    found: dict[str, Path] = {}
    for package, folder in config["tool"]["setuptools"]["package-dir"].items():
        for path in (ROOT / folder).rglob("*.py"):
            if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue
            parts = [p for p in path.relative_to(ROOT / folder).with_suffix("").parts
                     if p != "__init__"]
            found[".".join([package, *parts])] = path
    return found


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of the namespace that `name` imports (a name imported from a package
    counts as the submodule when there is one, else as the package itself)."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")
                anchor = anchor[:len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                       for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name and not name.startswith(target + "."):
                found.add(target)  # a module's own parent packages load first anyway
    return found


def graph() -> dict[str, set[str]]:
    found = modules()
    return {name: imports(name, path, set(found)) for name, path in found.items()}


def package_of(module: str) -> str:
    return ".".join(module.split(".")[:2])


def cycles(edges: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components of more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[set[str]] = []
    counter = 0
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(component)
    return found


def test_the_graph_is_read() -> None:
    edges = graph()
    # Anchors: if these are not found, the pass reads nothing and every check below is moot.
    assert "recover.controller.coordinator" in edges
    assert "recover.proto" in edges["recover.controller.coordinator"]
    assert "recover.trainer.executor" in edges["recover.trainer.api"] or any(
        m.startswith("recover.trainer.") for m in edges["recover.trainer.api"])


def test_packages_depend_the_way_the_design_says() -> None:
    wrong = sorted(f"{module} imports {target}"
                   for module, targets in graph().items() for target in targets
                   if package_of(target) in FORBIDDEN.get(package_of(module), set()))
    assert wrong == []


def test_no_cycle_between_packages() -> None:
    packages: dict[str, set[str]] = defaultdict(set)
    for module, targets in graph().items():
        packages[package_of(module)] |= {package_of(t) for t in targets} - {package_of(module)}
    assert cycles(packages) == []


def test_no_cycle_between_modules() -> None:
    found = {frozenset(c) for c in cycles(graph())}
    assert found - KNOWN_MODULE_CYCLES == set(), "new import cycles"
    assert KNOWN_MODULE_CYCLES - found == set(), "a known cycle is gone: drop it from the list"


def test_cycles_are_found() -> None:
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert cycles(edges) == [{"a", "b", "c"}]
