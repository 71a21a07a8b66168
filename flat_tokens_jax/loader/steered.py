"""A run its trainer steers: weight changes and skipped batches, checked, saved,
merged on restore, read from YAML, and read back.

``Loader.set_weights(step, weights)`` and ``Loader.skip(step, count)`` (and
``PhasedLoader``'s) record a change by the trainer's step, for any step at or
after the loader's next step (the step its ``state()`` saves by default). The
arithmetic is :mod:`~flat_tokens_jax.sampling.steering`'s: step ``t`` reads
data step ``d(t)``, ``t`` plus the batches skipped at steps ``<= t``; a
weight change from ``t`` starts a weight segment at ``d(t)``.

``state()`` holds the changes as ``"weights": [[step, [n, ...]], ...]`` (the
samples of each component per period that the weights round to: the weights
in effect, exactly) and ``"skips": [[step, count], ...]``, only when there
are any; the fingerprint does not change. A restore continues with the saved
lists (what the run did) and the loader's own (e.g. skips read from a YAML
``skip`` list before the restore): before the saved step they must agree; from
it on they join, and a step in both must have one value (:func:`merged`).
"""

from __future__ import annotations

import bisect
import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from flat_tokens_jax.core import fields
from flat_tokens_jax.core.values import (
    BadValue,
    child,
    integer,
    known_keys,
    mapping,
    sequence,
)
from flat_tokens_jax.core.yamlfile import read_yaml
from flat_tokens_jax.loader.state import SKIP_COUNT, SavedState, StateMismatch, read_state
from flat_tokens_jax.sampling.mixture import Mixture, period_counts
from flat_tokens_jax.sampling.steering import Change, Skips

__all__ = [
    "StepSteering",
    "check_step",
    "merged",
    "skip_count",
    "skips_from_config",
    "skips_from_yaml",
    "state_fields",
    "steering_at",
    "weight_counts",
    "with_weights",
]


def check_step(step: Any, next_step: int, call: str) -> int:
    """``step`` if a change may start there: an int at or after ``next_step``.

    Raises:
        ValueError: naming ``call``, ``step`` and ``next_step``.
    """
    step = fields.step(step, f"{call}: step")
    if step < next_step:
        raise ValueError(
            f"{call}: step {step} is before the loader's next step {next_step} (the step its "
            f"state() saves): the steps before it were handed out; pass a step >= {next_step}"
        )
    return step


def skip_count(count: Any, call: str) -> int:
    """``count``, the batches a skip passes over, checked (an int >= 1)."""
    out: int = SKIP_COUNT(count, f"{call}: count")
    return out


def weight_counts(mixture: Mixture | None, weights: Any, step: int, call: str) -> tuple[int, ...]:
    """``weights`` from ``step`` on as the samples of each component per
    period they round to, checked by the mixture's weight checks.

    Raises:
        ValueError: there is no mixture (one source has no weights), or the
            mixture refuses the weights.
    """
    if mixture is None:
        raise ValueError(
            f"{call}: this loader reads a single source, which has no weights: "
            "set_weights changes the weights of a Mixture's components"
        )
    _, counts = mixture.weight_counts(weights, step)
    return tuple(int(n) for n in counts)


def with_weights(
    changes: Sequence[Change], step: int, counts: tuple[int, ...]
) -> tuple[Change, ...]:
    """``changes`` with ``counts`` from ``step`` on (replacing one at that step)."""
    at = bisect.bisect_left(changes, (step,))
    after = at + 1 if at < len(changes) and changes[at][0] == step else at
    return (*changes[:at], (step, counts), *changes[after:])


def state_fields(skips: Skips, changes: Sequence[Change]) -> dict[str, Any]:
    """The fields a state holds for these changes: none without any."""
    out: dict[str, Any] = {}
    if changes:
        out["weights"] = [[t, list(counts)] for t, counts in changes]
    if skips:
        out["skips"] = [[s, n] for s, n in skips.entries]
    return out


def merged(
    saved: SavedState, skips: Skips, changes: Sequence[Change]
) -> tuple[Skips, tuple[Change, ...]]:
    """The changes a restore of ``saved`` continues with: the saved ones
    (what the run did) and this loader's (``skips``, ``changes``).

    Raises:
        StateMismatch: a loader's change before the saved step that the
            saved run did not make, or a step in both with another value;
            each named with both values.
    """
    out: list[str] = []
    joined_skips = _joined("skips", dict(saved.skips), dict(skips.entries), saved.step, out)
    joined = _joined("weights", dict(saved.weights), dict(changes), saved.step, out)
    if out:
        raise StateMismatch(
            "the saved state's changes and this loader's disagree:\n  " + "\n  ".join(out)
        )
    return Skips(tuple(sorted(joined_skips.items()))), tuple(sorted(joined.items()))


def _joined(
    name: str, saved: dict[int, Any], now: dict[int, Any], step: int, out: list[str]
) -> dict[int, Any]:
    """``saved`` and ``now``'s entries from ``step`` on; a line in ``out``
    for each entry of ``now`` that disagrees."""
    joined = dict(saved)
    what = "count" if name == "skips" else "samples per period"
    for t, value in sorted(now.items()):
        if t in saved and saved[t] != value:
            out.append(
                f"{name} at step {t}: the saved state has {what} {_listed(saved[t])}, this "
                f"loader {_listed(value)}: give one value (the saved state holds what the run did)"
            )
        elif t not in saved and t < step:
            out.append(
                f"{name} at step {t}: this loader has {what} {_listed(value)}, but the run "
                f"saved at step {step} had none there: drop it, or restore a state saved "
                f"before step {t}"
            )
        else:
            joined[t] = value
    return joined


def _listed(value: Any) -> str:
    return str(list(value)) if isinstance(value, tuple) else str(value)


def skips_from_config(value: Any, path: str = "skip") -> list[tuple[int, int]]:
    """The ``(step, count)`` pairs of a YAML ``skip`` list, by step.

    The list holds ``{step, count}`` mappings: from trainer ``step`` on, skip
    ``count`` batches. Apply them with ``loader.skip(step, count)``.

    Raises:
        ValueError: not a list of such mappings, a bad step or count, an
            unknown key, or a step listed twice; named by its path (``skip[1].count``).
    """
    pairs: dict[int, tuple[int, str]] = {}
    for i, entry in enumerate(sequence(value, path, "a list of {step, count}")):
        where = child(path, i)
        entry = mapping(entry, where, "a mapping {step, count}")
        known_keys(entry, where, ("step", "count"))
        for key in ("step", "count"):
            if key not in entry:
                raise BadValue(where, f"must say {key!r}: skip: [{{step: 5, count: 3}}]")
        step = fields.step(entry["step"], child(where, "step"))
        count = integer(entry["count"], child(where, "count"), low=1, high=fields.MAX_STEP)
        if step in pairs:
            raise BadValue(
                child(where, "step"), f"repeats step {step} of {pairs[step][1]}: list a step once"
            )
        pairs[step] = (count, where)
    return [(step, count) for step, (count, _) in sorted(pairs.items())]


def skips_from_yaml(path: str | os.PathLike[str]) -> list[tuple[int, int]]:
    """The top-level ``skip`` list of a run YAML (none without one): see
    :func:`skips_from_config` (needs the ``yaml`` extra)."""
    doc = read_yaml(path)
    if not isinstance(doc, Mapping) or "skip" not in doc:
        return []
    try:
        return skips_from_config(doc["skip"])
    except ValueError as e:
        raise ValueError(f"{os.fspath(path)}: {e}") from None


class Saves(Protocol):
    """What :func:`steering_at` reads a run's changes from: a ``Loader`` or ``PhasedLoader``."""

    def state(self, step: int | None = None) -> dict[str, Any]: ...


@dataclasses.dataclass(frozen=True)
class StepSteering:
    """What a steered run's step reads: see :func:`steering_at`.

    Attributes:
        step: the trainer's step.
        data_step: the step of the run without skips whose data it reads.
        skipped: ``((step, count), ...)`` the skips at steps ``<= step``.
        phase: the index of the phase whose data it reads.
        names: the components of that phase.
        counts: ``[K]`` samples of each component per period in effect
            (``None`` for a single source).
        since: the trainer step from which those weights apply (the first
            step that reads them, for the mixture's declared schedule).
        changed: whether they are a trainer's change (else declared).
    """

    step: int
    data_step: int
    skipped: tuple[tuple[int, int], ...]
    phase: int
    names: tuple[str, ...]
    counts: tuple[int, ...] | None
    since: int
    changed: bool

    @property
    def shares(self) -> dict[str, float] | None:
        """``{name: share of the samples}`` in effect (``None`` for a single source)."""
        if self.counts is None:
            return None
        period = sum(self.counts)
        return {n: c / period for n, c in zip(self.names, self.counts, strict=True)}


def steering_at(run: Mapping[str, Any] | Saves, step: int) -> StepSteering:
    """The data step that ``step`` reads and the weights in effect there, for
    a saved state (as ``state()`` returns it, or its JSON read back) or a
    ``Loader``/``PhasedLoader`` (its ``state()``: its changes so far).

    Raises:
        StateMismatch: the state is not one this version reads.
    """
    step = fields.step(step, "step")
    saved = read_state(run if isinstance(run, Mapping) else run.state())
    skips = Skips(saved.skips)
    data = skips.data_step(step)
    starts = [p.start_step for p in saved.phases]
    k = bisect.bisect_right(starts, data) - 1
    phase = saved.phases[k]
    names = tuple(str(s["name"]) for s in phase.sources)
    skipped = tuple((s, n) for s, n in saved.skips if s <= step)
    blend = phase.fingerprint["data"]
    if "components" not in blend:
        return StepSteering(
            step, data, skipped, k, names, None, skips.trainer_step(starts[k]), False
        )
    local = data - starts[k]
    j = bisect.bisect_right(blend["steps"], local) - 1
    declared = starts[k] + blend["steps"][j]
    counts = tuple(int(n) for n in period_counts(blend["weights"][j], blend["periods"][j]))
    since, changed = skips.trainer_step(declared), False
    for t, found in saved.weights:
        at = skips.data_step(t)
        if t <= step and starts[k] <= at and at >= declared:
            since, counts, changed, declared = t, found, True, at
    return StepSteering(step, data, skipped, k, names, counts, since, changed)
