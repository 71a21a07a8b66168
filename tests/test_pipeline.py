"""flat_tokens_jax.loader.pipeline: steps come back in order, each
``finish(request(step)())``; the next step's fetch runs beside this step's
finish; errors and cancellation reach the right step; the first step of a
burst starts its reads before the others start theirs."""

import concurrent.futures
import threading
from collections.abc import Callable
from typing import TypeVar

import pytest

from flat_tokens_jax.loader.pipeline import Ahead

T = TypeVar("T")


def whole(fetch: Callable[[int], T]) -> Callable[[int], Callable[[], T]]:
    """A request that does all of ``fetch`` when it starts."""

    def request(step: int) -> Callable[[], T]:
        out = fetch(step)
        return lambda: out

    return request


def test_steps_come_back_in_order_from_two_threads() -> None:
    threads: dict[str, set[str]] = {"fetch": set(), "finish": set()}

    def fetch(step: int) -> int:
        threads["fetch"].add(threading.current_thread().name)
        return step * 10

    def finish(fetched: int) -> int:
        threads["finish"].add(threading.current_thread().name)
        return fetched + 1

    ahead = Ahead(whole(fetch), finish, "t")
    futures = [ahead.submit(s) for s in range(50)]
    assert [f.result(timeout=10) for f in futures] == [s * 10 + 1 for s in range(50)]
    ahead.close()
    assert len(threads["fetch"]) == len(threads["finish"]) == 1
    assert threads["fetch"] != threads["finish"]


def test_the_next_fetch_runs_beside_this_finish() -> None:
    # finish(0) returns only once fetch(1) has started: one thread for both
    # stages would never get there.
    fetching_1 = threading.Event()

    def fetch(step: int) -> int:
        if step == 1:
            fetching_1.set()
        return step

    def finish(step: int) -> int:
        if step == 0 and not fetching_1.wait(timeout=10):
            raise AssertionError("fetch(1) did not start while finish(0) ran")
        return step

    ahead = Ahead(whole(fetch), finish, "t")
    futures = [ahead.submit(s) for s in range(2)]
    assert [f.result(timeout=20) for f in futures] == [0, 1]
    ahead.close()


def test_an_error_reaches_its_step_only() -> None:
    def fetch(step: int) -> int:
        if step == 1:
            raise ValueError("bad record at step 1")
        return step

    ahead = Ahead(whole(fetch), lambda x: x, "t")
    futures = [ahead.submit(s) for s in range(3)]
    assert futures[0].result(timeout=10) == 0
    with pytest.raises(ValueError, match="step 1"):
        futures[1].result(timeout=10)
    assert futures[2].result(timeout=10) == 2
    ahead.close()


def blocked_fetches() -> tuple[Callable[[int], int], threading.Event, list[int]]:
    """A fetch that records its step and waits for ``release``."""
    release = threading.Event()
    fetched: list[int] = []

    def fetch(step: int) -> int:
        fetched.append(step)
        release.wait(timeout=10)
        return step

    return fetch, release, fetched


def test_cancelling_a_step_cancels_its_fetch() -> None:
    fetch, release, fetched = blocked_fetches()
    ahead = Ahead(whole(fetch), lambda x: x, "t")
    first, second = ahead.submit(0), ahead.submit(1)
    assert second.cancel()
    release.set()
    assert first.result(timeout=10) == 0
    ahead.close()
    assert fetched == [0]
    with pytest.raises(concurrent.futures.CancelledError):
        second.result()


def test_close_drops_steps_not_started() -> None:
    fetch, release, fetched = blocked_fetches()
    ahead = Ahead(whole(fetch), lambda x: x, "t")
    futures = [ahead.submit(s) for s in range(4)]
    threading.Timer(0.2, release.set).start()
    ahead.close()
    assert fetched == [0]
    assert all(f.cancelled() for f in futures[1:])


def test_close_without_waiting_returns_while_a_fetch_still_runs() -> None:
    """What a garbage-collected grain iterator does: a finalizer must not join
    threads (one can run inside threading's own bookkeeping and deadlock)."""
    release, began, ended = threading.Event(), threading.Event(), threading.Event()

    def fetch(step: int) -> int:
        began.set()
        release.wait(timeout=10)
        ended.set()
        return step

    ahead = Ahead(whole(fetch), lambda x: x, "t")
    futures = [ahead.submit(s) for s in range(4)]
    assert began.wait(timeout=60)
    ahead.close(wait=False)
    assert not ended.is_set()  # returned with step 0's fetch still running
    assert all(f.cancelled() for f in futures[1:])
    release.set()
    assert ended.wait(timeout=60)


@pytest.mark.parametrize("fetchers", [1, 2, 4])
def test_fetches_of_steps_in_flight_overlap_and_finish_in_order(fetchers: int) -> None:
    """With ``fetchers`` threads, that many fetches wait at once (a barrier of
    that many parties passes only if they do); later fetches that end first
    still finish after the earlier steps, in submission order."""
    barrier = threading.Barrier(fetchers, timeout=10)
    finished: list[int] = []

    def fetch(step: int) -> int:
        if step < fetchers:
            barrier.wait()  # all of the first `fetchers` fetches in flight at once
        return step

    def finish(step: int) -> int:
        finished.append(step)
        return step * 2

    ahead = Ahead(whole(fetch), finish, "t", fetchers=fetchers)
    futures = [ahead.submit(s) for s in range(3 * fetchers)]
    assert [f.result(timeout=20) for f in futures] == [2 * s for s in range(3 * fetchers)]
    ahead.close()
    assert finished == list(range(3 * fetchers))


def test_one_fetcher_runs_one_fetch_at_a_time() -> None:
    barrier = threading.Barrier(2, timeout=0.5)
    ahead = Ahead(whole(lambda step: barrier.wait()), lambda x: x, "t")
    futures = [ahead.submit(s) for s in range(2)]
    with pytest.raises(threading.BrokenBarrierError):
        futures[0].result(timeout=10)
    ahead.close()


@pytest.mark.parametrize("fetchers", [0, -1, True, 1.5])
def test_fetchers_must_be_a_positive_int(fetchers: object) -> None:
    with pytest.raises(ValueError, match=r"Ahead\.fetchers must be an int >= 1"):
        Ahead(whole(lambda s: s), lambda x: x, "t", fetchers=fetchers)  # type: ignore[arg-type]


def test_the_fetches_after_a_lead_start_their_reads_once_it_has_started_its_own() -> None:
    """The lead's request waits up to a second for another request to begin,
    and sees none (four fetchers: without the order, the others begin at
    once); its reads then wait until another request has begun, which it
    does (the others do not wait for the lead's reads to end)."""
    other_began = threading.Event()
    seen: list[bool] = []

    def request(step: int) -> Callable[[], int]:
        if step == 0:
            seen.append(other_began.wait(1.0))
            return lambda: step if other_began.wait(10) else -1
        other_began.set()
        return lambda: step

    ahead = Ahead(request, lambda step: step, "t", fetchers=4)
    futures = [ahead.submit(0, lead=True), *(ahead.submit(s) for s in range(1, 4))]
    assert [f.result(timeout=20) for f in futures] == [0, 1, 2, 3]
    ahead.close()
    assert seen == [False]


def test_the_fetches_after_a_lead_run_when_its_request_fails() -> None:
    def request(step: int) -> Callable[[], int]:
        if step == 0:
            raise ValueError("the lead's own error")
        return lambda: step

    ahead = Ahead(request, lambda step: step, "t", fetchers=2)
    futures = [ahead.submit(0, lead=True), *(ahead.submit(s) for s in range(1, 4))]
    assert [f.result(timeout=20) for f in futures[1:]] == [1, 2, 3]
    with pytest.raises(ValueError, match="the lead's own error"):
        futures[0].result()
    ahead.close()


def test_the_fetches_after_a_lead_cancelled_unstarted_run() -> None:
    """One fetcher, busy with step 0 while the lead (step 1) is cancelled:
    step 2, submitted after the lead, still runs."""
    fetch, release, fetched = blocked_fetches()
    ahead = Ahead(whole(fetch), lambda x: x, "t")
    first, lead, after = ahead.submit(0), ahead.submit(1, lead=True), ahead.submit(2)
    assert lead.cancel()
    release.set()
    assert (first.result(timeout=10), after.result(timeout=10)) == (0, 2)
    ahead.close()
    assert fetched == [0, 2]
