"""Every Python package in the tree is installed: setuptools' explicit package list must name it."""

from __future__ import annotations

import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ROOTS = {
    "factory": "factory",
    "schemas": "factory.schemas",
    "kernels": "factory.kernels",
    "blueprints": "factory.blueprints",
    "data_recipes": "factory.data_recipes",
}


def test_every_package_is_listed_in_pyproject() -> None:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    found = set()
    for folder, dotted in ROOTS.items():
        for init in (REPO / folder).rglob("__init__.py"):
            parts = init.parent.relative_to(REPO / folder).parts
            found.add(".".join([dotted, *parts]))
    assert found - listed == set(), "add these to [tool.setuptools] packages"
    assert listed - found == set(), "these are listed but do not exist"
