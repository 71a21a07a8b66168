"""The project's own promises: CI runs the README's test command, and that command
tests the dependency floors pyproject.toml declares."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_test_command() -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Two commands", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)\n```", section, re.S)
    assert len(blocks) == 2, blocks
    return blocks[1]


def test_ci_runs_exactly_the_readme_test_command() -> None:
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert lines[-1] == readme_test_command()
    assert readme_test_command().endswith(" && scripts/test_floors.sh")


def test_floors_are_the_declared_lower_bounds() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "floors.py")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    pyproject = (ROOT / "pyproject.toml").read_text()
    for name in ("jax", "numpy", "zarr", "numcodecs", "tensorstore", "grain", "numba"):
        declared = re.search(rf'"{name}>=([^"]+)"', pyproject)
        assert declared is not None, name
        assert f"{name}=={declared.group(1)}" in out
    jax = next(p for p in out if p.startswith("jax=="))
    assert f"jaxlib=={jax.split('==')[1]}" in out
    readme = (ROOT / "README.md").read_text()
    for pin in out:
        if not pin.startswith("jaxlib"):
            assert pin.replace("==", " ") in readme, f"README names another floor than {pin}"
