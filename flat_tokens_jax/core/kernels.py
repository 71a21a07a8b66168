"""Compiled host kernels (numba, the ``fast`` extra; import them through
:func:`flat_tokens_jax.core.compiled.kernels`): copying a batch's ranges out of
memory-mapped shards, decoding rows as ``batch.window_fields`` does and the instance
filter's verdicts, one pass per row while it is in cache, without the interpreter lock.
"""

from __future__ import annotations

import numpy as np

from flat_tokens_jax.core.fields import Packing
from flat_tokens_jax.core.numbacache import compile_cached

# Tokens OR-ed together before looking at each: sequence starts are rare.
_SCAN = 32
# No stored loss mask, no lengths: empty arrays of the kernels' types, so one
# compiled version serves rows with and without them.
_NO_MASK = np.zeros((0, 0), np.uint8)
_NO_LENGTHS = np.zeros(0, np.int64)


@compile_cached
def _pad(
    start: int,
    pad_id: int,
    inputs: np.ndarray,
    targets: np.ndarray,
    segment_ids: np.ndarray,
    positions: np.ndarray,
    loss_mask: np.ndarray,
) -> None:  # pragma: no cover - compiled
    """Padding in one row's fields from column ``start`` on."""
    for c in range(start, targets.shape[0]):
        inputs[c] = pad_id
        targets[c] = pad_id
        segment_ids[c] = 0
        positions[c] = 0
        loss_mask[c] = False


@compile_cached
def _packed_rows(
    windows: np.ndarray,
    r0: int,
    r1: int,
    start_id: int,
    pad_id: int,
    lengths: np.ndarray,
    mask: np.ndarray,
    inputs: np.ndarray,
    targets: np.ndarray,
    segment_ids: np.ndarray,
    positions: np.ndarray,
    loss_mask: np.ndarray,
) -> None:  # pragma: no cover - compiled; tests call it through decode_rows
    seq_len = targets.shape[1]
    for r in range(r0, r1):
        row = windows[r]
        ii, ti, sg, ps, lm = inputs[r], targets[r], segment_ids[r], positions[r], loss_mask[r]
        # Every column as if the row's first run covered it all (vectorised).
        for c in range(seq_len):
            ti[c] = row[c + 1] >> 1
            ii[c] = row[c] >> 1
            sg[c] = 1
            ps[c] = c
        if mask.shape[0]:
            stored = mask[r]
            for c in range(seq_len):
                lm[c] = stored[c] != 0
        else:
            for c in range(seq_len):
                lm[c] = True
        if row[1] & 1:
            ii[0] = start_id
        # Then each later run: from a sequence start to the next one.
        segment, begin = 1, -1
        for b0 in range(1, seq_len, _SCAN):
            b1 = min(b0 + _SCAN, seq_len)
            any_start = np.uint32(0)
            for c in range(b0 + 1, b1 + 1):
                any_start |= row[c]
            if not any_start & 1:
                continue
            for c in range(b0, b1):
                if row[c + 1] & 1:
                    ii[c] = start_id
                    if begin >= 0:
                        for j in range(begin, c):
                            sg[j] = segment
                            ps[j] = j - begin
                    segment += 1
                    begin = c
        if begin >= 0:
            for j in range(begin, seq_len):
                sg[j] = segment
                ps[j] = j - begin
        if lengths.shape[0]:  # bins: padding from the bin's length on
            _pad(lengths[r], pad_id, ii, ti, sg, ps, lm)


@compile_cached
def _padded_rows(
    tokens: np.ndarray,
    r0: int,
    r1: int,
    start_id: int,
    pad_id: int,
    lengths: np.ndarray,
    mask: np.ndarray,
    inputs: np.ndarray,
    targets: np.ndarray,
    segment_ids: np.ndarray,
    positions: np.ndarray,
    loss_mask: np.ndarray,
) -> None:  # pragma: no cover - compiled; tests call it through decode_rows
    for r in range(r0, r1):
        row, n = tokens[r], lengths[r]
        ii, ti, sg, ps, lm = inputs[r], targets[r], segment_ids[r], positions[r], loss_mask[r]
        if n:
            ii[0] = start_id
        for c in range(1, n):
            ii[c] = row[c - 1] >> 1
        for c in range(n):
            ti[c] = row[c] >> 1
            sg[c] = 1
            ps[c] = c
        if mask.shape[0]:
            stored = mask[r]
            for c in range(n):
                lm[c] = stored[c] != 0
        else:
            for c in range(n):
                lm[c] = True
        _pad(n, pad_id, ii, ti, sg, ps, lm)


def decode_rows(
    encoded: np.ndarray,
    lengths: np.ndarray | None,
    stored_mask: np.ndarray | None,
    packing: Packing,
    rows: tuple[int, int],
    *,
    start_token_id: int,
    pad_id: int,
    out: dict[str, np.ndarray],
) -> None:
    """Writes what ``batch.window_fields`` returns for rows ``rows[0] .. rows[1]``
    of a batch (its checked ``Windows``) into the same rows of ``out``, the five
    C-contiguous fields ``[batch, seq_len]``."""
    kernel = _padded_rows if packing is Packing.PADDED else _packed_rows
    kernel(
        encoded,
        rows[0],
        rows[1],
        start_token_id,
        pad_id,
        _NO_LENGTHS if lengths is None else lengths,
        _NO_MASK if stored_mask is None else stored_mask,
        out["inputs"],
        out["targets"],
        out["segment_ids"],
        out["positions"],
        out["loss_mask"],
    )


@compile_cached
def gather(
    words: np.ndarray,
    pos: np.ndarray,
    count: np.ndarray,
    dest: np.ndarray,
    before: np.ndarray,
    chunk: int,
    gap: int,
    flat: np.ndarray,
) -> None:  # pragma: no cover - compiled
    """Copies ``count[r]`` elements of ``words`` (``[n]``, a shard's elements)
    from ``pos[r]`` to ``flat[dest[r]:]``, skipping ``gap`` elements (a
    checksum) after the first ``before[r]`` and then after every ``chunk``
    (``gap`` 0 without checksums). ``pos, count, dest, before``: ``[k] int64``."""
    for r in range(pos.size):
        p, n, d, m = pos[r], count[r], dest[r], before[r]
        m = min(m, n)
        for j in range(m):
            flat[d + j] = words[p + j]
        p += m + gap
        while m < n:  # the next chunk, whole or the range's last part
            k = min(chunk, n - m)
            for j in range(k):
                flat[d + m + j] = words[p + j]
            m, p = m + k, p + k + gap


@compile_cached
def _row_rejected(
    targets: np.ndarray, segment_ids: np.ndarray, min_period: int, max_period: int, max_count: int
) -> bool:  # pragma: no cover - compiled
    width = targets.shape[0]
    for p in range(min_period, max_period + 1):
        reach = (max_count - 1) * p
        pairs = width - p
        if reach > pairs:
            return False  # longer periods reach further still
        need = min(4, reach)
        stride = reach // need
        hits = 0
        for j in range(0, pairs, stride):
            if targets[j] != targets[j + p] or segment_ids[j + p] == 0:
                hits = 0
                continue
            hits += 1
            if hits < need:
                continue
            first = j - (need - 1) * stride  # a run over these probes covers it
            run = 0
            for i in range(max(0, first - reach + 1), min(pairs, first + reach)):
                if targets[i] == targets[i + p] and segment_ids[i] != 0 and segment_ids[i + p] != 0:
                    run += 1
                    if run >= reach:
                        return True
                else:
                    run = 0
    return False


@compile_cached
def _rejected(
    targets: np.ndarray,
    segment_ids: np.ndarray,
    min_period: int,
    max_period: int,
    max_count: int,
    out: np.ndarray,
) -> None:  # pragma: no cover - compiled
    for r in range(targets.shape[0]):
        out[r] = _row_rejected(targets[r], segment_ids[r], min_period, max_period, max_count)


def rejected(
    targets: np.ndarray, segment_ids: np.ndarray, min_period: int, max_period: int, max_count: int
) -> np.ndarray:
    """``[rows] bool``: the rows of ``targets`` and ``segment_ids`` (``[rows,
    seq_len]``, C-contiguous int32) that the filter of these fields rejects."""
    out = np.zeros(targets.shape[0], np.bool_)
    _rejected(targets, segment_ids, min_period, max_period, max_count, out)
    return out


def warm() -> None:
    """Calls each kernel on a tiny input: a process's first call sets numba up
    and loads the kernel (most of a second)."""
    words = np.arange(8, dtype=np.uint32)
    words.setflags(write=False)
    flat = np.zeros(4, np.uint32)
    one = np.ones(1, np.int64)
    gather(words, np.zeros(1, np.int64), 4 * one, np.zeros(1, np.int64), 4 * one, 8, 0, flat)
    out = {k: np.zeros((1, 4), np.int32) for k in ("inputs", "targets", "segment_ids", "positions")}
    out["loss_mask"] = np.zeros((1, 4), np.bool_)
    encoded = flat.reshape(1, 4)
    decode_rows(encoded, None, None, Packing.WINDOWS, (0, 1), start_token_id=0, pad_id=0, out=out)
