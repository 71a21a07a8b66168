"""The flat-tokens encoding, its invariants and the one error type for broken data.

A split stores every token of every sequence concatenated in ``encoded_tokens``
(``uint32``): ``token_id * 2 + 1`` where a sequence starts, ``token_id * 2``
elsewhere. ``seq_starts`` (``uint64``, ``num_sequences + 1`` entries) holds the
offset of each sequence and ends with ``num_tokens``. Pure numpy, no I/O.
"""

from __future__ import annotations

import dataclasses
import operator
import re
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from flat_tokens_jax.core.values import BadValue, text

MAX_TOKEN_ID = 2**31 - 1
ENCODED_DTYPE = np.dtype(np.uint32)
STARTS_DTYPE = np.dtype(np.uint64)
MASK_DTYPE = np.dtype(np.uint8)
TOKENS = "encoded_tokens"
LEGACY_TOKENS = "tokens"
SEQ_STARTS = "seq_starts"
LOSS_MASK = "loss_mask"
SPLITS = ("train", "validation")
"""The splits every dataset has (written empty when no data goes to them); any
other split a dataset has is an extra one, recorded in its root attributes."""
MAX_SPLIT_NAME = 64
_SPLIT_NAME = re.compile(r"[a-z][a-z0-9_-]*")
_SPLIT_RULE = (
    "a split name is lowercase ASCII: a letter, then letters, digits, '_' or '-', "
    f"at most {MAX_SPLIT_NAME} characters (one plain folder on every file system "
    "and object store)"
)
# Names of what a split holds: a split of such a name would read as a member
# of another split to a tool that lists the dataset one level down.
_SPLIT_MEMBERS = (TOKENS, LEGACY_TOKENS, SEQ_STARTS, LOSS_MASK)
_PLAN_PREFIX = "bins_"  # <split>/bins_<seq_len>: the packing plans `pack` stores


def check_split_name(name: Any) -> str:
    """``name`` if it may name a split: lowercase ASCII, ``[a-z][a-z0-9_-]*``, at
    most :data:`MAX_SPLIT_NAME` characters (so off the store's own files, which
    start with ``_`` or ``.``), and no name the store uses inside a split.

    Raises:
        ValueError: naming the name, the rule it breaks and a name to write.
    """
    try:
        text(name, "a split name")
    except BadValue as e:
        raise ValueError(f"{e}; {_SPLIT_RULE}: write e.g. 'test'") from None
    shown = repr(name) if len(name) <= 2 * MAX_SPLIT_NAME else f"{name[:MAX_SPLIT_NAME]!r}..."
    if name in _SPLIT_MEMBERS:
        raise ValueError(
            f"split name {shown} is refused: the store names an array inside every "
            "split so; choose another name, e.g. 'test'"
        )
    if name.startswith(_PLAN_PREFIX):
        raise ValueError(
            f"split name {shown} is refused: names starting {_PLAN_PREFIX!r} are the "
            "packing plans that `pack` stores inside a split; choose another name, e.g. 'test'"
        )
    if len(name) > MAX_SPLIT_NAME or not _SPLIT_NAME.fullmatch(name):
        why = f" ({len(name)} characters)" if len(name) > MAX_SPLIT_NAME else ""
        if name[0] in "_.":
            why += " (names starting with '_' or '.' are the store's own files)"
        raise ValueError(
            f"split name {shown} is not allowed{why}: {_SPLIT_RULE}; write {_plain(name)!r}"
        )
    return name


def split_names(names: Iterable[Any]) -> tuple[str, ...]:
    """:data:`SPLITS`, then ``names``, each checked by :func:`check_split_name`, repeats dropped."""
    return tuple(dict.fromkeys([*SPLITS, *(check_split_name(name) for name in names)]))


def _plain(name: str) -> str:
    """A name near ``name`` that follows the rule of :func:`check_split_name`, else ``"test"``."""
    plain = re.sub(r"[^a-z0-9_-]+", "_", name.lower()).lstrip("_-0123456789")
    plain = plain[:MAX_SPLIT_NAME]
    ok = plain and plain not in _SPLIT_MEMBERS and not plain.startswith(_PLAN_PREFIX)
    return plain if ok else "test"


class UnknownSplit(KeyError, ValueError):
    """A split that a dataset or a writer does not have: a ``KeyError`` whose text
    reads as a sentence, and a ``ValueError`` so the command line reports it."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


@dataclasses.dataclass(frozen=True)
class Problem:
    """One violation of the format: ``message`` at ``where`` (e.g.
    ``"train/seq_starts"``), element ``index`` and its ``value`` where known."""

    where: str
    message: str
    index: int | None = None
    value: object = None

    def __str__(self) -> str:
        loc = self.where if self.index is None else f"{self.where}[{self.index}]"
        val = "" if self.value is None else f" (value {self.value})"
        # A problem made from a message alone names its place inside the message.
        return f"{loc}: {self.message}{val}" if loc else f"{self.message}{val}"


class FormatError(ValueError):
    """Data that breaks the flat-tokens format; ``problems`` lists every violation found."""

    max_listed = 20

    def __init__(self, problems: Problem | str | Sequence[Problem]) -> None:
        if isinstance(problems, str):
            problems = [Problem("", problems)]
        elif isinstance(problems, Problem):
            problems = [problems]
        self.problems: list[Problem] = list(problems)
        lines = [str(p) for p in self.problems[: self.max_listed]]
        more = len(self.problems) - self.max_listed
        if more > 0:
            lines.append(f"... and {more} more")
        super().__init__(lines[0] if len(lines) == 1 else "\n  ".join(["", *lines]).lstrip("\n"))


def listed_problems(
    where: str, message: str, at: np.ndarray, values: np.ndarray, offset: int = 0
) -> list[Problem]:
    """The problem of ``values[i]`` at index ``offset + i``, for the first
    :attr:`FormatError.max_listed` indices ``i`` of ``at``."""
    return [
        Problem(where, message, offset + int(i), int(values[i]))
        for i in at[: FormatError.max_listed]
    ]


def as_indices(values: Any, what: str) -> np.ndarray:
    """``values`` (any shape) as ``[k] int64``; ``TypeError`` for floats, booleans
    or anything else not integral (truncating ``1.7`` would read another index)."""
    array = np.asarray(values)
    if array.size and array.dtype.kind not in "iu":
        raise TypeError(
            f"{what} must be integers, got {array.dtype} values such as {array.reshape(-1)[0]!r}"
        )
    return array.astype(np.int64).reshape(-1)


def indices_below(values: Any, n: int, noun: str, who: object) -> np.ndarray:
    """:func:`as_indices` of ``values``, each in ``[0, n)``, else ``IndexError`` naming ``who``."""
    idx = as_indices(values, f"{noun} indices")
    bad = np.flatnonzero((idx < 0) | (idx >= n))
    if bad.size:
        raise IndexError(f"{who!r}: {noun} index {idx[bad[0]]} is outside [0, {n})")
    return idx


def as_index(value: Any, what: str) -> int:
    """``value`` as an ``int``, refusing floats and booleans (see :func:`as_indices`)."""
    if isinstance(value, bool | np.bool_) or not hasattr(type(value), "__index__"):
        raise TypeError(f"{what} must be an integer, got {value!r}")
    return operator.index(value)


def check_token_ids(ids: np.ndarray, where: str) -> np.ndarray:
    """Token ids ``[n]`` of one sequence (any integer dtype) as ``int64``;
    ``ValueError`` naming ``where`` if not 1-D integers in ``[0, 2**31 - 1]``."""
    arr = np.asarray(ids)
    if arr.ndim != 1:
        raise ValueError(f"{where}: expected a 1-D sequence of token ids, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, np.int64)
    if arr.dtype.kind not in "iu":
        raise ValueError(f"{where}: token ids must be integers, got dtype {arr.dtype}")
    if int(arr.min()) < 0 or int(arr.max()) > MAX_TOKEN_ID:
        bad = int(np.flatnonzero((arr < 0) | (arr > MAX_TOKEN_ID))[0])
        raise ValueError(
            f"{where}: token id {int(arr[bad])} at position {bad} is outside "
            f"[0, {MAX_TOKEN_ID}], the range the format can store"
        )
    return arr.astype(np.int64, copy=False)


def check_loss_mask(mask: np.ndarray, num_tokens: int, where: str) -> np.ndarray:
    """A loss mask (bool, or integers all 0 or 1) as ``[num_tokens] uint8``;
    ``ValueError`` naming ``where`` otherwise."""
    arr = np.asarray(mask)
    if arr.ndim != 1 or arr.size != num_tokens:
        raise ValueError(
            f"{where}: loss mask of shape {arr.shape}, expected one entry per token ({num_tokens},)"
        )
    if arr.size and arr.dtype.kind not in "biu":
        raise ValueError(f"{where}: loss mask must be bool or integers, got dtype {arr.dtype}")
    bad = np.flatnonzero((arr != 0) & (arr != 1))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"{where}: loss mask entry {i} is {arr[i]}; entries must be 0 or 1")
    return arr.astype(MASK_DTYPE, copy=False)


def encode_concatenated(ids: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """``[num_tokens] uint32`` encoded tokens of checked ``ids`` ``[num_tokens]``
    whose sequences start at offsets ``starts`` ``[num_sequences]``."""
    out = ids.astype(np.uint32) << np.uint32(1)
    out[starts] |= np.uint32(1)
    return out


def encode(
    sequences: Iterable[Sequence[int] | np.ndarray], where: str = "sequence", first: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Encodes whole sequences in memory (for tests and small data); errors name
    sequence ``i`` as ``f"{where} {first + i}"``.

    Returns:
        ``(encoded_tokens [num_tokens] uint32, seq_starts [num_sequences + 1] uint64)``.

    Example:
        >>> enc, starts = encode([[1, 2], [3, 4, 5], [6, 7, 8]])
        >>> enc.tolist(), starts.tolist()
        ([3, 4, 7, 8, 10, 13, 14, 16], [0, 2, 5, 8])
    """
    arrays = [
        check_token_ids(np.asarray(s), f"{where} {first + i}") for i, s in enumerate(sequences)
    ]
    for i, a in enumerate(arrays):
        if a.size == 0:
            raise ValueError(
                f"{where} {first + i} is empty; the format cannot store empty sequences "
                "(drop them before writing)"
            )
    lengths = np.array([a.size for a in arrays], dtype=np.uint64)
    seq_starts = np.zeros(len(arrays) + 1, dtype=np.uint64)
    np.cumsum(lengths, out=seq_starts[1:])
    ids = np.concatenate(arrays) if arrays else np.zeros(0, np.int64)
    return encode_concatenated(ids, seq_starts[:-1].astype(np.int64)), seq_starts


def decode(encoded: np.ndarray) -> np.ndarray:
    """Token ids ``int32`` of encoded tokens (any shape)."""
    return (np.asarray(encoded, dtype=np.uint32) >> np.uint32(1)).astype(np.int32)


def check_starts_block(
    starts: np.ndarray, offset: int, previous: int | None, num_tokens: int, where: str
) -> list[Problem]:
    """Problems of ``starts`` (``[k] uint64`` entries ``offset ..`` of
    ``seq_starts``, after ``previous``; ``None``: the first block): it must
    start at 0, strictly increase and stay within ``num_tokens``."""
    problems: list[Problem] = []
    values = np.asarray(starts, dtype=np.uint64)
    if previous is None and values.size and int(values[0]) != 0:
        problems.append(Problem(where, "first entry must be 0", 0, int(values[0])))
    prev = np.concatenate([[np.uint64(previous)], values]) if previous is not None else values
    bad = np.flatnonzero(prev[1:] <= prev[:-1])
    base = offset if previous is not None else offset + 1
    problems += [
        Problem(
            where,
            f"not strictly increasing (previous entry {int(prev[i])})",
            base + int(i),
            int(prev[i + 1]),
        )
        for i in bad[: FormatError.max_listed]
    ]
    over = np.flatnonzero(values > np.uint64(num_tokens))
    beyond = f"beyond the {num_tokens} tokens of the split"
    return problems + listed_problems(where, beyond, over, values, offset)


def check_tokens_block(
    encoded: np.ndarray, offset: int, starts: np.ndarray, max_token_id: int, where: str
) -> list[Problem]:
    """Problems of ``encoded`` (``[k] uint32`` tokens ``offset ..``): start bits
    exactly at ``starts`` (the ``seq_starts`` entries in the block), ids at most
    ``max_token_id``."""
    problems: list[Problem] = []
    encoded = np.asarray(encoded)
    flagged = np.flatnonzero(encoded & np.uint32(1))
    expected = np.asarray(starts, dtype=np.int64) - offset
    if flagged.size != expected.size or not np.array_equal(flagged, expected):
        clear = "seq_starts marks a sequence start here but the start bit is clear"
        problems += listed_problems(where, clear, np.setdiff1d(expected, flagged), encoded, offset)
        extra = "start bit set where seq_starts has no sequence start"
        problems += listed_problems(where, extra, np.setdiff1d(flagged, expected), encoded, offset)
    ids = encoded >> np.uint32(1)
    over = np.flatnonzero(ids > np.uint32(max_token_id))
    above = f"token id above max_token_id {max_token_id}"
    return problems + listed_problems(where, above, over, ids, offset)
