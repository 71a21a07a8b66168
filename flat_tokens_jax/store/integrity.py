"""An array read with its integrity checks: the shard probes and chunk digests
of what each read touches, started with the read's own requests and waited for
before it gives values (see :mod:`~flat_tokens_jax.store.checks`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from flat_tokens_jax.core.format import FormatError
from flat_tokens_jax.store.arrays import ArrayReader, Known, Pending
from flat_tokens_jax.store.digests import CONTENT, DIGESTS, ChunkDigests
from flat_tokens_jax.store.localshards import touched
from flat_tokens_jax.store.probes import ATTRIBUTE as PROBES
from flat_tokens_jax.store.probes import ShardProbes
from flat_tokens_jax.store.store import Store


class CheckedArray:
    """Reads of one array that check every shard and chunk they touch, the
    first time a read touches it (once per process). Thread-safe. Reads made
    through ``reader`` directly are not checked; ``probes`` and ``digests`` are
    ``None`` where the array records none."""

    def __init__(
        self, reader: ArrayReader, probes: ShardProbes | None, digests: ChunkDigests | None
    ) -> None:
        self.reader, self.probes, self.digests = reader, probes, digests
        # Blocks of `_unit` elements (a digest's chunk, else a probe's shard) that
        # passed every check: a read that touches only those starts none, and
        # asks neither the probes nor the digests (a run's steady state).
        self._unit = 0 if probes is None else probes.shard
        if digests is not None:
            self._unit = digests.chunk
        self._clean = np.zeros(-(-reader.size // self._unit), bool) if self._unit else None

    @classmethod
    def open(
        cls,
        store: Store,
        key: str,
        reader: ArrayReader,
        attributes: Mapping[str, Any],
        *,
        ours: bool,
    ) -> CheckedArray:
        """The checks that the array at ``key`` records in its ``attributes``;
        ``FormatError`` for a malformed one, or with ``ours`` (the dataset says
        our writers made it, which record both on every array) a missing one, so
        that deleting it cannot make a shard copied in with its digests read."""
        where, side = f"{store.url}/{key}", f"{key}/{DIGESTS}"

        def open_side() -> ArrayReader:
            found = store.array_metadata(side)
            if found is None:
                raise FormatError(
                    f"{where}/{DIGESTS}: the chunk digests that the array's attribute "
                    f"{DIGESTS!r} announces are missing: rewrite the dataset"
                )
            return store.open_array(side, *found)

        probes = ShardProbes.of(attributes, where, reader.size)
        digests = ChunkDigests.of(attributes, where, reader.size, open_side)
        if not ours or (digests is not None and digests.content is not None and probes is not None):
            return cls(reader, probes, digests)
        if probes is None:
            missing = f"attribute {PROBES!r} is missing"
        elif digests is None:
            missing = f"attribute {DIGESTS!r} is missing"
        else:
            missing = f"attribute {DIGESTS!r} has no {CONTENT!r}"
        raise FormatError(
            f"{where}: {missing}, which our writers record on every array of a dataset whose "
            "root attributes say they made it: deleted? restore the array's metadata from the "
            "dataset's source, or rewrite the dataset"
        )

    @property
    def data_bytes(self) -> int:
        """Bytes requested through :attr:`reader` for the values read, not for the checks."""
        through_reader = sum(c.bytes_read for c in (self.probes, self.digests) if c is not None)
        return self.reader.bytes_read - through_reader

    @property
    def check_bytes(self) -> int:
        """Bytes read to check shard probes and chunk digests (with the recorded digests)."""
        digests = 0 if self.digests is None else self.digests.bytes_read + self.digests.side_bytes
        return digests + (0 if self.probes is None else self.probes.bytes_read)

    def request_ranges(self, starts: np.ndarray, stops: np.ndarray) -> Pending:
        """Starts reading elements ``[starts[i], stops[i])`` and the checks of
        what they touch; ``.result()`` gives the values once the checks pass."""
        return self.reader.request_ranges(starts, stops, self.start_checks(starts, stops))

    def read_points(self, indices: np.ndarray) -> np.ndarray:
        """Elements at ``indices`` (``[k]``), read once what they touch is checked."""
        known = self.start_checks(indices, indices + 1)
        if known is not None:
            known.wait()
        return self.reader.read_points(indices)

    def start_checks(self, starts: np.ndarray, stops: np.ndarray) -> Known | None:
        """Starts checking what ranges ``[starts, stops)`` touch, so that those
        reads share the read's round trips; what the read waits for before it
        gives values (``None``: all checked before)."""
        if self._clean is None:
            return None
        blocks = touched(starts, stops, self._unit)
        if self._clean[blocks].all():
            return None
        probes, digests, read = self.probes, self.digests, self.reader
        probed = None if probes is None else probes.start_check(read.request_ranges, starts, stops)
        known = None if digests is None else digests.start_check(read, starts, stops)
        clean = self._clean

        def wait() -> Mapping[int, np.ndarray] | None:
            # The digests' wait reads the recorded digests while the probes
            # are in flight; a shard whose probe differs is named first.
            try:
                values = None if known is None else known.wait()
            finally:
                if probed is not None:
                    probed()
            clean[blocks] = True
            return values

        return Known(1, frozenset(), wait) if known is None else known._replace(wait=wait)
