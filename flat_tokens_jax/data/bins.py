"""Bins of whole sequences as records: ``BinRecords``. A bin holds the sequences
its split's :class:`~flat_tokens_jax.data.plans.PackingPlan` gives it (each
truncated to ``seq_len``), one after another, padded at the end.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np

from flat_tokens_jax.core import fields
from flat_tokens_jax.core.format import ENCODED_DTYPE, FormatError, Problem, indices_below
from flat_tokens_jax.core.limits import check_seq_len
from flat_tokens_jax.data.dataset import FlatTokens
from flat_tokens_jax.data.plans import PackingPlan, check_plan, find_plan
from flat_tokens_jax.data.records import (
    PackedRecords,
    PaddedRecords,
    Records,
    Windows,
    _check_columns,
    _data_fingerprint,
)


class BinRecords:
    """Record ``b`` is bin ``b`` of a packing plan: whole sequences, padded at the end.

    Args:
        plan: the plan to use (checked against ``ft`` and ``seq_len``); ``None``:
            :func:`find_plan`, caching built plans in ``cache_dir`` if given.
        max_segments: at most this many runs per bin (its sequences, plus its
            padding when not full); ``None``: no cap. Ignored with ``plan``.
    """

    packing = fields.Packing.BINS

    def __init__(
        self,
        ft: FlatTokens,
        seq_len: int,
        *,
        plan: PackingPlan | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        max_segments: int | None = None,
    ) -> None:
        seq_len = fields.seq_len(seq_len, "BinRecords.seq_len")
        check_seq_len(seq_len, f"bins of {ft!r}:")
        self.ft, self.seq_len = ft, seq_len
        if plan is None:
            plan = find_plan(ft, seq_len, cache_dir, max_segments)
        else:
            check_plan(plan, ft, seq_len, repr(ft), "build the plan of this split and seq_len")
        self.plan = plan

    def __repr__(self) -> str:
        return (
            f"BinRecords({self.ft!r}, seq_len={self.seq_len}, "
            f"plan={self.plan.algorithm}:{self.plan.digest})"
        )

    def __len__(self) -> int:
        return self.plan.num_bins

    def fingerprint(self) -> dict[str, Any]:
        return {
            "records": "bins",
            "seq_len": self.seq_len,
            "plan": {"algorithm": self.plan.algorithm, "digest": self.plan.digest},
            **_data_fingerprint(self.ft),
        }

    def sequences(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(row, sequence)`` ``[m] int64``: the sequences of bins ``indices``, in bin order."""
        idx = indices_below(indices, len(self), "record", self)
        lo, hi = self.plan.bin_starts[idx], self.plan.bin_starts[idx + 1]
        counts = hi - lo
        row = np.repeat(np.arange(idx.size), counts)
        first = np.cumsum(counts) - counts
        at = np.repeat(lo - first, counts) + np.arange(int(counts.sum()))
        return row, self.plan.seq_order[at]

    def members(self, indices: np.ndarray) -> list[list[int]]:
        """The sequences of each bin ``indices``, one list per bin, in bin order."""
        row, seqs = self.sequences(indices)
        cuts = np.searchsorted(row, np.arange(1, np.asarray(indices).size))
        return [part.tolist() for part in np.split(seqs, cuts)]

    def segments(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(row, length)`` ``[m] int64``: each bin's sequences, truncated to ``seq_len``."""
        row, seqs = self.sequences(indices)
        start, stop = self.ft.sequence_bounds(seqs)
        return row, np.minimum(stop - start, self.seq_len)

    def token_ranges(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The span ``(start, stop)`` ``[k] int64`` from a bin's first sequence to its last."""
        row, seqs = self.sequences(indices)
        start, stop = self.ft.sequence_bounds(seqs)
        k = np.asarray(indices).size
        first = np.full(k, np.iinfo(np.int64).max)
        last = np.zeros(k, np.int64)
        np.minimum.at(first, row, start)
        np.maximum.at(last, row, np.minimum(stop, start + self.seq_len))
        return first, last

    def read(self, indices: np.ndarray, columns: tuple[int, int] | None = None) -> Windows:
        return self.request(indices, columns)()

    def request(
        self, indices: np.ndarray, columns: tuple[int, int] | None = None
    ) -> Callable[[], Windows]:
        """Starts reading bins ``indices``; the function returned waits for them:
        packed windows ``[k, c1 - c0 + 1]`` with ``lengths`` ``[k]``, each whole
        bin's tokens. Sequences that are neighbours in the split are one read."""
        c0, c1 = _check_columns(columns, self.seq_len)
        row, seqs = self.sequences(indices)
        k = np.asarray(indices).size
        start, stop = self.ft.sequence_bounds(seqs)
        stop = np.minimum(stop, start + self.seq_len)
        size = stop - start
        lengths = np.bincount(row, weights=size, minlength=k).astype(np.int64)
        if k and lengths.max() > self.seq_len:
            b = int(np.asarray(indices).reshape(-1)[int(np.argmax(lengths))])
            raise FormatError(
                Problem(repr(self), f"bin {b} holds {lengths.max()} tokens, over seq_len")
            )
        offset = np.cumsum(size) - size
        offset -= np.repeat((np.cumsum(lengths) - lengths), np.bincount(row, minlength=k))
        # One piece per run of sequences that are neighbours in the split.
        new = np.ones(seqs.size, bool)
        new[1:] = (row[1:] != row[:-1]) | (start[1:] != stop[:-1])
        ends = np.append(np.flatnonzero(new)[1:], seqs.size) - 1
        p_row, p_off, p_start = row[new], offset[new], start[new]
        p_stop = stop[ends]
        # Bin positions [c0 - 1, c1) go to columns [0, width).
        lo = np.maximum(p_off, max(c0 - 1, 0))
        hi = np.minimum(p_off + (p_stop - p_start), c1)
        keep = hi > lo
        p_row, lo, hi, p_off, p_start = p_row[keep], lo[keep], hi[keep], p_off[keep], p_start[keep]
        width = c1 - c0 + 1
        t_lo = p_start + lo - p_off
        t_hi = t_lo + (hi - lo)
        tokens = self.ft.request_encoded(t_lo, t_hi)
        masks = self.ft.request_loss_mask(t_lo, t_hi)
        dest = p_row * width + lo - (c0 - 1)

        def windows() -> Windows:
            out = _scatter(tokens.result(), dest, hi - lo, (k, width), ENCODED_DTYPE)
            if masks is None:
                return Windows(out, lengths=lengths)
            mask = _scatter(masks.result(), dest, hi - lo, (k, width), np.uint8)
            return Windows(out, lengths=lengths, stored_mask=mask[:, 1:])

        return windows


def _scatter(
    pieces: list[np.ndarray],
    dest: np.ndarray,
    sizes: np.ndarray,
    shape: tuple[int, int],
    dtype: Any,
) -> np.ndarray:
    """``[rows, width]`` zeros with each piece written at its flat offset ``dest``."""
    out = np.zeros(shape, dtype)
    if pieces:
        flat = np.concatenate(pieces)
        first = np.cumsum(sizes) - sizes
        at = np.repeat(dest - first, sizes) + np.arange(flat.size)
        out.reshape(-1)[at] = flat
    return out


def make_records(
    ft: FlatTokens,
    seq_len: int,
    packing: fields.Packing,
    cache_dir: str | os.PathLike[str] | None = None,
    max_segments: int | None = None,
) -> Records:
    """The records ``packing`` makes of a split."""
    if packing is fields.Packing.BINS:
        return BinRecords(ft, seq_len, cache_dir=cache_dir, max_segments=max_segments)
    if packing is fields.Packing.WINDOWS:
        return PackedRecords(ft, seq_len)
    return PaddedRecords(ft, seq_len)
