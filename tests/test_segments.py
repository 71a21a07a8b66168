"""Tests for ``flat_tokens_jax.decoding.segments``: sequence starts and the segment
ids and positions of packed rows, each against a token-by-token reference."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flat_tokens_jax.decoding.segments import _fill_runs, sequence_starts, write_segments


@pytest.mark.parametrize(
    "write", [_fill_runs, write_segments], ids=["tile by tile", "tiles or a scan"]
)
@settings(max_examples=60)
@given(
    batch=st.integers(1, 6),
    seq_len=st.integers(1, 700),
    every=st.sampled_from([2, 9, 60, 130, 400, 5000]),
    data=st.data(),
)
def test_segments_match_a_token_by_token_reference(
    write: Callable[[np.ndarray, np.ndarray, np.ndarray], None],
    batch: int,
    seq_len: int,
    every: int,
    data: st.DataObject,
) -> None:
    """Segment ids and positions written tile by tile (a run start inside a tile,
    on a tile's first token, a row start inside a tile, a last partial tile),
    or by a scan of every token where starts are dense, equal a loop over every
    token."""
    size = batch * seq_len
    picks = data.draw(st.lists(st.integers(0, size - 1), max_size=max(1, size // every)))
    starts = np.unique(np.array(picks, np.int64))
    segment_ids = np.full((batch, seq_len), -7, np.int32)
    positions = np.full((batch, seq_len), -7, np.int32)
    write(starts, segment_ids, positions)
    is_start = set(starts.tolist())
    for r in range(batch):
        segment, position = 1, 0
        for c in range(seq_len):
            if c and r * seq_len + c in is_start:
                segment, position = segment + 1, 0
            elif c:
                position += 1
            assert (segment_ids[r, c], positions[r, c]) == (segment, position), (r, c)


@pytest.mark.parametrize("size", [0, 5, 16 * 1024 - 1, 16 * 1024, 50_001])
@pytest.mark.parametrize("every", [1, 3, 997, 10**6])
@pytest.mark.parametrize("small_flags", [False, True])
def test_sequence_starts_are_the_odd_tokens(size: int, every: int, small_flags: bool) -> None:
    """Sparse starts (found through OR-folded slices) and dense ones (every token
    tested), with scratch flags too small for a test of every token."""
    rng = np.random.default_rng(size + every)
    flat = (rng.integers(0, 2**31, size, dtype=np.uint32) * 2).astype(np.uint32)
    odd = rng.choice(size, size // every, replace=False) if size else np.zeros(0, np.int64)
    flat[odd] += 1
    flags = np.empty(size // 16 if small_flags else size, np.bool_)
    scratch = np.empty(size // 16 + 1, np.uint32)
    found = sequence_starts(flat, flags, scratch)
    np.testing.assert_array_equal(found, np.sort(odd))
