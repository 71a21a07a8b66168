"""flat_tokens_jax.loader.prefetch: steps come back in order, each
``finish(step, read(step)())``; the next step's read runs beside this step's
finish; errors and dropped steps reach the right step; close drops what has
not started; the first step of a burst starts its reads before the others
start theirs."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from flat_tokens_jax.loader.config import LoaderConfig
from flat_tokens_jax.loader.prefetch import Prefetcher


@dataclasses.dataclass(frozen=True)
class Part:
    """A step's first stage: a value, and its one row's source."""

    value: int
    sources: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(1, np.int32))


Read = Callable[[int, bool], Callable[[], Part]]


def whole(fetch: Callable[[int], int]) -> Read:
    """A read that does all of ``fetch`` when it starts."""

    def read(step: int, ahead: bool) -> Callable[[], Part]:
        part = Part(fetch(step))
        return lambda: part

    return read


def prefetcher(
    read: Read,
    finish: Callable[[Part], Any] = lambda part: part.value,
    prefetch: int = 2,
    fetchers: int | None = None,
) -> Prefetcher[Part, Any]:
    """A prefetcher of one-row steps (no splits: local disk), threads named ``t``."""
    config = LoaderConfig(batch_size=1, seq_len=1, prefetch=prefetch)
    return Prefetcher(
        config,
        read,
        lambda step, part, ahead: finish(part),
        rows=lambda s: 1,
        name="t",
        fetchers=fetchers,
    )


def took(p: Prefetcher[Part, Any], step: int, end: int | None) -> Any:
    """``p.take(step, end)`` on a thread of its own, failing the test if it has
    not returned within 20 s (a read that waits forever does not hang it)."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = p.take(step, end)
        except BaseException as e:  # handed to the test's thread
            out["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(20)
    assert not thread.is_alive(), f"take({step}) did not return"
    if "error" in out:
        raise out["error"]
    return out["value"]


def blocked_reads() -> tuple[Read, threading.Event, list[int]]:
    """A read that records its step and waits for ``release``."""
    release = threading.Event()
    fetched: list[int] = []

    def fetch(step: int) -> int:
        fetched.append(step)
        release.wait(timeout=10)
        return step

    return whole(fetch), release, fetched


def test_steps_come_back_in_order_from_two_threads() -> None:
    threads: dict[str, set[str]] = {"read": set(), "finish": set()}
    ahead: set[bool] = set()

    def read(step: int, behind: bool) -> Callable[[], Part]:
        threads["read"].add(threading.current_thread().name)
        ahead.add(behind)
        return lambda: Part(step * 10)

    def finish(part: Part) -> int:
        threads["finish"].add(threading.current_thread().name)
        return part.value + 1

    p = prefetcher(read, finish, prefetch=49)
    p.start(0, 50)
    assert p.steps() == list(range(50))
    assert [took(p, s, 50) for s in range(50)] == [s * 10 + 1 for s in range(50)]
    p.close()
    assert len(threads["read"]) == len(threads["finish"]) == 1
    assert threads["read"] != threads["finish"]
    assert ahead == {True}  # all read on the read-ahead's threads


def test_the_next_read_runs_beside_this_finish() -> None:
    # finish(0) returns only once read(1) has started: one thread for both
    # stages would never get there.
    reading_1 = threading.Event()

    def fetch(step: int) -> int:
        if step == 1:
            reading_1.set()
        return step

    def finish(part: Part) -> int:
        if part.value == 0 and not reading_1.wait(timeout=10):
            raise AssertionError("read(1) did not start while finish(0) ran")
        return part.value

    p = prefetcher(whole(fetch), finish, prefetch=1)
    p.start(0, 2)
    assert [took(p, s, 2) for s in range(2)] == [0, 1]
    p.close()


def test_an_error_reaches_its_step_only() -> None:
    def fetch(step: int) -> int:
        if step == 1:
            raise ValueError("bad record at step 1")
        return step

    p = prefetcher(whole(fetch))
    p.start(0, 3)
    assert took(p, 0, 3) == 0
    with pytest.raises(ValueError, match="step 1"):
        took(p, 1, 3)
    assert took(p, 2, 3) == 2
    p.close()


def test_dropping_a_step_cancels_its_read_and_taking_it_reads_it_again() -> None:
    read, release, fetched = blocked_reads()
    p = prefetcher(read, prefetch=1)
    p.start(0, 2)
    p.drop_from(1)  # step 0's read is under way, step 1's waits for it
    assert p.steps() == [0]
    release.set()
    assert took(p, 0, 1) == 0  # nothing read at or past the end: step 1 is not read again
    assert fetched == [0] and p.steps() == []
    assert took(p, 1, 2) == 1
    p.close()
    assert fetched == [0, 1]


def test_a_jump_drops_the_steps_in_flight_and_reads_its_step_here() -> None:
    caller: list[tuple[int, bool, str]] = []

    def read(step: int, ahead: bool) -> Callable[[], Part]:
        caller.append((step, ahead, threading.current_thread().name))
        return lambda: Part(step)

    p = prefetcher(read, prefetch=2)
    p.start(0, None)
    assert took(p, 0, None) == 0 and p.steps() == [1, 2]
    assert p.take(7, None, ahead=False) == 7
    assert p.steps() == []
    p.close()
    assert caller[-1] == (7, False, threading.current_thread().name)
    assert all(ahead and name.startswith("t-read") for _, ahead, name in caller[:-1])


def test_close_drops_steps_not_started() -> None:
    read, release, fetched = blocked_reads()
    p = prefetcher(read, prefetch=3)
    p.start(0, 4)
    assert p.steps() == [0, 1, 2, 3]
    threading.Timer(0.2, release.set).start()
    p.close()
    assert fetched == [0] and p.steps() == []


def test_close_without_waiting_returns_while_a_read_still_runs() -> None:
    """What a garbage-collected grain iterator does: a finalizer must not join
    threads (one can run inside threading's own bookkeeping and deadlock)."""
    release, began, ended = threading.Event(), threading.Event(), threading.Event()
    fetched: list[int] = []

    def fetch(step: int) -> int:
        fetched.append(step)
        began.set()
        release.wait(timeout=10)
        ended.set()
        return step

    p = prefetcher(whole(fetch), prefetch=3)
    p.start(0, 4)
    assert began.wait(timeout=60)
    p.close(wait=False)
    assert not ended.is_set()  # returned with step 0's read still running
    assert p.steps() == []
    release.set()
    assert ended.wait(timeout=60)
    assert fetched == [0]  # the steps not started were dropped


@pytest.mark.parametrize("fetchers", [1, 2, 4])
def test_reads_of_steps_in_flight_overlap_and_finish_in_order(fetchers: int) -> None:
    """With ``fetchers`` threads, that many reads wait at once (a barrier of
    that many parties passes only if they do); later reads that end first
    still finish after the earlier steps, in step order."""
    barrier = threading.Barrier(fetchers, timeout=10)
    finished: list[int] = []

    def read(step: int, ahead: bool) -> Callable[[], Part]:
        def waiting() -> Part:
            if step < fetchers:
                barrier.wait()  # the first `fetchers` reads all in flight at once
            return Part(step)

        return waiting

    def finish(part: Part) -> int:
        finished.append(part.value)
        return part.value * 2

    n = 3 * fetchers
    p = prefetcher(read, finish, prefetch=n - 1, fetchers=fetchers)
    p.start(0, n)
    assert [took(p, s, n) for s in range(n)] == [2 * s for s in range(n)]
    p.close()
    assert finished == list(range(n))


def test_on_local_disk_one_read_runs_at_a_time() -> None:
    """No splits off local disk: one read thread, so two reads never wait at
    once (the barrier breaks)."""
    barrier = threading.Barrier(2, timeout=0.5)

    def read(step: int, ahead: bool) -> Callable[[], Part]:
        return lambda: Part(barrier.wait())

    p = prefetcher(read, prefetch=1)
    assert p.fetchers == 1
    p.start(0, 2)
    with pytest.raises(threading.BrokenBarrierError):
        took(p, 0, 2)
    p.close()


def test_the_reads_after_a_lead_start_once_it_has_started_its_own() -> None:
    """The lead's read waits up to a second for another read to begin, and sees
    none (four fetchers: without the order, the others begin at once); its
    wait then lasts until another read has begun, which it does (the others
    do not wait for the lead's reads to end)."""
    other_began = threading.Event()
    seen: list[bool] = []

    def read(step: int, ahead: bool) -> Callable[[], Part]:
        if step == 0:
            seen.append(other_began.wait(1.0))
            return lambda: Part(step if other_began.wait(10) else -1)
        other_began.set()
        return lambda: Part(step)

    p = prefetcher(read, prefetch=3, fetchers=4)
    p.start(0, 4)  # step 0 leads the burst
    assert [took(p, s, 4) for s in range(4)] == [0, 1, 2, 3]
    p.close()
    assert seen == [False]


def test_the_reads_after_a_lead_run_when_its_read_fails() -> None:
    def read(step: int, ahead: bool) -> Callable[[], Part]:
        if step == 0:
            raise ValueError("the lead's own error")
        return lambda: Part(step)

    p = prefetcher(read, prefetch=3, fetchers=2)
    p.start(0, 4)
    with pytest.raises(ValueError, match="the lead's own error"):
        took(p, 0, 4)
    assert [took(p, s, 4) for s in range(1, 4)] == [1, 2, 3]
    p.close()


def test_the_reads_after_a_lead_dropped_unstarted_run() -> None:
    """One read thread, busy with step 0 (started, then left by a jump to step 1)
    while the lead (step 1) is dropped unstarted by taking step 2: step 2,
    started after the lead, still runs."""
    read, release, fetched = blocked_reads()
    p = prefetcher(read, prefetch=1)
    p.start(0, 1)
    p.start(1, 3)  # step 1 leads, step 2 after it; step 0's read still runs
    assert p.steps() == [1, 2]
    taking = threading.Thread(target=lambda: out.append(took(p, 2, 3)), daemon=True)
    out: list[int] = []
    taking.start()
    deadline = time.monotonic() + 20
    while p.steps() and time.monotonic() < deadline:  # take(2) dropped step 1
        time.sleep(0.01)
    assert p.steps() == []
    release.set()
    taking.join(30)
    assert out == [2]
    p.close()
    assert fetched == [0, 2]


def test_a_slow_trainers_top_up_waits_until_its_step_is_asked_for_or_dropped() -> None:
    """The read a hand-out tops up starts after half the time the trainer's
    measured step leaves spare (not while the caller returns to the trainer);
    the caller asking for its step starts it at once on its read thread, and a
    close ends it unread."""
    started: list[int] = []
    here: list[int] = []  # steps finished in the caller's thread (no threads given)

    def finish(step: int, part: Part, threads: int | None) -> int:
        if threads is None:
            here.append(step)
        return part.value

    config = LoaderConfig(batch_size=1, seq_len=1, prefetch=2)
    read = whole(lambda s: started.append(s) or s)
    p: Prefetcher[Part, int] = Prefetcher(config, read, finish, rows=lambda s: 1, name="t")
    assert took(p, 0, None) == 0
    assert took(p, 1, None) == 1  # fetch and finish measured, steps 2 and 3 read
    p.measures.interval_ema = 1000.0  # a trainer step of 1,000 s
    assert took(p, 2, None) == 2  # tops up step 4: it waits about 500 s
    assert 4 in p.steps()
    time.sleep(1.0)
    assert 4 not in started
    assert took(p, 3, None) == 3  # its read was done before: step 5 waits too
    assert took(p, 4, None) == 4  # asked for: its read starts now
    assert 4 in started and 5 not in started and 6 in p.steps()
    assert here == []  # every step was read and finished on the threads
    closing = threading.Thread(target=p.close)
    closing.start()
    closing.join(20)
    assert not closing.is_alive(), "close waited for the paced reads"
    assert 5 not in started and 6 not in started


def test_a_top_up_steps_ahead_waits_for_what_those_steps_leave_spare() -> None:
    """With reads that run at once, a step topped up two steps ahead of a fast
    trainer still waits: its fetch needs more than one trainer step, not more
    than the two before it is asked for. With one read thread it starts at once."""

    def run(fetchers: int) -> list[int]:
        started: list[int] = []
        read = whole(lambda s: started.append(s) or s)
        p = prefetcher(read, prefetch=2, fetchers=fetchers)
        assert took(p, 0, None) == 0
        assert took(p, 1, None) == 1  # steps 2 and 3 read
        p.measures.fetched(0.0, 100.0)  # the slowest recent fetch: 100 s
        p.measures.interval_ema = 100.0  # a trainer step of 100 s: nothing spare in one
        assert took(p, 2, None) == 2  # tops up step 4, two steps ahead
        deadline = time.monotonic() + 20
        while 4 not in started and time.monotonic() < deadline and fetchers == 1:
            time.sleep(0.01)
        time.sleep(0.5)
        p.close(wait=False)
        return started

    assert 4 not in run(fetchers=3)  # 200 s less 150 s needed: it waits about 25 s
    assert 4 in run(fetchers=1)  # one thread reads each step in one trainer step
