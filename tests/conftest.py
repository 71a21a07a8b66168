"""Shared test settings (8 CPU devices, hypothesis profiles) and the fixtures
that several test modules use: small trained tokenizers, and storage servers
on 127.0.0.1 (one per test module, so that a module's tests share a server)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

# Before anything imports jax: every test sees 8 CPU devices.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()


import hypothesis
import numpy as np
import pytest
from buckets import S3, Served
from servers import aws_profile, fake_gcs, moto_s3, s3_files

import flat_tokens_jax as ftj

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
    (``<|endoftext|>``) and no beginning-of-sequence one, like GPT-2's, and
    one more added token, ``<|custom_eos|>``, for a config to name as its
    end of sequence; tests need no file from outside the repository."""
    from textdata import EOS, train_tokenizer  # tokenizers: not in the floors' environment

    path = tmp_path_factory.mktemp("tokenizer") / "eos-only.json"
    train_tokenizer([EOS, "<|custom_eos|>"]).save(str(path))
    return path


@pytest.fixture(scope="session")
def tok_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small trained BPE tokenizer JSON with :data:`textdata.SPECIALS` as
    added tokens: ``<|endoftext|>`` (end of sequence), ``<s>`` (beginning of
    sequence), ChatML's ``<|im_start|>`` and ``<|im_end|>``, and ``</s>``."""
    from textdata import SPECIALS, train_tokenizer

    path = tmp_path_factory.mktemp("tokenizer") / "bpe.json"
    train_tokenizer(SPECIALS).save(str(path))
    return path


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3]:
    """moto's S3 server, started once for the test module; its tests share the
    bucket, so each writes under names of its own."""
    with moto_s3() as base:
        credentials = aws_profile(tmp_path_factory.mktemp("aws"))
        yield S3(base, ftj.StoreOptions(endpoint=base, region="us-east-1", credentials=credentials))


@pytest.fixture(scope="module")
def gcs() -> Iterator[str]:
    """fake-gcs-server with the bucket ``bucket``, started once for the test
    module: its base URL."""
    with fake_gcs() as base:
        yield base


@pytest.fixture(scope="module")
def served(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Served]:
    """500 random sequences of 20 to 400 tokens, written with the test
    module's ``STORAGE_FORMAT`` to local disk and served from there as
    ``s3://bucket/ds`` by the read-only S3 stand-in (its work per request is a
    file read, so a loaded machine slows it little)."""
    storage_format: ftj.StorageFormat = request.module.STORAGE_FORMAT
    rng = np.random.default_rng(3)
    seqs = [rng.integers(1, 1000, int(n)) for n in rng.integers(20, 400, 500)]
    folder = tmp_path_factory.mktemp("served")
    ftj.write_dataset(folder / "bucket" / "ds", {"train": seqs}, storage_format=storage_format)
    with s3_files(folder) as base:
        options = ftj.StoreOptions(endpoint=base, region="us-east-1", credentials="anonymous")
        yield Served(
            "s3://bucket/ds", folder / "bucket" / "ds", int(base.rsplit(":", 1)[1]), options
        )
