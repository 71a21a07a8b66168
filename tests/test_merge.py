from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from memurls import memory_url

import flat_tokens_jax as ftj
from flat_tokens_jax.cli import main
from flat_tokens_jax.convert.merge import merge

seqs = st.lists(st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=12), max_size=12)


@settings(max_examples=30)
@given(parts=st.lists(st.tuples(seqs, seqs), min_size=1, max_size=3), block=st.integers(1, 30))
def test_merge_concatenates_every_split_in_order(
    parts: list[tuple[list, list]], block: int
) -> None:
    urls = []
    for train, valid in parts:
        urls.append(memory_url("part"))
        ftj.write_dataset(
            urls[-1],
            {"train": train, "validation": valid},
            storage_format=ftj.StorageFormat(shard_tokens=16, chunk_tokens=4),
        )
    out = memory_url("merged")
    summary = merge(urls, out, block_tokens=block)
    ds = ftj.open_dataset(out)
    for i, split in enumerate(("train", "validation")):
        expected = [s for part in parts for s in part[i]]
        ft = ds[split]
        assert [s.tolist() for s in ft.sequences(np.arange(ft.num_sequences))] == expected
        assert ft.max_token_id == max((t for s in expected for t in s), default=0)
        assert summary["splits"][split]["sequences"] == len(expected)
    ftj.validate(out)


def test_merge_command_and_refusals(tmp_path: Path) -> None:
    ftj.write_dataset(tmp_path / "a", {"train": [[1, 2]], "validation": [[3]]})
    ftj.write_dataset(tmp_path / "b", {"train": [[4]]})
    assert main(["merge", str(tmp_path / "a"), str(tmp_path / "b"), str(tmp_path / "m")]) == 0
    train = ftj.open_dataset(tmp_path / "m")["train"]
    assert [s.tolist() for s in train.sequences([0, 1])] == [[1, 2], [4]]
    assert main(["merge", str(tmp_path / "a"), str(tmp_path / "m")]) == 1
    assert (
        main(["merge", str(tmp_path / "a"), str(tmp_path / "missing"), str(tmp_path / "m2")]) == 1
    )
    with pytest.raises(ftj.FormatError):
        ftj.open_dataset(tmp_path / "m2")


def test_extend_encoded_refuses_misplaced_start_bits() -> None:
    enc, _ = ftj.encode([[1, 2], [3]])
    with ftj.DatasetWriter(memory_url()) as w:
        w.extend_encoded("train", enc, np.array([2, 1]))
        with pytest.raises(ValueError, match="start bits do not sit exactly"):
            w.extend_encoded("train", enc, np.array([1, 2]))
        with pytest.raises(ValueError, match="sum to the 3 tokens"):
            w.extend_encoded("train", enc, np.array([2, 2]))


@settings(max_examples=20)
@given(
    parts=st.lists(
        st.lists(st.lists(st.booleans(), min_size=1, max_size=10), min_size=1, max_size=6),
        min_size=1,
        max_size=3,
    ),
    block=st.integers(1, 20),
)
def test_merge_carries_loss_masks(parts: list[list[list[bool]]], block: int) -> None:
    urls = []
    for k, masks in enumerate(parts):
        urls.append(memory_url("masked"))
        seqs = [[k + 1] * len(m) for m in masks]
        ftj.write_dataset(
            urls[-1],
            {"train": seqs},
            loss_masks={"train": masks},
            storage_format=ftj.StorageFormat(shard_tokens=16, chunk_tokens=4),
        )
    out = memory_url("merged")
    merge(urls, out, block_tokens=block)
    ft = ftj.open_dataset(out)["train"]
    pending = ft.request_loss_mask(np.array([0]), np.array([ft.num_tokens]))
    assert pending is not None
    expected = [int(b) for masks in parts for m in masks for b in m]
    assert pending.result()[0].tolist() == expected
    ftj.validate(out)


def test_merge_refuses_inputs_with_and_without_masks(tmp_path: Path) -> None:
    ftj.write_dataset(tmp_path / "a", {"train": [[1, 2]]}, loss_masks={"train": [[0, 1]]})
    ftj.write_dataset(tmp_path / "b", {"train": [[4]]})
    with pytest.raises(ValueError, match=r"split 'train': some inputs have a loss_mask.*without"):
        merge([tmp_path / "a", tmp_path / "b"], tmp_path / "m")
    with pytest.raises(ftj.FormatError):
        ftj.open_dataset(tmp_path / "m")


def test_merge_keeps_every_split_of_every_input(tmp_path: Path) -> None:
    # Before: merge wrote train and validation only, and dropped "test" and "dev" silently.
    ftj.write_dataset(tmp_path / "a", {"train": [[1, 2]], "test": [[3], [4, 5]]})
    ftj.write_dataset(
        tmp_path / "b",
        {"dev": [[6]], "test": [[7]]},
        storage_format=ftj.StorageFormat(zarr_format=2),
    )
    ftj.write_dataset(tmp_path / "c", {"validation": [[8]]})
    out = tmp_path / "m"
    assert main(["merge", *(str(tmp_path / n) for n in "abc"), str(out)]) == 0
    ds = ftj.open_dataset(out)
    assert ds.splits == ("train", "validation", "test", "dev")
    want = {"train": [[1, 2]], "validation": [[8]], "test": [[3], [4, 5], [7]], "dev": [[6]]}
    for split, sequences in want.items():
        ft = ds[split]
        assert [s.tolist() for s in ft.sequences(np.arange(ft.num_sequences))] == sequences
    ftj.validate(out)
    summary = merge([tmp_path / "b", tmp_path / "c"], tmp_path / "m2")
    assert summary["splits"] == {
        "train": {"sequences": 0, "tokens": 0},
        "validation": {"sequences": 1, "tokens": 1},
        "dev": {"sequences": 1, "tokens": 1},
        "test": {"sequences": 1, "tokens": 1},
    }
