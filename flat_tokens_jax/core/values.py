"""Strict checks of config values, shared by every surface: Python, YAML, saved states, the CLI.

Each check returns the value in its one accepted form, or raises :class:`BadValue`
naming the path (``data.datasets[1].weight``), what was given and what is accepted.
Nothing is coerced: ``'false'`` is not a boolean, ``2.0`` not an int, ``True`` not a number.

Example:
    >>> integer(3, "loader.seed", low=0)
    3
    >>> try:
    ...     boolean("no", "data.allow_mixed_tokenizers")
    ... except BadValue as e:
    ...     print(e.path)
    data.allow_mixed_tokenizers
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np


class BadValue(ValueError):
    """A refused config value: at ``path`` (``data.datasets[1].weight``), the
    ``problem`` (``must be an int >= 0, got 1.9``)."""

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(f"{path} {problem}")
        self.path, self.problem = path, problem

    def moved(self, old: str, new: str) -> BadValue:
        """The same error with the path's leading ``old`` replaced by ``new``
        (``LoaderConfig.seed`` becomes ``loader.seed``); itself if its path is elsewhere."""
        rest = self.path[len(old) :]
        if self.path.startswith(old) and (not rest or rest[0] in ".[ "):
            return BadValue(new + rest, self.problem)
        return self


def child(path: str, key: Any) -> str:
    """The path of ``key`` inside ``path``: ``data.seed``, ``data.datasets[1]``,
    ``data.datasets['gs://b/web']``."""
    if isinstance(key, int) and not isinstance(key, bool):
        return f"{path}[{key}]"
    if isinstance(key, str) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_-]*", key):
        return f"{path}.{key}" if path else key
    return f"{path}[{key!r}]"


def _hint(value: Any) -> str:
    """Why a value of the wrong kind may look right, for the message."""
    if isinstance(value, str):
        word = value.strip()
        if word.lower() in ("true", "false", "yes", "no", "on", "off", "y", "n"):
            return " (a string: write true or false, without quotes)"
        if re.fullmatch(r"[-+]?[0-9]+", word):
            return f" (a string: write {word} without quotes)"
        try:
            parsed = float(word)
        except ValueError:
            return ""
        if not math.isfinite(parsed):
            return ""
        # YAML 1.1 (PyYAML) reads 1e-4 and 1.0e308 as text: a float needs a dot
        # and a signed exponent (1.0e+308, 0.0001).
        mantissa, e, exponent = repr(parsed).partition("e")
        written = mantissa + ("" if "." in mantissa else ".0") + e + exponent
        return f" (a string: YAML reads a number written {written}, without quotes)"
    if isinstance(value, float | np.floating) and math.isfinite(value):
        if float(value).is_integer():
            return f" (write {int(value)}, without the fraction)"
        return " (ints are not rounded: write a whole number)"
    return ""


def boolean(value: Any, path: str) -> bool:
    """``value`` if it is a boolean (``True``/``False``, YAML ``true``/``false``;
    numpy's too)."""
    if isinstance(value, bool | np.bool_):
        return bool(value)
    raise BadValue(path, f"must be True or False, got {value!r}{_hint(value)}")


def _int_form(low: int | None, high: int | None, optional: bool) -> str:
    """What :func:`integer` takes, for its refusals (worked out only then)."""
    if low is not None and high is not None:
        bits = (high + 1).bit_length() - 1
        top = f"2**{bits} - 1" if high > 1024 and high + 1 == 1 << bits else str(high)
        form = f"an int in [{low}, {top}]"
    elif low is not None:
        form = f"an int >= {low}"
    else:
        form = "an int" if high is None else f"an int <= {high}"
    return form + (" or null/None" if optional else "")


def integer(
    value: Any,
    path: str,
    *,
    low: int | None = None,
    high: int | None = None,
    optional: bool = False,
) -> Any:
    """``value`` as a Python int if it is an integer (numpy's too, not a bool)
    within ``[low, high]``; ``None`` passes when ``optional``."""
    if optional and value is None:
        return None
    if isinstance(value, bool | np.bool_) or not isinstance(value, int | np.integer):
        form = _int_form(low, high, optional)
        raise BadValue(path, f"must be {form}, got {value!r}{_hint(value)}")
    value = int(value)
    if (low is not None and value < low) or (high is not None and value > high):
        raise BadValue(path, f"must be {_int_form(low, high, optional)}, got {value!r}")
    return value


def is_integer(value: Any, *, low: int | None = None) -> bool:
    """Whether :func:`integer` takes ``value`` (an int, numpy's too, not a
    bool, ``>= low``), for checks that word their own refusal."""
    try:
        integer(value, "", low=low)
    except BadValue:
        return False
    return True


def number(value: Any, path: str, *, low: float | None = None) -> float:
    """``value`` as a finite float (an int or float, numpy's too, not a bool), ``>= low``."""
    if low is None:
        form = "a finite number"
    else:
        form = "a finite non-negative number" if low == 0 else f"a finite number >= {low:g}"
    if isinstance(value, bool | np.bool_) or not isinstance(value, int | float | np.number):
        raise BadValue(path, f"must be {form}, got {value!r}{_hint(value)}")
    try:
        out = float(value)
    except (OverflowError, TypeError):
        raise BadValue(path, f"must be {form}, got {value!r}") from None
    if not math.isfinite(out) or (low is not None and out < low):
        raise BadValue(path, f"must be {form}, got {value!r}")
    return out


def text(value: Any, path: str) -> str:
    """``value`` if it is a non-empty string."""
    if isinstance(value, str) and value:
        return value
    raise BadValue(path, f"must be a non-empty string, got {value!r}")


def choice(value: Any, path: str, choices: Sequence[str]) -> str:
    """``value`` if it is one of the strings ``choices``."""
    if isinstance(value, str) and value in choices:
        return value
    form = " or ".join(map(repr, choices)) if len(choices) == 2 else f"one of {list(choices)}"
    raise BadValue(path, f"must be {form}, got {value!r}")


def mapping(value: Any, path: str, form: str = "a mapping") -> Mapping[Any, Any]:
    """``value`` if it is a mapping."""
    if isinstance(value, Mapping):
        return value
    raise BadValue(path, f"must be {form}, got {value!r}")


def close_match(key: Any, known: Iterable[str]) -> str:
    """`` (did you mean 'weight'?)`` for a key written ``wieght``; ``""`` when
    no known key is close."""
    close = difflib.get_close_matches(str(key), list(known), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def known_keys(
    value: Mapping[Any, Any], path: str, known: Iterable[str], what: str = "key"
) -> None:
    """Refuses a key of ``value`` that is not in ``known``, named as written,
    with the known key it is closest to (a misspelling: ``wieght``)."""
    known = sorted(known)
    unknown = [key for key in value if key not in known]
    if unknown:
        named = ", ".join(f"{key!r}{close_match(key, known)}" for key in unknown)
        plural = what + ("s" if len(unknown) > 1 else "")
        raise BadValue(path, f"has unknown {plural} {named}; known: {', '.join(known)}")


def sequence(value: Any, path: str, form: str = "a list") -> Sequence[Any]:
    """``value`` if it is a list or tuple (not a string)."""
    if isinstance(value, Sequence) and not isinstance(value, str | bytes):
        return value
    raise BadValue(path, f"must be {form}, got {value!r}")
