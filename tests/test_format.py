import itertools
import re

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from flat_tokens_jax.core import format as fmt

MAX = fmt.MAX_TOKEN_ID
sequences = st.lists(st.lists(st.integers(0, MAX), min_size=1, max_size=20), max_size=20)


def reference_encode(seqs: list[list[int]]) -> tuple[list[int], list[int]]:
    tokens, starts = [], [0]
    for seq in seqs:
        for j, t in enumerate(seq):
            tokens.append(t * 2 + (1 if j == 0 else 0))
        starts.append(len(tokens))
    return tokens, starts


def test_spec_example() -> None:
    enc, starts = fmt.encode([[1, 2], [3, 4, 5], [6, 7, 8]])
    assert enc.tolist() == [3, 4, 7, 8, 10, 13, 14, 16]
    assert starts.tolist() == [0, 2, 5, 8]
    assert enc.dtype == np.uint32 and starts.dtype == np.uint64


@given(sequences)
def test_encode_matches_reference_and_decodes_back(seqs: list[list[int]]) -> None:
    enc, starts = fmt.encode(seqs)
    ref_tokens, ref_starts = reference_encode(seqs)
    assert enc.tolist() == ref_tokens
    assert starts.tolist() == ref_starts
    ids = fmt.decode(enc)
    assert [ids[a:b].tolist() for a, b in itertools.pairwise(ref_starts)] == seqs
    assert np.flatnonzero(enc & 1).tolist() == ref_starts[:-1]


@pytest.mark.parametrize("bad", [[-1], [MAX + 1], [2**32], [0, 5, 2**40]])
def test_ids_outside_the_range_are_refused(bad: list[int]) -> None:
    with pytest.raises(ValueError, match=r"outside \[0, 2147483647\]"):
        fmt.encode([[1, 2], bad])


def test_bounds_are_accepted() -> None:
    enc, _ = fmt.encode([[0, MAX], [MAX]])
    assert fmt.decode(enc).tolist() == [0, MAX, MAX]


def test_bad_dtype_and_empty_sequences_are_refused() -> None:
    with pytest.raises(ValueError, match="must be integers, got dtype float64"):
        fmt.encode([[1.5, 2.0]])
    with pytest.raises(ValueError, match="sequence 1 is empty"):
        fmt.encode([[1], []])
    with pytest.raises(ValueError, match="1-D"):
        fmt.encode([[[1, 2]]])


def test_unsigned_ids_beyond_int31_are_refused() -> None:
    with pytest.raises(ValueError, match="4294967295"):
        fmt.check_token_ids(np.array([1, 2**32 - 1], np.uint32), "seq")
    with pytest.raises(ValueError, match="18446744073709551615"):
        fmt.check_token_ids(np.array([2**64 - 1], np.uint64), "seq")


def test_starts_block_names_each_violation() -> None:
    problems = fmt.check_starts_block(np.array([1, 3, 3, 2, 9], np.uint64), 0, None, 8, "s")
    text = [str(p) for p in problems]
    assert "s[0]: first entry must be 0 (value 1)" in text
    assert "s[2]: not strictly increasing (previous entry 3) (value 3)" in text
    assert "s[3]: not strictly increasing (previous entry 3) (value 2)" in text
    assert "s[4]: beyond the 8 tokens of the split (value 9)" in text
    assert len(problems) == 4


def test_starts_block_continues_from_previous_block() -> None:
    assert fmt.check_starts_block(np.array([5, 6], np.uint64), 10, 4, 8, "s") == []
    (p,) = fmt.check_starts_block(np.array([4, 6], np.uint64), 10, 4, 8, "s")
    assert (p.index, p.value) == (10, 4)


def test_tokens_block_checks_start_bits_and_max_id() -> None:
    enc, starts = fmt.encode([[1, 2], [3, 4, 5]])
    assert fmt.check_tokens_block(enc, 0, starts[:-1], 5, "t") == []
    bad = enc.copy()
    bad[1] |= 1
    bad[2] &= ~np.uint32(1)
    problems = fmt.check_tokens_block(bad, 100, starts[:-1] + 100, 4, "t")
    text = [str(p) for p in problems]
    clear = "seq_starts marks a sequence start here but the start bit is clear"
    assert f"t[102]: {clear} (value 6)" in text
    assert "t[101]: start bit set where seq_starts has no sequence start (value 5)" in text
    assert "t[104]: token id above max_token_id 4 (value 5)" in text


def test_format_error_lists_and_truncates() -> None:
    err = fmt.FormatError([fmt.Problem("a", f"p{i}", i) for i in range(25)])
    assert len(err.problems) == 25
    assert "a[19]: p19" in str(err) and "a[20]" not in str(err)
    assert "and 5 more" in str(err)


# A split name: lowercase ASCII, a letter first, at most 64 characters, and no
# name of what a split holds (written out here, independently of the code).
SPLIT_RULE = re.compile(r"[a-z][a-z0-9_-]{0,63}")
SPLIT_MEMBERS = {"encoded_tokens", "tokens", "seq_starts", "loss_mask"}


def allowed_split_name(name: object) -> bool:
    return (
        isinstance(name, str)
        and SPLIT_RULE.fullmatch(name) is not None
        and name not in SPLIT_MEMBERS
        and not name.startswith("bins_")
    )


@pytest.mark.parametrize(
    ("name", "why", "fix"),
    [
        ("Train", "is not allowed: a split name is lowercase ASCII", "write 'train'"),
        ("é", "is not allowed", "write 'test'"),
        ("a/b", "is not allowed", "write 'a_b'"),
        ("a b", "is not allowed", "write 'a_b'"),
        ("1st", "is not allowed", "write 'st'"),
        ("bins_8", "names starting 'bins_' are the packing plans", "e.g. 'test'"),
        ("_staging", "is not allowed (names starting with '_' or '.' are the store's", "'staging'"),
        ("", "must be a non-empty string, got ''", "e.g. 'test'"),
        (".", "is not allowed (names starting with '_' or '.'", "write 'test'"),
        ("../x", "is not allowed (names starting with '_' or '.'", "write 'x'"),
        ("zarr.json", "is not allowed", "write 'zarr_json'"),
        ("seq_starts", "the store names an array inside every split so", "e.g. 'test'"),
        ("encoded_tokens", "names an array inside every split", "e.g. 'test'"),
        ("loss_mask", "names an array inside every split", "e.g. 'test'"),
        ("tokens", "names an array inside every split", "e.g. 'test'"),
        ("x" * 65, "(65 characters)", "write '" + "x" * 64 + "'"),
        (7, "must be a non-empty string, got 7", "e.g. 'test'"),
        (None, "must be a non-empty string, got None", "e.g. 'test'"),
    ],
)
def test_a_split_name_outside_the_rule_is_refused_naming_it_and_the_fix(
    name: object, why: str, fix: str
) -> None:
    with pytest.raises(ValueError) as e:
        fmt.check_split_name(name)
    message = str(e.value)
    assert why in message and message.endswith(fix), message
    if "is not allowed" in message:
        assert "lowercase ASCII: a letter, then letters, digits, '_' or '-'" in message


@pytest.mark.parametrize("name", ["train", "validation", "test", "dev-2", "a", "x" * 64, "bins"])
def test_plain_split_names_are_accepted(name: str) -> None:
    assert fmt.check_split_name(name) == name


@given(st.text(max_size=80) | st.from_regex(r"[a-z][a-z0-9_-]{0,70}", fullmatch=True))
def test_split_names_follow_the_rule_and_every_suggestion_is_allowed(name: str) -> None:
    if allowed_split_name(name):
        assert fmt.check_split_name(name) == name
        return
    with pytest.raises(ValueError) as e:
        fmt.check_split_name(name)
    suggestion = re.search(r"(?:write|e\.g\.) '([^']*)'$", str(e.value))
    assert suggestion is not None, str(e.value)
    assert allowed_split_name(suggestion.group(1))
