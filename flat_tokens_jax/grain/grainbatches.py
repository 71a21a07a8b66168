"""Whole steps as grain elements: ``Batches`` (shuffled batches of one size)
and ``ScheduledBatches`` (a batch-size schedule's steps of any order).

``FlatTokensSource.batches(...)`` builds a ``Batches``. A grain pipeline that batches
records one at a time (``MapDataset.source(src).shuffle(seed).batch(B)``)
reads and decodes every record on its own; a ``Batches`` element is one
batched read of a whole step, decoded in row blocks on several threads, in
``Loader``'s order (same sampler, same seed), so a grain pipeline and a
``Loader`` agree row for row.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Sequence
from typing import Any, Protocol, SupportsIndex

import numpy as np

from flat_tokens_jax.core.limits import check_loader_memory
from flat_tokens_jax.core.values import integer
from flat_tokens_jax.decoding.layouts import BatchLayout
from flat_tokens_jax.sampling.blocks import BlockSampler, Sampler
from flat_tokens_jax.sampling.mixture import Mixture
from flat_tokens_jax.sampling.schedule import BatchSchedule, BatchSizeSpec
from flat_tokens_jax.sampling.stepsamples import MAX_SAMPLE, StepSamples


class BatchReader(Protocol):
    """What ``Batches`` and ``ScheduledBatches`` read from (a ``FlatTokensSource``)."""

    seq_len: int
    layout: BatchLayout

    @property
    def mixture(self) -> Mixture | None: ...

    def __len__(self) -> int: ...

    def read_batch(self, indices: Sequence[int] | np.ndarray) -> dict[str, np.ndarray]: ...

    def read_rows(
        self,
        comp: np.ndarray,
        records: np.ndarray,
        real: np.ndarray,
        where: str,
        rows: np.ndarray | None = None,
    ) -> dict[str, np.ndarray]: ...


class Batches:
    """A grain random-access source of whole batches (see :meth:`FlatTokensSource.batches`).

    Element ``step``: the layout's fields, each ``[rows, seq_len]``, of this
    shard's rows of global step ``step``, ``rows`` the step's batch size over
    the shard count. Which record each row reads is the loader's
    :class:`~flat_tokens_jax.sampling.stepsamples.StepSamples` (the mixture's
    routing, the samplers, the batch-size schedule); rows past the last
    epoch are padding. Contract: deterministic, thread-safe, picklable (as
    its source).

    Args:
        source: the records.
        batch_size: an int or a schedule ``[(start_step, size), ...]``.
        samplers: one per component of ``source`` (one without a mixture).
        shard: ``(index, count)``.
    """

    def __init__(
        self,
        source: BatchReader,
        batch_size: BatchSizeSpec,
        samplers: Sequence[Sampler],
        *,
        shard: tuple[int, int] = (0, 1),
    ) -> None:
        schedule = BatchSchedule.of(batch_size)
        index, count = _shard(shard)
        for start, size in schedule.entries:
            if size % count:
                at = "" if start == 0 else f" (from step {start})"
                raise ValueError(
                    f"batch_size {size}{at} does not divide over {count} shards: "
                    f"choose a multiple of {count}"
                )
        largest = max(size for _, size in schedule.entries)
        check_loader_memory(largest, source.seq_len, 0, count, row_bytes=source.layout.row_bytes)
        self.source, self.schedule, self.shard = source, schedule, (index, count)
        self.samplers = list(samplers)
        self.sampler = self.samplers[0]
        self._steps = self._step_samples()
        total = self._steps.num_batches
        self._length = self.schedule.step_of(MAX_SAMPLE) if total is None else total

    def _step_samples(self) -> StepSamples:
        num_epochs = self.sampler.num_epochs
        mixture = self.source.mixture
        return StepSamples(self.samplers, mixture, self.schedule, self.rows_at, num_epochs)

    def rows_at(self, step: int) -> np.ndarray:
        """``[k] int64`` the global rows of this shard at ``step``."""
        index, count = self.shard
        rows = self.schedule.size(step) // count
        return np.arange(index * rows, (index + 1) * rows, dtype=np.int64)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["_steps"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._steps = self._step_samples()

    def __repr__(self) -> str:
        s = self.sampler
        blocks = ""
        if isinstance(s, BlockSampler):
            blocks = f", shuffle_block={s.block}, shuffle_window={s.window}"
        return (
            f"Batches({self.source!r}, batch_size={self.schedule}, seed={s.seed}, "
            f"shuffle={s.shuffle!r}{blocks}, num_epochs={s.num_epochs}, shard={self.shard})"
        )

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, step: SupportsIndex) -> dict[str, np.ndarray]:
        """This shard's rows of ``step``: the layout's fields, each ``[rows, seq_len]``."""
        index = integer(step, "Batches step")
        if not 0 <= index < self._length:
            raise IndexError(f"{self!r}: step {index} is outside [0, {self._length})")
        rows = self.rows_at(index)
        comp, records, real = self._steps.records(index, rows)
        return self.source.read_rows(comp, records, real, f"step {index}", rows)


class ScheduledBatches:
    """A grain random-access source whose element ``step`` is the batch of that step.

    Element ``step`` holds positions ``[samples_before(step),
    samples_before(step + 1))`` of ``order`` (a batch-size schedule's cut,
    as in :class:`~flat_tokens_jax.LoaderConfig`), read from ``source`` in one
    batched read: the five fields, each ``[batch_size_at(step), seq_len]``.
    The last step holds what is left of ``order``, so it may be shorter.

    Contract: deterministic, thread-safe and picklable when ``source`` and
    ``order`` are.

    Args:
        source: the records.
        batch_size: an int or a schedule ``[(start_step, size), ...]``.
        order: record indices in the order to train on, any random-access
            sequence (``len`` and integer indexing), e.g. a
            ``grain.MapDataset`` of indices; ``None``: ``range(len(source))``.

    Example:
        >>> import flat_tokens_jax as ftj
        >>> from flat_tokens_jax.grain import FlatTokensSource
        >>> url = "memory://doc/scheduled"
        >>> ftj.write_dataset(url, {"train": [[1, 2, 3, 4, 5, 6, 7, 8, 9]]}, overwrite=True)
        >>> batches = ScheduledBatches(FlatTokensSource(url, seq_len=2), [(0, 1), (2, 2)])
        >>> len(batches), [batches[s]["targets"].tolist() for s in range(len(batches))]
        (3, [[[1, 2]], [[3, 4]], [[5, 6], [7, 8]]])
    """

    def __init__(
        self,
        source: BatchReader,
        batch_size: BatchSizeSpec | BatchSchedule,
        order: Sequence[int] | None = None,
    ) -> None:
        if not all(hasattr(source, a) for a in ("read_batch", "seq_len", "layout", "__len__")):
            raise TypeError(
                f"ScheduledBatches reads a FlatTokensSource, got {type(source).__name__}"
            )
        self.source, self.schedule = source, BatchSchedule.of(batch_size)
        largest = max(size for _, size in self.schedule.entries)
        check_loader_memory(largest, source.seq_len, 0, 1, row_bytes=source.layout.row_bytes)
        self.order = order
        self._num_samples = len(source) if order is None else len(order)
        self._length = self.schedule.steps_to_cover(self._num_samples)

    def __repr__(self) -> str:
        order = "in order" if self.order is None else repr(self.order)
        return f"ScheduledBatches({self.source!r}, batch_size={self.schedule}, order={order})"

    def __len__(self) -> int:
        return self._length

    def positions(self, step: int) -> range:
        """The positions of ``order`` that step ``step`` holds."""
        first = self.schedule.samples_before(step)
        return range(first, min(self.schedule.samples_before(step + 1), self._num_samples))

    def __getitem__(self, step: SupportsIndex) -> dict[str, np.ndarray]:
        """The batch of ``step``: five fields, each ``[rows, seq_len]``."""
        index = integer(step, "ScheduledBatches step")
        if not 0 <= index < self._length:
            raise IndexError(f"{self!r}: step {index} is outside [0, {self._length})")
        where = self.positions(index)
        if self.order is None:
            records = np.arange(where.start, where.stop, dtype=np.int64)
        else:
            records = _record_indices(self.order, where)
        return self.source.read_batch(records)


def _record_indices(order: Sequence[int], where: range) -> np.ndarray:
    """``[len(where)] int64`` entries ``where`` of ``order``, each an int: a
    float or a bool in the order is refused naming its position, not truncated."""
    raw = [order[i] for i in where]
    if all(t is int or issubclass(t, np.integer) for t in set(map(type, raw))):
        with contextlib.suppress(OverflowError):  # named below
            return np.array(raw, np.int64)
    for i, value in zip(where, raw, strict=True):
        if not -(2**63) <= integer(value, f"ScheduledBatches order[{i}]") < 2**63:
            raise IndexError(f"ScheduledBatches order[{i}] is {value}, not a record index")
    return np.array(raw, np.int64)


def _shard(shard: tuple[int, int]) -> tuple[int, int]:
    try:
        index, count = (operator.index(v) for v in shard)
    except (TypeError, ValueError):
        raise ValueError(
            f"shard must be (index, count), e.g. (jax.process_index(), jax.process_count()), "
            f"got {shard!r}"
        ) from None
    if not 0 <= index < count:
        raise ValueError(f"shard {shard!r}: need 0 <= index < count")
    return index, count
