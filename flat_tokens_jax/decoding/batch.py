"""Model fields from encoded tokens: packed windows and padded sequences.

Every function returns the five batch fields, each ``[batch, seq_len]``:
``inputs``, ``targets``, ``segment_ids``, ``positions`` (``int32``) and
``loss_mask`` (``bool``). Encoded tokens are ``uint32`` ``token_id * 2 + 1`` at a
sequence start, else ``token_id * 2``.

Packed rows follow the spec's expansion: ``targets[t]`` is the decoded token at
``t``; ``inputs[t]`` is ``start_token_id`` where ``t`` starts a sequence, else the
token before it, including ``t = 0``, which reads the token before the record.
``segment_ids`` are 1 for a row's first segment (a whole sequence or a leading
fragment) and grow by one at each later sequence start; ``positions`` restart at
0 at each sequence start, and a leading fragment counts from 0 too. Padded rows
use the same input rule; padding has ``pad_id`` input and target, segment 0,
position 0 and ``loss_mask`` False.

Bins of whole sequences (``bin_fields``) are packed windows whose first column
starts a sequence, followed by padding from the bin's length on.

``packed_fields``, ``padded_fields`` and ``bin_fields`` run on the host in
numpy; their ``_jax`` twins (in :mod:`~flat_tokens_jax.decoding.batch_jax`, importable
from here too) compute the same values with jax ops inside ``jax.jit``, for
decoding on the accelerator.
"""

from __future__ import annotations

import numpy as np

from flat_tokens_jax.core.fields import Packing
from flat_tokens_jax.data.records import Windows
from flat_tokens_jax.decoding.batch_jax import bin_fields_jax, packed_fields_jax, padded_fields_jax
from flat_tokens_jax.decoding.segments import sequence_starts, write_segments

__all__ = [
    "FIELDS",
    "bin_fields",
    "bin_fields_jax",
    "checked_windows",
    "packed_fields",
    "packed_fields_jax",
    "padded_fields",
    "padded_fields_jax",
    "padding_fields",
    "window_fields",
]

FIELDS = ("inputs", "targets", "segment_ids", "positions", "loss_mask")

_INT32 = np.iinfo(np.int32)
# Where the fields start in their shared allocation, modulo this: see `_empty_fields`.
_PAGE = 4096


def packed_fields(
    windows: np.ndarray,
    *,
    start_token_id: int = 0,
    stored_mask: np.ndarray | None = None,
    out: dict[str, np.ndarray] | None = None,
) -> dict[str, np.ndarray]:
    """Decodes packed records into model fields (numpy, on the host).

    Args:
        windows: ``[batch, seq_len + 1] uint32`` encoded tokens. Column 0 is the
            token before the record; columns ``1..seq_len`` are the record. When
            column 1 starts a sequence (always so for the record at token 0),
            column 0 is ignored.
        start_token_id: the input where a sequence starts.
        stored_mask: optional ``[batch, seq_len]`` stored loss mask aligned with
            the targets; nonzero means trained on. Without it every target is.
        out: optional five C-contiguous ``[batch, seq_len]`` arrays of the
            fields' dtypes to write into (e.g. one row block of a larger batch).

    Returns:
        The five fields, each ``[batch, seq_len]`` and C-contiguous: ``inputs``,
        ``targets``, ``segment_ids``, ``positions`` (``int32``) and ``loss_mask``
        (``bool``); ``out`` when given, else all but ``segment_ids`` share one
        allocation.

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

    inputs, targets, positions, loss_mask, flags = _fields_out(out, batch, seq_len, batch)
    np.right_shift(w[:, 1:], 1, out=targets.view(np.uint32))
    np.copyto(inputs[:, 1:], targets[:, :-1])
    np.right_shift(w[:, 0], 1, out=inputs[:, 0].view(np.uint32))

    # Sequence starts are rare (one per ~1,000 tokens in typical data), so find
    # them once as flat indices and build segment ids and positions run by run.
    hits = sequence_starts(w.reshape(-1), flags, positions.reshape(-1).view(np.uint32))
    row = hits // (seq_len + 1)
    hits -= row
    starts = hits[hits != row * seq_len] - 1  # drop column 0; index into [batch * seq_len]
    inputs.reshape(-1)[starts] = start

    if stored_mask is None:
        loss_mask.fill(True)
    else:
        np.not_equal(stored_mask, 0, out=loss_mask)

    segment_ids = np.empty((batch, seq_len), np.int32) if out is None else out["segment_ids"]
    write_segments(starts, segment_ids, positions)
    return dict(zip(FIELDS, (inputs, targets, segment_ids, positions, loss_mask), strict=True))


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

    Args:
        tokens: ``[batch, seq_len] uint32`` encoded tokens; row ``b`` holds the
            first ``lengths[b]`` tokens of sequence ``b``. Later columns are
            ignored, whatever they hold.
        lengths: ``[batch]`` integer tokens kept per row, ``0 <= lengths <= seq_len``
            (a 0 row is all padding).
        start_token_id: the input at each row's first token.
        pad_id: the input and target at padding.
        stored_mask: optional ``[batch, seq_len]`` stored loss mask aligned with
            the targets, ANDed with the non-padding mask.
        out: optional arrays to write into, as for ``packed_fields``.

    Returns:
        The five fields, each ``[batch, seq_len]``: ``inputs`` is
        ``start_token_id`` then ``seq[:len - 1]``, ``targets`` is ``seq[:len]``,
        both then ``pad_id``; ``segment_ids`` 1 on the sequence, 0 on padding;
        ``positions`` ``0..len-1`` then 0; ``loss_mask`` True on the sequence.

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

    inputs, targets, positions, loss_mask, _ = _fields_out(out, batch, seq_len, 0)
    np.right_shift(tok, 1, out=targets.view(np.uint32))
    np.copyto(inputs[:, 1:], targets[:, :-1])
    inputs[:, 0] = start

    col = np.arange(seq_len, dtype=np.int32)
    np.less(col, lens[:, None], out=loss_mask)
    padding = ~loss_mask
    np.copyto(inputs, pad, where=padding)
    np.copyto(targets, pad, where=padding)
    np.multiply(col, loss_mask, out=positions)
    if out is None:
        segment_ids = loss_mask.astype(np.int32)
    else:
        segment_ids = _copied(loss_mask, out["segment_ids"])
    if stored_mask is not None:
        loss_mask &= stored_mask != 0
    return dict(zip(FIELDS, (inputs, targets, segment_ids, positions, loss_mask), strict=True))


def _empty_fields(
    batch: int, seq_len: int, flag_extra: int = 0
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Uninitialised ``inputs``, ``targets``, ``positions`` and ``loss_mask``.

    They are carved out of one allocation: five separate 2 MiB arrays freed
    together make glibc hand the memory back to the OS and fault it in again on
    the next batch, which measured 5 ms a batch where writing them takes 0.25 ms.
    Each field starts at a different offset modulo 4 KiB: copying ``targets``
    into ``inputs`` at the same offset measured 10x slower (4K aliasing of
    loads and stores).

    Returns:
        ``(inputs, targets, positions, loss_mask, flags)``: three ``[batch,
        seq_len] int32``, one ``[batch, seq_len] bool``, and ``flags``, a
        ``[batch * seq_len + flag_extra] bool`` scratch that overlaps
        ``loss_mask``.
    """
    n = batch * seq_len
    sizes = (4 * n, 4 * n, 4 * n, n + flag_extra)
    buf = np.empty(sum(sizes) + _PAGE * len(sizes), np.uint8)
    base = buf.ctypes.data
    views = []
    offset = 0
    for i, size in enumerate(sizes):
        offset += (i * _PAGE // len(sizes) - (base + offset)) % _PAGE
        views.append(buf[offset : offset + size])
        offset += size
    ints = [v.view(np.int32).reshape(batch, seq_len) for v in views[:3]]
    flags = views[3].view(np.bool_)
    return ints[0], ints[1], ints[2], flags[:n].reshape(batch, seq_len), flags


def _fields_out(
    out: dict[str, np.ndarray] | None, batch: int, seq_len: int, flag_extra: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``_empty_fields``, or the arrays of ``out`` (checked) and ``flags``, the
    flat ``loss_mask`` of ``out`` (``sequence_starts`` makes more when it needs them)."""
    if out is None:
        return _empty_fields(batch, seq_len, flag_extra)
    for key in FIELDS:
        value = out.get(key)
        dtype = np.bool_ if key == "loss_mask" else np.int32
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
    flags = out["loss_mask"].reshape(-1)
    return out["inputs"], out["targets"], out["positions"], out["loss_mask"], flags


def _copied(value: np.ndarray, into: np.ndarray) -> np.ndarray:
    np.copyto(into, value)
    return into


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
    """Decodes bins of whole sequences: packed windows that end in padding.

    Args:
        windows: ``[batch, seq_len + 1] uint32`` as for ``packed_fields``; column
            1 starts a sequence, so column 0 is ignored.
        lengths: ``[batch]`` integer tokens of each bin; later columns are padding.
        start_token_id: the input where a sequence starts.
        pad_id: the input and target at padding.
        stored_mask: optional ``[batch, seq_len]`` stored loss mask.
        out: optional arrays to write into, as for ``packed_fields``.

    Returns:
        The five fields, each ``[batch, seq_len]``: every sequence follows the
        padded rule (inputs ``start_token_id`` then ``seq[:-1]``), segment ids
        count 1, 2, ... per sequence, positions restart at 0; padding has
        ``pad_id`` input and target, segment 0, position 0, loss mask False.

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
    pad = _int32("pad_id", pad_id)
    np.copyto(out["inputs"], pad, where=padding)
    np.copyto(out["targets"], pad, where=padding)
    np.copyto(out["segment_ids"], 0, where=padding)
    np.copyto(out["positions"], 0, where=padding)
    out["loss_mask"] &= ~padding
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
    if packing is Packing.WINDOWS:
        return packed_fields(
            windows.encoded, start_token_id=start_token_id, stored_mask=windows.stored_mask, out=out
        )
    if windows.lengths is None:
        raise TypeError("padded records and bins were read without their lengths")
    if packing is Packing.BINS:
        return bin_fields(
            windows.encoded,
            windows.lengths,
            start_token_id=start_token_id,
            pad_id=pad_id,
            stored_mask=windows.stored_mask,
            out=out,
        )
    return padded_fields(
        windows.encoded,
        windows.lengths,
        start_token_id=start_token_id,
        pad_id=pad_id,
        stored_mask=windows.stored_mask,
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
    """``windows`` checked as :func:`window_fields` checks them (rows of
    ``seq_len`` tokens), as the compiled decode (:mod:`~flat_tokens_jax.core.kernels`)
    takes them: C-contiguous ``uint32`` tokens, ``[k] int64`` lengths (padded
    rows and bins only) and a C-contiguous ``[k, seq_len] uint8`` stored mask,
    nonzero where trained on.

    Raises:
        ValueError: what ``window_fields`` raises for the same arguments, or
            rows of another length than ``seq_len``.
        TypeError: padded records or bins without their lengths.
    """
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


def padding_fields(num_rows: int, seq_len: int, pad_id: int) -> dict[str, np.ndarray]:
    """Fields of padding rows, each ``[num_rows, seq_len]``: ``pad_id`` inputs and
    targets, the rest 0."""
    shape = (num_rows, seq_len)
    return {
        "inputs": np.full(shape, pad_id, np.int32),
        "targets": np.full(shape, pad_id, np.int32),
        "segment_ids": np.zeros(shape, np.int32),
        "positions": np.zeros(shape, np.int32),
        "loss_mask": np.zeros(shape, bool),
    }
