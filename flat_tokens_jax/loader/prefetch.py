"""Steps read ahead for one loader, in order, on background threads: ``Prefetcher``.

A step's ``read`` starts reading its records, ``finish`` decodes them (and places them
on the devices): one thread finishes step after step while the next are read beside it,
by one thread on local disk (a read is a copy, which needs a core), all at once on an
object store (their round trips overlap). The depth: ``prefetch``, else what the measured
times ask for (:class:`~flat_tokens_jax.loader.readahead.Measures`) within
``read_ahead_bytes``; taking any step but the next (a jump) drops what was started and
reads that step in the caller's thread.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Generic, Protocol, TypeVar

import numpy as np

from flat_tokens_jax.core import compiled
from flat_tokens_jax.data.dataset import FlatTokens
from flat_tokens_jax.decoding.hostdecode import default_threads
from flat_tokens_jax.loader.config import LoaderConfig
from flat_tokens_jax.loader.readahead import (
    DEVICE_BYTES_PER_TOKEN,
    INITIAL_DEPTH,
    MAX_DEPTH,
    MIN_DEPTH,
    Measures,
    next_depth,
    stall_message,
)
from flat_tokens_jax.store.store import remote_reads, throttled_requests

log = logging.getLogger("flat_tokens_jax.loader")


class Part(Protocol):
    """What a step's first stage gives: read records, or blocks for the devices."""

    @property
    def sources(self) -> np.ndarray:
        """``[rows] int32`` each row's source, ``-1`` for padding."""


P = TypeVar("P", bound=Part)
Done = TypeVar("Done")


class Prefetcher(Generic[P, Done]):
    """A loader's steps read ahead; see the module's docstring. Thread-safe.

    Args:
        read: ``read(step, ahead)`` starts a step's first stage and returns the
            function that waits for it; ``ahead``: on a background thread.
        finish: ``finish(step, part, threads)``, the second stage, decoding on
            ``threads`` threads (``None``: the decoder's default).
        rows: this host's rows at a step.
        splits: the splits the loader reads (their bytes are counted; one off
            local disk makes the reads run at once).
        source_names: the run's sources, which ``source_tokens`` counts by name.
        fetchers: reads that run at once (``None``: one on local disk, one per step
            in flight on an object store).
        warm: called before each read is timed (the compiled kernels' set-up,
            once a process, must not set the first loader's depth).
    """

    def __init__(
        self,
        config: LoaderConfig,
        read: Callable[[int, bool], Callable[[], P]],
        finish: Callable[[int, P, int | None], Done],
        rows: Callable[[int], int],
        splits: Sequence[FlatTokens] = (),
        source_names: Sequence[str] = ("0",),
        name: str = "ftj-prefetch",
        fetchers: int | None = None,
        warm: Callable[[], object] = compiled.warm,
    ) -> None:
        self.prefetch, self.budget = config.prefetch, config.read_ahead_bytes
        self._seq_len = config.seq_len
        self._read, self._finishing, self._rows, self._name = read, finish, rows, name
        self._warm = warm
        # Decoded on the host, a step holds its layout's arrays; on the
        # devices, its encoded tokens until they are placed there.
        self._row_bytes = (
            config.seq_len * DEVICE_BYTES_PER_TOKEN
            if config.decode == "device"
            else config.batch_layout.row_bytes(config.seq_len)
        )
        self._splits = list({id(ft): ft for ft in splits}.values())
        self.remote = any(ft.store.local_path("") is None for ft in self._splits)
        if fetchers is None and self.remote:
            fetchers = MAX_DEPTH + 1 if self.prefetch is None else max(1, self.prefetch)
        self.fetchers = fetchers or 1
        # Reading ahead, the read stage takes a core of its own.
        self.measures = Measures(
            most_threads=max(1, default_threads() - 1),
            decode_threads=config.decode_threads,
        )
        # On an object store the steps after the first are requested with it.
        start = INITIAL_DEPTH if self.remote else MIN_DEPTH
        self._target = start if self.prefetch is None else self.prefetch
        self._lock = threading.Lock()
        self._paced = threading.Event()  # set: the paced reads waiting start now
        self._futures: dict[int, concurrent.futures.Future[tuple[Done, np.ndarray]]] = {}
        # Each step in flight's bytes, worked out once when it is started.
        self._sizes: dict[int, int] = {}
        self._pools: tuple[concurrent.futures.ThreadPoolExecutor, ...] | None = None
        self._lead: threading.Event | None = None
        self._last: int | None = None  # the step taken last
        self._end: int | None = None  # ... and the end it was taken with
        self._reading = False
        self.peak_bytes = 0
        self.wait_seconds = 0.0
        self._tokens = 0
        self._source_names = tuple(source_names)
        self._source_rows = np.zeros(len(self._source_names), np.int64)
        self._requests_before = sum(remote_reads().values())
        self._throttled_before = self._throttled_window = throttled_requests()
        self._bytes_before = self._bytes_read()

    def take(
        self,
        step: int,
        end: int | None,
        ahead: bool = True,
        deliver: Callable[[Done], Any] | None = None,
    ) -> Any:
        """Step ``step``, prepared, through ``deliver``: from the steps in flight
        when there, else read here. ``ahead``: read ahead even after a jump;
        nothing is read at or past ``end``."""
        began = time.perf_counter()
        future = self._take(step, ahead, end)
        done = None
        if future is not None:
            with contextlib.suppress(concurrent.futures.CancelledError):  # dropped: read it here
                done = future.result()
        if done is None:  # both stages in the caller's thread
            done = self._finish(step, self._fetch(step, False, None, None))
        out = done[0] if deliver is None else deliver(done[0])
        now = time.perf_counter()
        self.wait_seconds = now - began
        self._handed(step, now - began, now, end, done[1])
        return out

    def start(self, step: int, end: int | None) -> None:
        """Starts ``step`` and the steps after it (nothing with ``prefetch=0``, or
        at or past ``end``)."""
        if self.prefetch == 0 or (end is not None and step >= end):
            return
        depth = self.depth(step)
        with self._lock:
            if step not in self._futures:
                self._drop()
                self._futures[step] = self._submit(step, lead=True)
                self._sizes[step] = self._step_bytes(step)
            self._last, self._end, self._reading = step - 1, end, True
            self._top_up(step, depth, end)

    def drop_from(self, step: int) -> None:
        """Drops the steps in flight at or after ``step``; taking them reads them again."""
        with self._lock:
            self._drop(step)

    def steps(self) -> list[int]:
        """The steps in flight (started, not taken), ascending."""
        with self._lock:
            return sorted(self._futures)

    def close(self, wait: bool = True, _finalizing: Callable[[], bool] = sys.is_finalizing) -> None:
        """Drops the steps not started and stops the threads (a later step starts
        new ones); ``wait``: waits for the reads running. Nothing while the
        interpreter exits: its threads end with the process (``_finalizing`` is
        bound at definition: exiting clears module globals)."""
        if _finalizing():
            return
        with self._lock:
            self._drop()
            self._last, self._reading = None, False
            pools, self._pools = self._pools, None
        if pools is not None:
            fetching, finishing = pools
            finishing.shutdown(wait=False, cancel_futures=True)
            fetching.shutdown(wait=wait, cancel_futures=True)
            finishing.shutdown(wait=wait)

    def _take(
        self, step: int, ahead: bool, end: int | None
    ) -> concurrent.futures.Future[tuple[Done, np.ndarray]] | None:
        depth = self.depth(step)
        with self._lock:
            future = self._futures.pop(step, None)
            self._sizes.pop(step, None)
            follows = self._last is not None and step == self._last + 1
            self._last, self._end = step, end
            self._reading = depth > 0 and (ahead or future is not None or follows)
            self._drop(0, None if future is None else step)
            if not self._reading:
                return future
            if future is None:
                future = self._submit(step, lead=True)
            if not future.done():  # the caller waits: no read waits for its start
                self._wake()
                self._top_up(step, depth, end)
            return future

    def _fetch(
        self,
        step: int,
        ahead: bool,
        after: threading.Event | None,
        issued: threading.Event | None,
        start_at: float | None = None,
    ) -> P:
        if start_at is not None:
            paced = self._paced
            if paced.wait(max(0.0, start_at - time.perf_counter())):
                with self._lock:  # woken: by the caller taking it, or by a drop
                    if step not in self._futures and step != self._last:
                        raise concurrent.futures.CancelledError
        if after is not None:
            after.wait()
        self._warm()
        began = time.perf_counter()
        try:
            waiting = self._read(step, ahead)
        finally:
            if issued is not None:
                issued.set()
        part = waiting()
        self._fetched(began, time.perf_counter() - began)
        return part

    def _finish(self, step: int, part: P, ahead: bool = False) -> tuple[Done, np.ndarray]:
        """A step's second stage; read ahead, on the threads the measures pick."""
        threads = self.measures.decode_threads() if ahead else None
        began = time.perf_counter()
        done = self._finishing(step, part, threads)
        self.measures.finished(time.perf_counter() - began, part.sources.size, threads)
        return done, part.sources

    def _submit(
        self, step: int, lead: bool = False, start_at: float | None = None
    ) -> concurrent.futures.Future[Any]:
        """Starts ``step`` on the threads (the lock held). ``lead``: the first step
        of a burst; the reads submitted after it start once it has started its own."""
        if self._pools is None:
            self._pools = (
                concurrent.futures.ThreadPoolExecutor(
                    self.fetchers, thread_name_prefix=f"{self._name}-read"
                ),
                concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=self._name),
            )
        fetching, finishing = self._pools
        issued = threading.Event()
        after = None if lead else self._lead
        if lead:
            self._lead = issued
        fetched = fetching.submit(self._fetch, step, True, after, issued, start_at)
        fetched.add_done_callback(lambda _: issued.set())  # also when cancelled unstarted
        finished = finishing.submit(lambda: self._finish(step, fetched.result(), True))
        finished.add_done_callback(lambda f: f.cancelled() and fetched.cancel())
        return finished

    def _drop(self, start: int = 0, stop: int | None = None) -> None:
        """Drops the steps in flight in ``[start, stop)`` (the lock held); the
        paced reads waiting wake, and those of dropped steps end."""
        dropped = False
        for step in list(self._futures):
            if start <= step and (stop is None or step < stop):
                self._futures.pop(step).cancel()
                del self._sizes[step]
                dropped = True
        if dropped:
            self._wake()

    def _wake(self) -> None:
        """Starts the paced reads waiting now (the lock held)."""
        self._paced.set()
        self._paced = threading.Event()

    def _top_up(self, step: int, depth: int, end: int | None, paced: bool = False) -> None:
        """Keeps up to ``depth`` steps after ``step`` in flight, within the budget
        (at least one step is read ahead whatever its size; the lock held)."""
        budget = self.budget if self.prefetch is None else None
        after = held = 0
        for s, size in self._sizes.items():
            if s > step:
                after, held = after + 1, held + size
        nxt = step + 1
        while after < depth and (end is None or nxt < end):
            if nxt not in self._futures:
                size = self._step_bytes(nxt)
                if budget is not None and after and held + size > budget:
                    break
                start_at = self._start_at(nxt - step) if paced else None
                self._futures[nxt] = self._submit(nxt, start_at=start_at)
                self._sizes[nxt] = size
                after, held = after + 1, held + size
            nxt += 1
        self.peak_bytes = max(self.peak_bytes, sum(self._sizes.values()))

    def _grow(self, step: int, depth: int, end: int | None, paced: bool = False) -> None:
        """Tops up after ``step`` when it was the last taken and read ahead."""
        with self._lock:
            if self._reading and self._last == step:
                self._top_up(step, depth, end, paced)

    def _start_at(self, ahead: int) -> float | None:
        """When a read the hand-out tops up ``ahead`` steps on starts: after half
        the time its step leaves spare (at once when none). Started at once, the
        read held the interpreter while the caller's thread returned to the
        trainer (twice the wait at 50 ms steps, docs/benchmarks.md). The time
        counts the trainer steps before the step is asked for, up to one a read
        thread: each thread still reads a step in the steps it covers."""
        spare = self.measures.spare(min(ahead, self.fetchers))
        return time.perf_counter() + spare / 2 if spare > 0 else None

    def _step_bytes(self, step: int) -> int:
        """Bytes a prepared step holds on this host (its rows' arrays)."""
        return self._rows(step) * self._row_bytes

    def depth(self, step: int, grow: bool = False) -> int:
        """Steps to keep in flight after ``step``: ``prefetch``, or moved toward
        what the measurements ask for, within the budget and the trial's cap;
        it grows only when ``grow`` (once per step handed out)."""
        if self.prefetch is not None:
            return self.prefetch
        size = self._sizes.get(step)  # in flight, usually
        if size is None:
            size = self._step_bytes(step)
        wanted = self.measures.depth(size, size * MAX_DEPTH)
        cap = min(MAX_DEPTH, self.budget // max(size, 1))
        with self._lock:
            if not grow:
                wanted = min(wanted, self._target)
            ceiling = self.measures.trial_cap()
            if ceiling is not None:
                cap = min(cap, ceiling)
            before = self._target
            self._target = next_depth(before, wanted, cap)
            if self._target > before:
                self.measures.grew(before, self._target, time.perf_counter())
            return self._target

    def _fetched(self, began: float, seconds: float) -> None:
        """Counts a read that ended now after ``seconds``. On an object store the
        first one, before any step was handed out, already moves the depth: at
        50 ms steps a 600 ms read needs the steps after the opening burst started
        before the trainer asks for the burst's first."""
        first = self.measures.fetch_ema is None
        self.measures.fetched(began, seconds)
        last = self._last
        if first and last is not None and self.measures.steps == 0 and self.remote:
            self._grow(last, self.depth(last + 1, grow=True), self._end)

    def _handed(
        self, step: int, wait: float, now: float, end: int | None, sources: np.ndarray
    ) -> None:
        """Counts ``step`` handed out at ``now`` after ``wait`` seconds, tops up
        the steps in flight and warns once of a stall. The depth grows from the
        second step handed out on: the steps started with the first are still
        being decoded, and new reads would take the interpreter from them."""
        grow = self.measures.steps > 0
        self._grow(step, self.depth(step + 1, grow=grow), end, paced=True)
        rows = np.bincount(sources[sources >= 0], minlength=self._source_rows.size)
        with self._lock:
            self._tokens += sources.size * self._seq_len
            self._source_rows += rows
        if self.measures.window_starts():
            self._throttled_window = throttled_requests()  # a stall window begins
        window = self.measures.taken(wait, now)
        if window is not None:
            log.warning(self._stall(step, window))

    def _bytes_read(self) -> int:
        return sum(ft.bytes_read + ft.probe_bytes for ft in self._splits)

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

    def stats(self) -> dict[str, Any]:
        with self._lock:
            tokens, rows = self._tokens, self._source_rows.tolist()
            depth = len(self._futures)
        return {
            **self.measures.stats(),
            "depth": depth,
            "depth_target": self._target,
            "depth_ceiling": self.measures.ceiling or 0,
            "read_ahead_bytes_peak": self.peak_bytes,
            "read_ahead_bytes": self.budget,
            "requests": sum(remote_reads().values()) - self._requests_before,
            "throttled_requests": throttled_requests() - self._throttled_before,
            "bytes_read": self._bytes_read() - self._bytes_before,
            "tokens": tokens,
            "source_tokens": {
                name: n * self._seq_len for name, n in zip(self._source_names, rows, strict=True)
            },
        }
