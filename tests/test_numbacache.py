"""flat_tokens_jax.core.numbacache: a kernel's on-disk cache lies in a folder of
its numba version, in whichever folder numba would choose (issue 46: two
environments of different numba versions over one tree read each other's
kernels), and nothing of it in that folder itself.

Each case copies the kernels module into a folder of its own,
compiles a kernel there in a new process, then in a second one, and looks for
numba's index (``.nbi``) and data (``.nbc``) files under the test's folder.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

numba = pytest.importorskip("numba")

ROOT = Path(__file__).resolve().parents[1]
VERSION_FOLDER = f"numba-{numba.__version__}"

_COMPILE = """
import json, sys
import numpy as np
sys.path.insert(0, sys.argv[1])
import kernels
kernel = kernels._row_rejected
rejected = kernel(np.full(12, 5, np.int32), np.ones(12, np.int32), 1, 2, 4)
stats = kernel.stats
print(json.dumps({"rejected": bool(rejected), "hits": sum(stats.cache_hits.values()),
                  "misses": sum(stats.cache_misses.values())}))
"""


def _compile(tree: Path, env: dict[str, str]) -> dict[str, int]:
    out = subprocess.run(
        [sys.executable, "-c", _COMPILE, str(tree)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.parametrize("where", ["tree", "NUMBA_CACHE_DIR", "user", "nowhere"])
def test_a_kernel_is_cached_in_a_folder_of_its_numba_version(tmp_path: Path, where: str) -> None:
    """numba's folders in its order: ``NUMBA_CACHE_DIR`` where set, else
    ``__pycache__`` beside the source, else the user's cache directory
    (``XDG_CACHE_HOME``), each passed over when it cannot be written (here: a
    file where the folder would be; the tests may run as root, whom file
    modes do not stop); with none, the kernel compiles in each process."""
    tree = tmp_path / "tree"
    tree.mkdir()
    shutil.copy(ROOT / "flat_tokens_jax" / "core" / "kernels.py", tree)
    env = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_")}
    env["XDG_CACHE_HOME"] = str(tmp_path / "user")
    if where == "NUMBA_CACHE_DIR":
        env["NUMBA_CACHE_DIR"] = str(tmp_path / "numba-cache")
    if where in ("user", "nowhere"):
        (tree / "__pycache__").write_bytes(b"")
    if where == "nowhere":
        (tmp_path / "user").write_bytes(b"")
    runs = [_compile(tree, env) for _ in range(2)]
    assert all(run["rejected"] for run in runs)  # one token repeated 12 times
    files = sorted(p for p in tmp_path.rglob("*") if p.suffix in (".nbi", ".nbc"))
    if where == "nowhere":
        assert files == []
        assert [run["misses"] for run in runs] == [1, 1]
        return
    # numba's own folder: the source's __pycache__, or the one folder (named
    # after the source's directory) in the cache directory.
    if where == "tree":
        base = tree / "__pycache__"
    else:
        cache_dir = tmp_path / ("numba-cache" if where == "NUMBA_CACHE_DIR" else "user/numba")
        (base,) = cache_dir.iterdir()
    assert {p.parent for p in files} == {base / VERSION_FOLDER}
    assert sorted(p.suffix for p in files) == [".nbc", ".nbi"]
    assert files[0].name.startswith("kernels._row_rejected-")
    assert (runs[0]["misses"], runs[1]["misses"], runs[1]["hits"]) == (1, 0, 1)
