"""A proxy that answers a client's requests in rounds, so that a test counts the
round trips the client waited for without racing the clock."""

from __future__ import annotations

import http.server
import select
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from proxies import ManyClients, answer, forward

LOOKS = 3  # looks in a row that find the client settled before a round is answered
LOOK_EVERY = 0.01  # seconds between looks: the proxy lets go of the GIL in between
GIVE_UP = 120.0  # seconds a round waits for the client to settle before it is answered anyway
# Every proxy's threads (another's looks run every LOOK_EVERY: they are no client).
PROXY_THREADS: set[int] = set()


class Record(NamedTuple):
    """One request a :class:`LockstepProxy` forwarded, and the round it was
    answered in (0: passed through, outside lockstep)."""

    method: str
    path: str
    range: str | None
    round: int


def rounds(records: list[Record]) -> int:
    """How many rounds of requests the client waited for."""
    return len({r.round for r in records})


def timeline(records: list[Record]) -> str:
    """The records as lines of round, method, path and range: what a failed bound shows."""
    return "\n" + "\n".join(
        f"{r.round:3d} {r.method} {r.path} {r.range or ''}"
        for r in sorted(records, key=lambda r: r.round)
    )


def _asleep(own: set[int]) -> dict[int, int] | None:
    """How many times each thread of this process but ``own`` has run (its
    timeslices, from ``schedstat``), when every thread but the caller sleeps
    (state ``S``): none runs or waits for a core; ``None`` otherwise. ``own``
    threads count too: one that holds the GIL while it waits for a core keeps a
    client thread asleep on the GIL with a request still to send."""
    ran = {}
    me = threading.get_native_id()
    for task in Path("/proc/self/task").iterdir():
        tid = int(task.name)
        if tid == me:
            continue
        try:
            state = (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
            if tid not in own:
                ran[tid] = int((task / "schedstat").read_text().split()[2])
        except (OSError, IndexError, ValueError):  # the thread ended while we looked
            continue
        if state != "S":
            return None
    return ran


class LockstepProxy:
    """An HTTP proxy on 127.0.0.1 in front of the server on ``target_port``
    that, while ``lockstep`` is on, answers in rounds.

    It holds each request until the client, a thread of this process, can
    send no more: no connection is waiting to be accepted or read, and every
    thread of the process sleeps (the proxies' own too), in :data:`LOOKS` looks
    in a row, no client thread having run in between (one that woke, sent a request
    and slept again between two looks was never seen running). Then it
    forwards the requests held, answers them all, and only then holds the
    next round. Requests that a client sends without waiting
    for an answer share a round however slowly a loaded machine lets it send
    them; one sent after an answer is in a later round. Off, requests pass
    through (round 0). Every request is recorded (:class:`Record`) until
    :meth:`take`; ``forced`` counts the rounds answered after :data:`GIVE_UP`
    seconds without the client settling.

    Each request has a connection of its own (answered with ``Connection:
    close``), so a request in flight never queues behind another.
    """

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.lockstep = False
        self.forced = 0
        self._records: list[Record] = []
        self._state = threading.Condition()
        self._holding = 1  # the round whose requests are held
        self._held = 0
        self._answering = 0  # requests of the rounds released, not answered yet
        self._unread = 0  # connections accepted whose request is not held yet
        self._ran: dict[int, int] | None = None  # what the last look saw the client's threads run
        self._closed = False
        proxy = self

        class Server(ManyClients):
            def process_request(self, request: Any, client_address: Any) -> None:
                with proxy._state:
                    proxy._unread += 1
                super().process_request(request, client_address)

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            unread = True

            def log_message(self, format: str, *args: object) -> None:
                pass

            def handle(self) -> None:
                PROXY_THREADS.add(threading.get_native_id())
                try:
                    super().handle()
                finally:
                    with proxy._state:
                        if self.unread:  # the client hung up before its request
                            self._read()
                    PROXY_THREADS.discard(threading.get_native_id())

            def _read(self) -> None:
                """Counts this connection's request as read (called with ``_state`` held)."""
                proxy._unread -= 1
                self.unread = False

            def _any(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                n = proxy._hold(self._read)
                try:
                    reply = forward(self, proxy.target_port, body)
                    if reply is not None:
                        record = Record(self.command, self.path, self.headers.get("Range"), n)
                        with proxy._state:  # before the answer: the client never sees it unrecorded
                            proxy._records.append(record)
                        answer(self, *reply, close=True)
                finally:
                    proxy._answered()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

        self._server = Server(("127.0.0.1", 0), Handler)
        self.port = int(self._server.server_address[1])
        self.url = f"http://127.0.0.1:{self.port}"
        self._threads = [
            threading.Thread(target=self._serve, daemon=True),
            threading.Thread(target=self._pace, daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def start(self) -> list[Record]:
        """Turns lockstep on; returns (and forgets) the records so far."""
        with self._state:
            self.lockstep = True
        return self.take()

    def stop(self) -> None:
        """Turns lockstep off, answering the requests held."""
        with self._state:
            self.lockstep = False
            self._release()

    def take(self) -> list[Record]:
        """The records so far, and a fresh list for the next."""
        with self._state:
            found, self._records = self._records, []
        return found

    def close(self) -> None:
        self.stop()
        self._closed = True
        self._server.shutdown()
        self._server.server_close()
        for thread in self._threads:
            thread.join(5)

    def _serve(self) -> None:
        PROXY_THREADS.add(threading.get_native_id())
        try:
            self._server.serve_forever()
        finally:
            PROXY_THREADS.discard(threading.get_native_id())

    def _hold(self, read: Callable[[], None]) -> int:
        """Calls ``read`` and waits until the round of this request is
        answered; returns the round (0: none)."""
        with self._state:
            read()
            if not self.lockstep:
                self._answering += 1
                return 0
            n = self._holding
            self._held += 1
            self._state.wait_for(lambda: self._holding > n)
            return n

    def _answered(self) -> None:
        with self._state:
            self._answering -= 1

    def _release(self) -> None:
        """Answers the round held (called with ``_state`` held)."""
        self._answering += self._held
        self._held = 0
        self._holding += 1
        self._state.notify_all()

    def _settled(self) -> bool:
        """Whether the client can send no more requests before an answer: it
        slept at this look and the one before, and ran in neither's meantime."""
        seen, self._ran = self._ran, None
        with self._state:
            if not (self.lockstep and self._held and not self._answering and not self._unread):
                return False
        waiting, _, _ = select.select([self._server.socket], [], [], 0)
        if waiting:
            return False
        # A thread that ran between two looks and slept again was not seen running.
        self._ran = _asleep(set(PROXY_THREADS))
        return self._ran is not None and self._ran == seen

    def _pace(self) -> None:
        """Answers each round once the client has settled."""
        PROXY_THREADS.add(threading.get_native_id())
        try:
            self._look()
        finally:
            PROXY_THREADS.discard(threading.get_native_id())

    def _look(self) -> None:
        looks, since = 0, time.monotonic()
        while not self._closed:
            time.sleep(LOOK_EVERY)
            looks = looks + 1 if self._settled() else 0
            with self._state:
                if not self._held:
                    since = time.monotonic()
                    continue
                if looks >= LOOKS or time.monotonic() - since > GIVE_UP:
                    self.forced += looks < LOOKS
                    self._release()
                    looks, since = 0, time.monotonic()
