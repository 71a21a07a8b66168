"""A run steered while it trains, as arithmetic (no I/O): :class:`Steering`, the weight
segments and skips a run routes with; skips (:mod:`~flat_tokens_jax.sampling.skips`) give
the *data step* ``d(t)`` that trainer step ``t`` reads (docs/guide/steering.md).
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import threading
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from flat_tokens_jax.sampling.mixture import Period, consumed, route_segments
from flat_tokens_jax.sampling.schedule import MAX_SAMPLE, BatchSchedule
from flat_tokens_jax.sampling.skips import NO_SKIPS, SharedRows, Skips

TABLES_KEPT = 8
"""Period tables of runtime weight changes a :class:`Steering` keeps built
(a table takes 8 bytes a sample of its period, up to ``2**24`` samples)."""

# (trainer step, samples of each component per period) of each weight change.
Change = tuple[int, tuple[int, ...]]


class Blend(Protocol):
    """What a :class:`Steering` reads of a mixture (a ``Mixture``, or a saved
    phase's): the components' ``names``, the data step each declared weight
    entry starts at (``steps`` ``[P] int64``, the first 0) and its layout."""

    @property
    def names(self) -> tuple[str, ...]: ...

    @property
    def steps(self) -> np.ndarray: ...

    @property
    def periods(self) -> Sequence[Period]: ...


@dataclasses.dataclass(frozen=True)
class Stretch:
    """Trainer steps ``[first, stop)`` (``stop`` ``None``: no end) read one
    weight segment: ``counts`` ``[K]`` samples of each component per period
    (``None``: one source), ``changed`` by a trainer (else declared)."""

    first: int
    stop: int | None
    counts: tuple[int, ...] | None
    changed: bool


class Steering:
    """What a loader (or a phase) routes with: its mixture's declared weight
    segments merged with runtime changes, and its skips. Immutable and
    thread-safe: a change makes a new one (:meth:`with_skip`,
    :meth:`with_change`, :meth:`steered`) that reuses the segments before it,
    O(log n) amortized for a change at or after every earlier one.

    Each boundary, declared or runtime, holds from its data step until the
    next; a runtime change at a declared boundary's data step wins over it.
    That rule is here alone: routing, what a stream draws and :meth:`stretch_at`
    all follow it. ``mixture`` ``None``: one source, only skips. ``changes``:
    ``((trainer step, counts), ...)`` by strictly increasing step, ``counts[c]``
    samples of component ``c`` per period from that step on.
    """

    # The changes: rows (trainer step, counts) by step, the last of a step in effect.
    _log: SharedRows
    _logged: int
    _changes: tuple[Change, ...] | None  # the log read back, once asked for
    # The segments: the first `_kept` rows of `_segs` (columns: first data step,
    # key; arrays: first global sample [S] int64, samples of each component drawn
    # before it [S, K] int64), then this steering's own, `_tail`'s. A key is a
    # declared entry's index, or a runtime change's counts.
    _segs: SharedRows
    _kept: int
    _tail: SharedRows

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
        self._set(skips, *_logged(changes), None, 0)

    def _segments(self, rows: Sequence[Sequence[Any]] = ()) -> SharedRows:
        """Segment rows ``(data step, key, start, [K] drawn)`` in rows of their own."""
        k = 0 if self.mixture is None else len(self.mixture.names)
        empty = SharedRows([[], []], [np.zeros(0, np.int64), np.zeros((0, k), np.int64)])
        return empty.added(0, rows)

    def _set(
        self, skips: Skips, log: SharedRows, logged: int, before: Steering | None, since: int
    ) -> None:
        """Holds ``skips`` and the first ``logged`` rows of ``log``, keeping
        ``before``'s segments that start before trainer step ``since``'s
        data step (in both) and adding the rest."""
        self.skips, self._log, self._logged, self._changes = skips, log, logged, None
        mix = self.mixture
        if before is None:
            self._segs, self._kept, data_from = self._segments(), 0, 0
        else:
            data_from = min(before.skips.data_step(since), skips.data_step(since))
            self._segs, self._kept = before._prefix(before._first_at(data_from))
        if mix is None:
            self._tail = self._segments()
            return
        later: dict[int, Any] = {int(s): j for j, s in enumerate(mix.steps) if s >= data_from}
        steps, values = log.lists
        for j in range(bisect.bisect_left(steps, since, 0, logged), logged):
            later[skips.data_step(steps[j])] = values[j]  # a runtime change wins at its step
        last = before._row(self._kept - 1) if before is not None and self._kept else None
        added: list[tuple[int, Any, int, np.ndarray]] = []
        for step in sorted(later):
            start = self.schedule.samples_before(step)
            if start > MAX_SAMPLE:
                break
            if last is None:
                drawn = np.zeros(len(mix.names), np.int64)
            else:
                more = consumed(self._counts(last[1]), start - last[2])
                drawn = last[3] + np.array(more, np.int64)
            last = (step, later[step], start, drawn)
            added.append(last)
        self._tail = self._segments(added)

    def _prefix(self, kept: int) -> tuple[SharedRows, int]:
        """Shared rows whose first ``kept`` are this steering's first segments."""
        if kept <= self._kept:
            return self._segs, kept
        moved = [self._row(j) for j in range(self._kept, kept)]
        return self._segs.added(self._kept, moved), kept

    def _row(self, j: int) -> tuple[int, Any, int, np.ndarray]:
        """Segment ``j``: its first data step, key, first global sample and
        ``[K]`` samples of each component drawn before it."""
        rows, j = (self._segs, j) if j < self._kept else (self._tail, j - self._kept)
        (steps, keys), (starts, offsets) = rows.lists, rows.arrays
        return steps[j], keys[j], int(starts[j]), offsets[j]

    def _parts(self) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """``(first segment, starts, offsets)`` of the shared segments and this one's own."""
        out = []
        for first, rows, n in ((0, self._segs, self._kept), (self._kept, self._tail, None)):
            starts, offsets = rows.arrays
            n = len(rows.lists[0]) if n is None else n
            if n:
                out.append((first, starts[:n], offsets[:n]))
        return out

    def _first_at(self, data_step: int) -> int:
        """The first segment starting at or after ``data_step``."""
        j = bisect.bisect_left(self._segs.lists[0], data_step, 0, self._kept)
        if j < self._kept:
            return j
        return self._kept + bisect.bisect_left(self._tail.lists[0], data_step)

    def _segment_at(self, data_step: int) -> int:
        """The segment that holds ``data_step``: the last starting at or before it."""
        return self._first_at(data_step + 1) - 1

    @property
    def changes(self) -> tuple[Change, ...]:
        """``((trainer step, counts), ...)`` by strictly increasing step."""
        if self._changes is None:
            steps, values = self._log.lists
            n = self._logged
            self._changes = tuple(dict(zip(steps[:n], values[:n], strict=True)).items())
        return self._changes

    def _made(self, skips: Skips, log: SharedRows, logged: int, since: int) -> Steering:
        out = Steering.__new__(Steering)
        out.mixture, out.schedule = self.mixture, self.schedule
        out._tables, out._lock = self._tables, self._lock  # tables depend on counts alone
        out._set(skips, log, logged, self, since)
        return out

    def steered(self, skips: Skips, changes: Sequence[Change], since: int) -> Steering:
        """A steering of ``skips`` and ``changes``, which agree with this one's
        before trainer step ``since`` (the segments before it are reused)."""
        return self._made(skips, *_logged(changes), since)

    def with_skip(self, step: int, count: int) -> Steering:
        """This steering and ``count`` more batches skipped at ``step`` (:meth:`Skips.added`)."""
        return self._made(self.skips.added(step, count), self._log, self._logged, step)

    def with_change(self, step: int, counts: tuple[int, ...]) -> Steering:
        """This steering with ``counts`` from ``step`` on, replacing a change
        at that step (itself when it has those counts there)."""
        steps, values = self._log.lists
        n = self._logged
        j = bisect.bisect_right(steps, step, 0, n)
        if j and steps[j - 1] == step and values[j - 1] == counts:
            return self
        if j < n:  # before a later change: the log is written again
            return self._made(self.skips, *_logged(with_weights(self.changes, step, counts)), step)
        return self._made(self.skips, self._log.added(n, [(step, counts)]), n + 1, step)

    def _counts(self, key: Any) -> np.ndarray:
        """The per-period counts of a segment's ``key``."""
        assert self.mixture is not None
        if isinstance(key, int):
            return self.mixture.periods[key].counts
        return np.asarray(key, np.int64)

    def _table(self, j: int) -> Period:
        key = self._row(j)[1]
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
        g = np.asarray(samples, np.int64)
        parts = self._parts()
        if len(parts) == 1:
            first, starts, offsets = parts[0]
            return route_segments(g, starts, offsets, lambda j: self._table(first + j))
        comp, sample = np.empty(g.shape, np.int64), np.empty(g.shape, np.int64)
        own = g >= parts[1][1][0]
        for (first, starts, offsets), here in zip(parts, (~own, own), strict=True):

            def period(j: int, first: int = first) -> Period:
                return self._table(first + j)

            comp[here], sample[here] = route_segments(g[here], starts, offsets, period)
        return comp, sample

    def drawn(self, num_samples: int) -> list[int]:
        """``[K]`` samples of each component drawn in the first
        ``num_samples`` global samples (``<= 2**63``), as Python ints."""
        if self.mixture is None:
            return [num_samples]
        j = -1
        for first, starts, _ in self._parts():  # num_samples may be 2**63
            if num_samples >= int(starts[0]):
                j = first + bisect.bisect_right(starts, num_samples) - 1
        _, key, start, offsets = self._row(j)
        more = consumed(self._counts(key), num_samples - start)
        return [int(a) + b for a, b in zip(offsets.tolist(), more, strict=True)]

    def first_past(self, limits: Sequence[int]) -> int | None:
        """The first global sample that draws component ``c``'s sample
        ``limits[c]`` (its first past ``limits[c]``) for some ``c``; ``None``
        if none does below ``2**63``."""
        assert self.mixture is not None
        found = MAX_SAMPLE + 1
        count = self._kept + len(self._tail.lists[0])
        for j in range(count):
            _, key, start, drawn = self._row(j)
            if start >= found:
                break
            after = self._row(j + 1)[3] if j + 1 < count else None  # drawn before the next
            counts = self._counts(key)
            for c, limit in enumerate(limits):
                # Only the segment that draws the sample builds its period's table.
                if drawn[c] <= limit and (after is None or limit < after[c]) and counts[c]:
                    whole, rank = divmod(limit - int(drawn[c]), int(counts[c]))
                    table = self._table(j)
                    at = int(np.flatnonzero(table.component == c)[rank])
                    found = min(found, start + whole * table.period + at)
        return found if found <= MAX_SAMPLE else None

    def _stretch(self, j: int) -> Stretch:
        """Segment ``j`` as the trainer steps that read it."""
        step, key, _, _ = self._row(j)
        following = j + 1 < self._kept + len(self._tail.lists[0])
        stop = self.skips.trainer_step(self._row(j + 1)[0]) if following else None
        counts = tuple(int(n) for n in self._counts(key))
        return Stretch(self.skips.trainer_step(step), stop, counts, not isinstance(key, int))

    def stretch_at(self, step: int) -> Stretch:
        """The weight segment that trainer step ``step`` reads: the latest
        boundary at or before its data step."""
        if self.mixture is None:
            return Stretch(0, None, None, False)
        return self._stretch(self._segment_at(self.data_step(step)))

    def stretches(self, stop: int) -> list[Stretch]:
        """The weight segments that trainer steps ``[0, stop)`` read, in order,
        cut at ``stop``; one whose every data step is skipped is left out."""
        if stop <= 0:
            return []
        if self.mixture is None:
            return [Stretch(0, stop, None, False)]
        out = []
        for j in range(self._segment_at(self.data_step(stop - 1)) + 1):
            found = self._stretch(j)
            end = stop if found.stop is None else min(found.stop, stop)
            if found.first < end:
                out.append(dataclasses.replace(found, stop=end))
        return out


def _logged(changes: Sequence[Change]) -> tuple[SharedRows, int]:
    """``changes`` as a steering's log and its length."""
    return SharedRows([[int(t) for t, _ in changes], [tuple(c) for _, c in changes]]), len(changes)


def with_weights(
    changes: Sequence[Change], step: int, counts: tuple[int, ...]
) -> tuple[Change, ...]:
    """``changes`` with ``counts`` from ``step`` on (replacing one at that step)."""
    at = bisect.bisect_left(changes, (step,))
    after = at + 1 if at < len(changes) and changes[at][0] == step else at
    return (*changes[:at], (step, counts), *changes[after:])
