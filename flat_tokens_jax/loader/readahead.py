"""How many steps to read ahead, what the trainer waited, and when to say so:
:class:`Measures` times a loader's steps and decides the depth, the decode threads
and the stall warning (:func:`stall_message`); pure code, testable without a store."""

from __future__ import annotations

import collections
import math
import threading

import numpy as np

from flat_tokens_jax.loader.decodethreads import THREAD_BOUND, DecodeThreads

MIN_DEPTH = 2
"""Fewest steps an automatic depth keeps in flight (memory permitting)."""

INITIAL_DEPTH = 8
"""Steps an automatic depth keeps in flight on an object store before any fetch
was measured, so the steps after the first are under way with it."""

MAX_DEPTH = 128
"""Most steps an automatic depth keeps in flight, whatever the measurements."""

ASSUMED_INTERVAL = 0.01
"""The trainer's step, in seconds, assumed until two batches were taken."""

EMA_WEIGHT = 0.25
"""Weight of a new measurement in the moving averages that set the depth."""

COVER = 1.5
"""Steps in flight cover this many times a step's fetch and finish."""

DEVICE_BYTES_PER_TOKEN = 5
"""Bytes a step decoded on the devices holds per token (``uint32`` and a mask byte)."""

RECENT_FETCHES = 32
"""Fetches whose slowest sets the depth: a step that touches a new shard takes
two or three round trips where others take one, and the depth must cover it."""

RECENT_WAITS = 1024
"""Waits kept for ``wait_p99_s``."""

STALL_WINDOW = 50
"""Steps (after the first) over which the trainer's waits are summed for the warning."""

STALL_SHARE = 0.05
"""Share of the trainer's time spent waiting for input that is a stall."""

TRIAL_FETCHES = 4
"""Fewest fetches whose mean duration measures a depth, before a growth and after it."""

PAID = 0.5
"""Share of a growth's proportional gain the rate must show: from ``d0`` to
``d1`` steps pays when ``depth / fetch`` rises ``1 + PAID * (d1 / d0 - 1)`` times."""

RETRIAL_FETCHES = 64
"""Fetches after a growth that did not pay before the next trial."""


def covered(fetch_s: float, finish_s: float | None) -> float:
    """Seconds the read-ahead needs for a step: :data:`COVER` times its fetch and finish."""
    return COVER * (fetch_s + (finish_s or 0.0))


def auto_depth(
    fetch_s: float | None,
    finish_s: float | None,
    interval_s: float | None,
    step_bytes: int,
    budget: int,
) -> int:
    """Steps to keep in flight: ``ceil(1.5 * (fetch + finish) / interval) + 1``,
    at least :data:`MIN_DEPTH` (:data:`INITIAL_DEPTH` before a fetch was
    measured), at most :data:`MAX_DEPTH` and ``budget // step_bytes``, and at
    least 1."""
    if fetch_s is None:
        want = INITIAL_DEPTH
    else:
        interval = ASSUMED_INTERVAL if interval_s is None else max(interval_s, 1e-6)
        ratio = covered(fetch_s, finish_s) / interval
        want = MAX_DEPTH if ratio >= MAX_DEPTH else math.ceil(ratio) + 1
        want = min(max(want, MIN_DEPTH), MAX_DEPTH)
    return max(1, min(want, budget // max(step_bytes, 1)))


GROWTH = 2
"""Most the automatic depth grows by at each update: a cold start's slow first
fetch does not request a hundred steps at once."""


def next_depth(previous: int, wanted: int, cap: int) -> int:
    """The depth after ``previous`` on the way to ``wanted``: up at most
    :data:`GROWTH` times (from at least :data:`MIN_DEPTH`), down one step per
    update, and within ``[1, cap]``."""
    if wanted >= previous:
        depth = min(wanted, max(MIN_DEPTH, GROWTH * previous))
    else:
        depth = max(wanted, previous - 1)
    return max(1, min(depth, cap))


def _ema(old: float | None, new: float) -> float:
    return new if old is None else old + EMA_WEIGHT * (new - old)


def _mean(total: list[float]) -> float:
    return total[0] / total[1] if total[1] else 0.0


class Measures:
    """Times of a loader's steps, and what they decide. Thread-safe.

    ``fetched`` and ``finished`` time the two stages of a step, ``taken`` the
    trainer's wait for it; the interval between two batches taken is the
    trainer's step. From them: the depth (:meth:`depth`), whether a growth of
    it made the store deliver faster (the trial), and the stall warning.

    The trial (docs/guide/loading.md, "Where the work runs, and read-ahead"): after
    the depth grew from ``d0`` to ``d1`` it is held until the fetches begun since have
    ended; it is kept when ``d1 / (their mean fetch)`` rose over ``d0 / (the mean
    before)`` by :data:`PAID`, else capped at ``d0`` (``ceiling``) for
    :data:`RETRIAL_FETCHES` fetches.

    The stall window: the trainer's waits and steps are summed over windows of
    ``stall_window`` steps after the first; the first window whose waits exceed
    ``stall_share`` of its time in more than a tenth of its steps (so one pause
    of the whole process is no stall) is reported by :meth:`taken`, once.
    Times are ``time.perf_counter`` seconds.
    """

    def __init__(
        self,
        stall_window: int = STALL_WINDOW,
        stall_share: float = STALL_SHARE,
        *,
        most_threads: int = 1,
        decode_threads: int | None = None,
    ) -> None:
        if stall_window < 1 or not 0 < stall_share < 1:
            raise ValueError(
                "Measures needs stall_window >= 1 and 0 < stall_share < 1, "
                f"got {stall_window}, {stall_share}"
            )
        self._lock = threading.Lock()
        self.fetch_ema: float | None = None
        self.finish_ema: float | None = None
        self.interval_ema: float | None = None
        self.fetch_last = 0.0
        self._recent_fetches: collections.deque[float] = collections.deque(maxlen=RECENT_FETCHES)
        self._fetch = [0.0, 0]  # sum, count
        self._finish = [0.0, 0]
        self._interval = [0.0, 0]
        self._waits = [0.0, 0]  # after the first step
        self.steps = 0
        self.wait_first = 0.0
        self.wait_last = 0.0
        self._recent: collections.deque[float] = collections.deque(maxlen=RECENT_WAITS)
        self._taken_at: float | None = None
        # The trial of a growth: (depth before, after, mean fetch before, when it
        # grew, fetches to measure), the fetches since, and the fetches before.
        self._pending: tuple[int, int, float, float, int] | None = None
        self._after: list[float] = []
        self._before: collections.deque[float] = collections.deque(maxlen=TRIAL_FETCHES)
        self.ceiling: int | None = None
        self._since_ceiling = 0
        self.trials = self.failed = 0
        # The stall window under way: waited, elapsed, steps, slow steps.
        self.stall_window, self.stall_share = stall_window, stall_share
        self._window = [0.0, 0.0, 0, 0]
        self.stalled = False
        self.threads = DecodeThreads(most_threads, decode_threads)

    def fetched(self, began: float, seconds: float) -> None:
        with self._lock:
            self.fetch_ema = _ema(self.fetch_ema, seconds)
            self.fetch_last = seconds
            self._recent_fetches.append(seconds)
            self._fetch[0] += seconds
            self._fetch[1] += 1
            self._judge(began, seconds)

    def finished(self, seconds: float, rows: int = 0, threads: int | None = None) -> None:
        """A finish of ``rows`` rows took ``seconds`` on ``threads`` threads
        (:meth:`decode_threads`'s count; ``None``: not measured for it)."""
        with self._lock:
            self.finish_ema = _ema(self.finish_ema, seconds)
            self._finish[0] += seconds
            self._finish[1] += 1
            if threads is not None and not self.threads.fixed:
                finish, fetch, interval = self.finish_ema, self.fetch_ema, self.interval_ema
                bound = (
                    interval is not None
                    and finish >= (fetch or 0.0)
                    and finish >= THREAD_BOUND * interval
                )
                self.threads.finished(seconds, rows, threads, bound)

    def decode_threads(self) -> int:
        with self._lock:
            return self.threads.count if self.threads.fixed else self.threads.next()

    def window_starts(self) -> bool:
        """Whether the next :meth:`taken` (not the first) begins a stall window."""
        with self._lock:
            return self._taken_at is not None and self._window[2] == 0 and not self.stalled

    def taken(self, wait: float, now: float) -> tuple[float, float, int] | None:
        """A batch handed out at ``now`` after ``wait`` seconds; ``(waited,
        elapsed, steps)`` of a stall window that ends with it, once."""
        with self._lock:
            interval = None if self._taken_at is None else now - self._taken_at
            self._taken_at = now
            if self.steps == 0:
                self.wait_first = wait
            else:
                self._waits[0] += wait
                self._waits[1] += 1
                self._recent.append(wait)
            self.steps += 1
            self.wait_last = wait
            if interval is None:
                return None
            self.interval_ema = _ema(self.interval_ema, interval)
            self._interval[0] += interval
            self._interval[1] += 1
            return self._stall(wait, interval)

    def _stall(self, wait: float, interval: float) -> tuple[float, float, int] | None:
        if self.stalled:
            return None
        w = self._window
        w[0] += wait
        w[1] += interval
        w[2] += 1
        w[3] += wait > self.stall_share * interval
        if w[2] < self.stall_window:
            return None
        window, slow = (float(w[0]), float(w[1]), int(w[2])), w[3]
        self._window = [0.0, 0.0, 0, 0]
        if window[0] > self.stall_share * window[1] and 10 * slow > window[2]:
            self.stalled = True
            return window
        return None

    def depth(self, step_bytes: int, budget: int) -> int:
        """:func:`auto_depth` of the slowest recent fetch and the finish's and
        trainer's step's moving averages."""
        with self._lock:
            fetch = max(self._recent_fetches) if self._recent_fetches else None
            return auto_depth(fetch, self.finish_ema, self.interval_ema, step_bytes, budget)

    def spare(self, ahead: int = 1) -> float:
        """Seconds the read-ahead does not need of the time until the trainer asks
        for a step ``ahead`` steps on: ``ahead`` trainer steps less :data:`COVER`
        times the slowest recent fetch and the finish (``0`` until all three were
        measured, or when they need all of it)."""
        with self._lock:
            if self.interval_ema is None or self.finish_ema is None or not self._recent_fetches:
                return 0.0
            needed = covered(max(self._recent_fetches), self.finish_ema)
            return max(0.0, ahead * self.interval_ema - needed)

    def trial_cap(self) -> int | None:
        """The most steps the depth may reach now: the depth under trial while
        one runs, the depth before a growth that did not pay, else ``None``."""
        with self._lock:
            return self.ceiling if self._pending is None else self._pending[1]

    def grew(self, before: int, after: int, now: float) -> None:
        """The depth grew from ``before`` to ``after`` steps at ``now``: a trial,
        unless one runs or fewer than :data:`TRIAL_FETCHES` fetches ended (the
        first fetches of a burst do not measure the depth)."""
        with self._lock:
            if self._pending is not None or len(self._before) < TRIAL_FETCHES or after <= before:
                return
            measure = max(TRIAL_FETCHES, after - before)
            self._pending = (before, after, sum(self._before) / len(self._before), now, measure)
            self._after = []
            self.trials += 1

    def _judge(self, began: float, seconds: float) -> None:
        """A fetch for the trial (the lock held)."""
        if self._pending is None:
            self._before.append(seconds)
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
        fetch1 = sum(self._after) / len(self._after)
        gain = (after / max(fetch1, 1e-9)) / (before / max(fetch0, 1e-9))
        self._pending = None
        self._before.clear()
        self._before.extend(self._after[-TRIAL_FETCHES:])
        if gain >= 1 + PAID * (after / before - 1):
            self.ceiling = None
        else:
            self.ceiling, self._since_ceiling = before, 0
            self.failed += 1

    def stats(self) -> dict[str, float | int]:
        """The measures ``Loader.stats`` reports (see docs/guide/loading.md); 0
        where nothing was measured."""
        with self._lock:
            recent = np.fromiter(self._recent, float, len(self._recent))
            return {
                "steps": self.steps,
                "wait_first_s": self.wait_first,
                "wait_last_s": self.wait_last,
                "wait_mean_s": _mean(self._waits),
                "wait_p99_s": float(np.quantile(recent, 0.99)) if recent.size else 0.0,
                "fetch_last_s": self.fetch_last,
                "fetch_mean_s": _mean(self._fetch),
                "decode_mean_s": _mean(self._finish),
                "interval_mean_s": _mean(self._interval),
                "decode_threads": self.threads.count,
            }


def stall_message(
    window: tuple[float, float, int],
    *,
    fetch_s: float,
    finish_s: float,
    depth: int,
    capped_by: str | None,
    bytes_per_step: float,
    delivered_bps: float,
    throttled: int = 0,
) -> str:
    """The warning for a ``window`` (``(waited, elapsed, steps)``) that stalled:
    how much the trainer waited, the likely cause and the knob. ``capped_by``:
    the field that held the depth below what the measurements ask for;
    ``throttled``: requests the store refused as throttled over the window.
    """
    waited, elapsed, steps = window
    step = max((elapsed - waited) / steps, 1e-9)  # the trainer's own work per step
    head = (
        f"input stall: the trainer waited {waited:.3f} s for batches over its last "
        f"{steps} steps ({100 * waited / max(elapsed, 1e-9):.0f}% of {elapsed:.3f} s; "
        f"its own step takes {1e3 * step:.1f} ms): "
    )
    if finish_s >= step:
        return head + (
            f"decoding a step takes {1e3 * finish_s:.1f} ms, longer than the trainer's "
            "step (decode CPU): raise LoaderConfig.decode_threads or set decode='device'"
        )
    if throttled:
        return head + (
            f"the store refused {throttled} requests as throttled (HTTP 429 or 503) over "
            "these steps, each retried after a backoff (throttling): need fewer requests "
            'with LoaderConfig(shuffle="blocks") (a request reads a block of records, '
            "not about one a row), or ramp the run's request rate up as the bucket's "
            "grows (a fresh GCS bucket serves about 5,000 reads/s, doubling about every "
            "20 minutes)"
        )
    if capped_by is not None and fetch_s > depth * step:
        fix = (
            "raise LoaderConfig.read_ahead_bytes"
            if capped_by == "read_ahead_bytes"
            else "raise LoaderConfig.prefetch or set it to None (automatic depth)"
        )
        return head + (
            f"a step's fetch takes {1e3 * fetch_s:.1f} ms and {capped_by} holds the "
            f"read-ahead at {depth} steps, which cover {1e3 * depth * step:.1f} ms "
            f"(latency): {fix}"
        )
    rates = (
        f"the store delivers {delivered_bps / 1e6:.3g} MB/s, the trainer's step "
        f"needs {bytes_per_step / step / 1e6:.3g} MB/s; "
        if bytes_per_step
        else ""
    )
    return head + (
        f"a step's fetch takes {1e3 * fetch_s:.1f} ms with {depth} steps in flight "
        f"(bandwidth or store): {rates}raise StoreOptions.concurrency or read from "
        "a store nearer to this host"
    )
