"""The fields that several surfaces take (``LoaderConfig``, YAML, ``Mixture``,
saved states), each with its one type and bounds, checked with the path the
surface names it by; :class:`~flat_tokens_jax.core.values.BadValue` otherwise.

Example:
    >>> seed(7, "Mixture.seed")
    7
    >>> try:
    ...     seq_len(0, "loader.seq_len")
    ... except ValueError as e:
    ...     print(e)
    loader.seq_len must be an int >= 1, got 0
"""

from __future__ import annotations

import enum
from typing import Any, Literal

from flat_tokens_jax.core.format import MAX_TOKEN_ID
from flat_tokens_jax.core.values import BadValue, boolean, integer

MAX_SEED = 2**64 - 1
"""The largest seed: seeds key a 64-bit mixer."""

MAX_STEP = 2**63 - 1
"""The largest step (or count of samples): steps count int64 samples."""


def seed(value: Any, path: str) -> int:
    """A shuffle key: an int in ``[0, 2**64 - 1]`` (it keys a 64-bit mixer)."""
    return integer(value, path, low=0, high=MAX_SEED)


def seq_len(value: Any, path: str, *, optional: bool = False) -> Any:
    """Tokens per row: an int ``>= 1`` (``None`` passes when ``optional``)."""
    return integer(value, path, low=1, optional=optional)


def token_id(value: Any, path: str, *, optional: bool = False) -> Any:
    """A token id written into the ``int32`` inputs: an int in ``[0, 2**31 - 1]``
    (``None`` passes when ``optional``)."""
    return integer(value, path, low=0, high=MAX_TOKEN_ID, optional=optional)


def pad_id(value: Any, path: str) -> int:
    """The id of padding in the ``int32`` inputs and targets: an int32."""
    return integer(value, path, low=-MAX_TOKEN_ID - 1, high=MAX_TOKEN_ID)


def step(value: Any, path: str) -> int:
    """A step of a run, or a count of its samples: an int in ``[0, 2**63 - 1]``."""
    return integer(value, path, low=0, high=MAX_STEP)


class Packing(enum.Enum):
    """What a row is: ``LoaderConfig.packing`` once read. Each member's value is
    what a user writes for it, and what saved states and fingerprints hold.

    Example:
        >>> packing("bins", "loader.packing") is Packing.BINS
        True
        >>> Packing.WINDOWS.value
        True
    """

    WINDOWS = True
    """Consecutive windows of the concatenated tokens (no padding)."""
    PADDED = False
    """One sequence per row, truncated and right-padded."""
    BINS = "bins"
    """Whole sequences packed into a row by the split's packing plan, padded at the end."""

    def __bool__(self) -> bool:
        # Every member would be true: a test of truth is a comparison forgotten.
        raise TypeError(f"{self} has no truth value: compare it with a Packing member")


def packing(value: Any, path: str) -> Packing:
    """A ``packing`` (``True``, ``False``, ``"bins"`` or a member) as its
    :class:`Packing`; ``1`` and numpy's ``True`` are refused."""
    if isinstance(value, Packing):
        return value
    if isinstance(value, bool):
        return Packing.WINDOWS if value else Packing.PADDED
    if isinstance(value, str) and value == Packing.BINS.value:
        return Packing.BINS
    raise BadValue(
        path,
        "must be True (packed windows), False (padded sequences) or 'bins' "
        f"(bins of whole sequences), got {value!r}",
    )


Shuffle = bool | Literal["blocks"]
"""A ``shuffle``: ``True`` (a full shuffle), ``False`` (in order) or ``"blocks"``
(the block shuffle); booleans stay booleans in fingerprints and saved states."""

BLOCKS: Literal["blocks"] = "blocks"
"""The ``shuffle`` of the block shuffle."""


def shuffle(value: Any, path: str) -> Shuffle:
    """A ``shuffle``: a boolean (numpy's too, as a config's booleans) or ``"blocks"``."""
    if isinstance(value, str) and value == BLOCKS:
        return BLOCKS
    try:
        return boolean(value, path)
    except BadValue as e:
        raise BadValue(path, f"{e.problem}; or 'blocks' for the block shuffle") from None
