"""Shared test settings: 8 CPU devices, hypothesis profiles, small dataset helpers."""

from __future__ import annotations

import os
from pathlib import Path

# Before anything imports jax: every test sees 8 CPU devices.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()


import hypothesis
import pytest

hypothesis.settings.register_profile("default", deadline=None, max_examples=60)
hypothesis.settings.register_profile("ci", deadline=None, max_examples=60, derandomize=True)
hypothesis.settings.load_profile("ci" if os.environ.get("CI") else "default")


@pytest.fixture(autouse=True)
def _plan_cache_in_tmp(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Packing plans that a test leaves to the default cache go to a tmp dir, not ~/.cache."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.getbasetemp() / "xdg-cache"))


@pytest.fixture(scope="session")
def eos_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small trained BPE tokenizer JSON with an end-of-sequence token
    (``<|endoftext|>``) and no beginning-of-sequence one, like GPT-2's; tests
    need no file from outside the repository."""
    from textdata import train_tokenizer

    path = tmp_path_factory.mktemp("tokenizer") / "eos-only.json"
    train_tokenizer(["<|endoftext|>"]).save(str(path))
    return path
