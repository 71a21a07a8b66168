"""flat_tokens_jax.data.dataset: FlatTokens refuses indices that are not integers, fractions
it cannot cut by; a missing split is named plainly."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from memurls import memory_url

import flat_tokens_jax as ftj
from flat_tokens_jax.cli import main


@pytest.fixture(scope="module")
def ft() -> ftj.FlatTokens:
    url = memory_url()
    ftj.write_dataset(url, {"train": [[1, 2], [3, 4, 5], [6]]})
    return ftj.open_dataset(url)["train"]


@pytest.mark.parametrize("bad", [[1.7], np.array([1.0]), [True], ["1"], np.array([[0.5]])])
def test_sequence_indices_must_be_integers(ft: ftj.FlatTokens, bad: Any) -> None:
    # Before: sequences([1.7]) read sequence 1.
    with pytest.raises(TypeError, match="sequence indices must be integers"):
        ft.sequences(bad)
    with pytest.raises(TypeError, match="sequence indices must be integers"):
        ft.sequence_bounds(bad)


def test_integer_indices_of_any_integer_type_work(ft: ftj.FlatTokens) -> None:
    for idx in ([1, 2], np.array([1, 2], np.uint32), np.array([[1], [2]], np.int8)):
        assert [s.tolist() for s in ft.sequences(idx)] == [[3, 4, 5], [6]]
    assert ft.sequences([]) == []
    assert ft.view(np.int64(1), 3).num_sequences == 2


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda ft: ft.view(0.5, 2), "first must be an integer, got 0.5"),
        (lambda ft: ft.view(0, True), "stop must be an integer, got True"),
        (lambda ft: ft.tokens(0, 2.5), "token range stops must be integers"),
        (lambda ft: ft.encoded_ranges([0.0], [1]), "token range starts must be integers"),
        (lambda ft: ftj.PackedRecords(ft, 2).read(np.array([0.9])), "record indices"),
        (lambda ft: ftj.PaddedRecords(ft, 2).token_ranges(np.array([1.5])), "sequence indices"),
        (lambda ft: ftj.PackedRecords(ft, 2).token_ranges(np.array([1.5])), "record indices"),
    ],
)
def test_other_index_taking_methods_refuse_non_integers(
    ft: ftj.FlatTokens, call: Any, message: str
) -> None:
    with pytest.raises(TypeError, match=message):
        call(ft)


def test_ranges_need_as_many_starts_as_stops(ft: ftj.FlatTokens) -> None:
    with pytest.raises(ValueError, match="2 range starts but 1 stops"):
        ft.encoded_ranges([0, 1], [2])


@pytest.mark.parametrize(
    ("fractions", "message"),
    [
        ("inf,1", r"split fractions 'inf,1': weight 0 \('inf'\) is not a finite non-negative"),
        ("1,nan", r"weight 1 \('nan'\) is not a finite"),
        ("-1,2", r"weight 0 \('-1'\) is not a finite non-negative"),
        ("a,b", r"weight 0 \('a'\) is not"),
        ([1, float("inf")], r"weight 1 \(inf\) is not"),
        ([True, 1], r"weight 0 \(True\) is not"),
        ("0,0", "the weights sum to 0"),
        ("", "the weights sum to 0"),
        ("1e308,1e308", "the weights sum to inf"),
        (None, "expected a string or a list of numbers"),
    ],
)
def test_split_refuses_fractions_it_cannot_use_naming_them_and_the_form(
    ft: ftj.FlatTokens, fractions: Any, message: str
) -> None:
    # Before: split("inf,1") raised "cannot convert float NaN to integer".
    with pytest.raises(ValueError, match=message) as e:
        ft.split(fractions)
    assert "such as '949,50,1'" in str(e.value)


def test_split_by_good_fractions_cuts_as_before(ft: ftj.FlatTokens) -> None:
    for fractions in ("2,1", "2/1", [2, 1], np.array([2.0, 1.0]), " 2 , 1 "):
        views = ft.split(fractions)
        assert [v.seq_range for v in views] == [(0, 2), (2, 3)]


def test_a_missing_split_reads_as_a_sentence_naming_the_splits_there(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before: str() of the KeyError kept Python's quotes around the message.
    ftj.write_dataset(tmp_path / "ds", {"train": [[1, 2]]})
    ds = ftj.open_dataset(tmp_path / "ds")
    with pytest.raises(KeyError) as e:
        ds["trian"]
    assert str(e.value) == f"{ds.url} has no split 'trian'; it has train, validation"
    assert isinstance(e.value, ValueError)  # bad input, as the CLI reports it
    with pytest.raises(KeyError, match=r"has no split 'valid'; it has train, validation: use"):
        ds["valid"]
    argv = ["show", str(tmp_path / "ds"), "--split", "trian", "--step", "0"]
    argv += ["--batch-size", "1", "--seq-len", "2"]
    assert main(argv) == 1
    assert (
        capsys.readouterr().err
        == f"show: {ds.url} has no split 'trian'; it has train, validation\n"
    )


def test_a_writer_names_the_splits_it_has_without_quotes() -> None:
    with ftj.DatasetWriter(memory_url()) as w, pytest.raises(KeyError) as e:
        w.append("test", [1])
    assert str(e.value).startswith("unknown split 'test'; this writer has ('train', 'validation')")
    assert "DatasetWriter(splits=...)" in str(e.value)
    with pytest.raises(KeyError) as e:
        ftj.write_dataset(memory_url(), {"train": [[1]]}, loss_masks={"test": [[1]]})
    assert str(e.value) == "loss_masks names splits ['test'] that splits does not have"
