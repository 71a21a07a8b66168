"""Steps prepared ahead, in order, by two background threads.

A step is made in two stages: ``fetch`` finds its records and reads their
encoded tokens, ``finish`` decodes them and places them on the devices. One
thread runs each stage, step after step, so the next step's read runs beside
this step's decode while the caller trains; on an object store, where a fetch
mostly waits for round trips, the fetches of all the steps in flight run at
once on threads of their own, so their round trips overlap. The stages overlap on separate
cores where their heavy work runs outside the interpreter lock: the compiled
kernels' copy and decode (the ``fast`` extra) never hold it. With numpy they
hold it between their large passes, and the two stages overlap less (measured
on two cores: still no slower than both stages on one thread).
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import Generic, TypeVar

Fetched = TypeVar("Fetched")
Done = TypeVar("Done")


class Ahead(Generic[Fetched, Done]):
    """Runs ``finish(fetch(step))`` for submitted steps in submission order:
    ``fetch`` on ``fetchers`` background threads, ``finish`` on another.

    Args:
        fetch: the first stage of a step; thread-safe when ``fetchers > 1``.
        finish: the second stage, given the first's result; steps finish in
            the order they were submitted, whatever order their fetches end in.
        name: the threads' name prefix.
        fetchers: fetches run at once. 1 where a fetch is CPU work (a copy out
            of local shards); more where it mostly waits for round trips (an
            object store), so the round trips of the steps in flight overlap.
    """

    def __init__(
        self,
        fetch: Callable[[int], Fetched],
        finish: Callable[[Fetched], Done],
        name: str,
        fetchers: int = 1,
    ) -> None:
        if isinstance(fetchers, bool) or not isinstance(fetchers, int) or fetchers < 1:
            raise ValueError(f"Ahead.fetchers must be an int >= 1, got {fetchers!r}")
        self.fetch, self.finish = fetch, finish
        self._fetching = concurrent.futures.ThreadPoolExecutor(
            fetchers, thread_name_prefix=f"{name}-read"
        )
        self._finishing = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=name)

    def submit(self, step: int) -> concurrent.futures.Future[Done]:
        """Starts ``step``; the future's result is ``finish(fetch(step))`` (or its
        error). Cancelling it before it starts cancels the fetch too, if that
        has not started either."""
        fetched = self._fetching.submit(self.fetch, step)
        finished = self._finishing.submit(self._finish, fetched)
        finished.add_done_callback(lambda f: f.cancelled() and fetched.cancel())
        return finished

    def _finish(self, fetched: concurrent.futures.Future[Fetched]) -> Done:
        return self.finish(fetched.result())

    def close(self) -> None:
        """Drops steps not started and waits for those running."""
        self._finishing.shutdown(wait=False, cancel_futures=True)
        self._fetching.shutdown(wait=True, cancel_futures=True)
        self._finishing.shutdown(wait=True)
