"""A read-only S3 stand-in that serves the files under a folder, for benchmarks.

``python tests/s3files.py FOLDER PORT [PROCESSES]`` answers path-style ``GET`` and
``HEAD`` of ``/BUCKET/KEY`` with the file ``FOLDER/BUCKET/KEY`` (``Range``:
``bytes=a-b``, ``bytes=a-`` and the suffix ``bytes=-n`` that shard indexes
are read with), and ``GET /BUCKET?list-type=2&prefix=P`` (ListObjectsV2, one
page), in :data:`PROCESSES` processes sharing the port. It checks no
signature and writes nothing: a dataset is written to the folder first. Its
work per request is a file read, so unlike moto's server (which answers tens
of requests a second on a busy machine) it is rarely what a benchmark
measures.
"""

from __future__ import annotations

import http.server
import multiprocessing
import signal
import socket
import sys
import urllib.parse
from pathlib import Path
from xml.sax.saxutils import escape

PROCESSES = 4
"""Server processes listening on the port."""


def byte_range(header: str | None, size: int) -> tuple[int, int] | None:
    """``[start, stop)`` that a ``Range`` header asks of ``size`` bytes (``None``: all)."""
    if not header or not header.startswith("bytes="):
        return None
    first, _, last = header[6:].split(",")[0].strip().partition("-")
    if not first:
        return max(size - int(last), 0), size
    return int(first), min(int(last) + 1, size) if last else size


def serve(root: Path, port: int) -> None:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        # The head and the body are two writes: without this the body waits
        # for the client's delayed ACK of the head (40 ms a request).
        disable_nagle_algorithm = True

        def log_message(self, format: str, *args: object) -> None:
            pass

        def _send(self, status: int, body: bytes, head: dict[str, str]) -> None:
            self.send_response(status)
            for key, value in {**head, "Content-Length": str(len(body))}.items():
                self.send_header(key, value)
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _missing(self) -> None:
            self._send(404, b"<Error><Code>NoSuchKey</Code></Error>", {})

        def _list(self, bucket: str, query: dict[str, list[str]]) -> None:
            prefix = query.get("prefix", [""])[0]
            base = root / bucket
            keys = sorted(str(p.relative_to(base)) for p in base.rglob("*") if p.is_file())
            items = "".join(
                f"<Contents><Key>{escape(k)}</Key><Size>{(base / k).stat().st_size}</Size>"
                "</Contents>"
                for k in keys
                if k.startswith(prefix)
            )
            body = (
                '<?xml version="1.0" encoding="UTF-8"?><ListBucketResult>'
                f"<Name>{escape(bucket)}</Name><Prefix>{escape(prefix)}</Prefix>"
                f"<IsTruncated>false</IsTruncated>{items}</ListBucketResult>"
            ).encode()
            self._send(200, body, {"Content-Type": "application/xml"})

        def do_GET(self) -> None:
            url = urllib.parse.urlsplit(self.path)
            bucket, _, key = urllib.parse.unquote(url.path).lstrip("/").partition("/")
            if not key:
                self._list(bucket, urllib.parse.parse_qs(url.query))
                return
            path = root / bucket / key
            if ".." in Path(key).parts or not path.is_file():
                self._missing()
                return
            info = path.stat()
            head = {"ETag": f'"{info.st_mtime_ns:x}"', "Accept-Ranges": "bytes"}
            span = byte_range(self.headers.get("Range"), info.st_size)
            start, stop = (0, info.st_size) if span is None else span
            with path.open("rb") as f:  # only the bytes asked for: shards are large
                f.seek(start)
                data = f.read(stop - start)
            if span is not None:
                head["Content-Range"] = f"bytes {start}-{stop - 1}/{info.st_size}"
            self._send(200 if span is None else 206, data, head)

        do_HEAD = do_GET

    class Server(http.server.ThreadingHTTPServer):
        daemon_threads = True
        request_queue_size = 512

        def server_bind(self) -> None:
            # Several processes listen on the port; the kernel spreads the
            # connections over them, so the server is not one interpreter.
            self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            super().server_bind()

    with Server(("127.0.0.1", port), Handler) as server:
        server.serve_forever()


if __name__ == "__main__":
    folder, port = Path(sys.argv[1]), int(sys.argv[2])
    processes = int(sys.argv[3]) if len(sys.argv) > 3 else PROCESSES
    # Daemons: a SIGTERM to this process ends it through sys.exit, which ends them.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    children = [
        multiprocessing.Process(target=serve, args=(folder, port), daemon=True)
        for _ in range(processes)
    ]
    for child in children:
        child.start()
    for child in children:
        child.join()
