"""What a trainer calls to steer a :class:`~flat_tokens_jax.loader.loader.Loader`
while it trains: ``skip`` and ``set_weights`` (the arithmetic is
:mod:`~flat_tokens_jax.sampling.steering`'s; the checks, the saved lists and
their merge on restore :mod:`~flat_tokens_jax.loader.steered`'s)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from flat_tokens_jax.loader.engine import StepEngine
from flat_tokens_jax.loader.prefetch import Prefetcher
from flat_tokens_jax.loader.steered import check_step, restated, skip_count, weight_counts
from flat_tokens_jax.sampling.blocks import Sampler
from flat_tokens_jax.sampling.mixture import Mixture
from flat_tokens_jax.sampling.schedule import BatchSchedule
from flat_tokens_jax.sampling.skips import Skips
from flat_tokens_jax.sampling.steering import Change, Steering


class Steerable:
    """``Loader``'s steering: skipped batches and weight changes from a step on."""

    engine: StepEngine
    prefetcher: Prefetcher[Any, Any]
    mixture: Mixture | None
    next_step: int
    sampler: Sampler
    schedule: BatchSchedule
    # The skips the last restore continued with that no skip() restated yet.
    _restored: dict[int, int]

    def skip(self, step: int, count: int) -> None:
        """From ``step`` on, step ``s`` reads what step ``s + count`` would have read
        (with the skips before: what its data step plus ``count`` would have read).

        Skips add up (two at one step, or at several steps); each is kept in
        :meth:`state` and replayed by :meth:`restore`. After a restore, the first skip
        at a step the restored loader skips at restates that skip: the same count
        changes nothing (set-up code run again after a restart is harmless), another
        is refused. Steps read ahead at or after ``step`` are dropped and read again.
        O(log n) amortized for ``n`` changes, at or after the last one.

        Raises:
            ValueError: ``step`` is before :attr:`next_step`, ``count`` is not an int
                >= 1, it takes a step past the largest sample index (naming the
                largest count that fits), or it disagrees with a restored skip.
        """
        if restated(self._restored, step, count, self.next_step, "Loader.skip"):
            return
        step = check_step(step, self.next_step, "Loader.skip")
        steering = self.steering
        last = self.schedule.last_step()
        count = skip_count(count, "Loader.skip: count", steering.skips, step, last)
        self.engine.steer(steering.with_skip(step, count))
        self.prefetcher.drop_from(step)

    def set_weights(self, step: int, weights: Sequence[float] | Mapping[str, float]) -> None:
        """From ``step`` on, the mixture blends its components by ``weights``
        (one per component, or ``{name: weight}`` naming every component).

        The change starts a weight segment at the data step ``step`` reads, over the
        mixture's ``period`` (or the default period of these weights); a change of the
        mixture's declared schedule at a later step still applies from there. Each
        component's stream continues where it was. A second change at the same step
        replaces the first. Kept in :meth:`state` (as the samples per period the weights
        round to) and replayed by :meth:`restore`; steps read ahead at or after ``step``
        are dropped and read again. O(log n) amortized for ``n`` changes, at or after
        the last one.

        Raises:
            ValueError: ``step`` is before :attr:`next_step`, the loader reads a single
                source, or the mixture refuses the weights (as it refuses its own).
        """
        step = check_step(step, self.next_step, "Loader.set_weights")
        counts = weight_counts(self.mixture, weights, step, "Loader.set_weights")
        steering = self.steering
        changed = steering.with_change(step, counts)
        if changed is not steering:
            self.engine.steer(changed)
            self.prefetcher.drop_from(step)

    def _steer(self, skips: Skips, changes: tuple[Change, ...], since: int) -> None:
        """Reads with these skips and weight changes, which differ from now's from ``since`` on."""
        now = self.steering
        if (skips, changes) != (now.skips, now.changes):
            self.engine.steer(now.steered(skips, changes, since))
            self.prefetcher.drop_from(since)

    def _restream(self, streams: Sequence[tuple[int, int]]) -> None:
        """Continues component ``c``'s stream at ``streams[c]``, its ``(seed,
        offset)`` (a phase, after the earlier phases' weights changed)."""
        self.engine.restream(streams)
        self.prefetcher.drop_from(0)
        self.sampler = self.engine.sampler

    @property
    def steering(self) -> Steering:
        """The skips (``steering.skips.entries``, ``((step, count), ...)``) and weight
        changes (``steering.changes``, ``((step, counts), ...)``: from ``step`` on,
        ``counts[c]`` samples of component ``c`` per period of ``sum(counts)``) that
        this loader reads with (see :meth:`skip` and :meth:`set_weights`)."""
        return self.engine.steps.steering
