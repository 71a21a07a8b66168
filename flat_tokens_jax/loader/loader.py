"""``Loader``: a run of one phase (several: :mod:`~flat_tokens_jax.loader.phasedloader`).
A step engine per phase computes a step (:mod:`~flat_tokens_jax.loader.engine`); the
loader reads steps ahead, places them on the devices, steers, saves and restores.
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import jax
import numpy as np

from flat_tokens_jax.core.values import integer
from flat_tokens_jax.data.dataset import FlatTokens
from flat_tokens_jax.data.records import Records, recorded_info, sources_of
from flat_tokens_jax.decoding.sharding import HostBlocks
from flat_tokens_jax.loader.config import LoaderConfig
from flat_tokens_jax.loader.deviceblocks import Blocks
from flat_tokens_jax.loader.engine import Fetched, StepEngine
from flat_tokens_jax.loader.phases import Phase
from flat_tokens_jax.loader.prefetch import Prefetcher
from flat_tokens_jax.loader.sources import Sources
from flat_tokens_jax.loader.state import SavedPhase, SavedState, StateMismatch
from flat_tokens_jax.loader.statefields import state_step
from flat_tokens_jax.loader.steered import check_step, merged, restated, skip_count, weight_counts
from flat_tokens_jax.sampling.mixture import Mixture
from flat_tokens_jax.sampling.skips import Skips
from flat_tokens_jax.sampling.steering import Change, Steering
from flat_tokens_jax.store.identity import recorded_vocab_size

if TYPE_CHECKING:
    from flat_tokens_jax.loader.tograin import StepsDataset

_T = TypeVar("_T")


class Loader:
    """Batches of model fields for any step, with background prefetching.

    Every batch holds ``inputs``, ``targets``, ``segment_ids``, ``positions``
    (``[batch_size, seq_len] int32``) and ``loss_mask`` (``[batch_size, seq_len] bool``;
    multiply the per-token loss by it); with a batch-size schedule ``batch_size`` is the
    step's, :meth:`batch_size_at`. Other arrays with ``config.layout``,
    ``config.max_segments`` and ``config.source_field`` (see :class:`LoaderConfig`).

    Args:
        source: a :class:`FlatTokens` split (records made per ``config.packing``)
            or any :class:`Records` source, e.g. a ``Mixture``.
        config: the batch definition.
        sharding: how the global batch is laid out over devices, e.g. ``NamedSharding(mesh,
            P("data"))``, ``P(("data", "fsdp"))`` or ``P("data", "seq")`` (sequence dimension
            sharded too). Each host then reads only the blocks its own devices hold.
            ``None``: whole batches on the default device.
        plan_cache: where packing plans built for ``packing="bins"`` are cached (splits
            without a stored plan, see ``flat-tokens pack``). ``None``:
            ``$XDG_CACHE_HOME/flat_tokens_jax/plans`` (``~/.cache/...``).

    Attributes:
        engines: ``[K]`` each phase's step engine; ``engine``, ``config``, ``mixture``,
            ``components``, ``names``, ``records``, ``schedule``, ``samplers``,
            ``sampler``, ``steps``, ``layout`` and ``start_token_id`` are the first's.
        source_names: the names a batch's ``source`` indexes (``config.source_field``):
            every phase's components, in the order they first appear (``("0",)`` for one split).
        starts: ``[K]`` each phase's declared first step; ``firsts``: the first step
            that reads each phase's data (its start, unless batches were skipped).
        next_step: the step :meth:`iterate` starts at (set by :meth:`restore`, advanced
            by each step :meth:`iterate` or :meth:`to_grain`'s iterator yields).
        end_step: the first step the run cannot read (a sample index would pass
            ``2**63 - 1``); ``None`` for one phase.
        prefetcher: the run's read-ahead.

    Raises:
        ValueError: the sharding cannot split ``[batch_size, seq_len]`` evenly (for a
            schedule: the first step whose size it cannot split is named), or
            ``vocab_size`` is too small for the data.
    """

    # Whether to_grain's steps go to grain's worker processes (see _worker).
    _to_workers = True

    def __init__(
        self,
        source: FlatTokens | Records | Mixture,
        config: LoaderConfig,
        sharding: jax.sharding.Sharding | None = None,
        *,
        plan_cache: str | os.PathLike[str] | None = None,
    ) -> None:
        sources = Sources.of(source, config, sharding, plan_cache)
        self.phases: tuple[Phase, ...] = (Phase(0, source, config),)
        self.starts, self.firsts = [0], [0]
        self.end_step: int | None = None
        self._open([StepEngine(sources, sharding)], sharding)

    def _open(self, engines: list[StepEngine], sharding: Any) -> None:
        self.engines, self.sharding = engines, sharding
        first = self.engine = engines[0]
        self.source_names = first.source_names
        self.config, self.layout, self.mixture = first.config, first.layout, first.mixture
        self.components, self.names, self.records = first.components, first.names, first.records
        self.start_token_id, self.schedule = first.start_token_id, first.schedule
        self.steps, self.samplers, self.sampler = first.steps, first.samplers, first.sampler
        self._restored: dict[int, int] = {}  # see skip
        # `_host`: read ahead for `to_grain`, decoded on the host.
        found = [getattr(r, "ft", None) for e in engines for r in e.components]
        self._host = False
        self.prefetcher: Prefetcher[Fetched | Blocks, Any] = Prefetcher(
            first.config,
            self._read,
            self._finish,
            lambda s: self.host_rows_at(s).size,
            [ft for ft in found if isinstance(ft, FlatTokens)],
            self.source_names,
        )
        # Step 0's; a schedule's later steps may differ: see host_blocks_at, host_rows_at.
        self.host_blocks, self.host_rows = self.host_blocks_at(0), self.host_rows_at(0)
        self.next_step = 0

    def __repr__(self) -> str:
        return f"Loader({self.records!r}, {self.config!r})"

    def phase_at(self, step: int) -> int:
        """The index of the phase that holds ``step`` (whose data ``step`` reads)."""
        return bisect.bisect_right(self.firsts, integer(step, "step", low=0)) - 1

    def locate(self, step: int) -> tuple[StepEngine, int]:
        """The engine of the phase that holds ``step``, and the step inside it."""
        return self.engine, integer(step, "step", low=0)

    def _in_phase(self, step: int, use: Callable[[StepEngine, int], _T]) -> _T:
        """``use(engine, local step)`` for the phase that holds ``step``, its errors the run's."""
        engine, local = self.locate(step)
        try:
            return use(engine, local)
        except (ValueError, IndexError) as e:
            raise self._told(e, int(step)) from None

    def _told(self, error: ValueError | IndexError, step: int) -> ValueError | IndexError:
        """``error`` of the phase that holds the run's ``step``, told as the run's."""
        return error

    @property
    def wait_seconds(self) -> float:
        """How long the last step :meth:`batch` or :meth:`iterate` handed out waited for it."""
        return self.prefetcher.wait_seconds

    def host_blocks_at(self, step: int) -> HostBlocks | None:
        """The blocks this host reads at ``step`` (``None`` without a sharding)."""
        return self._in_phase(step, StepEngine.host_blocks_at)

    def host_rows_at(self, step: int) -> np.ndarray:
        """``[k] int64`` the global rows this host reads at ``step``, ascending."""
        return self._in_phase(step, StepEngine.host_rows_at)

    def batch_size_at(self, step: int) -> int:
        """Global rows of the batch at ``step`` (of the data step it reads, see :meth:`skip`)."""
        return self._in_phase(step, lambda e, s: e.steps.size(s))

    def samples_before(self, step: int) -> int:
        """Global samples before ``step``'s, the global index of its first sample (with
        skips, those of the data steps before the one it reads: docs/guide/steering.md)."""
        step = integer(step, "step", low=0)
        return self.schedule.samples_before(self.steps.data_step(step))

    @property
    def num_batches(self) -> int | None:
        """Steps in the run (``None`` when ``num_epochs`` is ``None``, or of several phases)."""
        return self.engine.num_batches if len(self.engines) == 1 else None

    def _end(self, stop: int | None = None) -> int | None:
        """The first step not to read: ``stop``, the run's end, the end step (several phases)."""
        ends = [e for e in (stop, self.num_batches, self.end_step) if e is not None]
        return min(ends) if ends else None

    def host_batch(self, step: int) -> dict[str, np.ndarray]:
        """This host's rows of the batch at ``step`` in global row order, as numpy."""
        return self._in_phase(step, StepEngine.host_batch)

    def batch(self, step: int) -> dict[str, jax.Array]:
        """The global batch at ``step`` as ``jax.Array``\\ s ``[batch_size, seq_len]``
        (``batch_size`` the step's). Called with consecutive steps, or at the step given
        to :meth:`start`, it reads the next steps ahead as :meth:`iterate` does."""
        return self._take(integer(step, "step", low=0), False, self._end())

    def start(self, step: int | None = None) -> None:
        """Starts reading ``step`` (default: :attr:`next_step`) and the steps after it in
        the background for the next :meth:`iterate` (or :meth:`batch`), so a trainer can
        start its input before it restores its own checkpoint."""
        step = integer(self.next_step if step is None else step, "Loader.start: step", low=0)
        self.locate(step)
        self._start(step, self._end())

    def encoded_batch(self, step: int) -> dict[str, jax.Array]:
        """The batch at ``step`` still encoded, as global arrays (docs/guide/multihost.md,
        "Decoding on the accelerator"): 4 bytes a token to the devices against 17.
        Decode inside your jitted step: ``fields = loader.decoder(step)(encoded)``."""
        return self._in_phase(step, lambda e, s: e.blocks.encoded(s))

    def decoder(self, step: int = 0) -> Callable[[Mapping[str, jax.Array]], dict[str, jax.Array]]:
        """The function from :meth:`encoded_batch`'s arrays to :meth:`batch`'s, to call
        inside ``jax.jit``; ``step``: any step of the batch size (and phase) in use."""
        return self._in_phase(step, lambda e, s: e.blocks.decoder(s))

    def provenance(self, step: int) -> list[dict[str, Any]]:
        """Where each of this host's rows at ``step`` came from.

        One dict per row: ``row``, ``sample`` (global index, over the run), ``epoch``,
        ``record`` and ``tokens`` (``[start, stop)`` of its targets in the split; for a
        bin, from its first sequence's start to its last one's end, and ``sequences``, the
        indices of the sequences it holds); with several phases, ``phase``; padding rows
        are ``{"row": r, "padding": True}``.
        """
        return self._in_phase(step, StepEngine.provenance)

    def _read(self, step: int, ahead: bool) -> Callable[[], Fetched | Blocks]:
        engine, local = self.locate(step)
        return engine.request(local, engine.lookup if ahead else 0, self._host)

    def _finish(self, step: int, part: Fetched | Blocks, threads: int | None) -> Any:
        engine, local = self.locate(step)
        return engine.finish(part, local, threads, self._host)

    def _on_devices(self, done: Any) -> dict[str, jax.Array]:
        """Finishes a step; decoding across hosts runs collectives, so call it in step order."""
        return done() if callable(done) else done

    def _mode(self, host: bool) -> None:
        """Reads ahead for ``to_grain`` (``host``) or the devices, dropping the other's."""
        if host != self._host:
            self.prefetcher.drop_from(0)
            self._host = host

    def _take(self, step: int, ahead: bool, end: int | None, host: bool = False) -> Any:
        """Step ``step`` handed out from the read-ahead, its filter rejections counted."""
        engine, local = self.locate(step)  # a step past the run's reach is the run's error
        self._mode(host)
        try:
            out = self.prefetcher.take(step, end, ahead, None if host else self._on_devices)
        except (ValueError, IndexError) as e:
            raise self._told(e, step) from None
        if engine.filter.rule is not None:
            engine.filter.handed(local)
        return out

    def _start(self, step: int, end: int | None, host: bool = False) -> None:
        self._mode(host)
        self.prefetcher.start(step, end)

    def iterate(
        self, start_step: int | None = None, stop_step: int | None = None
    ) -> Iterator[tuple[int, dict[str, jax.Array]]]:
        """Yields ``(step, batch)`` from ``start_step`` (default: the restored step)
        to ``stop_step`` (exclusive; default: the run's end, if any), reading
        nothing ahead past ``stop_step``. The next steps are read, decoded and placed
        on device by background threads while the caller trains.
        """
        step = integer(self.next_step if start_step is None else start_step, "start_step", low=0)
        stop = None if stop_step is None else integer(stop_step, "stop_step", low=0)
        try:
            while stop is None or step < stop:
                end = self._end(stop)  # a skip made meanwhile moves the run's end
                if end is not None and step >= end and (end == stop or end != self.end_step):
                    return
                batch = self._take(step, True, end)
                self.next_step = step + 1
                yield step, batch
                step += 1
        finally:
            self.prefetcher.close()

    def stats(self) -> dict[str, Any]:
        """What the input pipeline did so far, JSON-ready, for a trainer to log (each key:
        docs/guide/loading.md, "Where the work runs, and read-ahead")."""
        return {**self.prefetcher.stats(), **self.engine.stats()}

    def to_grain(self) -> StepsDataset:
        """This host's rows of each step from :attr:`next_step` on, read ahead, as a
        ``grain.IterDataset`` of :meth:`host_batch` dicts (see docs/guide/trainers.md)."""
        from flat_tokens_jax.loader import tograin  # imports grain, only when asked

        return tograin.StepsDataset(self, self.next_step)

    @classmethod
    def _worker(cls, sources: Sources, rows: dict[int, np.ndarray]) -> Loader:
        """A grain worker's loader of ``sources``, reading ``rows`` of each batch size."""
        loader = cls.__new__(cls)
        loader.phases = (Phase(0, sources.records, sources.config),)
        loader.starts, loader.firsts, loader.end_step = [0], [0], None
        loader._open([StepEngine(sources, rows=rows)], None)
        return loader

    @property
    def vocab_size(self) -> int | None:
        """The vocabulary size of the tokenizer the data records
        (``DatasetInfo.tokenizer.vocab_size``), over every phase's components; ``None``
        when none records one. Raises ``ValueError`` naming two components (and their
        phases) whose recorded sizes differ."""
        named = [
            (f"phase {k} {n!r}" if len(self.engines) > 1 else repr(n), recorded_info(r))
            for k, e in enumerate(self.engines)
            for n, r in zip(e.names, e.components, strict=True)
        ]
        return recorded_vocab_size(named)

    def fingerprint(self) -> Any:
        """What the batches depend on, which :meth:`restore` checks: ``data`` (the
        data's identity; a Mixture's components and blending), ``config`` (every field
        that changes batches) and ``batch_size``."""
        return self.engine.sources.fingerprint()

    def sources(self, k: int = 0) -> list[dict[str, Any]]:
        """Where each component of phase ``k`` lives (``name``, ``url``, ``split``,
        ``sequences``; ``repr`` for custom records), JSON-ready."""
        return sources_of(self.engines[k].names, self.engines[k].components)

    def saved_state(self, step: int | None = None) -> SavedState:
        """:meth:`state` as a :class:`~flat_tokens_jax.loader.state.SavedState`."""
        step = state_step(step, self.next_step)
        skips, changes = self._steered()
        phases = tuple(
            SavedPhase(start, e.sources.fingerprint(), tuple(self.sources(k)))
            for k, (start, e) in enumerate(zip(self.starts, self.engines, strict=True))
        )
        return SavedState(
            step, self.samples_before(step), phases, len(phases) > 1, skips.entries, changes
        )

    def state(self, step: int | None = None) -> dict[str, Any]:
        """The run's state, JSON-ready (its format: :mod:`~flat_tokens_jax.loader.state`).
        ``step`` is where a :meth:`restore` resumes: by default :attr:`next_step`; a loop
        that asks :meth:`batch` by step passes ``step + 1`` after training ``step``.
        """
        return self.saved_state(step).to_json()

    def state_differences(self, state: Mapping[str, Any]) -> list[str]:
        """What keeps this run from continuing a saved :meth:`state`, as
        ``path: saved X, now Y`` lines (none: it may)."""
        try:
            return self._differences(SavedState.read(state))
        except StateMismatch as e:
            return list(e.lines)

    def _differences(self, saved: SavedState) -> list[str]:
        return saved.differences(self.engine.sources.fingerprint(), self.schedule)

    def restore(self, state: Mapping[str, Any] | SavedState) -> int:
        """Continues from a saved :meth:`state` (or its :meth:`saved_state`); returns
        the step ``iterate`` resumes at. The batch size may change from the saved step
        on; the saved skips and weight changes join this loader's (docs/guide/steering.md).

        Raises:
            StateMismatch: other data or config, other batch sizes before the saved
                step, a field missing, unknown or of the wrong type (each named by its
                path, ``fingerprint.data.sample_digest``), or this loader's changes
                disagree with the saved ones.
        """
        saved = SavedState.of(state, "loader")
        saved.check(self.engine.sources.fingerprint(), self.schedule)
        now = self.steering
        skips, changes = merged(saved, now.skips, now.changes)
        if (skips, changes) != (now.skips, now.changes):
            self.engine.steer(now.steered(skips, changes, 0))
            self.prefetcher.drop_from(0)
        self._restored = dict(skips.entries)
        self.next_step = saved.step
        return saved.step

    def _steered(self) -> tuple[Skips, tuple[Change, ...]]:
        """The run's skips and weight changes, by its trainer steps."""
        steering = self.steering
        return steering.skips, steering.changes

    @property
    def steering(self) -> Steering:
        """The skips (``steering.skips.entries``, ``((step, count), ...)``) and weight
        changes (``steering.changes``, ``((step, counts), ...)``, samples per period)."""
        return self.engine.steps.steering

    def skip(self, step: int, count: int) -> None:
        """From ``step`` on, step ``s`` reads what step ``s + count`` would have read.
        Skips add up, are kept in :meth:`state` and replayed by :meth:`restore` (see
        docs/guide/steering.md, also for a skip restated after a restore).

        Raises:
            ValueError: ``step`` is before :attr:`next_step`, ``count`` is not an int
                >= 1 or takes a step past the largest sample index, or it disagrees
                with a restored skip.
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
        """From ``step`` on, the mixture blends its components by ``weights`` (one per
        component, or ``{name: weight}`` naming every component); kept in :meth:`state`
        and replayed by :meth:`restore` (see docs/guide/steering.md).

        Raises:
            ValueError: ``step`` is before :attr:`next_step`, the loader reads a single
                source, or the mixture refuses the weights.
        """
        step = check_step(step, self.next_step, "Loader.set_weights")
        counts = weight_counts(self.mixture, weights, step, "Loader.set_weights")
        steering = self.steering
        changed = steering.with_change(step, counts)
        if changed is not steering:
            self.engine.steer(changed)
            self.prefetcher.drop_from(step)
