"""The block shuffle's reads: block ``b`` (records ``[b * B, (b + 1) * B)``) of
packed windows or padded sequences is one contiguous token range, read in one
request; its records' rows are then taken from it, bit for bit and with the same
checks as :meth:`~.records.PackedRecords.request` and ``PaddedRecords.request``
(bins and other records are read row by row)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import numpy as np

from flat_tokens_jax.core.format import ENCODED_DTYPE, indices_below
from flat_tokens_jax.data.records import (
    PackedRecords,
    PaddedRecords,
    Records,
    Windows,
    _check_columns,
    check_start_bits,
)

SplitRecords = PackedRecords | PaddedRecords


def reads_blocks(records: Records) -> bool:
    """Whether ``records`` are read in blocks (a split's packed windows or padded sequences)."""
    return type(records) in (PackedRecords, PaddedRecords)


@dataclasses.dataclass(frozen=True)
class BlockTokens:
    """A block's tokens as read: ``tokens`` ``[m] uint32`` from split token
    ``base`` on (packed block 0: a 0 before record 0), the stored ``mask``
    ``[m'] uint8`` from ``mask_base`` on or ``None``, and, padded, each record's
    token ``starts, stops`` ``[B'] int64`` (truncated to ``seq_len``)."""

    tokens: np.ndarray
    mask: np.ndarray | None
    base: int
    mask_base: int
    starts: np.ndarray | None = None
    stops: np.ndarray | None = None


@dataclasses.dataclass(frozen=True)
class BlockRanges:
    """The token ranges of some blocks of ``records`` and the bytes each will hold."""

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

    def request(self) -> Callable[[], list[BlockTokens]]:
        """Starts reading the blocks in one batch; the function returned waits for them."""
        ft, packed = self.records.ft, self.bounds is None
        seq_len = self.records.seq_len
        mask_lo = self.blocks * np.int64(self.size * seq_len) if packed else self.lo
        tokens = ft.request_encoded(self.lo, self.hi)
        masks = ft.request_loss_mask(mask_lo, self.hi)

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


def block_ranges(records: SplitRecords, blocks: np.ndarray, size: int) -> BlockRanges:
    """The ranges of ``blocks`` (``[k] int64``) of ``size`` records each;
    padded records read their sequences' bounds here (one request)."""
    n = len(records)
    first = blocks * np.int64(size)
    stop = np.minimum(first + size, n)
    if isinstance(records, PackedRecords):
        seq_len = records.seq_len
        return BlockRanges(
            records, blocks, size, np.maximum(first * seq_len - 1, 0), stop * seq_len, None
        )
    counts = stop - first
    at = np.repeat(first - np.cumsum(counts) + counts, counts) + np.arange(int(counts.sum()))
    starts, stops = records.token_ranges(at)
    cuts = np.cumsum(counts)[:-1]
    bounds = list(zip(np.split(starts, cuts), np.split(stops, cuts), strict=True))
    lo = np.array([s[0] for s, _ in bounds], np.int64)
    hi = np.array([e[-1] for _, e in bounds], np.int64)
    return BlockRanges(records, blocks, size, lo, hi, bounds)


def block_rows(
    records: SplitRecords,
    held: Mapping[int, BlockTokens],
    indices: np.ndarray,
    size: int,
    columns: tuple[int, int] | None = None,
) -> Windows:
    """``records.read(indices, columns)``, from the blocks ``held`` (by block
    index, ``size`` records each) that hold every record of ``indices``."""
    idx = indices_below(indices, len(records), "record", records)
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
            mask_lo = idx[rows] * records.seq_len + c0
            lo, hi = mask_lo - 1, mask_lo + (c1 - c0)
        else:
            assert got.starts is not None and got.stops is not None and lengths is not None
            k = idx[rows] - b * size
            start, stop = got.starts[k], got.stops[k]
            lo = mask_lo = np.minimum(start + c0, stop)
            hi = np.minimum(start + c1, stop)
            lengths[rows], starts_all[rows] = stop - start, start
        _gather(out, rows, got.tokens, lo - got.base, hi - lo)
        if mask is not None and got.mask is not None:
            _gather(mask, rows, got.mask, mask_lo - got.mask_base, hi - mask_lo)
    if packed:
        return Windows(out, stored_mask=mask)
    assert lengths is not None
    check_start_bits(records.ft, out, idx, starts_all + c0, lengths, c0 == 0)
    return Windows(out, lengths=lengths, stored_mask=mask)


def _gather(
    out: np.ndarray, rows: np.ndarray, values: np.ndarray, first: np.ndarray, count: np.ndarray
) -> None:
    """``out[rows[r], :count[r]] = values[first[r] : first[r] + count[r]]``, the rest 0."""
    cols = np.arange(out.shape[1], dtype=np.int64)
    keep = cols[None, :] < np.asarray(count)[:, None]
    where = np.where(keep, np.asarray(first)[:, None] + cols[None, :], 0)
    out[rows] = np.where(keep, values[where], 0)
