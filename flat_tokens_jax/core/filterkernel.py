"""The instance filter's compiled kernel (numba, the ``fast`` extra): what
:meth:`~flat_tokens_jax.InstanceFilter.rejected` finds, one row at a time
while the row is in cache, stopping at a row's first run.
"""

from __future__ import annotations

import numpy as np

from flat_tokens_jax.core.numbacache import compile_cached


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
