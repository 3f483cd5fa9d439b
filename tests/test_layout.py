"""The package layout over src/ (ARCHITECTURE §2), read from the source with `ast`, lazy and
`TYPE_CHECKING` imports included.

- Packages are layered in the order of the data flow (LAYERS): a module imports only packages of a lower
  layer than its own, or its own package. Same-layer packages (engines/, codec/, client/) never import
  each other.
- `scheduler/` imports no torch: it plans with the step types of `orpheus_serve.scheduler.step` and is
  tested on CPU with hand-built engine outputs.
- nothing imports `api/` (the gateway) but `api/` itself, the entry point `__main__` and `deploy/`
  (deployments wrap the server's app).
- no import cycles: the module graph has no strongly connected component of more than one module.
- at most six modules sit loose at the top of the package; no function is longer than 80 lines and no
  class longer than 400 (generated protobuf modules aside).

Every check has a test that plants a violation and sees it caught.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "orpheus_serve"
API_ENTRY_POINTS = {"orpheus_serve.__main__"}
API_WRAPPERS = "orpheus_serve.deploy"
# Lowest first. A package imports only those of lower layers (and itself); "" is the package's __init__.
LAYERS: tuple[frozenset[str], ...] = tuple(frozenset(layer) for layer in (
    {""},  # __version__
    {"config"},
    {"shapes"},  # padded batch buckets (CUDA graphs of the engine and the codec)
    {"token_format"},
    {"audio"},  # PCM and audio encodings
    {"proto"},  # the gRPC messages (their audio-encoding table comes from audio/)
    {"weights"},  # model paths, tiny models
    {"scheduler"},  # sessions, slots, policies, step types: pure Python
    {"request"},  # request types, errors, text, validation
    {"replay"},  # a measured card's costs, for the sim engine and the sim codec (no torch)
    {"engines", "codec", "client"},  # token engines; SNAC decoders; the client package (no server code)
    {"core", "benchmarking"},  # the engine core and its clients; benchmarks drive the client package
    {"metrics"},  # the request tally and Prometheus collectors (read core stats)
    {"service"},  # the asyncio facade per API process
    {"api"},  # gateways, the server process, launch
    {"deploy", "__main__"},  # deployments and the command line wrap the server
))
MAX_LOOSE_MODULES = 6
MAX_FUNCTION_LINES = 80
MAX_CLASS_LINES = 400
GENERATED = ("orpheus_serve.proto.orpheus_pb2", "orpheus_serve.proto.orpheus_pb2_grpc")


def module_name(path: Path) -> str:
    parts = ("orpheus_serve", *path.relative_to(PACKAGE).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    name = module_name(path)
    return imports_in(path.read_text(), name if path.name == "__init__.py" else name.rpartition(".")[0])


def imports_in(source: str, package: str) -> set[str]:
    """Every module `source` (a module of `package`) imports, absolute, anywhere (functions included)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.add(target)
            # `from . import x` / `from ..engines import sim_engine` import submodules by name.
            found.update(f"{target}.{alias.name}" for alias in node.names)
    return found


def in_package(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


SOURCES = {module_name(p): imports_of(p) for p in sorted(PACKAGE.rglob("*.py"))}


def offenders(importer: str, forbidden: tuple[str, ...]) -> list[str]:
    return sorted(
        f"{mod} imports {target}"
        for mod, targets in SOURCES.items()
        if in_package(mod, importer)
        for target in targets
        if any(in_package(target, f) for f in forbidden)
    )


def test_sources_were_found() -> None:
    assert "orpheus_serve.scheduler.scheduler" in SOURCES
    assert "orpheus_serve.scheduler.step" in SOURCES["orpheus_serve.scheduler.scheduler"]


@pytest.mark.parametrize(("importer", "forbidden"), [
    ("orpheus_serve.scheduler", ("orpheus_serve.engines", "orpheus_serve.codec", "orpheus_serve.api", "torch")),
    ("orpheus_serve.engines", ("orpheus_serve.codec", "orpheus_serve.api")),
    ("orpheus_serve.codec", ("orpheus_serve.engines", "orpheus_serve.api")),
    ("orpheus_serve.client", ("orpheus_serve.core", "orpheus_serve.service", "orpheus_serve.api")),
])
def test_package_imports_nothing_it_must_not(importer: str, forbidden: tuple[str, ...]) -> None:
    assert offenders(importer, forbidden) == []


def test_only_entry_points_import_the_gateway() -> None:
    outside = [
        f"{mod} imports {target}"
        for mod, targets in SOURCES.items()
        if not in_package(mod, "orpheus_serve.api") and mod not in API_ENTRY_POINTS
        and not in_package(mod, API_WRAPPERS)
        for target in targets
        if in_package(target, "orpheus_serve.api")
    ]
    assert outside == []


def test_deploy_is_the_only_package_beside_the_entry_points_that_may_import_the_gateway() -> None:
    assert any(in_package(t, "orpheus_serve.api") for t in SOURCES["orpheus_serve.deploy.ray.app"])
    # Nothing on the serving path imports deploy/ either: it sits outside, like the entry points.
    inward = [f"{mod} imports {target}" for mod, targets in SOURCES.items()
              if not in_package(mod, API_WRAPPERS) for target in targets if in_package(target, API_WRAPPERS)]
    assert inward == []


def test_the_checks_can_fail() -> None:
    # A lazy relative import inside a function of the scheduler is seen and resolved.
    probe = "def lazy():\n    from ..engines import sim_engine\n    import torch\n"
    found = imports_in(probe, "orpheus_serve.scheduler")
    assert {"orpheus_serve.engines", "orpheus_serve.engines.sim_engine", "torch"} <= found
    SOURCES["orpheus_serve.scheduler.probe"] = found
    try:
        assert offenders("orpheus_serve.scheduler", ("orpheus_serve.engines", "torch")) == [
            "orpheus_serve.scheduler.probe imports orpheus_serve.engines",
            "orpheus_serve.scheduler.probe imports orpheus_serve.engines.sim_engine",
            "orpheus_serve.scheduler.probe imports torch",
        ]
    finally:
        del SOURCES["orpheus_serve.scheduler.probe"]


# ---------------------------------------------------------------- layers


def top_package(module: str) -> str:
    """"api" for orpheus_serve.api.server, "config" for orpheus_serve.config, "" for orpheus_serve itself."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def layer_of(package: str) -> int:
    for rank, layer in enumerate(LAYERS):
        if package in layer:
            return rank
    raise KeyError(f"orpheus_serve.{package} is in no layer of tests/test_layout.py: add it to LAYERS")


def internal_edges(sources: Mapping[str, Iterable[str]]) -> dict[str, set[str]]:
    """module -> the modules of the package it imports (names that are attributes, not modules, dropped)."""
    return {mod: {target for target in targets if target in sources and target != mod}
            for mod, targets in sources.items()}


def layer_violations(sources: Mapping[str, Iterable[str]]) -> list[str]:
    found = []
    for mod, targets in internal_edges(sources).items():
        own = top_package(mod)
        for target in targets:
            other = top_package(target)
            if other != own and layer_of(other) >= layer_of(own):
                found.append(f"{mod} imports {target}")
    return sorted(found)


def test_every_package_has_a_layer() -> None:
    for mod in SOURCES:
        layer_of(top_package(mod))


def test_packages_import_only_lower_layers() -> None:
    assert layer_violations(SOURCES) == []


def test_the_layer_check_can_fail() -> None:
    planted = {**SOURCES, "orpheus_serve.scheduler.probe": {"orpheus_serve.request.types"},
               "orpheus_serve.engines.probe": {"orpheus_serve.codec.base"}}
    assert layer_violations(planted) == ["orpheus_serve.engines.probe imports orpheus_serve.codec.base",
                                         "orpheus_serve.scheduler.probe imports orpheus_serve.request.types"]


# ---------------------------------------------------------------- cycles


def import_cycles(sources: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    graph = internal_edges(sources)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return sorted(cycles)


def test_no_import_cycles() -> None:
    assert import_cycles(SOURCES) == []


def test_the_cycle_check_can_fail() -> None:
    # A function-level import and a TYPE_CHECKING one close a cycle through an existing module.
    probe = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .server import OrpheusServer\n"
    lazy = "def lazy():\n    from .probe import x\n"
    planted = {**SOURCES, "orpheus_serve.api.probe": imports_in(probe, "orpheus_serve.api")}
    planted["orpheus_serve.api.server"] = {*SOURCES["orpheus_serve.api.server"],
                                           *imports_in(lazy, "orpheus_serve.api")}
    assert import_cycles(planted) == [["orpheus_serve.api.probe", "orpheus_serve.api.server"]]
    # A longer one: a -> b -> c -> a, beside an acyclic d -> a.
    ring = {"p.a": {"p.b"}, "p.b": {"p.c"}, "p.c": {"p.a"}, "p.d": {"p.a"}}
    assert import_cycles(ring) == [["p.a", "p.b", "p.c"]]


# ---------------------------------------------------------------- sizes


def loose_modules(package: Path) -> list[str]:
    return sorted(path.name for path in package.glob("*.py"))


def oversized(source: str, module: str) -> list[str]:
    """Functions over MAX_FUNCTION_LINES lines and classes over MAX_CLASS_LINES in `source`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            limit, kind = MAX_FUNCTION_LINES, "function"
        elif isinstance(node, ast.ClassDef):
            limit, kind = MAX_CLASS_LINES, "class"
        else:
            continue
        lines = node.end_lineno - node.lineno + 1  # type: ignore[operator]
        if lines > limit:
            found.append(f"{module}: {kind} {node.name} has {lines} lines (at most {limit})")
    return found


def test_few_loose_modules_at_the_top() -> None:
    loose = loose_modules(PACKAGE)
    assert len(loose) <= MAX_LOOSE_MODULES, loose


def test_no_oversized_function_or_class() -> None:
    found = [entry for path in sorted(PACKAGE.rglob("*.py")) if module_name(path) not in GENERATED
             for entry in oversized(path.read_text(), module_name(path))]
    assert found == []


def test_the_size_checks_can_fail(tmp_path: Path) -> None:
    for name in ("__init__", "config", "a", "b", "c", "d", "e"):
        (tmp_path / f"{name}.py").write_text("")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "f.py").write_text("")
    assert len(loose_modules(tmp_path)) == 7 > MAX_LOOSE_MODULES
    function = "def long():\n" + "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))  # 81 lines
    klass = "class Big:\n" + "".join(f"    y{i} = {i}\n" for i in range(MAX_CLASS_LINES))  # 401 lines
    fitting = "def short():\n" + "    z = 0\n" * (MAX_FUNCTION_LINES - 1)  # exactly 80
    assert oversized(f"{function}\n{klass}\n{fitting}", "probe") == [
        f"probe: function long has {MAX_FUNCTION_LINES + 1} lines (at most {MAX_FUNCTION_LINES})",
        f"probe: class Big has {MAX_CLASS_LINES + 1} lines (at most {MAX_CLASS_LINES})",
    ]


def test_paths_derived_from_a_modules_location_point_into_the_repository() -> None:
    # A module that moves deeper must still find the repository's files (models/, config/, the playground).
    from orpheus_serve.api.http import PLAYGROUND_DIR
    from orpheus_serve.benchmarking.launch import REPO_ROOT as BENCH_ROOT
    from orpheus_serve.config import DEFAULT_CONFIG_PATH
    from orpheus_serve.weights.paths import REPO_ROOT

    root = PACKAGE.parents[1]
    assert REPO_ROOT == BENCH_ROOT == root and (root / "pyproject.toml").exists()
    assert DEFAULT_CONFIG_PATH.exists() and (PLAYGROUND_DIR / "index.html").exists()
