"""Real GCS and S3 servers on 127.0.0.1 (fake-gcs-server, moto), started by the tests."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from servers import DelayProxy, aws_profile, fake_gcs, moto_s3

import flat_tokens_jax as ftj

pytestmark = pytest.mark.remote
SEQS = [[i % 500 + 1] * (i % 37 + 1) for i in range(400)]


@pytest.fixture(scope="module")
def gcs_bucket() -> Iterator[str]:
    with fake_gcs() as base:
        # tensorstore reads these at its first gcs open in this process.
        os.environ["TENSORSTORE_GCS_HTTP_URL"] = base
        os.environ["GOOGLE_AUTH_TOKEN_FOR_TESTING"] = "test"
        yield "gs://bucket"


@pytest.fixture(scope="module")
def s3_options(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ftj.StoreOptions]:
    with moto_s3() as base:
        yield ftj.StoreOptions(
            endpoint=base,
            region="us-east-1",
            credentials=aws_profile(tmp_path_factory.mktemp("aws")),
        )


def check_remote_copy(url: str, options: ftj.StoreOptions, local: Path) -> None:
    layout = ftj.Layout(shard_tokens=1 << 10, chunk_tokens=1 << 6)
    ftj.write_dataset(local, {"train": SEQS, "validation": SEQS[:9]}, layout=layout)
    ftj.write_dataset(url, {"train": SEQS, "validation": SEQS[:9]}, layout=layout, options=options)
    ftj.validate(url, options)
    assert ftj.summary(url, options)["splits"]["train"]["num_tokens"] == sum(map(len, SEQS))
    with pytest.raises(FileExistsError):
        ftj.write_dataset(url, {"train": SEQS}, options=options)
    for packing in (True, False):
        cfg = ftj.LoaderConfig(batch_size=8, seq_len=32, packing=packing, seed=2)
        remote = ftj.Loader(ftj.open_dataset(url, options)["train"], cfg)
        here = ftj.Loader(ftj.open_dataset(local)["train"], cfg)
        for step in (0, 3, 17):
            for key, value in remote.host_batch(step).items():
                np.testing.assert_array_equal(value, here.host_batch(step)[key])


def test_gcs_round_trip_equals_local(gcs_bucket: str, tmp_path: Path) -> None:
    check_remote_copy(f"{gcs_bucket}/ds", ftj.StoreOptions(), tmp_path / "local")


def test_s3_round_trip_equals_local(s3_options: ftj.StoreOptions, tmp_path: Path) -> None:
    check_remote_copy("s3://bucket/ds", s3_options, tmp_path / "local")


def test_interrupted_remote_write_does_not_open(s3_options: ftj.StoreOptions) -> None:
    with (
        pytest.raises(RuntimeError),
        ftj.DatasetWriter("s3://bucket/broken", options=s3_options) as w,
    ):
        w.extend("train", SEQS)
        raise RuntimeError("stop")
    with pytest.raises(ftj.FormatError, match="did not finish"):
        ftj.open_dataset("s3://bucket/broken", s3_options)


def test_delay_proxy_delays_each_request(s3_options: ftj.StoreOptions) -> None:
    assert s3_options.endpoint is not None
    port = int(s3_options.endpoint.rsplit(":", 1)[1])
    proxy = DelayProxy(port, 0.2)
    try:
        slow = ftj.StoreOptions(
            endpoint=f"http://127.0.0.1:{proxy.port}",
            region="us-east-1",
            credentials=s3_options.credentials,
        )
        ftj.write_dataset("s3://bucket/slow", {"train": SEQS[:20]}, options=s3_options)
        began = time.perf_counter()
        ft = ftj.open_dataset("s3://bucket/slow", slow)["train"]
        assert ft.tokens(0, 3).tolist() == SEQS[0] + SEQS[1]
        assert time.perf_counter() - began >= 0.2
    finally:
        proxy.close()
