"""Where sequences start in packed rows, and the segment ids and positions that follow
(for :func:`~flat_tokens_jax.decoding.batch.packed_fields`): from the starts' flat indices
where they can, not token by token, as starts are rare (one per ~1,000 tokens)."""

from __future__ import annotations

import numpy as np

# Slices OR-ed together when looking for sequence starts: see `sequence_starts`.
_FOLD = 16
# Runs per segment shorter than this on average make `write_segments` scan every token.
_SHORT_RUN = 8
# Tokens per tile of `_fill_runs`.
_TILE = 128
_TILE_RANGE = np.arange(_TILE, dtype=np.int32)


def sequence_starts(flat: np.ndarray, flags: np.ndarray, scratch: np.ndarray) -> np.ndarray:
    """Sorted indices ``[k] int64`` of the odd values (sequence starts) of ``flat``.

    Args:
        flat: ``[n] uint32`` encoded tokens.
        flags: ``[m] bool`` scratch, ``m >= n // _FOLD`` (a new one is made if
            every token must be tested and ``m < n``).
        scratch: ``[>= n // _FOLD] uint32`` scratch.
    """
    # OR-reduce `_FOLD` slices of the tokens into one (a read-only pass that runs
    # at memory speed), then look only at the columns whose OR is odd. This
    # beats testing every token when starts are sparse; when they are not, test
    # every token.
    width = flat.size // _FOLD
    if width >= 1024:
        folded = np.bitwise_or.reduce(
            flat[: _FOLD * width].reshape(_FOLD, width), axis=0, out=scratch[:width]
        )
        cols = np.flatnonzero(np.bitwise_and(folded, 1, out=flags[:width], casting="unsafe"))
        if cols.size * _FOLD * 8 <= flat.size:
            candidates = (np.arange(0, _FOLD * width, width)[:, None] + cols).ravel()
            tail = np.arange(_FOLD * width, flat.size)
            candidates = np.concatenate((candidates, tail))
            hits: np.ndarray = candidates[(flat[candidates] & 1) != 0]
            hits.sort()
            return hits
    if flags.size < flat.size:
        flags = np.empty(flat.size, np.bool_)
    np.bitwise_and(flat, 1, out=flags[: flat.size], casting="unsafe")
    return np.flatnonzero(flags[: flat.size])


def write_segments(starts: np.ndarray, segment_ids: np.ndarray, positions: np.ndarray) -> None:
    """Writes the segment ids and positions of packed rows (as ``packed_fields``
    gives them) into ``segment_ids`` and ``positions``, ``[batch, seq_len] int32``
    C-contiguous, from ``starts``, the sorted flat indices ``[k] int64`` of the
    sequence starts."""
    batch, seq_len = segment_ids.shape
    if starts.size * _SHORT_RUN < batch * seq_len:
        _fill_runs(starts, segment_ids, positions)
        return
    # Runs this short would mostly be patched: scan every token instead.
    col = np.arange(seq_len, dtype=np.int32)
    is_start = np.zeros((batch, seq_len), np.bool_)
    is_start.reshape(-1)[starts] = True
    np.cumsum(is_start, axis=1, dtype=np.int32, out=segment_ids)
    segment_ids += ~is_start[:, :1]
    last_start = np.multiply(is_start, col, dtype=np.int32)
    np.maximum.accumulate(last_start, axis=1, out=last_start)
    np.subtract(col, last_start, out=positions)


def _fill_runs(starts: np.ndarray, segment_ids: np.ndarray, positions: np.ndarray) -> None:
    """:func:`write_segments`, tile by tile.

    A run (one segment of one row) begins at each row start and at each
    sequence start inside a row. Each ``_TILE``-token tile of the flat batch is
    first written as if its first token's run covered it all, by broadcasting
    one value per tile (segment ids) or one start per tile plus ``0 ..
    _TILE - 1`` (positions): memory speed, and no temporary the batch's size
    (a fresh one measured ~500 page faults a half batch). Then the tokens from
    each run start inside a tile to the tile's end are rewritten, and a last
    partial tile token by token.
    """
    batch, seq_len = segment_ids.shape
    size = batch * seq_len
    row_starts = np.arange(0, size, seq_len)
    run_start = np.concatenate((row_starts, starts[starts % seq_len != 0]))
    run_start.sort(kind="stable")  # merges two sorted halves in linear time
    first_run_of_row = np.searchsorted(run_start, row_starts)
    run_segment = (
        np.arange(1, run_start.size + 1) - first_run_of_row[run_start // seq_len]
    ).astype(np.int32)
    seg, pos = segment_ids.reshape(-1), positions.reshape(-1)
    tiles = size // _TILE
    whole = tiles * _TILE
    first = np.arange(0, whole, _TILE)
    run = np.searchsorted(run_start, first, side="right") - 1
    seg[:whole].reshape(tiles, _TILE)[...] = run_segment[run][:, None]
    base = (first - run_start[run]).astype(np.int32)
    np.add(base[:, None], _TILE_RANGE, out=pos[:whole].reshape(tiles, _TILE))
    # From each run start inside a tile to the tile's end or the next run start.
    k = np.flatnonzero((run_start % _TILE != 0) & (run_start < whole))
    begin = run_start[k]
    end = np.minimum((begin // _TILE + 1) * _TILE, np.append(run_start, size)[k + 1])
    length = end - begin
    offset = np.arange(int(length.sum())) - np.repeat(np.cumsum(length) - length, length)
    at = np.repeat(begin, length) + offset
    seg[at] = np.repeat(run_segment[k], length)
    pos[at] = offset
    tail = np.arange(whole, size)
    run = np.searchsorted(run_start, tail, side="right") - 1
    seg[tail] = run_segment[run]
    pos[tail] = tail - run_start[run]
