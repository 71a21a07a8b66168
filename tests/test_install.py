"""A trainer pinned to zarr 2 installs the package: its dependencies resolve with
``zarr<3`` from PyPI, and in a fresh virtual environment with zarr 2 it reads a
store that tensorstore wrote and one whose filter only zarr-python decodes.

The environment is a real one (no system site packages), made and filled by uv
(the installer of the README's commands; its cache keeps the wheels between
runs). To stay cheap, only the resolution covers every dependency (``uv pip
install --dry-run``); the environment that reads gets what reading needs
(numpy, tensorstore, google-crc32c, ``zarr<3``) and the package itself without
its other dependencies: reading a store imports neither jax nor grain.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from rawstore import DELTA, SPEC_STARTS, SPEC_TOKENS, flat_split, write_raw
from uv import find_uv_bin

import flat_tokens_jax as ftj

ROOT = Path(__file__).resolve().parents[1]
PYCACHE = shutil.ignore_patterns("__pycache__", "*.pyc", "*.nbi", "*.nbc")

READ = """
import json, sys
import zarr
import flat_tokens_jax as ftj

out = {"zarr": zarr.__version__, "jax_imported": "jax" in sys.modules}
for name in sys.argv[1:]:
    ft = ftj.open_dataset(name)["train"]
    out[name] = {
        "sequences": [s.tolist() for s in ft.sequences(range(ft.num_sequences))],
        "starts": type(ft.starts).__name__,
    }
out["jax_imported"] = "jax" in sys.modules
print(json.dumps(out))
"""


def uv(venv: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``uv pip ARGS`` into ``venv``."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run(
        [find_uv_bin(), "pip", *args, "-p", str(venv / "bin" / "python")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=True,
    )


@pytest.mark.install
def test_installs_beside_zarr_2_and_reads_stores(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, 50_000, int(n)).tolist() for n in rng.integers(1, 30, 40)]
    written = tmp_path / "by_tensorstore"
    ftj.write_dataset(written, {"train": seqs})
    delta = tmp_path / "delta_v2"
    write_raw(delta, {"train": flat_split(SPEC_TOKENS, SPEC_STARTS, 8, starts_kwargs=DELTA)}, 2)

    # a build writes into the source tree: build from a copy, leaving the checkout alone.
    source = tmp_path / "source"
    shutil.copytree(ROOT / "flat_tokens_jax", source / "flat_tokens_jax", ignore=PYCACHE)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    venv = tmp_path / "venv"
    subprocess.run([find_uv_bin(), "venv", "-q", "-p", sys.executable, str(venv)], check=True)
    resolved = uv(venv, "install", "--dry-run", f"{source}[zarr]", "zarr<3")
    # "Would install N packages", then a line " + name==version" each
    report = dict(
        line.strip()[2:].split("==")
        for line in resolved.stderr.splitlines()
        if line.startswith(" + ") and "==" in line
    )
    assert report["zarr"].startswith("2."), resolved.stderr
    assert {"jax", "jaxlib", "tensorstore", "grain"} <= set(report), resolved.stderr
    assert "flat-tokens-jax @ " in resolved.stderr, resolved.stderr
    uv(venv, "install", "-q", "zarr<3", "numpy", "tensorstore", "google-crc32c")
    uv(venv, "install", "-q", "--no-deps", str(source))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [str(venv / "bin" / "python"), "-c", textwrap.dedent(READ), str(written), str(delta)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    assert got["zarr"].startswith("2."), got["zarr"]
    assert not got["jax_imported"]
    assert got[str(written)] == {"sequences": seqs, "starts": "TensorStoreArray"}
    assert got[str(delta)] == {
        "sequences": [[1, 2], [3, 4, 5], [6, 7, 8]],
        "starts": "ZarrPythonArray",
    }
