"""Cutting a split into contiguous parts by fractions, as Megatron does ("949,50,1")."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from flat_tokens_jax.core.values import number

_FORM = "write non-negative numbers with a positive sum, such as '949,50,1'"


def split_boundaries(fractions: str | Sequence[float], n: int) -> list[int]:
    """Boundaries ``[0, ..., n]`` of a Megatron-style split of ``n`` items.

    ``fractions`` are weights: a string of numbers separated by ``,`` or ``/``,
    or a sequence of numbers. Sizes follow Megatron's rule (also Nanoset's):
    weights are normalised, each boundary is the previous one plus
    ``round(weight * n)``, and every boundary after the first is shifted so the
    last equals ``n``.

    Example:
        >>> split_boundaries("949,50,1", 1000)
        [0, 949, 999, 1000]

    Raises:
        ValueError: naming ``fractions``, the weight at fault and the form to
            write: no number, negative, infinite or NaN, or no positive sum.
    """
    where = f"split fractions {fractions!r}"
    if isinstance(fractions, str):
        pieces: list[Any] = [p for p in fractions.replace("/", ",").split(",") if p.strip()]
    else:
        try:
            pieces = list(fractions)
        except TypeError:
            raise ValueError(f"{where}: expected a string or a list of numbers; {_FORM}") from None
    weights = []
    for i, piece in enumerate(pieces):
        try:
            weights.append(number(float(piece) if isinstance(piece, str) else piece, "", low=0))
        except ValueError:
            raise ValueError(
                f"{where}: weight {i} ({piece!r}) is not a finite non-negative number; {_FORM}"
            ) from None
    total = sum(weights)  # Megatron's sum, so that rounding matches it
    if not weights or not 0 < total < math.inf:
        raise ValueError(f"{where}: the weights sum to {total:g}; {_FORM}")
    bounds = [0]
    for w in weights:
        bounds.append(bounds[-1] + round(w / total * float(n)))
    excess = bounds[-1] - n
    return [bounds[0], *(b - excess for b in bounds[1:])]
