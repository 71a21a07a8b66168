"""Chunk digests: the crc32c of every chunk's values, recorded by our writers in
a side array ``chunk_crc32c`` beside the array and announced by its attribute
(layout in docs/format.md, "Chunk digests"), checked on a chunk's first read.
A side chunk can be copied in with its shard, so recorded digests are trusted
only once they match the attribute (``shards``, else ``content``).
"""

from __future__ import annotations

import hashlib
import re
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import numpy as np

from flat_tokens_jax.core.format import FormatError
from flat_tokens_jax.store.arrays import ArrayReader, Known
from flat_tokens_jax.store.checks import Checks
from flat_tokens_jax.store.localshards import crc32c, touched
from flat_tokens_jax.store.probes import crc_list

DIGESTS = "chunk_crc32c"  # the array attribute, and the side array's name in the array's folder
ALGORITHM = "crc32c"
CONTENT = "content"  # the attribute's key of the whole array's content digest
SHARDS = "shards"  # the attribute's key of the crc32c of each shard's side chunk
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
    """``[ceil(n / chunk)] uint32``: :func:`chunk_digest` of each chunk of ``values`` (``[n]``)."""
    return np.array(
        [chunk_digest(values[i : i + chunk], chunk) for i in range(0, values.size, chunk)],
        np.uint32,
    )


def side_digests(digests: np.ndarray, per_shard: int) -> list[int]:
    """The ``shards`` entries of chunk ``digests`` (``[k] uint32``, from a shard's
    first): the crc32c of each side chunk of ``per_shard`` of them (the last may be shorter)."""
    return [
        chunk_digest(digests[i : i + per_shard], digests[i : i + per_shard].size)
        for i in range(0, digests.size, per_shard)
    ]


def attribute(chunk: int, shard: int, blocks: Iterable[np.ndarray]) -> dict[str, Any]:
    """The ``chunk_crc32c`` attribute of an array whose chunk digests ``blocks``
    hold (all of them, in order, ``uint32``; each block but the last whole side chunks)."""
    shards: list[int] = []

    def hashed() -> Iterator[np.ndarray]:  # one pass over the blocks, for both
        for block in blocks:
            shards.extend(side_digests(block, shard // chunk))
            yield block

    content = content_digest(hashed())
    return {
        "algorithm": ALGORITHM,
        "chunk": chunk,
        "shard": shard,
        CONTENT: content,
        SHARDS: shards,
    }


def content_digest(blocks: Iterable[np.ndarray]) -> str:
    """The identity of a whole array's contents (what a loader state names):
    sha256 (hex) of all its chunk digests (``blocks``, in order, ``uint32``)."""
    found = hashlib.sha256()
    for block in blocks:
        found.update(np.ascontiguousarray(block, dtype="<u4").tobytes())
    return found.hexdigest()


class ChunkDigests:
    """The recorded chunk digests of one array, and which chunks this process
    checked. Thread-safe. A shard's recorded digests are read the first time
    one of its chunks is checked, and checked against the attribute first.
    """

    def __init__(self, where: str, size: int, chunk: int, shard: int, open_side: OpenSide) -> None:
        self.where, self.size, self.chunk, self.shard = where, size, chunk, shard
        self.count, self.per_shard = -(-size // chunk), shard // chunk
        self.bytes_read = 0  # through the array's reader: the chunks read to hash
        self.side_bytes = 0  # of the side array: the recorded digests
        # [count] uint32: the recorded digests of the shards loaded so far
        # (``_sides.checked``: the digests of a shard read and vouched for).
        self._recorded = np.zeros(self.count, np.uint32)
        self._open_side = open_side
        self._side: ArrayReader | None = None
        self.content: str | None = None  # the recorded content digest, if any
        # The recorded crc32c of each shard's side chunk ([shards] int64), if any.
        self.shards: np.ndarray | None = None
        self._lock = threading.Lock()  # for bytes_read
        self._checks: Checks[dict[int, np.ndarray]] = Checks(self.count)
        self._sides: Checks[None] = Checks(-(-size // shard))
        self._loading = threading.Lock()  # held while recorded digests are read

    @classmethod
    def of(
        cls, attributes: Mapping[str, Any], where: str, size: int, open_side: OpenSide
    ) -> ChunkDigests | None:
        """The digests an array's ``attributes`` announce; ``None`` when none.
        Raises ``FormatError`` for a malformed attribute."""
        found = attributes.get(DIGESTS)
        if found is None:
            return None
        content = found.get(CONTENT) if isinstance(found, Mapping) else None
        shards = crc_list(found.get(SHARDS)) if isinstance(found, Mapping) else None
        ok = (
            isinstance(found, Mapping)
            and set(found) - {CONTENT, SHARDS} == {"algorithm", "chunk", "shard"}
            and (content is None or (isinstance(content, str) and _HEX64.fullmatch(content)))
            and (SHARDS not in found or shards is not None)
            and found["algorithm"] == ALGORITHM
            and all(type(found[k]) is int and found[k] >= 1 for k in ("chunk", "shard"))
            and found["shard"] % found["chunk"] == 0
        )
        if not ok:
            raise FormatError(
                f"{where}: attribute {DIGESTS!r} is malformed: {found!r}; expected "
                f'{{"algorithm": "{ALGORITHM}", "chunk": C, "shard": S[, "{CONTENT}": H, '
                f'"{SHARDS}": [X0, ...]]}}, the values per digest and per shard (positive ints, '
                "C dividing S), the sha256 of all the digests (64 hex digits) and the crc32c "
                "of each shard's digests (ints in [0, 2**32))"
            )
        made = cls(where, size, found["chunk"], found["shard"], open_side)
        if shards is not None and shards.size != made._sides.checked.size:
            raise FormatError(
                f"{where}: attribute {DIGESTS!r} has {shards.size} {SHARDS!r} entries, expected "
                f"{made._sides.checked.size} (one per shard of {made.shard} of {size} values): "
                "the attribute belongs to another array: rewrite the dataset"
            )
        made.content, made.shards = content, shards
        return made

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

    @property
    def checked(self) -> np.ndarray:
        """``[count] bool``: which chunks this process has checked."""
        return self._checks.checked

    def start_check(
        self, reader: ArrayReader, starts: np.ndarray, stops: np.ndarray
    ) -> Known | None:
        """Starts checking every chunk of ``reader`` (this array) that ranges
        ``[starts, stops)`` touch and no read has checked or is checking: reads
        them whole where the reader does not hold their stored checksums.
        ``None`` when all were checked; ``Known.wait`` raises ``FormatError``
        naming a chunk that differs."""
        chunks = touched(starts, stops, self.chunk)
        if self.checked[chunks].all():
            return None
        whole: list[np.ndarray] = []

        def begin(mine: np.ndarray) -> Callable[[], dict[int, np.ndarray]]:
            check, read = self._begin(reader, mine)
            if read:
                whole.append(mine)
            return check

        waiting = self._checks.start(chunks, begin)
        read = frozenset(whole[0].tolist()) if whole else frozenset()
        return Known(self.chunk, read, waiting)

    def check(self, reader: ArrayReader, starts: np.ndarray, stops: np.ndarray) -> None:
        """:meth:`start_check`, waited for."""
        known = self.start_check(reader, starts, stops)
        if known is not None:
            known.wait()

    def _begin(
        self, reader: ArrayReader, todo: np.ndarray
    ) -> tuple[Callable[[], dict[int, np.ndarray]], bool]:
        """Starts checking ``todo`` (sorted chunk numbers): the call that waits and
        checks them (giving the chunks it read whole), and whether it reads them."""
        got = reader.stored_crc32c(todo, self.chunk)
        if got is not None:
            stored = got

            def compare() -> dict[int, np.ndarray]:
                self._verify(todo, stored)
                return {}

            return compare, False
        # Runs of consecutive chunks as one range each: a store reads
        # adjacent chunks of a shard in one request, as the read would.
        runs = np.split(todo, np.flatnonzero(np.diff(todo) != 1) + 1)
        lo = np.array([r[0] for r in runs], np.int64) * self.chunk
        hi = np.minimum(np.array([r[-1] + 1 for r in runs], np.int64) * self.chunk, self.size)
        pending = reader.request_ranges(lo, hi)
        recorded = self._start_load(todo)  # read while the chunks are in flight

        def hashed() -> dict[int, np.ndarray]:
            recorded()
            values = [
                run_values[i * self.chunk : (i + 1) * self.chunk]
                for run, run_values in zip(runs, pending.result(), strict=True)
                for i in range(run.size)
            ]
            with self._lock:
                self.bytes_read += sum(v.nbytes for v in values)
            self._verify(todo, np.array([chunk_digest(v, self.chunk) for v in values], np.uint32))
            return dict(zip(todo.tolist(), values, strict=True))

        return hashed, True

    def _verify(self, chunks: np.ndarray, got: np.ndarray) -> None:
        bad = self._mismatches(chunks, got)
        if bad:
            raise FormatError(f"{self.where}: {bad[0]}")

    def check_block(self, offset: int, values: np.ndarray) -> list[str]:
        """For ``validate``: checks the chunks wholly inside ``values``, the array's
        elements from ``offset`` on; a message for each that differs."""
        first = -(-offset // self.chunk)
        stop = (offset + values.size) // self.chunk
        if offset + values.size == self.size:
            stop = self.count
        if stop <= first:
            return []
        todo = np.arange(first, stop, dtype=np.int64)
        got = chunk_digests(values[first * self.chunk - offset :], self.chunk)[: todo.size]
        bad = self._mismatches(todo, got)
        self.checked[todo] = True
        return bad

    def side_problems(self) -> list[str]:
        """For ``validate``: every shard's recorded digests checked against the
        attribute and all against ``content``; a message for each that differs."""
        with self._loading:
            todo = np.flatnonzero(~self._sides.checked)
            bad = []
            if todo.size:
                bad = self._keep_side(todo, self.side().read_ranges(*self._side_ranges(todo)))
        if bad or self.content is None or self.shards is None:
            return bad  # without ``shards``, reading them compared them with ``content``
        return self._content_problems([self._recorded])

    def _content_problems(self, digests: list[np.ndarray]) -> list[str]:
        """A message if the sha256 of ``digests`` (all, in order) is not ``content``."""
        found = content_digest(digests)
        if self.content is None or found == self.content:
            return []
        return [
            f"the chunk digests are not those recorded when the array was written (sha256 "
            f"{found[:16]}..., recorded {self.content[:16]}...): a shard and its digests of "
            "another version copied in? restore them from the dataset's source or rewrite "
            "the dataset"
        ]

    def _mismatches(self, chunks: np.ndarray, got: np.ndarray) -> list[str]:
        self._start_load(chunks)()  # raises for digests the attribute does not vouch for
        recorded = self._recorded[chunks]
        return [
            self._message(int(chunks[i]), int(got[i]), int(recorded[i]))
            for i in np.flatnonzero(got != recorded)
        ]

    def _start_load(self, chunks: np.ndarray) -> Callable[[], None]:
        """Starts reading the recorded digests of the shards of ``chunks`` not read
        yet; the call returned waits and keeps them, raising ``FormatError`` for a bad one."""
        shards = np.unique(chunks // self.per_shard)
        if self._sides.checked[shards].all():
            return lambda: None
        if self.shards is None and self.content is not None:
            shards = np.arange(self._sides.checked.size, dtype=np.int64)  # all, for content

        def begin(mine: np.ndarray) -> Callable[[], None]:
            pending = self.side().request_ranges(*self._side_ranges(mine))

            def keep() -> None:
                found = pending.result()
                with self._loading:
                    bad = self._keep_side(mine, found)
                if bad:
                    raise FormatError(f"{self.where}/{DIGESTS}: {bad[0]}")

            return keep

        return self._sides.start(shards, begin)

    def _side_ranges(self, shards: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        lo = shards * self.per_shard
        return lo, np.minimum(lo + self.per_shard, self.count)

    def _keep_side(self, shards: np.ndarray, found: list[np.ndarray]) -> list[str]:
        """Keeps the recorded digests ``found`` of ``shards`` (sorted; ``_loading``
        held) that the attribute vouches for (each shard's ``shards`` entry, or
        with ``content`` alone, all shards' digests); a message for each that fails."""
        lo = shards * self.per_shard
        self.side_bytes += sum(values.nbytes for values in found)
        bad: list[str] = []
        good = np.ones(shards.size, bool)
        if self.shards is not None:
            got = np.array([side_digests(values, self.per_shard)[0] for values in found], np.int64)
            good = got == self.shards[shards]
            bad = [
                self._side_message(int(shards[i]), int(got[i]), int(self.shards[shards[i]]))
                for i in np.flatnonzero(~good)
            ]
        elif self.content is not None:
            bad = self._content_problems(found)
            good[:] = not bad
        for i in np.flatnonzero(good).tolist():
            self._recorded[lo[i] : lo[i] + found[i].size] = found[i]
        self._sides.checked[shards[good]] = True
        return bad

    def _side_message(self, s: int, got: int, recorded: int) -> str:
        a, b = s * self.per_shard, min((s + 1) * self.per_shard, self.count)
        return (
            f"shard {s}'s chunk digests are not those recorded when the array was written "
            f"(entries [{a}, {b}), of values [{s * self.shard}, "
            f"{min((s + 1) * self.shard, self.size)})): their crc32c {got:#010x} differs from "
            f"the attribute's {recorded:#010x} (shard {s} and its digests copied in from "
            "another version?): restore both from the dataset's source or rewrite the dataset"
        )

    def _message(self, c: int, got: int, recorded: int) -> str:
        lo, hi = c * self.chunk, min((c + 1) * self.chunk, self.size)
        return (
            f"shard {lo // self.shard}, chunk {c} (values [{lo}, {hi})) is not the one "
            f"written here: its crc32c {got:#010x} differs from the recorded {recorded:#010x} "
            "(a shard of another version, split or dataset copied or linked in its place?): "
            "restore the shard or rewrite the dataset"
        )
