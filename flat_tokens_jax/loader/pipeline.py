"""Steps prepared ahead, in order, on background threads.

A step is made in two stages: the fetch finds its records and reads their
encoded tokens, ``finish`` decodes them and places them on the devices. One
thread runs each stage, step after step, so the next step's read runs beside
this step's decode while the caller trains; on an object store, where a fetch
mostly waits for round trips, the fetches of all the steps in flight run at
once on threads of their own, so their round trips overlap. The first step of
a burst (the step a caller waits for, with nothing in flight) asks for its
reads first: the fetches after it start their reads once it has started its
own, so that its requests are not queued behind theirs, and its round trips
still overlap theirs. The stages overlap on separate
cores where their heavy work runs outside the interpreter lock: the compiled
kernels' copy and decode (the ``fast`` extra) never hold it. With numpy they
hold it between their large passes, and the two stages overlap less (measured
on two cores: still no slower than both stages on one thread).

:class:`InFlight` keeps the steps read ahead of a caller that takes them by
step number; ``Loader.iterate`` and ``Loader.batch`` share one.
"""

from __future__ import annotations

import concurrent.futures
import sys
import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from flat_tokens_jax.core.values import integer

Fetched = TypeVar("Fetched")
Done = TypeVar("Done")


class Ahead(Generic[Fetched, Done]):
    """Runs ``finish(request(step)())`` for submitted steps in submission
    order: the fetch (``request``, then waiting for what it started) on
    ``fetchers`` background threads, ``finish`` on another.

    Args:
        request: starts the first stage of a step and returns a function
            that waits for it and gives its result; thread-safe when
            ``fetchers > 1``.
        finish: the second stage, given the first's result; steps finish in
            the order they were submitted, whatever order their fetches end in.
        name: the threads' name prefix.
        fetchers: fetches run at once, at most. 1 where a fetch is CPU work (a
            copy out of local shards); more where it mostly waits for round
            trips (an object store), so the round trips of the steps in flight
            overlap. Threads start as fetches wait for one, so a pool with
            room for many runs as many fetches as steps are in flight.
    """

    def __init__(
        self,
        request: Callable[[int], Callable[[], Fetched]],
        finish: Callable[[Fetched], Done],
        name: str,
        fetchers: int = 1,
    ) -> None:
        fetchers = integer(fetchers, "Ahead.fetchers", low=1)
        self.request, self.finish = request, finish
        self._fetching = concurrent.futures.ThreadPoolExecutor(
            fetchers, thread_name_prefix=f"{name}-read"
        )
        self._finishing = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=name)
        self._lead: threading.Event | None = None

    def submit(self, step: int, lead: bool = False) -> concurrent.futures.Future[Done]:
        """Starts ``step``; the future's result is ``finish(request(step)())``
        (or its error). Cancelling it before it starts cancels the fetch too,
        if that has not started either.

        ``lead``: ``step`` is the first of a burst (the step a caller waits
        for, with nothing in flight): the fetches submitted after it call
        ``request`` once its ``request`` has returned (its reads started),
        so that its reads are not queued behind theirs (a cold start on an
        object store waited for the whole burst)."""
        issued = threading.Event()
        after = None if lead else self._lead
        if lead:
            self._lead = issued
        fetched = self._fetching.submit(self._fetch, step, after, issued)
        fetched.add_done_callback(lambda _: issued.set())  # also when cancelled unstarted
        finished = self._finishing.submit(self._finish, fetched)
        finished.add_done_callback(lambda f: f.cancelled() and fetched.cancel())
        return finished

    def _fetch(self, step: int, after: threading.Event | None, issued: threading.Event) -> Fetched:
        if after is not None:
            after.wait()
        try:
            waiting = self.request(step)
        finally:
            issued.set()
        return waiting()

    def _finish(self, fetched: concurrent.futures.Future[Fetched]) -> Done:
        return self.finish(fetched.result())

    def close(self, wait: bool = True, _finalizing: Callable[[], bool] = sys.is_finalizing) -> None:
        """Drops steps not started and waits for those running (``wait=False``:
        lets them end on their own; not while the interpreter exits: a generator
        left open is closed then, and its threads end with the process)."""
        if _finalizing():  # bound at definition: exiting clears module globals
            return
        self._finishing.shutdown(wait=False, cancel_futures=True)
        self._fetching.shutdown(wait=wait, cancel_futures=True)
        self._finishing.shutdown(wait=wait)


class InFlight(Generic[Done]):
    """Steps started ahead, by step number, for a caller that takes them one
    by one. Thread-safe.

    Taking a step that is in flight, or the step after the one taken last,
    reads ahead: the step itself and up to ``depth`` steps after it are kept
    in flight. Taking any other step drops what was started (the caller reads
    that step itself). A step once started is never dropped for a smaller
    depth; the depth only stops the topping up.

    Args:
        make: builds the :class:`Ahead` that prepares the steps (when first needed).
        bytes_of: bytes a step holds once prepared, for the memory budget.
    """

    def __init__(self, make: Callable[[], Ahead[Any, Done]], bytes_of: Callable[[int], int]):
        self._make, self._bytes_of = make, bytes_of
        self._ahead: Ahead[Any, Done] | None = None
        self._futures: dict[int, concurrent.futures.Future[Done]] = {}
        self._last: int | None = None
        self._reading = False
        self._lock = threading.Lock()
        self.peak_bytes = 0

    def steps(self) -> list[int]:
        """The steps in flight (started, not taken), ascending."""
        with self._lock:
            return sorted(self._futures)

    def take(
        self, step: int, *, ahead: bool, depth: int, end: int | None, budget: int | None
    ) -> concurrent.futures.Future[Done] | None:
        """The future of ``step`` (``None``: not started; read it yourself).

        The steps after it are topped up here when ``step`` is not ready yet;
        when it is, the caller tops them up with :meth:`grow` (off the path
        that hands a ready step out).

        Args:
            step: the step the caller takes now.
            ahead: read ahead even if ``step`` is neither in flight nor the
                step after the last one taken.
            depth: steps after ``step`` to keep in flight (0: none).
            end: the first step that does not exist (``None``: no end).
            budget: bytes the steps after ``step`` may hold (at least one
                step is read ahead whatever its size); ``None``: no bound.
        """
        with self._lock:
            future = self._futures.pop(step, None)
            follows = self._last is not None and step == self._last + 1
            self._last = step
            self._reading = depth > 0 and (ahead or future is not None or follows)
            for other in [s for s in self._futures if future is None or s < step]:
                self._futures.pop(other).cancel()
            if not self._reading:
                return future
            if future is None:
                future = self._submit(step, lead=True)
            if not future.done():  # the caller waits anyway: top up now
                self._top_up(step, depth, end, budget)
            return future

    def grow(self, step: int, depth: int, end: int | None, budget: int | None) -> None:
        """Tops up to ``depth`` steps after ``step`` when ``step`` was the last
        taken and read ahead (after new measurements raised the depth)."""
        with self._lock:
            if self._reading and self._last == step:
                self._top_up(step, depth, end, budget)

    def start(self, step: int, depth: int, end: int | None, budget: int | None) -> None:
        """Starts ``step`` and up to ``depth`` steps after it, so that taking
        ``step`` next uses them; keeps them if ``step`` is in flight already."""
        with self._lock:
            if step not in self._futures:
                for other in list(self._futures):
                    self._futures.pop(other).cancel()
                self._futures[step] = self._submit(step, lead=True)
            self._last, self._reading = step - 1, True
            self._top_up(step, depth, end, budget)

    def drop_from(self, step: int) -> None:
        """Drops the steps in flight at or after ``step`` (a result under way
        is never handed out); the next take reads them again."""
        with self._lock:
            for other in [s for s in self._futures if s >= step]:
                self._futures.pop(other).cancel()

    def _submit(self, step: int, lead: bool = False) -> concurrent.futures.Future[Done]:
        if self._ahead is None:
            self._ahead = self._make()
        return self._ahead.submit(step, lead)

    def _top_up(self, step: int, depth: int, end: int | None, budget: int | None) -> None:
        after = [s for s in self._futures if s > step]
        held = sum(map(self._bytes_of, after))
        nxt = step + 1
        while len(after) < depth and (end is None or nxt < end):
            if nxt not in self._futures:
                size = self._bytes_of(nxt)
                if budget is not None and after and held + size > budget:
                    break
                self._futures[nxt] = self._submit(nxt)
                after.append(nxt)
                held += size
            nxt += 1
        self.peak_bytes = max(self.peak_bytes, sum(map(self._bytes_of, self._futures)))

    def close(self, wait: bool = True) -> None:
        """Drops the steps not started, waits for those running (``wait=False``:
        lets them end on their own), and stops the threads (a later step starts
        new ones)."""
        with self._lock:
            for future in self._futures.values():
                future.cancel()
            self._futures.clear()
            self._last, self._reading = None, False
            ahead, self._ahead = self._ahead, None
        if ahead is not None:
            ahead.close(wait)
