"""Batches from any step: ``Loader`` (its ``LoaderConfig`` is in
:mod:`~flat_tokens_jax.loader.config`).

``Loader.batch(step)`` is a pure function of (data, config, step): global
sample ``g = samples_before(step) + row`` (``step * batch_size + row`` for a
constant batch size, see :mod:`~flat_tokens_jax.sampling.schedule`) goes through the
stateless sampler to a record, the record's tokens are read, and the model
fields are decoded.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from flat_tokens_jax.core.limits import check_loader_memory
from flat_tokens_jax.core.values import integer
from flat_tokens_jax.data.bins import BinRecords
from flat_tokens_jax.data.dataset import FlatTokens
from flat_tokens_jax.data.plans import default_cache_dir
from flat_tokens_jax.data.records import Records, Windows, recorded_info, sources_of
from flat_tokens_jax.decoding.batch import padding_fields
from flat_tokens_jax.decoding.hostdecode import BlockDecoder, default_threads
from flat_tokens_jax.decoding.instancefilter import FilteredRows
from flat_tokens_jax.decoding.layouts import row_starts
from flat_tokens_jax.decoding.sharding import Block, BlockData, HostPlan, host_plans
from flat_tokens_jax.loader.config import (
    LoaderConfig,
    check_sharding,
    check_vocab,
    records_for,
    resolve_start_token_id,
)
from flat_tokens_jax.loader.feed import Feed, timed
from flat_tokens_jax.loader.pipeline import Ahead
from flat_tokens_jax.loader.resume import StateMismatch, check_resume, compare_state, state_step
from flat_tokens_jax.sampling.mixture import Mixture
from flat_tokens_jax.sampling.sampling import IndexSampler
from flat_tokens_jax.sampling.stepsamples import LOOKUP_AHEAD, StepSamples

if TYPE_CHECKING:
    from flat_tokens_jax.loader.tograin import StepsDataset

log = logging.getLogger(__name__)

FIELDS = ("inputs", "targets", "segment_ids", "positions", "loss_mask")


@dataclasses.dataclass(frozen=True)
class _Fetched:
    """A step's rows on this host, read, still to be decoded.

    ``parts`` holds ``(component, rows, windows)``: ``rows`` the positions
    among the step's ``rows`` rows, or ``None`` for all of them (one
    component, no padding rows).
    """

    rows: int
    parts: list[tuple[int, np.ndarray | None, Windows]]


@dataclasses.dataclass(frozen=True)
class _Blocks:
    """A step's blocks read on this host, still to be decoded on the devices."""

    plan: HostPlan
    data: dict[Block, BlockData]


class Loader:
    """Batches of model fields for any step, with background prefetching.

    Every batch holds ``inputs``, ``targets``, ``segment_ids``, ``positions``
    (``[batch_size, seq_len] int32``) and ``loss_mask`` (``[batch_size, seq_len]
    bool``; multiply the per-token loss by it); with a batch-size schedule
    ``batch_size`` is the step's, ``config.batch_size_at(step)``. Other
    arrays with ``config.layout`` and ``config.max_segments`` (see
    :class:`LoaderConfig`).

    Args:
        source: a :class:`FlatTokens` split (records made per ``config.packing``)
            or any :class:`Records` source, e.g. a ``Mixture``.
        config: the batch definition.
        sharding: how the global batch is laid out over devices, e.g.
            ``NamedSharding(mesh, P("data"))``, ``P(("data", "fsdp"))`` or
            ``P("data", "seq")`` (sequence dimension sharded too). Each host then
            reads only the blocks its own devices hold. ``None``: whole batches on
            the default device.
        plan_cache: where packing plans built for ``packing="bins"`` are cached
            (splits without a stored plan, see ``flat-tokens pack``). ``None``:
            ``$XDG_CACHE_HOME/flat_tokens_jax/plans`` (``~/.cache/...``).

    Raises:
        ValueError: the sharding cannot split ``[batch_size, seq_len]`` evenly
            (for a schedule: the first step whose size it cannot split is
            named), or ``vocab_size`` is too small for the data.
    """

    def __init__(
        self,
        source: FlatTokens | Records | Mixture,
        config: LoaderConfig,
        sharding: jax.sharding.Sharding | None = None,
        *,
        plan_cache: str | os.PathLike[str] | None = None,
    ) -> None:
        if not isinstance(config, LoaderConfig):
            raise TypeError(
                f"config must be a LoaderConfig, got {type(config).__name__}: "
                "ftj.LoaderConfig(batch_size=..., seq_len=...)"
            )
        check_sharding(sharding)
        self.layout = config.batch_layout
        largest = max(size for _, size in config.schedule.entries)
        ahead, row = config.read_ahead_bytes, self.layout.row_bytes(config.seq_len)
        check_loader_memory(
            largest, config.seq_len, config.prefetch, jax.process_count(), ahead, row_bytes=row
        )
        self.mixture = source if isinstance(source, Mixture) else None
        cache = default_cache_dir() if plan_cache is None else plan_cache
        if isinstance(source, Mixture):
            if config.num_epochs is not None:
                raise ValueError(
                    "num_epochs does not apply to a Mixture: each component "
                    "runs its own epochs, without end; set num_epochs=None"
                )
            components = source.records(
                config.seq_len, config.packing, plan_cache=cache, max_segments=config.max_segments
            )
            names = source.names
        else:
            components = (records_for(source, config, cache),)
            names = ("0",)
        for records in components:
            if len(records) == 0:
                raise ValueError(
                    f"{records!r} has no records: the split holds fewer than "
                    f"seq_len={config.seq_len} tokens or no sequences"
                )
        infos = [(n, recorded_info(r)) for n, r in zip(names, components, strict=True)]
        check_vocab(config, components, infos)
        self.start_token_id = resolve_start_token_id(config, infos)
        self.components, self.config, self.sharding = components, config, sharding
        self.names = names
        self.records: Records | Mixture = components[0] if self.mixture is None else self.mixture
        mix = self.mixture
        self.samplers = [
            IndexSampler(
                len(r),
                seed=config.seed if mix is None else mix.component_seed(config.seed, c),
                shuffle=config.shuffle,
                num_epochs=config.num_epochs,
            )
            for c, r in enumerate(components)
        ]
        self.sampler = self.samplers[0]
        self.schedule = config.schedule
        self._plans = host_plans(sharding, self.schedule, config.seq_len)
        self.steps = StepSamples(
            self.samplers, self.mixture, self.schedule, self.host_rows_at, config.num_epochs
        )
        self._device_plans = self._plans if sharding is not None else None
        # Whether device decoding ships a stored loss mask: unless every
        # component is a split known to store none (custom records may).
        self._ships_mask = not all(map(_stores_no_mask, components))
        # Steps read ahead, for `iterate`, `start` and consecutive `batch` calls.
        self._feed = Feed(
            config, self._producer, self._read, lambda s: self.host_rows_at(s).size, components
        )
        # Step 0's; a schedule's later steps may differ: see plan_at, host_rows_at.
        self.plan = self.plan_at(0)
        self.host_rows = self.host_rows_at(0)
        self.next_step = 0
        self.wait_seconds = 0.0
        self._fingerprint: dict[str, Any] | None = None
        self.block_decoder = BlockDecoder(config.decode_threads or default_threads())
        self._filter = FilteredRows(config.instance_filter, self.block_decoder.run_blocks)
        # Reading ahead, the read stage takes a core of its own (see pipeline).
        self._ahead_threads = config.decode_threads or max(1, default_threads() - 1)
        if config.decode == "device":
            self._device_plan(0)  # refuses a sharding it cannot decode under

    def __repr__(self) -> str:
        return f"Loader({self.records!r}, {self.config!r})"

    def use_samplers(self, samplers: list[IndexSampler]) -> None:
        """Reads component ``c`` through ``samplers[c]`` (of its record count)
        instead of the config's sampler; call before the first batch. A run in
        phases passes samplers that continue each stream where earlier phases
        left it (see :mod:`~flat_tokens_jax.loader.phasedloader`)."""
        sizes = [len(r) for r in self.components]
        if [s.num_records for s in samplers] != sizes:
            raise ValueError(f"samplers must be one per component of {sizes} records")
        self.samplers, self.sampler = samplers, samplers[0]
        self.steps = StepSamples(
            samplers, self.mixture, self.schedule, self.host_rows_at, self.config.num_epochs
        )

    def plan_at(self, step: int) -> HostPlan | None:
        """The blocks this host reads at ``step`` (``None`` without a sharding)."""
        return self._plans.get(self.schedule.size(step))

    def host_rows_at(self, step: int) -> np.ndarray:
        """``[k] int64`` the global rows this host reads at ``step``, ascending."""
        plan = self.plan_at(step)
        if plan is None:
            return np.arange(self.schedule.size(step), dtype=np.int64)
        return plan.rows

    def samples_before(self, step: int) -> int:
        """Global samples in the steps before ``step`` (``step * batch_size`` if constant)."""
        return self.schedule.samples_before(step)

    @property
    def num_batches(self) -> int | None:
        """Steps in the run (``None`` when ``num_epochs`` is ``None``)."""
        return self.steps.num_batches

    def _decode(
        self, component: int, windows: Windows, threads: int | None = None
    ) -> dict[str, np.ndarray]:
        source = self.components[component]
        return self.block_decoder.decode(
            windows,
            source.packed,
            self.config.seq_len,
            start_token_id=self.start_token_id,
            pad_id=self.config.pad_id,
            threads=threads,
        )

    def _fetch_rows(self, step: int, rows: np.ndarray, ahead: int = 0) -> _Fetched:
        """Reads the records of ``rows`` at ``step`` (``ahead``: see ``StepSamples.records``)."""
        comp, records, real = self.steps.records(step, rows, ahead)
        present = np.unique(comp).tolist()
        if real.all() and len(present) == 1:
            return _Fetched(
                rows.size, [(present[0], None, self.components[present[0]].read(records))]
            )
        at = np.flatnonzero(real)
        parts = [(c, at[comp == c], self.components[c].read(records[comp == c])) for c in present]
        return _Fetched(rows.size, parts)

    def _fields_of(
        self, fetched: _Fetched, step: int, threads: int | None = None, counted: bool = True
    ) -> dict[str, np.ndarray]:
        """The layout's fields of records read by ``_fetch_rows`` at ``step``,
        decoded on at most ``threads`` threads (default: the decoder's), after
        the instance filter (its rejections noted for ``step`` when ``counted``)."""
        noted = step if counted else None
        parts = fetched.parts
        if len(parts) == 1 and parts[0][1] is None:
            c, windows = parts[0][0], parts[0][2]
            out = self._filter.apply(self._decode(c, windows, threads), noted, threads)
            if self.layout.plain:
                return out
            starts = row_starts(windows, self.components[c].packed)
        else:
            out = padding_fields(fetched.rows, self.config.seq_len, self.config.pad_id)
            starts = np.zeros(fetched.rows, bool)
            for c, at, windows in parts:
                for key, value in self._decode(c, windows, threads).items():
                    out[key][at] = value
                starts[at] = row_starts(windows, self.components[c].packed)
            out = self._filter.apply(out, noted, threads)
        rows = self.host_rows_at(step)
        return self.layout.apply(out, starts, where=f"step {step}", rows=rows)

    def host_batch(self, step: int) -> dict[str, np.ndarray]:
        """This host's rows of the batch at ``step``, whole, in global row order
        (numpy): the fields of ``config.layout``."""
        return self._fields_of(self._fetch_rows(step, self.host_rows_at(step)), step, counted=False)

    def batch(self, step: int) -> dict[str, jax.Array]:
        """The global batch at ``step`` as ``jax.Array``\\ s ``[batch_size, seq_len]``
        (``batch_size`` the step's).

        Called with consecutive steps (a loop that asks by step), or at the
        step given to :meth:`start`, it reads the next steps ahead in
        background threads, as :meth:`iterate` does; another step drops what
        was read ahead. The batches are the same either way.
        """
        return self._take(step, ahead=False)

    def start(self, step: int | None = None) -> None:
        """Starts reading ``step`` (default: :attr:`next_step`, e.g. after
        :meth:`restore`) and the steps after it in the background, and returns.

        The next :meth:`iterate` from ``step`` (or :meth:`batch` at ``step``)
        takes them, so a trainer can start its input before it restores its
        own checkpoint. Calling it again at the same step changes nothing;
        iterating or asking for another step drops these reads. With
        ``prefetch=0`` it reads nothing.
        """
        step = integer(self.next_step if step is None else step, "Loader.start: step", low=0)
        self._feed.start(step, self.num_batches)

    def _take(self, step: int, ahead: bool, end: int | None = None) -> dict[str, jax.Array]:
        """The batch at ``step`` for the trainer (``ahead``: read ahead even
        after a jump; nothing at or past ``end``, default the run's end);
        measures its wait."""
        step, end = integer(step, "step", low=0), self.num_batches if end is None else end
        began = time.perf_counter()
        batch = self._on_devices(self._feed.take(step, ahead, end))
        now = time.perf_counter()
        self.wait_seconds = now - began
        self._feed.handed(step, now - began, now, end)
        self._filter.handed(step)
        return batch

    def _producer(self) -> Ahead[tuple[int, _Fetched | _Blocks], Any]:
        """Background threads that prepare steps in order, reading records
        for several steps per sampler call (see :mod:`~flat_tokens_jax.loader.pipeline`)."""
        ahead = max(self.config.prefetch or 0, LOOKUP_AHEAD)
        return Ahead(
            lambda step: (step, self._timed_fetch(step, ahead)),
            lambda fetched: self._finish(fetched, self._ahead_threads),
            "ftj-prefetch",
            fetchers=self._feed.fetchers(),
        )

    def encoded_batch(self, step: int) -> dict[str, jax.Array]:
        """The batch at ``step`` still encoded, as global arrays, for :meth:`decoder`.

        Host-to-device traffic is 4 bytes a token (plus 1 for a stored loss
        mask), against 17 for the decoded fields. Decode inside your jitted
        step: ``fields = loader.decoder(step)(encoded)``.

        Returns:
            ``encoded`` ``[batch_size, seq_len] uint32`` (encoded tokens),
            ``before`` ``[batch_size, column shards] uint32`` (the token before
            each column shard), ``lengths`` ``[batch_size] int32`` (tokens of
            padded rows and bins), ``real`` ``[batch_size] bool`` (False for
            padding rows past the last epoch), and ``stored_mask``
            ``[batch_size, seq_len] uint8`` when the data stores a loss mask.
            Laid out as the loader's sharding (whole rows on one device
            without one).
        """
        plan = self._device_plan(step)
        return plan.encoded_arrays(self._block_reads(step, plan))

    def decoder(self, step: int = 0) -> Callable[[Mapping[str, jax.Array]], dict[str, jax.Array]]:
        """The function from :meth:`encoded_batch`'s arrays to the fields of
        ``config.layout`` (the values :meth:`batch` returns), to call inside
        ``jax.jit``.

        ``step`` matters only with a batch-size schedule whose sizes lay out
        differently over the mesh: pass any step of the size in use.
        """
        return self._device_plan(step).decoder(
            packed=self.config.packing,
            start_token_id=self.start_token_id,
            pad_id=self.config.pad_id,
            instance_filter=self.config.instance_filter,
            layout=self.layout,
        )

    def _device_plan(self, step: int) -> HostPlan:
        if self._device_plans is None:
            self._device_plans = host_plans(
                _device_sharding(None), self.schedule, self.config.seq_len
            )
        plan = self._device_plans.get(self.schedule.size(step))
        if plan is None or not isinstance(plan.sharding, NamedSharding):
            raise ValueError(
                "decoding on the devices needs a NamedSharding (or no sharding), got "
                f"{self.sharding!r}: use NamedSharding(mesh, PartitionSpec(...))"
            )
        return plan

    def _block_reads(self, step: int, plan: HostPlan) -> dict[Block, BlockData]:
        data = {b: self._block_data(step, b) for b in plan.blocks}
        if self.layout.max_segments is not None:
            where = f"step {step}"
            self.layout.check_blocks(data, self.config.seq_len, self.config.packing, where)
        return data

    def _read(self, step: int) -> dict[str, jax.Array] | _Blocks:
        """Everything of a step that involves no collective: safe in any thread."""
        return self._finish((step, self._timed_fetch(step)))

    def _timed_fetch(self, step: int, ahead: int = 0) -> _Fetched | _Blocks:
        fetched: _Fetched | _Blocks = timed(self._feed.fetched, lambda: self._fetch(step, ahead))
        return fetched

    def _fetch(self, step: int, ahead: int = 0) -> _Fetched | _Blocks:
        """A step's first stage: its records, read (decoded already for ``_Blocks``)."""
        if self.config.decode == "device":
            on_device = self._device_plan(step)
            return _Blocks(on_device, self._block_reads(step, on_device))
        plan = self.plan_at(step)
        if plan is not None and plan.columns_sharded:
            return _Blocks(plan, self._block_reads(step, plan))
        return self._fetch_rows(step, self.host_rows_at(step), ahead)

    def _finish(
        self, fetched: tuple[int, _Fetched | _Blocks], threads: int | None = None
    ) -> dict[str, jax.Array] | _Blocks:
        """A step's second stage: its fields decoded (on at most ``threads``
        threads) and placed on the devices."""
        step, part = fetched
        if isinstance(part, _Blocks):
            return part
        plan = self.plan_at(step)
        if plan is None:
            placed: dict[str, jax.Array] = timed(
                self._feed.measures.finished,
                lambda: jax.device_put(self._fields_of(part, step, threads)),
            )
            return placed
        return timed(
            self._feed.measures.finished,
            lambda: plan.assemble_rows(self._fields_of(part, step, threads)),
        )

    def _on_devices(self, part: dict[str, jax.Array] | _Blocks) -> dict[str, jax.Array]:
        """Finishes a step; decoding across hosts runs collectives, so call it in step order."""
        if not isinstance(part, _Blocks):
            return part
        return part.plan.assemble_blocks(
            part.data,
            packed=self.config.packing,
            start_token_id=self.start_token_id,
            pad_id=self.config.pad_id,
            instance_filter=self.config.instance_filter,
            layout=self.layout,
        )

    def _block_data(self, step: int, block: Block) -> BlockData:
        """Encoded tokens of one block (its columns only) for decoding on device."""
        g, real = self.steps.samples(step, np.arange(*block.rows, dtype=np.int64))
        comp, records, _ = self.steps.lookup(g[real])
        n, width = g.size, block.cols[1] - block.cols[0]
        encoded = np.zeros((n, width), np.uint32)
        before = np.zeros((n, 1), np.uint32)
        lengths = np.zeros(n, np.int32)
        mask = np.ones((n, width), np.uint8) if self._ships_mask else None
        at = np.flatnonzero(real)
        for c in np.unique(comp).tolist():
            rows = at[comp == c]
            windows = self.components[c].read(records[comp == c], columns=block.cols)
            if self.components[c].packed:  # packed windows, and bins: their column 0 is before
                encoded[rows], before[rows, 0] = windows.encoded[:, 1:], windows.encoded[:, 0]
            else:
                encoded[rows] = windows.encoded
            if self.components[c].packed is not True:
                assert windows.lengths is not None
                lengths[rows] = windows.lengths
            if windows.stored_mask is not None and mask is not None:
                mask[rows] = windows.stored_mask
        return BlockData(encoded, before, lengths, mask, real)

    def iterate(
        self, start_step: int | None = None, stop_step: int | None = None
    ) -> Iterator[tuple[int, dict[str, jax.Array]]]:
        """Yields ``(step, batch)`` from ``start_step`` (default: the restored step)
        to ``stop_step`` (exclusive; default: the run's end, if any), reading
        nothing ahead past ``stop_step``.

        The next steps (``config.prefetch``, or as many as the measured times
        ask for, see :class:`LoaderConfig`) are read, decoded and placed on
        device by background threads while the caller trains (work that needs
        collectives across hosts is dispatched here, in step order); steps
        begun by :meth:`start` are used. ``wait_seconds`` holds how long the
        last step waited for its batch: near zero when input keeps up; see
        :meth:`stats` for more.
        """
        step = integer(self.next_step if start_step is None else start_step, "start_step", low=0)
        end = self.num_batches
        if stop_step is not None:
            stop_step = integer(stop_step, "stop_step", low=0)
            end = stop_step if end is None else min(end, stop_step)
        try:
            while end is None or step < end:
                batch = self._take(step, ahead=True, end=end)
                self.next_step = step + 1
                yield step, batch
                step += 1
        finally:
            self._feed.close()

    def stats(self) -> dict[str, float | int]:
        """What the input pipeline did so far, JSON-ready, for a trainer to log.

        ``steps``: batches handed out (``batch`` and ``iterate``); the
        trainer's waits for them, ``wait_first_s`` for the first and
        ``wait_last_s``, ``wait_mean_s``, ``wait_p99_s`` (of the last 1024)
        over the others; ``fetch_last_s``, ``fetch_mean_s`` (a step's read:
        latency), ``decode_mean_s`` (decode and placement), ``interval_mean_s``
        (between batches taken: the trainer's step); ``depth`` (steps in
        flight now), ``depth_target`` (the automatic depth last set; the
        pinned ``prefetch``), ``read_ahead_bytes_peak`` (most bytes the steps
        in flight held) and ``read_ahead_bytes`` (the budget);
        ``requests``: HTTP reads to GCS and S3 since the loader was made, by
        the whole process (other loaders' too); ``bytes_read``: bytes the
        components' readers requested, checks included, since then;
        ``tokens``: tokens of this host's rows handed out (rows x
        ``seq_len``, padding included); ``filtered_rows`` and
        ``filtered_rows_last``: this host's rows whose loss mask the
        ``instance_filter`` cleared, over the steps handed out and in the
        last one. Only rows decoded on the host are counted: steps decoded on
        the devices (``decode="device"``, or the sequence dimension sharded)
        count 0, since counting them would cost a transfer back from the
        devices; :meth:`host_batch` is not counted either.
        """
        return {**self._feed.stats(), **self._filter.stats()}

    def to_grain(self) -> StepsDataset:
        """This host's rows of each step from :attr:`next_step` on, read ahead, as a
        ``grain.IterDataset`` of :meth:`host_batch` dicts; its iterator's state is
        :meth:`state`, checked by :meth:`restore` (see :mod:`~flat_tokens_jax.loader.tograin`)."""
        from flat_tokens_jax.loader import tograin  # imports grain, only when asked

        return tograin.StepsDataset(self, [tograin.Span(self, 0, self.num_batches)], self.next_step)

    def fingerprint(self) -> dict[str, Any]:
        """What the batches depend on: the data's identity and the batch-defining config.

        ``data`` and ``config`` decide the sample order: ``data`` the records'
        counts, a digest of sampled tokens, whether a loss mask is stored and
        the vocabulary hash of the tokenizer the data records, and for a
        Mixture the components' names and the blending; ``config`` every
        other field that changes batches, with ``start_token_id`` resolved
        (see :class:`LoaderConfig`). ``batch_size`` (an int or ``[[start_step,
        size], ...]``) decides only how that order is cut into batches.
        """
        if self._fingerprint is None:
            if self.mixture is None:
                data = self.components[0].fingerprint()
            else:
                data = self.mixture.fingerprint(self.components)
            config = {**self.config.batch_defining(), "start_token_id": self.start_token_id}
            batch_size = config.pop("batch_size")
            self._fingerprint = {"data": data, "config": config, "batch_size": batch_size}
        return self._fingerprint

    def sources(self) -> list[dict[str, Any]]:
        """Where each component's data lives: ``name``, ``url``, ``split`` and the
        ``sequences`` range of a view (JSON-ready; ``repr`` for custom records)."""
        return sources_of(self.names, self.components)

    def state(self, step: int | None = None) -> dict[str, Any]:
        """``{"step": next step, "samples": ..., "fingerprint": ..., "sources": ...}``,
        JSON-ready.

        ``step`` is the step a :meth:`restore` of it resumes at: by default
        :attr:`next_step`, the step after the last one :meth:`iterate` yielded;
        a loop that asks :meth:`batch` by step passes ``step + 1`` after training
        ``step``. ``samples`` counts the global samples of the steps before ``step``;
        ``fingerprint`` is what :meth:`restore` checks; ``sources`` (see
        :meth:`sources`) says where the data was, for ``flat-tokens show
        --state``, and is not checked (data may move between stores).
        """
        step = state_step(step, self.next_step)
        return {
            "step": step,
            "samples": self.samples_before(step),
            "fingerprint": self.fingerprint(),
            "sources": self.sources(),
        }

    def restore(self, state: Mapping[str, Any]) -> int:
        """Continues from a saved :meth:`state`; returns the step ``iterate`` resumes at.

        Every field of :meth:`fingerprint` must be in the state with the same
        value and JSON type (see :mod:`~flat_tokens_jax.loader.resume`); a state
        saved by an older version may lack only fields that cannot change a
        batch, and a warning names them. The batch size may change from the
        saved step on: a ``batch_size`` (or schedule) that agrees with the
        saved one on every step before it continues at exactly the next unseen
        sample. An older state's batch size is its config's int.

        Raises:
            StateMismatch: other data (kind of source, a component's identity,
                tokenizer) or config, other batch sizes before the saved step,
                or a field missing or of the wrong type; each named by its path
                in the state (``fingerprint.data.sample_digest``).
        """
        if not isinstance(state, Mapping):
            raise TypeError(
                "restore takes the mapping that loader.state() returned, "
                f"got {type(state).__name__}"
            )
        step = state.get("step")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise StateMismatch(f"saved loader state has no valid step: {step!r} (an int >= 0)")
        self.next_step = check_resume(state, self.fingerprint(), self.schedule)
        return self.next_step

    def state_differences(self, state: Mapping[str, Any]) -> list[str]:
        """What keeps this loader from continuing a saved :meth:`state`, as
        ``path: saved X, now Y`` lines (none: it may; see :meth:`restore`)."""
        return compare_state(state, self.fingerprint(), self.schedule).differences

    def provenance(self, step: int) -> list[dict[str, Any]]:
        """Where each of this host's rows at ``step`` came from.

        One dict per row: ``row``, ``sample`` (global index), ``epoch``, ``record``
        and ``tokens`` (``[start, stop)`` of its targets in the split; for a bin,
        from its first sequence's start to its last one's end, and
        ``sequences``, the indices of the sequences it holds); padding rows are
        ``{"row": r, "padding": True}``.
        """
        rows = self.host_rows_at(step)
        g, real = self.steps.samples(step, rows)
        comp, records, epochs = self.steps.lookup(g[real])
        out: list[dict[str, Any]] = [{"row": int(r), "padding": True} for r in rows]
        at = np.flatnonzero(real)
        for c in np.unique(comp).tolist():
            mine = np.flatnonzero(comp == c)
            source = self.components[c]
            starts, stops = source.token_ranges(records[mine])
            members = source.members(records[mine]) if isinstance(source, BinRecords) else None
            for i, k in enumerate(mine.tolist()):
                pos = int(at[k])
                row: dict[str, Any] = {"row": int(rows[pos]), "sample": int(g[pos])}
                if self.mixture is not None:
                    row["component"], row["component_name"] = c, self.names[c]
                out[pos] = {
                    **row,
                    "epoch": int(epochs[k]),
                    "record": int(records[k]),
                    "tokens": [int(starts[i]), int(stops[i])],
                }
                if members is not None:
                    out[pos]["sequences"] = members[i]
        return out


def _stores_no_mask(records: Records) -> bool:
    ft = getattr(records, "ft", None)
    return isinstance(ft, FlatTokens) and ft.loss_mask is None


def _device_sharding(sharding: jax.sharding.Sharding | None) -> jax.sharding.Sharding:
    """The sharding device decoding lays a batch out with: ``sharding``, or
    for none, whole batches on the default device (as ``jax.device_put``)."""
    if sharding is not None:
        return sharding
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("batch",))
    return NamedSharding(mesh, PartitionSpec())
