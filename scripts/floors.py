"""Prints the lowest versions ``pyproject.toml`` declares, as pip requirements
(``jax==0.6.0`` ...), one per line, for ``scripts/test_floors.sh``: the core
dependencies, the ``fast`` extra (numba), and the zarr-python the tests write
stores with (``zarr`` and ``numcodecs`` of the ``test`` extra).

Each ``name>=X`` becomes ``name==X``; jax's floor also pins jaxlib, which jax
releases in lockstep. The ``zarr`` extra's own floor (zarr 2) is tested by
``tests/test_install.py`` in a fresh environment instead: the tests write
stores with zarr-python 3's API.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

# Of the ``test`` extra: what the tests' fixtures need beside the package.
TEST_TOOLS = ("zarr", "numcodecs")


def floors(pyproject: Path) -> list[str]:
    """``name==X`` for every ``name>=X`` of ``[project] dependencies``, of the
    ``fast`` extra and of :data:`TEST_TOOLS` in the ``test`` extra."""
    project = tomllib.loads(pyproject.read_text())["project"]
    extras = project["optional-dependencies"]
    tools = [d for d in extras["test"] if re.split(r"[<>=!~ \[]", d, maxsplit=1)[0] in TEST_TOOLS]
    pins = []
    for dep in project["dependencies"] + extras["fast"] + tools:
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
