"""A run in phases: ``PhasedLoader``, one :class:`~flat_tokens_jax.Loader` per phase.

Step ``s`` of the run is step ``s - start_step`` of the phase that holds it
(see :mod:`~flat_tokens_jax.loader.phases`); each phase's loader reads its
components through samplers that continue every stream where the earlier
phases left it. With one phase, ``PhasedLoader`` is that phase's ``Loader``:
the same batches and the same ``state()``.

A run of several phases saves ``{"step", "samples", "phases": [{"start_step",
"fingerprint", "sources"}, ...]}``. A saved state (of either shape) restores
into phases that agree with it on every step before the saved one: the same
starts for the phases begun before it, each of them with the fingerprint it
had (its batch size may change from the saved step on, as a ``Loader``'s).
Phases may be added or changed from the saved step on.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import os
import re
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from typing import Any, cast

import jax
import numpy as np

from flat_tokens_jax.decoding.sharding import HostPlan
from flat_tokens_jax.loader.loader import Loader
from flat_tokens_jax.loader.phases import Phase, check_phases, drawn, stream_key
from flat_tokens_jax.loader.resume import UNRECORDED, StateMismatch, compare_state, state_step

log = logging.getLogger(__name__)

NEXT_PHASE_AHEAD = 8
"""Steps before a phase's end at which :meth:`PhasedLoader.iterate` starts
reading the next phase's first steps."""


class PhasedLoader:
    """Batches of a run in phases, from any step.

    Args:
        phases: the run's :class:`~flat_tokens_jax.loader.phases.Phase` list, by start step.
        sharding: as :class:`~flat_tokens_jax.Loader`'s, for every phase.
        plan_cache: as :class:`~flat_tokens_jax.Loader`'s.

    Attributes:
        phases: the phases, checked.
        starts: ``[K]`` each phase's first step.
        loaders: ``[K]`` each phase's :class:`~flat_tokens_jax.Loader` (its steps
            count from the phase's start).
        streams: per phase, each component's stream key (see
            :func:`~flat_tokens_jax.loader.phases.stream_key`).
        offsets: per phase, each component's stream samples drawn by the
            earlier phases: where the phase continues its streams.
        next_step: the step :meth:`iterate` starts at (set by :meth:`restore`).

    Raises:
        ValueError: the phases are out of order, bound their epochs, or one
            phase blends one stream twice; or a phase's ``Loader`` refuses its
            source or config (the message names the phase).
    """

    def __init__(
        self,
        phases: Sequence[Phase],
        sharding: jax.sharding.Sharding | None = None,
        *,
        plan_cache: str | os.PathLike[str] | None = None,
    ) -> None:
        self.phases = check_phases(phases)
        self.starts = [p.start_step for p in self.phases]
        self.loaders: list[Loader] = []
        for k, phase in enumerate(self.phases):
            try:
                self.loaders.append(
                    Loader(phase.source, phase.config, sharding, plan_cache=plan_cache)
                )
            except ValueError as e:
                raise ValueError(f"{self.label(k)}: {e}") from None
        # Samples of the run before each phase, and each stream's drawn before it.
        self._before = [0]
        self.streams: list[list[str]] = []
        self.offsets: list[list[int]] = []
        seeds: dict[str, int] = {}
        counts: dict[str, int] = {}
        for k, loader in enumerate(self.loaders):
            keys = self._keys(k)
            self.streams.append(keys)
            self.offsets.append([counts.get(key, 0) for key in keys])
            for key, sampler in zip(keys, loader.samplers, strict=True):
                seeds.setdefault(key, sampler.seed)
            if len(self.phases) > 1:
                loader.use_samplers(
                    [
                        dataclasses.replace(s, seed=seeds[key], offset=counts.get(key, 0))
                        for key, s in zip(keys, loader.samplers, strict=True)
                    ]
                )
            if k + 1 < len(self.phases):
                steps = self.starts[k + 1] - self.starts[k]
                for key, n in zip(keys, drawn(loader.mixture, loader.schedule, steps), strict=True):
                    counts[key] = counts.get(key, 0) + n
                self._before.append(self._before[-1] + loader.schedule.samples_before(steps))
        self.sharding = sharding
        self.next_step = 0

    def _keys(self, k: int) -> list[str]:
        loader = self.loaders[k]
        data = loader.fingerprint()["data"]
        parts = data["components"] if loader.mixture is not None else [data]
        keys = [stream_key(d, loader.config) for d in parts]
        if len(self.phases) > 1 and len(set(keys)) < len(keys):
            twice = [n for n, key in zip(loader.names, keys, strict=True) if keys.count(key) > 1]
            raise ValueError(
                f"{self.label(k)}: components {twice} are one stream (the same records, "
                "seed and shuffle): list it once, with their weights summed"
            )
        return keys

    def label(self, k: int) -> str:
        """How messages name phase ``k``: ``phase 1 'anneal' (from step 900)``."""
        name = self.phases[k].name
        return f"phase {k}{'' if name is None else f' {name!r}'} (from step {self.starts[k]})"

    def __repr__(self) -> str:
        return f"PhasedLoader({len(self.phases)} phases from steps {self.starts})"

    def phase_at(self, step: int) -> int:
        """The index of the phase that holds ``step``."""
        if isinstance(step, bool) or not isinstance(step, int | np.integer) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        return bisect.bisect_right(self.starts, int(step)) - 1

    def locate(self, step: int) -> tuple[Loader, int]:
        """The loader of the phase that holds ``step``, and the step inside that phase."""
        k = self.phase_at(step)
        return self.loaders[k], int(step) - self.starts[k]

    @property
    def num_batches(self) -> int | None:
        """Steps in the run: one phase's ``num_batches``, else ``None`` (unbounded)."""
        return self.loaders[0].num_batches if len(self.loaders) == 1 else None

    def samples_before(self, step: int) -> int:
        """Global samples of the run in the steps before ``step``."""
        k = self.phase_at(step)
        return self._before[k] + self.loaders[k].samples_before(step - self.starts[k])

    def batch_size_at(self, step: int) -> int:
        """Global rows of the batch at ``step``."""
        loader, local = self.locate(step)
        return loader.schedule.size(local)

    def plan_at(self, step: int) -> HostPlan | None:
        """The blocks this host reads at ``step`` (``None`` without a sharding)."""
        loader, local = self.locate(step)
        return loader.plan_at(local)

    def host_rows_at(self, step: int) -> np.ndarray:
        """``[k] int64`` the global rows this host reads at ``step``, ascending."""
        loader, local = self.locate(step)
        return loader.host_rows_at(local)

    def batch(self, step: int) -> dict[str, jax.Array]:
        """The global batch at ``step``, ``[batch_size, seq_len]`` of its phase."""
        loader, local = self.locate(step)
        return loader.batch(local)

    def host_batch(self, step: int) -> dict[str, np.ndarray]:
        """This host's rows of the batch at ``step`` (numpy), in global row order."""
        loader, local = self.locate(step)
        return loader.host_batch(local)

    def encoded_batch(self, step: int) -> dict[str, jax.Array]:
        """:meth:`Loader.encoded_batch` of the phase that holds ``step``."""
        loader, local = self.locate(step)
        return loader.encoded_batch(local)

    def decoder(self, step: int = 0) -> Callable[[Mapping[str, jax.Array]], dict[str, jax.Array]]:
        """:meth:`Loader.decoder` of the phase that holds ``step``."""
        loader, local = self.locate(step)
        return loader.decoder(local)

    def provenance(self, step: int) -> list[dict[str, Any]]:
        """:meth:`Loader.provenance` of ``step``; with several phases each
        row also says its ``phase``, and ``sample`` counts over the run."""
        k = self.phase_at(step)
        rows = self.loaders[k].provenance(step - self.starts[k])
        if len(self.phases) == 1:
            return rows
        for row in rows:
            row["phase"] = k
            if "sample" in row:
                row["sample"] += self._before[k]
        return rows

    def iterate(self, start_step: int | None = None) -> Iterator[tuple[int, dict[str, jax.Array]]]:
        """Yields ``(step, batch)`` from ``start_step`` (default: the restored
        step), each phase read ahead by its loader's ``iterate``."""
        step = self.next_step if start_step is None else start_step
        k = self.phase_at(step)
        while k < len(self.loaders):
            end = self.starts[k + 1] if k + 1 < len(self.starts) else None
            stop = None if end is None else end - self.starts[k]
            # Reads nothing ahead past the boundary; the next phase's first
            # steps are started a few steps before it.
            batches = self.loaders[k].iterate(step - self.starts[k], stop)
            stream = cast(Generator[tuple[int, dict[str, jax.Array]], None, None], batches)
            started = False
            try:
                for local, batch in stream:
                    step = self.starts[k] + local
                    self.next_step = step + 1
                    if end is not None and not started and step >= end - NEXT_PHASE_AHEAD:
                        self.loaders[k + 1].start(0)
                        started = True
                    yield step, batch
            finally:
                stream.close()
            if end is None:
                return
            step, k = end, k + 1

    def start(self, step: int | None = None) -> None:
        """Starts reading ``step`` (default: :attr:`next_step`) and the steps
        after it in its phase (see :meth:`Loader.start`)."""
        loader, local = self.locate(self.next_step if step is None else step)
        loader.start(local)

    def stats(self) -> dict[str, float | int]:
        """:meth:`Loader.stats` of the phase of the last step handed out, and
        ``phase``, its index."""
        k = self.phase_at(max(0, self.next_step - 1))
        return {**self.loaders[k].stats(), "phase": k}

    @property
    def wait_seconds(self) -> float:
        """How long the last step of the current phase waited for its batch."""
        loader, _ = self.locate(max(0, self.next_step - 1))
        return loader.wait_seconds

    def fingerprint(self) -> list[dict[str, Any]]:
        """Each phase's ``{"start_step", "fingerprint"}`` (see :meth:`Loader.fingerprint`)."""
        return [
            {"start_step": s, "fingerprint": loader.fingerprint()}
            for s, loader in zip(self.starts, self.loaders, strict=True)
        ]

    def state(self, step: int | None = None) -> dict[str, Any]:
        """JSON-ready: with one phase, :meth:`Loader.state`; else ``{"step",
        "samples", "phases": [{"start_step", "fingerprint", "sources"}, ...]}``.
        ``step`` (default :attr:`next_step`) is where a restore resumes."""
        step = state_step(step, self.next_step)
        if len(self.loaders) == 1:
            self.loaders[0].next_step = self.next_step
            return self.loaders[0].state(step)
        return {
            "step": step,
            "samples": self.samples_before(step),
            "phases": [
                {**p, "sources": loader.sources()}
                for p, loader in zip(self.fingerprint(), self.loaders, strict=True)
            ],
        }

    def state_differences(self, state: Mapping[str, Any]) -> list[str]:
        """What keeps this run from continuing a saved :meth:`state`, as lines
        naming phase, steps and field (none: it may)."""
        return self._compare(state)[0]

    def restore(self, state: Mapping[str, Any]) -> int:
        """Continues from a saved :meth:`state` (or a :meth:`Loader.state`);
        returns the step :meth:`iterate` resumes at.

        Raises:
            StateMismatch: a phase begun before the saved step starts elsewhere
                or differs in a field that decides its batches there; each
                line names the phase, the steps seen and the field.
        """
        if not isinstance(state, Mapping):
            raise TypeError(
                f"restore takes the mapping that state() returned, got {type(state).__name__}"
            )
        if len(self.loaders) == 1 and "phases" not in state:
            self.next_step = self.loaders[0].restore(state)
            return self.next_step
        differences, step, unrecorded = self._compare(state)
        if differences or step is None:
            raise StateMismatch(
                "the saved loader state does not continue into these phases:\n  "
                + "\n  ".join(differences)
            )
        if unrecorded:
            log.warning(
                "the saved loader state lacks %s (saved by an older version); it resumes "
                "without comparing them: %s",
                ", ".join(unrecorded),
                "; ".join(sorted({UNRECORDED.get(_pattern(p), "") for p in unrecorded})),
            )
        self.next_step = step
        return step

    def _compare(self, state: Any) -> tuple[list[str], int | None, list[str]]:
        """``(differences, saved step, unrecorded paths)`` of ``state`` against these phases."""
        if not isinstance(state, Mapping):
            return [f"state: expected a mapping, got {type(state).__name__}"], None, []
        step = state.get("step")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            return [f"step: expected an int >= 0, got {step!r}"], None, []
        saved = _saved_phases(state)
        if isinstance(saved, str):
            return [saved], None, []
        out: list[str] = []
        unrecorded: list[str] = []
        seen = [(s, fp, samples) for s, fp, samples in saved if s < step] or saved[:1]
        now = [s for s in self.starts if s < step] or [0]
        if [s for s, _, _ in seen] != now:
            out.append(
                f"phases: the saved run's phases before step {step} start at steps "
                f"{[s for s, _, _ in seen]}, these at {now}; phases may be added or "
                f"changed only from the saved step {step} on"
            )
            return out, step, unrecorded
        for j, (start, fp, samples) in enumerate(seen):
            end = saved[j + 1][0] if j + 1 < len(saved) and saved[j + 1][0] < step else step
            sub = {"step": end - start, "fingerprint": fp}
            if samples is not None:
                sub["samples"] = samples
            loader = self.loaders[j]
            found = compare_state(sub, loader.fingerprint(), loader.schedule)
            where = f"{self.label(j)}, steps {start}..{end - 1} seen before the saved step {step}"
            out += [f"{where}: {line}" for line in found.differences if line]
            unrecorded += found.unrecorded
        return out, step, [u for u in unrecorded if u != "samples"]


def _saved_phases(state: Mapping[str, Any]) -> list[tuple[int, Any, int | None]] | str:
    """``(start_step, fingerprint, samples)`` of each saved phase (``samples``:
    the state's count, kept for a single-phase state), or a line saying why not."""
    if "phases" not in state:
        samples = state.get("samples")
        return [(0, state.get("fingerprint"), samples if isinstance(samples, int) else None)]
    phases = state["phases"]
    if not isinstance(phases, list) or not phases:
        return f"phases: expected a non-empty list, got {phases!r:.80}"
    out: list[tuple[int, Any, int | None]] = []
    for j, p in enumerate(phases):
        start = p.get("start_step") if isinstance(p, Mapping) else None
        if isinstance(start, bool) or not isinstance(start, int) or start < 0:
            return f"phases[{j}].start_step: expected an int >= 0, got {start!r}"
        if out and start <= out[-1][0]:
            return f"phases[{j}].start_step: {start} is not after the previous phase's"
        out.append((start, p.get("fingerprint"), None))
    return out


def _pattern(path: str) -> str:
    return re.sub(r"\[\d+\]", "[]", path)
