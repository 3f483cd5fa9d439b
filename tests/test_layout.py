"""Import direction over src/ (DESIGN §2), read from the source with `ast`, lazy imports included.

- `scheduler/` imports no module of `engines/`, `codec/` or `api/`, and no torch: it plans with the
  step types of `orpheus_serve.scheduler.step` and is tested on CPU with hand-built engine outputs.
- `engines/` and `codec/` never import each other or `api/`.
- nothing imports `api/` (the gateway) but `api/` itself, the entry point `__main__` and `deploy/`
  (deployments wrap the server's app: DESIGN §2).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "orpheus_serve"
API_ENTRY_POINTS = {"orpheus_serve.__main__"}
API_WRAPPERS = "orpheus_serve.deploy"


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
