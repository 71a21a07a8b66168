"""Chunk digests: the recorded contents of every chunk, checked on first read.

A checksum inside a shard proves that its bytes are the ones written into that
file, and a shard probe (:mod:`~flat_tokens_jax.store.probes`) that a shard's first
values are; neither tells a shard of another version of the dataset that
differs further in. So our writers record, for every chunk of
:attr:`ChunkDigests.chunk` values (the inner chunk of a zarr v3 shard, the
chunk file of zarr v2), the crc32c of its values as little-endian bytes, the
chunk's values past the array's end counted as the fill value 0 (as zarr stores
an edge chunk), computed from the values as they are written. They go in a
side array ``chunk_crc32c`` (``uint32[ceil(size / C)]``, one side chunk per
shard, so that writers of different shards never share an object) inside the
array's folder, announced by the array's attribute ``chunk_crc32c``:
``{"algorithm": "crc32c", "chunk": C, "shard": S, "content": H}`` (values per
chunk and per shard, and H the sha256 of all the chunk digests in order, the
identity of the array's whole contents that a loader's fingerprint records;
stores written before it lack ``content``).

A read checks every chunk it touches the first time it touches it (once per
process) and raises :class:`~flat_tokens_jax.core.format.FormatError` naming the
array, the shard and the chunk if it differs. For an uncompressed chunk
stored with its crc32c (our default layout), the digest is that stored crc32c,
so the memory-mapped path compares the 4 bytes after the chunk, verified as
any read verifies them, with the recorded digest: nothing more is hashed.
Otherwise the check reads the chunk whole (a read fetches whole chunks anyway)
and hashes it. Arrays without the attribute (older stores, other writers) are
read without this check.
"""

from __future__ import annotations

import hashlib
import re
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

from flat_tokens_jax.core.format import FormatError
from flat_tokens_jax.store.arrays import ArrayReader, Known
from flat_tokens_jax.store.localshards import crc32c, touched

DIGESTS = "chunk_crc32c"  # the array attribute, and the side array's name in the array's folder
ALGORITHM = "crc32c"
CONTENT = "content"  # the attribute's key of the whole array's content digest
_HEX64 = re.compile(r"[0-9a-f]{64}")

OpenSide = Callable[[], ArrayReader]


def chunk_digest(values: np.ndarray, chunk: int) -> int:
    """The digest of one chunk whose first ``values`` (``[n]``, ``n <= chunk``) are
    given: crc32c of its ``chunk`` values as little-endian bytes, 0 past ``n``."""
    if values.size == chunk and values.dtype.byteorder != ">" and values.flags.c_contiguous:
        return crc32c(values)  # the common case, without a copy
    little = np.ascontiguousarray(values, dtype=values.dtype.newbyteorder("<"))
    if little.size < chunk:
        little = np.concatenate([little, np.zeros(chunk - little.size, little.dtype)])
    return crc32c(little)


def chunk_digests(values: np.ndarray, chunk: int) -> np.ndarray:
    """``[ceil(n / chunk)] uint32``: :func:`chunk_digest` of each run of ``chunk``
    values of ``values`` (``[n]``, the start of a shard)."""
    return np.array(
        [chunk_digest(values[i : i + chunk], chunk) for i in range(0, values.size, chunk)],
        np.uint32,
    )


def attribute(chunk: int, shard: int, content: str | None = None) -> dict[str, Any]:
    """The ``chunk_crc32c`` attribute of an array of ``chunk`` values per chunk and
    ``shard`` per shard; ``content`` (see :func:`content_digest`) once the
    digests of every chunk are written."""
    found = {"algorithm": ALGORITHM, "chunk": chunk, "shard": shard}
    return found if content is None else {**found, CONTENT: content}


def content_digest(blocks: Iterable[np.ndarray]) -> str:
    """The identity of a whole array's contents: sha256 (hex) of the digests of
    all its chunks (``blocks``, in order, ``uint32``), as little-endian bytes.
    Two arrays with equal content digests hold the same values (as far as the
    chunks' crc32c tell), so a loader state names the data it was saved from
    exactly, at the cost of one small attribute."""
    found = hashlib.sha256()
    for block in blocks:
        found.update(np.ascontiguousarray(block, dtype="<u4").tobytes())
    return found.hexdigest()


class ChunkDigests:
    """The recorded chunk digests of one array, and which chunks this process checked.

    Thread-safe: concurrent reads may check the same chunk; it is checked once.
    The side array is opened on the first check, and a shard's recorded digests
    are read at once, the first time one of its chunks is checked.
    """

    def __init__(self, where: str, size: int, chunk: int, shard: int, open_side: OpenSide) -> None:
        self.where, self.size, self.chunk, self.shard = where, size, chunk, shard
        self.count = -(-size // chunk)
        self.checked = np.zeros(self.count, bool)
        self.bytes_read = 0  # through the array's reader: the chunks read to hash
        self.side_bytes = 0  # of the side array: the recorded digests
        # The recorded digests of the shards loaded so far: [count] uint32, and
        # [shards] bool, which shards' entries hold their recorded values.
        self._recorded = np.zeros(self.count, np.uint32)
        self._loaded = np.zeros(-(-size // shard), bool)
        self._open_side = open_side
        self._side: ArrayReader | None = None
        self.content: str | None = None  # the recorded content digest, if any
        self._lock = threading.Lock()
        self._checking: dict[int, threading.Event] = {}  # chunk: set once its check ends
        self._loading = threading.Lock()  # held while recorded digests are read

    @classmethod
    def of(
        cls, attributes: Mapping[str, Any], where: str, size: int, open_side: OpenSide
    ) -> ChunkDigests | None:
        """The digests an array's ``attributes`` announce; ``None`` when none.

        Raises:
            FormatError: a malformed attribute.
        """
        found = attributes.get(DIGESTS)
        if found is None:
            return None
        content = found.get(CONTENT) if isinstance(found, Mapping) else None
        ok = (
            isinstance(found, Mapping)
            and set(found) - {CONTENT} == {"algorithm", "chunk", "shard"}
            and (content is None or (isinstance(content, str) and _HEX64.fullmatch(content)))
            and found["algorithm"] == ALGORITHM
            and all(type(found[k]) is int and found[k] >= 1 for k in ("chunk", "shard"))
            and found["shard"] % found["chunk"] == 0
        )
        if not ok:
            raise FormatError(
                f"{where}: attribute {DIGESTS!r} is malformed: {found!r}; expected "
                f'{{"algorithm": "{ALGORITHM}", "chunk": C, "shard": S[, "{CONTENT}": H]}}, '
                "the values per digest and per shard (positive ints, C dividing S) and the "
                "sha256 of all the digests (64 hex digits)"
            )
        found_digests = cls(where, size, found["chunk"], found["shard"], open_side)
        found_digests.content = content
        return found_digests

    def side(self) -> ArrayReader:
        """The side array of digests, opened and its shape checked on first use."""
        if self._side is None:
            side = self._open_side()
            if side.size != self.count or side.dtype != np.uint32:
                raise FormatError(
                    f"{self.where}/{DIGESTS}: {side.size} {side.dtype} entries, expected "
                    f"{self.count} uint32 (one per chunk of {self.chunk} of {self.size} values); "
                    "the digests belong to another array: rewrite the dataset"
                )
            self._side = side
        return self._side

    def unchecked(self, starts: np.ndarray, stops: np.ndarray) -> bool:
        """Whether ranges ``[starts, stops)`` (within the array) touch a chunk not checked yet."""
        return not self.checked[touched(starts, stops, self.chunk)].all()

    def check(self, reader: ArrayReader, starts: np.ndarray, stops: np.ndarray) -> Known | None:
        """Checks every chunk of ``reader`` (this array) that ranges ``[starts,
        stops)`` touch and that this process has not checked yet.

        Returns:
            The chunks read whole to hash them, all checked, for the read to
            serve its ranges from; ``None`` when none was read.

        Raises:
            FormatError: a chunk whose values are not those recorded.
        """
        chunks = touched(starts, stops, self.chunk)
        if self.checked[chunks].all():
            return None
        # Reads check their chunks at once, each chunk once: a chunk another
        # read is checking is waited for, not read again, and no lock is held
        # while chunks are read (the reads of steps in flight overlap).
        with self._lock:
            todo = np.unique(chunks)
            todo = todo[~self.checked[todo]]
            busy = np.array([c in self._checking for c in todo.tolist()], bool)
            theirs = {self._checking[c] for c in todo[busy].tolist()}
            mine = todo[~busy]
            done = threading.Event()
            for c in mine.tolist():
                self._checking[c] = done
        try:
            known = self._check_chunks(reader, mine) if mine.size else None
        finally:
            with self._lock:
                for c in mine.tolist():
                    del self._checking[c]
            done.set()
        for event in theirs:
            event.wait()
        failed = todo[busy][~self.checked[todo[busy]]]
        if failed.size:  # another read found it bad: check it here, for the message
            self._check_chunks(reader, failed)
        return known

    def _check_chunks(self, reader: ArrayReader, todo: np.ndarray) -> Known | None:
        """Checks ``todo`` (sorted chunk numbers); the chunks read whole, if any."""
        known = None
        got = reader.stored_crc32c(todo, self.chunk)
        if got is None:
            # Runs of consecutive chunks as one range each: a store reads
            # adjacent chunks of a shard in one request, as the read would.
            runs = np.split(todo, np.flatnonzero(np.diff(todo) != 1) + 1)
            lo = np.array([r[0] for r in runs], np.int64) * self.chunk
            hi = np.minimum(np.array([r[-1] + 1 for r in runs], np.int64) * self.chunk, self.size)
            pending = reader.request_ranges(lo, hi)
            self._load(todo)  # the recorded digests, read while the chunks are in flight
            values = [
                run_values[i * self.chunk : (i + 1) * self.chunk]
                for run, run_values in zip(runs, pending.result(), strict=True)
                for i in range(run.size)
            ]
            with self._lock:
                self.bytes_read += sum(v.nbytes for v in values)
            got = np.array([chunk_digest(v, self.chunk) for v in values], np.uint32)
            known = Known(self.chunk, dict(zip(todo.tolist(), values, strict=True)))
        bad = self._mismatches(todo, got)
        if bad:
            raise FormatError(f"{self.where}: {bad[0]}")
        self.checked[todo] = True
        return known

    def check_block(self, offset: int, values: np.ndarray) -> list[str]:
        """Checks the chunks wholly inside ``values``, the array's elements from
        ``offset`` on (for ``validate``, which reads every value anyway); a message
        for each that differs."""
        first = -(-offset // self.chunk)
        stop = (offset + values.size) // self.chunk
        if offset + values.size == self.size:
            stop = self.count
        if stop <= first:
            return []
        todo = np.arange(first, stop, dtype=np.int64)
        at = (todo * self.chunk - offset).tolist()
        got = np.array([chunk_digest(values[a : a + self.chunk], self.chunk) for a in at])
        bad = self._mismatches(todo, got.astype(np.uint32))
        self.checked[todo] = True
        return bad

    def content_problems(self) -> list[str]:
        """For ``validate``, once every chunk was checked: whether the recorded
        digests are those the content digest was made from (a side array of
        another version swapped in with its shards differs here)."""
        if self.content is None:
            return []
        found = content_digest([self._load(np.arange(self.count, dtype=np.int64))])
        if found == self.content:
            return []
        return [
            f"{DIGESTS}: the chunk digests are not those recorded when the array was written "
            f"(sha256 {found[:16]}..., recorded {self.content[:16]}...): a shard and its "
            "digests of another version copied in? restore them or rewrite the dataset"
        ]

    def _mismatches(self, chunks: np.ndarray, got: np.ndarray) -> list[str]:
        recorded = self._load(chunks)
        return [
            self._message(int(chunks[i]), int(got[i]), int(recorded[i]))
            for i in np.flatnonzero(got != recorded)
        ]

    def _load(self, chunks: np.ndarray) -> np.ndarray:
        """The recorded digests of ``chunks`` (``[k] int64``), reading those of their
        shards not read yet (one request)."""
        per_shard = self.shard // self.chunk
        shards = np.unique(chunks // per_shard)
        if not self._loaded[shards].all():
            with self._loading:  # each shard's digests read once (once per process)
                shards = shards[~self._loaded[shards]]
                if shards.size:
                    lo = shards * per_shard
                    hi = np.minimum(lo + per_shard, self.count)
                    found = self.side().read_ranges(lo, hi)
                    for a, values in zip(lo.tolist(), found, strict=True):
                        self._recorded[a : a + values.size] = values
                        self.side_bytes += values.nbytes
                    self._loaded[shards] = True
        return self._recorded[chunks]

    def _message(self, c: int, got: int, recorded: int) -> str:
        lo, hi = c * self.chunk, min((c + 1) * self.chunk, self.size)
        return (
            f"shard {lo // self.shard}, chunk {c} (values [{lo}, {hi})) is not the one "
            f"written here: its crc32c {got:#010x} differs from the recorded {recorded:#010x} "
            "(a shard of another version, split or dataset copied or linked in its place?): "
            "restore the shard or rewrite the dataset"
        )
