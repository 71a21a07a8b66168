"""Records read in whole blocks: a block of consecutive records as one token
range, and the rows of its records taken from it.

Under the block shuffle (``LoaderConfig(shuffle="blocks")``) block ``b`` is
records ``[b * B, (b + 1) * B)``. Their tokens are one contiguous range of
the split for packed windows (``[b * B * L - 1, (b + 1) * B * L)``, the token
before the block included) and for padded sequences (the block's whole
sequences, from the first one's start to the last one's end, truncated to
``L``), so a block is one request (two with a stored loss mask, and, padded,
one of ``seq_starts`` first). Bins are not: a bin's sequences lie anywhere in
the split, so a block of bins would cost as many requests as its rows, and
bins (and records that are not a split's) are read row by row.

The rows taken from a block are those :meth:`~.records.PackedRecords.request`
and :meth:`~.records.PaddedRecords.request` give, bit for bit, with the same
checks: the reads go through the split's checked arrays, and padded rows'
start bits are checked as theirs are.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import numpy as np

from flat_tokens_jax.core.format import ENCODED_DTYPE
from flat_tokens_jax.data.records import (
    PackedRecords,
    PaddedRecords,
    Records,
    Windows,
    _check_columns,
    _check_indices,
    check_start_bits,
)

SplitRecords = PackedRecords | PaddedRecords


def reads_blocks(records: Records) -> bool:
    """Whether ``records`` are read in blocks (a split's packed windows or
    padded sequences); bins and other records are read row by row."""
    return type(records) in (PackedRecords, PaddedRecords)


@dataclasses.dataclass(frozen=True)
class BlockTokens:
    """A block's tokens as read, ready to give its records' rows.

    Attributes:
        tokens: ``[m] uint32`` encoded tokens ``[base, base + m)`` of the split
            (packed: element 0 is 0 for the block of record 0, which has no
            token before it).
        mask: ``[m'] uint8`` the stored loss mask from ``mask_base`` on, or ``None``.
        base, mask_base: the split token of element 0 of each.
        starts, stops: padded: ``[B'] int64`` each record's tokens (truncated
            to ``seq_len``), from the block's first record on; else ``None``.
    """

    tokens: np.ndarray
    mask: np.ndarray | None
    base: int
    mask_base: int
    starts: np.ndarray | None = None
    stops: np.ndarray | None = None

    @property
    def nbytes(self) -> int:
        """Bytes the block holds."""
        extra = [a for a in (self.mask, self.starts, self.stops) if a is not None]
        return self.tokens.nbytes + sum(a.nbytes for a in extra)


@dataclasses.dataclass(frozen=True)
class BlockPlan:
    """What reading some blocks of ``records`` takes: each block's token range
    (padded: after reading its sequences' bounds) and the bytes it will hold."""

    records: SplitRecords
    blocks: np.ndarray  # [k] int64 block indices
    size: int  # B, records per block
    lo: np.ndarray  # [k] int64 first token read (packed: the token before, or 0)
    hi: np.ndarray  # [k] int64 the token after the last one read
    bounds: list[tuple[np.ndarray, np.ndarray]] | None  # padded: each block's records' tokens

    @property
    def nbytes(self) -> np.ndarray:
        """``[k] int64`` bytes each block will hold as :class:`BlockTokens`."""
        tokens = self.hi - self.lo
        per_token = 4 + (self.records.ft.loss_mask is not None)
        if self.bounds is None:  # packed: the token before record 0 is a 0 added
            return tokens * per_token + 4 * (self.lo == 0)
        return tokens * per_token + np.array([16 * s.size for s, _ in self.bounds], np.int64)

    @property
    def _packed(self) -> bool:
        return isinstance(self.records, PackedRecords)

    def request(self) -> Callable[[], list[BlockTokens]]:
        """Starts reading the blocks, all ranges in one batch; the function
        returned waits for them."""
        ft, packed = self.records.ft, self._packed
        seq_len = self.records.seq_len
        mask_lo = self.blocks * np.int64(self.size * seq_len) if packed else self.lo
        tokens, masks = ft.request_encoded_and_mask(self.lo, self.hi, mask_lo, self.hi)

        def blocks() -> list[BlockTokens]:
            got = tokens.result()
            mask = None if masks is None else masks.result()
            out = []
            for i, piece in enumerate(got):
                lo = int(self.lo[i])
                if packed and lo == 0 and self.blocks[i] == 0:
                    piece, lo = np.concatenate([np.zeros(1, piece.dtype), piece]), -1
                starts, stops = (None, None) if self.bounds is None else self.bounds[i]
                m = None if mask is None else mask[i]
                out.append(BlockTokens(piece, m, lo, int(mask_lo[i]), starts, stops))
            return out

        return blocks


def plan_blocks(records: SplitRecords, blocks: np.ndarray, size: int) -> BlockPlan:
    """The reads of ``blocks`` (``[k] int64``) of ``size`` records each;
    padded records read their sequences' bounds here (one request)."""
    n = len(records)
    first = blocks * np.int64(size)
    stop = np.minimum(first + size, n)
    if isinstance(records, PackedRecords):
        seq_len = records.seq_len
        return BlockPlan(
            records, blocks, size, np.maximum(first * seq_len - 1, 0), stop * seq_len, None
        )
    counts = stop - first
    at = np.repeat(first - np.cumsum(counts) + counts, counts) + np.arange(int(counts.sum()))
    starts, stops = records.token_ranges(at)
    cuts = np.cumsum(counts)[:-1]
    bounds = list(zip(np.split(starts, cuts), np.split(stops, cuts), strict=True))
    lo = np.array([s[0] for s, _ in bounds], np.int64)
    hi = np.array([e[-1] for _, e in bounds], np.int64)
    return BlockPlan(records, blocks, size, lo, hi, bounds)


def block_rows(
    records: SplitRecords,
    held: Mapping[int, BlockTokens],
    indices: np.ndarray,
    size: int,
    columns: tuple[int, int] | None = None,
) -> Windows:
    """``records.read(indices, columns)``, from the blocks ``held`` (by block
    index, ``size`` records each) that hold every record of ``indices``."""
    idx = _check_indices(indices, len(records), records)
    c0, c1 = _check_columns(columns, records.seq_len)
    packed = isinstance(records, PackedRecords)
    width = c1 - c0 + int(packed)
    out = np.zeros((idx.size, width), ENCODED_DTYPE)
    has_mask = records.ft.loss_mask is not None
    mask = np.zeros((idx.size, c1 - c0), np.uint8) if has_mask else None
    lengths = None if packed else np.zeros(idx.size, np.int64)
    starts_all = np.zeros(idx.size, np.int64)
    block = idx // np.int64(size)
    for b in np.unique(block).tolist():
        rows = np.flatnonzero(block == b)
        got = held[b]
        if packed:
            seq_len = records.seq_len
            begin = idx[rows] * seq_len + c0
            lo, hi = begin - 1, begin + (c1 - c0)
            _gather(out, rows, got.tokens, lo - got.base, hi - lo)
            if mask is not None and got.mask is not None:
                _gather(mask, rows, got.mask, begin - got.mask_base, hi - begin)
            continue
        assert got.starts is not None and got.stops is not None and lengths is not None
        k = idx[rows] - b * size
        start, stop = got.starts[k], got.stops[k]
        lo, hi = np.minimum(start + c0, stop), np.minimum(start + c1, stop)
        _gather(out, rows, got.tokens, lo - got.base, hi - lo)
        if mask is not None and got.mask is not None:
            _gather(mask, rows, got.mask, lo - got.mask_base, hi - lo)
        lengths[rows], starts_all[rows] = stop - start, start
    if packed:
        return Windows(out, stored_mask=mask)
    assert lengths is not None
    check_start_bits(records.ft, out, idx, starts_all + c0, lengths, c0 == 0)
    return Windows(out, lengths=lengths, stored_mask=mask)


def _gather(
    out: np.ndarray, rows: np.ndarray, values: np.ndarray, first: np.ndarray, count: np.ndarray
) -> None:
    """``out[rows[r], :count[r]] = values[first[r] : first[r] + count[r]]``,
    vectorised (``count`` at most ``out``'s width; the rest of a row stays 0)."""
    cols = np.arange(out.shape[1], dtype=np.int64)
    keep = cols[None, :] < np.asarray(count)[:, None]
    where = np.where(keep, np.asarray(first)[:, None] + cols[None, :], 0)
    out[rows] = np.where(keep, values[where], 0)
