"""The steps a loader hands to its trainer: read ahead, measured, watched for stalls.

:class:`Feed` joins the pieces that ``Loader.iterate``, ``Loader.batch`` and
``Loader.start`` share: one :class:`~flat_tokens_jax.loader.pipeline.InFlight` of
steps read ahead, its depth (pinned by ``prefetch``, or set by
:func:`~flat_tokens_jax.loader.readahead.auto_depth` from the
:class:`~flat_tokens_jax.loader.readahead.Measures` within ``read_ahead_bytes``), the
statistics and the one stall warning (which names throttling when the store
refused requests as throttled during the steps that stalled).
"""

from __future__ import annotations

import concurrent.futures
import logging
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from flat_tokens_jax.data.dataset import FlatTokens
from flat_tokens_jax.loader.config import LoaderConfig
from flat_tokens_jax.loader.pipeline import Ahead, InFlight
from flat_tokens_jax.loader.readahead import (
    DEVICE_BYTES_PER_TOKEN,
    INITIAL_DEPTH,
    MAX_DEPTH,
    MIN_DEPTH,
    Measures,
    StallWatch,
    next_depth,
    stall_message,
)
from flat_tokens_jax.loader.throughput import DepthTrial
from flat_tokens_jax.store.store import remote_reads, throttled_requests

log = logging.getLogger("flat_tokens_jax.loader")

BOOKS_DELAY = 0.002
"""Seconds the books of a step handed out wait before they start: the
trainer's thread returns with its batch and begins its step before the
fetches they start take the interpreter lock; only for a trainer whose
step is longer than :data:`SLOW_TRAINER` seconds."""

SLOW_TRAINER = 0.04


class Feed:
    """Steps read ahead for one loader, with their measurements. Thread-safe.

    Args:
        config: ``prefetch``, ``read_ahead_bytes``, ``seq_len``, ``decode``,
            ``layout`` and ``max_segments`` are used.
        make: builds the :class:`Ahead` that prepares steps.
        read: prepares one step in the caller's thread.
        host_rows: this host's rows at a step.
        components: the loader's records (their splits' bytes are counted).
        source_names: the run's sources, which ``source_tokens`` counts by name.
    """

    def __init__(
        self,
        config: LoaderConfig,
        make: Callable[[], Ahead[Any, Any]],
        read: Callable[[int], Any],
        host_rows: Callable[[int], int],
        components: Sequence[Any],
        source_names: Sequence[str],
    ) -> None:
        self.prefetch, self.budget = config.prefetch, config.read_ahead_bytes
        self._read, self._rows, self._seq_len = read, host_rows, config.seq_len
        # Decoded on the host, a step holds its layout's arrays; on the
        # devices, its encoded tokens until they are placed there.
        self._row_bytes = (
            config.seq_len * DEVICE_BYTES_PER_TOKEN
            if config.decode == "device"
            else config.batch_layout.row_bytes(config.seq_len)
        )
        found = [getattr(r, "ft", None) for r in components]
        self._splits = list({id(ft): ft for ft in found if isinstance(ft, FlatTokens)}.values())
        self.flight: InFlight[Any] = InFlight(make, self._step_bytes)
        self.measures, self._watch = Measures(), StallWatch()
        self.trial = DepthTrial()
        # On an object store the steps after the first are requested with it.
        start = INITIAL_DEPTH if self.remote else MIN_DEPTH
        self._target = start if self.prefetch is None else self.prefetch
        self._taken: tuple[int, int | None] | None = None  # the step taken last, and the end
        self._lock = threading.Lock()
        self._books: concurrent.futures.ThreadPoolExecutor | None = None
        self._booked: concurrent.futures.Future[None] | None = None
        self._tokens = 0
        self._source_names = tuple(source_names)
        self._source_rows = np.zeros(len(self._source_names), np.int64)
        self._requests_before = sum(remote_reads().values())
        self._throttled_before = self._throttled_window = throttled_requests()
        self._bytes_before = self._bytes_read()

    @property
    def remote(self) -> bool:
        """Whether some split is off local disk: a fetch mostly waits for round trips."""
        return any(ft.store.local_path("") is None for ft in self._splits)

    def fetchers(self) -> int:
        """Fetches that run at once: one locally (a fetch there is a copy that
        needs a core); on an object store one per step in flight."""
        if not self.remote:
            return 1
        return MAX_DEPTH + 1 if self.prefetch is None else max(1, self.prefetch)

    def _step_bytes(self, step: int) -> int:
        """Bytes a prepared step holds on this host (its rows' arrays)."""
        return self._rows(step) * self._row_bytes

    def _bytes_read(self) -> int:
        return sum(ft.bytes_read + ft.probe_bytes for ft in self._splits)

    def fetched(self, seconds: float) -> None:
        """Counts a step's fetch that ended now after ``seconds``. On an
        object store the first one measured, before any step was handed out,
        already moves the depth: at 50 ms steps a store whose fetch takes
        600 ms needs the steps after the opening burst started before the
        trainer asks for the burst's first (measured: a 250 ms wait at step 9
        at +250 ms a request otherwise). On local disk the depth waits for
        the second step handed out (see :meth:`_handed`)."""
        first = self.measures.fetch_ema is None
        self.measures.fetched(seconds)
        self.trial.fetched(time.perf_counter() - seconds, seconds)
        taken = self._taken
        if first and taken is not None and self.measures.steps == 0 and self.remote:
            step, end = taken
            self.flight.grow(step, self.depth(step + 1, grow=True), end, self._bound())

    def depth(self, step: int, grow: bool = False) -> int:
        """Steps to keep in flight after ``step``: ``prefetch``, or measured
        and moved toward what the measurements ask for by
        :func:`~flat_tokens_jax.loader.readahead.next_depth`, within the budget and
        the cap of :class:`~flat_tokens_jax.loader.throughput.DepthTrial` (a growth
        that did not make the store deliver faster is undone); it grows only
        when ``grow`` (once per step handed out)."""
        if self.prefetch is not None:
            return self.prefetch
        size = self._step_bytes(step)
        wanted = self.measures.depth(size, size * MAX_DEPTH)
        cap = min(MAX_DEPTH, self.budget // max(size, 1))
        with self._lock:
            if not grow:
                wanted = min(wanted, self._target)
            ceiling = self.trial.cap()
            if ceiling is not None:
                cap = min(cap, ceiling)
            before = self._target
            self._target = next_depth(before, wanted, cap)
            if self._target > before:
                self.trial.grew(before, self._target, time.perf_counter())
            return self._target

    def _bound(self) -> int | None:
        return self.budget if self.prefetch is None else None

    def take(self, step: int, ahead: bool, end: int | None) -> Any:
        """Step ``step`` prepared: from the steps in flight when there, else
        read here (``ahead``: read ahead even after a jump)."""
        self._taken = (step, end)
        future = self.flight.take(
            step, ahead=ahead, depth=self.depth(step), end=end, budget=self._bound()
        )
        if future is not None:
            try:
                return future.result()
            except concurrent.futures.CancelledError:  # dropped by a closing iterate
                pass
        return self._read(step)

    def drop_from(self, step: int) -> None:
        """Drops the steps read ahead at or after ``step``, to be read again."""
        self.flight.drop_from(step)

    def start(self, step: int, end: int | None) -> None:
        """Starts ``step`` and the steps after it (see ``Loader.start``)."""
        if self.prefetch != 0 and (end is None or step < end):
            self.flight.start(step, self.depth(step), end, self._bound())

    def handed(
        self, step: int, wait: float, now: float, end: int | None, sources: np.ndarray
    ) -> None:
        """Counts step ``step`` handed to the trainer at ``now`` after ``wait``
        seconds (``sources`` ``[k]`` its rows' sources, ``-1`` for padding),
        tops up the steps in flight, and warns once of a stall: on a
        thread of its own, so the trainer has its batch without waiting for
        this work (or for the interpreter lock the fetches it starts take)."""
        with self._lock:
            if self._books is None:
                self._books = concurrent.futures.ThreadPoolExecutor(
                    1, thread_name_prefix="ftj-feed"
                )
            self._booked = self._books.submit(self._handed, step, wait, now, end, sources)

    def _flush(self) -> None:
        """Waits for the steps handed out so far to be counted."""
        with self._lock:
            booked = self._booked
        if booked is not None:
            booked.result()

    def _handed(
        self, step: int, wait: float, now: float, end: int | None, sources: np.ndarray
    ) -> None:
        """See :meth:`handed`.

        The depth grows from the second step handed out on: when the first is,
        the steps started with it are still being decoded, and new fetches
        would take the interpreter from them."""
        interval = self.measures.interval_ema
        if interval is not None and interval > SLOW_TRAINER:
            time.sleep(BOOKS_DELAY)  # a fast trainer would wait for the top-up instead
        grow = self.measures.steps > 0
        self.flight.grow(step, self.depth(step + 1, grow=grow), end, self._bound())
        rows = np.bincount(sources[sources >= 0], minlength=self._source_rows.size)
        with self._lock:
            self._tokens += self._rows(step) * self._seq_len
            self._source_rows += rows
        interval = self.measures.taken(wait, now)
        if interval is not None and self._watch.steps == 0 and not self._watch.fired:
            self._throttled_window = throttled_requests()  # a stall window begins
        window = None if interval is None else self._watch.add(wait, interval)
        if window is not None:
            log.warning(self._stall(step, window))

    def _stall(self, step: int, window: tuple[float, float, int]) -> str:
        m = self.measures
        size = self._step_bytes(step)
        wanted = m.depth(size, size * MAX_DEPTH)
        depth = self._target
        capped = None
        if wanted > depth and self.prefetch is not None:
            capped = "prefetch"
        elif wanted > depth and self.budget // max(size, 1) <= depth:
            capped = "read_ahead_bytes"  # not a trial: that holds it for the store's throughput
        read = self._bytes_read() - self._bytes_before
        elapsed = float(m.stats()["interval_mean_s"]) * max(m.steps - 1, 1)
        return stall_message(
            window,
            fetch_s=m.fetch_ema or 0.0,
            finish_s=m.finish_ema or 0.0,
            depth=depth,
            capped_by=capped,
            bytes_per_step=read / max(m.steps, 1),
            delivered_bps=read / max(elapsed, 1e-9),
            throttled=throttled_requests() - self._throttled_window,
        )

    def close(self, wait: bool = True, _finalizing: Callable[[], bool] = sys.is_finalizing) -> None:
        """Stops the read-ahead (``wait``: as ``pipeline.InFlight.close``)."""
        if _finalizing():  # as in pipeline.Ahead.close: the threads end with the process
            return
        self._flush()
        with self._lock:
            books, self._books, self._booked = self._books, None, None
        if books is not None:
            books.shutdown(wait=wait)
        self.flight.close(wait)

    def stats(self) -> dict[str, Any]:
        """See ``Loader.stats``."""
        self._flush()
        with self._lock:
            tokens = self._tokens
            rows = self._source_rows.tolist()
        return {
            **self.measures.stats(),
            "depth": len(self.flight.steps()),
            "depth_target": self._target,
            "depth_ceiling": self.trial.ceiling or 0,
            "read_ahead_bytes_peak": self.flight.peak_bytes,
            "read_ahead_bytes": self.budget,
            "requests": sum(remote_reads().values()) - self._requests_before,
            "throttled_requests": throttled_requests() - self._throttled_before,
            "bytes_read": self._bytes_read() - self._bytes_before,
            "tokens": tokens,
            "source_tokens": {
                name: n * self._seq_len for name, n in zip(self._source_names, rows, strict=True)
            },
        }


def timed(measure: Callable[[float], None], run: Callable[[], Any]) -> Any:
    """``run()``, its seconds given to ``measure``."""
    began = time.perf_counter()
    out = run()
    measure(time.perf_counter() - began)
    return out
