"""A saved loader state read from its JSON file (its ints exact), and the data it read."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from flat_tokens_jax.convert.commands import path_error
from flat_tokens_jax.data.dataset import FlatTokens, open_dataset
from flat_tokens_jax.loader.state import SavedState, StateMismatch
from flat_tokens_jax.sampling.mixture import Mixture
from flat_tokens_jax.store.options import StoreOptions


def load_state(path: str | os.PathLike[str]) -> SavedState:
    """A saved loader state from a JSON file, read by :meth:`SavedState.read`."""
    where = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            state = json.load(f, parse_int=_state_int)
    except _LongNumber as e:
        raise ValueError(f"--state {where}: not a loader state: {e}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"--state {where}: not JSON ({e})") from None
    except RecursionError:
        why = "nested too deeply to be a loader state"
        raise ValueError(f"--state {where}: not JSON ({why})") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"--state {where}: not UTF-8 text ({e.reason})") from None
    except OSError as e:
        raise path_error("--state", where, e, "a saved loader state's JSON file") from None
    try:
        return SavedState.read(state)
    except StateMismatch as e:
        why = "; ".join(e.lines)
        raise ValueError(f"--state {where}: not a loader state this version reads: {why}") from None


class _LongNumber(ValueError):
    """A number in a state file with more digits than Python reads."""


def _state_int(digits: str) -> int:
    limit = sys.get_int_max_str_digits()
    if limit and len(digits.lstrip("-")) > limit:
        raise _LongNumber(
            f"it holds a number of {len(digits.lstrip('-')):,} digits; "
            "a saved loader state's numbers fit in 64 bits"
        )
    return int(digits)


def saved_source(state: SavedState, options: StoreOptions | None) -> FlatTokens | Mixture:
    """The data a ``Loader``'s saved state (one phase) read, from its ``sources``."""
    phase = state.phases[0]
    data = phase.fingerprint["data"]
    opened: dict[str, Any] = {}
    views = []
    for src in phase.sources:
        if "url" not in src:
            raise ValueError(
                f"component {src['name']!r} was custom records ({src['repr']}): "
                "pass the data with a URL or --config"
            )
        if src["url"] not in opened:
            opened[src["url"]] = open_dataset(src["url"], options)
        ft = opened[src["url"]][src["split"]]
        first, stop = src["sequences"]
        views.append((src["name"], ft.view(first, stop) if (first, stop) != ft.seq_range else ft))
    if "components" not in data:
        return views[0][1]
    weights, steps, periods = data["weights"], data["steps"], data["periods"]
    schedule = list(zip(steps[1:], weights[1:], strict=True))
    parts = [(name, ft, w) for (name, ft), w in zip(views, weights[0], strict=True)]
    try:
        mix = Mixture(parts, seed=data["seed"], schedule=schedule)
        if [p.period for p in mix.periods] != periods:
            mix = Mixture(parts, seed=data["seed"], schedule=schedule, period=periods[0])
    except ValueError as e:
        raise ValueError(f"fingerprint.data does not make a Mixture: {e}") from None
    return mix
