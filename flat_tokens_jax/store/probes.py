"""Shard probes: the CRC-32 of each shard file's first :data:`PROBE` values,
recorded by our writers (attribute ``shard_probes``, docs/format.md) and
checked on a shard's first read, so that a valid shard of another split or
dataset copied in its place (which its own checksums cannot tell) fails.
"""

from __future__ import annotations

import threading
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from flat_tokens_jax.core.format import FormatError
from flat_tokens_jax.store.arrays import Pending
from flat_tokens_jax.store.checks import Checks
from flat_tokens_jax.store.localshards import touched

ATTRIBUTE = "shard_probes"
PROBE = 1024  # values per probe: the start of each shard's first inner chunk

ReadRanges = Callable[[np.ndarray, np.ndarray], Sequence[np.ndarray]]
RequestRanges = Callable[[np.ndarray, np.ndarray], Pending]


def digest(values: np.ndarray) -> int:
    """CRC-32 of ``values`` as little-endian bytes of their dtype."""
    little = np.ascontiguousarray(values, dtype=values.dtype.newbyteorder("<"))
    return zlib.crc32(little.tobytes())


def crc_list(value: Any) -> np.ndarray | None:
    """``value`` as ``[n] int64`` if it is a JSON list of 32-bit checksums (ints
    in ``[0, 2**32)``, not booleans), as attributes record one per shard; else ``None``."""
    if not isinstance(value, list) or not all(type(c) is int and 0 <= c < 2**32 for c in value):
        return None
    return np.array(value, np.int64)


def probe_ranges(shards: np.ndarray, size: int, shard: int) -> tuple[np.ndarray, np.ndarray]:
    """``(starts, stops)`` of the probes of ``shards`` (``[k] int64``)."""
    starts = shards * shard
    return starts, np.minimum(starts + min(PROBE, shard), size)


def probe_attribute(read: ReadRanges, size: int, shard: int) -> dict[str, Any]:
    """The ``shard_probes`` attribute of an array of ``size`` elements in shards
    of ``shard``, whose values ``read`` returns (one batched read)."""
    values = read(*probe_ranges(np.arange(-(-size // shard), dtype=np.int64), size, shard))
    return {"shard": shard, "values": PROBE, "crc32": [digest(v) for v in values]}


class ShardProbes:
    """The recorded probes of one array, and which shards this process checked.

    Thread-safe: concurrent reads may check the same shard; it is read once.
    """

    def __init__(self, where: str, size: int, shard: int, crcs: Sequence[int]) -> None:
        self.where, self.size, self.shard = where, size, shard
        self.crcs = np.asarray(crcs, np.int64)
        self.bytes_read = 0  # by the checks, over all views that share these probes
        self._lock = threading.Lock()  # for bytes_read
        self._checks: Checks[None] = Checks(self.crcs.size)

    @classmethod
    def of(cls, attributes: Mapping[str, Any], where: str, size: int) -> ShardProbes | None:
        """The probes recorded in an array's ``attributes``; ``None`` when there are
        none. ``FormatError`` for a malformed attribute or a count that does not fit."""
        found = attributes.get(ATTRIBUTE)
        if found is None:
            return None
        ok = (
            isinstance(found, Mapping)
            and isinstance(found.get("shard"), int)
            and found["shard"] >= 1
            and found.get("values") == PROBE
            and crc_list(found.get("crc32")) is not None
        )
        if not ok:
            raise FormatError(f"{where}: attribute {ATTRIBUTE!r} is malformed: {found!r}")
        expected = -(-size // found["shard"])
        if len(found["crc32"]) != expected:
            raise FormatError(
                f"{where}: attribute {ATTRIBUTE!r} has {len(found['crc32'])} probes, expected "
                f"{expected} (one per shard of {found['shard']} of {size} values)"
            )
        return cls(where, size, found["shard"], found["crc32"])

    def start_check(
        self, request: RequestRanges, starts: np.ndarray, stops: np.ndarray
    ) -> Callable[[], None]:
        """Starts reading, with ``request``, the probe of every shard that ranges
        ``[starts, stops)`` touch and no read has checked or is checking; the
        call returned waits for them all and raises ``FormatError`` for a shard
        whose probe differs (see :mod:`~flat_tokens_jax.store.checks`)."""

        def begin(mine: np.ndarray) -> Callable[[], None]:
            pending = request(*probe_ranges(mine, self.size, self.shard))
            return lambda: self._verify(mine, pending.result())

        return self._checks.start(touched(starts, stops, self.shard), begin)

    def _verify(self, shards: np.ndarray, values: Sequence[np.ndarray]) -> None:
        bad = self._compare(shards, values)
        if bad:
            raise FormatError(f"{self.where}: {bad[0]}")

    def verify_all(self, read: ReadRanges) -> list[str]:
        """Reads every shard's probe; a message for each that differs (for ``validate``)."""
        shards = np.arange(self.crcs.size, dtype=np.int64)
        return self._compare(shards, read(*probe_ranges(shards, self.size, self.shard)))

    def _compare(self, shards: np.ndarray, values: Sequence[np.ndarray]) -> list[str]:
        """A message for each of ``shards`` whose probe ``values`` differ from the recorded."""
        size = min(PROBE, self.shard)
        with self._lock:
            self.bytes_read += sum(v.nbytes for v in values)
        return [
            f"shard {s} (values [{s * self.shard}, {min((s + 1) * self.shard, self.size)})) "
            f"is not the one written here: its first {size} values differ from the recorded "
            "probe (a shard of another split or dataset copied or linked in its place?)"
            for s, v in zip(shards.tolist(), values, strict=True)
            if digest(v) != self.crcs[s]
        ]
