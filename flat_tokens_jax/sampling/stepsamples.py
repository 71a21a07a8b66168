"""Which record each row of a step reads: ``StepSamples``. Global sample ``g =
samples_before(d) + row`` (``d`` the data step read) goes through the mixture, if any, and
a stateless sampler to a record; a sampler call costs about the same for 256 samples as
for 2,048, so steps asked for in order share one call.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import numpy as np

from flat_tokens_jax.core.values import integer
from flat_tokens_jax.sampling.balance import balanced_rows
from flat_tokens_jax.sampling.blocks import BlockSampler, Sampler, sample_of_row
from flat_tokens_jax.sampling.mixture import Mixture
from flat_tokens_jax.sampling.schedule import MAX_SAMPLE, BatchSchedule
from flat_tokens_jax.sampling.steering import Steering

# Steps whose records one sampler call finds when steps are asked for in order.
LOOKUP_AHEAD = 8

# A steering, whether it skips, the run's end (None: unbounded), its last step
# and its samples (None: unbounded).
_Route = tuple[Steering, bool, int | None, int, int | None]

# The balanced orders kept, of the data steps looked up last.
BALANCED_KEPT = 64


class StepSamples:
    """The records of a run's steps, from a sampler per component. Thread-safe.
    ``rows_at(step)``: the global rows this host reads, ``[k] int64``;
    ``num_epochs`` for messages; ``steering``: the trainer's skips and weight
    changes (``None``: none); ``balance``: ``(groups, costs)``, each step's rows
    in :func:`~flat_tokens_jax.sampling.balance.balanced_rows` order of
    ``costs(component, record)`` (``[k] int64`` of real rows; ``None``: in order)."""

    def __init__(
        self,
        samplers: Sequence[Sampler],
        mixture: Mixture | None,
        schedule: BatchSchedule,
        rows_at: Callable[[int], np.ndarray],
        num_epochs: int | None,
        steering: Steering | None = None,
        balance: tuple[int, Callable[[np.ndarray, np.ndarray], np.ndarray]] | None = None,
    ) -> None:
        self.samplers, self.mixture, self.schedule = samplers, mixture, schedule
        self.balance = balance
        first = samplers[0]
        self.lanes = first.lanes if isinstance(first, BlockSampler) else None
        self.rows_at, self.num_epochs = rows_at, num_epochs
        # A constant batch size puts data step d's samples at d * size: no
        # schedule to look up. The samplers may be replaced (a phase's streams
        # go on), never their number of samples.
        self._constant = schedule.constant
        self._lock = threading.Lock()
        self._steer(Steering(mixture, schedule) if steering is None else steering)

    def steer(self, steering: Steering) -> None:
        """Routes with ``steering`` from now on; records found ahead with the
        one before are dropped (a lookup under way keeps none)."""
        with self._lock:
            self._steer(steering)

    def _steer(self, steering: Steering) -> None:
        skips, schedule = steering.skips, self.schedule
        total = self.samplers[0].num_samples
        if self.mixture is not None and self.num_epochs is not None:
            # The run ends where the first component would start another epoch.
            total = steering.first_past([s.num_records * self.num_epochs for s in self.samplers])
        end = None if total is None else skips.trainer_step(schedule.steps_to_cover(total))
        last = skips.trainer_step(schedule.step_of(MAX_SAMPLE)) - 1
        self.steering = steering
        # What a step's samples need of the steering, worked out once and read
        # as one piece without the lock: it, whether it skips (without skips a
        # step reads its own data), the run's end and its last step.
        self._route: _Route = (steering, bool(skips), end, last, total)
        # Records of the steps after the last one found in order: see `records`.
        self._kept: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._last: int | None = None
        self._orders: dict[int, np.ndarray] = {}  # a data step's first sample: its order

    def data_step(self, step: int) -> int:
        """The data step that ``step`` (an int >= 0) reads."""
        step = integer(step, "step", low=0)
        steering, skipping, _, _, _ = self._route
        return steering.data_step(step) if skipping else step

    def size(self, step: int) -> int:
        """Global rows of the batch at ``step``: its data step's."""
        return self.schedule.size(self.data_step(step))

    @property
    def num_batches(self) -> int | None:
        """Steps in the run (``None`` when ``num_epochs`` is ``None``)."""
        return self._route[2]

    def samples(self, step: int, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Global sample index ``[k] int64`` of ``rows`` at ``step`` and which are
        real; an IndexError past the run's end."""
        return self._samples(integer(step, "step", low=0), rows, self._route)

    def _samples(self, step: int, rows: np.ndarray, route: _Route) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`samples` of a step checked before, under ``route``."""
        steering, skipping, end, _, total = route
        data = steering.data_step(step) if skipping else step
        size = self._constant
        if size is None:
            first = self.schedule.samples_before(data)
            size = self.schedule.samples_before(data + 1) - first
        else:
            first = data * size
        last = first + size - 1
        if last > MAX_SAMPLE or (total is not None and first >= total):
            read = "" if data == step else f" (it reads data step {data})"
            if last > MAX_SAMPLE:
                final = self.schedule.last_step()
                shown = steering.skips.trainer_step(final + 1) - 1 if skipping else final
                raise ValueError(
                    f"step {step}{read} is too large: its samples reach index {last}, past "
                    f"the largest sample index 2**63 - 1; with batch_size {self.schedule} "
                    f"the last step is {shown}"
                )
            epochs = f"{self.num_epochs} epoch(s)"
            if self.mixture is None:
                epochs += f" of {self.samplers[0].num_records} records"
            else:
                epochs += ": a mixture ends where a component would begin another"
            raise IndexError(
                f"step {step}{read} is past the end: this run has {end} steps ({epochs})"
            )
        if self.balance is not None:
            rows = self._balanced(first, size, route)[rows]
        if self.lanes is not None:
            rows = sample_of_row(rows, size, self.lanes)
        g = np.int64(first) + rows
        return g, (np.ones(g.shape, bool) if total is None else g < total)

    def _balanced(self, first: int, size: int, route: _Route) -> np.ndarray:
        """The balanced order of the batch of samples ``[first, first + size)``,
        from every row's cost (the same on every host)."""
        order = self._orders.get(first)
        if order is not None:
            return order
        assert self.balance is not None
        groups, costs = self.balance
        g = np.arange(first, first + size, dtype=np.int64)
        total = route[4]
        real = g < total if total is not None else np.ones(size, bool)
        comp, records, _ = self.lookup(g[real], route[0])
        cost = np.zeros(size, np.int64)
        cost[real] = costs(comp, records)
        order = balanced_rows(cost, groups)
        order.setflags(write=False)
        with self._lock:
            if self._route is route:  # else steered meanwhile: not kept
                if len(self._orders) >= BALANCED_KEPT:
                    del self._orders[next(iter(self._orders))]
                self._orders[first] = order
        return order

    def lookup(
        self, g: np.ndarray, steering: Steering | None = None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(component, record, epoch)`` ``[k] int64`` of global samples ``g``
        (routed by ``steering``; ``None``: the current one)."""
        if self.mixture is None:
            zeros = np.zeros(g.shape, np.int64)
            return zeros, self.samplers[0].records(g), self.samplers[0].epochs(g)
        comp, sample = (steering or self.steering).route(g)
        record, epoch = np.empty_like(sample), np.empty_like(sample)
        for c in np.unique(comp).tolist():
            here = comp == c
            record[here] = self.samplers[c].records(sample[here])
            epoch[here] = self.samplers[c].epochs(sample[here])
        return comp, record, epoch

    def records(
        self, step: int, rows: np.ndarray, ahead: int = 0
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(component, record)`` ``[k] int64`` of the real rows among ``rows``
        (this host's rows at ``step``, a step checked before), and which rows
        are real (``[k] bool``).

        With ``ahead > 0``, or when ``step`` follows the last step asked for,
        the records of the next steps (``ahead``, at least ``LOOKUP_AHEAD``)
        come from the same sampler call and are kept for them.
        """
        with self._lock:
            route = self._route
            hit = self._kept.pop(step, None)
            if hit is None and self._last is not None and step == self._last + 1:
                ahead = max(ahead, LOOKUP_AHEAD)
            self._last = step
        # A change made meanwhile leaves the steps before it as they were, and
        # drops the later ones read ahead: only what is kept must not be stale.
        g, real = self._samples(step, rows, route)
        if hit is not None:
            return (*hit, real)
        if not ahead:
            comp, records, _ = self.lookup(g[real])
            return comp, records, real
        # Up to `ahead` steps after it, before the run's end and the largest sample index.
        _, _, end, last, _ = route
        stop = step + 1 + ahead if end is None else min(step + 1 + ahead, end)
        later = range(step + 1, min(stop, last + 1))
        samples = [g[real]]
        for s in later:
            g_s, real_s = self._samples(s, self.rows_at(s), route)
            samples.append(g_s[real_s])
        comp, records, _ = self.lookup(np.concatenate(samples))
        cuts = np.cumsum([x.size for x in samples])[:-1]
        found = list(zip(np.split(comp, cuts), np.split(records, cuts), strict=True))
        with self._lock:
            if self._route is route:  # else steered meanwhile: these may be stale
                self._kept = dict(zip(later, found[1:], strict=True))
        return (*found[0], real)
