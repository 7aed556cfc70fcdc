"""The layout holds (docs/architecture.md, "Rooms and arrows"): every package folder is installed,
arrows point one way, and the modules of the package's root (jetrl/plugins.py) are leaves every
room may use."""

from __future__ import annotations

import ast
import gc
import os
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PACKAGE_DIR: dict[str, str] = PYPROJECT["tool"]["setuptools"]["package-dir"]

# Which jetrl subpackages each top-level folder may import (docs/architecture.md, "Rooms and arrows").
ALLOWED = {
    "bus": set(),
    "policy": set(),
    "store": {"bus"},
    "producers": {"bus", "policy"},
    "consumers": {"bus", "policy", "store"},
    "deploy": {"bus", "policy", "store", "producers", "consumers"},
}


def test_every_package_folder_is_listed_in_pyproject() -> None:
    listed = set(PYPROJECT["tool"]["setuptools"]["packages"])
    found = set()
    for top, folder in PACKAGE_DIR.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join([top, *rel.parts]) if rel.parts else top)
    assert found - listed == set(), "package folders missing from [tool.setuptools] packages"


def _imports(path: Path) -> set[str]:
    # No collection mid-parse: a finalizer running Python code then (an un-awaited task's error
    # logged) fails CPython 3.11's AST constructor ("recursion depth mismatch").
    collecting = gc.isenabled()
    gc.disable()
    try:
        tree = ast.parse(path.read_text())
    finally:
        if collecting:
            gc.enable()
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


# Modules of the package's own folder (jetrl/): leaves that import nothing of ours, so that every
# room may import them (the plugin registry, which bus/ and policy/ use too).
ROOT_MODULES = sorted(p for p in (ROOT / "jetrl").glob("*.py") if p.name != "__init__.py")


@pytest.mark.parametrize("path", ROOT_MODULES, ids=lambda p: p.name)
def test_the_package_root_holds_only_leaves(path: Path) -> None:
    ours = sorted(m for m in _imports(path) if m == "jetrl" or m.startswith("jetrl."))
    assert not ours, f"{path.relative_to(ROOT)} imports {ours}"


@pytest.mark.parametrize("folder", sorted(ALLOWED))
def test_imports_point_one_way(folder: str) -> None:
    bad = []
    for path in (ROOT / folder).rglob("*.py"):
        for mod in _imports(path):
            parts = mod.split(".")
            if parts[0] != "jetrl" or len(parts) < 2 or parts[1] not in ALLOWED:
                continue
            if parts[1] != folder and parts[1] not in ALLOWED[folder]:
                bad.append(f"{path.relative_to(ROOT)} imports {mod}")
    assert not bad, "\n".join(bad)


def test_consumers_never_import_each_other() -> None:
    bad = []
    for path in (ROOT / "consumers").rglob("*.py"):
        rel = path.relative_to(ROOT / "consumers").parts
        if len(rel) < 2:
            continue
        mine = rel[0]
        for mod in _imports(path):
            parts = mod.split(".")
            if parts[:2] == ["jetrl", "consumers"] and len(parts) > 2 and parts[2] != mine:
                bad.append(f"{path.relative_to(ROOT)} imports {mod}")
    assert not bad, "\n".join(bad)


def test_typecheck_view_mirrors_package_dir() -> None:
    # mypy reads the package through .typecheck/jetrl (pyproject.toml, [tool.mypy]): one
    # relative symlink per folder of package-dir, so a fresh clone checks the same files.
    view = ROOT / ".typecheck"
    linked = {p.name for p in (view / "jetrl").iterdir()}
    rooms = {top.split(".", 1)[1] for top in PACKAGE_DIR if top != "jetrl"}
    expected = {"__init__.py"} | {p.name for p in ROOT_MODULES} | rooms
    assert linked == expected
    for path in ROOT_MODULES:
        link = view / "jetrl" / path.name
        assert link.is_symlink() and not Path(os.readlink(link)).is_absolute(), link
        assert link.resolve() == path.resolve(), link
    for top, folder in PACKAGE_DIR.items():
        link = view.joinpath(*top.split("."))
        if top == "jetrl":
            link = link / "__init__.py"
            folder = f"{folder}/__init__.py"
        assert link.is_symlink() and not Path(os.readlink(link)).is_absolute(), link
        assert link.resolve() == (ROOT / folder).resolve(), link
