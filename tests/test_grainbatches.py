"""``FlatTokensSource.batches``: whole steps as grain elements, picked by the
loader's own step arithmetic (mixtures, batch-size schedules, the padded last
step of an evaluation pass), checked against ``Loader.host_batch`` and a
brute-force count."""

from __future__ import annotations

import collections
import pickle
from pathlib import Path

import grain
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from memurls import memory_url

import flat_tokens_jax as ftj
from flat_tokens_jax.core import limits
from flat_tokens_jax.grain.grain import FlatTokensSource

SEQ_LEN = 16


def sequences(n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 5000, rng.integers(1, 40)) for _ in range(n)]


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two datasets on local disk: ``a`` with 300 validation sequences (not a
    multiple of 8 or 24), and ``b``."""
    root = tmp_path_factory.mktemp("grainbatches")
    storage_format = ftj.StorageFormat(shard_tokens=1024, chunk_tokens=64)
    splits = {"train": sequences(200, 0), "validation": sequences(300, 1)}
    ftj.write_dataset(root / "a", splits, storage_format=storage_format)
    ftj.write_dataset(root / "b", {"train": sequences(150, 2)}, storage_format=storage_format)
    return root


def key(row: dict[str, np.ndarray]) -> tuple[bytes, ...]:
    return tuple(row[k].tobytes() for k in ("inputs", "targets", "loss_mask"))


def assert_equal(got: dict[str, np.ndarray], want: dict[str, np.ndarray], where: str) -> None:
    assert sorted(got) == sorted(want), where
    for key in want:
        assert got[key].dtype == want[key].dtype, (where, key)
        np.testing.assert_array_equal(got[key], want[key], err_msg=f"{where} {key}")


def mixture(path: Path) -> ftj.Mixture:
    a = ftj.open_dataset(path / "a")["train"]
    b = ftj.open_dataset(path / "b")["train"]
    return ftj.Mixture({"a": (a, 0.7), "b": (b, 0.3)}, seed=4, schedule=[(5, {"a": 0.2, "b": 0.8})])


@pytest.mark.parametrize("layout", ["fields", "maxtext"])
def test_a_mixtures_steps_are_the_loaders(path: Path, layout: str) -> None:
    """Issue 36: a Mixture through grain is the loader's blend (its weight
    schedule, per-component seeds and epochs), not grain's mixing: step ``s``
    row ``r`` reads what ``Loader.host_batch(s)`` reads, whole and per shard."""
    sizes = [(0, 8), (4, 16)]
    cfg = ftj.LoaderConfig(sizes, SEQ_LEN, seed=9, prefetch=0, layout=layout, max_segments=8)
    loader = ftj.Loader(mixture(path), cfg)
    src = FlatTokensSource(mixture(path), SEQ_LEN, layout=layout, max_segments=8)
    whole = src.batches(sizes, seed=9, num_epochs=None)
    halves = [src.batches(sizes, seed=9, num_epochs=None, shard=(i, 2)) for i in range(2)]
    for step in [0, 3, 4, 5, 11, 40, 3]:
        want = loader.host_batch(step)
        assert_equal(whole[step], want, f"step {step}")
        joined = {k: np.concatenate([h[step][k] for h in halves]) for k in want}
        assert_equal(joined, want, f"step {step}, two shards")
    ds = grain.MapDataset.source(whole).to_iter_dataset()
    for step, got in zip(range(6), ds, strict=False):
        assert_equal(got, loader.host_batch(step), f"grain step {step}")


def test_a_mixture_source_names_what_it_cannot_do(path: Path) -> None:
    src = FlatTokensSource(mixture(path), SEQ_LEN)
    with pytest.raises(ValueError, match=r"num_epochs=1 does not apply to a Mixture.*None"):
        src.batches(8)
    with pytest.raises(TypeError, match=r"drawn by step, not by index"):
        src[0]
    assert src.vocab_size == 5000 and src.max_token_id == 4999


def test_a_mixtures_steps_cross_processes(path: Path) -> None:
    """A pickled Mixture source blends again over the components it reopens:
    the same steps in a copy and in two grain worker processes (``mp_prefetch``)."""
    cfg = ftj.LoaderConfig(8, SEQ_LEN, seed=3, prefetch=0)
    loader = ftj.Loader(mixture(path), cfg)
    batches = FlatTokensSource(mixture(path), SEQ_LEN).batches(8, seed=3, num_epochs=None)
    again = pickle.loads(pickle.dumps(batches))
    assert repr(again) == repr(batches) and again.source.mixture is not None
    assert_equal(again[6], loader.host_batch(6), "a pickled copy")
    options = grain.MultiprocessingOptions(num_workers=2)
    ds = grain.MapDataset.source(batches)[:8].to_iter_dataset().mp_prefetch(options)
    for step, got in enumerate(ds):
        assert_equal(got, loader.host_batch(step), f"step {step} from a worker")
    assert step == 7
    a, b = (ftj.open_dataset(path / n)["train"] for n in ("a", "b"))
    given = ftj.Mixture([(a, 1), (b, 2)], seed=1, period=50, schedule=[(2, [3, 1])])
    want = ftj.Loader(given, cfg).host_batch(4)
    source = FlatTokensSource(given, SEQ_LEN)
    assert_equal(
        pickle.loads(pickle.dumps(source)).batches(8, seed=3, num_epochs=None)[4], want, ""
    )


@pytest.mark.parametrize("shuffle", [True, False])
def test_a_batch_size_schedule_is_the_loaders(path: Path, shuffle: bool) -> None:
    ft = ftj.open_dataset(path / "a")["train"]
    sizes = [(0, 4), (3, 12), (7, 8)]
    cfg = ftj.LoaderConfig(sizes, SEQ_LEN, seed=2, shuffle=shuffle, num_epochs=2, prefetch=0)
    loader = ftj.Loader(ft, cfg)
    batches = FlatTokensSource(ft, SEQ_LEN).batches(sizes, seed=2, shuffle=shuffle, num_epochs=2)
    assert len(batches) == loader.num_batches
    for step in [0, 2, 3, 6, 7, 8, len(batches) - 1]:
        assert_equal(batches[step], loader.host_batch(step), f"step {step}")
    with pytest.raises(ValueError, match=r"batch_size 12 \(from step 3\) does not divide over 8"):
        FlatTokensSource(ft, SEQ_LEN).batches([(0, 8), (3, 12)], shard=(0, 8))


@pytest.mark.parametrize("packing", [True, False])
@pytest.mark.parametrize("batch_size", [8, 24])
def test_an_evaluation_pass_reads_every_record_once_the_last_step_padded(
    path: Path, batch_size: int, packing: bool
) -> None:
    """Issue 36: ``num_epochs=1, shuffle=False`` over the validation split
    (300 sequences) dropped the last partial step; now every record is read
    exactly once, counted row by row against ``src[i]``, and the rows past the
    last record are padding a trainer ignores (``loss_mask`` False), as the
    ``Loader``'s own last step."""
    val = ftj.open_dataset(path / "a")["validation"]
    src = FlatTokensSource(val, SEQ_LEN, packing)
    n = len(src)
    assert n % batch_size, "the test needs a partial last step"
    batches = src.batches(batch_size, shuffle=False, num_epochs=1)
    steps = list(grain.MapDataset.source(batches).to_iter_dataset())
    assert len(steps) == len(batches) == -(-n // batch_size)
    records = collections.Counter(key(src[i]) for i in range(n))
    seen: collections.Counter[tuple[bytes, ...]] = collections.Counter()
    padding = 0
    for step in steps:
        for r in range(batch_size):
            row = {k: v[r] for k, v in step.items()}
            if not row["segment_ids"].any():
                assert not row["loss_mask"].any() and not row["positions"].any()
                padding += 1
            else:
                seen[key(row)] += 1
    assert seen == records and padding == len(steps) * batch_size - n
    assert not steps[-1]["loss_mask"][n % batch_size :].any()
    cfg = ftj.LoaderConfig(batch_size, SEQ_LEN, packing, shuffle=False, num_epochs=1, prefetch=0)
    loader = ftj.Loader(val, cfg)
    assert_equal(steps[-1], loader.host_batch(len(steps) - 1), "the last step")


def test_the_largest_step_of_a_schedule_must_fit_in_memory(
    path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A schedule whose later steps could not fit in memory is refused when
    the batches are made, as ``Loader`` refuses it, not at that step."""
    ft = ftj.open_dataset(path / "a")["train"]
    monkeypatch.setattr(limits, "memory_bytes", lambda: 64 << 20)
    sizes = [(0, 8), (5, 10**6)]
    FlatTokensSource(ft, SEQ_LEN).batches(8)
    with pytest.raises(ValueError, match=r"memory"):
        FlatTokensSource(ft, SEQ_LEN).batches(sizes)
    with pytest.raises(ValueError, match=r"memory"):
        ftj.Loader(ft, ftj.LoaderConfig(sizes, SEQ_LEN, prefetch=0))


@settings(max_examples=20, deadline=None)
@given(data=st.data())
def test_any_blend_schedule_and_shard_is_the_loaders(data: st.DataObject) -> None:
    """Random mixtures (weights, a weight change), batch-size schedules,
    shard counts, seeds and steps: the shards of a step, joined, are
    ``Loader.host_batch`` of that step."""
    url = memory_url()
    seqs = [list(range(1 + i, 1 + i + n)) for i, n in enumerate([3, 9, 4, 12, 5, 7, 2, 8])]
    ftj.write_dataset(url, {"train": seqs, "validation": seqs[::-1]}, overwrite=True)
    ds = ftj.open_dataset(url)
    count = data.draw(st.sampled_from([1, 2, 4]), label="shards")
    sizes = sorted(data.draw(st.sets(st.integers(1, 4), min_size=1, max_size=3)))
    schedule = [(step * 3, count * n) for step, n in enumerate(sizes)]
    weights = data.draw(st.lists(st.integers(1, 5), min_size=2, max_size=2), label="weights")
    change = data.draw(st.lists(st.integers(0, 5), min_size=2, max_size=2).filter(any))
    components = {"t": (ds["train"], weights[0]), "v": (ds["validation"], weights[1])}
    seed = data.draw(st.integers(0, 2**32), label="seed")
    blend = ftj.Mixture(components, seed=seed % 7, schedule=[(4, change)])
    seq_len = data.draw(st.integers(2, 6), label="seq_len")
    src = FlatTokensSource(blend, seq_len, data.draw(st.booleans(), label="packing"))
    cfg = ftj.LoaderConfig(schedule, seq_len, src.packing, seed=seed, prefetch=0)
    loader = ftj.Loader(blend, cfg)
    shards = [
        src.batches(schedule, seed=seed, num_epochs=None, shard=(i, count)) for i in range(count)
    ]
    for step in data.draw(st.lists(st.integers(0, 30), min_size=1, max_size=4), label="steps"):
        got = {k: np.concatenate([s[step][k] for s in shards]) for k in shards[0][step]}
        assert_equal(got, loader.host_batch(step), f"step {step}")
