"""How many threads decode a step read ahead: :class:`DecodeThreads`, from
the finish times the read-ahead measured, not from the core count.
"""

from __future__ import annotations

import numpy as np

THREAD_WINDOW = 8
"""Finishes at each of the two counts a trial compares (by their median time per row)."""

THREAD_GAIN = 0.1
"""Share of the time per row a doubled count of decode threads must save to be
kept (on a 16-core host two threads delivered 256-row steps about 15 % faster
than one, and 64-row steps slower)."""

THREAD_BOUND = 0.8
"""The trainer waits for the finish stage when a finish takes at least this
share of its step (and at least a fetch)."""

THREAD_RETRY = 512
"""Finishes after a trial that did not pay before the next (doubled each time)."""

THREAD_SKIP = 2
"""A loader's first finishes, not measured: they wait for the opening burst's reads."""


class DecodeThreads:
    """The threads that decode a step read ahead, from measured finish times.
    Not thread-safe (``Measures`` holds it under its lock).

    ``pinned`` (``LoaderConfig.decode_threads``) fixes the count; otherwise trials
    of twice as many (at most ``most``) as docs/guide/loading.md says, the two counts
    handed out in turn (so what drifts meanwhile weighs on both alike).
    """

    def __init__(self, most: int, pinned: int | None = None) -> None:
        self.pinned, self.most = pinned, max(1, most)
        self.count = pinned or 1
        # Nothing to choose: a pinned count, or one core for decoding.
        self.fixed = pinned is not None or self.most == 1
        self.trials = self.kept = 0
        # A trial's two counts, and the seconds per row measured at each.
        self._trial: dict[int, list[float]] | None = None
        self._skip = THREAD_SKIP
        self._retry = THREAD_RETRY
        self._wait = 0

    def next(self) -> int:
        """The count for the next finish (in a trial, the one measured fewer times)."""
        if self._trial is None:
            return self.count
        low, high = self._trial
        return high if len(self._trial[high]) <= len(self._trial[low]) else low

    def finished(self, seconds: float, rows: int, threads: int, bound: bool) -> None:
        """A finish of ``rows`` rows on ``threads`` threads took ``seconds``;
        ``bound``: the finish stage is what the trainer waits for."""
        if self.pinned is not None or rows < 1:
            return
        trial = self._trial
        if trial is not None:
            if threads in trial:
                trial[threads].append(seconds / rows)
                if min(map(len, trial.values())) >= THREAD_WINDOW:
                    self._judge(trial)
            return
        if threads != self.count:
            return
        if self._skip:
            self._skip -= 1
        elif self._wait:
            self._wait -= 1
        elif bound and self.count < self.most:
            self._trial = {self.count: [], min(2 * self.count, self.most): []}
            self.trials += 1

    def _judge(self, trial: dict[int, list[float]]) -> None:
        (low, slow), (high, fast) = trial.items()
        self._trial = None
        if np.median(fast) <= (1 - THREAD_GAIN) * np.median(slow):
            self.count = high
            self.kept += 1
        else:
            self.count, self._wait = low, self._retry
            self._retry *= 2
