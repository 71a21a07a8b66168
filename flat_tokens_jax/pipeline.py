"""Steps prepared ahead, in order, by two background threads.

A step is made in two stages: ``fetch`` finds its records and reads their
encoded tokens, ``finish`` decodes them and places them on the devices. One
thread runs each stage, step after step, so the next step's read runs beside
this step's decode while the caller trains. The stages overlap on separate
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
    ``fetch`` on one background thread, ``finish`` on another.

    Args:
        fetch: the first stage of a step.
        finish: the second stage, given the first's result.
        name: the threads' name prefix.
    """

    def __init__(
        self, fetch: Callable[[int], Fetched], finish: Callable[[Fetched], Done], name: str
    ) -> None:
        self.fetch, self.finish = fetch, finish
        self._fetching = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"{name}-read")
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
