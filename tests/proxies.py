"""Proxies on 127.0.0.1 between the tests (or benchmarks) and the servers of
``servers.py``, that delay, cap, throttle, fail or record requests."""

from __future__ import annotations

import asyncio
import dataclasses
import http.client
import http.server
import json
import threading
import time

from servers import free_port


class Link:
    """A link of ``rate`` bytes/s shared by everything sent over it, first come
    first served: :meth:`hold` says how long to keep ``n`` bytes that arrive at
    ``now`` so that they leave when the link has carried them (no burst).

    Whatever the arrivals, the bytes that have left by any time ``t`` are at
    most ``rate * (t - first arrival)``, and while bytes wait the link carries
    ``rate`` bytes/s.
    """

    def __init__(self) -> None:
        self._free = float("-inf")  # when the link has carried all it was given

    def hold(self, n: int, now: float, rate: float) -> float:
        """Seconds from ``now`` until ``n`` bytes given at ``now`` have been carried."""
        self._free = max(now, self._free) + n / rate
        return self._free - now


_HELD = object()  # a request the proxy keeps without answering


@dataclasses.dataclass(frozen=True)
class Refusal:
    """An answer the proxy gives in the server's stead: ``status`` and
    ``reason``, ``body`` (left out for a ``HEAD``) of ``content_type``;
    ``close``: the connection is closed after it; ``held``: it comes back
    after the proxy's ``delay``, as from the distant server."""

    status: int
    reason: str
    body: bytes = b""
    content_type: str | None = None
    close: bool = True
    held: bool = False

    def message(self, method: bytes) -> bytes:
        """The answer to a request of ``method``, head and body."""
        body = b"" if method == b"HEAD" else self.body
        lines = [f"HTTP/1.1 {self.status} {self.reason}", f"Content-Length: {len(self.body)}"]
        if self.content_type:
            lines.append(f"Content-Type: {self.content_type}")
        if self.close:
            lines.append("Connection: close")
        return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


class DelayProxy:
    """An HTTP/1.1 proxy on 127.0.0.1 (TCP in between: the client's bytes pass
    unchanged) that holds each client write ``delay`` seconds, caps the answers'
    bandwidth, counts requests in flight, and can fail or stall requests.

    Each HTTP request reaches the server ``delay`` later than sent (and each
    64 KiB of a request body ``delay`` more): a fixed latency per request, as
    from a distant object store. ``delay`` may change at any time.

    ``rate``: bytes/s that the answers of all connections share (``None``: no
    cap; may change at any time), as a link to a remote store: see :class:`Link`.

    A request is *in flight* from when its head reaches the proxy until the
    first bytes of its answer come back (clients send one request at a time
    per connection): ``in_flight`` now, ``max_in_flight`` the most at once
    since the start or the last :meth:`reset`. :meth:`count` gives the
    requests seen, ``downloaded`` the bytes of the answers, ``failed`` the
    requests that :meth:`fail` answered.

    :meth:`fail` answers the next ``n`` requests with an HTTP error from the
    proxy itself (the server never sees them); :meth:`stall` holds the next
    ``n`` unanswered until :meth:`release` (or :meth:`close`).
    """

    def __init__(self, target_port: int, delay: float = 0.0, rate: float | None = None) -> None:
        self.target_port, self.delay, self.rate = target_port, delay, rate
        self.port = free_port()
        self.in_flight = self.max_in_flight = self.downloaded = self.failed = 0
        self._requests = 0
        self._switches: list[int | object] = []
        self._lock = threading.Lock()
        self._link = Link()
        self._gate = asyncio.Event()  # set by release: held requests go on
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        self._ready.wait(10)

    def fail(self, n: int, status: int = 503) -> None:
        """Answers the next ``n`` requests with ``status`` (empty body, and the
        connection closed after it) instead of forwarding them."""
        with self._lock:
            self._switches.extend([Refusal(status, "Proxy Fault")] * n)

    def stall(self, n: int) -> None:
        """Holds the next ``n`` requests unanswered, their connections open."""
        with self._lock:
            self._switches.extend([_HELD] * n)

    def release(self) -> None:
        """Forwards the requests held by :meth:`stall`, and drops the stalls not used yet."""
        with self._lock:
            self._switches = [s for s in self._switches if s is not _HELD]
        self._loop.call_soon_threadsafe(self._gate.set)

    def count(self) -> int:
        """Requests seen (forwarded, failed or held) since the start or :meth:`reset`."""
        with self._lock:
            return self._requests

    def reset(self) -> None:
        """Starts counting afresh: ``max_in_flight`` becomes ``in_flight``, and
        :meth:`count` and ``downloaded`` zero."""
        with self._lock:
            self.max_in_flight = self.in_flight
            self._requests = self.downloaded = 0

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(
            # A client opens a connection per request in flight, hundreds at
            # once when its read-ahead grows; past the listen backlog (100 by
            # default) a connection waits a second for its SYN's resend: a
            # stall of the proxy's making, not of the store it stands for.
            asyncio.start_server(self._handle, "127.0.0.1", self.port, limit=1 << 20, backlog=4096)
        )
        self._ready.set()
        self._loop.run_forever()
        self._loop.run_until_complete(self._server.wait_closed())
        self._loop.close()

    def _begin(self) -> Refusal | object | None:
        """Counts a request in flight; what to do with it (a :class:`Refusal`,
        _HELD, or None: forward)."""
        with self._lock:
            self._requests += 1
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            action = self._switches.pop(0) if self._switches else None
            self.failed += isinstance(action, Refusal)
            return action

    def _end(self, n: int = 1) -> None:
        with self._lock:
            self.in_flight -= n

    async def _hold(self) -> None:
        if self.delay:  # read each time: the delay may change
            await asyncio.sleep(self.delay)

    async def _body(
        self, reader: asyncio.StreamReader, head: bytes, writer: asyncio.StreamWriter | None
    ) -> None:
        """Reads the body of the request ``head`` (Content-Length or chunked),
        passing it to ``writer`` if any, each 64 KiB held ``delay``."""
        fields = [line.split(b":", 1) for line in head.split(b"\r\n")[1:] if b":" in line]
        headers = {k.strip().lower(): v.strip().lower() for k, v in fields}
        if headers.get(b"transfer-encoding", b"").endswith(b"chunked"):
            while True:
                line = await reader.readuntil(b"\r\n")
                size = int(line.split(b";")[0], 16)
                data = line + await reader.readexactly(size + 2 if size else 0)
                if not size:  # trailers, up to an empty line
                    while (more := await reader.readuntil(b"\r\n")) != b"\r\n":
                        data += more
                    data += b"\r\n"
                await self._hold()
                if writer is not None:
                    writer.write(data)
                    await writer.drain()
                if not size:
                    return
        left = int(headers.get(b"content-length", b"0"))
        while left:
            data = await reader.readexactly(min(left, 1 << 16))
            left -= len(data)
            await self._hold()
            if writer is not None:
                writer.write(data)
                await writer.drain()

    async def _requests_up(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        client: asyncio.StreamWriter,
        waiting: list[int],
    ) -> None:
        """Passes the client's requests to the server, one after another."""
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError:
                    return  # the client hung up
                action = self._begin()
                waiting[0] += 1
                if action is _HELD:
                    gate = self._gate
                    await gate.wait()
                    if self._gate is gate:  # the first held request to go on
                        self._gate = asyncio.Event()
                    action = None
                if isinstance(action, Refusal):
                    # Without its body a client that awaits "100 Continue"
                    # would send it as the next request: the connection closes.
                    if b"100-continue" in head.lower():
                        action = dataclasses.replace(action, close=True)
                    else:
                        await self._body(reader, head, None)
                    if action.held:
                        await self._hold()
                    waiting[0] -= 1
                    self._end()
                    client.write(action.message(head.split(b" ", 1)[0]))
                    await client.drain()
                    if action.close:
                        return
                    continue
                await self._hold()
                writer.write(head)
                await writer.drain()
                await self._body(reader, head, writer)
        except (ConnectionError, asyncio.CancelledError, asyncio.LimitOverrunError, ValueError):
            pass  # a peer hung up, the proxy is shutting down, or not HTTP
        finally:
            writer.close()
            client.close()

    async def _answers_down(
        self, reader: asyncio.StreamReader, client: asyncio.StreamWriter, waiting: list[int]
    ) -> None:
        """Passes the server's answers to the client, at most ``rate`` bytes/s
        over all connections."""
        try:
            while data := await reader.read(1 << 16):
                if waiting[0]:  # the first bytes of an answer
                    waiting[0] -= 1
                    self._end()
                if self.rate:
                    await asyncio.sleep(self._link.hold(len(data), self._loop.time(), self.rate))
                with self._lock:
                    self.downloaded += len(data)
                client.write(data)
                await client.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass  # a peer hung up, or the proxy is shutting down
        finally:
            client.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        waiting = [0]  # this connection's requests in flight
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
            await asyncio.gather(
                self._requests_up(reader, up_writer, writer, waiting),
                self._answers_down(up_reader, writer, waiting),
            )
        except (ConnectionError, asyncio.CancelledError):
            writer.close()  # the server is gone, or the proxy is shutting down
        finally:
            self._end(waiting[0])

    async def _shutdown(self) -> None:
        self._server.close()  # no new connections while the open ones end
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._loop.stop()

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop)
        self._thread.join(5)


# What GCS (JSON API) and S3 answer a request over the bucket's request rate.
THROTTLED = {
    "gcs": Refusal(
        429,
        "Too Many Requests",
        json.dumps(
            {
                "error": {
                    "code": 429,
                    "message": "The rate of requests to this bucket exceeds its rate limit. "
                    "Please reduce the rate of requests.",
                    "errors": [
                        {
                            "message": "The rate of requests to this bucket exceeds its rate "
                            "limit. Please reduce the rate of requests.",
                            "domain": "usageLimits",
                            "reason": "rateLimitExceeded",
                        }
                    ],
                }
            }
        ).encode(),
        "application/json; charset=UTF-8",
        close=False,
        held=True,
    ),
    "s3": Refusal(
        503,
        "Slow Down",
        b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
        b"<Message>Please reduce your request rate.</Message>"
        b"<RequestId>0000000000000000</RequestId><HostId>throttle-proxy</HostId></Error>",
        "application/xml",
        close=False,
        held=True,
    ),
}


class ThrottleProxy(DelayProxy):
    """A :class:`DelayProxy` that answers the requests over a request rate as
    a throttled bucket does: 429 Too Many Requests (``service="gcs"``) or 503
    SlowDown (``"s3"``), with those services' bodies, after ``delay`` (the
    round trip), keeping the connection open.

    A token bucket decides: it holds up to ``burst`` tokens (full at the
    start) and gains ``requests_per_s`` a second; a request that finds a
    token takes it and is forwarded, one that finds none is refused (and
    takes none, so refusals do not lower the rate forwarded). Both may
    change at any time; ``requests_per_s=None`` forwards everything.
    ``refused`` and ``forwarded`` count the requests since the start (what
    :meth:`fail` and :meth:`stall` do comes first and counts in neither).
    """

    def __init__(
        self,
        target_port: int,
        service: str,
        requests_per_s: float | None,
        burst: float = 1.0,
        delay: float = 0.0,
        rate: float | None = None,
    ) -> None:
        if service not in THROTTLED:
            raise ValueError(f"service must be one of {sorted(THROTTLED)}, got {service!r}")
        self.refusal = THROTTLED[service]
        self.requests_per_s, self.burst = requests_per_s, burst
        self.refused = self.forwarded = 0
        self._tokens, self._filled = burst, time.monotonic()
        super().__init__(target_port, delay, rate)

    def _begin(self) -> Refusal | object | None:
        action = super()._begin()
        if action is not None:
            return action
        with self._lock:
            now = time.monotonic()
            per_s = self.requests_per_s
            if per_s is not None:
                self._tokens = min(self.burst, self._tokens + (now - self._filled) * per_s)
            self._filled = now
            if per_s is None or self._tokens >= 1:
                self._tokens = max(self._tokens - 1, 0.0)
                self.forwarded += 1
                return None
            self.refused += 1
            return self.refusal


class ManyClients(http.server.ThreadingHTTPServer):
    daemon_threads = True
    # A client opens a connection per request in flight; past the listen
    # backlog (5 by default) a connection waits a second for its SYN's resend.
    request_queue_size = 512


def forward(
    handler: http.server.BaseHTTPRequestHandler, port: int, body: bytes | None
) -> tuple[http.client.HTTPResponse, bytes] | None:
    """Sends ``handler``'s request to the server on ``port``; its reply and
    body, or ``None`` when the server is gone (the client is hung up on, as
    the server would)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    headers = {k: v for k, v in handler.headers.items() if k.lower() != "host"}
    headers["Host"] = f"127.0.0.1:{port}"
    try:
        conn.request(handler.command, handler.path, body=body, headers=headers)
        reply = conn.getresponse()
        data = reply.read()
    except OSError:
        handler.close_connection = True
        return None
    finally:
        conn.close()
    return reply, data


def answer(
    handler: http.server.BaseHTTPRequestHandler,
    reply: http.client.HTTPResponse,
    data: bytes,
    close: bool,
) -> None:
    """Passes the server's ``reply`` to the client (``close``: and hangs up)."""
    handler.send_response(reply.status, reply.reason)
    for key, value in reply.getheaders():
        if key.lower() not in ("content-length", "transfer-encoding", "connection"):
            handler.send_header(key, value)
    handler.send_header("Content-Length", str(len(data)))
    if close:
        handler.send_header("Connection", "close")
        handler.close_connection = True
    handler.end_headers()
    if handler.command != "HEAD":
        handler.wfile.write(data)


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
                reply = forward(self, proxy.target_port, body)
                if reply is not None:
                    answer(self, *reply, close=False)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

        self._server = ManyClients(("127.0.0.1", 0), Handler)
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
