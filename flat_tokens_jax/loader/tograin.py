"""A loader's steps as a ``grain.IterDataset`` of host numpy dicts
(``Loader.to_grain``), read ahead by the loader's own read-ahead; under
``mp_prefetch`` each worker reads its steps with the loader opened again there
(docs/guide/trainers.md). It imports grain: ``Loader.to_grain`` imports it when called.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import grain
import numpy as np

from flat_tokens_jax.loader.grainprocess import prepare_grain
from flat_tokens_jax.loader.state import SavedState


@dataclasses.dataclass(frozen=True)
class Reopened:
    """A loader as a grain worker process opens it again: its class, sources,
    this host's rows of each batch size (the worker needs no sharding), and
    its state, whose steering the worker restores."""

    kind: Any
    sources: Any
    rows: dict[int, np.ndarray]
    state: SavedState

    @classmethod
    def of(cls, loader: Any) -> Reopened:
        """``loader`` as a worker opens it; from now on its steering is fixed."""
        engine = loader.engine
        engine.sent = (
            "a Loader whose steps went to grain's worker processes (to_grain under "
            "mp_prefetch) cannot be steered (skip, set_weights, a restore of other "
            "steering): the workers read with the steering they were sent. Steer it "
            "before iterating, or restore the mp_prefetch iterator with its get_state()"
        )
        rows = {size: engine.host_rows_at(step) for step, size in engine.schedule.entries}
        return cls(type(loader), engine.sources, rows, loader.saved_state())

    def open(self) -> Any:
        loader = self.kind._worker(self.sources, self.rows)
        loader.restore(self.state)
        return loader


class StepsDataset(grain.IterDataset):
    """The steps of ``owner`` (a ``Loader``) from ``start``, as a
    ``grain.IterDataset`` of host numpy dicts (see the module's docstring)."""

    def __init__(self, owner: Any, start: int) -> None:
        super().__init__()
        self.owner, self.start = owner, start
        prepare_grain()

    def __repr__(self) -> str:
        return f"StepsDataset({self.owner!r}, start={self.start})"

    def __iter__(self) -> StepsIterator:
        return StepsIterator(self.owner, self.start)

    @property
    def vocab_size(self) -> int | None:
        """The owner's ``vocab_size``: the size of the tokenizer its data records."""
        return self.owner.vocab_size

    def __reduce__(self) -> Any:
        if not self.owner._to_workers:
            raise TypeError(
                "a PhasedLoader's grain dataset (to_grain) cannot go to grain's worker "
                "processes: it reads ahead on threads of its own already. Use it without "
                "mp_prefetch (.map and other transformations run in this process), or each "
                "phase's Loader(...).to_grain() under mp_prefetch"
            )
        return WorkerSteps, (Reopened.of(self.owner), self.start)


class StepsIterator(grain.DatasetIterator):
    """The steps of a :class:`StepsDataset`; not thread-safe (as grain's iterators)."""

    def __init__(self, owner: Any, step: int) -> None:
        super().__init__()
        self._owner, self._step = owner, step
        self._reading = False  # whether this iterator used the owner's read-ahead
        self._ended = False

    def __next__(self) -> dict[str, np.ndarray]:
        if self._ended:
            raise ValueError(f"{self} is closed: iterate the dataset again for a new iterator")
        owner, end = self._owner, self._owner._end()
        if end is not None and self._step >= end:
            raise StopIteration
        self._reading = True
        fields: dict[str, np.ndarray] = owner._take(self._step, True, end, host=True)
        self._step += 1
        owner.next_step = self._step
        return fields

    def start_prefetch(self) -> None:
        """Starts reading the next step and those after it (grain calls it after a
        checkpoint's restore), as ``Loader.start`` does."""
        end = self._owner._end()
        if end is None or self._step < end:
            self._reading = True
            self._owner._start(self._step, end, host=True)

    def get_state(self) -> dict[str, Any]:
        """The owner's ``state()`` at the next step this iterator yields (JSON-ready)."""
        return self._owner.state(self._step)

    def set_state(self, state: dict[str, Any]) -> None:
        """Continues from a :meth:`get_state` (or the owner's ``state()``),
        checked and restored by the owner's ``restore`` (``StateMismatch``)."""
        step = self._owner.restore(state)
        if step != self._step:
            self._stop_reading()
        self._step = step

    async def load(self, directory: Any) -> Any:
        """grain's orbax v1 hook: reads and sets the saved state before it returns,
        so a ``StateMismatch`` reaches the caller as it is (orbax wraps an error of
        the returned awaitable in its own ``NoEntryError``)."""
        await (await super().load(directory))
        return asyncio.sleep(0)

    @property
    def _parent(self) -> grain.DatasetIterator:
        # grain's asserts one parent; code that walks a pipeline asks hasattr(it, "_parent").
        raise AttributeError("a loader's steps iterator has no parent iterator")

    def _stop_reading(self, wait: bool = True) -> None:
        if self._reading:
            self._reading = False
            self._owner.prefetcher.close(wait)

    def close(self) -> None:
        """Stops the read-ahead; the iterator yields nothing after it."""
        self._ended = True
        self._stop_reading()

    def __del__(self) -> None:
        # grain's DatasetIterator.__del__ calls close(). A collection can run in
        # any allocation, inside threading's own bookkeeping too (a thread being
        # started holds its shutdown lock), where joining a thread deadlocks: an
        # iterator collected stops its read-ahead without waiting for it.
        self._ended = True
        self._stop_reading(wait=False)

    def __str__(self) -> str:
        return f"StepsIterator(step={self._step})"


class WorkerSteps(grain.IterDataset):
    """A :class:`StepsDataset` unpickled in a grain worker: steps ``first``,
    ``first + stride``, ... (set by :meth:`set_slice`) of the loader ``recipe`` opens."""

    def __init__(self, recipe: Reopened, start: int) -> None:
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
    """Steps ``first``, ``first + stride``, ... of ``loader``, each its ``host_batch``."""

    def __init__(self, loader: Any, first: int, stride: int) -> None:
        super().__init__()
        self._loader, self._step, self._stride = loader, first, stride

    def __next__(self) -> dict[str, np.ndarray]:
        end = self._loader.num_batches
        if end is not None and self._step >= end:
            raise StopIteration
        fields: dict[str, np.ndarray] = self._loader.host_batch(self._step)
        self._step += self._stride
        return fields

    def get_state(self) -> dict[str, Any]:
        return self._loader.state(self._step)

    def set_state(self, state: dict[str, Any]) -> None:
        self._step = self._loader.restore(state)
