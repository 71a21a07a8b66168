"""Read-ahead that sizes itself: the depth policy, the steps in flight, start, stats, warning."""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from memurls import memory_url

import flat_tokens_jax as ftj
from flat_tokens_jax.loader.prefetch import Prefetcher
from flat_tokens_jax.loader.readahead import (
    ASSUMED_INTERVAL,
    INITIAL_DEPTH,
    MAX_DEPTH,
    MIN_DEPTH,
    RECENT_FETCHES,
    Measures,
    auto_depth,
    next_depth,
    stall_message,
)

SEQS = [[i % 97 + 1] * (i % 13 + 1) for i in range(600)]
BATCH, SEQ_LEN = 4, 8
STEP_BYTES = BATCH * SEQ_LEN * 17  # decoded fields of a step on the host


def split() -> ftj.FlatTokens:
    url = memory_url()
    ftj.write_dataset(
        url, {"train": SEQS}, storage_format=ftj.StorageFormat(shard_tokens=256, chunk_tokens=16)
    )
    return ftj.open_dataset(url)["train"]


class Logged:
    """Packed records whose reads are logged, each after ``delay`` seconds."""

    def __init__(self, ft: ftj.FlatTokens, delay: float = 0.0) -> None:
        self.inner = ftj.PackedRecords(ft, SEQ_LEN)
        self.seq_len, self.packing, self.delay = SEQ_LEN, ftj.Packing.WINDOWS, delay
        self.reads: list[list[int]] = []
        self.first = threading.Event()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.inner)

    def __repr__(self) -> str:
        return f"Logged({self.inner!r})"

    def read(self, indices: np.ndarray, columns: tuple[int, int] | None = None) -> Any:
        time.sleep(self.delay)
        with self._lock:
            self.reads.append(np.asarray(indices).tolist())
        self.first.set()
        return self.inner.read(indices, columns)

    def token_ranges(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self.inner.token_ranges(indices)

    def fingerprint(self) -> dict[str, Any]:
        return self.inner.fingerprint()


class LeadFirst(Logged):
    """Logged records of a split off local disk (a memory store), so that the
    steps in flight are fetched at once, which start their reads in
    ``request``. The request of ``lead`` (a step's records) waits up to a
    second for another request to begin; its reads then wait up to ten
    seconds for one, and note whether one began."""

    def __init__(self, ft: ftj.FlatTokens, lead: list[int]) -> None:
        super().__init__(ft)
        self.ft, self.lead = ft, lead
        self.events: list[tuple[str, list[int]]] = []
        self.other = threading.Event()
        self.seen: list[bool] = []

    def request(self, indices: np.ndarray, columns: tuple[int, int] | None = None) -> Any:
        key = np.asarray(indices).tolist()
        with self._lock:
            self.events.append(("begin", key))
        if key == self.lead:
            self.other.wait(1.0)
        else:
            self.other.set()
        waiting = self.inner.request(indices, columns)
        with self._lock:
            self.events.append(("issued", key))

        def windows() -> Any:
            if key == self.lead:
                self.seen.append(self.other.wait(10.0))
            return waiting()

        return windows


def cfg(**changes: Any) -> ftj.LoaderConfig:
    return ftj.LoaderConfig(batch_size=BATCH, seq_len=SEQ_LEN, seed=7, **changes)


def as_lists(batch: dict[str, Any]) -> dict[str, list[Any]]:
    return {k: np.asarray(v).tolist() for k, v in batch.items()}


def reference_depth(fetch: float, finish: float, interval: float, size: int, budget: int) -> int:
    want = math.ceil(1.5 * (fetch + finish) / interval) + 1
    return max(1, min(max(want, MIN_DEPTH), MAX_DEPTH, budget // size))


def test_depth_follows_fetch_decode_and_the_trainers_step() -> None:
    big = 1 << 40
    assert auto_depth(0.125, 0.0, 0.0625, 1, big) == 4  # ceil(1.5 * 2) + 1
    assert auto_depth(0.125, 0.125, 0.0625, 1, big) == 7
    assert auto_depth(0.001, 0.0, 1.0, 1, big) == MIN_DEPTH
    assert auto_depth(10.0, 0.0, 0.001, 1, big) == MAX_DEPTH
    assert auto_depth(None, None, None, 1, big) == INITIAL_DEPTH  # nothing measured yet
    # Before the trainer's step is known, a fast one is assumed.
    assert auto_depth(0.1, 0.0, None, 1, big) == reference_depth(0.1, 0, ASSUMED_INTERVAL, 1, big)
    assert auto_depth(0.1, 0.0, None, 1, big) > 10
    assert auto_depth(0.1, 0.0, None, 100, 350) == 3  # the budget holds 3 steps
    assert auto_depth(0.1, 0.0, None, 100, 50) == 1  # one step whatever the budget


@given(
    fetch=st.floats(0, 1e6, allow_nan=False),
    finish=st.floats(0, 1e6, allow_nan=False),
    interval=st.floats(1e-5, 1e6, allow_nan=False),
    size=st.integers(1, 1 << 40),
    budget=st.integers(1, 1 << 50),
)
def test_depth_never_exceeds_the_memory_budget(
    fetch: float, finish: float, interval: float, size: int, budget: int
) -> None:
    depth = auto_depth(fetch, finish, interval, size, budget)
    assert depth == reference_depth(fetch, finish, interval, size, budget)
    assert 1 <= depth <= MAX_DEPTH
    assert depth * size <= budget or depth == 1


def test_depth_grows_by_doubling_and_shrinks_a_step_at_a_time() -> None:
    depth, seen = 0, []
    for wanted in [100] * 6 + [5] * 3:
        depth = next_depth(depth, wanted, cap=1000)
        seen.append(depth)
    assert seen == [2, 4, 8, 16, 32, 64, 63, 62, 61]
    assert next_depth(64, 100, cap=10) == 10  # the budget applies at once
    assert next_depth(5, 3, cap=0) == 1


@given(
    previous=st.integers(0, 500),
    wanted=st.integers(1, MAX_DEPTH),
    size=st.integers(1, 1 << 40),
    budget=st.integers(1, 1 << 50),
)
def test_a_depth_moved_toward_its_target_keeps_the_budget(
    previous: int, wanted: int, size: int, budget: int
) -> None:
    cap = min(MAX_DEPTH, budget // size)
    depth = next_depth(previous, wanted, cap)
    assert depth * size <= budget or depth == 1
    assert min(previous - 1, wanted, cap) <= depth <= max(MIN_DEPTH, 2 * previous, 1)


def test_measures_grow_before_the_interval_is_known_then_follow_it() -> None:
    m = Measures()
    assert m.depth(1, 1 << 30) == INITIAL_DEPTH
    m.fetched(0.0, 0.1)  # step 0's fetch: the trainer is assumed fast
    assert m.depth(1, 1 << 30) == reference_depth(0.1, 0, ASSUMED_INTERVAL, 1, 1 << 30) > 10
    m.taken(0.1, 10.0)
    m.taken(0.0, 11.0)  # a trainer step of 1 s: 2 steps cover the fetch
    assert m.depth(1, 1 << 30) == MIN_DEPTH
    stats = m.stats()
    assert stats["steps"] == 2 and stats["wait_first_s"] == 0.1
    assert stats["interval_mean_s"] == 1.0 and stats["fetch_mean_s"] == 0.1


def test_spare_is_the_trainers_step_less_the_covered_fetch_and_finish() -> None:
    m = Measures()
    assert m.spare() == 0.0  # nothing measured: a read starts at once
    m.fetched(0.0, 0.3)
    m.fetched(0.0, 0.1)  # the slowest recent fetch counts, as for the depth
    m.finished(0.05)
    assert m.spare() == 0.0  # no trainer step measured yet
    m.taken(0.0, 10.0)
    m.taken(0.0, 11.0)  # a trainer step of 1 s
    assert m.spare() == pytest.approx(1.0 - 1.5 * (0.3 + 0.05))
    assert m.spare(3) == pytest.approx(3.0 - 1.5 * (0.3 + 0.05))  # three steps ahead
    for k in range(1, 200):
        m.taken(0.0, 11.0 + 0.01 * k)  # a fast trainer leaves nothing spare
    assert m.spare() == 0.0


class Squared:
    """A step's records: its number, one row of source 0."""

    def __init__(self, step: int) -> None:
        self.step, self.sources = step, np.zeros(1, np.int32)


def test_in_flight_tops_up_within_the_budget_and_never_drops_a_started_step() -> None:
    """Steps of 1, 2 and 3 rows and a budget of 6 rows; the depth is set by the
    test (the measured one is tested below)."""
    row = ftj.LoaderConfig(batch_size=1, seq_len=SEQ_LEN).batch_layout.row_bytes(SEQ_LEN)
    config = ftj.LoaderConfig(batch_size=1, seq_len=SEQ_LEN, read_ahead_bytes=6 * row)
    read_here: list[int] = []

    def read(step: int, ahead: bool) -> Any:
        if not ahead:
            read_here.append(step)
        return lambda: Squared(step)

    flight: Prefetcher[Squared, int] = Prefetcher(
        config, read, lambda s, part, ahead: part.step**2, rows=lambda s: 1 + s % 3
    )
    depth = [8]
    flight.depth = lambda step, grow=False: depth[0]  # type: ignore[method-assign]
    try:
        assert flight.take(0, None) == 0
        assert flight.steps() == [1, 2, 3]  # 2 + 3 + 1 rows; step 4's 2 more would not fit
        assert flight.peak_bytes == 6 * row
        depth[0] = 1
        assert flight.take(1, None, ahead=False) == 1  # a smaller depth
        assert flight.steps() == [2, 3]  # started steps stay
        depth[0] = 5
        assert flight.take(2, 5) == 4
        assert flight.steps() == [3, 4]  # grows, up to the end (the budget holds step 5)
        flight._grow(0, 9, None)  # not the step taken last: nothing
        assert flight.steps() == [3, 4]
        assert flight.take(7, None, ahead=False) == 49  # a jump, read in this thread
        assert flight.steps() == [] and read_here == [7]
    finally:
        flight.close()
    # At least one step is read ahead, whatever its size.
    one: Prefetcher[Squared, int] = Prefetcher(
        config, read, lambda s, part, ahead: part.step**2, rows=lambda s: 10
    )
    one.depth = lambda step, grow=False: 8  # type: ignore[method-assign]
    try:
        assert one.take(0, None) == 0 and one.steps() == [1]
    finally:
        one.close()


def stall_windows(m: Measures, since: float, steps: list[tuple[float, float]]) -> list[Any]:
    """``m.taken`` of each ``(wait, interval)`` after the batch before, the
    first after a batch taken at ``since``."""
    now, out = since, []
    for wait, interval in steps:
        now += interval
        out.append(m.taken(wait, now))
    return out


def test_the_stall_window_reports_one_window_and_names_the_cause() -> None:
    m = Measures(stall_window=4, stall_share=0.05)
    assert not m.window_starts()
    assert m.taken(0.0, 0.0) is None  # the first batch: no interval, no window
    assert m.window_starts()
    assert stall_windows(m, 0.0, [(0.0, 0.1)] * 4) == [None] * 4
    paused = Measures(stall_window=10, stall_share=0.05)  # one pause in ten steps is no stall
    paused.taken(0.0, 0.0)
    assert stall_windows(paused, 0.0, [(0.0, 0.1)] * 9 + [(1.0, 1.1)]) == [None] * 10
    assert m.window_starts()
    windows = stall_windows(m, 0.4, [(0.02, 0.1)] * 3)
    assert not m.window_starts()  # within a window
    windows += stall_windows(m, 0.7, [(0.02, 0.1)] * 5)
    assert windows[3] == pytest.approx((0.08, 0.4, 4)) and windows.count(None) == 7
    assert not m.window_starts()  # reported once: no window begins after it
    with pytest.raises(ValueError, match="stall_window >= 1 and 0 < stall_share < 1"):
        Measures(stall_window=0)
    args = {"window": (0.08, 0.4, 4), "bytes_per_step": 2e6, "delivered_bps": 1e6}
    assert "decode_threads" in stall_message(
        **args, fetch_s=0.01, finish_s=0.2, depth=4, capped_by=None
    )
    capped = "read_ahead_bytes"
    latency = stall_message(**args, fetch_s=1.0, finish_s=0.0, depth=2, capped_by=capped)
    assert "raise LoaderConfig.read_ahead_bytes" in latency
    bandwidth = stall_message(**args, fetch_s=1.0, finish_s=0.0, depth=2, capped_by=None)
    assert "delivers 1 MB/s" in bandwidth and "needs 25 MB/s" in bandwidth
    assert "throttled" not in bandwidth + latency
    # Requests refused as throttled over the window name throttling before
    # latency and bandwidth; a decode slower than the step still comes first.
    throttled = stall_message(
        **args, fetch_s=1.0, finish_s=0.0, depth=2, capped_by=capped, throttled=7
    )
    assert "refused 7 requests as throttled" in throttled
    assert 'LoaderConfig(shuffle="blocks")' in throttled
    decode = stall_message(**args, fetch_s=0.01, finish_s=0.2, depth=4, capped_by=None, throttled=7)
    assert "decode_threads" in decode and "throttled" not in decode


def test_automatic_depth_gives_the_batches_of_no_read_ahead() -> None:
    ft = split()
    plain = ftj.Loader(ft, cfg(prefetch=0))
    auto = ftj.Loader(ft, cfg(read_ahead_bytes=3 * STEP_BYTES))
    for step, batch in auto.iterate(3):
        assert as_lists(batch) == as_lists(plain.batch(step))
        if step == 30:
            break
    for step in (40, 41, 42, 7):
        assert as_lists(auto.batch(step)) == as_lists(plain.batch(step))


def test_slow_fetches_keep_the_memory_budget() -> None:
    """A fetch slower than the trainer's step wants more steps in flight than
    the budget holds: the steps in flight reach it and stay within it (a
    growth that did not pay may hold the depth below it afterwards)."""
    records = Logged(split(), delay=0.01)
    loader = ftj.Loader(records, cfg(read_ahead_bytes=3 * STEP_BYTES))
    depths = []
    for step, _ in loader.iterate(0):
        depths.append(loader.stats()["depth"])
        if step == 12:
            break
    stats = loader.stats()
    assert stats["depth_target"] <= 3 and max(depths) == 3
    assert stats["read_ahead_bytes_peak"] <= 3 * STEP_BYTES


def test_a_step_read_ahead_counts_every_field_of_its_layout() -> None:
    """Issue 35: a step read ahead holds its layout's arrays (MaxText's six,
    ``sequence_start`` and ``segment_lengths`` here: 29 bytes a token, not
    the five fields' 17), measured on a real batch: the steps in flight are
    counted in whole steps of those bytes, within the budget."""
    ft = split()
    wide = {"layout": "maxtext", "sequence_start": True, "max_segments": SEQ_LEN}
    batch = ftj.Loader(ft, cfg(prefetch=0, **wide)).host_batch(0)
    step_bytes = sum(v.nbytes for v in batch.values())
    loader = ftj.Loader(Logged(ft, delay=0.01), cfg(read_ahead_bytes=3 * step_bytes, **wide))
    for step, _ in loader.iterate(0):
        if step == 12:
            break
    peak = loader.stats()["read_ahead_bytes_peak"]
    assert 0 < peak <= 3 * step_bytes and peak % step_bytes == 0, (peak, step_bytes)


def test_start_reads_ahead_and_iterate_takes_those_reads() -> None:
    ft = split()
    records = Logged(ft)
    loader = ftj.Loader(records, cfg())
    want = [row["record"] for row in ftj.Loader(ft, cfg(prefetch=0)).provenance(5)]
    loader.start(5)
    loader.start(5)  # a second call changes nothing
    assert records.first.wait(10)
    assert records.reads[0] == want  # step 5 was read before iterate was called
    step, batch = next(iter(loader.iterate(5)))
    assert step == 5
    assert as_lists(batch) == as_lists(ftj.Loader(ft, cfg(prefetch=0)).batch(5))
    assert records.reads.count(want) == 1


def test_batch_takes_the_started_step_and_a_jump_drops_it() -> None:
    ft = split()
    records = Logged(ft)
    loader = ftj.Loader(records, cfg())
    loader.start(9)
    assert records.first.wait(10)
    assert loader.stats()["depth"] >= 1
    plain = ftj.Loader(ft, cfg(prefetch=0))
    assert as_lists(loader.batch(9)) == as_lists(plain.batch(9))
    want = [row["record"] for row in plain.provenance(9)]
    assert records.reads.count(want) == 1
    assert 10 in loader.prefetcher.steps()  # reading ahead, as after consecutive steps
    assert as_lists(loader.batch(2)) == as_lists(plain.batch(2))
    assert loader.prefetcher.steps() == []
    with pytest.raises(ValueError, match=r"Loader\.start: step must be an int >= 0, got -1"):
        loader.start(-1)


def test_stats_count_what_the_trainer_got() -> None:
    loader = ftj.Loader(split(), cfg())
    waits = []
    for step, _ in loader.iterate(0):
        waits.append(loader.wait_seconds)
        if step == 8:
            break
    loader.batch(9)
    waits.append(loader.wait_seconds)
    stats = loader.stats()
    assert set(stats) == {
        "steps", "wait_first_s", "wait_last_s", "wait_mean_s", "wait_p99_s",
        "fetch_last_s", "fetch_mean_s", "decode_mean_s", "interval_mean_s", "depth",
        "depth_target", "depth_ceiling", "read_ahead_bytes_peak", "read_ahead_bytes", "requests",
        "throttled_requests", "bytes_read", "tokens", "source_tokens", "filtered_rows",
        "filtered_rows_last", "decode_threads",
    }  # fmt: skip
    assert stats["steps"] == 10 and stats["tokens"] == 10 * BATCH * SEQ_LEN
    assert stats["source_tokens"] == {"0": 10 * BATCH * SEQ_LEN}  # one split, no padding
    assert stats["wait_first_s"] == waits[0] and stats["wait_last_s"] == waits[-1]
    assert stats["wait_mean_s"] == pytest.approx(np.mean(waits[1:]))
    assert stats["wait_mean_s"] <= stats["wait_p99_s"] <= max(waits[1:])
    assert min(v for v in stats.values() if not isinstance(v, dict)) >= 0
    assert stats["fetch_mean_s"] > 0 and stats["decode_mean_s"] > 0
    assert stats["interval_mean_s"] > 0 and stats["depth_target"] >= MIN_DEPTH
    assert 0 < stats["read_ahead_bytes_peak"] <= stats["read_ahead_bytes"] == 1 << 30
    assert stats["requests"] == stats["throttled_requests"] == 0 and stats["bytes_read"] > 0


def test_warns_once_when_the_trainer_waits(caplog: pytest.LogCaptureFixture) -> None:
    """A fetch of 20 ms, a trainer step of 5 ms and a budget of one step: the
    trainer waits most of its time, and one warning names the budget."""
    loader = ftj.Loader(Logged(split(), delay=0.02), cfg(read_ahead_bytes=STEP_BYTES))
    with caplog.at_level(logging.WARNING, logger="flat_tokens_jax"):
        for step, _ in loader.iterate(0):
            time.sleep(0.005)
            if step == 105:
                break
    warnings = [r.getMessage() for r in caplog.records if r.name.startswith("flat_tokens_jax")]
    assert len(warnings) == 1, warnings
    assert "input stall" in warnings[0] and "raise LoaderConfig.read_ahead_bytes" in warnings[0]


def test_no_warning_when_input_keeps_up(caplog: pytest.LogCaptureFixture) -> None:
    loader = ftj.Loader(split(), cfg())
    with caplog.at_level(logging.WARNING, logger="flat_tokens_jax"):
        for step, _ in loader.iterate(0):
            time.sleep(0.04)
            if step == 52:
                break
    assert loader.stats()["steps"] == 53
    assert not [r for r in caplog.records if r.name.startswith("flat_tokens_jax")]


def test_read_ahead_bytes_is_checked_like_the_other_fields() -> None:
    with pytest.raises(ValueError, match=r"LoaderConfig\.read_ahead_bytes must be"):
        cfg(read_ahead_bytes=0)
    with pytest.raises(ValueError, match=r"LoaderConfig\.read_ahead_bytes must be"):
        cfg(read_ahead_bytes=1.5)
    assert "read_ahead_bytes" not in cfg().batch_defining()
    assert cfg().prefetch is None


def test_a_budget_over_memory_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match=r"read_ahead_bytes 1,000,000,000,000,000.*memory") as e:
        ftj.Loader(split(), cfg(read_ahead_bytes=10**18))
    assert "lower read_ahead_bytes (at most" in str(e.value)
    ftj.Loader(split(), cfg(read_ahead_bytes=10**18, prefetch=2))  # a pinned depth ignores it


def test_a_slow_fetch_sets_the_depth_while_it_is_recent() -> None:
    """A step that touches a new shard fetches in several round trips: the
    depth covers it until RECENT_FETCHES faster ones came after it."""
    m = Measures()
    m.taken(0.0, 0.0)
    m.taken(0.0, 0.05)  # a 50 ms trainer
    for seconds in [0.1] * 5 + [0.8] + [0.1] * 5:
        m.fetched(0.0, seconds)
    assert m.depth(1, 1 << 30) == reference_depth(0.8, 0, 0.05, 1, 1 << 30)
    for _ in range(RECENT_FETCHES):
        m.fetched(0.0, 0.1)
    assert m.depth(1, 1 << 30) == reference_depth(0.1, 0, 0.05, 1, 1 << 30)


def test_the_depth_grows_from_the_second_step_handed_out() -> None:
    """When the first step is handed out the steps started with it are still
    being decoded: no new fetches are started beside them yet."""
    loader = ftj.Loader(Logged(split(), delay=0.05), cfg())
    it = loader.iterate(0)
    next(it)
    assert loader.stats()["depth_target"] == MIN_DEPTH
    next(it)
    assert loader.stats()["depth_target"] > MIN_DEPTH
    it.close()


class Remote(Logged):
    """Logged records of a split off local disk (a memory store), each read
    ``delay`` seconds long."""

    def __init__(self, ft: ftj.FlatTokens, delay: float) -> None:
        super().__init__(ft, delay)
        self.ft = ft


@pytest.mark.parametrize("door", ["iterate", "to_grain"])
def test_on_an_object_store_the_first_fetch_moves_the_depth_before_a_step_is_handed_out(
    door: str,
) -> None:
    """A 50 ms fetch against the assumed 10 ms step asks for more than the
    opening burst: the depth grows when the first fetch ends, so the steps
    after the burst are read by the time the first step is handed out."""
    loader = ftj.Loader(Remote(split(), delay=0.05), cfg())
    steps = iter(loader.to_grain()) if door == "to_grain" else (b for _, b in loader.iterate())
    next(steps)
    assert loader.stats()["depth_target"] > INITIAL_DEPTH
    steps.close()  # type: ignore[attr-defined]


@pytest.mark.parametrize("first", [0, 3])
@pytest.mark.parametrize("door", ["iterate", "to_grain"])
def test_the_first_step_starts_its_reads_before_the_rest_of_the_opening_burst(
    door: str, first: int
) -> None:
    """On a store off local disk the first step (0, or the restored one) and
    the steps read ahead with it are fetched at once: the others start their
    reads once the first one has started its own, and before its reads end,
    whichever door asks."""
    ft = split()
    twin = ftj.Loader(ftj.PackedRecords(ft, SEQ_LEN), cfg())
    lead = [row["record"] for row in twin.provenance(first)]
    records = LeadFirst(ft, lead)
    loader = ftj.Loader(records, cfg())
    loader.restore(loader.state(first))
    steps = iter(loader.to_grain()) if door == "to_grain" else (b for _, b in loader.iterate())
    batches = [next(steps) for _ in range(4)]
    steps.close()  # type: ignore[attr-defined]
    for k, batch in enumerate(batches):
        assert as_lists(batch) == as_lists(twin.host_batch(first + k))
    issued = records.events.index(("issued", lead))
    others = [k for k, (what, key) in enumerate(records.events) if what == "begin" and key != lead]
    assert len(others) >= 3 and min(others) > issued, records.events
    assert records.seen == [True]
