"""The grain door: a loader's steps as a ``grain.IterDataset`` (``Loader.to_grain``).

Element ``k`` of the dataset is the step ``start + k`` as host numpy arrays:
this host's rows of it (:meth:`~flat_tokens_jax.Loader.host_rows_at`, all
rows without a sharding), each field of ``config.layout`` ``[rows, seq_len]``,
equal to :meth:`~flat_tokens_jax.Loader.host_batch`. The steps are read ahead
by the loader's own read-ahead (:class:`~flat_tokens_jax.loader.prefetch.Prefetcher`:
its self-sizing depth, its read-ahead budget), only without the placement on
the devices: there is one path from a step to its fields, a grain pipeline
gets the same read-ahead as ``Loader.iterate``, and ``Loader.stats`` counts
the steps it hands out.

The iterator's state is the loader's ``state()`` at its next step, and
``set_state`` is the loader's ``restore``: another seed's or another
dataset's state is refused with ``StateMismatch`` naming the field. grain's
checkpointing (``save``/``load``, orbax's grain handler) writes that state as
JSON.

A step handed out is handed out by the loader, as ``Loader.iterate``'s are:
each step the iterator yields sets the loader's ``next_step`` to the step
after it (``set_state`` sets it too, through ``restore``), so ``state()``
saves the step the iterator yields next, and a ``skip`` or ``set_weights``
at a step it yielded already is refused naming both steps. Each ``iter()``
of the dataset is an iterator of its own from the dataset's first step; the
loader's ``next_step`` follows the iterator that yielded last. A read-ahead
downstream (grain's thread prefetch) takes steps before the trainer does:
they count as handed out, so save the ``get_state()`` of the iterator the
trainer takes from (grain keeps each read-ahead element's state), not
``state()``.

Under ``mp_prefetch`` (``grain.MultiprocessingOptions(num_workers=n)``) a
``Loader``'s dataset pickles as what opens the loader again (:class:`WorkerSteps`:
its sources reopened, its config and steering, this host's rows of each step
as this process works them out, so a worker needs no sharding), and grain's
slice gives worker ``i`` the steps ``start + i``, ``start + i + n``, ...,
each read by the worker's own engine (its ``host_batch``): grain's
round-robin over the workers hands them out in step order. The iterator's
state is grain's, one loader ``state()`` per worker, and restores exactly.
Its steering is fixed when the workers start: the loader refuses a later
``skip`` or ``set_weights``. A ``PhasedLoader``'s dataset stays in this process.
This module imports grain; ``Loader.to_grain`` imports it only when called.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import grain
import numpy as np

from flat_tokens_jax.loader.grainprocess import prepare_grain
from flat_tokens_jax.loader.prefetch import Prefetcher

NO_WORKERS = (
    "a PhasedLoader's grain dataset (to_grain) cannot go to grain's worker processes: "
    "it reads ahead on threads of its own already. Use it without mp_prefetch (.map and "
    "other transformations run in this process), or each phase's Loader(...).to_grain() "
    "under mp_prefetch"
)


class Run(Protocol):
    """A ``Loader``: whose ``state`` and ``restore`` a dataset's iterators go
    through, and, opened again, what a worker process reads steps with."""

    next_step: int

    @property
    def num_batches(self) -> int | None: ...

    def host_batch(self, step: int) -> dict[str, np.ndarray]: ...

    def state(self, step: int | None = None) -> dict[str, Any]: ...

    def restore(self, state: Any) -> int: ...


class Reopenable(Protocol):
    """What opens a loader again in a worker process (picklable)."""

    def open(self) -> Run: ...


class Reader(Protocol):
    """What reads a span's steps: a ``Loader`` (a phase's), by its read-ahead."""

    prefetcher: Prefetcher[Any, Any]

    def _take(self, step: int, ahead: bool, end: int | None, host: bool = False) -> Any: ...

    def _start(self, step: int, end: int | None, host: bool = False) -> None: ...


@dataclasses.dataclass(frozen=True)
class Span:
    """Steps ``[start, stop)`` of a run read by ``loader`` as its steps from 0
    (a phase; the whole run for a ``Loader``, ``stop`` ``None`` without end)."""

    loader: Reader
    start: int
    stop: int | None


@dataclasses.dataclass(frozen=True)
class Reopened:
    """A loader opened again in a grain worker process (``to_grain`` under
    ``mp_prefetch``): its class and sources (they pickle as what reopens
    them), this host's rows of each batch size as the parent worked them out
    under its sharding (the worker needs none), and the parent's ``state()``,
    whose steering it restores."""

    kind: Any
    sources: Any
    rows: dict[int, np.ndarray]
    state: dict[str, Any]

    @classmethod
    def of(cls, loader: Any) -> Reopened:
        """``loader`` as a worker opens it; from now on its steering is fixed,
        since the workers could not follow it."""
        engine = loader.engine
        engine.sent = (
            "a Loader whose steps went to grain's worker processes (to_grain under "
            "mp_prefetch) cannot be steered (skip, set_weights, a restore of other "
            "steering): the workers read with the steering they were sent. Steer it "
            "before iterating, or restore the mp_prefetch iterator with its get_state()"
        )
        rows = {size: engine.host_rows_at(step) for step, size in engine.schedule.entries}
        return cls(type(loader), engine.sources, rows, loader.state())

    def open(self) -> Run:
        loader = self.kind._worker(self.sources, self.rows)
        loader.restore(self.state)
        return loader


class StepsDataset(grain.IterDataset):
    """A run's steps from ``start`` as a ``grain.IterDataset`` of host numpy dicts.

    Made by :meth:`~flat_tokens_jax.Loader.to_grain` and
    :meth:`~flat_tokens_jax.PhasedLoader.to_grain`; see the module's docstring.

    Args:
        owner: whose ``state`` and ``restore`` the iterator's state goes through.
        spans: the run's steps by reader, in order, without gaps from step 0,
            as they are now (a skip moves a phase's first step).
        start: the first step of a fresh iterator.
        lead: steps before a span's end at which the next span starts reading.
        told: an error of a step (``ValueError`` or ``IndexError``) and the
            run's step to the error to raise: one that names the phase.
        workers: whether the dataset may go to grain's worker processes: pickled,
            it is what opens the owner (a ``Loader``) again there (:class:`Reopened`).
    """

    def __init__(
        self,
        owner: Run,
        spans: Callable[[], Sequence[Span]],
        start: int,
        lead: int = 0,
        told: Callable[[ValueError | IndexError, int], Exception] | None = None,
        workers: bool = False,
    ) -> None:
        super().__init__()
        self.owner, self._spans, self.start, self.lead = owner, spans, start, lead
        self.told, self.workers = told, workers
        prepare_grain()

    @property
    def spans(self) -> tuple[Span, ...]:
        """The run's steps by reader, as they are now."""
        return tuple(self._spans())

    def __repr__(self) -> str:
        return f"StepsDataset({self.owner!r}, start={self.start})"

    def __iter__(self) -> StepsIterator:
        return StepsIterator(self)

    def __reduce__(self) -> Any:
        if not self.workers:
            raise TypeError(NO_WORKERS)
        return WorkerSteps, (Reopened.of(self.owner), self.start)


class StepsIterator(grain.DatasetIterator):
    """The steps of a :class:`StepsDataset`; not thread-safe (as grain's iterators)."""

    def __init__(self, dataset: StepsDataset) -> None:
        super().__init__()
        self._ds, self._step = dataset, dataset.start
        self._open: dict[int, Reader] = {}
        self._ended = False

    def _span(self, step: int) -> tuple[int, Span] | None:
        """The span that holds ``step`` (``None`` past the run's end)."""
        for k, span in enumerate(self._ds.spans):
            if span.stop is None or step < span.stop:
                return k, span
        return None

    def _steps(self, k: int) -> Reader:
        """Span ``k``'s loader; the read-ahead of other spans, but the next one, is closed."""
        for j in [j for j in self._open if j not in (k, k + 1)]:
            self._open.pop(j).prefetcher.close()
        self._open.setdefault(k, self._ds.spans[k].loader)
        return self._open[k]

    def __next__(self) -> dict[str, np.ndarray]:
        if self._ended:
            raise ValueError(f"{self} is closed: iterate the dataset again for a new iterator")
        found = self._span(self._step)
        if found is None:
            raise StopIteration
        k, span = found
        local = self._step - span.start
        end = None if span.stop is None else span.stop - span.start
        try:
            fields: dict[str, np.ndarray] = self._steps(k)._take(local, True, end, host=True)
        except (ValueError, IndexError) as e:
            if self._ds.told is None:
                raise
            raise self._ds.told(e, self._step) from None
        if end is not None and k + 1 < len(self._ds.spans) and local + 1 >= end - self._ds.lead:
            self._steps(k + 1)._start(0, _length(self._ds.spans[k + 1]), host=True)
        self._step += 1
        self._ds.owner.next_step = self._step
        return fields

    def start_prefetch(self) -> None:
        """Starts reading the next step and those after it (grain calls it after a
        checkpoint's restore), as ``Loader.start`` does."""
        found = self._span(self._step)
        if found is not None:
            k, span = found
            self._steps(k)._start(self._step - span.start, _length(span), host=True)

    def get_state(self) -> dict[str, Any]:
        """The owner's ``state()`` at the next step this iterator yields (JSON-ready)."""
        return self._ds.owner.state(self._step)

    def set_state(self, state: dict[str, Any]) -> None:
        """Continues from a :meth:`get_state` (or the owner's ``state()``),
        checked by the owner's ``restore``, which it also restores.

        Raises:
            StateMismatch: the state is of other data or another config (see
                :meth:`~flat_tokens_jax.Loader.restore`).
        """
        step = self._ds.owner.restore(state)
        if step != self._step:
            self._close_feeds()
        self._step = step

    def _close_feeds(self, wait: bool = True) -> None:
        while self._open:
            self._open.popitem()[1].prefetcher.close(wait)

    def close(self) -> None:
        """Stops the read-ahead; the iterator yields nothing after it."""
        self._ended = True
        self._close_feeds()

    def __del__(self) -> None:
        # grain's DatasetIterator.__del__ calls close(). A collection can run in
        # any allocation, inside threading's own bookkeeping too (a thread being
        # started holds its shutdown lock), where joining a thread deadlocks: an
        # iterator collected stops its read-ahead without waiting for it.
        self._ended = True
        self._close_feeds(wait=False)

    def __str__(self) -> str:
        return f"StepsIterator(step={self._step})"


def _length(span: Span) -> int | None:
    return None if span.stop is None else span.stop - span.start


class WorkerSteps(grain.IterDataset):
    """A loader's steps in a grain worker process: a :class:`StepsDataset`
    unpickled. Its iterator reads step ``first``, then every ``stride``-th
    step after it (grain's :meth:`set_slice` sets both), with the loader
    ``recipe`` opens."""

    def __init__(self, recipe: Reopenable, start: int) -> None:
        super().__init__()
        self.recipe, self.first, self.stride = recipe, start, 1

    def __repr__(self) -> str:
        return f"WorkerSteps(first={self.first}, stride={self.stride})"

    def set_slice(self, sl: slice, sequential_slice: bool = False) -> None:
        """grain's hook: worker ``i`` of ``n`` (``slice(i, None, n)``) reads
        steps ``start + i``, ``start + i + n``, ..."""
        if sequential_slice or sl.stop is not None or sl.step is None or sl.step < 1:
            raise ValueError(
                f"a loader's steps go to grain's workers in turn, one step each, got {sl} "
                f"(sequential_slice={sequential_slice}): leave mp_prefetch's "
                "sequential_slice False"
            )
        self.first, self.stride = self.first + (sl.start or 0), self.stride * sl.step

    def __iter__(self) -> WorkerIterator:
        return WorkerIterator(self.recipe.open(), self.first, self.stride)


class WorkerIterator(grain.DatasetIterator):
    """Steps ``first``, ``first + stride``, ... of ``loader``, each its
    ``host_batch``; the state is the loader's ``state()`` at the next one."""

    def __init__(self, loader: Run, first: int, stride: int) -> None:
        super().__init__()
        self._loader, self._step, self._stride = loader, first, stride

    def __next__(self) -> dict[str, np.ndarray]:
        end = self._loader.num_batches
        if end is not None and self._step >= end:
            raise StopIteration
        fields = self._loader.host_batch(self._step)
        self._step += self._stride
        return fields

    def get_state(self) -> dict[str, Any]:
        return self._loader.state(self._step)

    def set_state(self, state: dict[str, Any]) -> None:
        self._step = self._loader.restore(state)
