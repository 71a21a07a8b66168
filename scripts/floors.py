"""Prints the lowest versions ``pyproject.toml`` declares for the core dependencies
and the ``fast`` extra (numba), as pip requirements (``jax==0.5.0`` ...), one
per line, for ``scripts/test_floors.sh``.

Each ``name>=X`` becomes ``name==X``; jax's floor also pins jaxlib, which jax
releases in lockstep.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path


def floors(pyproject: Path) -> list[str]:
    """``name==X`` for every ``name>=X`` of ``[project] dependencies`` and of the
    ``fast`` extra."""
    project = tomllib.loads(pyproject.read_text())["project"]
    deps = project["dependencies"] + project["optional-dependencies"]["fast"]
    pins = []
    for dep in deps:
        found = re.fullmatch(r"([A-Za-z0-9_.-]+)>=([0-9][0-9A-Za-z.]*)", dep.replace(" ", ""))
        if found is None:
            raise ValueError(f"{pyproject}: dependency {dep!r} is not of the form name>=X")
        name, version = found.groups()
        pins.append(f"{name}=={version}")
        if name == "jax":
            pins.append(f"jaxlib=={version}")
    return pins


if __name__ == "__main__":
    print("\n".join(floors(Path(__file__).resolve().parents[1] / "pyproject.toml")))
