"""A run steered while it trains: skipped batches and weight changes, as arithmetic.

A trainer passes its own steps ``t``. Skips, ``(step, count)`` pairs, define
the *data step* ``d(t) = t + sum(count for (s, count) in skips if s <= t)``,
strictly increasing in ``t``: step ``t`` reads what step ``d(t)`` of the run
without skips would read (its samples, batch size and weight segment), so a
skip of 3 at step 5 makes step 7 read the data of step 10 (:class:`Skips`).

A weight change from step ``t`` starts a weight segment at data step
``d(t)``, merged with the mixture's declared schedule: each boundary, declared
or runtime, uses its own weights from its step on (a runtime change wins over
a declared one at the same data step). A change is held as the exact samples
of each component per period its weights round to: counts that sum to the
period reproduce its layout (:meth:`~flat_tokens_jax.sampling.mixture.Period.of_counts`).
Each component's stream continues across segments, as across a declared
schedule's: segment ``j`` starts with the samples each component drew before
it, counted when the segment is added (whole periods plus a prefix, found by
arithmetic without the period's tables: :func:`prefix_counts`). A step finds
its segment by bisection and builds the period tables it routes with on
demand, keeping the last few (:data:`TABLES_KEPT`), so a run with ``10**4``
changes costs at any step what it costs at step 1. The weights a trainer
step reads, and the trainer steps that read each segment, are read back as
stretches of steps (:class:`Stretch`). Pure arithmetic, no I/O.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import itertools
import threading
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from flat_tokens_jax.sampling.mixture import Period, route_segments
from flat_tokens_jax.sampling.schedule import BatchSchedule

__all__ = [
    "NO_SKIPS",
    "TABLES_KEPT",
    "Blend",
    "Skips",
    "Steering",
    "Stretch",
    "consumed",
    "prefix_counts",
]

MAX_SAMPLE = 2**63 - 1  # Global sample indices are int64.
TABLES_KEPT = 8
"""Period tables of runtime weight changes a :class:`Steering` keeps built
(a table takes 8 bytes a sample of its period, up to ``2**24`` samples)."""

# (trainer step, samples of each component per period) of each weight change.
Change = tuple[int, tuple[int, ...]]


@dataclasses.dataclass(frozen=True)
class Skips:
    """Skipped batches: the data step of each trainer step.

    Attributes:
        entries: ``((step, count), ...)``, steps strictly increasing, counts
            >= 1: from trainer ``step`` on, ``count`` more data steps are skipped.
    """

    entries: tuple[tuple[int, int], ...] = ()
    _steps: tuple[int, ...] = dataclasses.field(init=False, repr=False, compare=False)
    _through: tuple[int, ...] = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        steps = tuple(s for s, _ in self.entries)
        if any(b <= a for a, b in itertools.pairwise(steps)):
            raise ValueError(f"skip steps must increase strictly, got {list(steps)}")
        through, total = [], 0
        for _, count in self.entries:
            total += count
            through.append(total)
        object.__setattr__(self, "_steps", steps)
        object.__setattr__(self, "_through", tuple(through))

    def __bool__(self) -> bool:
        return bool(self.entries)

    def skipped(self, step: int) -> int:
        """Data steps skipped at trainer steps ``<= step``."""
        j = bisect.bisect_right(self._steps, step)
        return self._through[j - 1] if j else 0

    def data_step(self, step: int) -> int:
        """``d(step)``: the step of the run without skips whose data ``step`` reads."""
        return step + self.skipped(step)

    def trainer_step(self, data_step: int) -> int:
        """The first trainer step whose data step is ``data_step`` or later."""
        low, high = max(0, data_step - (self._through[-1] if self._through else 0)), data_step
        while low < high:  # d is strictly increasing, and d(t) >= t
            mid = (low + high) // 2
            low, high = (mid + 1, high) if self.data_step(mid) < data_step else (low, mid)
        return low

    def added(self, step: int, count: int) -> Skips:
        """These skips and ``count`` more at ``step`` (skips at one step add up)."""
        found = dict(self.entries)
        found[step] = found.get(step, 0) + count
        return Skips(tuple(sorted(found.items())))

    def within(self, first: int, stop: int | None, data_first: int) -> Skips:
        """The skips of trainer steps ``[first, stop)`` counted from ``first``
        (``stop`` ``None``: no end), for steps whose data counts from data
        step ``data_first``: a phase's own, with what ``d(first)`` passes over
        ``data_first`` skipped at its step 0."""
        lead = self.data_step(first) - data_first
        local = tuple(
            (s - first, c) for s, c in self.entries if first < s and (stop is None or s < stop)
        )
        return Skips((((0, lead),) if lead > 0 else ()) + local)


NO_SKIPS = Skips()


def prefix_counts(counts: Sequence[int] | np.ndarray, rest: int) -> np.ndarray:
    """``[K] int64`` samples of each component among the first ``rest``
    offsets of the period laid out from ``counts`` (``Period.of_counts``),
    found without its tables.

    Component ``c``'s ``k``-th sample sits at ``(2k + 1) / (2 n_c)`` of the
    period, ties to the lower component, so the first ``rest`` offsets are a
    prefix of that order. The samples at or before ``rest / period`` are such
    a prefix, within ``K / 2`` of ``rest`` long (each component's count is
    within 1/2 of its share): the last ones are taken off, or the next ones
    added, one at a time. O(K^2) exact integer arithmetic.
    """
    n = [int(x) for x in counts]
    period = sum(n)
    if rest >= period:
        return np.array(n, np.int64)
    rest = max(rest, 0)
    # Component c's samples at positions <= rest / period: (2k + 1) / (2 n_c) <= rest / period.
    m = [min(c, (2 * rest * c + period) // (2 * period)) for c in n]
    total = sum(m)
    while total > rest:  # drop the last taken: the latest position, ties the higher component
        last = -1
        for c in range(len(n)):
            if m[c] and (last < 0 or (2 * m[c] - 1) * n[last] >= (2 * m[last] - 1) * n[c]):
                last = c
        m[last] -= 1
        total -= 1
    while total < rest:  # take the next: the earliest position, ties the lower component
        first = -1
        for c in range(len(n)):
            if m[c] < n[c] and (first < 0 or (2 * m[c] + 1) * n[first] < (2 * m[first] + 1) * n[c]):
                first = c
        m[first] += 1
        total += 1
    return np.array(m, np.int64)


def consumed(counts: Sequence[int] | np.ndarray, num_samples: int) -> list[int]:
    """Samples of each component in the first ``num_samples`` of a run of
    periods laid out from ``counts``, as Python ints (``Period.consumed``
    without the tables)."""
    n = np.asarray(counts, np.int64)
    whole, rest = divmod(int(num_samples), int(n.sum()))
    prefix = prefix_counts(n, rest)
    return [whole * int(a) + int(b) for a, b in zip(n.tolist(), prefix.tolist(), strict=True)]


class Blend(Protocol):
    """What a :class:`Steering` reads of a mixture (a ``Mixture`` is one):
    its components and its declared weight schedule."""

    @property
    def names(self) -> tuple[str, ...]:
        """``[K]`` the components' names."""
        ...

    @property
    def steps(self) -> np.ndarray:
        """``[P] int64`` the data step each declared entry starts at, the first 0."""
        ...

    @property
    def periods(self) -> Sequence[Period]:
        """``[P]`` each declared entry's layout."""
        ...


@dataclasses.dataclass(frozen=True)
class Stretch:
    """The trainer steps that read one weight segment, and its weights.

    Attributes:
        first: the first trainer step that reads it.
        stop: the trainer step after the last (``None``: the last segment, no end).
        counts: ``[K]`` samples of each component per period (``None``: one source).
        changed: whether a trainer's change set them (else the mixture declared them).
    """

    first: int
    stop: int | None
    counts: tuple[int, ...] | None
    changed: bool


class Steering:
    """What a loader (or a phase's) routes with: its mixture's declared
    weight segments merged with runtime changes, and its skips. Immutable
    once made, and safe to share between threads: a change makes a new one
    (:meth:`steered`) that reuses the segments before it.

    Each boundary, declared or a runtime change, holds from its data step
    until the next one; a runtime change at a declared boundary's data step
    wins over it. That rule is here alone: routing, what a stream draws and
    what :meth:`stretch_at` reads back all follow it.

    Args:
        mixture: the blend (``None``: one source, no weights, only skips).
        schedule: the batch size of each data step.
        skips: the skipped batches, by trainer step.
        changes: ``((trainer step, counts), ...)`` by strictly increasing
            step: from that step on, ``counts[c]`` samples of component ``c``
            per period of ``sum(counts)`` samples.
    """

    _steps: list[int]  # each segment's first data step
    _keys: list[Any]  # a declared entry's index, or a runtime change's counts
    _starts: np.ndarray  # [S] int64 each segment's first global sample
    _offsets: np.ndarray  # [S, K] int64 samples of each component drawn before it

    def __init__(
        self,
        mixture: Blend | None,
        schedule: BatchSchedule,
        skips: Skips = NO_SKIPS,
        changes: Sequence[Change] = (),
    ) -> None:
        self.mixture, self.schedule = mixture, schedule
        self._tables: collections.OrderedDict[tuple[int, ...], Period] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._set(skips, tuple(changes), None, 0)

    def _set(
        self, skips: Skips, changes: tuple[Change, ...], before: Steering | None, since: int
    ) -> None:
        """Holds ``skips`` and ``changes``, keeping ``before``'s segments that
        start before trainer step ``since``'s data step (in both) and adding the rest."""
        self.skips, self.changes = skips, changes
        mix = self.mixture
        if mix is None:
            return
        if before is None:
            kept, data_from = 0, 0
            steps: list[int] = []
            keys: list[Any] = []
            starts = np.zeros(0, np.int64)
            offsets = np.zeros((0, len(mix.names)), np.int64)
        else:
            data_from = min(before.skips.data_step(since), skips.data_step(since))
            kept = bisect.bisect_left(before._steps, data_from)
            steps, keys = before._steps[:kept], before._keys[:kept]
            starts, offsets = before._starts[:kept], before._offsets[:kept]
        later: dict[int, Any] = {int(s): j for j, s in enumerate(mix.steps) if s >= data_from}
        for t, counts in changes[bisect.bisect_left(changes, (since,)) :]:
            later[skips.data_step(t)] = counts  # a runtime change wins at its step
        last = (int(starts[-1]), offsets[-1]) if kept else None
        added: list[tuple[int, np.ndarray]] = []
        for step in sorted(later):
            start = self.schedule.samples_before(step)
            if start > MAX_SAMPLE:
                break
            if last is None:
                drawn = np.zeros(len(mix.names), np.int64)
            else:
                more = consumed(self._counts(keys[-1]), start - last[0])
                drawn = last[1] + np.array(more, np.int64)
            steps.append(step)
            keys.append(later[step])
            last = (start, drawn)
            added.append(last)
        self._steps, self._keys = steps, keys
        self._starts = np.concatenate([starts, np.array([a for a, _ in added], np.int64)])
        self._offsets = np.concatenate([offsets, *[d[None] for _, d in added]])

    def steered(self, skips: Skips, changes: Sequence[Change], since: int) -> Steering:
        """A steering of ``skips`` and ``changes``, which agree with this
        one's before trainer step ``since``: its segments from there on are
        counted again, the earlier ones reused."""
        out = Steering.__new__(Steering)
        out.mixture, out.schedule = self.mixture, self.schedule
        out._tables, out._lock = self._tables, self._lock  # tables depend on counts alone
        out._set(skips, tuple(changes), self, since)
        return out

    def _counts(self, key: Any) -> np.ndarray:
        """The per-period counts of a segment's ``key``: a declared entry's
        index, or a runtime change's counts."""
        assert self.mixture is not None
        if isinstance(key, int):
            return self.mixture.periods[key].counts
        return np.asarray(key, np.int64)

    def _table(self, j: int) -> Period:
        key = self._keys[j]
        assert self.mixture is not None
        if isinstance(key, int):
            return self.mixture.periods[key]
        with self._lock:
            found = self._tables.get(key)
            if found is not None:
                self._tables.move_to_end(key)
                return found
        made = Period.of_counts(key)  # outside the lock: a large one takes a while
        with self._lock:
            self._tables[key] = made
            while len(self._tables) > TABLES_KEPT:
                self._tables.popitem(last=False)
        return made

    def data_step(self, step: int) -> int:
        """The data step that trainer step ``step`` reads."""
        return self.skips.data_step(step)

    def route(self, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Global samples to ``(component [k] int64, component sample [k] int64)``."""
        return route_segments(samples, self._starts, self._offsets, self._table)

    def drawn(self, num_samples: int) -> list[int]:
        """``[K]`` samples of each component drawn in the first
        ``num_samples`` global samples (``<= 2**63``), as Python ints."""
        if self.mixture is None:
            return [num_samples]
        j = bisect.bisect_right(self._starts, num_samples) - 1  # num_samples may be 2**63
        more = consumed(self._counts(self._keys[j]), num_samples - int(self._starts[j]))
        return [int(a) + b for a, b in zip(self._offsets[j].tolist(), more, strict=True)]

    def _stretch(self, j: int) -> Stretch:
        """Segment ``j`` as the trainer steps that read it."""
        key = self._keys[j]
        stop = self.skips.trainer_step(self._steps[j + 1]) if j + 1 < len(self._steps) else None
        counts = tuple(int(n) for n in self._counts(key))
        first = self.skips.trainer_step(self._steps[j])
        return Stretch(first, stop, counts, not isinstance(key, int))

    def stretch_at(self, step: int) -> Stretch:
        """The weight segment that trainer step ``step`` reads: the latest
        boundary at or before its data step."""
        if self.mixture is None:
            return Stretch(0, None, None, False)
        return self._stretch(bisect.bisect_right(self._steps, self.data_step(step)) - 1)

    def stretches(self, stop: int) -> list[Stretch]:
        """The weight segments that trainer steps ``[0, stop)`` read, in order,
        the last one cut at ``stop``; a segment whose every data step is
        skipped is left out."""
        if stop <= 0:
            return []
        if self.mixture is None:
            return [Stretch(0, stop, None, False)]
        last = bisect.bisect_right(self._steps, self.data_step(stop - 1)) - 1
        out = []
        for j in range(last + 1):
            found = self._stretch(j)
            end = stop if found.stop is None else min(found.stop, stop)
            if found.first < end:
                out.append(dataclasses.replace(found, stop=end))
        return out
