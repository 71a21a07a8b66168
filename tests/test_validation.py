import json
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from rawstore import SPEC_STARTS, SPEC_TOKENS, flat_split, write_raw

import flat_tokens_jax as ftj
from flat_tokens_jax.data import validation
from flat_tokens_jax.store.arrays import ZarrPythonArray

EMPTY = flat_split([], [0], 0)


def problems_of(path: Path, **kwargs: Any) -> list[str]:
    with pytest.raises(ftj.FormatError) as info:
        ftj.validate(path, **kwargs)
    return [str(p) for p in info.value.problems]


def plant(
    path: Path,
    tokens: list[int] = SPEC_TOKENS,
    starts: list[int] = SPEC_STARTS,
    max_token_id: int = 8,
    **kwargs: Any,
) -> None:
    write_raw(
        path, {"train": flat_split(tokens, starts, max_token_id), "validation": EMPTY}, **kwargs
    )


@pytest.mark.parametrize(
    ("tokens", "starts", "max_id", "expected"),
    [
        (SPEC_TOKENS, [1, 2, 5, 8], 8, "train/seq_starts[0]: first entry must be 0 (value 1)"),
        (
            SPEC_TOKENS,
            [0, 5, 2, 8],
            8,
            "train/seq_starts[2]: not strictly increasing (previous entry 5) (value 2)",
        ),
        (
            SPEC_TOKENS,
            [0, 2, 5, 7],
            8,
            "train/seq_starts[3]: last entry must equal the token count 8 (value 7)",
        ),
        (SPEC_TOKENS, [0, 2, 5, 9], 8, "train/seq_starts[3]: beyond the 8 tokens of the split"),
        (
            [3, 4, 6, 8, 10, 13, 14, 16],
            SPEC_STARTS,
            8,
            "train/encoded_tokens[2]: seq_starts marks a sequence start here but the start bit"
            " is clear",
        ),
        (
            [3, 5, 7, 8, 10, 13, 14, 16],
            SPEC_STARTS,
            8,
            "train/encoded_tokens[1]: start bit set where seq_starts has no sequence start",
        ),
        (
            SPEC_TOKENS,
            SPEC_STARTS,
            7,
            "train/encoded_tokens[7]: token id above max_token_id 7 (value 8)",
        ),
    ],
)
def test_planted_violation_is_named(
    tmp_path: Path, tokens: list[int], starts: list[int], max_id: int, expected: str
) -> None:
    plant(tmp_path, tokens, starts, max_id)
    found = problems_of(tmp_path)
    assert any(p.startswith(expected) for p in found), found


def test_open_dataset_refuses_a_wrong_end(tmp_path: Path) -> None:
    plant(tmp_path, starts=[0, 2, 5, 7])
    with pytest.raises(ftj.FormatError, match=r"seq_starts\[3\]: last entry is 7"):
        ftj.open_dataset(tmp_path)


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        (lambda s: s.pop("validation"), "split 'validation' is missing"),
        (lambda s: s["train"]["attrs"].clear(), "attribute 'max_token_id' is missing"),
        (lambda s: s["train"]["attrs"].update(max_token_id="8"), "max_token_id must be an int"),
        (lambda s: s["train"]["attrs"].update(max_token_id=2**31), "max_token_id must be an int"),
        (lambda s: s["train"]["arrays"].pop("seq_starts"), "array 'seq_starts' is missing"),
        (
            lambda s: s["train"]["arrays"].update(
                encoded_tokens=(np.array(SPEC_TOKENS, np.int32), {})
            ),
            "encoded_tokens: dtype is int32, expected uint32",
        ),
        (
            lambda s: s["train"]["arrays"].update(
                seq_starts=(np.array(SPEC_STARTS, np.uint32), {})
            ),
            "seq_starts: dtype is uint32, expected uint64",
        ),
        (
            lambda s: s["train"]["arrays"].update(
                encoded_tokens=(np.array(SPEC_TOKENS, np.uint32).reshape(2, 4), {"chunks": (2, 2)})
            ),
            "encoded_tokens: expected a 1-D array, found shape (2, 4)",
        ),
        (
            lambda s: s["train"]["arrays"].update(seq_starts=(np.zeros(0, np.uint64), {})),
            "seq_starts: empty",
        ),
        (
            lambda s: s["train"]["arrays"].update(
                loss_mask=(np.array([1, 0, 2, 1, 1, 1, 1, 1], np.uint8), {})
            ),
            "train/loss_mask[2]: loss mask entries must be 0 or 1 (value 2)",
        ),
        (
            lambda s: s["train"]["arrays"].update(loss_mask=(np.ones(8, np.float32), {})),
            "train/loss_mask: dtype is float32, expected uint8",
        ),
        (
            lambda s: s["train"]["arrays"].update(loss_mask=(np.ones(7, np.uint8), {})),
            "loss_mask: 7 entries, expected one per token (8)",
        ),
    ],
)
def test_structural_violation_is_named(tmp_path: Path, mutate: Any, expected: str) -> None:
    splits = {"train": flat_split(SPEC_TOKENS, SPEC_STARTS, 8), "validation": EMPTY}
    mutate(splits)
    write_raw(tmp_path, splits)
    found = problems_of(tmp_path)
    assert any(expected in p for p in found), found


def test_every_problem_of_both_splits_is_reported(tmp_path: Path) -> None:
    write_raw(
        tmp_path,
        {
            "train": flat_split(SPEC_TOKENS, [0, 2, 5, 7], 8),
            "validation": flat_split([3, 5], [0, 2], 1),
        },
        zarr_format=2,
    )
    found = problems_of(tmp_path)
    assert any(p.startswith("train/seq_starts[3]") for p in found)
    assert any(p.startswith("validation/encoded_tokens[1]: start bit") for p in found)
    assert any(p.startswith("validation/encoded_tokens[1]: token id above") for p in found)


def test_missing_root_marker_is_an_unfinished_write(tmp_path: Path) -> None:
    plant(tmp_path, root=False)
    (found,) = problems_of(tmp_path)
    assert "a write did not finish" in found


corruptions = st.sampled_from(["flip_bit", "raise_id", "bump_start", "drop_last"])


@given(
    seqs=st.lists(st.lists(st.integers(0, 100), min_size=1, max_size=12), min_size=2, max_size=25),
    block=st.integers(1, 40),
    corruption=corruptions,
    data=st.data(),
)
def test_streaming_check_equals_whole_array_reference(
    seqs: list[list[int]], block: int, corruption: str, data: st.DataObject
) -> None:
    """Any block size finds the planted problem at its index, and nothing on valid data."""
    enc, starts = ftj.encode(seqs)
    max_id = max(max(s) for s in seqs)
    tokens_reader = ZarrPythonArray(np.asarray(enc))  # type: ignore[arg-type]
    assert (
        validation._check_arrays(
            "t",
            tokens_reader,
            "s",
            ZarrPythonArray(starts),  # type: ignore[arg-type]
            max_id,
            block,
        )
        == []
    )
    enc, starts = enc.copy(), starts.copy()
    if corruption == "flip_bit":
        i = data.draw(st.integers(1, enc.size - 1))
        enc[i] ^= 1
        expected = ("t", i)
    elif corruption == "raise_id":
        i = data.draw(st.integers(0, enc.size - 1))
        enc[i] = enc[i] % 2 + 2 * (max_id + 1)
        expected = ("t", i)
    elif corruption == "bump_start":
        i = data.draw(st.integers(1, starts.size - 2))
        starts[i] = starts[i - 1]
        expected = ("s", i)
    else:
        starts[-1] -= 1
        expected = ("s", starts.size - 1)
    problems = validation._check_arrays(
        "t",
        ZarrPythonArray(enc),  # type: ignore[arg-type]
        "s",
        ZarrPythonArray(starts),  # type: ignore[arg-type]
        max_id,
        block,
    )
    assert expected in {(p.where, p.index) for p in problems}, problems


def test_summary_reports_counts_lengths_and_layout(tmp_path: Path) -> None:
    ftj.write_dataset(
        tmp_path,
        {"train": [[1, 2], [3, 4, 5], [6, 7, 8, 9]]},
        storage_format=ftj.StorageFormat(shard_tokens=64, chunk_tokens=8, compression="zstd"),
    )
    info = ftj.summary(tmp_path)
    train = info["splits"]["train"]
    assert (train["num_tokens"], train["num_sequences"], train["max_token_id"]) == (9, 3, 9)
    assert train["lengths"] == {
        "mean": 3.0,
        "min": 2,
        "median": 3.0,
        "p90": 3.8,
        "p99": pytest.approx(3.98),
        "max": 4,
    }
    assert train["layout"]["encoded_tokens"] == {
        "zarr_format": 3,
        "chunk": 8,
        "shard": 64,
        "compression": "zstd",
        "filters": [],
        "checksum": True,
    }
    assert info["splits"]["validation"]["num_sequences"] == 0


@given(
    mask=st.lists(st.integers(0, 1), min_size=1, max_size=60),
    bad=st.lists(st.tuples(st.integers(0, 59), st.integers(2, 255)), max_size=5),
    block=st.integers(1, 16),
)
def test_loss_mask_values_are_checked_in_blocks(
    mask: list[int], bad: list[tuple[int, int]], block: int
) -> None:
    """Every entry other than 0 or 1 is reported at its index, whatever the block size."""
    values = list(mask)
    for i, v in bad:
        if i < len(values):
            values[i] = v
    expected = {i for i, v in enumerate(values) if v > 1}
    split = flat_split([3] + [2] * (len(values) - 1), [0, len(values)], 1)
    split["arrays"]["loss_mask"] = (np.array(values, np.uint8), {"chunks": (5,)})
    with tempfile.TemporaryDirectory() as tmp:
        write_raw(Path(tmp), {"train": split, "validation": EMPTY})
        if not expected:
            ftj.validate(tmp, block=block)
            return
        with pytest.raises(ftj.FormatError) as info:
            ftj.validate(tmp, block=block)
    found = info.value.problems
    assert {p.index for p in found} == expected
    assert {(p.where, p.message) for p in found} == {
        ("train/loss_mask", "loss mask entries must be 0 or 1")
    }


def test_written_loss_mask_validates_on_both_zarr_versions(tmp_path: Path) -> None:
    for zarr_format in (3, 2):
        url = tmp_path / f"v{zarr_format}"
        ftj.write_dataset(
            url,
            {"train": [[1, 2], [3, 4, 5]], "validation": [[6]]},
            loss_masks={"train": [[0, 1], [1, 0, 1]], "validation": [[1]]},
            storage_format=ftj.StorageFormat(
                zarr_format=zarr_format, shard_tokens=4, chunk_tokens=2
            ),
        )
        ftj.validate(url, block=2)
        assert ftj.summary(url)["splits"]["train"]["loss_mask"] is True


def rewrite_attributes(meta_file: Path, change: Any) -> None:
    meta = json.loads(meta_file.read_text())
    change(meta["attributes"])
    meta_file.write_text(json.dumps(meta))


def test_validate_checks_every_split_the_dataset_records(tmp_path: Path) -> None:
    # Before: validate checked train and validation only, and passed this dataset.
    ftj.write_dataset(tmp_path / "d", {"train": [[1]], "test": [[1, 2, 3]], "dev": [[4]]})
    rewrite_attributes(tmp_path / "d" / "test" / "zarr.json", lambda a: a.update(max_token_id=2))
    shutil.rmtree(tmp_path / "d" / "dev")
    for quick in (False, True):
        found = problems_of(tmp_path / "d", quick=quick)
        assert any(p.startswith("test/encoded_tokens[2]: token id above") for p in found), found
        assert any("split 'dev' is missing" in p for p in found), found
    assert ftj.open_dataset(tmp_path / "d").splits == ("train", "validation", "test")


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ("test", "flat_tokens.splits must be a list of split names, got 'test'"),
        (
            ["train", "../x"],
            "flat_tokens.splits is damaged (rewrite the dataset): split name '../x' is not",
        ),
        (
            ["train", 3],
            "splits is damaged (rewrite the dataset): a split name must be a non-empty string",
        ),
    ],
)
def test_a_malformed_splits_record_is_refused_naming_it(
    tmp_path: Path, record: Any, message: str
) -> None:
    ftj.write_dataset(tmp_path / "d", {"train": [[1]]})
    rewrite_attributes(
        tmp_path / "d" / "zarr.json", lambda a: a["flat_tokens"].update(splits=record)
    )
    assert any(message in p for p in problems_of(tmp_path / "d")), problems_of(tmp_path / "d")
    with pytest.raises(ftj.FormatError, match=re.escape(message)):
        ftj.open_dataset(tmp_path / "d")
