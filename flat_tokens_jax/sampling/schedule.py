"""Batch-size schedules: the global batch size of every step, and the samples before it.

Arithmetic over the ``(start_step, size)`` entries on Python ints, never a loop
over steps, so any step (``10**12`` included) costs the same.

Example:
    >>> sched = BatchSchedule.of([(0, 256), (2000, 512)])
    >>> sched.size(1999), sched.size(2000)
    (256, 512)
    >>> sched.samples_before(2001)
    512512
    >>> sched.step_of(512511)
    2000
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
from collections.abc import Mapping, Sequence
from typing import Any

from flat_tokens_jax.core.values import integer, is_integer
from flat_tokens_jax.sampling.blocks import lanes

MAX_SAMPLE = 2**63 - 1  # Global sample indices are int64.

# What a config may hold: an int, [(start_step, size), ...] or {start_step: size}.
BatchSizeSpec = int | Sequence[Sequence[int]] | Mapping[int, int]


@dataclasses.dataclass(frozen=True)
class BatchSchedule:
    """The global batch size of each step: ``entries`` ``((start_step, size),
    ...)``, the first at step 0, steps strictly increasing; consecutive equal
    sizes are merged, so equal schedules compare equal."""

    entries: tuple[tuple[int, int], ...]
    _starts: tuple[int, ...] = dataclasses.field(init=False, repr=False, compare=False)
    _before: tuple[int, ...] = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.entries:
            raise ValueError("a batch-size schedule needs at least one (step, size) entry")
        checked = []
        for i, (step, size) in enumerate(self.entries):
            entry = f"batch_size entry {i} ({step!r}, {size!r}): the"
            checked.append((integer(step, f"{entry} step"), integer(size, f"{entry} size", low=1)))
        object.__setattr__(self, "entries", tuple(checked))
        first = self.entries[0][0]
        if first != 0:
            raise ValueError(
                f"batch_size entry 0 ({first}, {self.entries[0][1]}) starts at step {first}: "
                "the first entry must start at step 0, e.g. [[0, 256], [2000, 512]]"
            )
        for i, ((a, _), (b, size)) in enumerate(itertools.pairwise(self.entries), start=1):
            if b <= a:
                raise ValueError(
                    f"batch_size entry {i} ({b}, {size}) starts at step {b}, not after the "
                    f"previous entry's step {a}: list steps in strictly increasing order"
                )
        merged = [self.entries[0]]
        for step, size in self.entries[1:]:
            if size != merged[-1][1]:
                merged.append((step, size))
        starts = [s for s, _ in merged]
        before = [0]
        for (a, size), b in zip(merged, starts[1:], strict=False):
            before.append(before[-1] + (b - a) * size)
        object.__setattr__(self, "entries", tuple(merged))
        object.__setattr__(self, "_starts", tuple(starts))
        object.__setattr__(self, "_before", tuple(before))

    @classmethod
    def of(cls, value: BatchSizeSpec | BatchSchedule) -> BatchSchedule:
        """A schedule from an int (every step), ``[(step, size), ...]`` or ``{step: size}``."""
        if isinstance(value, BatchSchedule):
            return value
        if is_integer(value):
            return cls(((0, integer(value, "batch_size", low=1)),))
        if isinstance(value, Mapping):
            pairs: list[Any] = list(value.items())
        elif isinstance(value, Sequence) and not isinstance(value, str | bytes):
            pairs = list(value)
        else:
            raise ValueError(
                f"batch_size must be an int or a schedule [[start_step, size], ...], got {value!r}"
            )
        entries = []
        for i, pair in enumerate(pairs):
            if isinstance(pair, str | bytes) or not isinstance(pair, Sequence) or len(pair) != 2:
                raise ValueError(
                    f"batch_size entry {i} must be a pair [start_step, size], got {pair!r}"
                )
            entries.append((pair[0], pair[1]))
        return cls(tuple(entries))

    @property
    def constant(self) -> int | None:
        """The size of every step, or ``None`` when it changes."""
        return self.entries[0][1] if len(self.entries) == 1 else None

    def spec(self) -> int | list[list[int]]:
        """JSON-ready: the int of a constant schedule, else ``[[start_step, size], ...]``."""
        constant = self.constant
        return constant if constant is not None else [[s, n] for s, n in self.entries]

    def _segment(self, step: int) -> tuple[int, int]:
        """The entry that holds ``step`` (an int >= 0), and ``step`` as a Python int."""
        step = integer(step, "step", low=0)
        return bisect.bisect_right(self._starts, step) - 1, step

    def size(self, step: int) -> int:
        """Rows of the global batch at ``step`` (``step >= 0``)."""
        return self.entries[self._segment(step)[0]][1]

    def samples_before(self, step: int) -> int:
        """Global samples in steps ``[0, step)``: O(entries), whatever ``step``."""
        j, step = self._segment(step)
        start, size = self.entries[j]
        return self._before[j] + (step - start) * size

    def step_of(self, sample: int) -> int:
        """The step whose rows hold global sample ``sample`` (``sample >= 0``)."""
        if sample < 0:
            raise ValueError(f"sample must be >= 0, got {sample}")
        j = bisect.bisect_right(self._before, sample) - 1
        start, size = self.entries[j]
        return start + (sample - self._before[j]) // size

    def last_step(self) -> int:
        """The last step whose samples all have indices within ``2**63 - 1``."""
        final = self.step_of(MAX_SAMPLE)
        return final if self.samples_before(final + 1) - 1 <= MAX_SAMPLE else final - 1

    def steps_to_cover(self, num_samples: int) -> int:
        """The fewest steps whose rows hold ``num_samples`` samples (the last may be partial)."""
        return 0 if num_samples <= 0 else self.step_of(num_samples - 1) + 1

    def first_difference(self, other: BatchSchedule, before_step: int) -> int | None:
        """The first step below ``before_step`` whose size differs in ``other``; ``None``
        if the two agree on every step before it."""
        points = sorted({s for s, _ in self.entries} | {s for s, _ in other.entries})
        for step in points:
            if step >= before_step:
                return None
            if self.size(step) != other.size(step):
                return step
        return None

    def continued(self, step: int, then: BatchSchedule) -> BatchSchedule:
        """This schedule's sizes before ``step``, ``then``'s from ``step`` on."""
        kept = [(s, n) for s, n in self.entries if s < step]
        later = [(s, n) for s, n in then.entries if s > step]
        return BatchSchedule.of([*kept, (step, then.size(step)), *later])

    def __str__(self) -> str:
        return str(self.spec())


def resume_differences(
    saved: Any,
    now: BatchSchedule,
    step: int,
    samples: int,
    data_step: int | None = None,
    lane_count: int | None = None,
) -> list[str]:
    """Why a run saved at ``step`` cannot resume with the batch sizes ``now``, as
    lines: ``now`` must agree with ``saved`` (the saved spec) before ``step``'s
    data step, and ``samples`` be what the saved sizes give there. The fix
    suggested keeps the block shuffle's ``lane_count`` (the sizes' gcd)."""
    try:
        before = BatchSchedule.of(saved)
    except ValueError:
        return [f"batch_size: the saved state has no valid batch size: {saved!r}"]
    out = []
    data = step if data_step is None else data_step
    named = f"step {step}" if data == step else f"step {step} (data step {data})"
    at = before.first_difference(now, data)
    if at is not None:
        fix = resumed(before, data, now, lane_count)
        lanes_kept = (
            f" (with shuffle='blocks' the gcd of the batch sizes, the lanes, must stay "
            f"{lane_count})"
            if fix != before.continued(data, now)
            else ""
        )
        out.append(
            f"batch_size: saved {before}, now {now}: step {at} had {before.size(at)} rows, "
            f"now {now.size(at)}; the batch size may change only from the saved {named} "
            f"on: batch_size {fix}{lanes_kept}"
        )
    if samples != before.samples_before(data):
        out.append(
            f"samples: saved {samples!r}, but the {data} steps of batch_size {before} "
            f"hold {before.samples_before(data)}"
        )
    return out


def resumed(
    before: BatchSchedule, step: int, now: BatchSchedule, lane_count: int | None = None
) -> BatchSchedule:
    """The schedule a run saved at ``step`` of ``before`` resumes with, nearest
    ``now``: ``before``'s sizes before ``step``, ``now``'s from it on. With
    ``lane_count`` (the block shuffle's lanes, which the gcd of the sizes
    must keep), each of ``now``'s sizes rounded down to a multiple of it (at
    least one), or ``before`` itself where that still changes the gcd."""
    plain = before.continued(step, now)
    if lane_count is None or lanes(plain.entries) == lane_count:
        return plain
    rounded = BatchSchedule.of(
        [(s, max(lane_count, n // lane_count * lane_count)) for s, n in now.entries]
    )
    kept = before.continued(step, rounded)
    return kept if lanes(kept.entries) == lane_count else before
