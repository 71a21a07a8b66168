"""Whether more steps in flight make a store deliver steps faster.

Pure code, testable without a store. A store bound by latency answers a
fetch in about the same time however many run, so ``d`` steps in flight
deliver about ``d / fetch`` steps a second; a store bound by throughput (a
server that answers so many requests a second, a throttled bucket, a capped
link) takes longer per fetch in proportion to the fetches running, so more
steps in flight only queue more requests behind each other (and delay a
first step, or a step after a jump, behind them).

:class:`DepthTrial` judges each growth of an automatic depth by that rate:
after the depth grew from ``d0`` to ``d1`` it holds it until the fetches
begun since (at least :data:`TRIAL_FETCHES`, and all ``d1 - d0`` started by
the growth) have ended, then keeps it when ``d1 / (their mean fetch)`` rose
over ``d0 / (the mean of the fetches before)``, and otherwise caps the depth
at ``d0``. The cap is lifted for a new trial every :data:`RETRIAL_FETCHES`
fetches, so a store that speeds up again (a throttle lifted) is used.
"""

from __future__ import annotations

import collections
import threading

TRIAL_FETCHES = 4
"""Fewest fetches whose mean duration measures a depth, before a growth and after it."""

PAID = 0.5
"""Share of a growth's proportional gain the rate must show: growing from
``d0`` to ``d1`` steps pays when ``depth / fetch`` rises at least ``1 + PAID *
(d1 / d0 - 1)`` times (a store bound by latency shows all of it, one bound by
throughput none)."""

RETRIAL_FETCHES = 64
"""Fetches after a growth that did not pay before the depth may try to grow
past its cap again."""


def _mean(values: collections.deque[float] | list[float]) -> float:
    return sum(values) / len(values)


class DepthTrial:
    """Lets an automatic depth grow only while growing made the store deliver
    steps faster. Thread-safe.

    The caller asks :meth:`cap` before it moves the depth, says :meth:`grew`
    when it raised it, and gives every fetch that ended to :meth:`fetched`.
    Times are ``time.perf_counter`` seconds.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._recent: collections.deque[float] = collections.deque(maxlen=TRIAL_FETCHES)
        # (depth before, depth after, mean fetch before, when it grew, fetches to measure)
        self._pending: tuple[int, int, float, float, int] | None = None
        self._after: list[float] = []
        self.ceiling: int | None = None
        self._since_ceiling = 0
        self.trials = self.failed = 0

    def cap(self) -> int | None:
        """The most steps the depth may reach now: the depth under trial while
        one runs, the depth before a growth that did not pay, else ``None``."""
        with self._lock:
            if self._pending is not None:
                return self._pending[1]
            return self.ceiling

    def grew(self, before: int, after: int, now: float) -> None:
        """The depth grew from ``before`` to ``after`` steps at ``now``. No
        trial while one runs, or before :data:`TRIAL_FETCHES` fetches ended:
        nothing to compare with (the first fetches of a burst are not a
        measure of the depth: its first step is fetched alone, ahead of the
        others)."""
        with self._lock:
            if self._pending is not None or len(self._recent) < TRIAL_FETCHES or after <= before:
                return
            measure = max(TRIAL_FETCHES, after - before)
            self._pending = (before, after, _mean(self._recent), now, measure)
            self._after = []
            self.trials += 1

    def fetched(self, began: float, seconds: float) -> None:
        """A fetch begun at ``began`` ended after ``seconds``."""
        with self._lock:
            if self._pending is None:
                self._recent.append(seconds)
                if self.ceiling is not None:
                    self._since_ceiling += 1
                    if self._since_ceiling >= RETRIAL_FETCHES:
                        self.ceiling = None
                return
            before, after, fetch0, grew_at, measure = self._pending
            if began < grew_at:
                return  # begun under the depth before
            self._after.append(seconds)
            if len(self._after) < measure:
                return
            fetch1 = _mean(self._after)
            gain = (after / max(fetch1, 1e-9)) / (before / max(fetch0, 1e-9))
            self._pending = None
            self._recent.clear()
            self._recent.extend(self._after[-TRIAL_FETCHES:])
            if gain >= 1 + PAID * (after / before - 1):
                self.ceiling = None
            else:
                self.ceiling, self._since_ceiling = before, 0
                self.failed += 1
