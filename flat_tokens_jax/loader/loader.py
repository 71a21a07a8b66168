"""Batches from any step: ``Loader`` (its ``LoaderConfig`` is in
:mod:`~flat_tokens_jax.loader.config`).

``Loader.batch(step)`` is a pure function of (data, config, step): global
sample ``g = samples_before(step) + row`` (``step * batch_size + row`` for a
constant batch size, see :mod:`~flat_tokens_jax.sampling.schedule`) goes through the
stateless sampler to a record, the record's tokens are read, and the model
fields are decoded. The step engine (:mod:`~flat_tokens_jax.loader.engine`)
does all of that; ``Loader`` makes global ``jax.Array``\\ s of its steps and
saves and restores where a run is.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from flat_tokens_jax.core.values import integer
from flat_tokens_jax.data.dataset import FlatTokens
from flat_tokens_jax.data.records import Records, sources_of
from flat_tokens_jax.decoding.sharding import HostBlocks
from flat_tokens_jax.loader.config import LoaderConfig
from flat_tokens_jax.loader.deviceblocks import Blocks
from flat_tokens_jax.loader.engine import Fetched, StepEngine
from flat_tokens_jax.loader.prefetch import Prefetcher
from flat_tokens_jax.loader.resume import check_resume, state_differences
from flat_tokens_jax.loader.sources import Sources
from flat_tokens_jax.loader.state import SavedState, read_state, restorable, state_step
from flat_tokens_jax.loader.steerable import Steerable
from flat_tokens_jax.loader.steered import merged, state_fields
from flat_tokens_jax.sampling.mixture import Mixture

if TYPE_CHECKING:
    from flat_tokens_jax.loader.tograin import StepsDataset


class Loader(Steerable):
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
        source_names: the names of the sources a batch's ``source`` counts
            (``config.source_field``): a ``Mixture``'s components in order,
            ``("0",)`` for one split; a phase's: the whole run's.
        samplers: ``[K]`` component ``c``'s sampler (``sampler``: the first's).
        steps: which record each row of a step reads.
        next_step: the step :meth:`iterate` starts at: the step after the last one
            handed out (by :meth:`iterate` or an iterator of :meth:`to_grain`), or
            the restored one.

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
        self._open(StepEngine(Sources.of(source, config, sharding, plan_cache), sharding))

    @classmethod
    def _of(cls, engine: StepEngine) -> Loader:
        """A loader of ``engine``'s steps (a phase's, made by ``PhasedLoader``)."""
        loader = cls.__new__(cls)
        loader._open(engine)
        return loader

    def _open(self, engine: StepEngine) -> None:
        self.engine = engine
        self.config, self.sharding, self.layout = engine.config, engine.sharding, engine.layout
        self.mixture, self.components, self.names = engine.mixture, engine.components, engine.names
        self.source_names, self.start_token_id = engine.source_names, engine.start_token_id
        self.records, self.schedule = engine.records, engine.schedule
        self.samplers, self.sampler, self.steps = engine.samplers, engine.sampler, engine.steps
        # Steps read ahead, for `iterate`, `start`, consecutive `batch` calls and
        # `to_grain` (which takes them decoded on the host: `_host`).
        found = [getattr(r, "ft", None) for r in engine.components]
        self._host = False
        self.prefetcher: Prefetcher[Fetched | Blocks, Any] = Prefetcher(
            engine.config,
            self._read,
            self._finish,
            lambda s: engine.host_rows_at(s).size,
            [ft for ft in found if isinstance(ft, FlatTokens)],
            engine.source_names,
        )
        # Step 0's; a schedule's later steps may differ: see host_blocks_at, host_rows_at.
        self.host_blocks, self.host_rows = self.host_blocks_at(0), self.host_rows_at(0)
        self.next_step = 0
        self._restored = {}

    def __repr__(self) -> str:
        return f"Loader({self.records!r}, {self.config!r})"

    @property
    def wait_seconds(self) -> float:
        """How long the last step :meth:`batch` or :meth:`iterate` handed out waited for it."""
        return self.prefetcher.wait_seconds

    def host_blocks_at(self, step: int) -> HostBlocks | None:
        """The blocks this host reads at ``step`` (``None`` without a sharding)."""
        return self.engine.host_blocks_at(integer(step, "step", low=0))

    def host_rows_at(self, step: int) -> np.ndarray:
        """``[k] int64`` the global rows this host reads at ``step``, ascending."""
        return self.engine.host_rows_at(integer(step, "step", low=0))

    def batch_size_at(self, step: int) -> int:
        """Global rows of the batch at ``step``: ``config.batch_size_at`` of the data
        step it reads (``step`` itself unless batches were skipped, see :meth:`skip`)."""
        return self.engine.steps.size(step)

    def samples_before(self, step: int) -> int:
        """Global samples before ``step``'s (the global index of its first sample):
        ``step * batch_size`` for a constant batch size; with skips, those of the data
        steps before the one it reads, skipped batches included."""
        return self.schedule.samples_before(self.engine.steps.data_step(step))

    @property
    def num_batches(self) -> int | None:
        """Steps in the run (``None`` when ``num_epochs`` is ``None``)."""
        return self.engine.num_batches

    def host_batch(self, step: int) -> dict[str, np.ndarray]:
        """This host's rows of the batch at ``step``, whole, in global row order
        (numpy): the fields of ``config.layout``."""
        return self.engine.host_batch(step)

    def batch(self, step: int) -> dict[str, jax.Array]:
        """The global batch at ``step`` as ``jax.Array``\\ s ``[batch_size, seq_len]``
        (``batch_size`` the step's).

        Called with consecutive steps (a loop that asks by step), or at the step given to
        :meth:`start`, it reads the next steps ahead in background threads, as
        :meth:`iterate` does; another step drops what was read ahead. The batches are the
        same either way.
        """
        step = integer(step, "step", low=0)
        return self._take(step, False, self.num_batches)

    def start(self, step: int | None = None) -> None:
        """Starts reading ``step`` (default: :attr:`next_step`, e.g. after
        :meth:`restore`) and the steps after it in the background, and returns.

        The next :meth:`iterate` from ``step`` (or :meth:`batch` at ``step``) takes them,
        so a trainer can start its input before it restores its own checkpoint. Calling
        it again at the same step changes nothing; iterating or asking for another step
        drops these reads. With ``prefetch=0`` it reads nothing.
        """
        step = integer(self.next_step if step is None else step, "Loader.start: step", low=0)
        self._start(step, self.num_batches)

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
        return self.engine.blocks.encoded(step)

    def decoder(self, step: int = 0) -> Callable[[Mapping[str, jax.Array]], dict[str, jax.Array]]:
        """The function from :meth:`encoded_batch`'s arrays to the fields of
        ``config.layout`` (the values :meth:`batch` returns), to call inside ``jax.jit``.

        ``step`` matters only with a batch-size schedule whose sizes lay out differently
        over the mesh: pass any step of the size in use.
        """
        return self.engine.blocks.decoder(step)

    def _read(self, step: int, ahead: bool) -> Callable[[], Fetched | Blocks]:
        """A step's first stage (see :meth:`StepEngine.request`); ``ahead``: on a
        read-ahead thread, looking up the next steps' records with it."""
        return self.engine.request(step, self.engine.lookup if ahead else 0, self._host)

    def _finish(self, step: int, part: Fetched | Blocks, threads: int | None) -> Any:
        """A step's second stage: its fields decoded on ``threads`` threads
        (the read-ahead's choice) and, unless for ``to_grain``, placed on the
        devices; blocks wait for :meth:`_on_devices`. Everything of it
        involves no collective: safe in any thread."""
        if isinstance(part, Blocks):
            return part
        fields = self.engine.fields(part, step, threads)
        if self._host:
            return fields
        held = self.host_blocks_at(step)
        return jax.device_put(fields) if held is None else held.assemble_rows(fields)

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
        self.engine.filter.handed(step)
        return out

    def _start(self, step: int, end: int | None, host: bool = False) -> None:
        self._mode(host)
        self.prefetcher.start(step, end)

    def _on_devices(self, part: dict[str, jax.Array] | Blocks) -> dict[str, jax.Array]:
        """Finishes a step; decoding across hosts runs collectives, so call it in step order."""
        return self.engine.blocks.decode(part) if isinstance(part, Blocks) else part

    def iterate(
        self, start_step: int | None = None, stop_step: int | None = None
    ) -> Iterator[tuple[int, dict[str, jax.Array]]]:
        """Yields ``(step, batch)`` from ``start_step`` (default: the restored step)
        to ``stop_step`` (exclusive; default: the run's end, if any), reading
        nothing ahead past ``stop_step``.

        The next steps (``config.prefetch``, or as many as the measured times ask for, see
        :class:`LoaderConfig`) are read, decoded and placed on device by background threads
        while the caller trains (work that needs collectives across hosts is dispatched
        here, in step order); steps begun by :meth:`start` are used. ``wait_seconds`` holds
        how long the last step waited for its batch: near zero when input keeps up; see
        :meth:`stats` for more.
        """
        step = integer(self.next_step if start_step is None else start_step, "start_step", low=0)
        end = self.num_batches
        if stop_step is not None:
            stop_step = integer(stop_step, "stop_step", low=0)
            end = stop_step if end is None else min(end, stop_step)
        try:
            while end is None or step < end:
                batch = self._take(step, True, end)
                self.next_step = step + 1
                yield step, batch
                last = self.num_batches  # a skip made meanwhile ends a bounded run sooner
                if last is not None and self.next_step >= last:
                    return
                step += 1
        finally:
            self.prefetcher.close()

    def stats(self) -> dict[str, Any]:
        """What the input pipeline did so far, JSON-ready, for a trainer to log: the
        trainer's waits, the fetch and decode times, the read-ahead's depth and bytes,
        requests and bytes read, requests refused as throttled, tokens (by source too)
        and the instance filter's rejections; each key is described in
        docs/guide/loading.md, "Where the work runs, and read-ahead"."""
        return {**self.prefetcher.stats(), **self.engine.stats()}

    def to_grain(self) -> StepsDataset:
        """This host's rows of each step from :attr:`next_step` on, read ahead, as a
        ``grain.IterDataset`` of :meth:`host_batch` dicts; each step its iterator yields
        advances :attr:`next_step` as :meth:`iterate` does, and its state is :meth:`state`,
        checked by :meth:`restore` (see :mod:`~flat_tokens_jax.loader.tograin`)."""
        from flat_tokens_jax.loader import tograin  # imports grain, only when asked

        def spans() -> list[tograin.Span]:
            return [tograin.Span(self, 0, self.num_batches)]

        return tograin.StepsDataset(self, spans, self.next_step, recipe=self._reopened)

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

    def fingerprint(self) -> dict[str, Any]:
        """What the batches depend on: the data's identity and the batch-defining config.

        ``data`` and ``config`` decide the sample order: ``data`` the records' counts, a
        digest of sampled tokens, whether a loss mask is stored and the vocabulary hash of
        the tokenizer the data records, and for a Mixture the components' names and the
        blending; ``config`` every other field that changes batches, with
        ``start_token_id`` resolved (see :class:`LoaderConfig`). ``batch_size`` (an int or
        ``[[start_step, size], ...]``) decides only how that order is cut into batches.
        """
        return self.engine.sources.fingerprint()

    def sources(self) -> list[dict[str, Any]]:
        """Where each component's data lives: ``name``, ``url``, ``split`` and the
        ``sequences`` range of a view (JSON-ready; ``repr`` for custom records)."""
        return sources_of(self.names, self.components)

    def state(self, step: int | None = None) -> dict[str, Any]:
        """``{"step": next step, "samples": ..., "fingerprint": ..., "sources": ...}``,
        JSON-ready.

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

    def restore(self, state: Mapping[str, Any] | SavedState) -> int:
        """Continues from a saved :meth:`state` (or one read back by
        :func:`~flat_tokens_jax.loader.state.read_state`); returns the step
        ``iterate`` resumes at.

        The state must have the shape :meth:`state` saves (see
        :mod:`~flat_tokens_jax.loader.state`), and every field of :meth:`fingerprint` must
        be in it with the same value and JSON type (see
        :mod:`~flat_tokens_jax.loader.resume`). The batch size may change from the saved
        step on: a ``batch_size`` (or schedule) that agrees with the saved one on every
        step before it continues at exactly the next unseen sample.

        The saved weight changes and skips are replayed, with this loader's own (e.g. a
        YAML ``skip`` list applied before): see :func:`~flat_tokens_jax.loader.steered.merged`.

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
        self._steer(*merged(saved, self.steering.skips, self.steering.changes), 0)
        self._restored = dict(self.steering.skips.entries)
        self.next_step = step
        return step

    def state_differences(self, state: Mapping[str, Any]) -> list[str]:
        """What keeps this loader from continuing a saved :meth:`state`, as
        ``path: saved X, now Y`` lines (none: it may; see :meth:`restore`)."""
        return state_differences(state, self.fingerprint(), self.schedule)

    def provenance(self, step: int) -> list[dict[str, Any]]:
        """Where each of this host's rows at ``step`` came from.

        One dict per row: ``row``, ``sample`` (global index), ``epoch``, ``record`` and
        ``tokens`` (``[start, stop)`` of its targets in the split; for a bin, from its
        first sequence's start to its last one's end, and ``sequences``, the indices of the
        sequences it holds); padding rows are ``{"row": r, "padding": True}``.
        """
        return self.engine.provenance(step)


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
        loader = Loader._of(StepEngine(self.sources, rows=self.rows))
        loader.restore(self.state)
        return loader
