"""The code blocks of README.md and docs/ (collected by pytest-codeblocks) run in a
workspace made once per session: a folder holding what the blocks name by relative
path, so every example runs as written, offline and on tiny data.

The workspace holds ``configs/`` and ``scripts/`` (links to the repository's) and
the sample data that ``scripts/sample_data.py`` makes, as a reader makes it
(``tokenizer.json``, ``corpus.jsonl``, ``chats.jsonl`` and the datasets
``data/corpus``, ``data/web``, ``data/books`` and ``data/code``; see that script). A block
runs with the workspace as its working directory and the ``flat-tokens``
command of this interpreter's environment first on ``PATH``; jax sees 8 CPU
devices, as in ``tests/``.

It also gives the whole test session (the xdist workers and every process a
test or a block starts, which inherit the environment) caches of its own, made
by the first process to load this file and removed when its session ends: jax's
persistent compilation cache, so that the many trainer, recipe and multi-host
processes the tests start compile each program once, and, under
``PYTHONDONTWRITEBYTECODE`` (an installer such as uv writes no bytecode either),
a bytecode folder (``PYTHONPYCACHEPREFIX``), so that those processes do not
each compile every module they import.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

DEVICES = "--xla_force_host_platform_device_count=8"
if DEVICES not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {DEVICES}".strip()

ROOT = Path(__file__).resolve().parent

_workspace: Path | None = None
_saved: dict[str, Any] = {}
_caches: list[Path] = []  # the session caches this process made, to remove at its end


def _session_cache(variable: str) -> None:
    os.environ[variable] = tempfile.mkdtemp(prefix=f"ftj-{variable.lower()}-")
    _caches.append(Path(os.environ[variable]))


if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _session_cache("JAX_COMPILATION_CACHE_DIR")
    # every program: a test's are small, and each is compiled again in many processes
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
if "PYTHONPYCACHEPREFIX" not in os.environ and os.environ.pop("PYTHONDONTWRITEBYTECODE", None):
    _session_cache("PYTHONPYCACHEPREFIX")


# The files that take longest (their time in a run of the README's command),
# longest first. With ``--dist loadfile`` each file goes whole to the worker
# that asks for work next: these start first, so that the workers end
# together (xdist's own order, by number of tests, would start them last).
SLOWEST_FIRST = (
    "tests/test_remote.py",
    "tests/test_train_phases.py",
    "tests/test_beam.py",
    "tests/test_train_example.py",
    "tests/test_grain.py",
    "tests/test_install.py",
    "tests/test_recipes.py",
    "tests/test_hostile_secrets.py",
    "docs/guide/trainers.md",
    "tests/test_train_steered.py",
    "tests/test_sharding.py",
    "tests/test_multihost.py",
    "tests/test_layouts.py",
    "tests/test_steering.py",
    "tests/test_sourcefield.py",
    "tests/test_hostile_integrity.py",
    "tests/test_hostile_bounds.py",
    "tests/test_convert.py",
    "tests/test_train_grain.py",
)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {path: i for i, path in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))


def _is_code_block(item: pytest.Item) -> bool:
    return type(item).__module__.startswith("pytest_codeblocks")


def _make_workspace() -> Path:
    spec = importlib.util.spec_from_file_location(
        "sample_data", ROOT / "scripts" / "sample_data.py"
    )
    assert spec is not None and spec.loader is not None
    sample_data = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sample_data)
    work = Path(tempfile.mkdtemp(prefix="ftj-docs-"))
    for name in ("configs", "scripts"):
        (work / name).symlink_to(ROOT / name)
    return Path(sample_data.make(work))


def pytest_runtest_setup(item: pytest.Item) -> None:
    global _workspace
    if not _is_code_block(item):
        return
    if _workspace is None:
        _workspace = _make_workspace()
    _saved["cwd"] = os.getcwd()
    _saved["env"] = {k: os.environ.get(k) for k in ("PATH", "XDG_CACHE_HOME")}
    os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]])
    os.environ["XDG_CACHE_HOME"] = str(_workspace / ".cache")
    os.chdir(_workspace)


def pytest_runtest_teardown(item: pytest.Item) -> None:
    if not _is_code_block(item) or "cwd" not in _saved:
        return
    os.chdir(_saved.pop("cwd"))
    for key, value in _saved.pop("env").items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def pytest_sessionfinish(session: pytest.Session) -> None:
    for made in [_workspace, *_caches]:
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)
