"""asyncwt's layers import one way: no module cycle, no package cycle, nothing up.

Every import counts: top-level, inside a function, under `if TYPE_CHECKING:`
(relative ones resolved), read from the source with `ast`, nothing imported. A
package is a direct child of asyncwt (`asyncwt._core`, `asyncwt._backends`, ...).
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "asyncwt"

LAYERS: list[tuple[str, set[str]]] = [
    ("core", {"asyncwt._core"}),  # metadata, plan, errors, settings, API types, registry
    ("transports", {"asyncwt._transports"}),  # the transport interface, wire, links, pool
    ("engines", {"asyncwt._delta", "asyncwt._trainer", "asyncwt._worker"}),
    ("backends", {"asyncwt._backends"}),  # tcp, shm, torch_dist, cuda_ipc
    (
        "integrations",
        {"asyncwt", "asyncwt.__main__", "asyncwt._bench", "asyncwt._cli", "asyncwt._control"}
        | {"asyncwt._vllm"},
    ),
]
"""Lowest first: a module imports from its own layer or the ones before it."""


def modules(root: Path, package: str) -> dict[str, Path]:
    """Every module of `package` under `root`, by dotted name."""
    found = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imports_of(name: str, path: Path, known: Iterable[str]) -> set[str]:
    """The modules of `known` that module `name` imports, wherever the import is."""
    known = set(known)
    here = name if path.name == "__init__.py" else name.rpartition(".")[0]
    named: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            named.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = here.split(".")[: len(here.split(".")) - node.level + 1]
                base = ".".join([*parts, *([node.module] if node.module else [])])
            named.add(base)
            named.update(f"{base}.{alias.name}" for alias in node.names)
    targets = set()
    for target in named:
        while target and target not in known:
            target = target.rpartition(".")[0]
        if target and target != name:
            targets.add(target)
    return targets


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    found = modules(root, package)
    return {name: imports_of(name, path, found) for name, path in found.items()}


def package_of(module: str) -> str:
    return ".".join(module.split(".")[:2])


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    packages: dict[str, set[str]] = {}
    for source, targets in graph.items():
        edges = packages.setdefault(package_of(source), set())
        edges.update(package_of(t) for t in targets if package_of(t) != package_of(source))
    return packages


def cycles(graph: dict[str, set[str]]) -> set[frozenset[str]]:
    """The strongly connected components of more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: set[frozenset[str]] = set()
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            for succ in successors:
                if succ not in index:
                    index[succ] = low[succ] = len(index)
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(sorted(graph.get(succ, ())))))
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            else:
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
                        found.add(frozenset(component))
    return found


def layer_of(module: str, layers: list[tuple[str, set[str]]] = LAYERS) -> int | None:
    for rank, (_, packages) in enumerate(layers):
        if package_of(module) in packages:
            return rank
    return None


def upward(
    graph: dict[str, set[str]], layers: list[tuple[str, set[str]]] = LAYERS
) -> set[tuple[str, str]]:
    """Every import whose target sits in a higher layer than its source."""
    found = set()
    for source, targets in graph.items():
        for target in targets:
            low, high = layer_of(source, layers), layer_of(target, layers)
            if low is not None and high is not None and high > low:
                found.add((source, target))
    return found


def _describe(found: set[frozenset[str]]) -> list[str]:
    return sorted(" <-> ".join(sorted(c)) for c in found)


def _check(kind: str, found: set[frozenset[str]]) -> None:
    assert not found, f"{kind} cycles: {_describe(found)}"


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph(ROOT, PACKAGE)


def test_no_module_imports_in_a_cycle(graph: dict[str, set[str]]) -> None:
    _check("module", cycles(graph))


def test_no_packages_import_in_a_cycle(graph: dict[str, set[str]]) -> None:
    _check("package", cycles(package_graph(graph)))


def test_no_import_points_up_the_layers(graph: dict[str, set[str]]) -> None:
    found = upward(graph)
    named = sorted(f"{s} ({LAYERS[layer_of(s) or 0][0]}) -> {t}" for s, t in found)
    assert not named, f"imports up the layers: {named}"


def test_every_package_has_a_layer(graph: dict[str, set[str]]) -> None:
    placed = set().union(*(packages for _, packages in LAYERS))
    assert {package_of(m) for m in graph} == placed


def test_the_checks_find_every_kind_of_import(tmp_path: Path) -> None:
    """On a small package: a cycle made of a function-level, a TYPE_CHECKING and a
    relative import is found, and so is its package cycle and the upward import."""
    files = {
        "pkg/__init__.py": "",
        "pkg/_core/__init__.py": "",
        "pkg/_core/a.py": "def f():\n    from .._trainer import b\n",
        "pkg/_core/c.py": "import os\n",
        "pkg/_trainer/__init__.py": "",
        "pkg/_trainer/b.py": (
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..x import d\n"
        ),
        "pkg/x.py": "from pkg._core.a import f\nfrom ._core import c\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    toy = import_graph(tmp_path, "pkg")
    layers = [("core", {"pkg._core", "pkg.x"}), ("engines", {"pkg._trainer", "pkg"})]

    assert cycles(toy) == {frozenset({"pkg._core.a", "pkg._trainer.b", "pkg.x"})}
    assert cycles(package_graph(toy)) == {frozenset({"pkg._core", "pkg._trainer", "pkg.x"})}
    assert upward(toy, layers) == {
        ("pkg._core.a", "pkg._trainer"),
        ("pkg._core.a", "pkg._trainer.b"),
    }
    with pytest.raises(AssertionError, match=r"module cycles: \['pkg._core.a <-> pkg._trainer.b"):
        _check("module", cycles(toy))


ENGINE_BASES = {
    "PipelinedTrainerEngine",
    "DeferredWorkerEngine",
    "TrainerWeightTransferEngine",
    "WeightTransferEngine",
}


def engine_subclasses(tree: ast.Module) -> list[str]:
    """Classes in `tree` that name an engine class among their bases."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for base in node.bases:
                target = base.value if isinstance(base, ast.Subscript) else base
                name = (
                    target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
                )
                if name in ENGINE_BASES:
                    found.append(f"{node.name}({name})")
    return found


def test_no_backend_subclasses_an_engine() -> None:
    """A backend hands the engines a `TransportBackend`; the engines take its transport."""
    offenders = {
        name: engine_subclasses(ast.parse(path.read_text()))
        for name, path in modules(ROOT, PACKAGE).items()
        if name.startswith("asyncwt._backends")
    }
    offenders = {name: found for name, found in offenders.items() if found}
    assert not offenders, f"backend modules subclassing an engine: {offenders}"
    sample = (
        "class X(PipelinedTrainerEngine[Info]):\n    pass\nclass Y(base.DeferredWorkerEngine): ..."
    )
    assert engine_subclasses(ast.parse(sample)) == [
        "X(PipelinedTrainerEngine)",
        "Y(DeferredWorkerEngine)",
    ]


def test_the_engines_name_no_sender_layer(graph: dict[str, set[str]]) -> None:
    """A mode is a layer around a transport: the engines see only the transport's
    interface (`receiver_layouts`, ...), never which layers it wears."""
    layers = {"asyncwt._transports.sliced", "asyncwt._transports.layer", "asyncwt._delta.links"}
    for engine in ("asyncwt._trainer.engine", "asyncwt._worker.engine"):
        assert not graph[engine] & layers, (engine, sorted(graph[engine] & layers))
