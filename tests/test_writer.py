import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import zarr
from hypothesis import given
from hypothesis import strategies as st
from memurls import memory_url

import flat_tokens_jax as ftj
from flat_tokens_jax.core.format import MAX_TOKEN_ID

MAX = MAX_TOKEN_ID
SMALL = ftj.StorageFormat(shard_tokens=16, chunk_tokens=4)
storage_formats = st.sampled_from(
    [
        SMALL,
        ftj.StorageFormat(shard_tokens=8, chunk_tokens=8, compression="zstd"),
        ftj.StorageFormat(zarr_format=2, shard_tokens=8, chunk_tokens=2),
        ftj.StorageFormat(zarr_format=2, shard_tokens=32, chunk_tokens=2, compression="zstd"),
        ftj.StorageFormat(),
    ]
)
seqs = st.lists(st.lists(st.integers(0, MAX), min_size=1, max_size=40), max_size=30)


@given(train=seqs, valid=seqs, storage_format=storage_formats)
def test_write_open_read_round_trip(
    train: list[list[int]], valid: list[list[int]], storage_format: ftj.StorageFormat
) -> None:
    url = memory_url()
    ftj.write_dataset(url, {"train": train, "validation": valid}, storage_format=storage_format)
    ds = ftj.open_dataset(url)
    assert ds.splits == ("train", "validation")
    for name, expected in (("train", train), ("validation", valid)):
        ft = ds[name]
        assert ft.num_sequences == len(expected)
        flat = [t for s in expected for t in s]
        assert ft.num_tokens == len(flat)
        assert ft.max_token_id == max(flat, default=0)
        assert [s.tolist() for s in ft.sequences(np.arange(len(expected)))] == expected
        assert ft.tokens(0, len(flat)).tolist() == flat
        enc, starts = ftj.encode(expected)
        assert ft.encoded_ranges([0], [len(flat)])[0].tolist() == enc.tolist()
        assert ft.starts.read_points(np.arange(len(expected) + 1)).tolist() == starts.tolist()
    ftj.validate(url)


@given(data=st.data())
def test_token_ranges_and_sequence_subsets(data: st.DataObject) -> None:
    train = data.draw(
        st.lists(st.lists(st.integers(0, 1000), min_size=1, max_size=30), min_size=1, max_size=30)
    )
    url = memory_url()
    ftj.write_dataset(url, {"train": train}, storage_format=SMALL)
    ft = ftj.open_dataset(url)["train"]
    flat = [t for s in train for t in s]
    a = data.draw(st.integers(0, len(flat)))
    b = data.draw(st.integers(a, len(flat)))
    assert ft.tokens(a, b).tolist() == flat[a:b]
    idx = data.draw(st.lists(st.integers(0, len(train) - 1), max_size=10))
    assert [s.tolist() for s in ft.sequences(idx)] == [train[i] for i in idx]


def test_out_of_range_reads_are_refused() -> None:
    url = memory_url()
    ftj.write_dataset(url, {"train": [[1, 2], [3]]})
    ft = ftj.open_dataset(url)["train"]
    with pytest.raises(IndexError, match=r"token range \[2, 4\) is outside \[0, 3\)"):
        ft.tokens(2, 4)
    with pytest.raises(IndexError, match=r"sequence index 2 is outside \[0, 2\)"):
        ft.sequences([0, 2])


def test_streams_with_bounded_memory_and_many_shards(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 300, size=2000)
    data = [rng.integers(0, 50_000, size=n) for n in lengths]
    storage_format = ftj.StorageFormat(shard_tokens=1 << 12, chunk_tokens=1 << 8)
    with ftj.DatasetWriter(tmp_path / "ds", storage_format=storage_format) as w:
        for i, seq in enumerate(data):
            w.append("train" if i % 10 else "validation", seq)
    ds = ftj.open_dataset(tmp_path / "ds")
    train = [s for i, s in enumerate(data) if i % 10]
    got = ds["train"].sequences(np.arange(len(train)))
    assert all(np.array_equal(a, b) for a, b in zip(got, train, strict=True))
    shards = os.listdir(tmp_path / "ds" / "train" / "encoded_tokens" / "c")
    assert len(shards) == -(-sum(map(len, train)) // (1 << 12))
    ftj.validate(tmp_path / "ds")


def test_zarr_python_reads_what_we_write(tmp_path: Path) -> None:
    for fmt_version in (3, 2):
        url = tmp_path / f"v{fmt_version}"
        # v2: its default compressor (blosc), which numcodecs decodes in every version;
        # numcodecs before 0.16 cannot decode the zstd frames tensorstore writes.
        storage_format = (
            ftj.StorageFormat(shard_tokens=8, chunk_tokens=4, compression="zstd")
            if fmt_version == 3
            else ftj.StorageFormat(zarr_format=2, shard_tokens=8)
        )
        ftj.write_dataset(
            url, {"train": [[1, 2], [3, 4, 5], [6, 7, 8]]}, storage_format=storage_format
        )
        group = zarr.open_group(str(url), mode="r")
        assert sorted(group.group_keys()) == ["train", "validation"]
        train = group["train"]
        assert train.attrs["max_token_id"] == 8
        assert train["encoded_tokens"][:].tolist() == [3, 4, 7, 8, 10, 13, 14, 16]
        assert train["seq_starts"][:].tolist() == [0, 2, 5, 8]
        assert group["validation"]["seq_starts"][:].tolist() == [0]


def test_zarr_v2_defaults_keep_a_small_dataset_small(tmp_path: Path) -> None:
    """50 sequences, ~60k tokens: once 257 MB on disk (full 64 MiB chunk files)."""
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, 50_000, int(n)) for n in rng.integers(1, 2400, 50)]
    ftj.write_dataset(tmp_path, {"train": seqs}, storage_format=ftj.StorageFormat(zarr_format=2))
    raw = 4 * sum(map(len, seqs)) + 8 * 51

    def on_disk(folder: Path) -> int:
        return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())

    assert on_disk(tmp_path) <= raw
    assert on_disk(tmp_path / "train" / "seq_starts") < 4096
    storage_format = ftj.open_dataset(tmp_path)["train"].storage_formats()["encoded_tokens"]
    assert (storage_format["chunk"], storage_format["compression"]) == (1 << 20, "blosc")
    assert zarr.open_array(str(tmp_path / "train" / "seq_starts"), mode="r")[-1] == sum(
        map(len, seqs)
    )


def test_bad_input_names_the_sequence() -> None:
    with ftj.DatasetWriter(memory_url()) as w, pytest.raises(ValueError) as info:
        w.extend("train", [[1, 2], [3, -4]])
    assert "split 'train', sequence 1" in str(info.value)
    assert "token id -4 at position 1" in str(info.value)
    url = memory_url()
    with pytest.raises(ValueError, match="sequence 2 is empty"), ftj.DatasetWriter(url) as w:
        w.append("train", [5])
        w.extend("train", [[1], []])
    with pytest.raises(ValueError, match="dtype float32"), ftj.DatasetWriter(url) as w:
        w.append("train", np.ones(3, np.float32))
    with pytest.raises(KeyError, match="unknown split 'test'"), ftj.DatasetWriter(url) as w:
        w.append("test", [1])


def test_failed_write_leaves_nothing(tmp_path: Path) -> None:
    url = tmp_path / "ds"
    with pytest.raises(RuntimeError), ftj.DatasetWriter(url, storage_format=SMALL) as w:
        w.extend("train", [[1, 2, 3]] * 50)
        raise RuntimeError("tokenizer crashed")
    with pytest.raises(ftj.FormatError, match="no flat-tokens dataset here"):
        ftj.open_dataset(url)
    ftj.write_dataset(url, {"train": [[1]]})
    assert ftj.open_dataset(url)["train"].num_tokens == 1


def test_never_overwrites_unless_asked(tmp_path: Path) -> None:
    url = tmp_path / "ds"
    ftj.write_dataset(url, {"train": [[1, 2]]})
    with pytest.raises(FileExistsError, match="already holds a flat-tokens dataset"):
        ftj.write_dataset(url, {"train": [[3]]})
    assert ftj.open_dataset(url)["train"].tokens(0, 2).tolist() == [1, 2]
    ftj.write_dataset(url, {"train": [[3]]}, overwrite=True)
    assert ftj.open_dataset(url)["train"].tokens(0, 1).tolist() == [3]
    other = tmp_path / "home"
    other.mkdir()
    (other / "notes.txt").write_text("precious")
    with pytest.raises(
        FileExistsError,
        match=r"not part of a flat-tokens dataset \(notes.txt: 1 file in all\); refusing",
    ):
        ftj.write_dataset(other, {"train": [[1]]}, overwrite=True)
    assert (other / "notes.txt").read_text() == "precious"


def test_bad_storage_formats_are_refused() -> None:
    with pytest.raises(ValueError, match="chunk_tokens 3 must divide shard_tokens 16"):
        ftj.StorageFormat(shard_tokens=16, chunk_tokens=3)
    with pytest.raises(ValueError, match="compression must be None, 'zstd' or 'blosc'"):
        ftj.StorageFormat(compression="gzip")
    with pytest.raises(ValueError, match="'blosc' needs zarr_format=2"):
        ftj.StorageFormat(compression="blosc")
    with pytest.raises(ValueError, match="checksum=True needs zarr_format=3"):
        ftj.StorageFormat(zarr_format=2, checksum=True)
    with pytest.raises(ValueError, match="zarr_format must be 2 or 3"):
        ftj.StorageFormat(zarr_format=4)


KILLED_WRITER = textwrap.dedent("""
    import itertools, sys
    import flat_tokens_jax as ftj
    from pathlib import Path
    url, marker = sys.argv[1], Path(sys.argv[2])
    def forever():
        for i in itertools.count():
            if i == 5000:
                marker.write_text("writing")
            yield [i % 1000 + 1] * 7
    storage_format = ftj.StorageFormat(shard_tokens=1 << 10, chunk_tokens=1 << 6)
    if len(sys.argv) > 3:
        with ftj.DatasetWriter(url, storage_format=storage_format) as w:
            for seq in forever():
                w.append("train", seq, loss_mask=[0, 0, 1, 1, 1, 1, 1])
    else:
        ftj.write_dataset(url, {"train": forever()}, storage_format=storage_format)
""")


@pytest.mark.parametrize("masked", [False, True], ids=["tokens", "with_loss_mask"])
@pytest.mark.parametrize("zarr_format", [3, 2])
def test_write_killed_midway_leaves_no_dataset(
    tmp_path: Path, zarr_format: int, masked: bool
) -> None:
    url, marker = tmp_path / "ds", tmp_path / "marker"
    script = KILLED_WRITER.replace("1 << 6)", f"1 << 6, zarr_format={zarr_format})")
    args = [str(url), str(marker), *(["masked"] if masked else [])]
    proc = subprocess.Popen([sys.executable, "-c", script, *args])
    try:
        deadline = time.monotonic() + 60
        while not marker.exists():
            assert proc.poll() is None, "writer exited before it was killed"
            assert time.monotonic() < deadline, "writer made no progress"
            time.sleep(0.05)
        time.sleep(0.2)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert list((url / "train").iterdir()), "the writer wrote nothing before it was killed"
    if masked:
        written = list((url / "train" / "loss_mask").iterdir())
        assert len(written) > 1, f"no loss mask data was written: {written}"
    with pytest.raises(ftj.FormatError, match="did not finish"):
        ftj.open_dataset(url)
    with pytest.raises(ftj.FormatError, match="did not finish"):
        ftj.validate(url)
    with pytest.raises(FileExistsError, match="leftover of an interrupted write"):
        ftj.write_dataset(url, {"train": [[1]]})
    ftj.write_dataset(url, {"train": [[1]]}, overwrite=True)
    assert ftj.open_dataset(url)["train"].num_tokens == 1


# -- Loss masks. -------------------------------------------------------------------

masked_seqs = st.lists(
    st.lists(st.tuples(st.integers(0, MAX), st.integers(0, 1)), min_size=1, max_size=40),
    max_size=30,
)


@given(train=masked_seqs, valid=seqs, storage_format=storage_formats, data=st.data())
def test_loss_mask_round_trip_through_every_write_method(
    train: list[list[tuple[int, int]]],
    valid: list[list[int]],
    storage_format: ftj.StorageFormat,
    data: st.DataObject,
) -> None:
    tokens = [[t for t, _ in s] for s in train]
    masks = [[m for _, m in s] for s in train]
    url = memory_url()
    with ftj.DatasetWriter(url, storage_format=storage_format) as w:
        i = 0
        while i < len(tokens):
            n = data.draw(st.integers(1, len(tokens) - i))
            how = data.draw(st.sampled_from(["append", "extend", "extend_encoded"]))
            if how == "append":
                n = 1
                w.append("train", tokens[i], np.array(masks[i], bool))
            elif how == "extend":
                w.extend("train", tokens[i : i + n], loss_masks=iter(masks[i : i + n]))
            else:
                enc, starts = ftj.encode(tokens[i : i + n])
                flat = np.array([m for s in masks[i : i + n] for m in s], np.int64)
                w.extend_encoded("train", enc, np.diff(starts), loss_mask=flat)
            i += n
        w.extend("validation", valid)
    ds = ftj.open_dataset(url)
    ft = ds["train"]
    assert [s.tolist() for s in ft.sequences(np.arange(len(tokens)))] == tokens
    flat_masks = [m for s in masks for m in s]
    if tokens:
        assert ft.loss_mask is not None and ft.loss_mask.dtype == np.uint8
        stored = ft.request_loss_mask(np.array([0]), np.array([ft.num_tokens]))
        assert stored is not None and stored.result()[0].tolist() == flat_masks
    else:
        assert ft.loss_mask is None
    assert ds["validation"].loss_mask is None
    ftj.validate(url)


def test_a_split_has_a_mask_for_every_sequence_or_for_none() -> None:
    url = memory_url()
    with pytest.raises(ValueError) as info, ftj.DatasetWriter(url) as w:
        w.extend("train", [[1, 2], [3]], loss_masks=[[0, 1], [1]])
        w.append("train", [4, 5])
    assert "split 'train', sequence 2: no loss mask given, but the split's earlier" in str(
        info.value
    )
    with (
        pytest.raises(
            ValueError,
            match=r"sequence 1: a loss mask given, but the split's earlier "
            r"sequences have none",
        ),
        ftj.DatasetWriter(url) as w,
    ):
        w.extend("validation", [])
        w.append("validation", [1])
        enc, _ = ftj.encode([[7, 8]])
        w.extend_encoded("validation", enc, np.array([2]), loss_mask=np.ones(2, np.uint8))
    with pytest.raises(
        ValueError, match="sequence 1: loss mask entry 0 is 2; entries must be 0 or 1"
    ):
        ftj.write_dataset(url, {"train": [[1], [2]]}, loss_masks={"train": [[1], [2]]})
    with pytest.raises(
        ValueError,
        match=r"sequence 0: loss mask of shape \(3,\), expected one "
        r"entry per token \(2,\)",
    ):
        ftj.write_dataset(url, {"train": [[1, 2]]}, loss_masks={"train": [[1, 1, 1]]})
    with pytest.raises(ValueError, match="must be bool or integers, got dtype float64"):
        ftj.write_dataset(url, {"train": [[1, 2]]}, loss_masks={"train": [[1.0, 0.0]]})
    with pytest.raises(ValueError, match="split 'train': more sequences than loss masks"):
        ftj.write_dataset(url, {"train": [[1], [2]]}, loss_masks={"train": [[1]]})
    with pytest.raises(ValueError, match="split 'train': more loss masks than sequences"):
        ftj.write_dataset(url, {"train": [[1]]}, loss_masks={"train": [[1], [0]]})
    with pytest.raises(KeyError, match=r"loss_masks names splits \['test'\]"):
        ftj.write_dataset(url, {"train": [[1]]}, loss_masks={"test": [[1]]})
    with pytest.raises(ftj.FormatError, match="did not finish"):
        ftj.open_dataset(url)


def test_zarr_python_reads_a_dataset_with_a_loss_mask(tmp_path: Path) -> None:
    """An older reader that knows only zarr opens the extended dataset and its base arrays."""
    for fmt_version in (3, 2):
        url = tmp_path / f"v{fmt_version}"
        storage_format = ftj.StorageFormat(zarr_format=fmt_version, shard_tokens=8, chunk_tokens=4)
        masks = [[0, 1], [0, 0, 1], [1, 1, 1]]
        ftj.write_dataset(
            url,
            {"train": [[1, 2], [3, 4, 5], [6, 7, 8]]},
            loss_masks={"train": masks},
            storage_format=storage_format,
        )
        group = zarr.open_group(str(url), mode="r")
        train = group["train"]
        assert train["encoded_tokens"][:].tolist() == [3, 4, 7, 8, 10, 13, 14, 16]
        assert train["seq_starts"][:].tolist() == [0, 2, 5, 8]
        assert train["loss_mask"].dtype == np.uint8
        assert train["loss_mask"][:].tolist() == [0, 1, 0, 0, 1, 1, 1, 1]
        assert "loss_mask" not in group["validation"]


def test_failed_masked_write_leaves_nothing(tmp_path: Path) -> None:
    url = tmp_path / "ds"
    with pytest.raises(RuntimeError), ftj.DatasetWriter(url, storage_format=SMALL) as w:
        w.extend("train", [[1, 2, 3]] * 50, loss_masks=[[0, 1, 1]] * 50)
        assert (url / "train" / "loss_mask").is_dir()
        raise RuntimeError("tokenizer crashed")
    assert not url.exists() or not any(url.rglob("*.json"))
    with pytest.raises(ftj.FormatError, match="no flat-tokens dataset here"):
        ftj.open_dataset(url)


def all_sequences(ft: ftj.FlatTokens) -> list[list[int]]:
    return [s.tolist() for s in ft.sequences(np.arange(ft.num_sequences))]


@pytest.mark.parametrize(
    "storage_format", [SMALL, ftj.StorageFormat(zarr_format=2, shard_tokens=8)]
)
def test_an_extra_split_is_written_and_read_back(
    tmp_path: Path, storage_format: ftj.StorageFormat
) -> None:
    # Before: "test" was written, then open_dataset listed only train and validation.
    test, train = [[1, 2, 3], [4, 5]], [[6]]
    ftj.write_dataset(tmp_path / "a", {"test": test, "train": train}, storage_format=storage_format)
    with ftj.DatasetWriter(
        tmp_path / "b", storage_format=storage_format, splits=("train", "test")
    ) as w:
        w.extend("test", test)
        w.extend("train", train)
    for name in ("a", "b"):
        ds = ftj.open_dataset(tmp_path / name)
        assert ds.splits == ("train", "validation", "test")
        assert all_sequences(ds["test"]) == test and all_sequences(ds["train"]) == train
        assert ds["validation"].num_sequences == 0 and ds["test"].max_token_id == 5
        ftj.validate(tmp_path / name)
        ftj.validate(tmp_path / name, quick=True)
    # zarr-python sees the split as a plain group, as it sees train.
    test_group = zarr.open_group(str(tmp_path / "a"), mode="r")["test"]
    assert test_group["encoded_tokens"][:].tolist() == ftj.encode(test)[0].tolist()


BAD_NAMES = ["Train", "é", "a/b", "bins_8", "_staging", "", ".", "../x", "zarr.json", "seq_starts"]


@pytest.mark.parametrize("name", BAD_NAMES)
def test_a_bad_split_name_is_refused_before_anything_is_written(tmp_path: Path, name: str) -> None:
    # Before: most were written and never read back; '', '.', '../x' and 'zarr.json'
    # failed in tensorstore and left files that blocked the next write.
    out = tmp_path / "out" / "d"
    with pytest.raises(ValueError, match=r"split name") as e:
        ftj.write_dataset(out, {"train": [[1]], name: [[2, 3]]})
    assert "write" in str(e.value) or "choose another name" in str(e.value)
    with pytest.raises(ValueError, match=r"split name"):
        ftj.DatasetWriter(out, splits=["train", name])
    assert not (tmp_path / "out").exists()  # nothing at all, not even beside the output
    ftj.write_dataset(out, {"train": [[1]]})  # no overwrite needed
    assert ftj.open_dataset(out).splits == ("train", "validation")


def test_splits_must_be_a_list_of_names() -> None:
    with pytest.raises(ValueError, match=r"splits must be a list of split names, got 'test'"):
        ftj.DatasetWriter(memory_url(), splits="test")


def test_overwrite_deletes_the_extra_splits_it_recorded(tmp_path: Path) -> None:
    out = tmp_path / "d"
    ftj.write_dataset(out, {"train": [[1]], "test": [[2]], "dev": [[3]]}, storage_format=SMALL)
    (out / "dev" / "zarr.json").unlink()  # damaged: only the record says "dev" is ours
    ftj.write_dataset(out, {"train": [[4]]}, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["train", "validation", "zarr.json"]
    assert ftj.open_dataset(out).splits == ("train", "validation")
