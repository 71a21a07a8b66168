"""``Buffers`` hands memory out again only once nothing made from it is alive."""

import gc
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flat_tokens_jax.core.buffers import Buffers

NBYTES = 4096


def address(held: Any) -> int:
    """Where ``held``'s data starts in memory."""
    if isinstance(held, jax.Array):
        return held.unsafe_buffer_pointer()
    return held.ctypes.data


def aligned(buf: np.ndarray) -> np.ndarray:
    """``[1024] int32`` of ``buf`` starting 64-byte aligned: jax uses such host
    memory in place on the CPU backend instead of copying it."""
    start = -buf.ctypes.data % 64
    return buf[start : start + 4096 - 64].view(np.int32)


HOLDERS: dict[str, Callable[[np.ndarray], Any]] = {
    "the array": lambda buf: buf,
    "a view": lambda buf: buf.view(np.int32),
    "a slice": lambda buf: buf[64:128],
    "a reshaped view of a slice": lambda buf: buf[64:].view(np.int32).reshape(-1, 4)[1:],
    "jax.device_put": lambda buf: jax.device_put(aligned(buf)),
    "jnp.asarray": lambda buf: jnp.asarray(aligned(buf)),
}
# Made without a copy on the CPU backend, so they hold the buffer itself.
IN_PLACE = {"the array", "a view", "a slice", "a reshaped view of a slice", "jax.device_put"}


@pytest.mark.parametrize("holder", HOLDERS)
def test_a_buffer_is_not_handed_out_while_anything_made_from_it_lives(holder: str) -> None:
    buffers = Buffers(keep=8)
    first = buffers.take(NBYTES)
    first[:] = 1
    memory = range(first.ctypes.data, first.ctypes.data + NBYTES)
    held = HOLDERS[holder](first)
    shares = address(held) in memory
    if holder in IN_PLACE:
        assert shares, f"{holder} copied: the test would hold nothing of the buffer"
    del first
    gc.collect()  # jax lets go of host memory it no longer uses at its next call or a collection

    for _ in range(3):
        again = buffers.take(NBYTES)
        assert (again.ctypes.data in memory) is not shares
        again[:] = 2
        del again
    assert (np.asarray(held).view(np.uint8) == 1).all(), "what the caller holds was written over"
    assert len(buffers._buffers) == (2 if shares else 1)  # allocations

    del held
    gc.collect()
    taken = [buffers.take(NBYTES), buffers.take(NBYTES)]
    assert len(buffers._buffers) == 2, "a free buffer was not reused"
    assert any(t.ctypes.data in memory for t in taken)


def test_a_buffer_is_reused_once_all_its_views_are_dropped() -> None:
    buffers = Buffers(keep=8)
    first = buffers.take(NBYTES)
    memory = first.ctypes.data
    view, part = first.view(np.int64), first[8:16]
    del first
    assert buffers.take(NBYTES).ctypes.data != memory
    del view
    assert buffers.take(NBYTES).ctypes.data != memory, "the slice still holds it"
    del part
    assert buffers.take(NBYTES).ctypes.data == memory
    assert len(buffers._buffers) == 2


def test_only_a_buffer_of_the_size_asked_for_is_reused() -> None:
    buffers = Buffers(keep=8)
    memory = buffers.take(NBYTES).ctypes.data
    assert buffers.take(2 * NBYTES).ctypes.data != memory
    assert buffers.take(NBYTES).ctypes.data == memory
    assert buffers.array((4, 8), np.int32).ctypes.data != memory  # 128 bytes
    assert buffers.array((32, 32), np.int32).ctypes.data == memory
    assert len(buffers._buffers) == 3


def test_the_pool_keeps_the_most_recent_buffers() -> None:
    buffers = Buffers(keep=2)
    held = [buffers.take(NBYTES) for _ in range(3)]
    kept = {b.ctypes.data for b in held[1:]}
    assert len(buffers._buffers) == 2
    del held
    again = [buffers.take(NBYTES) for _ in range(2)]
    assert {b.ctypes.data for b in again} == kept


def test_threads_never_share_a_buffer() -> None:
    buffers = Buffers(keep=4)
    clashes: list[int] = []

    def work(mark: int) -> None:
        for _ in range(300):
            buf = buffers.array((NBYTES // 8,), np.int64)
            buf[:] = mark
            time.sleep(0)  # the other threads take buffers while this one is held
            if not (buf == mark).all():
                clashes.append(mark)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert clashes == []
    assert len(buffers._buffers) <= 4
