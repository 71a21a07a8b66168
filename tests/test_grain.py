"""The grain adapter: elements equal Loader rows; grain pipelines, worker processes, checkpoints."""

from __future__ import annotations

import concurrent.futures
import os
import pickle
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import grain
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from memurls import memory_url
from reference import packed_row, padded_row, reference_batch

import flat_tokens_jax as ftj
from flat_tokens_jax.data.records import Windows
from flat_tokens_jax.grain.grain import FlatTokensSource

SEQ_LEN = 16
FIELDS = ("inputs", "targets", "segment_ids", "positions", "loss_mask")


def sequences() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, 5000, rng.integers(1, 40)) for _ in range(300)]


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A store of :func:`sequences` on local disk, so grain's worker processes can open it."""
    out = tmp_path_factory.mktemp("grain") / "ds"
    storage_format = ftj.StorageFormat(shard_tokens=1024, chunk_tokens=64)
    ftj.write_dataset(out, {"train": sequences()}, storage_format=storage_format)
    return out


def loader_rows(ft: ftj.FlatTokens, packing: bool = True, **config: Any) -> dict[str, np.ndarray]:
    """Every record, in order, as ``ftj.Loader`` makes its rows: the reference."""
    kind = ftj.PackedRecords if packing else ftj.PaddedRecords
    n = len(kind(ft, SEQ_LEN))
    cfg = ftj.LoaderConfig(
        batch_size=n, seq_len=SEQ_LEN, packing=packing, shuffle=False, prefetch=0, **config
    )
    return ftj.Loader(ft, cfg).host_batch(0)


def assert_rows_equal(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert sorted(got) == sorted(FIELDS)
    for key in FIELDS:
        assert got[key].dtype == want[key].dtype, key
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)


def stack(elements: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return {key: np.stack([e[key] for e in elements]) for key in FIELDS}


def worker_batches(keys: np.ndarray, worker_count: int, batch: int) -> list[np.ndarray]:
    """The record keys of each batch a grain DataLoader yields, in order.

    Worker ``w`` of ``W`` reads sampler positions ``w, w + W, ...`` and batches
    them itself; the loader takes one batch from each worker in turn.
    """
    workers = max(worker_count, 1)
    own = [keys[w::workers] for w in range(workers)]
    per_worker = [
        [mine[j * batch : (j + 1) * batch] for j in range(len(mine) // batch)] for mine in own
    ]
    rounds = max(len(b) for b in per_worker)
    return [b[j] for j in range(rounds) for b in per_worker if j < len(b)]


class CountingRecords:
    """Records that count their batched reads."""

    def __init__(self, records: ftj.Records) -> None:
        self.inner, self.reads = records, 0
        self.seq_len, self.packing = records.seq_len, records.packing

    def __len__(self) -> int:
        return len(self.inner)

    def __repr__(self) -> str:
        return f"CountingRecords({self.inner!r})"

    def read(self, indices: np.ndarray, columns: tuple[int, int] | None = None) -> Any:
        self.reads += 1
        return self.inner.read(indices, columns)

    def token_ranges(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self.inner.token_ranges(indices)

    def fingerprint(self) -> dict[str, Any]:
        return self.inner.fingerprint()


class ArrayRecords:
    """Packed records over encoded tokens held in memory: picklable, unlike a store's."""

    packing = ftj.Packing.WINDOWS

    def __init__(self, seqs: list[np.ndarray], seq_len: int) -> None:
        self.encoded, _ = ftj.encode(seqs)
        self.seq_len = seq_len

    def __len__(self) -> int:
        return self.encoded.size // self.seq_len

    def __repr__(self) -> str:
        return f"ArrayRecords({self.encoded.size} tokens, seq_len={self.seq_len})"

    def read(self, indices: np.ndarray, columns: tuple[int, int] | None = None) -> Any:
        # Column 0 is the token before the record, 0 before record 0.
        padded = np.concatenate([[0], self.encoded]).astype(np.uint32)
        starts = np.asarray(indices) * self.seq_len
        rows = padded[starts[:, None] + np.arange(self.seq_len + 1)]
        return Windows(rows)

    def token_ranges(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        starts = np.asarray(indices) * self.seq_len
        return starts, starts + self.seq_len

    def fingerprint(self) -> dict[str, Any]:
        return {"num_tokens": self.encoded.size}


class WithPid(grain.transforms.Map):
    """Tags an element with the id of the process that read it."""

    def map(self, element: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {**element, "pid": np.asarray(os.getpid())}


@pytest.mark.parametrize(
    "packing, start_token_id, pad_id", [(True, 0, 0), (True, 3, 0), (False, 0, 0), (False, 2, 7)]
)
def test_elements_equal_loader_rows(
    path: Path, packing: bool, start_token_id: int, pad_id: int
) -> None:
    ft = ftj.open_dataset(path)["train"]
    src = FlatTokensSource(
        path, SEQ_LEN, packing=packing, start_token_id=start_token_id, pad_id=pad_id
    )
    want = loader_rows(ft, packing, start_token_id=start_token_id, pad_id=pad_id)
    n = len(want["targets"])
    assert len(src) == n
    assert_rows_equal(stack([src[i] for i in range(n)]), want)
    assert_rows_equal(stack(src._getitems(list(range(n)))), want)
    picks = np.array([n - 1, 0, 5, 5, 2])
    assert_rows_equal(src.read_batch(picks), {k: v[picks] for k, v in want.items()})
    assert src[0]["targets"].shape == (SEQ_LEN,)


@pytest.mark.parametrize("packing", [True, False])
def test_stored_loss_mask_reaches_the_elements(tmp_path: Path, packing: bool) -> None:
    rng = np.random.default_rng(1)
    seqs = [rng.integers(0, 100, rng.integers(1, 30)) for _ in range(60)]
    masks = [rng.integers(0, 2, s.size) for s in seqs]
    with ftj.DatasetWriter(tmp_path / "ds") as w:
        w.extend("train", seqs, loss_masks=masks)
    ft = ftj.open_dataset(tmp_path / "ds")["train"]
    src = FlatTokensSource(ft, SEQ_LEN, packing=packing)
    want = loader_rows(ft, packing)
    got = src.read_batch(np.arange(len(src)))
    assert_rows_equal(got, want)
    assert 0 < got["loss_mask"].mean() < 1


datasets = st.lists(
    st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=15), min_size=1, max_size=25
)


@settings(max_examples=30)
@given(seqs=datasets, data=st.data())
def test_elements_equal_brute_force_reference(seqs: list[list[int]], data: st.DataObject) -> None:
    packing = data.draw(st.booleans())
    num_tokens = sum(map(len, seqs))
    seq_len = data.draw(st.integers(1, num_tokens if packing else 20))
    start_token_id, pad_id = data.draw(st.integers(0, 5)), data.draw(st.integers(0, 5))
    url = memory_url()
    ftj.write_dataset(
        url, {"train": seqs}, storage_format=ftj.StorageFormat(shard_tokens=64, chunk_tokens=8)
    )
    src = FlatTokensSource(
        url, seq_len, packing=packing, start_token_id=start_token_id, pad_id=pad_id
    )
    n = num_tokens // seq_len if packing else len(seqs)
    assert len(src) == n
    for record in sorted({0, n - 1, data.draw(st.integers(0, n - 1))}):
        want = (
            packed_row(seqs, record, seq_len, start_token_id)
            if packing
            else padded_row(seqs, record, seq_len, start_token_id, pad_id)
        )
        for got in (src[record], src[record - n]):
            assert {k: v.astype(int).tolist() for k, v in got.items()} == want


def test_sources_from_url_split_and_records_agree(path: Path) -> None:
    ft = ftj.open_dataset(path)["train"]
    by_url = FlatTokensSource(path, SEQ_LEN, packing=False)
    by_split = FlatTokensSource(ft, SEQ_LEN, packing=False)
    by_records = FlatTokensSource(ftj.PaddedRecords(ft, SEQ_LEN))
    assert repr(by_url) == repr(by_split) == repr(by_records)
    assert repr(by_url) != repr(FlatTokensSource(path, SEQ_LEN))
    idx = np.arange(len(by_url))
    assert_rows_equal(by_split.read_batch(idx), by_url.read_batch(idx))
    assert_rows_equal(by_records.read_batch(idx), by_url.read_batch(idx))


def test_pickled_copy_reopens_the_same_view(path: Path) -> None:
    _, view = ftj.open_dataset(path)["train"].split("1,1")
    src = FlatTokensSource(view, SEQ_LEN)
    data = pickle.dumps(src)
    assert len(data) < 4096
    copy = pickle.loads(data)
    assert repr(copy) == repr(src) and len(copy) == len(src)
    assert copy.records is not src.records
    want = loader_rows(view)
    assert_rows_equal(copy.read_batch(np.arange(len(copy))), want)


def test_records_of_another_type_are_pickled_as_they_are(path: Path) -> None:
    src = FlatTokensSource(ArrayRecords(sequences(), SEQ_LEN))
    copy = pickle.loads(pickle.dumps(src))
    assert repr(copy) == repr(src)
    want = loader_rows(ftj.open_dataset(path)["train"])
    assert_rows_equal(copy.read_batch(np.arange(len(copy))), want)


def test_first_reads_of_an_unpickled_copy_race_safely(path: Path) -> None:
    want = loader_rows(ftj.open_dataset(path)["train"])
    copy = pickle.loads(pickle.dumps(FlatTokensSource(path, SEQ_LEN)))
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        got = list(pool.map(copy.__getitem__, range(len(copy))))
    assert_rows_equal(stack(got), want)


def test_memory_store_refuses_to_pickle() -> None:
    url = memory_url()
    ftj.write_dataset(url, {"train": [[1, 2, 3]] * 4})
    with pytest.raises(pickle.PicklingError, match=r"memory:// store.*worker_count=0"):
        pickle.dumps(FlatTokensSource(url, 2))


def test_indices_out_of_range_and_of_the_wrong_kind(path: Path) -> None:
    src = FlatTokensSource(path, SEQ_LEN)
    n = len(src)
    np.testing.assert_array_equal(src[-1]["targets"], src[n - 1]["targets"])
    with pytest.raises(IndexError, match=rf"record index {n} is outside \[-{n}, {n}\)"):
        src[n]
    with pytest.raises(IndexError, match=rf"record index {-n - 1} is outside"):
        src.read_batch([0, -n - 1])
    with pytest.raises(ValueError, match=r"FlatTokensSource index must be an int, got 1\.0"):
        src[1.0]  # type: ignore[index]
    with pytest.raises(TypeError, match="must be integers"):
        src.read_batch(np.array([0.5]))
    with pytest.raises(ValueError, match=r"1-D \[k\]"):
        src.read_batch(np.zeros((2, 2), np.int64))
    assert src.read_batch([])["targets"].shape == (0, SEQ_LEN)


def test_construction_errors_name_the_fix(path: Path) -> None:
    ft = ftj.open_dataset(path)["train"]
    with pytest.raises(ValueError, match="seq_len is required"):
        FlatTokensSource(path)
    with pytest.raises(TypeError, match=r"pick a split: ds\['train'\]"):
        FlatTokensSource(ftj.open_dataset(path), SEQ_LEN)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"seq_len must be an int >= 1 or null/None, got 0"):
        FlatTokensSource(path, 0)
    with pytest.raises(ValueError, match="has no records"):
        FlatTokensSource(path, ft.num_tokens + 1)
    with pytest.raises(ValueError, match="seq_len 8 and packing True were asked for"):
        FlatTokensSource(ftj.PackedRecords(ft, SEQ_LEN), 8)
    with pytest.raises(ValueError, match="seq_len 16 and packing False were asked for"):
        FlatTokensSource(ftj.PackedRecords(ft, SEQ_LEN), packing=False)
    for field, bad, bounds in (
        ("start_token_id", -1, r"in \[0, 2\*\*31 - 1\] or null/None"),
        ("pad_id", 2**31, r"in \[-2147483648, 2\*\*31 - 1\]"),
        ("pad_id", True, r"in \[-2147483648, 2\*\*31 - 1\]"),
    ):
        # The bounds of LoaderConfig's field of the same name: the ids are int32.
        with pytest.raises(ValueError, match=rf"^{field} must be an int {bounds}, got {bad}"):
            FlatTokensSource(path, SEQ_LEN, **{field: bad})
        with pytest.raises(ValueError, match=rf"^LoaderConfig.{field} must be an int {bounds}"):
            ftj.LoaderConfig(batch_size=1, seq_len=SEQ_LEN, **{field: bad})
    with pytest.raises(ValueError, match="options apply to a URL only"):
        FlatTokensSource(ft, SEQ_LEN, options=ftj.StoreOptions())
    mixture = ftj.Mixture([(ft, 1.0), (ft, 1.0)])
    for seq_len in (None, SEQ_LEN):
        with pytest.raises(TypeError, match=r"drawn by step.*Loader\(mixture, LoaderConfig"):
            FlatTokensSource(mixture, seq_len)
    with pytest.raises(TypeError, match="got int"):
        FlatTokensSource(3, SEQ_LEN)  # type: ignore[arg-type]


def test_reads_per_batch(path: Path) -> None:
    ft = ftj.open_dataset(path)["train"]
    records = CountingRecords(ftj.PackedRecords(ft, SEQ_LEN))
    src = FlatTokensSource(records)
    batch = 8
    # grain's batched-read hook reaches the source: one read for many records.
    got = grain.MapDataset.source(src)._getitems([4, 1, 9])
    assert records.reads == 1
    assert_rows_equal(stack(got), src.read_batch([4, 1, 9]))

    records.reads = 0
    per_record = grain.MapDataset.source(src).shuffle(seed=3).batch(batch)
    firsts = [per_record[i] for i in range(3)]
    assert records.reads == 3 * batch, (
        "grain's MapDataset.batch now reads through _getitems: update the read "
        "costs in flat_tokens_jax/grain/grain.py and docs/guide/trainers.md"
    )

    records.reads = 0
    batched = grain.MapDataset.range(len(src)).shuffle(seed=3).batch(batch).map(src.read_batch)
    for i in range(3):
        assert_rows_equal(batched[i], firsts[i])
    assert records.reads == 3
    assert len(batched) == len(per_record)


def test_the_guides_data_loader_example_runs_as_a_script_in_the_sample_data(
    tmp_path: Path,
) -> None:
    """Issue 35: the guide's ``DataLoader`` example, pasted into a script, hung:
    grain's workers import the script again and ran its top level, starting
    workers of their own. The guide's block is a script with the guard; run as
    one, where ``scripts/sample_data.py`` made the data it reads (it trains a
    tokenizer: the convert extra)."""
    pytest.importorskip("tokenizers")
    root = Path(__file__).resolve().parents[1]
    guide = (root / "docs" / "guide" / "trainers.md").read_text()
    blocks = re.findall(r"^```python\n(.*?)^```", guide, re.M | re.S)
    (script,) = [b for b in blocks if "grain.DataLoader(" in b]
    made = subprocess.run(
        [sys.executable, str(root / "scripts" / "sample_data.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert made.returncode == 0, made.stderr
    (tmp_path / "grain_loader.py").write_text(script)
    ran = subprocess.run(
        [sys.executable, "grain_loader.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert (ran.returncode, ran.stdout) == (0, "(32, 256)\n"), ran.stderr


@pytest.mark.parametrize("worker_count", [0, 2])
def test_data_loader_with_workers_and_checkpoint(path: Path, worker_count: int) -> None:
    src = FlatTokensSource(path, SEQ_LEN)
    want = loader_rows(ftj.open_dataset(path)["train"])
    batch = 16
    sampler = grain.samplers.IndexSampler(
        num_records=len(src),
        shard_options=grain.sharding.ShardByJaxProcess(drop_remainder=True),
        shuffle=True,
        num_epochs=1,
        seed=7,
    )
    loader = grain.DataLoader(
        data_source=src,
        sampler=sampler,
        operations=[WithPid(), grain.transforms.Batch(batch, drop_remainder=True)],
        worker_count=worker_count,
    )
    keys = np.array([sampler[i].record_key for i in range(len(src))])
    expected = worker_batches(keys, worker_count, batch)
    it = iter(loader)
    head = [next(it) for _ in range(3)]
    state = it.get_state()
    tail = list(it)
    assert len(head) + len(tail) == len(expected)
    for got, rows in zip(head + tail, expected, strict=True):
        assert_rows_equal({k: got[k] for k in FIELDS}, {k: v[rows] for k, v in want.items()})
    pids = set(np.concatenate([b["pid"] for b in head + tail]).tolist())
    if worker_count:
        assert len(pids) == worker_count and os.getpid() not in pids
    else:
        assert pids == {os.getpid()}

    resumed = iter(loader)
    resumed.set_state(state)
    again = list(resumed)
    assert len(again) == len(tail)
    for a, b in zip(again, tail, strict=True):
        assert_rows_equal({k: a[k] for k in FIELDS}, {k: b[k] for k in FIELDS})


def test_batched_pipeline_in_worker_processes(path: Path) -> None:
    src = FlatTokensSource(path, SEQ_LEN)
    ds = grain.MapDataset.range(len(src)).shuffle(seed=5).batch(16).map(src.read_batch)
    want = list(ds)
    tagged = ds.map(lambda b: {**b, "pid": np.asarray(os.getpid())}).to_iter_dataset()
    got = list(tagged.mp_prefetch(grain.MultiprocessingOptions(num_workers=2)))
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert_rows_equal({k: a[k] for k in FIELDS}, b)
    pids = {int(b["pid"]) for b in got}
    assert len(pids) == 2 and os.getpid() not in pids


# A plain script (no absl.app.run) that keeps grain's iterators and batches
# alive until the interpreter exits, as a training script's globals do.
PLAIN_SCRIPT = """
import sys
import grain
import numpy as np
from absl import flags
from flat_tokens_jax.grain.grain import FlatTokensSource

if __name__ == "__main__":
    path, out, parsed = sys.argv[1], sys.argv[2], sys.argv[3] == "parsed"
    if parsed:  # as under absl.app.run
        flags.FLAGS(sys.argv[:1])
    src = FlatTokensSource(path, 16)
    sampler = grain.samplers.IndexSampler(
        num_records=len(src), shard_options=grain.sharding.NoSharding(),
        shuffle=True, num_epochs=1, seed=7,
    )
    loader = grain.DataLoader(
        data_source=src, sampler=sampler,
        operations=[grain.transforms.Batch(16, drop_remainder=True)], worker_count=2,
    )
    loaded = list(loader)
    ds = grain.MapDataset.range(len(src)).shuffle(seed=5).batch(16).map(src.read_batch)
    prefetched = ds.to_iter_dataset().mp_prefetch(grain.MultiprocessingOptions(num_workers=2))
    it = iter(prefetched)
    first = [next(it) for _ in range(3)]
    np.savez(out, loaded=np.stack([b["targets"] for b in loaded]),
             prefetched=np.stack([b["targets"] for b in first]))
"""


@pytest.mark.parametrize("absl", ["unparsed", "parsed"])
def test_worker_processes_from_a_plain_script_exit_cleanly(
    path: Path, tmp_path: Path, absl: str
) -> None:
    script, out = tmp_path / "train.py", tmp_path / "batches.npz"
    script.write_text(textwrap.dedent(PLAIN_SCRIPT))
    done = subprocess.run(
        [sys.executable, str(script), str(path), str(out), absl],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    for noise in ("Traceback", "Exception ignored"):
        assert noise not in done.stderr, done.stderr
    # The shared memory of a batch the script leaves, queued or held, is
    # removed by Python's resource tracker once the script ends, with this
    # warning, before the run returns: /dev/shm counted before and after
    # would show nothing left, leak or not.
    assert "leaked shared_memory" not in done.stderr, done.stderr
    got = np.load(out)
    src = FlatTokensSource(path, SEQ_LEN)
    sampler = grain.samplers.IndexSampler(
        num_records=len(src),
        shard_options=grain.sharding.NoSharding(),
        shuffle=True,
        num_epochs=1,
        seed=7,
    )
    keys = np.array([sampler[i].record_key for i in range(len(src))])
    want = [src.read_batch(rows)["targets"] for rows in worker_batches(keys, 2, 16)]
    np.testing.assert_array_equal(got["loaded"], np.stack(want))
    in_process = grain.MapDataset.range(len(src)).shuffle(seed=5).batch(16).map(src.read_batch)
    np.testing.assert_array_equal(
        got["prefetched"], np.stack([in_process[i]["targets"] for i in range(3)])
    )


def test_an_unset_start_token_id_is_the_recorded_one_as_in_the_loader(tmp_path: Path) -> None:
    seqs = [[1, 2], [3, 4, 5], [6, 7, 8]]
    ftj.write_dataset(tmp_path / "d", {"train": seqs}, info=ftj.DatasetInfo(start_token_id=9))
    ft = ftj.open_dataset(tmp_path / "d")["train"]
    src = FlatTokensSource(ft, 4)
    loader = ftj.Loader(ft, ftj.LoaderConfig(batch_size=2, seq_len=4, shuffle=False))
    assert src.start_token_id == loader.start_token_id == 9
    assert src.read_batch([0, 1])["inputs"].tolist() == loader.host_batch(0)["inputs"].tolist()
    assert src[0]["inputs"].tolist() == [9, 1, 9, 3]
    assert FlatTokensSource(ft, 4, start_token_id=0)[0]["inputs"].tolist() == [0, 1, 0, 3]


def test_an_index_past_64_bits_or_of_another_kind_is_named(path: Path) -> None:
    """Issue 35: ``FlatTokensSource(...)[10**20]`` raised ``OverflowError: Python
    int too large to convert to C long``; a uint64 past int64 wrapped to a
    negative index and read a record from the end."""
    src = FlatTokensSource(path, SEQ_LEN)
    n = len(src)
    for index in (10**20, -(10**20), np.uint64(2**63), np.uint64(2**64 - 1)):
        with pytest.raises(IndexError, match=rf"record index {index} is outside \[-{n}, {n}\)"):
            src[index]  # type: ignore[index]
    with pytest.raises(IndexError, match=rf"record index {2**64 - 1} is outside"):
        src.read_batch(np.array([0, 2**64 - 1], np.uint64))
    with pytest.raises(IndexError, match=rf"record index {10**20} is outside"):
        src.read_batch([0, 10**20])
    with pytest.raises(ValueError, match=r"FlatTokensSource index must be an int, got '3' \("):
        src["3"]  # type: ignore[index]
    with pytest.raises(ValueError, match=r"record indices\[1\] must be an int, got None"):
        src.read_batch([0, None])  # type: ignore[list-item]


@settings(max_examples=25, deadline=None)
@given(
    seqs=st.lists(st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=12), min_size=2),
    data=st.data(),
)
def test_to_grain_steps_equal_brute_force_reference(
    seqs: list[list[int]], data: st.DataObject
) -> None:
    url = memory_url()
    ftj.write_dataset(
        url, {"train": seqs}, storage_format=ftj.StorageFormat(shard_tokens=32, chunk_tokens=4)
    )
    packing = data.draw(st.booleans())
    seq_len = data.draw(st.integers(1, max(1, sum(map(len, seqs)) // 2)))
    records = len(FlatTokensSource(url, seq_len, packing))
    batch_size = data.draw(st.integers(1, 24))
    seed, shuffle = data.draw(st.integers(0, 2**64 - 1)), data.draw(st.booleans())
    num_epochs = data.draw(st.sampled_from([None, 1, 3]))
    cfg = ftj.LoaderConfig(
        batch_size, seq_len, packing, shuffle=shuffle, seed=seed, num_epochs=num_epochs
    )
    loader = ftj.Loader(ftj.open_dataset(url)["train"], cfg)
    steps = 50 if num_epochs is None else -(-records * num_epochs // batch_size)
    if num_epochs is not None:  # the last step padded, not dropped
        assert loader.num_batches == steps
    step = data.draw(st.integers(0, min(steps, 50) - 1))
    if data.draw(st.booleans()):
        step = steps - 1 if num_epochs is not None else step
    loader.next_step = step
    want = reference_batch(
        seqs,
        step,
        batch_size,
        seq_len,
        packing=packing,
        shuffle=shuffle,
        seed=seed,
        num_epochs=num_epochs,
    )
    got = next(iter(loader.to_grain()))
    assert {k: v.astype(int).tolist() for k, v in got.items()} == {
        k: v.astype(int).tolist() for k, v in want.items()
    }


def test_the_source_carries_the_datas_vocabulary(tmp_path: Path) -> None:
    """Issue 36: a trainer sizes its embedding from the source, without opening
    the dataset again: the recorded tokenizer's facts (``vocab_size`` ``None``
    when none is recorded, as the loader's) and the largest id (counted here from
    the sequences written), in every copy of the source."""
    seqs = [[1, 2], [3, 4, 70], [6, 7, 8]]
    tok = ftj.TokenizerInfo("tok.json", "sha256:0123456789abcdef", 500, bos_id=1, eos_id=2)
    ftj.write_dataset(tmp_path / "tok", {"train": seqs}, info=ftj.DatasetInfo(tokenizer=tok))
    src = FlatTokensSource(tmp_path / "tok", 2)
    again = pickle.loads(pickle.dumps(src))
    for s in (src, again):
        assert s.tokenizer == tok and s.info is not None and s.info.tokenizer == tok
        assert (s.vocab_size, s.tokenizer.eos_id, s.max_token_id) == (500, 2, 70)
    ftj.write_dataset(tmp_path / "bare", {"train": seqs})
    bare = FlatTokensSource(ftj.PackedRecords(ftj.open_dataset(tmp_path / "bare")["train"], 2))
    assert bare.tokenizer is None and bare.info is not None
    assert bare.vocab_size is None
    assert bare.max_token_id == max(t for s in seqs for t in s) == 70
