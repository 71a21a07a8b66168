"""Batches from any step: ``Loader``, a run of one phase or several
(``PhasedLoader``); its ``LoaderConfig`` is in :mod:`~flat_tokens_jax.loader.config`.

``Loader.batch(step)`` is a pure function of (data, config, step): global
sample ``g = samples_before(step) + row`` (``step * batch_size + row`` for a
constant batch size, see :mod:`~flat_tokens_jax.sampling.schedule`) goes through the
stateless sampler to a record, the record's tokens are read, and the model
fields are decoded. A step engine per phase (:mod:`~flat_tokens_jax.loader.engine`)
does all of that for the steps of its phase; ``Loader`` finds a step's phase, reads
steps ahead (:mod:`~flat_tokens_jax.loader.prefetch`), makes global
``jax.Array``\\ s of them, and saves and restores where a run is.

A run of several phases (see :mod:`~flat_tokens_jax.loader.phases`): step
``s`` of the run is step ``s - first`` of the phase that holds it, and each
phase's engine reads its components through samplers that continue every
stream where the earlier phases left it. One phase is a plain ``Loader``: the
same batches and the same ``state()``.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import jax
import numpy as np

from flat_tokens_jax.core.values import integer
from flat_tokens_jax.data.dataset import FlatTokens
from flat_tokens_jax.data.records import Records, sources_of
from flat_tokens_jax.decoding.sharding import HostBlocks
from flat_tokens_jax.loader.config import LoaderConfig
from flat_tokens_jax.loader.deviceblocks import Blocks
from flat_tokens_jax.loader.engine import Fetched, StepEngine
from flat_tokens_jax.loader.phases import Phase, PhaseStreams, check_phases, drawn, stream_key
from flat_tokens_jax.loader.prefetch import Prefetcher
from flat_tokens_jax.loader.resume import check_resume, differences, state_differences
from flat_tokens_jax.loader.sources import Sources
from flat_tokens_jax.loader.state import (
    SavedState,
    StateMismatch,
    read_state,
    restorable,
    state_problems,
    state_step,
)
from flat_tokens_jax.loader.steered import (
    check_step,
    merged,
    restated,
    skip_count,
    state_fields,
    weight_counts,
    with_weights,
)
from flat_tokens_jax.sampling.mixture import Mixture
from flat_tokens_jax.sampling.skips import NO_SKIPS, Skips
from flat_tokens_jax.sampling.steering import Change, Steering

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
        engines: ``[K]`` each phase's step engine (one for a plain run); ``engine``,
            ``config``, ``mixture``, ``components``, ``names``, ``records``,
            ``schedule``, ``samplers``, ``sampler``, ``steps``, ``layout`` and
            ``start_token_id`` are the first phase's (the only one of a plain run).
        source_names: the names of the sources a batch's ``source`` counts
            (``config.source_field``): the components of every phase, by name, in
            the order they first appear (``("0",)`` for one split).
        starts: ``[K]`` each phase's declared first step; ``firsts``: the first step
            that reads each phase's data (its start, unless batches were skipped).
        next_step: the step :meth:`iterate` starts at (set by :meth:`restore`; each
            step :meth:`iterate` or :meth:`to_grain`'s iterator yields advances it).
        end_step: the first step the run cannot read (a sample index would pass
            ``2**63 - 1``); ``None`` for one phase, whose steps say so themselves.
        prefetcher: the run's read-ahead.

    Raises:
        ValueError: the sharding cannot split ``[batch_size, seq_len]`` evenly (for a
            schedule: the first step whose size it cannot split is named), or
            ``vocab_size`` is too small for the data.
    """

    def __init__(
        self,
        source: FlatTokens | Records | Mixture,
        config: LoaderConfig,
        sharding: jax.sharding.Sharding | None = None,
        *,
        plan_cache: str | os.PathLike[str] | None = None,
    ) -> None:
        sources = Sources.of(source, config, sharding, plan_cache)
        self.phases = (Phase(0, source, config),)
        self.starts, self.firsts, self.end_step = [0], [0], None
        self._open([StepEngine(sources, sharding)], sharding)

    def _open(self, engines: list[StepEngine], sharding: Any) -> None:
        """The run of ``engines``, one a phase (:attr:`phases`, :attr:`starts`,
        :attr:`firsts` and :attr:`end_step` set before)."""
        self.engines, self.sharding = engines, sharding
        first = self.engine = engines[0]
        self.source_names = first.source_names
        self.config, self.layout, self.mixture = first.config, first.layout, first.mixture
        self.components, self.names, self.records = first.components, first.names, first.records
        self.start_token_id, self.schedule, self.steps = (
            first.start_token_id,
            first.schedule,
            first.steps,
        )
        self.samplers, self.sampler = first.samplers, first.sampler
        self._restored: dict[int, int] = {}  # see skip
        # Steps read ahead, for `iterate`, `start`, consecutive `batch` calls and
        # `to_grain` (which takes them decoded on the host: `_host`).
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

    # -- which phase a step reads (one here; see PhasedLoader)

    def phase_at(self, step: int) -> int:
        """The index of the phase that holds ``step`` (whose data ``step`` reads)."""
        integer(step, "step", low=0)
        return 0

    def locate(self, step: int) -> tuple[StepEngine, int]:
        """The engine of the phase that holds ``step``, and the step inside that phase.

        Raises:
            ValueError: ``step`` is not an int >= 0.
        """
        return self.engine, integer(step, "step", low=0)

    def _in_phase(self, step: int, use: Callable[[StepEngine, int], _T]) -> _T:
        """``use(engine, local step)`` for the phase that holds ``step``; with
        several phases, an error it raises names the run's step and the phase."""
        engine, local = self.locate(step)
        try:
            return use(engine, local)
        except (ValueError, IndexError) as e:
            raise self._told(e, int(step)) from None

    def _told(self, error: ValueError | IndexError, step: int) -> ValueError | IndexError:
        """``error`` of the phase that holds the run's ``step``, told as the run's."""
        return error

    # -- a step's rows and batches

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
        """Global rows of the batch at ``step``: ``config.batch_size_at`` of the data
        step it reads (``step`` itself unless batches were skipped, see :meth:`skip`)."""
        return self._in_phase(step, lambda e, s: e.steps.size(s))

    def samples_before(self, step: int) -> int:
        """Global samples before ``step``'s (the global index of its first sample):
        ``step * batch_size`` for a constant batch size; with skips, those of the data
        steps before the one it reads, skipped batches included; over the run's phases."""
        step = integer(step, "step", low=0)
        return self.schedule.samples_before(self.steps.data_step(step))

    @property
    def num_batches(self) -> int | None:
        """Steps in the run (``None`` when ``num_epochs`` is ``None``; for several
        phases, see :class:`PhasedLoader`)."""
        return self.engine.num_batches

    def _end(self, stop: int | None = None) -> int | None:
        """The first step not to read: ``stop``, the run's end, the end step (several phases)."""
        ends = [e for e in (stop, self.num_batches, self.end_step) if e is not None]
        return min(ends) if ends else None

    def host_batch(self, step: int) -> dict[str, np.ndarray]:
        """This host's rows of the batch at ``step``, whole, in global row order
        (numpy): the fields of ``config.layout``."""
        return self._in_phase(step, StepEngine.host_batch)

    def batch(self, step: int) -> dict[str, jax.Array]:
        """The global batch at ``step`` as ``jax.Array``\\ s ``[batch_size, seq_len]``
        (``batch_size`` the step's).

        Called with consecutive steps (a loop that asks by step), or at the step given to
        :meth:`start`, it reads the next steps ahead in background threads, as
        :meth:`iterate` does; another step drops what was read ahead. The batches are the
        same either way.
        """
        step = integer(step, "step", low=0)
        try:
            return self._take(step, False, self._end())
        except (ValueError, IndexError) as e:
            raise self._told(e, step) from None

    def start(self, step: int | None = None) -> None:
        """Starts reading ``step`` (default: :attr:`next_step`, e.g. after
        :meth:`restore`) and the steps after it in the background, and returns.

        The next :meth:`iterate` from ``step`` (or :meth:`batch` at ``step``) takes them,
        so a trainer can start its input before it restores its own checkpoint. Calling
        it again at the same step changes nothing; iterating or asking for another step
        drops these reads. With ``prefetch=0`` it reads nothing.
        """
        step = integer(self.next_step if step is None else step, "Loader.start: step", low=0)
        self.locate(step)
        self._start(step, self._end())

    def encoded_batch(self, step: int) -> dict[str, jax.Array]:
        """The batch at ``step`` still encoded, as global arrays, for :meth:`decoder`.

        Host-to-device traffic is 4 bytes a token (plus 1 for a stored loss mask), against
        17 for the decoded fields. Decode inside your jitted step: ``fields =
        loader.decoder(step)(encoded)``.

        Returns:
            ``encoded`` ``[batch_size, seq_len] uint32`` (encoded tokens), ``before``
            ``[batch_size, column shards] uint32`` (the token before each column shard),
            ``lengths`` ``[batch_size] int32`` (tokens of padded rows and bins), ``real``
            ``[batch_size] bool`` (False for padding rows past the last epoch),
            ``stored_mask`` ``[batch_size, seq_len] uint8`` when the data stores a loss
            mask, and ``source`` ``[batch_size] int32`` with ``config.source_field``.
            Laid out as the loader's sharding (whole rows on one device without one).
        """
        return self._in_phase(step, lambda e, s: e.blocks.encoded(s))

    def decoder(self, step: int = 0) -> Callable[[Mapping[str, jax.Array]], dict[str, jax.Array]]:
        """The function from :meth:`encoded_batch`'s arrays to the fields of
        ``config.layout`` (the values :meth:`batch` returns), to call inside ``jax.jit``.

        ``step`` matters only with a batch-size schedule whose sizes lay out differently
        over the mesh, or phases: pass any step of the size in use.
        """
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

    # -- reading ahead

    def _read(self, step: int, ahead: bool) -> Callable[[], Fetched | Blocks]:
        """A step's first stage (see :meth:`StepEngine.request`); ``ahead``: on a
        read-ahead thread, looking up the next steps' records with it."""
        engine, local = self.locate(step)
        return engine.request(local, engine.lookup if ahead else 0, self._host)

    def _finish(self, step: int, part: Fetched | Blocks, ahead: bool) -> Any:
        """A step's second stage: its fields decoded (on the read-ahead's threads
        when ``ahead``) and, unless for ``to_grain``, placed on the devices;
        blocks are decoded on the devices by :meth:`_on_devices`. Everything of
        it involves no collective: safe in any thread."""
        engine, local = self.locate(step)
        if isinstance(part, Blocks):
            return functools.partial(engine.blocks.decode, part)
        fields = engine.fields(part, local, engine.ahead_threads if ahead else None)
        if self._host:
            return fields
        held = engine.host_blocks_at(local)
        return jax.device_put(fields) if held is None else held.assemble_rows(fields)

    def _on_devices(self, done: Any) -> dict[str, jax.Array]:
        """Finishes a step; decoding across hosts runs collectives, so call it in step order."""
        return done() if callable(done) else done

    def _mode(self, host: bool) -> None:
        """Reads ahead for ``to_grain`` (host numpy) or for the devices; a
        change drops what was read for the other."""
        if host != self._host:
            self.prefetcher.drop_from(0)
            self._host = host

    def _take(self, step: int, ahead: bool, end: int | None, host: bool = False) -> Any:
        """Step ``step`` handed out, from the read-ahead (see
        :meth:`Prefetcher.take`); the instance filter's rejections in it counted."""
        self._mode(host)
        out = self.prefetcher.take(step, end, ahead, None if host else self._on_devices)
        engine, local = self.locate(step)
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
        nothing ahead past ``stop_step``; across phases as within one.

        The next steps (``config.prefetch``, or as many as the measured times ask for, see
        :class:`LoaderConfig`) are read, decoded and placed on device by background threads
        while the caller trains (work that needs collectives across hosts is dispatched
        here, in step order); steps begun by :meth:`start` are used. ``wait_seconds`` holds
        how long the last step waited for its batch: near zero when input keeps up; see
        :meth:`stats` for more.
        """
        step = integer(self.next_step if start_step is None else start_step, "start_step", low=0)
        stop = None if stop_step is None else integer(stop_step, "stop_step", low=0)
        try:
            while stop is None or step < stop:
                end = self._end(stop)  # a skip made meanwhile moves the run's end
                if end is not None and step >= end and (end == stop or end != self.end_step):
                    return
                try:
                    batch = self._take(step, True, end)
                except (ValueError, IndexError) as e:
                    raise self._told(e, step) from None
                self.next_step = step + 1
                yield step, batch
                step += 1
        finally:
            self.prefetcher.close()

    def stats(self) -> dict[str, Any]:
        """What the input pipeline did so far, JSON-ready, for a trainer to log: the
        trainer's waits, the fetch and decode times, the read-ahead's depth and bytes,
        requests and bytes read, requests refused as throttled, tokens (by source too)
        and the instance filter's rejections (with several phases, of the phase of the
        last step handed out, ``phase``); each key is described in
        docs/guide/loading.md, "Where the work runs, and read-ahead"."""
        return {**self.prefetcher.stats(), **self.engine.stats()}

    def to_grain(self) -> StepsDataset:
        """This host's rows of each step from :attr:`next_step` on, read ahead, as a
        ``grain.IterDataset`` of :meth:`host_batch` dicts; each step its iterator yields
        advances :attr:`next_step` as :meth:`iterate` does, and its state is :meth:`state`,
        checked by :meth:`restore` (see :mod:`~flat_tokens_jax.loader.tograin`)."""
        from flat_tokens_jax.loader import tograin  # imports grain, only when asked

        def spans() -> list[tograin.Span]:
            return [tograin.Span(self, 0, self._end())]

        return tograin.StepsDataset(self, spans, self.next_step, 0, self._told, self._recipe())

    def _recipe(self) -> Callable[[], Reopened] | None:
        """What opens this run again in a grain worker process, when one can."""
        return self._reopened

    def _reopened(self) -> Reopened:
        """What opens this loader again in a grain worker process; from now
        on its steering is fixed, since the workers could not follow it."""
        engine = self.engine
        engine.sent = (
            "a Loader whose steps went to grain's worker processes (to_grain under "
            "mp_prefetch) cannot be steered (skip, set_weights, a restore of other "
            "steering): the workers read with the steering they were sent. Steer it "
            "before iterating, or restore the mp_prefetch iterator with its get_state()"
        )
        rows = {size: engine.host_rows_at(step) for step, size in self.schedule.entries}
        return Reopened(engine.sources, rows, self.state())

    # -- what a saved state holds

    def fingerprint(self) -> Any:
        """What the batches depend on: the data's identity and the batch-defining config;
        with several phases, each phase's ``{"start_step", "fingerprint"}``.

        ``data`` and ``config`` decide the sample order: ``data`` the records' counts, a
        digest of sampled tokens, whether a loss mask is stored and the vocabulary hash of
        the tokenizer the data records, and for a Mixture the components' names and the
        blending; ``config`` every other field that changes batches, with
        ``start_token_id`` resolved (see :class:`LoaderConfig`). ``batch_size`` (an int or
        ``[[start_step, size], ...]``) decides only how that order is cut into batches.
        """
        return self.engine.sources.fingerprint()

    def sources(self, k: int = 0) -> list[dict[str, Any]]:
        """Where each component of phase ``k`` lives: ``name``, ``url``, ``split`` and
        the ``sequences`` range of a view (JSON-ready; ``repr`` for custom records)."""
        return sources_of(self.engines[k].names, self.engines[k].components)

    def state(self, step: int | None = None) -> dict[str, Any]:
        """``{"step": next step, "samples": ..., "fingerprint": ..., "sources": ...}``,
        JSON-ready; with several phases ``{"step", "samples", "phases": [{"start_step",
        "fingerprint", "sources"}, ...]}``.

        ``step`` is the step a :meth:`restore` of it resumes at: by default
        :attr:`next_step`, the step after the last one :meth:`iterate` (or
        :meth:`to_grain`'s iterator) yielded; a loop that
        asks :meth:`batch` by step passes ``step + 1`` after training ``step``.
        ``samples`` counts the global samples before ``step``'s (see :meth:`samples_before`);
        ``fingerprint`` is what :meth:`restore` checks; ``sources`` (see :meth:`sources`)
        says where the data was, for ``flat-tokens show --state``, and is not checked
        (data may move between stores). A run with :meth:`set_weights` or :meth:`skip`
        also holds ``weights``, ``[[step, [n, ...]], ...]``, and ``skips``, ``[[step,
        count], ...]`` (see :mod:`~flat_tokens_jax.loader.steered`).
        """
        step = state_step(step, self.next_step)
        steering = self.steering
        return {
            "step": step,
            "samples": self.samples_before(step),
            "fingerprint": self.fingerprint(),
            "sources": self.sources(),
            **state_fields(steering.skips, steering.changes),
        }

    def state_differences(self, state: Mapping[str, Any]) -> list[str]:
        """What keeps this run from continuing a saved :meth:`state`, as
        ``path: saved X, now Y`` lines (naming phase and steps with several phases;
        none: it may; see :meth:`restore`)."""
        return state_differences(state, self.fingerprint(), self.schedule)

    def restore(self, state: Mapping[str, Any] | SavedState) -> int:
        """Continues from a saved :meth:`state` (or one read back by
        :func:`~flat_tokens_jax.loader.state.read_state`); returns the step
        ``iterate`` resumes at.

        The state must have the shape :meth:`state` saves (see
        :mod:`~flat_tokens_jax.loader.state`), and every field of :meth:`fingerprint` must
        be in it with the same value and JSON type (see
        :mod:`~flat_tokens_jax.loader.resume`). The batch size may change from the saved
        step on: a ``batch_size`` (or schedule) that agrees with the saved one on every
        step before it continues at exactly the next unseen sample. The saved weight
        changes and skips are replayed, with this loader's own (e.g. a YAML ``skip`` list
        applied before): see :func:`~flat_tokens_jax.loader.steered.merged`.

        Raises:
            StateMismatch: other data (kind of source, a component's identity,
                tokenizer) or config, other batch sizes before the saved step,
                or a field missing, unknown or of the wrong type; each named by
                its path in the state (``fingerprint.data.sample_digest``); or
                this loader's changes disagree with the saved ones.
        """
        if not isinstance(state, SavedState):
            state = restorable(state, "loader")
        step = check_resume(state, self.fingerprint(), self.schedule)
        saved = state if isinstance(state, SavedState) else read_state(state)
        skips, changes = merged(saved, self.steering.skips, self.steering.changes)
        now = self.steering
        if (skips, changes) != (now.skips, now.changes):
            self.engine.steer(now.steered(skips, changes, 0))
            self.prefetcher.drop_from(0)
        self._restored = dict(self.steering.skips.entries)
        self.next_step = step
        return step

    # -- steering: skipped batches and weight changes from a step on

    @property
    def steering(self) -> Steering:
        """The skips (``steering.skips.entries``, ``((step, count), ...)``) and weight
        changes (``steering.changes``, ``((step, counts), ...)``: from ``step`` on,
        ``counts[c]`` samples of component ``c`` per period of ``sum(counts)``) that
        this loader reads with (see :meth:`skip` and :meth:`set_weights`)."""
        return self.engine.steps.steering

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


@dataclasses.dataclass(frozen=True)
class Reopened:
    """A loader opened again in a grain worker process (``to_grain`` under
    ``mp_prefetch``): its sources (they pickle as what reopens them), this
    host's rows of each batch size as the parent worked them out under its
    sharding (the worker needs none), and the parent's :meth:`Loader.state`,
    whose steering it restores."""

    sources: Sources
    rows: dict[int, np.ndarray]
    state: dict[str, Any]

    def open(self) -> Loader:
        loader = Loader.__new__(Loader)
        source = self.sources.mixture or self.sources.components[0]
        loader.phases = (Phase(0, source, self.sources.config),)
        loader.starts, loader.firsts, loader.end_step = [0], [0], None
        loader._open([StepEngine(self.sources, rows=self.rows)], None)
        loader.restore(self.state)
        return loader

