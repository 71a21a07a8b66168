"""flat_tokens_jax.store.checks: each item is checked once among concurrent
reads; a read that never waits for its check holds no other read up; a check
another read failed is done again here, naming the bad item; and a split's
reads (through ``flat_tokens_jax.store.integrity.CheckedArray``) start their
checks without waiting for them and count their bytes apart."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from memurls import memory_url

import flat_tokens_jax as ftj
from flat_tokens_jax.core.format import FormatError
from flat_tokens_jax.store.checks import Checks, Once


class Recorder:
    """A ``begin`` that counts the items it checks; ``bad`` items fail."""

    def __init__(self, bad: frozenset[int] = frozenset()) -> None:
        self.begun: Counter[int] = Counter()
        self.bad = bad
        self._lock = threading.Lock()

    def begin(self, mine: np.ndarray) -> Callable[[], list[int]]:
        with self._lock:
            self.begun.update(mine.tolist())
        return lambda: self._verify(mine)

    def _verify(self, items: np.ndarray) -> list[int]:
        wrong = sorted(self.bad & set(items.tolist()))
        if wrong:
            raise FormatError(f"item {wrong[0]} is bad")
        return items.tolist()


@settings(max_examples=30, deadline=None)
@given(reads=st.lists(st.lists(st.integers(0, 19), min_size=1, max_size=6), min_size=1, max_size=8))
def test_each_item_is_checked_once_among_concurrent_reads(reads: list[list[int]]) -> None:
    checks: Checks[list[int]] = Checks(20)
    rec = Recorder()
    barrier = threading.Barrier(len(reads), timeout=10)
    errors: list[BaseException] = []

    def read(items: list[int]) -> None:
        try:
            barrier.wait()
            checks.start(np.array(items, np.int64), rec.begin)()
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=read, args=(r,)) for r in reads]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert not errors
    touched = {i for r in reads for i in r}
    assert rec.begun == Counter({i: 1 for i in touched})
    assert np.flatnonzero(checks.checked).tolist() == sorted(touched)


def test_a_read_that_never_waits_holds_no_other_read_up() -> None:
    """Read A claims items 1 and 2 and never waits; read B, touching item 2,
    runs A's check itself (one begin per item) and the items are checked."""
    checks: Checks[list[int]] = Checks(5)
    rec = Recorder()
    checks.start(np.array([1, 2]), rec.begin)  # never waited for
    done = threading.Event()

    def other() -> None:
        checks.start(np.array([2, 3]), rec.begin)()
        done.set()

    threading.Thread(target=other, daemon=True).start()
    assert done.wait(20)
    assert rec.begun == Counter({1: 1, 2: 1, 3: 1})
    assert checks.checked.tolist() == [False, True, True, True, False]


def test_a_check_another_read_failed_is_done_again_and_names_the_item() -> None:
    checks: Checks[list[int]] = Checks(5)
    rec = Recorder(bad=frozenset({2}))
    first = checks.start(np.array([2]), rec.begin)
    second = checks.start(np.array([2, 4]), rec.begin)
    with pytest.raises(FormatError, match="item 2 is bad"):
        first()
    with pytest.raises(FormatError, match="item 2 is bad"):
        second()
    assert rec.begun == Counter({2: 2, 4: 1})  # 2 begun again by the second read
    assert checks.checked.tolist() == [False, False, False, False, True]


def test_a_failed_check_is_not_counted_checked_and_a_later_read_checks_again() -> None:
    checks: Checks[list[int]] = Checks(3)
    rec = Recorder(bad=frozenset({1}))
    with pytest.raises(FormatError):
        checks.start(np.array([1]), rec.begin)()
    rec.bad = frozenset()
    assert checks.start(np.array([1]), rec.begin)() == [1]
    assert rec.begun == Counter({1: 2})


def test_once_runs_its_call_once_and_gives_every_caller_its_error() -> None:
    calls: list[int] = []

    def fail() -> int:
        calls.append(1)
        raise ValueError("bad")

    once = Once(fail)
    for _ in range(3):
        with pytest.raises(ValueError, match="bad"):
            once.result()
    assert calls == [1]


def test_a_read_of_a_split_starts_its_checks_without_waiting_for_them() -> None:
    """Requesting ranges returns before the chunks they touch are checked (their
    reads share the round trips of the values); the values wait for the checks."""
    url = memory_url()
    seqs = [list(range(1, 60 + i)) for i in range(20)]
    ftj.write_dataset(
        url, {"train": seqs}, storage_format=ftj.StorageFormat(shard_tokens=256, chunk_tokens=16)
    )
    ft = ftj.open_dataset(url)["train"]
    digests = ft.digests[ft.tokens_name]
    assert digests is not None
    starts, stops = np.array([300, 700]), np.array([340, 720])
    pending = ft.request_encoded(starts, stops)
    assert not digests.checked[[300 // 16, 700 // 16]].any()
    got = pending.result()
    assert digests.checked[[300 // 16, 700 // 16]].all()
    flat = ftj.encode(seqs)[0]
    assert [g.tolist() for g in got] == [flat[300:340].tolist(), flat[700:720].tolist()]


def test_a_checked_array_counts_the_bytes_of_its_values_apart_from_its_checks() -> None:
    """Through ``CheckedArray`` a read checks the shards and chunks it touches
    once; bytes of values and of checks are counted apart. Without memory-mapped
    shards (a memory store) a chunk's check reads it whole and hashes it."""
    url = memory_url()
    seqs = [list(range(1, 60 + i)) for i in range(20)]  # 1,370 tokens: 6 shards of 256
    ftj.write_dataset(
        url, {"train": seqs}, storage_format=ftj.StorageFormat(shard_tokens=256, chunk_tokens=16)
    )
    ft = ftj.open_dataset(url)["train"]
    tokens = ft.checked[ft.tokens_name]
    assert tokens.reader is ft.encoded and tokens.digests is ft.digests[ft.tokens_name]
    assert (tokens.data_bytes, tokens.check_bytes) == (0, 0)

    got = tokens.request_ranges(np.array([300, 330]), np.array([340, 350])).result()
    flat = ftj.encode(seqs)[0]
    assert [g.tolist() for g in got] == [flat[300:340].tolist(), flat[330:350].tolist()]
    # Values: 60 uint32. Checks: shard 1's probe (its 256 values), the recorded
    # digests of its 16 chunks, and chunks 18..21 read whole (16 values each).
    assert tokens.data_bytes == 60 * 4
    assert tokens.check_bytes == 256 * 4 + 16 * 4 + 4 * 16 * 4
    assert tokens.reader.bytes_read == 60 * 4 + 256 * 4 + 4 * 16 * 4

    tokens.request_ranges(np.array([320]), np.array([336])).result()  # checked already
    assert (tokens.data_bytes, tokens.check_bytes) == (76 * 4, 256 * 4 + 16 * 4 + 4 * 16 * 4)

    before = tokens.digests.checked.copy()  # type: ignore[union-attr]
    tokens.reader.read_ranges(np.array([1000]), np.array([1010]))  # not through the checks
    np.testing.assert_array_equal(tokens.digests.checked, before)  # type: ignore[union-attr]
    np.testing.assert_array_equal(tokens.read_points(np.array([1000, 1009])), flat[[1000, 1009]])
    assert tokens.digests.checked[1000 // 16]  # type: ignore[union-attr]
