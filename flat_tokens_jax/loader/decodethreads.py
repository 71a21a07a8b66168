"""How many threads decode a step read ahead: :class:`DecodeThreads`, from
the finish times the read-ahead measured, not from the core count.

Pure code, testable without a store (:class:`~flat_tokens_jax.loader.readahead.Measures`
feeds it).
"""

from __future__ import annotations

from collections.abc import Hashable

import numpy as np

THREAD_WINDOW = 8
"""Finishes whose median time per row measures a count of decode threads."""

THREAD_GAIN = 0.1
"""Share of the time per row a doubled count of decode threads must save to be
kept (threads that save less cost cores and hand-offs for noise; on a 16-core
host two threads delivered 256-row steps about 15 % faster than one, and
64-row steps slower)."""

THREAD_BOUND = 0.8
"""The finish stage is what the trainer waits for when a finish takes at least
this share of the interval between the batches it takes (and at least a fetch)."""

THREAD_RETRY = 512
"""Finishes after a doubling that did not pay before the next try (doubled
after each such try)."""

_DECIDED: dict[Hashable, int] = {}
"""The count each :class:`DecodeThreads` key's last trial decided on, this process."""


class DecodeThreads:
    """The threads that decode a step read ahead, from measured finish times.
    Not thread-safe (:class:`~flat_tokens_jax.loader.readahead.Measures`
    holds it under its lock).

    ``pinned`` (``LoaderConfig.decode_threads``) fixes the count. Otherwise it
    starts at 1 and, while the finish stage is what the trainer waits for,
    tries twice as many (at most ``most``): the median time per row over
    :data:`THREAD_WINDOW` finishes at the new count is compared with the one
    before it, and the count is kept when it saved at least
    :data:`THREAD_GAIN`, else it goes back and tries again only after
    :data:`THREAD_RETRY` finishes (twice that after the next failure). The
    first finishes of a loader are not measured: they wait for the opening
    burst's reads. Threads never change a batch, only how fast it is decoded.

    ``key`` names what a finish's time depends on (the rows of a step and
    their layout): a count a trial decided on is kept for the process under
    it, and the next policy of that key starts there, trying more only after
    :data:`THREAD_RETRY` finishes, so that a later loader of the same steps
    does not pay for the trials again.
    """

    def __init__(self, most: int, pinned: int | None = None, key: Hashable = None) -> None:
        self.pinned, self.most, self.key = pinned, max(1, most), key
        decided = None if key is None else _DECIDED.get(key)
        self.count = pinned or min(decided or 1, self.most)
        self.trials = self.kept = 0
        self._times: list[float] = []  # seconds per row at `count`, this window
        self._before: tuple[int, float] | None = None  # the count under trial came from
        self._skip = 2
        self._retry = THREAD_RETRY
        self._wait = 0 if decided is None else THREAD_RETRY

    def finished(self, seconds: float, rows: int, threads: int, bound: bool) -> None:
        """A finish of ``rows`` rows on ``threads`` threads took ``seconds``;
        ``bound``: the finish stage is what the trainer waits for."""
        if self.pinned is not None or threads != self.count or rows < 1:
            return
        if self._skip:
            self._skip -= 1
            return
        if self._wait:
            self._wait -= 1
            return
        self._times.append(seconds / rows)
        if len(self._times) < THREAD_WINDOW:
            return
        now, self._times = float(np.median(self._times)), []
        if self._before is not None:
            count, then = self._before
            self._before = None
            if now > (1 - THREAD_GAIN) * then:
                self.count, self._wait = count, self._retry
                self._retry *= 2
                self._decided()
                return
            self.kept += 1
            self._decided()
        if bound and self.count < self.most:
            self._before = (self.count, now)
            self.count = min(2 * self.count, self.most)
            self.trials += 1

    def _decided(self) -> None:
        if self.key is not None:
            _DECIDED[self.key] = self.count
