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
import os
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, cast

import jax
import numpy as np

from flat_tokens_jax.core.values import integer
from flat_tokens_jax.decoding.sharding import HostBlocks
from flat_tokens_jax.loader.engine import StepEngine
from flat_tokens_jax.loader.loader import Loader
from flat_tokens_jax.loader.phases import (
    Phase,
    check_phases,
    drawn,
    largest,
    steps_within,
    stream_key,
)
from flat_tokens_jax.loader.resume import differences
from flat_tokens_jax.loader.sources import Sources
from flat_tokens_jax.loader.state import (
    SavedState,
    StateMismatch,
    read_state,
    restorable,
    state_problems,
    state_step,
)
from flat_tokens_jax.sampling.stepsamples import MAX_SAMPLE

if TYPE_CHECKING:
    from flat_tokens_jax.loader.tograin import StepsDataset

_T = TypeVar("_T")

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
        source_names: the run's components, numbered by name in the order
            they first appear (phase by phase, each phase's in its order): a
            batch's ``source`` (``config.source_field``) is an index into it,
            the same for a component in every phase.
        next_step: the step :meth:`iterate` starts at (set by :meth:`restore`).
        end_step: the first step the run cannot read: there the last phase's
            samples, or a stream's, would pass the largest sample index
            ``2**63 - 1``. Errors of a step at or past it name it.

    Raises:
        ValueError: the phases are out of order, bound their epochs, or one
            phase blends one stream twice; a phase's ``Loader`` refuses its
            source or config; or a phase cannot read all its steps (a stream
            would pass the largest sample index: the message names the phase
            and the latest start step that works). Each names the phase.
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
        resolved = []
        for k, phase in enumerate(self.phases):
            try:
                resolved.append(Sources.of(phase.source, phase.config, sharding, plan_cache))
            except ValueError as e:
                raise ValueError(f"{self.label(k)}: {e}") from None
        self.source_names = tuple(dict.fromkeys(n for r in resolved for n in r.names))
        self.loaders: list[Loader] = []
        # Samples of the run before each phase, and each stream's drawn before it.
        self._before = [0]
        self.streams: list[list[str]] = []
        self.offsets: list[list[int]] = []
        self._drawn_before: list[dict[str, int]] = []
        seeds: dict[str, int] = {}
        counts: dict[str, int] = {}
        for k, sources in enumerate(resolved):
            try:
                keys = self._keys(sources)
                for key, seed in zip(keys, sources.seeds(), strict=True):
                    seeds.setdefault(key, seed)
                # A stream goes on where the earlier phases left it, under the seed
                # of the phase it first appeared in. One phase reads as a Loader
                # does (its mixture may even blend one stream twice).
                streams = [(seeds[key], counts.get(key, 0)) for key in keys]
                engine = StepEngine(
                    sources,
                    sharding,
                    streams if len(self.phases) > 1 else None,
                    self.source_names,
                )
            except ValueError as e:
                raise ValueError(f"{self.label(k)}: {e}") from None
            loader = Loader._of(engine)
            self.loaders.append(loader)
            self.streams.append(keys)
            self.offsets.append([counts.get(key, 0) for key in keys])
            self._drawn_before.append(dict(counts))
            if k + 1 < len(self.phases):
                steps = self.starts[k + 1] - self.starts[k]
                for key, n in zip(keys, drawn(loader.mixture, loader.schedule, steps), strict=True):
                    counts[key] = counts.get(key, 0) + n
                self._before.append(self._before[-1] + loader.schedule.samples_before(steps))
        self.sharding = sharding
        self.next_step = 0
        self.end_step = self._reach()

    def _keys(self, sources: Sources) -> list[str]:
        data = sources.fingerprint()["data"]
        parts = data["components"] if sources.mixture is not None else [data]
        keys = [stream_key(d, sources.config) for d in parts]
        if len(self.phases) > 1 and len(set(keys)) < len(keys):
            twice = [n for n, key in zip(sources.names, keys, strict=True) if keys.count(key) > 1]
            raise ValueError(
                f"components {twice} are one stream (the same records, "
                "seed and shuffle): list it once, with their weights summed"
            )
        return keys

    def label(self, k: int) -> str:
        """How messages name phase ``k``: ``phase 1 'anneal' (from step 900)``."""
        name = self.phases[k].name
        return f"phase {k}{'' if name is None else f' {name!r}'} (from step {self.starts[k]})"

    def _reach(self) -> int:
        """:attr:`end_step`, after refusing a phase that cannot read all its steps."""
        for k, loader in enumerate(self.loaders):
            last = k + 1 == len(self.loaders)
            most = MAX_SAMPLE + 1 if last else self.starts[k + 1] - self.starts[k]
            n = steps_within(loader.mixture, loader.schedule, self.offsets[k], most)
            if n == 0:
                latest = self._latest_start(k)
                fix = (
                    f"start it at step {latest} at most"
                    if latest is not None
                    else f"no start after phases[{k - 1}]'s works: give it other streams"
                )
                raise ValueError(
                    f"{self.label(k)} cannot read its first step: {self._past(k, 0)}; {fix}"
                )
            if not last and n < most:
                raise ValueError(
                    f"{self.label(k)} cannot read its steps from step {self.starts[k] + n} "
                    f"on: {self._past(k, n)}; phases[{k + 1}] starts at step "
                    f"{self.starts[k + 1]}: start it at step {self.starts[k] + n} at most"
                )
        return self.starts[-1] + n

    def _past(self, k: int, local: int) -> str:
        """Which sample index phase ``k``'s step ``local`` would take past ``2**63 - 1``."""
        loader = self.loaders[k]
        if loader.schedule.samples_before(local + 1) - 1 > MAX_SAMPLE:
            return (
                f"the phase's sample indices would pass 2**63 - 1 (batch_size "
                f"{loader.schedule}, {loader.schedule.samples_before(local):,} samples before)"
            )
        counts = drawn(loader.mixture, loader.schedule, local + 1)
        for c, (before, n) in enumerate(zip(self.offsets[k], counts, strict=True)):
            if before + n - 1 > MAX_SAMPLE:
                stream = "its stream" if loader.mixture is None else f"{loader.names[c]!r}'s stream"
                return (
                    f"{stream} would pass sample index 2**63 - 1 (it continues from "
                    f"{before:,} samples drawn in earlier phases)"
                )
        raise AssertionError("a step within every sample index")

    def _latest_start(self, k: int) -> int | None:
        """The latest start after phase ``k - 1``'s at which phase ``k`` reads
        its first step; ``None`` when there is none."""
        if k == 0:
            return None
        before, earlier = self.loaders[k - 1], self.starts[k - 1]

        def fits(start: int) -> bool:
            counts = dict(self._drawn_before[k - 1])
            taken = drawn(before.mixture, before.schedule, start - earlier)
            for key, n in zip(self.streams[k - 1], taken, strict=True):
                counts[key] = counts.get(key, 0) + n
            offsets = [counts.get(key, 0) for key in self.streams[k]]
            loader = self.loaders[k]
            return steps_within(loader.mixture, loader.schedule, offsets, 1) == 1

        first = earlier + 1
        if first == self.starts[k] or not fits(first):
            return None
        return largest(fits, first, self.starts[k] - 1)

    def __repr__(self) -> str:
        return f"PhasedLoader({len(self.phases)} phases from steps {self.starts})"

    def phase_at(self, step: int) -> int:
        """The index of the phase that holds ``step``."""
        return bisect.bisect_right(self.starts, integer(step, "step", low=0)) - 1

    def locate(self, step: int) -> tuple[Loader, int]:
        """The loader of the phase that holds ``step``, and the step inside that phase.

        Raises:
            ValueError: ``step`` is not an int >= 0, or is at or past
                :attr:`end_step` (the message names the run's last step, its
                phase and the sample index it would pass).
        """
        k = self.phase_at(step)
        if step >= self.end_step:
            raise ValueError(
                f"step {step} is past the last step this run can read, {self.end_step - 1}: "
                f"at step {self.end_step}, in {self.label(k)}, "
                f"{self._past(k, self.end_step - self.starts[k])}"
            )
        return self.loaders[k], int(step) - self.starts[k]

    def _in_phase(self, step: int, use: Callable[[Loader, int], _T]) -> _T:
        """``use(loader, local step)`` for the phase that holds ``step``; with
        several phases, an error it raises names the run's step and the phase."""
        loader, local = self.locate(step)
        try:
            return use(loader, local)
        except (ValueError, IndexError) as e:
            raise self._told(e, int(step)) from None

    def _told(self, error: ValueError | IndexError, step: int) -> ValueError | IndexError:
        """``error`` of the phase that holds the run's ``step``, told as the
        run's (as it is with one phase, whose steps are the run's)."""
        if len(self.loaders) == 1:
            return error
        k = self.phase_at(step)
        text = f"step {step} (in {self.label(k)}, its step {step - self.starts[k]}): {error}"
        try:
            return type(error)(text)
        except TypeError:  # an error type that takes more than a message
            return IndexError(text) if isinstance(error, IndexError) else ValueError(text)

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
        return self._in_phase(step, lambda loader, local: loader.schedule.size(local))

    def host_blocks_at(self, step: int) -> HostBlocks | None:
        """The blocks this host reads at ``step`` (``None`` without a sharding)."""
        return self._in_phase(step, Loader.host_blocks_at)

    def host_rows_at(self, step: int) -> np.ndarray:
        """``[k] int64`` the global rows this host reads at ``step``, ascending."""
        return self._in_phase(step, Loader.host_rows_at)

    def batch(self, step: int) -> dict[str, jax.Array]:
        """The global batch at ``step``, ``[batch_size, seq_len]`` of its phase."""
        return self._in_phase(step, Loader.batch)

    def host_batch(self, step: int) -> dict[str, np.ndarray]:
        """This host's rows of the batch at ``step`` (numpy), in global row order."""
        return self._in_phase(step, Loader.host_batch)

    def encoded_batch(self, step: int) -> dict[str, jax.Array]:
        """:meth:`Loader.encoded_batch` of the phase that holds ``step``."""
        return self._in_phase(step, Loader.encoded_batch)

    def decoder(self, step: int = 0) -> Callable[[Mapping[str, jax.Array]], dict[str, jax.Array]]:
        """:meth:`Loader.decoder` of the phase that holds ``step``."""
        return self._in_phase(step, Loader.decoder)

    def provenance(self, step: int) -> list[dict[str, Any]]:
        """:meth:`Loader.provenance` of ``step``; with several phases each
        row also says its ``phase``, and ``sample`` counts over the run."""
        rows = self._in_phase(step, Loader.provenance)
        if len(self.phases) == 1:
            return rows
        k = self.phase_at(step)
        for row in rows:
            row["phase"] = k
            if "sample" in row:
                row["sample"] += self._before[k]
        return rows

    def iterate(self, start_step: int | None = None) -> Iterator[tuple[int, dict[str, jax.Array]]]:
        """Yields ``(step, batch)`` from ``start_step`` (default: the restored
        step), each phase read ahead by its loader's ``iterate``, up to
        :attr:`end_step` (or the end of a single phase's epochs)."""
        step = self.next_step if start_step is None else start_step
        self.locate(step)
        k = self.phase_at(step)
        while True:
            end = self.starts[k + 1] if k + 1 < len(self.starts) else self.end_step
            # Reads nothing ahead past the boundary; the next phase's first
            # steps are started a few steps before it.
            batches = self.loaders[k].iterate(step - self.starts[k], end - self.starts[k])
            stream = cast(Generator[tuple[int, dict[str, jax.Array]], None, None], batches)
            started = False
            try:
                while (taken := self._next(stream, step)) is not None:
                    step = self.starts[k] + taken[0]
                    self.next_step = step + 1
                    if k + 1 < len(self.loaders) and not started and step >= end - NEXT_PHASE_AHEAD:
                        self.loaders[k + 1].start(0)
                        started = True
                    yield step, taken[1]
                    step += 1
            finally:
                stream.close()
            if k + 1 == len(self.loaders):
                if step >= self.end_step:
                    self.locate(step)  # raises: the run can read no further
                return
            step, k = end, k + 1

    def _next(
        self, stream: Iterator[tuple[int, dict[str, jax.Array]]], step: int
    ) -> tuple[int, dict[str, jax.Array]] | None:
        """The next ``(local step, batch)`` of a phase's ``iterate`` (``None``
        at its end); an error names the run's ``step`` and the phase."""
        try:
            return next(stream)
        except StopIteration:
            return None
        except (ValueError, IndexError) as e:
            raise self._told(e, step) from None

    def start(self, step: int | None = None) -> None:
        """Starts reading ``step`` (default: :attr:`next_step`) and the steps
        after it in its phase (see :meth:`Loader.start`)."""
        self._in_phase(self.next_step if step is None else step, Loader.start)

    def stats(self) -> dict[str, Any]:
        """:meth:`Loader.stats` of the phase of the last step handed out (its
        ``tokens`` and ``source_tokens`` count that phase's steps), and
        ``phase``, its index."""
        k = self.phase_at(max(0, self.next_step - 1))
        return {**self.loaders[k].stats(), "phase": k}

    @property
    def wait_seconds(self) -> float:
        """How long the last step of the current phase waited for its batch."""
        loader, _ = self.locate(max(0, self.next_step - 1))
        return loader.wait_seconds

    def to_grain(self) -> StepsDataset:
        """:meth:`Loader.to_grain` over the phases, from :attr:`next_step` to
        :attr:`end_step` (or a single phase's end); its iterator's state is
        :meth:`state`, checked by :meth:`restore`."""
        from flat_tokens_jax.loader import tograin  # imports grain, only when asked

        last = self.end_step if self.num_batches is None else min(self.end_step, self.num_batches)
        stops = [*self.starts[1:], last]
        engines = [loader.engine for loader in self.loaders]
        spans = [tograin.Span(*s) for s in zip(engines, self.starts, stops, strict=True)]
        return tograin.StepsDataset(self, spans, self.next_step, NEXT_PHASE_AHEAD, self._told)

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
        saved, problems = state_problems(state)
        return problems if saved is None else self._differences(saved)

    def restore(self, state: Mapping[str, Any]) -> int:
        """Continues from a saved :meth:`state` (or a :meth:`Loader.state`);
        returns the step :meth:`iterate` resumes at.

        Raises:
            StateMismatch: the state is not one this version reads (each field
                named), or a phase begun before the saved step starts elsewhere
                or differs in a field that decides its batches there; each
                line names the phase, the steps seen and the field.
        """
        if len(self.loaders) == 1 and "phases" not in restorable(state, "run"):
            self.next_step = self.loaders[0].restore(state)
            return self.next_step
        saved = read_state(state)
        found = self._differences(saved)
        if found:
            raise StateMismatch(
                "the saved loader state does not continue into these phases:\n  "
                + "\n  ".join(found)
            )
        self.next_step = saved.step
        return saved.step

    def _differences(self, saved: SavedState) -> list[str]:
        """What keeps these phases from continuing ``saved``: each phase begun
        before the saved step must start where it did and resume there."""
        step = saved.step
        seen = [j for j, p in enumerate(saved.phases) if p.start_step < step] or [0]
        before = [saved.phases[j].start_step for j in seen]
        now = [s for s in self.starts if s < step] or [0]
        if before != now:
            return [
                f"phases: the saved run's phases before step {step} start at steps "
                f"{before}, these at {now}; phases may be added or changed only from the "
                f"saved step {step} on"
            ]
        out = []
        for j in seen:
            alone, start = saved.phase(j), saved.phases[j].start_step
            loader = self.loaders[j]
            end = start + alone.step
            where = f"{self.label(j)}, steps {start}..{end - 1} seen before the saved step {step}"
            found = differences(alone, loader.fingerprint(), loader.schedule)
            out += [f"{where}: {line}" for line in found]
        return out
