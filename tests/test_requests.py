"""Requests a batch costs on a remote store (moto's S3): the reads of one
request go out in one tensorstore batch, so rows whose windows share a chunk
read it once and a shard's chunks are fetched in few requests."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from buckets import S3

import flat_tokens_jax as ftj
from flat_tokens_jax.store.store import remote_bytes, remote_reads

pytestmark = pytest.mark.remote
STORAGE_FORMAT = ftj.StorageFormat(shard_tokens=1 << 14, chunk_tokens=1 << 10)
RNG = np.random.default_rng(7)
SEQS = [RNG.integers(1, 1000, int(n)).tolist() for n in RNG.integers(20, 300, 200)]


@pytest.fixture(scope="module")
def uncached(s3: S3) -> ftj.StoreOptions:
    """Options that reach moto's S3 server with no cache: every read goes to
    the server, to be counted."""
    return dataclasses.replace(s3.options, cache_bytes=0)


@pytest.mark.parametrize("packing", [True, False])
def test_rows_that_share_chunks_cost_fewer_requests_than_rows(
    uncached: ftj.StoreOptions, tmp_path: Path, packing: bool
) -> None:
    url = f"s3://bucket/shared-{packing}"
    ftj.write_dataset(url, {"train": SEQS}, storage_format=STORAGE_FORMAT, options=uncached)
    ftj.write_dataset(tmp_path, {"train": SEQS}, storage_format=STORAGE_FORMAT)
    cfg = ftj.LoaderConfig(batch_size=32, seq_len=64, packing=packing, shuffle=False, prefetch=0)
    loader = ftj.Loader(ftj.open_dataset(url, uncached)["train"], cfg)
    here = ftj.Loader(ftj.open_dataset(tmp_path)["train"], cfg)
    for step in (0, 1):
        loader.host_batch(step)  # the first touch checks the chunks, reading them whole
        reads, got = remote_reads()["s3"], remote_bytes()["s3"]
        batch = loader.host_batch(step)
        requests = remote_reads()["s3"] - reads
        # 32 consecutive rows lie in a few chunks of 1,024 tokens of one
        # shard (padded rows: their sequences' bounds too, in seq_starts):
        # the shard's index, then its chunks in one request. Before: 3
        # requests (packed) and 9 (padded), the chunks of a shard fetched
        # apart.
        assert requests <= (2 if packing else 4) < cfg.batch_size
        chunks = 4 if packing else 2 * 4  # whole chunks of 4-byte values, and indexes
        assert 0 < remote_bytes()["s3"] - got <= chunks * (4 << 10) + 4 * 1024
        for key, value in here.host_batch(step).items():
            np.testing.assert_array_equal(batch[key], value)
