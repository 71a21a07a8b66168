"""Steps prepared ahead, in order, by one background thread.

A step is made in two stages: ``fetch`` finds its records and reads their
encoded tokens, ``finish`` decodes them and places them on the devices. Both
run in one thread, step after step, while the caller trains. Two steps in
flight at once in separate threads measured slower on two cores than one at a
time: most of a step holds the interpreter lock in short stretches (a copy
per row, small numpy calls between the decode's large passes), and two
threads handing the lock back and forth at each stretch cost more than the
large passes gain from running side by side.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import Generic, TypeVar

Fetched = TypeVar("Fetched")
Done = TypeVar("Done")


class Ahead(Generic[Fetched, Done]):
    """Runs ``finish(fetch(step))`` for submitted steps, one at a time, in
    submission order, on one background thread.

    Args:
        fetch: the first stage of a step.
        finish: the second stage, given the first's result.
        name: the thread's name prefix.
    """

    def __init__(
        self, fetch: Callable[[int], Fetched], finish: Callable[[Fetched], Done], name: str
    ) -> None:
        self.fetch, self.finish = fetch, finish
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=name)

    def submit(self, step: int) -> concurrent.futures.Future[Done]:
        """Starts ``step``; the future's result is ``finish(fetch(step))`` (or its error)."""
        return self._pool.submit(self._run, step)

    def _run(self, step: int) -> Done:
        return self.finish(self.fetch(step))

    def close(self) -> None:
        """Drops steps not started and waits for the one running."""
        self._pool.shutdown(wait=True, cancel_futures=True)
