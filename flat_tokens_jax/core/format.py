"""The flat-tokens encoding, its invariants and the one error type for broken data.

A split stores every token of every sequence concatenated in ``encoded_tokens``
(``uint32``): ``token_id * 2 + 1`` where a sequence starts, ``token_id * 2``
elsewhere. ``seq_starts`` (``uint64``, ``num_sequences + 1`` entries) holds the
offset of each sequence and ends with ``num_tokens``. Pure numpy, no I/O.
"""

from __future__ import annotations

import dataclasses
import itertools
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
    """``name`` if it may name a split: it follows the rule below and is no name
    the store uses inside a split (``encoded_tokens``, ``tokens``,
    ``seq_starts``, ``loss_mask``, ``bins_*``). The rule: lowercase ASCII,
    ``[a-z][a-z0-9_-]*``, at most :data:`MAX_SPLIT_NAME` characters; it also
    keeps split names off the store's own files (zarr metadata, the write
    marker, the staging folder), which start with ``_`` or ``.``.

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
    """A split that a dataset or a writer does not have: a ``KeyError`` whose
    text reads as a sentence (a plain one shows its message in quotes), and a
    ``ValueError`` as every other bad name given is, so that whatever reports
    bad input (the command line) reports it."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


@dataclasses.dataclass(frozen=True)
class Problem:
    """One violation of the format: what is wrong and where.

    Attributes:
        where: the split and array, e.g. ``"train/seq_starts"``.
        message: what is wrong, in words.
        index: the element index in that array, when one element is at fault.
        value: the offending value, when there is one.
    """

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


def as_indices(values: Any, what: str) -> np.ndarray:
    """``values`` (any shape) as ``[k] int64``, refusing what is not an integer:
    ``1.7`` or ``True`` is no index, and truncating it would read another one.

    Raises:
        TypeError: ``values`` hold floats, booleans or anything else not integral.
    """
    array = np.asarray(values)
    if array.size and array.dtype.kind not in "iu":
        raise TypeError(
            f"{what} must be integers, got {array.dtype} values such as {array.reshape(-1)[0]!r}"
        )
    return array.astype(np.int64).reshape(-1)


def as_index(value: Any, what: str) -> int:
    """``value`` as an ``int``, refusing floats and booleans (see :func:`as_indices`)."""
    if isinstance(value, bool | np.bool_) or not hasattr(type(value), "__index__"):
        raise TypeError(f"{what} must be an integer, got {value!r}")
    return operator.index(value)


def check_token_ids(ids: np.ndarray, where: str) -> np.ndarray:
    """Returns ``ids`` as ``int64`` after checking dtype and range.

    Args:
        ids: token ids of one sequence, any integer dtype, shape ``[n]``.
        where: names the sequence in error messages.

    Raises:
        ValueError: not a 1-D integer array, or an id outside ``[0, 2**31 - 1]``.
    """
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
    """Returns a loss mask as ``[num_tokens] uint8`` after checking it.

    Args:
        mask: ``[num_tokens]`` bool, or integers that are all 0 or 1.
        num_tokens: the length of the tokens it belongs to.
        where: names the sequence in error messages.

    Raises:
        ValueError: wrong shape or length, not bool or integer, or an entry other than 0 and 1.
    """
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
    """Encodes concatenated token ids given the offsets where sequences start.

    Args:
        ids: checked token ids ``[num_tokens]`` (int64 within range).
        starts: offsets of sequence starts within ``ids`` ``[num_sequences]``.

    Returns:
        ``[num_tokens] uint32`` encoded tokens.
    """
    out = ids.astype(np.uint32) << np.uint32(1)
    out[starts] |= np.uint32(1)
    return out


def encode(sequences: Iterable[Sequence[int] | np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Encodes whole sequences in memory (for tests and small data).

    Returns:
        ``(encoded_tokens [num_tokens] uint32, seq_starts [num_sequences + 1] uint64)``.

    Example:
        >>> enc, starts = encode([[1, 2], [3, 4, 5], [6, 7, 8]])
        >>> enc.tolist(), starts.tolist()
        ([3, 4, 7, 8, 10, 13, 14, 16], [0, 2, 5, 8])
    """
    arrays = [check_token_ids(np.asarray(s), f"sequence {i}") for i, s in enumerate(sequences)]
    for i, a in enumerate(arrays):
        if a.size == 0:
            raise ValueError(f"sequence {i} is empty; the format cannot store empty sequences")
    lengths = np.array([a.size for a in arrays], dtype=np.uint64)
    seq_starts = np.zeros(len(arrays) + 1, dtype=np.uint64)
    np.cumsum(lengths, out=seq_starts[1:])
    ids = np.concatenate(arrays) if arrays else np.zeros(0, np.int64)
    return encode_concatenated(ids, seq_starts[:-1].astype(np.int64)), seq_starts


def decode(encoded: np.ndarray) -> np.ndarray:
    """Token ids ``int32`` of encoded tokens (any shape)."""
    return (np.asarray(encoded, dtype=np.uint32) >> np.uint32(1)).astype(np.int32)


def is_start(encoded: np.ndarray) -> np.ndarray:
    """``bool`` mask of the tokens that start a sequence (any shape)."""
    return (np.asarray(encoded, dtype=np.uint32) & np.uint32(1)).astype(bool)


def split_sequences(encoded: np.ndarray, seq_starts: np.ndarray) -> list[np.ndarray]:
    """Decodes a whole split held in memory into its sequences (``int32`` each)."""
    ids = decode(encoded)
    bounds = np.asarray(seq_starts, dtype=np.int64)
    return [ids[a:b] for a, b in itertools.pairwise(bounds)]


def check_starts_block(
    starts: np.ndarray, offset: int, previous: int | None, num_tokens: int, where: str
) -> list[Problem]:
    """Checks one block of ``seq_starts``: starts at 0, strictly increasing, in range.

    Args:
        starts: ``[k] uint64`` entries ``offset .. offset + k`` of ``seq_starts``.
        offset: index of ``starts[0]`` in the whole array.
        previous: the entry before this block, or ``None`` for the first block.
        num_tokens: length of ``encoded_tokens``.
        where: e.g. ``"train/seq_starts"``.
    """
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
    problems += [
        Problem(
            where, f"beyond the {num_tokens} tokens of the split", offset + int(i), int(values[i])
        )
        for i in over[: FormatError.max_listed]
    ]
    return problems


def check_tokens_block(
    encoded: np.ndarray, offset: int, starts: np.ndarray, max_token_id: int, where: str
) -> list[Problem]:
    """Checks one block of ``encoded_tokens`` against ``seq_starts`` and ``max_token_id``.

    Args:
        encoded: ``[k] uint32`` tokens ``offset .. offset + k``.
        offset: index of ``encoded[0]`` in the whole array.
        starts: every ``seq_starts`` entry in ``[offset, offset + k)``, ``uint64``.
        max_token_id: the split's attribute.
        where: e.g. ``"train/encoded_tokens"``.
    """
    problems: list[Problem] = []
    flagged = np.flatnonzero(np.asarray(encoded) & np.uint32(1))
    expected = np.asarray(starts, dtype=np.int64) - offset
    if flagged.size != expected.size or not np.array_equal(flagged, expected):
        missing = np.setdiff1d(expected, flagged)
        extra = np.setdiff1d(flagged, expected)
        problems += [
            Problem(
                where,
                "seq_starts marks a sequence start here but the start bit is clear",
                offset + int(i),
                int(encoded[i]),
            )
            for i in missing[: FormatError.max_listed]
        ]
        problems += [
            Problem(
                where,
                "start bit set where seq_starts has no sequence start",
                offset + int(i),
                int(encoded[i]),
            )
            for i in extra[: FormatError.max_listed]
        ]
    if encoded.size:
        over = np.flatnonzero((np.asarray(encoded) >> np.uint32(1)) > np.uint32(max_token_id))
        problems += [
            Problem(
                where,
                f"token id above max_token_id {max_token_id}",
                offset + int(i),
                int(encoded[i]) >> 1,
            )
            for i in over[: FormatError.max_listed]
        ]
    return problems
