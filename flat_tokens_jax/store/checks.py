"""Integrity checks of an array's shards or chunks among concurrent reads: each
item checked once, by whichever read waits for it first, so a read that starts
a check and never waits for it (an error elsewhere in its step) holds no other
read up.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

import numpy as np

R = TypeVar("R")


class Once(Generic[R]):
    """A call run once, by whichever thread asks for its result first; the
    others wait for that run and get its result or its error."""

    def __init__(self, call: Callable[[], R]) -> None:
        self._call: Callable[[], R] | None = call
        self._lock = threading.Lock()
        self._out: R | None = None
        self._error: BaseException | None = None

    def result(self) -> R:
        with self._lock:
            if self._call is not None:
                call, self._call = self._call, None
                try:
                    self._out = call()
                except BaseException as e:
                    self._error = e
        if self._error is not None:
            raise self._error
        return self._out  # type: ignore[return-value]


class Checks(Generic[R]):
    """Which of an array's ``count`` items (shards, chunks) this process has
    checked, and the checks in flight. Thread-safe."""

    def __init__(self, count: int) -> None:
        self.checked = np.zeros(count, bool)
        self._lock = threading.Lock()
        self._claimed: dict[int, Once[R]] = {}

    def start(
        self,
        items: np.ndarray,
        begin: Callable[[np.ndarray], Callable[[], R]],
    ) -> Callable[[], R | None]:
        """Claims the ``items`` (``[k] int64``: what a read touches) that no read has
        checked or claimed, and starts their checks with ``begin``: given the
        claimed items (sorted, unique), it starts reading them (only that: it runs
        under the claiming lock) and returns the call that waits and checks them,
        raising the error naming a bad item. Returns the call that waits for every
        check of ``items`` (beginning again those another read's check left
        unchecked), giving ``begin``'s call's result (``None``: none claimed).
        """
        todo = np.unique(items)
        if self.checked[todo].all():
            return lambda: None
        with self._lock:  # checked again here: a check may have ended since
            todo = todo[~self.checked[todo]]
            busy = np.array([i in self._claimed for i in todo.tolist()], bool)
            claims = [self._claimed[i] for i in todo[busy].tolist()]
            theirs = list({id(c): c for c in claims}.values())
            mine = todo[~busy]
            once: Once[R] | None = None
            if mine.size:
                once = Once(self._run(mine, begin(mine)))
                for i in mine.tolist():
                    self._claimed[i] = once
        others = todo[busy]

        def wait() -> R | None:
            out = None if once is None else once.result()
            for check in theirs:
                with contextlib.suppress(Exception):  # left unchecked: checked again below
                    check.result()
            failed = others[~self.checked[others]]
            if failed.size:
                begin(failed)()
                self.checked[failed] = True
            return out

        return wait

    def _run(self, mine: np.ndarray, waiting: Callable[[], R]) -> Callable[[], R]:
        def run() -> R:
            try:
                out = waiting()
                self.checked[mine] = True
                return out
            finally:
                with self._lock:
                    for i in mine.tolist():
                        del self._claimed[i]

        return run
