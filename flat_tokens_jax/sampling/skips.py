"""Skipped batches: the data step ``d(t) = t + sum(count for (s, count) in skips if
s <= t)`` each trainer step ``t`` reads (:class:`Skips`), and the rows that immutable
values share and extend at their end (:class:`SharedRows`).
"""

from __future__ import annotations

import bisect
import itertools
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np


class SharedRows:
    """Columns of rows (Python ``lists``, numpy ``arrays`` ``[capacity, ...]``)
    that immutable values share, each reading its own first rows: rows are
    added in place when no other value added past the adder's, else to a copy,
    so a change at the end of a run's changes costs O(1) amortized."""

    def __init__(self, lists: Sequence[list[Any]], arrays: Sequence[np.ndarray] = ()) -> None:
        self.lists, self.arrays = list(lists), list(arrays)
        self._lock = threading.Lock()

    def added(self, n: int, rows: Sequence[Sequence[Any]]) -> SharedRows:
        """Rows ``[0, n)`` and ``rows`` after them (a value a column each)."""
        with self._lock:
            if len(self.lists[0]) == n:
                self._extend(rows)
                return self
        out = SharedRows([c[:n] for c in self.lists], [a[:n].copy() for a in self.arrays])
        out._extend(rows)
        return out

    def _extend(self, rows: Sequence[Sequence[Any]]) -> None:
        n = len(self.lists[0])
        end = n + len(rows)
        for i, a in enumerate(self.arrays):
            if end > len(a):  # readers of the old array read rows it holds
                grown = np.zeros((max(2 * len(a), end), *a.shape[1:]), a.dtype)
                grown[:n] = a[:n]
                self.arrays[i] = grown
        for k, row in enumerate(rows):
            for a, value in zip(self.arrays, row[len(self.lists) :], strict=True):
                a[n + k] = value
            for c, value in zip(self.lists, row, strict=False):
                c.append(value)


class Skips:
    """Skipped batches: the data step of each trainer step. Immutable.
    ``entries``: ``((step, count), ...)``, steps strictly increasing: from
    trainer ``step`` on, ``count`` more data steps are skipped."""

    __slots__ = ("_entries", "_n", "_rows")

    def __init__(self, entries: Sequence[tuple[int, int]] = ()) -> None:
        pairs = tuple((int(s), int(c)) for s, c in entries)
        steps = [s for s, _ in pairs]
        if any(b <= a for a, b in itertools.pairwise(steps)):
            raise ValueError(f"skip steps must increase strictly, got {steps}")
        # Each row: a step, and the data steps skipped at steps up to it.
        self._rows = SharedRows([steps, list(itertools.accumulate(c for _, c in pairs))])
        self._n: int = len(pairs)
        self._entries: tuple[tuple[int, int], ...] | None = pairs

    @classmethod
    def _of(cls, rows: SharedRows, n: int) -> Skips:
        out = cls.__new__(cls)
        out._rows, out._n, out._entries = rows, n, None
        return out

    @property
    def entries(self) -> tuple[tuple[int, int], ...]:
        """``((step, count), ...)`` by strictly increasing step (skips added
        at one step are one entry)."""
        if self._entries is None:
            steps, through = self._rows.lists
            found: dict[int, int] = {}
            for j in range(self._n):
                found[steps[j]] = found.get(steps[j], 0) + through[j] - (through[j - 1] if j else 0)
            self._entries = tuple(found.items())
        return self._entries

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Skips) and self.entries == other.entries

    def __hash__(self) -> int:
        return hash(self.entries)

    def __repr__(self) -> str:
        return f"Skips({self.entries!r})"

    def __bool__(self) -> bool:
        return self._n > 0

    @property
    def latest(self) -> int:
        """The last step with a skip (-1 without any)."""
        return self._rows.lists[0][self._n - 1] if self._n else -1

    def skipped(self, step: int) -> int:
        """Data steps skipped at trainer steps ``<= step``."""
        steps, through = self._rows.lists
        j = bisect.bisect_right(steps, step, 0, self._n)
        out: int = through[j - 1] if j else 0
        return out

    def data_step(self, step: int) -> int:
        """``d(step)``: the step of the run without skips whose data ``step`` reads."""
        return step + self.skipped(step)

    def trainer_step(self, data_step: int) -> int:
        """The first trainer step whose data step is ``data_step`` or later."""
        low, high = max(0, data_step - self.skipped(self.latest)), data_step
        while low < high:  # d is strictly increasing, and d(t) >= t
            mid = (low + high) // 2
            low, high = (mid + 1, high) if self.data_step(mid) < data_step else (low, mid)
        return low

    def added(self, step: int, count: int) -> Skips:
        """These skips and ``count`` more at ``step`` (skips at one step add
        up): O(log n) amortized at or after the last step with a skip."""
        if step < self.latest:
            found = dict(self.entries)
            found[step] = found.get(step, 0) + count
            return Skips(tuple(sorted(found.items())))
        row = (step, self.skipped(step) + count)
        return Skips._of(self._rows.added(self._n, [row]), self._n + 1)

    def within(self, first: int, stop: int | None, data_first: int) -> Skips:
        """The skips of trainer steps ``[first, stop)`` counted from ``first``
        (``stop`` ``None``: no end), for steps whose data counts from data
        step ``data_first``: a phase's own, with what ``d(first)`` passes over
        ``data_first`` skipped at its step 0."""
        lead = self.data_step(first) - data_first
        local = tuple(
            (s - first, c) for s, c in self.entries if first < s and (stop is None or s < stop)
        )
        return Skips((((0, lead),) if lead > 0 else ()) + local)


NO_SKIPS = Skips()
