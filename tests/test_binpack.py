"""The packing plan: best-fit decreasing against a per-sequence reference, and frozen."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from flat_tokens_jax.data import binpack
from flat_tokens_jax.data.binpack import build_plan, plan_digest


def reference_plan(lengths: list[int], seq_len: int) -> list[list[int]]:
    """Best-fit decreasing, one sequence at a time, as the module docstring says it."""
    sizes = [min(n, seq_len) for n in lengths]
    free: list[int] = []
    last_used: list[int] = []
    members: list[list[int]] = []
    for t, i in enumerate(sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))):
        fits = [b for b in range(len(free)) if free[b] >= sizes[i]]
        if fits:
            b = min(fits, key=lambda b: (free[b], -last_used[b]))
        else:
            free.append(seq_len)
            last_used.append(-1)
            members.append([])
            b = len(free) - 1
        free[b] -= sizes[i]
        last_used[b] = t
        members[b].append(i)
    return [sorted(m) for m in members]


def bins_of(lengths: list[int], seq_len: int) -> list[list[int]]:
    starts, order = build_plan(np.array(lengths, np.int64), seq_len)
    return [order[a:b].tolist() for a, b in itertools.pairwise(starts)]


@given(
    lengths=st.lists(st.integers(1, 70), max_size=80),
    seq_len=st.integers(1, 64),
)
def test_plan_equals_the_one_sequence_at_a_time_reference(lengths: list[int], seq_len: int) -> None:
    got = bins_of(lengths, seq_len)
    assert got == reference_plan(lengths, seq_len)
    placed = sorted(i for b in got for i in b)
    assert placed == list(range(len(lengths))), "every sequence in exactly one bin"
    assert all(sum(min(lengths[i], seq_len) for i in b) <= seq_len for b in got)


def test_blocks_are_packed_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(binpack, "BLOCK", 4)
    lengths = [3, 3, 3, 3, 1, 1, 1, 1, 2]
    expected = []
    for lo in range(0, len(lengths), 4):
        expected += [[i + lo for i in b] for b in reference_plan(lengths[lo : lo + 4], 4)]
    assert bins_of(lengths, 4) == expected
    assert len(expected) == 6  # the whole split packs into 5: a 1 beside each 3


def test_golden_plan() -> None:
    # Frozen: a change here changes every bins run's batches (a breaking change).
    lengths = (np.arange(1000) * 7919 % 997 + 1).astype(np.int64)
    starts, order = build_plan(lengths, 2048)
    assert binpack.ALGORITHM == "best-fit-decreasing/blocks-of-262144"
    assert starts.size - 1 == GOLDEN_BINS
    assert plan_digest(starts, order) == GOLDEN_DIGEST
    assert [order[starts[b] : starts[b + 1]].tolist() for b in range(3)] == GOLDEN_FIRST_BINS
    assert bins_of(lengths.tolist(), 2048)[:3] == reference_plan(lengths.tolist(), 2048)[:3]


GOLDEN_BINS = 244
GOLDEN_DIGEST = "9baa770f5b11fc17"
GOLDEN_FIRST_BINS = [[35, 70, 104], [105, 140, 961], [175, 210, 821]]


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="seq_len must be an int >= 1"):
        build_plan(np.array([1]), 0)
    with pytest.raises(ValueError, match="lengths must be >= 0"):
        build_plan(np.array([1, -2]), 4)
    with pytest.raises(ValueError, match="lengths must be 1-D integers"):
        build_plan(np.array([1.5]), 4)


def test_empty_split_has_no_bins() -> None:
    starts, order = build_plan(np.zeros(0, np.int64), 8)
    assert starts.tolist() == [0] and order.size == 0
