"""A saved :meth:`Loader.state` read back for ``flat-tokens show``: its shape
checked field by field, and the config and data it names.

Every refusal names the field (``sources[0].split``, ``fingerprint.config.seed``)
and what it should hold, as :meth:`Loader.state` saves it.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from typing import Any

from flat_tokens_jax.data.dataset import FlatTokens, open_dataset
from flat_tokens_jax.loader.config import LoaderConfig
from flat_tokens_jax.sampling.mixture import Mixture
from flat_tokens_jax.store.options import StoreOptions


def read_state(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A saved :meth:`Loader.state` from a JSON file, its shape checked (a
    :meth:`PhasedLoader.state`'s phases are checked as they are rebuilt).

    Raises:
        ValueError: the file is not JSON or not a loader state; the message
            names the file and the field (``sources[0].split``).
    """
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
    try:
        if not (isinstance(state, Mapping) and "phases" in state):  # phases: checked each
            check_state(state)
    except ValueError as e:
        raise ValueError(f"--state {where}: {e}") from None
    return state


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


def check_state(state: Any) -> None:
    """Refuses a saved state whose fingerprint or ``sources`` ``show`` cannot
    read, naming the field and what it should hold.

    Raises:
        ValueError: one line, e.g. ``sources[0].split: missing; expected the
            split's name (a string), as loader.state() saves it``.
    """
    if not isinstance(state, Mapping):
        raise ValueError(f"expected the mapping loader.state() saves, got {_kind(state)}")
    _field(state, "step", int, "", "the next step (an int >= 0)")
    for key in ("step", "samples"):
        if key in state and not _is_count(state[key]):
            raise ValueError(f"{key}: expected an int >= 0, got {_kind(state[key])}")
    fingerprint = _field(state, "fingerprint", Mapping, "", "a mapping")
    for key in ("config", "data"):
        _field(fingerprint, key, Mapping, "fingerprint.", "a mapping")
    _check_config(fingerprint)
    sources = state.get("sources")
    if sources is None:
        return
    if not isinstance(sources, list) or not sources:
        raise ValueError(f"sources: expected a non-empty list, got {_kind(sources)}")
    for i, src in enumerate(sources):
        here = f"sources[{i}]."
        if not isinstance(src, Mapping):
            raise ValueError(f"sources[{i}]: expected a mapping, got {_kind(src)}")
        _field(src, "name", str, here, "the component's name (a string)")
        if "url" not in src:
            _field(src, "repr", str, here, "a 'url' (a string) or the custom records' 'repr'")
            continue
        _field(src, "url", str, here, "the dataset URL (a string)")
        _field(src, "split", str, here, "the split's name (a string)")
        seqs = _field(src, "sequences", list, here, "[first, stop], two ints")
        if len(seqs) != 2 or not all(_is_count(n) for n in seqs) or seqs[0] > seqs[1]:
            raise ValueError(
                f"{here}sequences: expected [first, stop], two ints with 0 <= first <= "
                f"stop, got {seqs!r}"
            )
    if "components" in fingerprint["data"]:
        _blend(fingerprint["data"], len(sources))
    elif len(sources) != 1:
        raise ValueError(
            f"sources: {len(sources)} entries, but fingerprint.data is a single split "
            "(no components): expected one"
        )


def _check_config(fingerprint: Mapping[str, Any]) -> None:
    """Each saved config field checked as a ``LoaderConfig`` field, named by its path."""
    extra = {k: fingerprint[k] for k in ("batch_size",) if k in fingerprint}
    where = "fingerprint.batch_size" if extra else "fingerprint.config.batch_size"
    try:
        LoaderConfig.from_dict(
            {"batch_size": 1, "seq_len": 1, **fingerprint["config"], **extra, "prefetch": 0}
        )
    except ValueError as e:
        text = str(e).replace("LoaderConfig.batch_size", where)
        raise ValueError(text.replace("LoaderConfig.", "fingerprint.config.")) from None


def _field(
    values: Mapping[str, Any], key: str, kind: type | Any, prefix: str, expected: str
) -> Any:
    """``values[key]``, refused naming ``prefix + key`` when missing or not a ``kind``."""
    if key not in values:
        raise ValueError(f"{prefix}{key}: missing; expected {expected}, as loader.state() saves it")
    value = values[key]
    if not isinstance(value, kind):
        raise ValueError(f"{prefix}{key}: expected {expected}, got {_kind(value)}")
    return value


def _kind(value: Any) -> str:
    text = repr(value)
    text = text if len(text) <= 60 else text[:57] + "..."
    return f"{text} (a {type(value).__name__})"


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def saved_config(state: Mapping[str, Any]) -> dict[str, Any]:
    """The config fields a saved state holds (checked by :func:`check_state`)."""
    check_state(state)
    fingerprint = state["fingerprint"]
    # An older state keeps its int batch_size inside config.
    extra = {k: fingerprint[k] for k in ("batch_size",) if k in fingerprint}
    return {**fingerprint["config"], **extra}


def saved_source(state: Mapping[str, Any], options: StoreOptions | None) -> FlatTokens | Mixture:
    """The data a saved state's run read, from its ``sources``."""
    check_state(state)
    sources = state.get("sources")
    if sources is None:
        raise ValueError(
            "the --state file does not say where the data is (saved by an older "
            "version): pass the dataset URL or --config"
        )
    data = state["fingerprint"]["data"]
    blend = _blend(data, len(sources)) if "components" in data else None
    opened: dict[str, Any] = {}
    views = []
    for src in sources:
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
    if blend is None:
        return views[0][1]
    weights, steps, periods, seed = blend
    schedule = list(zip(steps[1:], weights[1:], strict=True))
    parts = [(name, ft, w) for (name, ft), w in zip(views, weights[0], strict=True)]
    try:
        mix = Mixture(parts, seed=seed, schedule=schedule)
        if [p.period for p in mix.periods] != periods:
            mix = Mixture(parts, seed=seed, schedule=schedule, period=periods[0])
    except ValueError as e:
        raise ValueError(f"fingerprint.data does not make a Mixture: {e}") from None
    return mix


def _blend(
    data: Mapping[str, Any], count: int
) -> tuple[list[list[float]], list[int], list[int], int]:
    """``(weights, steps, periods, seed)`` of a saved Mixture fingerprint of
    ``count`` components, each checked, named by its path."""
    here = "fingerprint.data."
    components = _field(data, "components", list, here, "a list, one entry per component")
    if len(components) != count:
        raise ValueError(
            f"sources: {count} entries, but fingerprint.data.components has "
            f"{len(components)}: expected one source per component"
        )
    weights = _field(data, "weights", list, here, "a list of weight lists")
    for i, w in enumerate(weights):
        if (
            not isinstance(w, list)
            or len(w) != count
            or not all(isinstance(x, int | float) and not isinstance(x, bool) for x in w)
        ):
            raise ValueError(
                f"{here}weights[{i}]: expected {count} numbers, one per component, got {_kind(w)}"
            )
    steps = _field(data, "steps", list, here, "a list of ints, one per weight list")
    periods = _field(data, "periods", list, here, "a list of ints, one per weight list")
    for name, values in (("steps", steps), ("periods", periods)):
        if len(values) != len(weights) or not all(_is_count(v) for v in values):
            raise ValueError(
                f"{here}{name}: expected {len(weights)} ints >= 0 (one per weight list), "
                f"got {_kind(values)}"
            )
    if not weights or steps[0] != 0:
        raise ValueError(f"{here}steps: expected a list starting at step 0, got {steps!r}")
    seed = _field(data, "seed", int, here, "an int")
    if isinstance(seed, bool) or seed < 0:
        raise ValueError(f"{here}seed: expected an int >= 0, got {_kind(seed)}")
    return weights, steps, periods, seed
