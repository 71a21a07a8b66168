"""One write's claim on its output: the :data:`MARKER` created exclusively
first and deleted last, which tells a write that runs from one that died, so
that ``overwrite`` never deletes a live write's output (docs/format.md,
"Claiming the output").
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import logging
import os
import socket
import threading
import uuid
import weakref
from collections.abc import Iterable, Sequence
from typing import Any, BinaryIO

from flat_tokens_jax.core.format import SPLITS, FormatError
from flat_tokens_jax.store.store import V2_ATTRS, V2_GROUP, V3_META, Store

log = logging.getLogger(__name__)

# Marks a write in progress (or interrupted); created first, deleted last.
MARKER = "_flat_tokens_writing.json"
# Temporary files of a write in progress (a distributed conversion's parts)
# live under this prefix of the output, and are deleted before it is valid.
STAGING = "_staging"
GROUP_META = (V3_META, V2_GROUP, V2_ATTRS)
# How long a claim on a remote (or memory://) store lives without renewal: a
# write that stopped renewing this long ago is dead, and overwrite may replace it.
LEASE_SECONDS = 60.0


class Claim:
    """A location claimed by one write (of ``splits``): its :data:`MARKER` is ours
    while the write runs. On local disk the marker stays open and ``flock``-ed
    by this process, so a dead write is told from one that runs. Elsewhere a
    thread renews its lease every quarter of it, with a conditional write on
    the marker's generation, so a claim taken over by another writer is noticed.
    """

    def __init__(self, store: Store, splits: Sequence[str]) -> None:
        self.store = store
        self.splits = tuple(dict.fromkeys([*SPLITS, *splits]))
        self.writer = uuid.uuid4().hex
        self.started = _now()
        self.lost = ""  # why the claim is no longer ours, once it is not
        self._file: BinaryIO | None = None  # local disk: the open, locked marker
        self._generation = b""  # other stores: the generation of our marker
        self._stop = threading.Event()
        self._mutex = threading.Lock()  # renewals against release and discard

    def marker_json(self) -> bytes:
        """The marker's JSON: who writes, since when, which splits, and the lease."""
        found = {
            "writer": self.writer,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": self.started.isoformat(timespec="seconds"),
            "splits": list(self.splits),
        }
        if not _local(self.store):
            found |= {"renewed": _now().isoformat(), "lease_seconds": LEASE_SECONDS}
        return json.dumps(found).encode()

    def create(self) -> bool:
        """Creates the marker where there is none; whether this call did."""
        if _local(self.store):
            path = _marker_path(self.store)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                return False
            return self._hold(os.fdopen(fd, "r+b"), created=True)
        got = self.store.wait(self.store.kv.read(MARKER))
        return got.state != "value" and self._put(got.stamp.generation)

    def take_over(self) -> None:
        """Replaces the marker of a write that is dead; ``FileExistsError`` when
        that write still runs or another writer changed the marker meanwhile."""
        if _local(self.store):
            try:
                found = open(_marker_path(self.store), "r+b")  # noqa: SIM115 (held while we write)
            except FileNotFoundError:
                raise _raced(self.store) from None
            try:
                fcntl.flock(found, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                found.close()
                raise _alive(self.store, "its process holds the marker's lock") from None
            if not self._hold(found, created=False):
                raise _raced(self.store)
            return
        got = self.store.wait(self.store.kv.read(MARKER))
        if got.state != "value":
            raise _raced(self.store)
        until = _lease_end(got.value)
        if until is not None and _now() < until:
            raise _alive(
                self.store,
                f"its lease runs until {until.isoformat(timespec='seconds')} unless renewed; "
                "if that write is dead, run again after that",
                bytes(got.value),
            )
        if not self._put(got.stamp.generation):
            raise _raced(self.store)

    def _hold(self, found: BinaryIO, created: bool) -> bool:
        """Locks the open marker ``found`` and writes our :meth:`marker_json` into it, if it
        is still the marker at its path."""
        path = _marker_path(self.store)
        try:
            if created:
                fcntl.flock(found, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if not _same_file(found, path):
                found.close()
                return False
            found.seek(0)
            found.truncate()
            found.write(self.marker_json())
            found.flush()
        except BlockingIOError:
            found.close()  # taken over in the instant after we created it
            return False
        except BaseException:
            with contextlib.suppress(OSError):  # closing flushes again, and fails again
                found.close()
            if created:
                os.remove(path)  # a full disk, say: leave nothing behind
            raise
        self._file = found
        return True

    def _put(self, generation: bytes) -> bool:
        """Writes our marker over ``generation`` (a missing key's, or a dead
        write's marker); on success starts the renewals."""
        written = self.store.wait(
            self.store.kv.write(MARKER, self.marker_json(), if_equal=generation)
        )
        if not written.generation or _writer_of(self.store) != self.writer:
            return False  # the last check: a store that ignores the condition
        self._generation = written.generation
        ref = weakref.ref(self)
        threading.Thread(
            target=_renew_until_stopped, args=(ref, self._stop), daemon=True, name="claim-lease"
        ).start()
        return True

    def renew(self) -> None:
        """Extends the lease (other stores), unless the claim ended or was lost."""
        with self._mutex:
            if self._stop.is_set() or self.lost:
                return
            try:
                got = self.store.wait(self.store.kv.read(MARKER))
                if got.state != "value":
                    self._stop.set()  # released by another process (Beam's last step)
                    return
                written = self.store.wait(
                    self.store.kv.write(MARKER, self.marker_json(), if_equal=self._generation)
                )
            except (OSError, ValueError) as e:
                log.warning("could not renew the claim on %s (will retry): %s", self.store.url, e)
                return
            if not written.generation:
                try:
                    now = read_marker(self.store)
                except OSError:
                    return  # the next renewal tells
                if now is None:
                    self._stop.set()  # deleted between our read and write: released
                    return
                self.lost = f"another writer replaced its marker ({describe_marker(self.store)})"
                log.error("this write lost its claim on %s: %s", self.store.url, self.lost)
                self._stop.set()
                return
            self._generation = written.generation

    def ours(self) -> bool:
        """Whether the marker at the location is still this claim's."""
        if self._file is not None:
            return _same_file(self._file, _marker_path(self.store))
        if self.lost:
            return False
        try:
            return _writer_of(self.store) == self.writer
        except (OSError, FormatError):
            return False

    def _end(self) -> bool:
        """Stops the renewals; whether the marker was still ours."""
        self._stop.set()
        with self._mutex:
            return self.ours()

    def _drop_marker(self) -> None:
        self.store.delete(MARKER)
        if self._file is not None:
            self._file.close()
            self._file = None

    def release(self) -> None:
        """The write finished (its root metadata is written): drops the marker;
        ``FileExistsError`` if another writer took the location over meanwhile."""
        if not self._end():
            raise FileExistsError(
                f"{self.store.url}: this write lost its claim while it ran "
                f"({self.lost or describe_marker(self.store)}); what the location holds "
                "now may be the other write's: check it, or write again"
            )
        self._drop_marker()

    def discard(self) -> None:
        """The write failed: deletes our own keys (never the whole prefix, nothing
        once the claim is another writer's), the marker last. Failures are logged,
        not raised, so the caller sees the error that stopped the write."""
        try:
            if not self._end():
                log.error(
                    "not deleting what the failed write left at %s: another write claimed it",
                    self.store.url,
                )
                return
            delete_ours(self.store, self.splits)
            self._drop_marker()
        except (OSError, ValueError) as e:
            log.error("could not delete what the failed write left at %s: %s", self.store.url, e)


def _renew_until_stopped(ref: weakref.ref[Claim], stop: threading.Event) -> None:
    """Renews the claim every quarter lease until it ends or is garbage."""
    while not stop.wait(LEASE_SECONDS / 4):
        claim = ref()
        if claim is None:
            return
        claim.renew()
        del claim


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _local(store: Store) -> bool:
    return bool(store.spec["driver"] == "file")


def _marker_path(store: Store) -> str:
    return str(store.spec["path"]) + MARKER


def _same_file(found: BinaryIO, path: str) -> bool:
    try:
        here = os.stat(path)
    except FileNotFoundError:
        return False
    there = os.fstat(found.fileno())
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


def _lease_end(value: bytes) -> datetime.datetime | None:
    """When a marker's lease ends; ``None`` for a marker without a readable
    one (damaged): its write is taken for dead."""
    try:
        found = json.loads(value)
        end = datetime.datetime.fromisoformat(found["renewed"]) + datetime.timedelta(
            seconds=float(found["lease_seconds"])
        )
    except (ValueError, TypeError, KeyError, OverflowError):
        return None
    return end if end.tzinfo is not None else None


def _writer_of(store: Store) -> object:
    marker = read_marker(store)
    return None if marker is None else marker.get("writer")


def _alive(store: Store, why: str, found: bytes | None = None) -> FileExistsError:
    return FileExistsError(
        f"another write to {store.url} is in progress ({describe_marker(store, found)}; {why}); "
        "overwrite replaces only a finished dataset or the leftover of a dead write: wait "
        "for that write to finish, or choose another location"
    )


def _raced(store: Store) -> FileExistsError:
    return FileExistsError(
        f"another write to {store.url} started or finished just now "
        f"({describe_marker(store)}); wait for it to finish, or choose another location"
    )


def read_marker(store: Store) -> dict[str, Any] | None:
    try:
        return store.read_json(MARKER)
    except FormatError:
        return None  # being written this instant, or damaged


def describe_marker(store: Store, found: bytes | None = None) -> str:
    """Who wrote the marker: ``found`` (its bytes, as read) or the one there now."""
    try:
        marker = read_marker(store) if found is None else json.loads(found)
    except ValueError:
        marker = None
    if not isinstance(marker, dict) or not marker:
        return f"its marker {MARKER} is there"
    return (
        f"marker {MARKER} written at {marker.get('started')} by pid {marker.get('pid')} "
        f"on {marker.get('host')}"
    )


def delete_ours(store: Store, splits: Iterable[str]) -> None:
    """Deletes the root metadata first (nothing valid is left even if this stops
    half way), then the split groups and the staging prefix; not the marker."""
    for key in GROUP_META:
        store.delete(key)
    for split in sorted(splits):
        store.delete_prefix(split)
    store.delete_prefix(STAGING)
