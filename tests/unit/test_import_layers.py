"""The package's layering, read from the source: every ``import`` / ``from ... import``
in every module under pagoda/, wherever it stands (module level, inside a function, under
``if TYPE_CHECKING``), relative ones resolved. docs/architecture.md ("Import rules") states
the rules:

- the house has floors (``FLOORS``, bottom first): a room (a top-level package
  ``pagoda/X/`` or module ``pagoda/X.py``; ``pagoda`` itself, the package's public face,
  is one too) imports only rooms on floors below its own, so rooms on one floor import
  nothing of each other; imports inside a room are free. Every room stands on a floor, and
  there is no import cycle between rooms;
- ``pagoda.core`` (the scheduler, KV cache bookkeeping) imports nothing from engine,
  entrypoints, executor, worker or bench;
- ``pagoda.worker``, ``pagoda.executor`` and ``pagoda.model`` import nothing from engine
  or entrypoints;
- ``pagoda.attention`` and ``pagoda.ops`` (backends and kernels) import nothing from those,
  the worker, the executor or the model's layers, families and loader;
- only ``pagoda.bench`` itself and the CLI's ``pagoda bench`` dispatch
  (``pagoda.entrypoints.cli``) import ``pagoda.bench``;
- ``pagoda.bench.overhead`` (a measurement harness, ``python -m``) is imported by nobody;
- no import cycle among pagoda's modules: ``from pagoda.x import y`` is an edge to
  ``pagoda.x``, or to ``pagoda.x.y`` when that is a module.
"""

from __future__ import annotations

import ast
import functools
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "pagoda"

# (packages, what they may not import)
LAYER_RULES: list[tuple[tuple[str, ...], tuple[str, ...]]] = [
    (("pagoda.core",), ("pagoda.engine", "pagoda.entrypoints", "pagoda.executor", "pagoda.worker", "pagoda.bench")),
    (("pagoda.worker", "pagoda.executor", "pagoda.model"), ("pagoda.engine", "pagoda.entrypoints")),
    # The attention backends and the kernels sit below the model's layers and the runner.
    (("pagoda.attention", "pagoda.ops"), ("pagoda.engine", "pagoda.entrypoints", "pagoda.executor", "pagoda.worker",
                                          "pagoda.model.layers", "pagoda.model.models", "pagoda.model.loader")),
]
BENCH = "pagoda.bench"
BENCH_IMPORTERS = ("pagoda.entrypoints.cli",)   # its lazy `pagoda bench` dispatch
HARNESSES = ("pagoda.bench.overhead",)          # run as scripts, imported by no module

# The house, bottom floor first. A room imports only rooms on lower floors (none on its own).
FLOORS: list[tuple[str, ...]] = [
    # standard library and third-party packages only
    ("pagoda.json_options", "pagoda.lazy", "pagoda.outputs", "pagoda.shared_prefix", "pagoda.tenants",
     "pagoda.host", "pagoda.distributed", "pagoda.ops"),
    ("pagoda.config",),             # the engine's configuration (no torch)
    ("pagoda.sampling_params",),
    # what requests ask for beyond sampling, finding model files, grammars, sampling,
    # attention over the paged KV cache
    ("pagoda.pooling", "pagoda.hub", "pagoda.structured_output", "pagoda.sample", "pagoda.attention"),
    ("pagoda.tokenizer", "pagoda.reasoning", "pagoda.multimodal"),   # images in: decoding, processors
    ("pagoda.model",),
    ("pagoda.lora", "pagoda.spec_decode"),
    ("pagoda.validation",),
    ("pagoda.core",),               # the scheduler and its requests, KV cache bookkeeping
    ("pagoda.kv_transfer", "pagoda.metrics", "pagoda.worker"),
    ("pagoda.executor",),
    ("pagoda.engine",),
    ("pagoda",),                    # the package's public face: LLM, SamplingParams, ...
    ("pagoda.bench",),
    ("pagoda.entrypoints",),        # the CLI (``pagoda bench`` included) and the servers
]
FLOOR = {room: i for i, floor in enumerate(FLOORS) for room in floor}


@dataclass(frozen=True)
class Import:
    module: str      # the importing module
    path: str        # its file, relative to the repository
    line: int
    statement: str   # the import as written
    target: str      # the module imported (dotted)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(module: str, path: Path, modules: dict[str, Path], root: Path = ROOT) -> list[Import]:
    source = path.read_text()
    tree = ast.parse(source, filename=str(path))
    is_package = path.name == "__init__.py"
    rel = str(path.relative_to(root))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                parent = ".".join(base + ([node.module] if node.module else []))
            else:
                parent = node.module or ""
            # `from pagoda.x import y`: the submodule pagoda.x.y when there is one, else pagoda.x.
            targets = [f"{parent}.{alias.name}" if f"{parent}.{alias.name}" in modules else parent
                       for alias in node.names]
        else:
            continue
        statement = " ".join((ast.get_source_segment(source, node) or ast.unparse(node)).split())
        for target in dict.fromkeys(targets):
            if target == "pagoda" or target.startswith("pagoda."):
                found.append(Import(module, rel, node.lineno, statement, target))
    return found


@functools.lru_cache(maxsize=1)
def _all_imports() -> tuple[Import, ...]:
    """Every pagoda import in the package, parsed once per test session (each test reads them)."""
    modules = _modules()
    return tuple(imp for name, path in modules.items() for imp in _imports(name, path, modules))


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _describe(imp: Import) -> str:
    return f"{imp.path}:{imp.line}: {imp.module} imports {imp.target} ({imp.statement})"


def _room(name: str) -> str:
    """The room a module is in: ``pagoda.x`` for ``pagoda.x`` and everything under it."""
    return ".".join(name.split(".")[:2])


def test_the_scan_sees_the_package():
    """A guard for the guards: the scan finds the modules and the imports the rules are about."""
    modules = _modules()
    assert {"pagoda", "pagoda.core.scheduler", "pagoda.engine.engine_core", "pagoda.entrypoints.cli"} <= set(modules)
    imports = _all_imports()
    assert any(i.module == "pagoda.engine.engine_core" and i.target == "pagoda.core.scheduler" for i in imports)
    # lazy ones (inside a function) count too
    assert any(i.module == "pagoda.entrypoints.cli" and i.target == "pagoda.bench.commands" for i in imports)


def test_relative_imports_resolve(tmp_path):
    pkg = tmp_path / "pagoda" / "sub"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("from . import a\nfrom .a import f\n")
    (pkg / "a.py").write_text("from .. import b\nfrom ..b import g\ndef f():\n    from .c import h\n")
    modules = dict.fromkeys(["pagoda", "pagoda.b", "pagoda.sub", "pagoda.sub.a", "pagoda.sub.c"], Path())
    init = [i.target for i in _imports("pagoda.sub", pkg / "__init__.py", modules, tmp_path)]
    a = [i.target for i in _imports("pagoda.sub.a", pkg / "a.py", modules, tmp_path)]
    assert init == ["pagoda.sub.a", "pagoda.sub.a"]
    assert a == ["pagoda.b", "pagoda.b", "pagoda.sub.c"]


def test_layers_import_only_what_they_may():
    bad = []
    for imp in _all_imports():
        for importers, forbidden in LAYER_RULES:
            if any(_within(imp.module, p) for p in importers):
                bad += [f"{_describe(imp)}: {imp.module.split('.')[1]}/ may not import {f}"
                        for f in forbidden if _within(imp.target, f)]
    assert not bad, "layering violated:\n" + "\n".join(bad)


def test_only_bench_and_the_cli_import_bench():
    bad = [f"{_describe(imp)}: runtime code may not import {BENCH}" for imp in _all_imports()
           if _within(imp.target, BENCH) and not _within(imp.module, BENCH) and imp.module not in BENCH_IMPORTERS]
    assert not bad, "\n".join(bad)


def test_no_module_imports_a_harness():
    bad = [f"{_describe(imp)}: {imp.target} is a measurement harness, run with python -m"
           for imp in _all_imports() if imp.target in HARNESSES and imp.module != imp.target]
    assert not bad, "\n".join(bad)


def _cycles(edges: dict[str, dict[str, Import]]) -> list[list[str]]:
    """One cycle (a list of modules, first == last) per strongly connected component with one."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:     # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in edges.get(v, ()):
                components.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)

    cycles = []
    for component in components:
        members = set(component)
        start = component[0]
        # The shortest way back to start, breadth first, inside the component.
        prev: dict[str, str] = {}
        frontier = [start]
        while frontier and start not in prev:
            nxt = []
            for v in frontier:
                for w in sorted(edges.get(v, ())):
                    if w in members and w not in prev:
                        prev[w] = v
                        nxt.append(w)
            frontier = nxt
        path = [start]
        while True:
            path.append(prev[path[-1]])
            if path[-1] == start:
                break
        cycles.append(path[::-1])
    return cycles


def test_no_import_cycles():
    edges: dict[str, dict[str, Import]] = {}
    modules = _modules()
    for imp in _all_imports():
        if imp.target in modules:
            edges.setdefault(imp.module, {}).setdefault(imp.target, imp)
    cycles = _cycles(edges)
    report = []
    for cycle in cycles:
        report.append(" -> ".join(cycle))
        report += [f"    {_describe(edges[a][b])}" for a, b in zip(cycle, cycle[1:])]
    assert not cycles, "import cycles among pagoda's modules:\n" + "\n".join(report)


def test_cycle_finder_finds_a_cycle():
    imp = Import("a", "a.py", 1, "import b", "b")
    edges = {"a": {"b": imp}, "b": {"c": imp}, "c": {"a": imp}, "d": {"a": imp}, "e": {"e": imp}}
    assert sorted(_cycles(edges)) == [["a", "b", "c", "a"], ["e", "e"]]


def test_every_room_stands_on_one_floor():
    """A new package or module at the top of pagoda/ is given its floor; a floor names only rooms there are."""
    placed = [room for floor in FLOORS for room in floor]
    rooms = {_room(name) for name in _modules()}
    assert len(placed) == len(set(placed)), f"rooms on two floors: {sorted({r for r in placed if placed.count(r) > 1})}"
    assert not rooms - FLOOR.keys(), f"rooms on no floor (add them to FLOORS): {sorted(rooms - FLOOR.keys())}"
    assert not FLOOR.keys() - rooms, f"FLOORS names rooms that are not there: {sorted(FLOOR.keys() - rooms)}"


def test_every_import_goes_down_the_floors():
    bad = []
    for imp in _all_imports():
        here, there = _room(imp.module), _room(imp.target)
        if here != there and here in FLOOR and there in FLOOR and FLOOR[there] >= FLOOR[here]:
            bad.append(f"{_describe(imp)}: {here} (floor {FLOOR[here]}) may import only rooms on lower floors, "
                       f"{there} is on floor {FLOOR[there]}")
    assert not bad, "imports that do not go down the floors:\n" + "\n".join(bad)


def test_no_cycles_between_rooms():
    edges: dict[str, dict[str, Import]] = {}
    for imp in _all_imports():
        here, there = _room(imp.module), _room(imp.target)
        if here != there:
            edges.setdefault(here, {}).setdefault(there, imp)
    cycles = _cycles(edges)
    report = []
    for cycle in cycles:
        report.append(" -> ".join(cycle))
        report += [f"    {_describe(edges[a][b])}" for a, b in zip(cycle, cycle[1:])]
    assert not cycles, "import cycles between pagoda's rooms:\n" + "\n".join(report)
