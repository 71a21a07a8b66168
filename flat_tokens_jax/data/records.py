"""Records of fixed length over one split: packed windows or padded sequences (bins:
:mod:`flat_tokens_jax.data.bins`). A packed record reads one token range; a padded one
its bounds from ``seq_starts``, then its tokens, each stage one batched request."""

from __future__ import annotations

import abc
import dataclasses
import hashlib
import os
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from flat_tokens_jax.core.concurrently import at_once
from flat_tokens_jax.core.fields import Packing
from flat_tokens_jax.core.format import ENCODED_DTYPE, FormatError, as_indices, indices_below
from flat_tokens_jax.core.limits import check_seq_len
from flat_tokens_jax.core.urls import redact
from flat_tokens_jax.data.dataset import Dataset, FlatTokens


@dataclasses.dataclass(frozen=True)
class Windows:
    """Encoded tokens of a batch of records, before decoding into model fields:
    ``encoded`` ``uint32``, packed ``[k, L + 1]`` (column 0: the token before
    the record, 0 for record 0), padded ``[k, L]`` (0 past the sequence), ``L``
    the columns read; padded and bins: ``lengths`` ``[k] int64``; the split's
    ``stored_mask`` ``[k, L] uint8`` aligned with the targets, or ``None``."""

    encoded: np.ndarray
    lengths: np.ndarray | None = None
    stored_mask: np.ndarray | None = None


class Records(Protocol):
    """Random access to fixed-length records.

    Contract: deterministic (the same index gives the same record every time),
    thread-safe, and ``repr`` tells two sources apart. ``packing`` says how
    ``read``'s windows decode, as ``LoaderConfig.packing`` does. Records may
    also define ``request(indices, columns)``, which starts the reads of
    ``read(indices, columns)`` and returns a function that waits for them
    (see :func:`request_windows`); the records of a split do. And
    ``segments(indices)``, ``(row, length)`` ``[m] int64``: the segments (runs
    of one nonzero segment id) of each record's row, in row order, from
    sequence boundaries alone, never tokens; ``balance_groups`` needs it.
    """

    seq_len: int

    @property
    def packing(self) -> Packing: ...

    def __len__(self) -> int: ...

    def read(self, indices: np.ndarray, columns: tuple[int, int] | None = None) -> Windows:
        """Encoded tokens of records ``indices`` (``[k] int64``); with ``columns=(c0,
        c1)`` (a sequence-sharded batch) packed windows hold tokens ``c0 - 1 .. c1``
        of the record, padded rows columns ``c0 .. c1`` (``lengths`` stay whole)."""
        ...

    def token_ranges(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(start, stop)`` ``[k] int64`` of the tokens each record's targets come from."""
        ...

    def fingerprint(self) -> dict[str, Any]:
        """What identifies the data behind the records (for checkpoint checks)."""
        ...


def _data_fingerprint(ft: FlatTokens) -> dict[str, Any]:
    """Counts, a digest of 64 evenly spaced tokens and sequence bounds, the
    recorded tokenizer's vocabulary hash and a digest of the arrays' recorded
    content digests (``None``: not recorded; a view shares its split's)."""
    tokenizer = None if ft.info is None else ft.info.tokenizer

    def spaced(n: int) -> np.ndarray:
        return np.unique(np.linspace(0, n - 1, 64).astype(np.int64)) if n else np.zeros(0, int)

    tokens, bounds = spaced(ft.num_tokens), spaced(ft.num_sequences)
    parts = at_once(
        [lambda: ft.encoded_ranges(tokens, tokens + 1), lambda: list(ft.sequence_bounds(bounds))]
    )
    digests = [(name, ft.digests.get(name)) for name in sorted(ft.digests)]
    contents = [(name, d.content) for name, d in digests if d is not None]
    content = None
    if len(contents) == len(digests) and all(c is not None for _, c in contents):
        text = ";".join(f"{name}={c}" for name, c in contents)
        content = hashlib.sha256(text.encode()).hexdigest()[:32]
    digest = hashlib.sha256()
    for part in (p for found in parts for p in found):
        digest.update(np.ascontiguousarray(part).tobytes())
    return {
        "num_tokens": ft.num_tokens,
        "num_sequences": ft.num_sequences,
        "max_token_id": ft.max_token_id,
        "loss_mask": ft.loss_mask is not None,
        "sample_digest": digest.hexdigest()[:16],
        "tokenizer": None if tokenizer is None else tokenizer.vocab_hash,
        "content": content,
    }


def request_windows(
    records: Records, indices: np.ndarray, columns: tuple[int, int] | None = None
) -> Callable[[], Windows]:
    """``request_windows(r, i, c)()`` is ``r.read(i, c)``; records with a
    ``request`` start their reads and return at once, others are read here."""
    request = getattr(records, "request", None)
    if request is not None:
        waiting: Callable[[], Windows] = request(indices, columns)
        return waiting
    windows = records.read(indices, columns)
    return lambda: windows


def check_source(source: Any, who: str) -> None:
    """Raises ``TypeError``, naming ``who`` (``"component 'web'"``) and the fix,
    for a ``source`` that is neither a split nor records."""
    if isinstance(source, FlatTokens):
        return
    if isinstance(source, Dataset):
        raise TypeError(
            f"{who} is a whole dataset ({source.url}); pick a split: ds[{source.splits[0]!r}]"
        )
    if isinstance(source, str | os.PathLike):
        url = redact(source)
        raise TypeError(
            f"{who} is the URL {url!r}; open a split: ftj.open_dataset({url!r})['train']"
        )
    if not all(hasattr(source, a) for a in ("read", "seq_len", "packing", "token_ranges")):
        raise TypeError(
            f"{who}: expected a FlatTokens split (ds['train']) or Records, "
            f"got {type(source).__name__}"
        )
    check_packing(source, who)


def check_packing(records: Any, who: str) -> None:
    """Raises ``TypeError`` for records whose ``packing`` is not a :class:`Packing`."""
    if not isinstance(records.packing, Packing):
        raise TypeError(
            f"{who}: {type(records).__name__}.packing is {records.packing!r}; records "
            "say how they decode with a flat_tokens_jax.Packing: Packing.WINDOWS "
            "(packed windows), Packing.PADDED (padded sequences) or Packing.BINS"
        )


def recorded_info(records: object) -> Any:
    """The ``DatasetInfo`` behind ``records``; ``None`` for records not over a
    split and datasets that record none."""
    ft = getattr(records, "ft", None)
    return getattr(ft, "info", None) if isinstance(ft, FlatTokens) else None


class _SplitRecords(abc.ABC):
    """Records over one split."""

    packing: Packing

    def __init__(self, ft: FlatTokens, seq_len: int) -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        check_seq_len(seq_len, f"records of {ft!r}:")
        self.ft, self.seq_len = ft, seq_len

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.ft!r}, seq_len={self.seq_len})"

    def read(self, indices: np.ndarray, columns: tuple[int, int] | None = None) -> Windows:
        return self.request(indices, columns)()

    @abc.abstractmethod
    def request(
        self, indices: np.ndarray, columns: tuple[int, int] | None = None
    ) -> Callable[[], Windows]:
        """Starts reading records ``indices``; the function returned waits for them."""

    def fingerprint(self) -> dict[str, Any]:
        kind = "packed" if self.packing is Packing.WINDOWS else "padded"
        return {"records": kind, "seq_len": self.seq_len, **_data_fingerprint(self.ft)}


class PackedRecords(_SplitRecords):
    """Record ``i`` is tokens ``[i*L, (i+1)*L)`` of a split, plus the token
    before it; a tail shorter than ``L`` is never used."""

    packing = Packing.WINDOWS

    def __len__(self) -> int:
        return self.ft.num_tokens // self.seq_len

    def token_ranges(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        start = as_indices(indices, "record indices").reshape(np.shape(indices)) * self.seq_len
        return start, start + self.seq_len

    def segments(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        start = indices_below(indices, len(self), "record", self) * self.seq_len
        inside, at = self.ft.starts_inside(start, start + self.seq_len)
        # A row's segments run between its edges and the sequence starts inside it.
        k = np.arange(start.size, dtype=np.int64)
        row = np.concatenate([k, inside, k])
        edge = np.concatenate([start, at, start + self.seq_len])
        order = np.lexsort((edge, row))
        row, edge = row[order], edge[order]
        same = row[1:] == row[:-1]
        return row[1:][same], np.diff(edge)[same]

    def request(
        self, indices: np.ndarray, columns: tuple[int, int] | None = None
    ) -> Callable[[], Windows]:
        idx = indices_below(indices, len(self), "record", self)
        c0, c1 = _check_columns(columns, self.seq_len)
        base = idx * self.seq_len
        start, stop = base + c0, base + c1
        tokens = self.ft.request_encoded(np.maximum(start - 1, 0), stop)
        masks = self.ft.request_loss_mask(start, stop)

        def windows() -> Windows:
            # Record 0 has no token before it: its row is right-aligned, column 0 stays 0.
            out = tokens.rows(c1 - c0 + 1, ENCODED_DTYPE, right=True)
            mask = None if masks is None else masks.rows(c1 - c0, np.uint8)
            return Windows(out, stored_mask=mask)

        return windows


class PaddedRecords(_SplitRecords):
    """Record ``i`` is sequence ``i``, truncated to ``L`` tokens, padded on the right."""

    packing = Packing.PADDED

    def __len__(self) -> int:
        return self.ft.num_sequences

    def token_ranges(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        start, stop = self.ft.sequence_bounds(indices)
        return start, np.minimum(stop, start + self.seq_len)

    def segments(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        start, stop = self.token_ranges(indices)
        return np.arange(start.size, dtype=np.int64), stop - start

    def request(
        self, indices: np.ndarray, columns: tuple[int, int] | None = None
    ) -> Callable[[], Windows]:
        idx = indices_below(indices, len(self), "record", self)
        c0, c1 = _check_columns(columns, self.seq_len)
        start, stop = self.token_ranges(idx)
        lo = np.minimum(start + c0, stop)
        hi = np.minimum(start + c1, stop)
        tokens = self.ft.request_encoded(lo, hi)
        masks = self.ft.request_loss_mask(lo, hi)

        def windows() -> Windows:
            out = tokens.rows(c1 - c0, ENCODED_DTYPE)
            check_start_bits(self.ft, out, idx, start + c0, stop - start, c0 == 0)
            mask = None if masks is None else masks.rows(c1 - c0, np.uint8)
            return Windows(out, lengths=stop - start, stored_mask=mask)

        return windows


def check_start_bits(
    ft: FlatTokens,
    rows: np.ndarray,
    sequences: np.ndarray,
    first: np.ndarray,
    lengths: np.ndarray,
    at_start: bool,
) -> None:
    """Raises :class:`FormatError` unless every padded row of ``rows`` (``[k, w]``
    encoded, from split token ``first[r]`` on) whose column 0 is its sequence's
    first token (``at_start``) has the start bit set there (one column: cheap)."""
    if not at_start or rows.shape[1] == 0:
        return
    clear = np.flatnonzero(((rows[:, 0] & 1) == 0) & (lengths > 0))
    if clear.size:
        r = int(clear[0])
        token = int(first[r]) + ft.token_range[0]
        raise FormatError(
            f"{ft.url}/{ft.split_name}/{ft.tokens_name}[{token}]: start bit clear where "
            f"seq_starts[{int(sequences[r]) + ft.seq_range[0]}] begins a sequence: "
            "the store is corrupt"
        )


def _check_columns(columns: tuple[int, int] | None, seq_len: int) -> tuple[int, int]:
    c0, c1 = (0, seq_len) if columns is None else columns
    if not 0 <= c0 < c1 <= seq_len:
        raise ValueError(f"columns ({c0}, {c1}) are not a range within [0, {seq_len}]")
    return c0, c1


def sources_of(names: Sequence[str], components: Sequence[Records]) -> list[dict[str, Any]]:
    """Where each named component's data lives, JSON-ready (``repr`` for custom records)."""
    out: list[dict[str, Any]] = []
    for name, records in zip(names, components, strict=True):
        ft = getattr(records, "ft", None)
        if isinstance(ft, FlatTokens):
            out.append(
                {
                    "name": name,
                    "url": ft.url,
                    "split": ft.split_name,
                    "sequences": list(ft.seq_range),
                }
            )
        else:
            out.append({"name": name, "repr": repr(records)})
    return out
