"""Tests for ``flat_tokens_jax.decoding.batch``: golden rows, a per-token reference, stored
masks."""

from __future__ import annotations

import itertools
from typing import Any

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flat_tokens_jax.decoding.batch import FIELDS, packed_fields, padded_fields
from flat_tokens_jax.decoding.batch_jax import packed_fields_jax, padded_fields_jax

MAX_ID = 2**31 - 1
INT32 = st.integers(-(2**31), 2**31 - 1)
UINT32 = st.integers(0, 2**32 - 1)

Rows = dict[str, list[list[Any]]]

packed_jit = jax.jit(packed_fields_jax)
padded_jit = jax.jit(padded_fields_jax)


# -- A plain-Python reference: explicit loops over tokens, no numpy. --------------


def encode(seqs: list[list[int]]) -> list[int]:
    """The spec's encoding of ``seqs``, concatenated."""
    return [tok * 2 + (i == 0) for seq in seqs for i, tok in enumerate(seq)]


def packed_windows(
    seqs: list[list[int]], offsets: list[int], seq_len: int, junk: int
) -> np.ndarray:
    """``[len(offsets), seq_len + 1]`` windows: the token before each record, then the record.

    The record at token 0 has nothing before it; column 0 holds ``junk`` there.
    """
    flat = encode(seqs)
    rows = [[flat[o - 1] if o else junk, *flat[o : o + seq_len]] for o in offsets]
    return np.array(rows, np.uint32).reshape(len(offsets), seq_len + 1)


def packed_reference(
    seqs: list[list[int]], offsets: list[int], seq_len: int, start_token_id: int
) -> Rows:
    """The fields of the packed rows whose targets are tokens ``[o, o + seq_len)``."""
    place = [(s, i) for s, seq in enumerate(seqs) for i in range(len(seq))]
    out: Rows = {k: [] for k in FIELDS}
    for o in offsets:
        row: dict[str, list[Any]] = {k: [] for k in FIELDS}
        segment = position = 0
        for t in range(seq_len):
            s, i = place[o + t]
            row["targets"].append(seqs[s][i])
            row["inputs"].append(start_token_id if i == 0 else seqs[s][i - 1])
            if t == 0:
                segment, position = 1, 0
            elif i == 0:
                segment, position = segment + 1, 0
            else:
                position += 1
            row["segment_ids"].append(segment)
            row["positions"].append(position)
            row["loss_mask"].append(True)
        for k in FIELDS:
            out[k].append(row[k])
    return out


def padded_reference(
    seqs: list[list[int]], lengths: list[int], seq_len: int, start_token_id: int, pad_id: int
) -> Rows:
    """The fields of one right-padded row per sequence, ``lengths`` tokens kept."""
    out: Rows = {k: [] for k in FIELDS}
    for seq, n in zip(seqs, lengths, strict=True):
        row: dict[str, list[Any]] = {k: [] for k in FIELDS}
        for t in range(seq_len):
            real = t < n
            row["targets"].append(seq[t] if real else pad_id)
            row["inputs"].append((start_token_id if t == 0 else seq[t - 1]) if real else pad_id)
            row["segment_ids"].append(1 if real else 0)
            row["positions"].append(t if real else 0)
            row["loss_mask"].append(real)
        for k in FIELDS:
            out[k].append(row[k])
    return out


def padded_tokens(seqs: list[list[int]], lengths: list[int], seq_len: int, junk: int) -> np.ndarray:
    """``[len(seqs), seq_len]`` encoded rows, ``junk`` after each row's kept tokens."""
    rows = [
        encode([seq[:n]])[:n] + [junk] * (seq_len - n) for seq, n in zip(seqs, lengths, strict=True)
    ]
    return np.array(rows, np.uint32).reshape(len(seqs), seq_len)


def assert_fields(got: dict[str, Any], want: Rows, shape: tuple[int, int]) -> None:
    assert sorted(got) == sorted(FIELDS)
    for k in FIELDS:
        arr = np.asarray(got[k])
        assert arr.shape == shape, k
        assert arr.dtype == (np.bool_ if k == "loss_mask" else np.int32), k
        np.testing.assert_array_equal(arr, np.array(want[k]).reshape(shape), err_msg=k)


# -- Golden rows from the spec. -----------------------------------------------------

SPEC_SEQS = [[1, 2], [3, 4, 5], [6, 7, 8]]
SPEC_TOKENS = [3, 4, 7, 8, 10, 13, 14, 16]


def test_encode_matches_spec() -> None:
    assert encode(SPEC_SEQS) == SPEC_TOKENS


GOLDEN_PACKED = [
    pytest.param(
        [0, *SPEC_TOKENS],
        {
            "inputs": [0, 1, 0, 3, 4, 0, 6, 7],
            "targets": [1, 2, 3, 4, 5, 6, 7, 8],
            "segment_ids": [1, 1, 2, 2, 2, 3, 3, 3],
            "positions": [0, 1, 0, 1, 2, 0, 1, 2],
        },
        id="L8-record0",
    ),
    pytest.param(
        [0, 3, 4, 7, 8],
        {
            "inputs": [0, 1, 0, 3],
            "targets": [1, 2, 3, 4],
            "segment_ids": [1, 1, 2, 2],
            "positions": [0, 1, 0, 1],
        },
        id="L4-record0",
    ),
    pytest.param(
        [8, 10, 13, 14, 16],
        {
            "inputs": [4, 0, 6, 7],
            "targets": [5, 6, 7, 8],
            "segment_ids": [1, 2, 2, 2],
            "positions": [0, 0, 1, 2],
        },
        id="L4-record1",
    ),
]


@pytest.mark.parametrize(("window", "want"), GOLDEN_PACKED)
@pytest.mark.parametrize("impl", ["numpy", "jax"])
def test_packed_golden(window: list[int], want: dict[str, list[int]], impl: str) -> None:
    w = np.array([window], np.uint32)
    got = packed_fields(w) if impl == "numpy" else packed_jit(w)
    rows: Rows = {k: [v] for k, v in want.items()}
    rows["loss_mask"] = [[True] * (len(window) - 1)]
    assert_fields(got, rows, (1, len(window) - 1))


@pytest.mark.parametrize("pad_id", [7, -1])
@pytest.mark.parametrize("impl", ["numpy", "jax"])
def test_padded_golden(pad_id: int, impl: str) -> None:
    tokens = np.array([[7, 8, 10, 99, 12345]], np.uint32)  # [3, 4, 5] then junk
    lengths = np.array([3])
    if impl == "numpy":
        got = padded_fields(tokens, lengths, pad_id=pad_id)
    else:
        got = padded_jit(tokens, lengths, pad_id=pad_id)
    p = pad_id
    want: Rows = {
        "inputs": [[0, 3, 4, p, p]],
        "targets": [[3, 4, 5, p, p]],
        "segment_ids": [[1, 1, 1, 0, 0]],
        "positions": [[0, 1, 2, 0, 0]],
        "loss_mask": [[True, True, True, False, False]],
    }
    assert_fields(got, want, (1, 5))


# -- Property tests against the reference. ------------------------------------------

ids = st.integers(0, MAX_ID)


@st.composite
def packed_cases(draw: st.DrawFn) -> tuple[list[list[int]], list[int], int, int, int]:
    """Sequences, row offsets into their tokens, seq_len, start_token_id, junk."""
    seqs = draw(st.lists(st.lists(ids, min_size=1, max_size=20), min_size=1, max_size=8))
    total = sum(map(len, seqs))
    seq_len = draw(st.integers(1, min(total, 40)))
    offsets = draw(st.lists(st.integers(0, total - seq_len), min_size=1, max_size=6))
    return seqs, offsets, seq_len, draw(INT32), draw(UINT32)


@given(packed_cases())
def test_packed_matches_reference(case: tuple[list[list[int]], list[int], int, int, int]) -> None:
    seqs, offsets, seq_len, start, junk = case
    got = packed_fields(packed_windows(seqs, offsets, seq_len, junk), start_token_id=start)
    want = packed_reference(seqs, offsets, seq_len, start)
    assert_fields(got, want, (len(offsets), seq_len))


@settings(max_examples=25)
@given(packed_cases())
def test_packed_jax_matches_reference(
    case: tuple[list[list[int]], list[int], int, int, int],
) -> None:
    seqs, offsets, seq_len, start, junk = case
    got = packed_jit(packed_windows(seqs, offsets, seq_len, junk), start_token_id=start)
    want = packed_reference(seqs, offsets, seq_len, start)
    assert_fields(got, want, (len(offsets), seq_len))


@st.composite
def padded_cases(draw: st.DrawFn) -> tuple[list[list[int]], list[int], int, int, int, int]:
    """Sequences, kept lengths, seq_len, start_token_id, pad_id, junk."""
    seq_len = draw(st.integers(1, 24))
    seqs = draw(st.lists(st.lists(ids, min_size=1, max_size=30), min_size=1, max_size=6))
    lengths = [draw(st.integers(0, min(len(s), seq_len))) for s in seqs]
    return seqs, lengths, seq_len, draw(INT32), draw(INT32), draw(UINT32)


@given(padded_cases())
def test_padded_matches_reference(
    case: tuple[list[list[int]], list[int], int, int, int, int],
) -> None:
    seqs, lengths, seq_len, start, pad, junk = case
    tokens = padded_tokens(seqs, lengths, seq_len, junk)
    got = padded_fields(tokens, np.array(lengths), start_token_id=start, pad_id=pad)
    assert_fields(got, padded_reference(seqs, lengths, seq_len, start, pad), tokens.shape)


@settings(max_examples=25)
@given(padded_cases())
def test_padded_jax_matches_reference(
    case: tuple[list[list[int]], list[int], int, int, int, int],
) -> None:
    seqs, lengths, seq_len, start, pad, junk = case
    tokens = padded_tokens(seqs, lengths, seq_len, junk)
    got = padded_jit(tokens, np.array(lengths, np.int32), start_token_id=start, pad_id=pad)
    assert_fields(got, padded_reference(seqs, lengths, seq_len, start, pad), tokens.shape)


@pytest.mark.parametrize("mean_len", [1.5, 40, 1_000, 50_000])
def test_packed_large_batches_match_reference(mean_len: float) -> None:
    """Batches big enough for the fast path that folds tokens to find starts.

    The flat window count is not a multiple of the fold, so a tail is left over,
    and the last token always starts a sequence, so the tail holds a start.
    """
    rng = np.random.default_rng(int(mean_len))
    batch, seq_len = 15, 2050
    total = batch * seq_len + 7
    cuts = np.flatnonzero(rng.random(total) < 1 / mean_len).tolist()
    bounds = sorted({0, *cuts, total - 1, total})
    flat_ids = rng.integers(0, MAX_ID, total).tolist()
    seqs = [flat_ids[a:b] for a, b in itertools.pairwise(bounds)]
    offsets = [0, *rng.integers(0, total - seq_len, batch - 2).tolist(), total - seq_len]
    windows = packed_windows(seqs, offsets, seq_len, junk=5)
    want = packed_reference(seqs, offsets, seq_len, 9)
    assert_fields(packed_fields(windows, start_token_id=9), want, (batch, seq_len))
    assert_fields(packed_jit(windows, start_token_id=9), want, (batch, seq_len))


# -- Stored loss masks. ------------------------------------------------------------


@given(packed_cases(), st.randoms(use_true_random=False))
def test_packed_stored_mask(
    case: tuple[list[list[int]], list[int], int, int, int], rnd: Any
) -> None:
    seqs, offsets, seq_len, start, junk = case
    windows = packed_windows(seqs, offsets, seq_len, junk)
    mask = np.array(
        [[rnd.choice([0, 0, 1, 2, 255]) for _ in range(seq_len)] for _ in offsets], np.uint8
    )
    want = packed_reference(seqs, offsets, seq_len, start)
    want["loss_mask"] = (mask != 0).tolist()
    shape = (len(offsets), seq_len)
    assert_fields(packed_fields(windows, start_token_id=start, stored_mask=mask), want, shape)
    got_jax = packed_jit(windows, start_token_id=start, stored_mask=mask)
    assert_fields(got_jax, want, shape)


@given(padded_cases(), st.randoms(use_true_random=False))
def test_padded_stored_mask(
    case: tuple[list[list[int]], list[int], int, int, int, int], rnd: Any
) -> None:
    seqs, lengths, seq_len, start, pad, junk = case
    tokens = padded_tokens(seqs, lengths, seq_len, junk)
    mask = np.array([[rnd.choice([0, 1, 3]) for _ in range(seq_len)] for _ in seqs], np.uint8)
    want = padded_reference(seqs, lengths, seq_len, start, pad)
    want["loss_mask"] = ((mask != 0) & np.array(want["loss_mask"])).tolist()
    lens = np.array(lengths)
    got = padded_fields(tokens, lens, start_token_id=start, pad_id=pad, stored_mask=mask)
    assert_fields(got, want, tokens.shape)
    got_jax = padded_jit(tokens, lens, start_token_id=start, pad_id=pad, stored_mask=mask)
    assert_fields(got_jax, want, tokens.shape)


# -- Shapes, layout and errors. ------------------------------------------------------


def test_packed_outputs_are_contiguous_and_independent() -> None:
    got = packed_fields(np.array([[0, *SPEC_TOKENS]], np.uint32))
    for k in FIELDS:
        assert got[k].flags.c_contiguous, k
    got["inputs"][:] = -5  # fields share an allocation but must not overlap
    assert got["targets"].tolist() == [[1, 2, 3, 4, 5, 6, 7, 8]]
    assert got["positions"].tolist() == [[0, 1, 0, 1, 2, 0, 1, 2]]
    assert got["loss_mask"].all()


def test_empty_batch() -> None:
    packed = packed_fields(np.zeros((0, 5), np.uint32))
    padded = padded_fields(np.zeros((0, 4), np.uint32), np.zeros(0, np.int64))
    for k in FIELDS:
        assert packed[k].shape == (0, 4), k
        assert padded[k].shape == (0, 4), k


def test_big_endian_windows_are_accepted() -> None:
    w = np.array([[0, *SPEC_TOKENS]], ">u4")
    assert packed_fields(w)["targets"].tolist() == [[1, 2, 3, 4, 5, 6, 7, 8]]


@pytest.mark.parametrize(
    ("windows", "kwargs", "match"),
    [
        (np.zeros(5, np.uint32), {}, "2-D"),
        (np.zeros((2, 1), np.uint32), {}, "at least 2"),
        (np.zeros((2, 5), np.int64), {}, "uint32"),
        (np.zeros((2, 5), np.uint32), {"stored_mask": np.ones((2, 5), np.uint8)}, r"\(2, 4\)"),
        (np.zeros((2, 5), np.uint32), {"start_token_id": 2**31}, "int32"),
    ],
)
def test_packed_rejects_bad_input(windows: np.ndarray, kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        packed_fields(windows, **kwargs)


@pytest.mark.parametrize(
    ("lengths", "kwargs", "match"),
    [
        (np.array([1, 5]), {}, r"\[0, 4\]"),
        (np.array([-1, 2]), {}, r"\[0, 4\]"),
        (np.array([1, 2, 3]), {}, r"shape \(2,\)"),
        (np.array([1.0, 2.0]), {}, "integers"),
        (np.array([1, 2]), {"pad_id": -(2**31) - 1}, "pad_id"),
        (np.array([1, 2]), {"stored_mask": np.ones((2, 3), np.uint8)}, "stored_mask"),
    ],
)
def test_padded_rejects_bad_input(lengths: np.ndarray, kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        padded_fields(np.zeros((2, 4), np.uint32), lengths, **kwargs)


def test_jax_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="uint32"):
        packed_fields_jax(np.zeros((2, 5), np.int32))
    with pytest.raises(ValueError, match="at least 2"):
        packed_fields_jax(np.zeros((2, 1), np.uint32))
    with pytest.raises(ValueError, match="stored_mask"):
        packed_fields_jax(np.zeros((2, 5), np.uint32), stored_mask=np.ones((2, 5), np.uint8))
    with pytest.raises(ValueError, match="lengths"):
        padded_fields_jax(np.zeros((2, 4), np.uint32), np.array([1, 2, 3]))
