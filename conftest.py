"""The code blocks of README.md and docs/ (collected by pytest-codeblocks) run in a
workspace made once per session: a folder holding what the blocks name by relative
path, so every example runs as written, offline and on tiny data.

The workspace holds ``configs/`` and ``scripts/`` (links to the repository's),
``tokenizer.json`` (a byte-level BPE of 500 ids trained here, with the ChatML
tokens ``<|im_start|>`` and ``<|im_end|>`` and ``<|endoftext|>`` as added tokens),
``corpus.jsonl`` (text documents), ``chats.jsonl`` (one conversation) and the
small datasets ``data/corpus``, ``data/web`` and ``data/books`` (``train`` and
``validation``; ids below 500, so the tokenizer decodes them). A block runs
with the workspace as its working directory and the ``flat-tokens`` command of
this interpreter's environment first on ``PATH``; jax sees 8 CPU devices, as in
``tests/``.
"""

from __future__ import annotations

import json
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
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT = {
    "system": "Be brief.",
    "conversations": [
        {"from": "human", "value": "What is up?"},
        {"from": "gpt", "value": "Hello!"},
    ],
}

_workspace: Path | None = None
_saved: dict[str, Any] = {}


def _is_code_block(item: pytest.Item) -> bool:
    return type(item).__module__.startswith("pytest_codeblocks")


def _make_workspace() -> Path:
    import numpy as np

    import flat_tokens_jax as ftj

    sys.path.insert(0, str(ROOT / "tests"))
    from textdata import corpus_texts, train_tokenizer

    work = Path(tempfile.mkdtemp(prefix="ftj-docs-"))
    for name in ("configs", "scripts"):
        (work / name).symlink_to(ROOT / name)
    train_tokenizer(SPECIALS).save(str(work / "tokenizer.json"))
    texts = corpus_texts(40, 1500)
    (work / "corpus.jsonl").write_text(
        "".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8"
    )
    (work / "chats.jsonl").write_text(json.dumps(CHAT) + "\n", encoding="utf-8")
    rng = np.random.default_rng(0)
    for name in ("corpus", "web", "books"):
        docs = [rng.integers(1, 500, n) for n in rng.integers(20, 400, 300)]
        ftj.write_dataset(work / "data" / name, {"train": docs[:280], "validation": docs[280:]})
    return work


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
    if _workspace is not None:
        shutil.rmtree(_workspace, ignore_errors=True)
