import dataclasses

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from flat_tokens_jax.sampling.sampling import MAX_N, EpochsExhausted, IndexSampler, permute

# The uint64 arithmetic wraps on purpose; any numpy overflow warning means a scalar slipped in.
pytestmark = pytest.mark.filterwarnings("error")

M64 = 2**64 - 1
GAMMA = 0x9E3779B97F4A7C15  # The splitmix64 increment.
# Tests that permute millions of indices do it in chunks: arrays that fit in cache run about
# three times faster than one huge call.
CHUNK = 1 << 16


def reference_mix(x: int) -> int:
    x ^= x >> 30
    x = x * 0xBF58476D1CE4E5B9 & M64
    x ^= x >> 27
    x = x * 0x94D049BB133111EB & M64
    return x ^ (x >> 31)


def reference_permute(i: int, n: int, seed: int, epoch: int) -> int:
    """The documented algorithm on Python ints, one index at a time."""
    half = (max(2, (n - 1).bit_length()) + 1) // 2
    mask = (1 << half) - 1
    state = reference_mix(reference_mix((seed + GAMMA) & M64) ^ epoch)
    keys = [reference_mix((state + GAMMA * (r + 1)) & M64) for r in range(6)]
    while True:
        left, right = i >> half, i & mask
        for key in keys:
            left, right = right, left ^ (reference_mix(right ^ key) & mask)
        i = (left << half) | right
        if i < n:
            return i


def assert_permutations(out: np.ndarray, sizes: np.ndarray) -> None:
    """``out`` holds ``permute(arange(s), s)`` for each ``s`` in ``sizes``, back to back."""
    starts = np.repeat(np.cumsum(sizes) - sizes, sizes)
    assert out.dtype == np.int64 and out.shape == starts.shape
    assert (out >= 0).all() and (out < np.repeat(sizes, sizes)).all()
    assert (np.bincount(starts + out, minlength=out.size) == 1).all()


def all_ranges(sizes: np.ndarray, seed: int, epoch: int) -> np.ndarray:
    """``permute(arange(s), s)`` for every ``s`` in ``sizes``, in one vectorised pass per chunk."""
    n = np.repeat(sizes, sizes)
    index = np.arange(n.size) - np.repeat(np.cumsum(sizes) - sizes, sizes)
    bounds = range(CHUNK, n.size, CHUNK)
    parts = zip(np.split(index, bounds), np.split(n, bounds), strict=True)
    return np.concatenate([permute(i, s, seed=seed, epoch=epoch) for i, s in parts])


@pytest.mark.parametrize(("seed", "epoch"), [(0, 0), (1, 3), (M64, M64)])
def test_every_n_up_to_5000_is_a_bijection(seed: int, epoch: int) -> None:
    sizes = np.arange(1, 5001)
    assert_permutations(all_ranges(sizes, seed, epoch), sizes)


@pytest.mark.parametrize("k", range(1, 23))
def test_sizes_around_powers_of_two_are_bijections(k: int) -> None:
    for n in (2**k - 1, 2**k, 2**k + 1):
        out = np.concatenate(
            [permute(i, n, seed=7, epoch=k) for i in np.array_split(np.arange(n), n // CHUNK + 1)]
        )
        assert out.dtype == np.int64 and out.min() >= 0 and out.max() < n
        assert (np.bincount(out, minlength=n) == 1).all()


def test_one_call_per_n_matches_the_batched_call() -> None:
    sizes = np.array([1, 2, 3, 4, 5, 17, 100, 1023, 1024, 1025])
    batched = all_ranges(sizes, seed=9, epoch=2)
    single = [permute(np.arange(s), int(s), seed=9, epoch=2) for s in sizes]
    assert batched.tolist() == np.concatenate(single).tolist()


def test_empty_and_tiny_ranges() -> None:
    assert permute([], 0, seed=0, epoch=0).shape == (0,)
    assert permute(np.zeros(0, np.int64), 5, seed=0, epoch=0).dtype == np.int64
    assert permute([0], 1, seed=123, epoch=456).tolist() == [0]
    assert sorted(permute([0, 1], 2, seed=1, epoch=0).tolist()) == [0, 1]


@pytest.mark.parametrize("seed", [0, 1, 2**63, M64])
def test_shuffle_moves_records_like_a_random_permutation(seed: int) -> None:
    n = 1000
    order = permute(np.arange(n), n, seed=seed, epoch=0)
    # A uniformly random permutation of 1000 moves an element (n**2 - 1) / 3n ~ 333 places on
    # average, with a standard deviation of the mean near 8, and has one fixed point on average.
    assert 290 < np.abs(order - np.arange(n)).mean() < 375
    assert (order == np.arange(n)).sum() <= 8


def test_first_position_is_spread_evenly_over_epochs() -> None:
    heads = permute(np.zeros(5000, np.int64), 10, seed=0, epoch=np.arange(5000))
    counts = np.bincount(heads, minlength=10)
    assert counts.min() > 400 and counts.max() < 600  # 500 +- 22 per bin for uniform heads.


@pytest.mark.parametrize("n", [100, 101, 1000, 4097, 2**20 + 1])
def test_orders_differ_between_seeds_and_epochs(n: int) -> None:
    index = np.arange(min(n, 4096))
    base = permute(index, n, seed=0, epoch=0)
    assert not np.array_equal(base, index)
    others = [(0, 1), (1, 0), (2, 0), (0, 2), (1, 1), (M64, 0), (0, M64)]
    orders = [base] + [permute(index, n, seed=s, epoch=e) for s, e in others]
    for i, a in enumerate(orders):
        for b in orders[i + 1 :]:
            assert (a == b).mean() < 0.1  # Two random orders agree at about one position.


@st.composite
def permute_cases(draw: st.DrawFn) -> tuple[list[int], int, int, int]:
    n = draw(st.one_of(st.integers(1, 300), st.integers(1, MAX_N)))
    indices = draw(st.lists(st.integers(0, n - 1), max_size=30))
    return indices, n, draw(st.integers(0, M64)), draw(st.integers(0, M64))


@given(permute_cases())
def test_vectorised_matches_one_at_a_time_and_the_reference(
    case: tuple[list[int], int, int, int],
) -> None:
    indices, n, seed, epoch = case
    out = permute(np.array(indices, np.int64), n, seed=seed, epoch=epoch)
    one_by_one = [int(permute([i], n, seed=seed, epoch=epoch)[0]) for i in indices]
    assert out.tolist() == one_by_one
    assert one_by_one == [reference_permute(i, n, seed, epoch) for i in indices]


def test_per_element_n_and_epoch_match_scalar_calls() -> None:
    index, n, epoch = np.array([0, 5, 9, 3]), np.array([1, 6, 10, 2**40]), np.array([4, 0, 4, 7])
    out = permute(index, n, seed=11, epoch=epoch)
    assert out.tolist() == [
        int(permute([i], int(s), seed=11, epoch=int(e))[0])
        for i, s, e in zip(index, n, epoch, strict=True)
    ]


def test_shape_is_kept() -> None:
    grid = np.arange(12).reshape(3, 4)
    out = permute(grid, 12, seed=3, epoch=0)
    assert out.shape == (3, 4)
    assert out.reshape(-1).tolist() == permute(np.arange(12), 12, seed=3, epoch=0).tolist()
    assert permute(4, 12, seed=3, epoch=0).shape == ()


@pytest.mark.parametrize("n", [2**62 + 12345, MAX_N])
def test_huge_n(n: int) -> None:
    index = np.array([0, 1, 2, 2**61, n - 2, n - 1], np.int64)
    out = permute(index, n, seed=5, epoch=9)
    assert out.dtype == np.int64 and ((out >= 0) & (out < n)).all()
    assert len(set(out.tolist())) == len(index)
    assert out.tolist() == [reference_permute(int(i), n, 5, 9) for i in index]


# GOLDEN VALUES. These freeze the exact shuffle. Changing any of them is a breaking change: it
# reorders every shuffled training run, so a resumed run would read different data. It needs a
# changelog entry, never a quiet update of these literals.
def test_golden_small() -> None:
    assert permute(np.arange(10), 10, seed=0, epoch=0).tolist() == [8, 7, 6, 1, 4, 9, 2, 0, 5, 3]


def test_golden_first_twenty() -> None:
    out = permute(np.arange(20), 1000, seed=1234, epoch=7)
    assert out.reshape(2, 10).tolist() == [
        [62, 329, 940, 824, 799, 14, 942, 582, 57, 491],
        [353, 541, 207, 250, 707, 742, 273, 50, 22, 115],
    ]


def test_golden_large_n() -> None:
    out = permute([0, 1, 2**39, 2**40 + 2], 2**40 + 3, seed=5, epoch=2)
    assert out.tolist() == [673378284072, 744510263168, 1090021410477, 838051776095]


def test_golden_sampler() -> None:
    sampler = IndexSampler(num_records=7, seed=42)
    assert sampler.records(np.arange(14)).tolist() == [3, 1, 4, 0, 2, 6, 5, 5, 3, 6, 1, 2, 0, 4]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"indices": [-1]}, r"indices must be in \[0, n\), got -1"),
        ({"indices": [0, 10]}, r"indices must be in \[0, n\), got 10 at flat position 1: n=10"),
        ({"indices": [1.0]}, "indices must be integers"),
        ({"n": -1, "indices": []}, r"n must be in \[0, 9223372036854775807\], got -1"),
        ({"n": 2**63}, r"n must be in \[0, 9223372036854775807\]"),
        ({"seed": -1}, r"seed must be an int in \[0, 2\*\*64 - 1\], got -1"),
        ({"seed": 2**64}, "seed must be an int in"),
        ({"seed": 1.5}, "seed must be an int"),
        ({"epoch": -3}, "epoch must be in"),
        ({"epoch": 2**64}, "epoch must be integers"),
    ],
)
def test_permute_refuses_bad_arguments(kwargs: dict[str, object], match: str) -> None:
    args: dict[str, object] = {"indices": [0, 1], "n": 10, "seed": 0, "epoch": 0} | kwargs
    with pytest.raises(ValueError, match=match):
        permute(args["indices"], args["n"], seed=args["seed"], epoch=args["epoch"])  # type: ignore[arg-type]


def test_sampler_epochs_cover_every_record_once_in_new_orders() -> None:
    n, num_epochs = 37, 6
    sampler = IndexSampler(num_records=n, seed=5, num_epochs=num_epochs)
    g = np.arange(n * num_epochs)
    records = sampler.records(g)
    assert records.dtype == np.int64 and sampler.num_samples == n * num_epochs
    by_epoch = records.reshape(num_epochs, n)
    for row in by_epoch:
        assert sorted(row.tolist()) == list(range(n))
    assert len({tuple(row) for row in by_epoch.tolist()}) == num_epochs
    assert sampler.epochs(g).tolist() == (g // n).tolist()
    expected = [int(permute([i % n], n, seed=5, epoch=i // n)[0]) for i in g]
    assert records.tolist() == expected


def test_sampler_records_any_order_of_indices() -> None:
    sampler = IndexSampler(num_records=1000, seed=3)
    g = np.array([5_000_017, 3, 999, 1000, 2**62, 3])
    assert sampler.records(g).tolist() == [int(sampler.records([i])[0]) for i in g]
    assert sampler.records(g)[1] == sampler.records(g)[5]
    assert sampler.records(g[::-1]).tolist() == sampler.records(g).tolist()[::-1]


def test_sampler_without_shuffle_is_the_identity() -> None:
    sampler = IndexSampler(num_records=11, shuffle=False)
    g = np.arange(50)
    assert sampler.records(g).tolist() == (g % 11).tolist()
    assert sampler.num_samples is None


def test_sampler_raises_when_epochs_run_out() -> None:
    sampler = IndexSampler(num_records=3, seed=1, num_epochs=2)
    assert sorted(sampler.records(np.arange(6)).tolist()) == [0, 0, 1, 1, 2, 2]
    with pytest.raises(EpochsExhausted, match="index 6 is past the end: 3 records x 2 epochs"):
        sampler.records([0, 6])
    with pytest.raises(IndexError):
        sampler.epochs([7])


def test_sampler_refuses_bad_global_indices() -> None:
    with pytest.raises(ValueError, match=r"global sample index must be in .*got -2"):
        IndexSampler(num_records=4).records([1, -2])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_records": 0}, "num_records must be an int in .*got 0"),
        ({"num_records": -5}, "num_records must be an int in"),
        ({"num_records": 2.0}, "num_records must be an int"),
        ({"num_records": True}, "num_records must be an int"),
        ({"seed": -1}, "seed must be an int in .*got -1"),
        ({"seed": 2**64}, "seed must be an int in"),
        ({"seed": "7"}, "seed must be an int"),
        ({"num_epochs": 0}, "num_epochs must be an int in .* or null/None, got 0"),
        ({"num_epochs": 1.5}, "num_epochs must be an int"),
        ({"shuffle": 1}, "shuffle must be True or False"),
    ],
)
def test_sampler_validates_fields(kwargs: dict[str, object], match: str) -> None:
    args: dict[str, object] = {"num_records": 10} | kwargs
    with pytest.raises(ValueError, match=match):
        IndexSampler(**args)  # type: ignore[arg-type]


def test_sampler_is_frozen() -> None:
    sampler = IndexSampler(num_records=4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        sampler.seed = 1  # type: ignore[misc]
