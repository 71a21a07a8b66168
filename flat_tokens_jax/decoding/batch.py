"""Model fields from encoded tokens (numpy, on the host): packed windows, padded sequences, bins.

Every decoder returns the five fields ``[batch, seq_len]``: ``inputs``, ``targets``,
``segment_ids``, ``positions`` (``int32``) and ``loss_mask`` (``bool``); padding has ``pad_id``
input and target, segment 0, position 0 and ``loss_mask`` False. The ``_jax`` twins
(:mod:`~flat_tokens_jax.decoding.batch_jax`) give the same values inside ``jax.jit``.
"""

from __future__ import annotations

import numpy as np

from flat_tokens_jax.core.buffers import Buffers
from flat_tokens_jax.core.fields import Packing
from flat_tokens_jax.data.records import Windows
from flat_tokens_jax.decoding.segments import sequence_starts, write_segments

FIELDS = ("inputs", "targets", "segment_ids", "positions", "loss_mask")

_INT32 = np.iinfo(np.int32)
_PAGE = 4096
_STAGGER = 768  # a multiple of 64; five fields stay at distinct offsets modulo _PAGE


def _dtype(key: str) -> type[np.generic]:
    return np.bool_ if key == "loss_mask" else np.int32


def empty_fields(batch: int, seq_len: int, buffers: Buffers | None = None) -> dict[str, np.ndarray]:
    """Uninitialised five fields ``[batch, seq_len]``, carved out of one allocation
    (from ``buffers`` when given).

    Five separate 2 MiB arrays freed together make glibc hand the memory back to
    the OS and fault it in again on the next batch (5 ms a batch, where writing
    them takes 0.25 ms). Each field starts 64-byte aligned, so ``jax.device_put``
    on the CPU backend uses it in place, and at its own offset modulo 4 KiB:
    copying ``targets`` into ``inputs`` at the same offset measured 10x slower
    (4K aliasing of loads and stores).
    """
    n = batch * seq_len
    sizes = [n if key == "loss_mask" else 4 * n for key in FIELDS]
    nbytes = sum(sizes) + _PAGE * len(sizes)
    buf = np.empty(nbytes, np.uint8) if buffers is None else buffers.take(nbytes)
    base, offset = buf.ctypes.data, 0
    out: dict[str, np.ndarray] = {}
    for i, (key, size) in enumerate(zip(FIELDS, sizes, strict=True)):
        offset += (i * _STAGGER - (base + offset)) % _PAGE
        out[key] = buf[offset : offset + size].view(_dtype(key)).reshape(batch, seq_len)
        offset += size
    return out


def packed_fields(
    windows: np.ndarray,
    *,
    start_token_id: int = 0,
    stored_mask: np.ndarray | None = None,
    out: dict[str, np.ndarray] | None = None,
) -> dict[str, np.ndarray]:
    """Decodes packed records into model fields.

    ``targets[t]`` is the decoded token at ``t``; ``inputs[t]`` is
    ``start_token_id`` where ``t`` starts a sequence, else the token before it
    (at ``t = 0``, the token before the record). ``segment_ids`` are 1 for a
    row's first segment (a whole sequence or a leading fragment) and grow by one
    at each later sequence start; ``positions`` restart at 0 at each sequence
    start and at column 0.

    ``windows`` ``[batch, seq_len + 1] uint32``: column 0 is the token before
    the record. ``stored_mask`` ``[batch, seq_len]``: nonzero where trained on
    (default: every target). ``out``: five C-contiguous ``[batch, seq_len]``
    arrays to write into (e.g. one row block of a larger batch).

    Example:
        >>> # sequences [1, 2], [3, 4, 5], [6, 7, 8]; packed record 1 of length 4
        >>> w = np.array([[8, 10, 13, 14, 16]], np.uint32)
        >>> f = packed_fields(w)
        >>> f["inputs"].tolist(), f["targets"].tolist()
        ([[4, 0, 6, 7]], [[5, 6, 7, 8]])
        >>> f["segment_ids"].tolist(), f["positions"].tolist()
        ([[1, 2, 2, 2]], [[0, 0, 1, 2]])
    """
    w = _encoded(windows, "windows", min_cols=2)
    batch, seq_len = w.shape[0], w.shape[1] - 1
    start = _int32("start_token_id", start_token_id)
    _check_mask(stored_mask, (batch, seq_len))
    out = _fields_out(out, batch, seq_len)
    inputs, targets, positions = out["inputs"], out["targets"], out["positions"]
    np.right_shift(w[:, 1:], 1, out=targets.view(np.uint32))
    np.copyto(inputs[:, 1:], targets[:, :-1])
    np.right_shift(w[:, 0], 1, out=inputs[:, 0].view(np.uint32))

    # Starts as flat indices (see decoding.segments); `loss_mask` is scratch until written.
    flags = out["loss_mask"].reshape(-1)
    hits = sequence_starts(w.reshape(-1), flags, positions.reshape(-1).view(np.uint32))
    row = hits // (seq_len + 1)
    hits -= row
    starts = hits[hits != row * seq_len] - 1  # drop column 0; index into [batch * seq_len]
    inputs.reshape(-1)[starts] = start
    _stored(out["loss_mask"], stored_mask)
    write_segments(starts, out["segment_ids"], positions)
    return out


def padded_fields(
    tokens: np.ndarray,
    lengths: np.ndarray,
    *,
    start_token_id: int = 0,
    pad_id: int = 0,
    stored_mask: np.ndarray | None = None,
    out: dict[str, np.ndarray] | None = None,
) -> dict[str, np.ndarray]:
    """Decodes one truncated sequence per row into right-padded model fields.

    ``tokens`` ``[batch, seq_len] uint32``: row ``b`` holds the first
    ``lengths[b]`` (in ``[0, seq_len]``) tokens of its sequence, later columns
    ignored. ``stored_mask`` and ``out`` as for ``packed_fields``.

    Example:
        >>> f = padded_fields(np.array([[7, 8, 10, 0, 0]], np.uint32), np.array([3]), pad_id=7)
        >>> f["inputs"].tolist(), f["targets"].tolist()
        ([[0, 3, 4, 7, 7]], [[3, 4, 5, 7, 7]])
        >>> f["segment_ids"].tolist(), f["positions"].tolist()
        ([[1, 1, 1, 0, 0]], [[0, 1, 2, 0, 0]])
    """
    tok = _encoded(tokens, "tokens", min_cols=1)
    batch, seq_len = tok.shape
    start = _int32("start_token_id", start_token_id)
    pad = _int32("pad_id", pad_id)
    lens = _lengths(lengths, batch, seq_len)
    _check_mask(stored_mask, (batch, seq_len))
    out = _fields_out(out, batch, seq_len)
    inputs, targets = out["inputs"], out["targets"]
    np.right_shift(tok, 1, out=targets.view(np.uint32))
    np.copyto(inputs[:, 1:], targets[:, :-1])
    inputs[:, 0] = start
    col = np.arange(seq_len, dtype=np.int32)
    out["positions"][:] = col
    out["segment_ids"].fill(1)
    _stored(out["loss_mask"], stored_mask)
    _pad(out, col >= lens[:, None], pad)
    return out


def _stored(loss_mask: np.ndarray, stored_mask: np.ndarray | None) -> None:
    """Writes the stored mask (nonzero: trained on; default every target) into ``loss_mask``."""
    if stored_mask is None:
        loss_mask.fill(True)
    else:
        np.not_equal(stored_mask, 0, out=loss_mask)


def _pad(out: dict[str, np.ndarray], padding: np.ndarray, pad_id: int) -> None:
    """Writes padding into the five fields where ``padding`` ``[batch, seq_len]`` is True."""
    for key in FIELDS[:4]:
        np.copyto(out[key], pad_id if key in ("inputs", "targets") else 0, where=padding)
    out["loss_mask"] &= ~padding


def _fields_out(
    out: dict[str, np.ndarray] | None, batch: int, seq_len: int
) -> dict[str, np.ndarray]:
    """``out``, checked, or :func:`empty_fields`."""
    if out is None:
        return empty_fields(batch, seq_len)
    for key in FIELDS:
        value, dtype = out.get(key), _dtype(key)
        if (
            not isinstance(value, np.ndarray)
            or value.shape != (batch, seq_len)
            or value.dtype != dtype
            or not value.flags.c_contiguous
        ):
            raise ValueError(
                f"out[{key!r}] must be a C-contiguous [{batch}, {seq_len}] "
                f"{np.dtype(dtype)} array, got {getattr(value, 'shape', value)!r}"
            )
    return out


def _encoded(x: np.ndarray, name: str, min_cols: int) -> np.ndarray:
    """``x`` as a C-contiguous native ``uint32`` 2-D array, or a ValueError."""
    a = np.asarray(x)
    if a.ndim != 2 or a.shape[1] < min_cols:
        raise ValueError(
            f"{name} must be 2-D [batch, {'seq_len + 1' if min_cols == 2 else 'seq_len'}] "
            f"with at least {min_cols} column(s), got shape {a.shape}"
        )
    if a.dtype.kind != "u" or a.dtype.itemsize != 4:
        raise ValueError(
            f"{name} must hold uint32 encoded tokens, got dtype {a.dtype}: "
            "pass the store's encoded_tokens unchanged"
        )
    return np.ascontiguousarray(a, dtype=np.uint32)


def _int32(name: str, value: int) -> int:
    if not _INT32.min <= int(value) <= _INT32.max:
        raise ValueError(f"{name} must fit in int32, got {value}")
    return int(value)


def _lengths(lengths: np.ndarray, batch: int, seq_len: int) -> np.ndarray:
    lens = np.asarray(lengths)
    if lens.shape != (batch,) or lens.dtype.kind not in "iu":
        raise ValueError(
            f"lengths must be integers of shape ({batch},), got {lens.dtype} {lens.shape}"
        )
    if batch and (lens.min() < 0 or lens.max() > seq_len):
        raise ValueError(
            f"lengths must lie in [0, {seq_len}] (the row length), got "
            f"[{lens.min()}, {lens.max()}]: truncate with np.minimum(lengths, {seq_len})"
        )
    return lens.astype(np.int32)


def _check_mask(mask: np.ndarray | None, shape: tuple[int, int]) -> None:
    if mask is not None and np.shape(mask) != shape:
        raise ValueError(f"stored_mask must have the targets' shape {shape}, got {np.shape(mask)}")


def bin_fields(
    windows: np.ndarray,
    lengths: np.ndarray,
    *,
    start_token_id: int = 0,
    pad_id: int = 0,
    stored_mask: np.ndarray | None = None,
    out: dict[str, np.ndarray] | None = None,
) -> dict[str, np.ndarray]:
    """Decodes bins of whole sequences: packed windows whose column 1 starts a
    sequence, padding from ``lengths`` (``[batch]`` tokens of each bin) on.

    Arguments as for ``packed_fields`` and ``padded_fields``; every sequence
    follows the padded rule, and segment ids count 1, 2, ... per sequence.

    Example:
        >>> f = bin_fields(np.array([[0, 7, 8, 11, 0, 0]], np.uint32), np.array([3]), pad_id=9)
        >>> f["inputs"].tolist(), f["targets"].tolist()
        ([[0, 3, 0, 9, 9]], [[3, 4, 5, 9, 9]])
        >>> f["segment_ids"].tolist(), f["positions"].tolist()
        ([[1, 1, 2, 0, 0]], [[0, 1, 0, 0, 0]])
    """
    out = packed_fields(windows, start_token_id=start_token_id, stored_mask=stored_mask, out=out)
    seq_len = out["targets"].shape[1]
    padding = np.arange(seq_len) >= _lengths(lengths, out["targets"].shape[0], seq_len)[:, None]
    _pad(out, padding, _int32("pad_id", pad_id))
    return out


def window_fields(
    windows: Windows,
    packing: Packing,
    *,
    start_token_id: int = 0,
    pad_id: int = 0,
    out: dict[str, np.ndarray] | None = None,
) -> dict[str, np.ndarray]:
    """The fields of records read as ``windows`` (:meth:`Records.read`): packed,
    padded or bins (``packing``, the records' own), with the stored loss mask
    when there is one; written into ``out`` when given (as for ``packed_fields``)."""
    mask = windows.stored_mask
    if packing is Packing.WINDOWS:
        return packed_fields(
            windows.encoded, start_token_id=start_token_id, stored_mask=mask, out=out
        )
    if windows.lengths is None:
        raise TypeError("padded records and bins were read without their lengths")
    decode = bin_fields if packing is Packing.BINS else padded_fields
    return decode(
        windows.encoded,
        windows.lengths,
        start_token_id=start_token_id,
        pad_id=pad_id,
        stored_mask=mask,
        out=out,
    )


def checked_windows(
    windows: Windows,
    packing: Packing,
    seq_len: int,
    *,
    start_token_id: int = 0,
    pad_id: int = 0,
) -> Windows:
    """``windows`` checked as :func:`window_fields` checks them, and as rows of
    ``seq_len`` tokens, in the form the compiled decode (:mod:`~flat_tokens_jax.core.kernels`)
    takes: C-contiguous ``uint32`` tokens, ``[k] int64`` lengths (padded rows
    and bins) and a C-contiguous ``[k, seq_len] uint8`` stored mask."""
    _int32("start_token_id", start_token_id)
    _int32("pad_id", pad_id)
    if packing is Packing.PADDED:
        encoded = _encoded(windows.encoded, "tokens", min_cols=1)
    else:
        encoded = _encoded(windows.encoded, "windows", min_cols=2)
    batch, width = encoded.shape[0], encoded.shape[1] - (packing is not Packing.PADDED)
    if width != seq_len:
        raise ValueError(f"records of {width} tokens cannot be decoded into rows of {seq_len}")
    lengths = None
    if packing is not Packing.WINDOWS:
        if windows.lengths is None:
            raise TypeError("padded records and bins were read without their lengths")
        lengths = _lengths(windows.lengths, batch, seq_len).astype(np.int64)
    mask = windows.stored_mask
    if mask is not None:
        _check_mask(mask, (batch, seq_len))
        mask = np.ascontiguousarray(
            mask.view(np.uint8) if mask.dtype in (np.bool_, np.uint8) else mask != 0
        ).view(np.uint8)
    return Windows(encoded, lengths=lengths, stored_mask=mask)


def chunk_fields(
    windows: np.ndarray,
    lengths: np.ndarray,
    first: int,
    before: tuple[np.ndarray, np.ndarray],
    *,
    start_token_id: int = 0,
    pad_id: int = 0,
    stored_mask: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
    """The five fields of columns ``[first, first + w)`` of rows, from those
    columns alone: equal to the whole rows' fields (packed, padded or bins) there.

    ``windows`` ``[k, w + 1] uint32``: column 0 the token before column
    ``first`` (0 before a row's column 0); ``lengths`` ``[k]`` each row's tokens
    before its padding (``seq_len`` for packed windows, 0 for a padding row);
    ``before``: the segment id and position of column ``first - 1`` of each row
    (:func:`run_carry`); ``stored_mask`` ``[k, w]``."""
    w = _encoded(windows, "windows", min_cols=2)
    seg_before, pos_before = before
    col = np.arange(first, first + w.shape[1] - 1, dtype=np.int32)
    start = (w[:, 1:] & 1) == 1
    targets = (w[:, 1:] >> 1).astype(np.int32)
    before_token = np.empty_like(targets)
    before_token[:, 1:], before_token[:, 0] = targets[:, :-1], w[:, 0] >> 1
    inputs = np.where(start, _int32("start_token_id", start_token_id), before_token)
    runs = start | (col == 0)
    segment_ids = (np.cumsum(runs, axis=1) + seg_before[:, None]).astype(np.int32)
    last = np.maximum.accumulate(np.where(runs, col, -1), axis=1)
    after = pos_before[:, None] + 1 + col - first
    positions = np.where(last >= 0, col - last, after).astype(np.int32)
    loss_mask = np.empty(targets.shape, bool)
    _stored(loss_mask, stored_mask)
    out = dict(zip(FIELDS, (inputs, targets, segment_ids, positions, loss_mask), strict=True))
    _pad(out, col >= np.asarray(lengths)[:, None], _int32("pad_id", pad_id))
    return out


def run_carry(
    row: np.ndarray, length: np.ndarray, rows: int, col: int
) -> tuple[np.ndarray, np.ndarray]:
    """The segment id and position ``[rows] int32`` at column ``col`` of rows
    whose segments are ``(row, length)`` (:meth:`Records.segments`, in row
    order); ``(0, -1)`` at column -1."""
    if col < 0:
        return np.zeros(rows, np.int32), np.full(rows, -1, np.int32)
    row, length = np.asarray(row, np.int64), np.asarray(length, np.int64)
    totals = np.bincount(row, length, rows).astype(np.int64)
    start = np.cumsum(length) - length - (np.cumsum(totals) - totals)[row]
    begun = start <= col
    seg = np.bincount(row[begun], minlength=rows).astype(np.int32)
    last = np.zeros(rows, np.int64)
    np.maximum.at(last, row[begun], start[begun])
    return seg, (col - last).astype(np.int32)


def padding_fields(num_rows: int, seq_len: int, pad_id: int) -> dict[str, np.ndarray]:
    """The five fields of ``num_rows`` padding rows."""
    shape = (num_rows, seq_len)
    return {
        k: np.full(shape, pad_id if k in ("inputs", "targets") else 0, _dtype(k)) for k in FIELDS
    }
