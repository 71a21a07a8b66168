"""Block reads under ``shuffle="blocks"``: batches taken from whole blocks
equal the row reads' bit for bit (packed, padded and bins records, a
mixture, a schedule, restores at random steps), the block cache holds at
most its budget (blocks dropped and read again under a tiny one), each
block is read once, and :meth:`BlockSampler.next_use` against a brute force."""

from __future__ import annotations

import collections
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from memurls import memory_url

import flat_tokens_jax as ftj
from flat_tokens_jax.data.writer import write_dataset
from flat_tokens_jax.sampling.blocks import NEVER, BlockSampler

pytestmark = pytest.mark.filterwarnings("error")


def corpus(masked: bool = True, seed: int = 0, count: int = 300) -> ftj.FlatTokens:
    """A split of ``count`` sequences of 1 to 40 tokens, with a loss mask."""
    rng = np.random.default_rng(seed)
    seqs = [rng.integers(0, 1000, int(rng.integers(1, 40))).tolist() for _ in range(count)]
    masks = {"train": [rng.integers(0, 2, len(s)).tolist() for s in seqs]} if masked else None
    url = memory_url()
    write_dataset(url, {"train": seqs}, loss_masks=masks)
    return ftj.open_dataset(url)["train"]


@pytest.fixture(scope="module")
def split() -> ftj.FlatTokens:
    return corpus()


def rows_read(source: object, config: ftj.LoaderConfig) -> ftj.Loader:
    """The same run with every row read on its own (no block cache)."""
    loader = ftj.Loader(source, config)
    loader.engine.block_cache = None
    return loader


def assert_same(got: dict[str, np.ndarray], want: dict[str, np.ndarray], where: str) -> None:
    assert got.keys() == want.keys()
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=f"{where} {name}")


@settings(max_examples=25, deadline=None)
@given(
    packing=st.sampled_from([True, False, "bins"]),
    block=st.integers(1, 9),
    window=st.integers(1, 3),
    batch=st.sampled_from([1, 3, 8]),
    seed=st.integers(0, 2**32),
    steps=st.lists(st.integers(0, 400), min_size=1, max_size=6),
)
def test_block_reads_equal_row_reads(
    split: ftj.FlatTokens,
    packing: bool | str,
    block: int,
    window: int,
    batch: int,
    seed: int,
    steps: list[int],
) -> None:
    """Random steps of a fresh loader (a restore needs only the step)."""
    config = ftj.LoaderConfig(
        batch_size=batch,
        seq_len=16,
        packing=packing,
        shuffle="blocks",
        shuffle_block=block,
        shuffle_window=window,
        seed=seed,
        prefetch=0,
    )
    got, want = ftj.Loader(split, config), rows_read(split, config)
    for step in steps:
        assert_same(got.host_batch(step), want.host_batch(step), f"step {step}")
    reads = got.stats()["block_reads"]
    assert (reads == 0) if packing == "bins" else (reads > 0)


def test_a_mixture_and_a_schedule_read_in_blocks_exactly(split: ftj.FlatTokens) -> None:
    other = corpus(seed=1, count=120)
    mix = ftj.Mixture({"a": (split, 1.0), "b": (other, 2.0)}, seed=5)
    config = ftj.LoaderConfig(
        batch_size=[(0, 4), (7, 8), (20, 12)],
        seq_len=16,
        shuffle="blocks",
        shuffle_block=3,
        shuffle_window=2,
        prefetch=3,
    )
    got, want = ftj.Loader(mix, config), rows_read(mix, config)
    for step, batch in got.iterate(0, 40):
        assert_same(jax_to_numpy(batch), want.host_batch(step), f"step {step}")
    assert got.stats()["block_reads"] > 0


def jax_to_numpy(batch: dict[str, object]) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in batch.items()}


def test_a_restored_loader_reads_the_same_batches(split: ftj.FlatTokens) -> None:
    config = ftj.LoaderConfig(batch_size=4, seq_len=16, shuffle="blocks", shuffle_block=4)
    first = ftj.Loader(split, config)
    taken = dict(first.iterate(0, 9))
    state = first.state(9)
    later = ftj.Loader(split, config)
    start = later.restore(state)
    want = rows_read(split, config)
    for step, batch in later.iterate(start, start + 12):
        assert_same(jax_to_numpy(batch), want.host_batch(step), f"step {step}")
    for step, batch in taken.items():
        assert_same(jax_to_numpy(batch), want.host_batch(step), f"step {step}")


@pytest.mark.parametrize("packing", [True, False])
def test_a_tiny_budget_drops_blocks_and_reads_them_again(
    split: ftj.FlatTokens, packing: bool
) -> None:
    """Three blocks' worth of budget for 8 lanes: the cache holds at most its
    budget at every step, drops blocks and reads some again, and every batch
    is exact."""
    block = 4
    config = ftj.LoaderConfig(
        batch_size=8, seq_len=16, packing=packing, shuffle="blocks", shuffle_block=block
    )
    probe = ftj.Loader(split, config)
    cache = probe.engine.block_cache
    assert cache is not None
    one = max(cache.budget // (8 * 2), 1)  # the default holds 2 blocks a lane
    budget = 3 * one
    tiny = ftj.LoaderConfig(
        batch_size=8,
        seq_len=16,
        packing=packing,
        shuffle="blocks",
        shuffle_block=block,
        block_cache_bytes=budget,
        prefetch=2,
    )
    got, want = ftj.Loader(split, tiny), rows_read(split, tiny)
    held = got.engine.block_cache
    assert held is not None and held.budget == budget
    steps = 2 * len(got.engine.components[0]) // 8
    for step, batch in got.iterate(0, steps):
        assert held.stats()["block_cache_bytes"] <= budget
        assert_same(jax_to_numpy(batch), want.host_batch(step), f"step {step}")
    stats = got.stats()
    assert stats["block_cache_peak"] <= budget
    assert stats["block_drops"] > 0
    blocks = -(-len(got.engine.components[0]) // block)
    assert stats["block_reads"] > 2 * blocks  # two epochs, and blocks read again


class CountingRanges:
    """Counts the token ranges asked of a split's tokens array, by start."""

    def __init__(self, ft: ftj.FlatTokens) -> None:
        self.asked: collections.Counter[int] = collections.Counter()
        checked = ft.checked[ft.tokens_name]
        original = checked.request_ranges

        def counted(lo: np.ndarray, hi: np.ndarray) -> object:
            longer = np.asarray(hi) - np.asarray(lo) > 1  # not the fingerprint's tokens
            self.asked.update(np.asarray(lo)[longer].tolist())
            return original(lo, hi)

        self._restore = lambda: setattr(checked, "request_ranges", original)
        checked.request_ranges = counted  # type: ignore[method-assign]

    def close(self) -> None:
        self._restore()


@pytest.fixture
def counting() -> Iterator[list[CountingRanges]]:
    made: list[CountingRanges] = []
    yield made
    for c in made:
        c.close()


@pytest.mark.parametrize("prefetch", [0, 6])
def test_each_block_is_read_once_an_epoch(counting: list[CountingRanges], prefetch: int) -> None:
    """Steps read one by one with the default budget: each block's token
    range is asked for once in an epoch, but for the blocks at the seams of
    two lanes' stretches (read at the epoch's start by one lane and at its
    end by the other: at most ``L - 1``, dropped between as the blocks needed
    furthest ahead). Steps read ahead on 6 threads with room for every
    block: each block once, the threads that need one sharing its read. The
    rows are exact."""
    ft = corpus(seed=3, count=400)
    seq_len, block = 8, 5
    room = None if prefetch == 0 else 1 << 24
    config = ftj.LoaderConfig(
        batch_size=4,
        seq_len=seq_len,
        shuffle="blocks",
        shuffle_block=block,
        prefetch=prefetch,
        block_cache_bytes=room,
    )
    loader = ftj.Loader(ft, config)
    n = len(loader.engine.components[0])
    count = CountingRanges(ft)
    counting.append(count)
    steps = n // 4
    want = rows_read(ft, config)
    batches = dict(loader.iterate(0, steps))
    count.close()
    starts = {max(b * block * seq_len - 1, 0) for b in range(-(-n // block))}
    assert set(count.asked) == starts
    twice = [b for b, times in count.asked.items() if times > 1]
    assert len(twice) <= (4 - 1 if room is None else 0) and max(count.asked.values()) <= 2
    for step in (0, steps // 2, steps - 1):
        assert_same(jax_to_numpy(batches[step]), want.host_batch(step), f"step {step}")


def test_the_budget_is_checked_with_the_memory_and_refused_without_blocks(
    split: ftj.FlatTokens,
) -> None:
    with pytest.raises(ValueError, match=r"^LoaderConfig.block_cache_bytes is 5, but shuffle"):
        ftj.LoaderConfig(batch_size=4, seq_len=8, block_cache_bytes=5)
    config = ftj.LoaderConfig(batch_size=4, seq_len=8, shuffle="blocks", block_cache_bytes=1 << 60)
    with pytest.raises(ValueError, match=r"block_cache_bytes 1,152,921,504,606,846,976"):
        ftj.Loader(split, config)


def brute_next_use(
    sampler: BlockSampler, epoch: int, window: int, lanes: tuple[int, int], now: int
) -> int | None:
    """Stream samples from ``now`` to the first one of epoch ``epoch`` that a
    lane of ``lanes`` reads in ``window``; ``None`` if none does."""
    n = sampler.num_records
    first = max(now, epoch * n)
    s = np.arange(first, (epoch + 1) * n, dtype=np.int64)
    s = s[(s % sampler.lanes >= lanes[0]) & (s % sampler.lanes < lanes[1])]
    if not s.size:
        return None
    _, j = sampler.positions(s - sampler.offset)
    hit = np.flatnonzero(sampler.window_of(j) == window)
    return None if not hit.size else int(s[hit[0]] - now)


@pytest.mark.parametrize(("n", "lanes"), [(4, 5), (3, 8), (1, 2), (5, 7)])
def test_next_use_with_fewer_records_than_lanes(n: int, lanes: int) -> None:
    """Lanes of no samples share their offset with the next lane's: next_use
    said NEVER for BlockSampler(4, 2, 2, 5, 0), epoch 1, window 0, lanes 0-4,
    at sample 7, which lane 2 reads then (hypothesis found it)."""
    for block, window, seed in [(2, 2, 0), (1, 3, 5), (3, 1, 9)]:
        sampler = BlockSampler(n, block, window, lanes, seed)
        windows = -(-n // min(block * window, n))
        for l0 in range(lanes):
            for l1 in range(l0 + 1, lanes + 1):
                for epoch in range(2):
                    for now in range(epoch * n, (epoch + 1) * n + 1):
                        for w in range(windows):
                            got = int(sampler.next_use([epoch], [w], (l0, l1), now)[0])
                            want = brute_next_use(sampler, epoch, w, (l0, l1), now)
                            assert (got == NEVER) == (want is None), (l0, l1, epoch, now, w)
                            if want is not None:
                                assert abs(got - want // lanes) <= 1


@settings(max_examples=150, deadline=None)
@given(
    n=st.integers(1, 60),
    block=st.integers(1, 6),
    window=st.integers(1, 3),
    lanes=st.integers(1, 8),
    seed=st.integers(0, 2**32),
    data=st.data(),
)
def test_next_use_against_a_brute_force(
    n: int, block: int, window: int, lanes: int, seed: int, data: st.DataObject
) -> None:
    """NEVER exactly when no lane of the range reads the window again in
    its epoch; otherwise the lane samples until it, within one."""
    sampler = BlockSampler(n, block, window, lanes, seed)
    l0 = data.draw(st.integers(0, lanes - 1))
    l1 = data.draw(st.integers(l0 + 1, lanes))
    epoch = data.draw(st.integers(0, 2))
    now = data.draw(st.integers(epoch * n, (epoch + 1) * n))
    windows = -(-n // min(block * window, n))
    for w in range(windows):
        got = int(sampler.next_use([epoch], [w], (l0, l1), now)[0])
        want = brute_next_use(sampler, epoch, w, (l0, l1), now)
        if want is None:
            assert got == NEVER, (w, got)
        else:
            assert got != NEVER, (w, want)
            assert abs(got - want // lanes) <= 1, (w, got, want)
