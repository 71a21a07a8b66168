"""Buffers for per-batch arrays, reused once nothing references them.

A batch allocates a few arrays of megabytes (the encoded windows, the five
fields). Freed and allocated again each step, their pages go back to the
system and are faulted in again: measured ~1,000 page faults and ~1.2 ms of
system time a 256 x 2048 batch, more than the decode itself, and worse with
several threads (each fault and unmap takes the process's memory-map lock).
A :class:`Buffers` keeps them mapped instead.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import numpy as np


class Buffers:
    """Recycles allocations that nothing references any more.

    The pool keeps each buffer's memory and hands out an array over it that
    only a weak reference follows. Every array made from what was handed out
    (a view, a slice, a ``jax.Array`` that uses it in place on the CPU
    backend) keeps that array alive through ``.base``, so the memory is handed
    out again only once all of them are gone, and reuse never changes data a
    caller still holds. Thread-safe.

    Args:
        keep: buffers kept, the most recently made; older ones are left to
            the garbage collector.
    """

    def __init__(self, keep: int = 8) -> None:
        self.keep = keep
        # Each buffer's memory, and a weak reference to the array handed out over it.
        self._buffers: list[tuple[np.ndarray, weakref.ref[np.ndarray]]] = []
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {"keep": self.keep}  # a copy starts empty

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["keep"])  # type: ignore[misc]

    def take(self, nbytes: int) -> np.ndarray:
        """A ``[nbytes] uint8`` buffer, uninitialised: a free one of that size or a new one."""
        with self._lock:
            for i, (memory, handed) in enumerate(self._buffers):
                if memory.nbytes == nbytes and handed() is None:
                    out = _over(memory)
                    self._buffers[i] = (memory, weakref.ref(out))
                    return out
            memory = np.empty(nbytes, np.uint8)
            out = _over(memory)
            self._buffers.append((memory, weakref.ref(out)))
            if len(self._buffers) > self.keep:
                self._buffers.pop(0)
            return out

    def array(self, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        """An uninitialised C-contiguous array of ``shape`` and ``dtype`` from the pool."""
        dt = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        return self.take(nbytes).view(dt).reshape(shape)


def _over(memory: np.ndarray) -> np.ndarray:
    """A new ``[n] uint8`` array over ``memory`` that every array made from it keeps alive.

    Numpy sets a view's ``.base`` to the array that owns the memory, skipping
    the views in between, so views of a plain view of ``memory`` would not
    keep that view alive; the skipping stops at a base that is not an array,
    here the memoryview ``memory.data``.
    """
    return np.frombuffer(memory.data, np.uint8)
