"""A loader's state: :class:`SavedState`, with its one JSON form (``to_json``,
what :meth:`~flat_tokens_jax.Loader.state` returns), its one reader (``read``)
and its one comparison with a loader (``differences``).

The JSON form::

    {"step": int >= 0,               the step a restore resumes at
     "samples": int >= 0,            global samples of the steps before it
     "fingerprint": {"data": {...},  the data's identity (compared: see resume)
                     "config": {...},  the batch-defining LoaderConfig fields
                     "batch_size": int | [[start_step, size], ...]},
     "sources": [{"name", "url", "split", "sequences": [first, stop]}, ...]}

(a source of custom records is ``{"name", "repr"}``; a Mixture's ``data`` holds
``components``, ``weights``, ``steps``, ``periods`` and ``seed``), and
:meth:`~flat_tokens_jax.PhasedLoader.state` of several phases ``{"step",
"samples", "phases": [{"start_step", "fingerprint", "sources"}, ...]}``.
A run its trainer steered also holds, in either shape, ``"weights"`` and
``"skips"`` (docs/guide/steering.md, "What the state holds").

A state carries no version of its own: one this version cannot read is refused
by what is wrong with it, each field named by its path (see
:mod:`~flat_tokens_jax.loader.statefields`).
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from flat_tokens_jax.core import fields
from flat_tokens_jax.loader import resume
from flat_tokens_jax.loader.statefields import checked
from flat_tokens_jax.sampling.mixture import Period, period_counts
from flat_tokens_jax.sampling.schedule import BatchSchedule
from flat_tokens_jax.sampling.skips import Skips
from flat_tokens_jax.sampling.steering import Steering, Stretch


class StateMismatch(ValueError):
    """A saved loader state does not belong to this loader's data or config,
    or is not a loader state this version reads; the message names each field.

    Attributes:
        lines: one per field (empty when the message is one sentence).
    """

    lines: tuple[str, ...] = ()

    @classmethod
    def of(cls, header: str, lines: Sequence[str]) -> StateMismatch:
        error = cls(f"{header}:\n  " + "\n  ".join(lines))
        error.lines = tuple(lines)
        return error


@dataclasses.dataclass(frozen=True)
class SavedPhase:
    """One phase of a saved run (the whole run, for a ``Loader``'s state);
    of a mixture, the blend a :class:`~flat_tokens_jax.sampling.steering.Steering`
    reads (``names``, ``steps``, ``periods``). ``fingerprint`` and ``sources`` as saved.
    """

    start_step: int
    fingerprint: Mapping[str, Any]
    sources: tuple[Mapping[str, Any], ...]

    @property
    def config(self) -> dict[str, Any]:
        """The ``LoaderConfig`` fields the phase saved, its ``batch_size`` included."""
        return {**self.fingerprint["config"], "batch_size": self.fingerprint["batch_size"]}

    @property
    def names(self) -> tuple[str, ...]:
        """``[K]`` the components' names."""
        return tuple(str(s["name"]) for s in self.sources)

    @functools.cached_property
    def steps(self) -> np.ndarray:
        """``[P] int64`` the data step each declared weight entry starts at."""
        return np.array(self.fingerprint["data"]["steps"], np.int64)

    @functools.cached_property
    def periods(self) -> tuple[Period, ...]:
        """``[P]`` each declared weight entry's layout."""
        data = self.fingerprint["data"]
        pairs = zip(data["weights"], data["periods"], strict=True)
        return tuple(Period.of_counts(period_counts(w, p)) for w, p in pairs)


@dataclasses.dataclass(frozen=True)
class SavedState:
    """A loader's state (see the module's docstring).

    Attributes:
        phases: the saved phases by start step (one for a ``Loader``'s state).
        phased: saved by a :class:`~flat_tokens_jax.PhasedLoader` of several
            phases (``phases`` in the state).
        data_step: the data step ``step`` reads (for one phase, its data reached).
    """

    step: int
    samples: int
    phases: tuple[SavedPhase, ...]
    phased: bool
    skips: tuple[tuple[int, int], ...] = ()
    weights: tuple[tuple[int, tuple[int, ...]], ...] = ()
    data_step: int = -1

    def __post_init__(self) -> None:
        if self.data_step < 0:
            object.__setattr__(self, "data_step", Skips(self.skips).data_step(self.step))

    @classmethod
    def read(cls, state: Any, header: str = "not a loader state this version reads") -> SavedState:
        """``state`` (as :meth:`to_json` made it, or its JSON read back) checked
        against the format; ``StateMismatch``: ``header`` and a line per field."""
        found, problems = checked(state)
        if found is None:
            raise StateMismatch.of(header, problems)
        phases = tuple(SavedPhase(*phase) for phase in found.pop("phases"))
        return cls(phases=phases, **found)

    @classmethod
    def of(cls, state: Any, who: str) -> SavedState:
        """What ``restore`` continues from: ``state`` itself, or the mapping
        that ``who.state()`` returned, read."""
        if isinstance(state, SavedState):
            return state
        if not isinstance(state, Mapping):
            raise TypeError(
                f"restore takes the mapping that {who}.state() returned, got {type(state).__name__}"
            )
        return cls.read(state)

    def to_json(self) -> dict[str, Any]:
        phases = [
            {"start_step": p.start_step, "fingerprint": p.fingerprint, "sources": list(p.sources)}
            for p in self.phases
        ]
        out: dict[str, Any] = {"step": self.step, "samples": self.samples}
        if self.phased:
            out["phases"] = phases
        else:
            out.update(fingerprint=phases[0]["fingerprint"], sources=phases[0]["sources"])
        if self.weights:
            out["weights"] = [[t, list(counts)] for t, counts in self.weights]
        if self.skips:
            out["skips"] = [[s, n] for s, n in self.skips]
        return out

    def differences(self, fingerprint: Mapping[str, Any], schedule: BatchSchedule) -> list[str]:
        """What keeps this state from resuming in a ``Loader`` of ``fingerprint``
        and ``schedule``: ``path: saved X, now Y`` lines (none: it resumes)."""
        if self.phased:
            return [f"phases: {self._several()}"]
        return resume.differences(
            self.phases[0].fingerprint,
            fingerprint,
            schedule,
            step=self.step,
            samples=self.samples,
            data_step=self.data_step,
        )

    def check(
        self,
        fingerprint: Mapping[str, Any],
        schedule: BatchSchedule,
        header: str = "the saved loader state is for different data or config",
    ) -> None:
        """Raises ``StateMismatch`` (``header`` and each of :meth:`differences`)
        unless a ``Loader`` of ``fingerprint`` and ``schedule`` resumes this state."""
        if self.phased:
            raise StateMismatch(
                f"Loader.restore takes one Loader's state; this is {self._several()}"
            )
        found = self.differences(fingerprint, schedule)
        if found:
            raise StateMismatch.of(header, found)

    def _several(self) -> str:
        return (
            f"a PhasedLoader's state (a run in {len(self.phases)} phases): build the saved "
            "run's phases and restore it with ftj.PhasedLoader(phases).restore(state)"
        )

    def phase(self, j: int) -> SavedState:
        """Phase ``j`` as a ``Loader``'s state of its own, by its own steps (0 for
        a phase not begun), with its skips and weight changes."""
        if not self.phased:
            return self
        skips, here = Skips(self.skips), self.phases[j]
        first = skips.trainer_step(here.start_step)
        stop = data_stop = None
        if j + 1 < len(self.phases):
            data_stop = self.phases[j + 1].start_step
            stop = skips.trainer_step(data_stop)
        local = max(0, (self.step if stop is None else min(stop, self.step)) - first)
        reached = self.data_step if data_stop is None else min(data_stop, self.data_step)
        data = max(0, reached - here.start_step)
        samples = BatchSchedule.of(here.fingerprint["batch_size"]).samples_before(data)
        alone = dataclasses.replace(here, start_step=0)
        weights = tuple(
            (t - first, counts)
            for t, counts in self.weights
            if first <= t and (stop is None or t < stop)
        )
        own = skips.within(first, stop, here.start_step).entries
        return SavedState(local, samples, (alone,), False, own, weights, data)

    @functools.cached_property
    def firsts(self) -> tuple[int, ...]:
        skips = Skips(self.skips)
        return tuple(skips.trainer_step(p.start_step) for p in self.phases)

    @functools.cached_property
    def steerings(self) -> tuple[Steering, ...]:
        """``[P]`` each phase's skips and weight changes as its ``Steering``, by its own steps."""
        out = []
        for k, phase in enumerate(self.phases):
            own = self.phase(k)
            blend = phase if "components" in phase.fingerprint["data"] else None
            schedule = BatchSchedule.of(phase.fingerprint["batch_size"])
            out.append(Steering(blend, schedule, Skips(own.skips), own.weights))
        return tuple(out)

    def steering_at(self, step: int) -> StepSteering:
        """The data step that trainer step ``step`` reads and the weights in effect there."""
        step = fields.step(step, "step")
        k = bisect.bisect_right(self.firsts, step) - 1
        first, steering = self.firsts[k], self.steerings[k]
        found = steering.stretch_at(step - first)
        data = self.phases[k].start_step + steering.data_step(step - first)
        skipped = tuple((s, n) for s, n in self.skips if s <= step)
        names = self.phases[k].names
        return StepSteering(
            step, data, skipped, k, names, found.counts, first + found.first, found.changed
        )

    def stretches(self, stop: int) -> list[tuple[int, Stretch]]:
        """``(phase, stretch)`` of each weight segment trainer steps ``[0, stop)`` read."""
        out = []
        for k, steering in enumerate(self.steerings):
            first = self.firsts[k]
            end = min(stop, self.firsts[k + 1]) if k + 1 < len(self.firsts) else stop
            for found in steering.stretches(end - first):
                assert found.stop is not None  # stretches() cuts the last one
                moved = dataclasses.replace(
                    found, first=first + found.first, stop=first + found.stop
                )
                out.append((k, moved))
        return out


@dataclasses.dataclass(frozen=True)
class StepSteering:
    """What a steered run's step reads: see :meth:`SavedState.steering_at`.

    Attributes:
        data_step: the step of the run without skips whose data it reads.
        skipped: ``((step, count), ...)`` the skips at steps ``<= step``.
        phase: the index of the phase whose data it reads; ``names``: its components.
        counts: ``[K]`` samples of each component per period in effect (``None``:
            a single source), ``since`` that trainer step, ``changed`` by the trainer.
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
        return sample_shares(self.names, self.counts)


def sample_shares(names: Sequence[str], counts: Sequence[int] | None) -> dict[str, float] | None:
    """``{name: share of the samples}`` of samples per period (``None``: a single source)."""
    if counts is None:
        return None
    period = sum(counts)
    return {n: c / period for n, c in zip(names, counts, strict=True)}
