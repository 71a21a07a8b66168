"""Whether a saved loader state resumes here: its shape checked, its fingerprint
compared field by field with the loader's.

A state (``Loader.state()``) is ``{"step", "samples", "fingerprint",
"sources"}``; ``fingerprint`` is ``{"data", "config", "batch_size"}`` (see
``Loader.fingerprint``). Every field of the loader's fingerprint must be in
the saved one with the same value and the same JSON type, and the saved one
may hold no field the loader's lacks. The exceptions are fields that older
versions did not record: a field in :data:`UNRECORDED` may be missing (the
state resumes and a warning names it), one in :data:`ABSENT` stands for its
default when missing, and one in :data:`MOVED` may be held where an older
version kept it. Pure: no I/O.
"""

from __future__ import annotations

import dataclasses
import logging
import numbers
import re
from collections.abc import Mapping, Sequence
from typing import Any

from flat_tokens_jax.core.values import BadValue, integer
from flat_tokens_jax.sampling.schedule import BatchSchedule, resume_differences

log = logging.getLogger(__name__)

# Fields a state saved by an older version may lack, with why the state still
# resumes. Paths as in the state, list indices as "[]".
_CONTENT = (
    "versions before it identified the data by its counts and a sampled digest, which are "
    "compared; the whole contents are not"
)
UNRECORDED = {
    "samples": "it follows from the saved batch size and step, which are compared",
    "fingerprint.data.tokenizer": (
        "the tokens themselves are compared (counts and sampled digest); the ids are the same"
    ),
    "fingerprint.data.components[].tokenizer": (
        "the tokens themselves are compared (counts and sampled digest); the ids are the same"
    ),
    "fingerprint.data.loss_mask": (
        "versions before it did not record whether a loss mask is stored; the tokens are compared"
    ),
    "fingerprint.data.components[].loss_mask": (
        "versions before it did not record whether a loss mask is stored; the tokens are compared"
    ),
    "fingerprint.data.components[].name": "components are matched by position, as they blend",
    "fingerprint.data.content": _CONTENT,
    "fingerprint.data.components[].content": _CONTENT,
}

# The digests of the data's recorded contents: a saved one that differs now
# (or is gone) means other data, said as such.
CONTENTS = ("fingerprint.data.content", "fingerprint.data.components[].content")

# Fields a fingerprint holds only when they are not the value here (a
# feature that is off): absent on either side, that value is compared, so
# states saved before the feature existed resume with it off, and only so.
ABSENT = {"fingerprint.config.instance_filter": None}

# Fields an older version kept where the loader no longer puts them: not
# compared there (``config.batch_size`` is the saved batch size when the
# fingerprint has no top-level one; ``vocab_size`` changes no batch).
MOVED = ("fingerprint.config.batch_size", "fingerprint.config.vocab_size")


class StateMismatch(ValueError):
    """A saved loader state does not belong to this loader's data or config,
    or is not a loader state at all; the message names each field."""


@dataclasses.dataclass(frozen=True)
class Comparison:
    """A saved state held against a loader.

    Attributes:
        step: the saved step, ``None`` when it is not an int >= 0.
        differences: ``path: saved X, now Y`` lines, one per field that keeps
            the state from resuming (none: it resumes).
        unrecorded: paths of :data:`UNRECORDED` fields the state lacks.
    """

    step: int | None
    differences: list[str]
    unrecorded: list[str]


def compare_state(
    state: Any, fingerprint: Mapping[str, Any], schedule: BatchSchedule
) -> Comparison:
    """Holds a saved ``state`` against a loader's ``fingerprint`` and batch-size
    ``schedule``. Never raises on what the state holds: a field of the wrong
    type is a difference naming its path.

    The batch sizes compare with
    :func:`~flat_tokens_jax.sampling.schedule.resume_differences`: they may change
    from the saved step on.
    """
    if not isinstance(state, Mapping):
        return Comparison(None, [f"state: expected a mapping, got {_show(state)}"], [])
    out: list[str] = []
    unrecorded: list[str] = []
    step: Any = state.get("step")
    if not _is_int(step) or step < 0:
        out.append(f"step: expected an int >= 0, got {_show(step)}")
        step = None
    samples: Any = state.get("samples")
    if "samples" not in state:
        unrecorded.append("samples")
    elif not _is_int(samples) or samples < 0:
        out.append(f"samples: expected an int >= 0, got {_show(samples)}")
        samples = None
    saved = state.get("fingerprint")
    phased = _phased(state)
    if phased is not None:
        return Comparison(step, [*out, f"phases: {phased}"], unrecorded)
    if not isinstance(saved, Mapping):
        out.append(f"fingerprint: expected a mapping, got {_show(saved)}")
        return Comparison(step, out, unrecorded)
    now = {k: v for k, v in fingerprint.items() if k != "batch_size"}
    kind = _kind_difference(saved.get("data"), now.get("data"))
    if kind:
        out.append(kind)
        now = {k: v for k, v in now.items() if k != "data"}
        saved = {k: v for k, v in saved.items() if k != "data"}
    _compare(saved, now, "fingerprint", out, unrecorded, skip={"batch_size"})
    config = saved.get("config")
    old = config.get("batch_size") if isinstance(config, Mapping) else None
    batch_size = saved.get("batch_size", old)
    if batch_size is None:
        out.append(
            "fingerprint.batch_size: missing from the saved state (nor in "
            "fingerprint.config, where versions before schedules kept it)"
        )
    elif step is not None:
        where = "fingerprint." if "batch_size" in saved else "fingerprint.config."
        for line in resume_differences(batch_size, schedule, step, samples):
            out.append(where + line if line.startswith("batch_size") else line)
    return Comparison(step, out, unrecorded)


def check_resume(
    state: Any,
    fingerprint: Mapping[str, Any],
    schedule: BatchSchedule,
    header: str = "the saved loader state is for different data or config",
) -> int:
    """The saved step, when ``state`` resumes here (a warning names the
    fields it lacks that cannot change a batch).

    Raises:
        StateMismatch: ``header`` and one line per difference.
    """
    phased = _phased(state)
    if phased is not None:
        raise StateMismatch(f"Loader.restore takes one Loader's state; this is {phased}")
    found = compare_state(state, fingerprint, schedule)
    if found.differences or found.step is None:
        raise StateMismatch(f"{header}:\n  " + "\n  ".join(found.differences))
    if found.unrecorded:
        log.warning(
            "the saved loader state lacks %s (saved by an older version, before "
            "they were recorded); it resumes without comparing them: %s",
            ", ".join(found.unrecorded),
            "; ".join(f"{p}: {UNRECORDED[_pattern(p)]}" for p in found.unrecorded),
        )
    return found.step


def _phased(state: Mapping[str, Any]) -> str | None:
    """What to do with a :meth:`PhasedLoader.state` of several phases, which
    no single ``Loader`` continues; ``None`` for any other state."""
    phases = state.get("phases")
    if "fingerprint" in state or not isinstance(phases, list):
        return None
    return (
        f"a PhasedLoader's state (a run in {len(phases)} phases): build the "
        "saved run's phases and restore it with ftj.PhasedLoader(phases).restore(state)"
    )


def _kind_difference(saved: Any, now: Any) -> str | None:
    """A line when one side is a Mixture and the other a single source."""
    if not isinstance(saved, Mapping) or not isinstance(now, Mapping):
        return None
    kinds = [
        "mixture" if "components" in d else "split" if "records" in d else None
        for d in (saved, now)
    ]
    if None in kinds or kinds[0] == kinds[1]:
        return None  # the same kind, or fields missing that the comparison names
    return f"fingerprint.data: saved {_describe(saved)}, now {_describe(now)}"


def _describe(data: Mapping[str, Any]) -> str:
    parts = data.get("components")
    if parts is None:
        return f"a single split ({data.get('records', 'custom')} records)"
    if not isinstance(parts, list):
        return f"a Mixture of components {_show(parts)}"
    names = [p.get("name") if isinstance(p, Mapping) else None for p in parts]
    return f"a Mixture of components {names}"


def _compare(
    saved: Any,
    now: Any,
    path: str,
    out: list[str],
    unrecorded: list[str],
    skip: set[str] | None = None,
) -> None:
    """Appends to ``out`` where ``saved`` differs from ``now`` (see the module doc)."""
    if isinstance(now, Mapping):
        if not isinstance(saved, Mapping):
            out.append(f"{path}: saved {_show(saved)}, expected a mapping")
            return
        for key in now:
            here = f"{path}.{key}"
            if key in saved:
                _compare(saved[key], now[key], here, out, unrecorded)
            elif here in ABSENT:
                _compare_absent(ABSENT[here], now[key], here, out)
            elif _pattern(here) in UNRECORDED:
                unrecorded.append(here)
            else:
                out.append(f"{here}: missing from the saved state, now {_show(now[key])}")
        for key in saved:
            here = f"{path}.{key}"
            if key not in now and here in ABSENT:
                _compare_absent(saved[key], ABSENT[here], here, out)
            elif key not in now and key not in (skip or ()) and here not in MOVED:
                out.append(f"{here}: saved {_show(saved[key])}, which this loader does not have")
        return
    if isinstance(now, list | tuple):
        if not isinstance(saved, list | tuple):
            out.append(f"{path}: saved {_show(saved)}, expected a list")
        elif len(saved) != len(now):
            out.append(
                f"{path}: saved {len(saved)} entries {_show(saved)}, now {len(now)} {_show(now)}"
            )
        else:
            for i, (a, b) in enumerate(zip(saved, now, strict=True)):
                _compare(a, b, f"{path}[{i}]", out, unrecorded)
        return
    if isinstance(saved, str) and saved != now and _pattern(path) in CONTENTS:
        out.append(_other_data(path, saved, now))
    elif _type(saved) != _type(now):
        out.append(f"{path}: saved {_show(saved)}, now {_show(now)}")
    elif saved != now:
        out.append(f"{path}: saved {_show(saved, typed=False)}, now {_show(now, typed=False)}")


def _other_data(path: str, saved: str, now: Any) -> str:
    """The line of a content digest (:data:`CONTENTS`) saved as ``saved`` and ``now`` another."""
    found = (
        "none is recorded (an array's attribute chunk_crc32c is gone)"
        if now is None
        else _show(now, typed=False)
    )
    return (
        f"{path}: the data is not what the saved run read: the digest of its recorded "
        f"contents was {_show(saved, typed=False)}, now {found}; point the loader at the "
        "data the run read, or start without the saved state"
    )


def _compare_absent(saved: Any, now: Any, path: str, out: list[str]) -> None:
    """A line when a field of :data:`ABSENT`, present on one side only, differs
    from the value its absence stands for on the other."""
    if _type(saved) != _type(now) or saved != now:
        out.append(f"{path}: saved {_show(saved)}, now {_show(now)}")


def _pattern(path: str) -> str:
    return re.sub(r"\[\d+\]", "[]", path)


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _type(value: Any) -> str:
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


def _show(value: Any, limit: int = 80, typed: bool = True) -> str:
    """``repr`` cut to ``limit`` characters, with the type (``typed``) when
    the ``repr`` does not say it."""
    text = repr(value)
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    kind = _type(value)
    if not typed or kind in ("int", "float", "NoneType", "mapping", "list"):
        return text
    return f"{text} (a {kind})"


def state_step(step: object, default: int) -> int:
    """The step a saved state resumes at: ``step``, or ``default`` when it is ``None``.

    Raises:
        ValueError: ``step`` is not an int >= 0.
    """
    if step is None:
        return default
    try:
        return int(integer(step, "step", low=0))
    except BadValue as e:
        raise BadValue(
            "state's step",
            f"{e.problem}: the step a restore resumes at (after training step s, pass s + 1)",
        ) from None
