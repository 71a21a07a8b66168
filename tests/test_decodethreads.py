"""Decode threads from measured finish times: the policy with hypothetical
timings (no store), the read-ahead's use of it, and ``decode_threads`` pinning
it; the warm-up before a read is timed."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from memurls import memory_url

import flat_tokens_jax as ftj
from flat_tokens_jax.loader import prefetch
from flat_tokens_jax.loader.config import LoaderConfig
from flat_tokens_jax.loader.decodethreads import THREAD_RETRY, THREAD_WINDOW, DecodeThreads
from flat_tokens_jax.loader.prefetch import Prefetcher
from flat_tokens_jax.loader.readahead import Measures

ROWS = 64
TRIAL = 2 * THREAD_WINDOW  # finishes of a trial: each of its two counts in turn
Times = dict[int, float] | Callable[[int, int], float]


def run(d: DecodeThreads, per_row: Times, n: int, bound: bool = True) -> int:
    """``n`` finishes, each on the count ``d.next()`` gives, taking ``per_row``
    seconds a row at that count (or ``per_row(count, i)`` at the ``i``-th);
    the count after them."""
    for i in range(n):
        t = d.next()
        d.finished(
            (per_row[t] if isinstance(per_row, dict) else per_row(t, i)) * ROWS, ROWS, t, bound
        )
    return d.count


def opened(most: int, pinned: int | None = None) -> DecodeThreads:
    """A policy past the opening finishes it does not measure (two)."""
    d = DecodeThreads(most, pinned)
    run(d, lambda t, i: 1.0, 2)  # the opening burst: slow, not measured
    return d


US = {1: 10e-6, 2: 8e-6, 4: 7.5e-6, 7: 7e-6}  # 2 threads 20 % faster than 1, 4 only 6 % than 2


def test_a_trial_hands_out_its_two_counts_in_turn() -> None:
    d = opened(most=7)
    assert run(d, US, 1) == 1 and d.trials == 1  # binding at 1 thread: a trial of 1 and 2
    handed = []
    for _ in range(TRIAL):
        handed.append(d.next())
        d.finished(US[handed[-1]] * ROWS, ROWS, handed[-1], True)
    assert handed == [2, 1] * THREAD_WINDOW
    assert d.count == 2 and d.kept == 1


def test_threads_double_while_decoding_binds_and_stay_only_where_they_paid() -> None:
    d = opened(most=7)
    assert run(d, US, 1 + TRIAL) == 2  # 20 % less a row: kept
    assert run(d, US, 1 + TRIAL) == 2  # 4 saves 6 %: back to 2
    assert (d.trials, d.kept) == (2, 1)
    # No new trial before THREAD_RETRY finishes; then one of 2 and 4 again.
    assert run(d, US, THREAD_RETRY) == 2 and d.trials == 2
    assert run(d, US, 1) == 2 and d.trials == 3 and d.next() == 4
    assert run(d, US, TRIAL) == 2  # no gain again: the next trial waits twice as long
    assert run(d, US, 2 * THREAD_RETRY) == 2 and d.trials == 3
    assert run(d, US, 1) == 2 and d.trials == 4


def test_a_warming_process_does_not_make_more_threads_look_faster() -> None:
    """Each finish 3 % faster than the one before (caches and memory warming),
    and 2 threads 5 % slower than 1 at any moment: 1 stays."""
    d = opened(most=7)

    def warming(t: int, i: int) -> float:
        return 10e-6 * 0.97**i * (1.05 if t == 2 else 1.0)

    assert run(d, warming, 1 + TRIAL) == 1 and d.trials == 1


def test_threads_stay_at_one_where_a_second_does_not_pay() -> None:
    d = opened(most=7)
    assert run(d, {1: 10e-6, 2: 9.5e-6}, 1 + TRIAL) == 1  # 5 % less is noise
    assert run(d, {1: 10e-6, 2: 5e-6}, THREAD_RETRY) == 1 and d.trials == 1


def test_threads_are_never_tried_when_decoding_is_not_what_the_trainer_waits_for() -> None:
    d = opened(most=7)
    assert run(d, US, 50 * TRIAL, bound=False) == 1
    assert d.trials == 0


def test_threads_reach_the_most_and_stop_there() -> None:
    d = opened(most=3)
    halving = {1: 8e-6, 2: 4e-6, 3: 2e-6}
    assert [run(d, halving, 1 + TRIAL) for _ in range(3)] == [2, 3, 3]
    assert d.trials == 2
    assert DecodeThreads(most=0).most == 1  # one core: the reads' thread decodes too
    d = opened(most=1)
    assert run(d, halving, 10 * TRIAL) == 1 and d.trials == 0


def test_a_finish_on_a_count_not_under_trial_is_not_measured() -> None:
    d = opened(most=7)
    assert run(d, US, 1) == 1 and d.trials == 1
    for t in (4, 7, 3):
        for _ in range(TRIAL):
            d.finished(1e-9 * ROWS, ROWS, t, True)
    assert d.count == 1 and d.trials == 1 and d.next() == 2
    assert run(d, US, TRIAL) == 2


def test_a_pinned_count_never_moves() -> None:
    d = opened(most=7, pinned=3)
    for t in (10e-6, 5e-6, 1e-6, 20e-6):
        assert run(d, lambda c, i, t=t: t, TRIAL) == 3
    assert d.trials == 0


def test_measures_try_threads_only_while_the_finish_binds() -> None:
    """The finish binds when it takes at least a fetch and 0.8 of the trainer's
    interval: 10 ms finishes against 1 ms fetches and 10 ms intervals; then
    against a trainer's 50 ms step; then against 20 ms fetches."""

    def measured(fetch: float, interval: float) -> Measures:
        m = Measures(most_threads=8)
        m.fetched(0.0, fetch)
        m.taken(0.0, 0.0)
        m.taken(0.0, interval)
        for _ in range(3):
            m.finished(0.01, ROWS, m.decode_threads())
        return m

    assert measured(0.001, 0.01).decode_threads() == 2  # a trial: 2 first
    assert measured(0.001, 0.05).decode_threads() == 1  # the trainer is slower
    assert measured(0.02, 0.01).decode_threads() == 1  # the fetch is slower
    m = Measures(most_threads=8)
    for _ in range(3):
        m.finished(0.01, ROWS)  # the caller's thread: not the read-ahead's count
    assert m.decode_threads() == 1 and m.stats()["decode_threads"] == 1
    assert Measures(most_threads=8, decode_threads=5).stats()["decode_threads"] == 5


class Part:
    def __init__(self, step: int) -> None:
        self.step, self.sources = step, np.zeros(1, np.int32)


def test_the_read_ahead_decodes_on_the_measured_count_and_a_jump_on_the_default() -> None:
    seen: list[tuple[int, int | None]] = []

    def finish(step: int, part: Part, threads: int | None) -> int:
        seen.append((step, threads))
        return step

    config = LoaderConfig(batch_size=1, seq_len=1, prefetch=2, decode_threads=3)
    p: Prefetcher[Part, int] = Prefetcher(
        config, lambda s, ahead: lambda: Part(s), finish, rows=lambda s: 1, name="t"
    )
    try:
        assert [p.take(s, 6) for s in range(6)] == list(range(6))
        assert p.take(2, 6, ahead=False) == 2  # a jump, read in the caller's thread
    finally:
        p.close()
    assert (2, None) in seen
    assert {t for s, t in seen if (s, t) != (2, None)} <= {3}
    assert {s for s, t in seen if t == 3} >= {1, 2, 3, 4, 5}
    assert p.stats()["decode_threads"] == 3


def test_decode_threads_pins_the_loaders_count() -> None:
    url = memory_url("decodethreads")
    ftj.write_dataset(url, {"train": [[i % 97 + 1] * (i % 13 + 1) for i in range(600)]})
    cfg = ftj.LoaderConfig(batch_size=4, seq_len=8, decode_threads=2)
    loader = ftj.Loader(ftj.open_dataset(url)["train"], cfg)
    used: list[int | None] = []
    fields = loader.engine.fields

    def spied(*args: Any, **kwargs: Any) -> Any:
        used.append(args[2] if len(args) > 2 else kwargs.get("threads"))
        return fields(*args, **kwargs)

    loader.engine.fields = spied  # type: ignore[method-assign]
    for step, _ in loader.iterate(0, 20):
        assert loader.stats()["decode_threads"] == 2, step
    assert used and set(used) == {2}


def test_the_warm_up_runs_before_a_read_is_timed(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a clock that only the warm-up advances (by 100 s), a read measures 0 s."""
    clock = [0.0]
    monkeypatch.setattr(prefetch, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    events: list[str] = []

    def warm() -> None:
        events.append("warm")
        clock[0] += 100.0

    def read(step: int, ahead: bool) -> Callable[[], Part]:
        events.append(f"read {step}")
        return lambda: Part(step)

    config = LoaderConfig(batch_size=1, seq_len=1, prefetch=0)
    p: Prefetcher[Part, int] = Prefetcher(
        config, read, lambda s, part, threads: s, rows=lambda s: 1, name="t", warm=warm
    )
    assert [p.take(s, None) for s in range(2)] == [0, 1]
    assert events == ["warm", "read 0", "warm", "read 1"]
    stats = p.stats()
    assert stats["fetch_mean_s"] == stats["fetch_last_s"] == 0.0
    assert stats["wait_first_s"] == 100.0  # the caller waited for it all the same
