"""``PhasedLoader``, a :class:`~flat_tokens_jax.Loader` of several phases, an
engine each (with one phase, the same batches and ``state()`` as a ``Loader``);
and :func:`steering_at`, what a step of any run reads. What a run in phases
reads and restores: docs/guide/mixtures.md, "Runs in phases".
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax

from flat_tokens_jax.core.limits import largest
from flat_tokens_jax.loader.engine import StepEngine
from flat_tokens_jax.loader.loader import Loader
from flat_tokens_jax.loader.phases import Phase, check_phases, drawn, steps_within, stream_key
from flat_tokens_jax.loader.sources import Sources
from flat_tokens_jax.loader.state import SavedState, StateMismatch, StepSteering
from flat_tokens_jax.loader.steered import check_step, merged, restated, skip_count, weight_counts
from flat_tokens_jax.sampling.skips import NO_SKIPS, Skips
from flat_tokens_jax.sampling.steering import Change, with_weights
from flat_tokens_jax.sampling.stepsamples import MAX_SAMPLE


class PhasedLoader(Loader):
    """Batches of a run in phases, from any step: a :class:`~flat_tokens_jax.Loader`
    whose steps go through the engine of their phase. ``phases``: the run's
    :class:`~flat_tokens_jax.loader.phases.Phase` list, by start step; ``sharding``
    and ``plan_cache`` as ``Loader``'s.

    Attributes:
        phases: the phases, checked.
        streams: per phase, each component's stream key (see
            :func:`~flat_tokens_jax.loader.phases.stream_key`).
        offsets: per phase, each component's stream samples drawn by the
            earlier phases: where the phase continues its streams.
        phase_samples: ``[K]`` the run's global samples before each phase.

    Raises:
        ValueError: naming the phase: the phases are out of order, bound their
            epochs, or one blends one stream twice; a phase refuses its source or
            config (as ``Loader`` does); or a phase cannot read all its steps (the
            message names the latest start step that works).
    """

    _to_workers = False  # to_grain refuses grain's worker processes

    def __init__(
        self,
        phases: Sequence[Phase],
        sharding: jax.sharding.Sharding | None = None,
        *,
        plan_cache: str | os.PathLike[str] | None = None,
    ) -> None:
        self.phases: tuple[Phase, ...] = check_phases(phases)
        self.starts = [p.start_step for p in self.phases]
        resolved = []
        for k, phase in enumerate(self.phases):
            try:
                resolved.append(Sources.of(phase.source, phase.config, sharding, plan_cache))
            except ValueError as e:
                raise ValueError(f"{self.label(k)}: {e}") from None
        names = tuple(dict.fromkeys(n for r in resolved for n in r.names))
        engines: list[StepEngine] = []
        self.streams: list[list[str]] = []
        self._seeds: list[list[int]] = []
        seeds: dict[str, int] = {}
        for k, sources in enumerate(resolved):
            try:
                keys = self._keys(sources)
                for key, seed in zip(keys, sources.seeds(), strict=True):
                    seeds.setdefault(key, seed)
                # A stream goes on where the earlier phases left it (see _apply), under
                # the seed of the phase it first appeared in. One phase reads as a Loader
                # does (its mixture may even blend one stream twice).
                streams = [(seeds[key], 0) for key in keys] if len(self.phases) > 1 else None
                engines.append(StepEngine(sources, sharding, streams, names))
            except ValueError as e:
                raise ValueError(f"{self.label(k)}: {e}") from None
            self.streams.append(keys)
            self._seeds.append([seeds[key] for key in keys])
        # Samples of the run before each phase, and each stream's drawn before it.
        self.phase_samples = [0]
        for k, engine in enumerate(engines[:-1]):
            drew = engine.schedule.samples_before(self.starts[k + 1] - self.starts[k])
            self.phase_samples.append(self.phase_samples[-1] + drew)
        self.offsets = [[0] * len(keys) for keys in self.streams]
        self._drawn_before: list[dict[str, int]] = [{} for _ in self.streams]
        self._skips: Skips = NO_SKIPS
        self._changes: list[Change] = []  # the run's weight changes, by step
        self.engines, self.firsts = engines, list(self.starts)
        self._apply(NO_SKIPS, (), 0)
        self._open(engines, sharding)

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
        """The first data step the run cannot read (a sample index, a phase's own or
        a stream's, would pass ``2**63 - 1``), after refusing (naming the latest
        start that works) a phase that cannot read all its steps."""
        for k, engine in enumerate(self.engines):
            last = k + 1 == len(self.engines)
            most = MAX_SAMPLE + 1 if last else self.starts[k + 1] - self.starts[k]
            n = steps_within(engine.steps.steering, self.offsets[k], most)
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
        """Which sample index phase ``k``'s data step ``local`` would take past ``2**63 - 1``."""
        steering = self.engines[k].steps.steering
        schedule, mixture = steering.schedule, steering.mixture
        if schedule.samples_before(local + 1) - 1 > MAX_SAMPLE:
            return (
                f"the phase's sample indices would pass 2**63 - 1 (batch_size "
                f"{schedule}, {schedule.samples_before(local):,} samples before)"
            )
        counts = drawn(steering, local + 1)
        for c, (before, n) in enumerate(zip(self.offsets[k], counts, strict=True)):
            if before + n - 1 > MAX_SAMPLE:
                stream = "its stream" if mixture is None else f"{mixture.names[c]!r}'s stream"
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
        earlier = self.starts[k - 1]

        def fits(start: int) -> bool:
            counts = dict(self._drawn_before[k - 1])
            taken = drawn(self.engines[k - 1].steps.steering, start - earlier)
            for key, n in zip(self.streams[k - 1], taken, strict=True):
                counts[key] = counts.get(key, 0) + n
            offsets = [counts.get(key, 0) for key in self.streams[k]]
            return steps_within(self.engines[k].steps.steering, offsets, 1) == 1

        first = earlier + 1
        return None if first == self.starts[k] else largest(fits, first, self.starts[k] - 1)

    def __repr__(self) -> str:
        return f"PhasedLoader({len(self.phases)} phases from steps {self.starts})"

    def locate(self, step: int) -> tuple[StepEngine, int]:
        k = self.phase_at(step)
        assert self.end_step is not None
        if step >= self.end_step:
            raise ValueError(
                f"step {step} is past the last step this run can read, {self.end_step - 1}: "
                f"at step {self.end_step}, in {self.label(k)}, "
                f"{self._past(k, self._data_end - self.starts[k])}"
            )
        return self.engines[k], int(step) - self.firsts[k]

    def _told(self, error: ValueError | IndexError, step: int) -> ValueError | IndexError:
        if len(self.engines) == 1:
            return error
        k = self.phase_at(step)
        text = f"step {step} (in {self.label(k)}, its step {step - self.firsts[k]}): {error}"
        try:
            return type(error)(text)
        except TypeError:  # an error type that takes more than a message
            return IndexError(text) if isinstance(error, IndexError) else ValueError(text)

    def samples_before(self, step: int) -> int:
        k = self.phase_at(step)
        engine, local = self.engines[k], step - self.firsts[k]
        return self.phase_samples[k] + engine.schedule.samples_before(engine.steps.data_step(local))

    def provenance(self, step: int) -> list[dict[str, Any]]:
        rows = super().provenance(step)
        if len(self.engines) > 1:
            k = self.phase_at(step)
            for row in rows:
                row["phase"] = k
                if "sample" in row:
                    row["sample"] += self.phase_samples[k]
        return rows

    def stats(self) -> dict[str, Any]:
        k = self.phase_at(max(0, self.next_step - 1))
        return {**self.prefetcher.stats(), **self.engines[k].stats(), "phase": k}

    def fingerprint(self) -> Any:
        """Each phase's ``{"start_step", "fingerprint"}`` (see :meth:`Loader.fingerprint`)."""
        return [
            {"start_step": s, "fingerprint": e.sources.fingerprint()}
            for s, e in zip(self.starts, self.engines, strict=True)
        ]

    def _steered(self) -> tuple[Skips, tuple[Change, ...]]:
        return self._skips, tuple(self._changes)

    def skip(self, step: int, count: int) -> None:
        """:meth:`Loader.skip` over the run, phases included (a phase declared to start
        at step ``B`` starts at the first step whose data step is ``B`` or later).

        Raises:
            ValueError: as :meth:`Loader.skip`, or the skip would move a weight
                change into another phase.
        """
        if restated(self._restored, step, count, self.next_step, "PhasedLoader.skip"):
            return
        step = check_step(step, self.next_step, "PhasedLoader.skip")
        count = skip_count(count, "PhasedLoader.skip: count", self._skips, step, self._data_end - 1)
        skips = self._skips.added(step, count)
        k = len(self.engines) - 1
        if step > self.firsts[k]:  # the last phase's: no boundary moves (O(log n))
            engine = self.engines[k]
            engine.steer(engine.steps.steering.with_skip(step - self.firsts[k], count))
            self._skips = skips
            self.end_step = skips.trainer_step(self._data_end)
            self.prefetcher.drop_from(step)
            return
        for t, _ in self._changes:
            was, now = self.phase_at(t), bisect.bisect_right(self.starts, skips.data_step(t)) - 1
            if was != now:
                raise ValueError(
                    f"PhasedLoader.skip: skipping {count} batches at step {step} moves the "
                    f"weight change at step {t} from {self.label(was)} to {self.label(now)}, "
                    "whose weights it does not give: skip fewer, or set the weights again"
                )
        self._apply(skips, self._changes, step)

    def set_weights(self, step: int, weights: Sequence[float] | Mapping[str, float]) -> None:
        """:meth:`Loader.set_weights` of the phase whose data ``step`` reads, from
        ``step`` to that phase's end (later phases keep their own weights)."""
        step = check_step(step, self.next_step, "PhasedLoader.set_weights")
        k = self.phase_at(step)
        call = "PhasedLoader.set_weights" + ("" if len(self.phases) == 1 else f" ({self.label(k)})")
        counts = weight_counts(self.engines[k].mixture, weights, step, call)
        changes = self._changes
        if k + 1 == len(self.engines) and (not changes or changes[-1][0] <= step):
            # The last phase's, at or after the last change: the phase's own steering
            # and the run's log grow at their end (O(log n)); its reach is counted again.
            engine = self.engines[k]
            steering = engine.steps.steering
            changed = steering.with_change(step - self.firsts[k], counts)
            if changed is not steering:
                engine.steer(changed)
                if changes and changes[-1][0] == step:
                    changes[-1] = (step, counts)
                else:
                    changes.append((step, counts))
                self._data_end = self._reach()
                self.end_step = self._skips.trainer_step(self._data_end)
                self.prefetcher.drop_from(step)
            return
        self._apply(self._skips, with_weights(changes, step, counts), step)

    def _apply(self, skips: Skips, changes: Sequence[Change], since: int) -> None:
        """Reads with the run's skips and weight changes, which differ from now's
        from step ``since`` on: each phase its own (see ``Skips.within``), its
        streams continued where the earlier phases left them."""
        firsts = [skips.trainer_step(b) for b in self.starts]
        homes = [bisect.bisect_right(firsts, t) - 1 for t, _ in changes]
        for (t, given), k in zip(changes, homes, strict=True):
            if len(given) != len(self.engines[k].names) or self.engines[k].mixture is None:
                raise ValueError(f"the weight change at step {t} is not {self.label(k)}'s")
        counts: dict[str, int] = {}
        for k, engine in enumerate(self.engines):
            stop = firsts[k + 1] if k + 1 < len(firsts) else None
            own = skips.within(firsts[k], stop, self.starts[k])
            mine = tuple(
                (t - firsts[k], c) for (t, c), h in zip(changes, homes, strict=True) if h == k
            )
            offsets = [counts.get(key, 0) for key in self.streams[k]]
            if offsets != self.offsets[k]:
                engine.restream(list(zip(self._seeds[k], offsets, strict=True)))
                self.offsets[k] = offsets
            self._drawn_before[k] = dict(counts)
            now = engine.steps.steering
            if (own, mine) != (now.skips, now.changes):
                unmoved = firsts[k] == self.firsts[k]
                engine.steer(now.steered(own, mine, max(0, since - firsts[k]) if unmoved else 0))
            if stop is not None:
                taken = drawn(engine.steps.steering, self.starts[k + 1] - self.starts[k])
                for key, n in zip(self.streams[k], taken, strict=True):
                    counts[key] = counts.get(key, 0) + n
        self.firsts, self._skips, self._changes = firsts, skips, list(changes)
        self._data_end = self._reach()
        self.end_step = skips.trainer_step(self._data_end)
        if hasattr(self, "prefetcher"):  # not while the run opens
            self.prefetcher.drop_from(since)

    def restore(self, state: Mapping[str, Any] | SavedState) -> int:
        """:meth:`Loader.restore` of a saved :meth:`state` (or a :meth:`Loader.state`).

        Raises:
            StateMismatch: the state is not one this version reads, or a phase begun
                before the saved step starts elsewhere or differs in a field that
                decides its batches there (naming the phase, the steps seen and the field).
        """
        saved = SavedState.of(state, "run")
        if len(self.engines) == 1 and not saved.phased:
            super().restore(saved)
            steering = self.engine.steps.steering
            self._apply(steering.skips, steering.changes, 0)
        else:
            found = self._differences(saved)
            if found:
                raise StateMismatch.of(
                    "the saved loader state does not continue into these phases", found
                )
            self._apply(*merged(saved, self._skips, self._changes), 0)
            self.next_step = saved.step
        self._restored = dict(self._skips.entries)
        return self.next_step

    def _differences(self, saved: SavedState) -> list[str]:
        """What keeps these phases from continuing ``saved``: each phase begun
        before the saved step must start where it did and resume there."""
        step, data = saved.step, saved.data_step
        seen = [j for j, p in enumerate(saved.phases) if p.start_step < data] or [0]
        before = [saved.phases[j].start_step for j in seen]
        now = [s for s in self.starts if s < data] or [0]
        if before != now:
            at = "" if data == step else f" (data step {data})"
            return [
                f"phases: the saved run's phases before step {step}{at} start at steps "
                f"{before}, these at {now}; phases may be added or changed only from the "
                f"saved step {step}{at} on"
            ]
        out = []
        for j in seen:
            alone, start = saved.phase(j), saved.phases[j].start_step
            engine = self.engines[j]
            end = start + alone.data_step
            where = f"{self.label(j)}, steps {start}..{end - 1} seen before the saved step {step}"
            found = alone.differences(engine.sources.fingerprint(), engine.schedule)
            out += [f"{where}: {line}" for line in found]
        return out


def steering_at(run: Loader | SavedState | Mapping[str, Any], step: int) -> StepSteering:
    """The data step that ``step`` reads and the weights in effect there, for
    a ``Loader`` (its changes so far) or a saved state (``state()``'s mapping or
    a ``SavedState``; for many steps, ask one ``SavedState``: this reads it each call).

    Raises:
        StateMismatch: the state is not one this version reads.
    """
    if isinstance(run, Loader):
        run = run.saved_state()
    return (run if isinstance(run, SavedState) else SavedState.read(run)).steering_at(step)
