"""Buffers for per-batch arrays, reused once nothing references them.

A batch allocates a few arrays of megabytes (the encoded windows, the five
fields). Freed and allocated again each step, their pages go back to the
system and are faulted in again: measured ~1,000 page faults and ~1.2 ms of
system time a 256 x 2048 batch, more than the decode itself, and worse with
several threads (each fault and unmap takes the process's memory-map lock).
A :class:`Buffers` keeps them mapped instead.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

import numpy as np


class Buffers:
    """Recycles allocations that nothing references any more.

    A buffer is handed out again only when the pool holds its one reference:
    every array made from it (a view, or a ``jax.Array`` that uses it in place
    on the CPU backend) keeps it busy, so reuse never changes data a caller
    still holds. Thread-safe.

    Args:
        keep: buffers kept, the most recently made; older ones are left to
            the garbage collector.
    """

    def __init__(self, keep: int = 8) -> None:
        self.keep = keep
        self._buffers: list[np.ndarray] = []
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {"keep": self.keep}  # a copy starts empty

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["keep"])  # type: ignore[misc]

    def take(self, nbytes: int) -> np.ndarray:
        """A ``[nbytes] uint8`` buffer, uninitialised: a free one of that size or a new one."""
        with self._lock:
            for buf in self._buffers:
                # References: the list, `buf`, and getrefcount's argument.
                if buf.nbytes == nbytes and sys.getrefcount(buf) == 3:
                    return buf
            buf = np.empty(nbytes, np.uint8)
            self._buffers.append(buf)
            if len(self._buffers) > self.keep:
                self._buffers.pop(0)
            return buf

    def array(self, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        """An uninitialised C-contiguous array of ``shape`` and ``dtype`` from the pool."""
        dt = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        return self.take(nbytes).view(dt).reshape(shape)
