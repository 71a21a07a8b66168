"""Each field of a saved loader state checked (:func:`checked`, what ``SavedState.read``
runs): a field missing, of another type or out of bounds, or one the format does not hold,
is a line naming its path (``phases[1].sources[0].split``); config fields as YAML's."""

from __future__ import annotations

import bisect
import functools
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from flat_tokens_jax.core import fields
from flat_tokens_jax.core.values import BadValue, child, integer, is_integer, number
from flat_tokens_jax.loader.config import BATCH_DEFINING, FIELDS
from flat_tokens_jax.sampling.mixture import MAX_PERIOD
from flat_tokens_jax.sampling.skips import Skips

_STEERED = ("weights", "skips")  # optional: absent, the trainer changed nothing
_STATE = ("step", "samples", "fingerprint", "sources", *_STEERED)
_PHASED = ("step", "samples", "phases", *_STEERED)
_PHASE = ("start_step", "fingerprint", "sources")
_FINGERPRINT = ("data", "config", "batch_size")
_BLEND = ("components", "weights", "steps", "periods", "seed")  # a Mixture's data
_SAVED_CONFIG = tuple(name for name in BATCH_DEFINING if name != "batch_size")
SKIP_COUNT = functools.partial(integer, low=1, high=fields.MAX_STEP)
"""The check of the batches a skip passes over: an int in ``[1, 2**63 - 1]``."""
_COUNT = functools.partial(integer, low=0, high=MAX_PERIOD)  # a component's samples per period
# Fields a saved config holds only when on: absent, they are off.
_WHEN_ON = (
    "instance_filter",
    "shuffle_block",
    "shuffle_window",
    "balance_groups",
    "context_parallel",
)
_URL_SOURCE = {
    "name": "the component's name (a string)",
    "url": "the dataset URL (a string)",
    "split": "the split's name (a string)",
    "sequences": "[first, stop], two ints with 0 <= first <= stop",
}
_CUSTOM_SOURCE = {
    "name": "the component's name (a string)",
    "repr": "a 'url' (a string) or the custom records' 'repr'",
}


# A phase as checked: (start_step, fingerprint, sources), as saved.
Phase = tuple[int, Mapping[str, Any], tuple[Mapping[str, Any], ...]]


def checked(state: Any) -> tuple[dict[str, Any] | None, list[str]]:
    """``state``'s fields as a ``SavedState``'s (``phases`` as :data:`Phase`
    triples), or ``None`` and a line per bad field. Never raises."""
    out: list[str] = []
    if not isinstance(state, Mapping):
        return None, [f"state: expected the mapping loader.state() saves, got {shown(state)}"]
    phased = "phases" in state
    _known(state, "", _PHASED if phased else _STATE, out)
    step = _field(state, "step", "", fields.step, "the next step (an int >= 0)", out)
    samples = _field(state, "samples", "", fields.step, "the samples before it", out)
    phases = _phases(state["phases"], out) if phased else [_phase(state, "", 0, out)]
    skips = _skips(state["skips"], out) if "skips" in state else ()
    if out:
        return None, out
    found = tuple(p for p in phases if p is not None)
    weights = _weights(state["weights"], found, Skips(skips), out) if "weights" in state else ()
    if out:
        return None, out
    return {
        "step": step,
        "samples": samples,
        "phases": found,
        "phased": phased,
        "skips": skips,
        "weights": weights,
    }, []


def _phases(value: Any, out: list[str]) -> list[Phase | None]:
    if not isinstance(value, list) or not value:
        out.append(f"phases: expected a non-empty list of the saved phases, got {shown(value)}")
        return [None]
    phases: list[Phase | None] = []
    last = None
    for j, entry in enumerate(value):
        path = child("phases", j)
        if not isinstance(entry, Mapping):
            out.append(f"{path}: expected a mapping, got {shown(entry)}")
            phases.append(None)
            continue
        _known(entry, path, _PHASE, out)
        start = _field(entry, "start_step", path, fields.step, "the phase's first step", out)
        if isinstance(start, int) and last is not None and start <= last:
            out.append(f"{path}.start_step: {start} is not after the previous phase's, {last}")
        last = start if isinstance(start, int) else last
        phases.append(_phase(entry, path, start, out))
    return phases


def _phase(values: Mapping[str, Any], path: str, start: Any, out: list[str]) -> Phase | None:
    before = len(out)
    where = child(path, "fingerprint")
    fingerprint = _field(values, "fingerprint", path, _mapping, "a mapping", out)
    data: Any = None
    if isinstance(fingerprint, Mapping):
        _known(fingerprint, where, _FINGERPRINT, out)
        data = _field(fingerprint, "data", where, _mapping, "a mapping, the data's identity", out)
        _config(fingerprint, where, out)
        _field(fingerprint, "batch_size", where, FIELDS["batch_size"], "the batch size", out)
    sources = _field(values, "sources", path, _list, "a non-empty list, one per component", out)
    if isinstance(sources, list):
        for i, source in enumerate(sources):
            _source(source, child(child(path, "sources"), i), out)
    if isinstance(data, Mapping) and isinstance(sources, list):
        if any(key in data for key in _BLEND):
            _blend(data, child(where, "data"), len(sources), child(path, "sources"), out)
        elif len(sources) != 1:
            out.append(
                f"{child(path, 'sources')}: {len(sources)} entries, but {where}.data is a "
                "single split (no components): expected one"
            )
    if len(out) > before or not isinstance(start, int):
        return None
    return start, fingerprint, tuple(sources or ())


def _config(fingerprint: Mapping[str, Any], where: str, out: list[str]) -> None:
    path = child(where, "config")
    config = _field(fingerprint, "config", where, _mapping, "a mapping of config fields", out)
    if not isinstance(config, Mapping):
        return
    _known(config, path, _SAVED_CONFIG, out)
    for name in _SAVED_CONFIG:
        if name in config or name not in _WHEN_ON:
            _field(config, name, path, FIELDS[name], f"LoaderConfig.{name}'s value", out)


def _source(source: Any, path: str, out: list[str]) -> None:
    if not isinstance(source, Mapping):
        out.append(f"{path}: expected a mapping, got {shown(source)}")
        return
    form = _URL_SOURCE if "url" in source else _CUSTOM_SOURCE
    _known(source, path, tuple(form), out)
    for key, expected in form.items():
        check = _range if key == "sequences" else _text
        _field(source, key, path, check, expected, out)


def _blend(data: Mapping[str, Any], path: str, count: int, sources: str, out: list[str]) -> None:
    parts = _field(data, "components", path, _list, "a list, one per component", out)
    if isinstance(parts, list):
        for i, part in enumerate(parts):
            if not isinstance(part, Mapping):
                out.append(f"{child(child(path, 'components'), i)}: expected a mapping")
        if len(parts) != count:
            out.append(
                f"{sources}: {count} entries, but {path}.components has {len(parts)}: "
                "expected one source per component"
            )
    weights = _field(data, "weights", path, _list, "a list of weight lists", out)
    if isinstance(weights, list):
        for i, w in enumerate(weights):
            here = child(child(path, "weights"), i)
            if not isinstance(w, list) or len(w) != count:
                out.append(f"{here}: expected {count} numbers, one per component, got {shown(w)}")
            else:
                for j, x in enumerate(w):
                    _checked(functools.partial(number, low=0), x, child(here, j), out)
    for name, low in (("steps", 0), ("periods", 1)):
        values = _field(data, name, path, _list, "a list of ints, one per weight list", out)
        if not isinstance(values, list):
            continue
        for i, value in enumerate(values):
            _checked(functools.partial(integer, low=low), value, child(child(path, name), i), out)
        if isinstance(weights, list) and len(values) != len(weights):
            out.append(
                f"{path}.{name}: expected {len(weights)} ints >= {low}, one per weight list "
                f"({path}.weights has {len(weights)}), got {shown(values)}"
            )
        elif name == "steps" and values[0] != 0:
            out.append(f"{path}.steps: expected a list starting at step 0, got {shown(values)}")
    _field(data, "seed", path, fields.seed, "the Mixture's seed", out)


def _pairs(value: Any, name: str, form: str, out: list[str]) -> list[tuple[str, Any, Any]]:
    """``(path, step, second)`` of each pair of the list saved as ``name``."""
    if not isinstance(value, list) or not value:
        out.append(f"{name}: expected a non-empty list of {form}, got {shown(value)}")
        return []
    found, last = [], None
    for i, pair in enumerate(value):
        path = child(name, i)
        if not isinstance(pair, list) or len(pair) != 2:
            out.append(f"{path}: expected {form}, got {shown(pair)}")
            continue
        step = _checked(fields.step, pair[0], child(path, 0), out)
        if step is None:
            continue
        if last is not None and step <= last:
            out.append(f"{child(path, 0)}: step {step} is not after the previous entry's, {last}")
        last = step
        found.append((path, step, pair[1]))
    return found


def _skips(value: Any, out: list[str]) -> tuple[tuple[int, int], ...]:
    entries = []
    for path, step, count in _pairs(value, "skips", "[step, count] pairs", out):
        count = _checked(SKIP_COUNT, count, child(path, 1), out)
        if count is not None:
            entries.append((step, count))
    return tuple(entries)


def _weights(
    value: Any, phases: Sequence[Phase], skips: Skips, out: list[str]
) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """The saved ``weights``, one count per component of the step's phase."""
    starts = [start for start, _, _ in phases]
    entries = []
    for path, step, counts in _pairs(value, "weights", "[step, [n, ...]] pairs", out):
        here = child(path, 1)
        start, fingerprint, sources = phases[bisect.bisect_right(starts, skips.data_step(step)) - 1]
        if not any(key in fingerprint["data"] for key in _BLEND):
            where = "" if len(phases) == 1 else f" (phase from step {start})"
            out.append(f"{path}: the data{where} is a single source, which has no weights")
            continue
        n = len(sources)
        if not isinstance(counts, list) or len(counts) != n:
            out.append(f"{here}: expected {n} ints >= 0, one per component, got {shown(counts)}")
            continue
        given = [_checked(_COUNT, x, child(here, c), out) for c, x in enumerate(counts)]
        if any(x is None for x in given):
            continue
        total = sum(given)
        if not 0 < total <= MAX_PERIOD:
            out.append(
                f"{here}: the samples of each component per period, which sum to the period: "
                f"expected a sum in [1, {MAX_PERIOD}], got {total}"
            )
            continue
        entries.append((step, tuple(given)))
    return tuple(entries)


def _checked(check: Callable[[Any, str], Any], value: Any, path: str, out: list[str]) -> Any:
    try:
        return check(value, path)
    except BadValue as e:
        out.append(str(e))
        return None


def _known(values: Mapping[str, Any], path: str, known: Sequence[str], out: list[str]) -> None:
    for key in values:
        if key not in known:
            out.append(
                f"{child(path, key)}: saved {shown(values[key])}, a field this version's "
                "states do not hold (a state of another version?)"
            )


def _field(
    values: Mapping[str, Any],
    key: str,
    path: str,
    check: Callable[[Any, str], Any],
    expected: str,
    out: list[str],
) -> Any:
    """``values[key]`` checked, or ``None`` and a line in ``out``."""
    here = child(path, key)
    if key not in values:
        out.append(f"{here}: missing from the saved state; expected {expected}")
        return None
    value = values[key]
    try:
        return check(value, here)
    except TypeError:  # not the shape saved there
        out.append(f"{here}: expected {expected}, got {shown(value)}")
    except BadValue as e:
        out.append(str(e))
    except ValueError as e:  # a check of several values, e.g. an instance filter's
        out.append(f"{here}: {e}")
    return None


def _shape(ok: Callable[[Any], bool]) -> Callable[[Any, str], Any]:
    """The check of a shape a state holds: the value if ``ok``, else a
    ``TypeError`` (:func:`_field` names what was expected)."""

    def check(value: Any, path: str) -> Any:
        if ok(value):
            return value
        raise TypeError

    return check


_mapping = _shape(lambda v: isinstance(v, Mapping))
_list = _shape(lambda v: isinstance(v, list) and bool(v))  # every list a state holds has an entry
_text = _shape(lambda v: isinstance(v, str))
_range = _shape(
    lambda v: (
        isinstance(v, list)
        and len(v) == 2
        and all(is_integer(x, low=0) for x in v)
        and v[0] <= v[1]
    )
)


def json_type(value: Any) -> str:
    """The JSON type of ``value`` (numpy scalars as their JSON kin)."""
    if value is None or isinstance(value, bool | str):
        return type(value).__name__
    if isinstance(value, numbers.Integral):
        return "int"
    if isinstance(value, numbers.Real):
        return "float"
    if isinstance(value, Mapping):
        return "mapping"
    if isinstance(value, Sequence):
        return "list"
    return type(value).__name__


def shown(value: Any, limit: int = 80, typed: bool = True) -> str:
    """``repr`` cut to ``limit`` characters, with the type unless it says it."""
    text = repr(value)
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    kind = json_type(value)
    if not typed or kind in ("int", "float", "NoneType", "mapping", "list"):
        return text
    return f"{text} (a {kind})"


def state_step(step: object, default: int) -> int:
    """The step a saved state resumes at: ``step``, or ``default`` for ``None``."""
    if step is None:
        return default
    try:
        return int(integer(step, "step", low=0))
    except BadValue as e:
        raise BadValue(
            "state's step",
            f"{e.problem}: the step a restore resumes at (after training step s, pass s + 1)",
        ) from None
