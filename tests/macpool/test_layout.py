"""The import packages and how they depend on each other: router and node_agent build on macpool, macpool on
neither, and neither on the other (no cycle between top-level packages)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# package -> the top-level packages of this project it must not import
FORBIDDEN = {
    "macpool": {"router", "node_agent"},
    "router": {"node_agent"},
    "node_agent": {"router"},
}


def _imported_tops(path: Path) -> set[str]:
    tops = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            tops |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            tops.add(node.module.split(".")[0])
    return tops


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_a_package_imports_only_what_it_builds_on(package: str) -> None:
    offending = {
        str(path.relative_to(ROOT)): sorted(_imported_tops(path) & FORBIDDEN[package])
        for path in sorted((ROOT / package).rglob("*.py"))
    }
    assert {path: tops for path, tops in offending.items() if tops} == {}


def test_only_the_three_packages_are_installed() -> None:
    tops = {path.parent.name for path in ROOT.glob("*/__init__.py")}
    assert tops == {"macpool", "router", "node_agent"}
