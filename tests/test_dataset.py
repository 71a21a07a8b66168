"""flat_tokens_jax.data.dataset: FlatTokens refuses indices that are not integers."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from memurls import memory_url

import flat_tokens_jax as ftj


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
