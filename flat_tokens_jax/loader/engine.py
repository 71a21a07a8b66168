"""The step engine: a step, this host's rows of it, their records, and their
fields in the configured layout, read ahead.

:class:`StepEngine` holds everything a step's fields depend on (the records,
the samplers, the schedule, the sharding's row plans, the decoder and the
instance filter) and computes a step in two stages: :meth:`StepEngine.request`
starts reading its records and returns what waits for them (:class:`Fetched`),
or for decoding on the devices its
encoded blocks (:class:`Blocks`); :meth:`StepEngine.fields` decodes records
into the layout's fields. A :class:`Door` reads one consumer's steps ahead
with those stages and hands them out: ``Loader`` places them on the devices
as global ``jax.Array``\\ s, ``to_grain`` hands the host numpy dicts over.
Both doors count their waits and the instance filter's rejections here, so
``Loader.stats`` reports whichever door handed out the last step.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from flat_tokens_jax.core.limits import check_loader_memory
from flat_tokens_jax.data.bins import BinRecords
from flat_tokens_jax.data.dataset import FlatTokens
from flat_tokens_jax.data.plans import default_cache_dir
from flat_tokens_jax.data.records import Records, Windows, recorded_info
from flat_tokens_jax.decoding.hostdecode import (
    BlockDecoder,
    default_threads,
    join_parts,
    request_parts,
)
from flat_tokens_jax.decoding.instancefilter import FilteredRows
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
from flat_tokens_jax.sampling.mixture import Mixture
from flat_tokens_jax.sampling.sampling import IndexSampler
from flat_tokens_jax.sampling.stepsamples import LOOKUP_AHEAD, StepSamples

Done = TypeVar("Done")
Out = TypeVar("Out")


@dataclasses.dataclass(frozen=True)
class Fetched:
    """A step's rows on this host, read, still to be decoded.

    ``parts`` holds ``(component, rows, windows)``: ``rows`` the positions
    among the step's ``rows`` rows, or ``None`` for all of them (one
    component, no padding rows).
    """

    rows: int
    parts: list[tuple[int, np.ndarray | None, Windows]]


@dataclasses.dataclass(frozen=True)
class Blocks:
    """A step's blocks read on this host, still to be decoded on the devices."""

    plan: HostPlan
    data: dict[Block, BlockData]


class StepEngine:
    """A loader's steps as this host's records and fields: see the module's docstring.

    Args: as :class:`~flat_tokens_jax.Loader`'s, which checks them here.
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
        self.block_decoder = BlockDecoder(config.decode_threads or default_threads())
        self.filter = FilteredRows(config.instance_filter, self.block_decoder.run_blocks)
        # Reading ahead, the read stage takes a core of its own (see pipeline).
        self.ahead_threads = config.decode_threads or max(1, default_threads() - 1)
        # Steps whose samples one sampler call looks up, reading ahead.
        self.lookup = max(config.prefetch or 0, LOOKUP_AHEAD)
        self._last: Door[Any] | None = None  # the door that handed out the last step
        if config.decode == "device":
            self.device_plan(0)  # refuses a sharding it cannot decode under

    def __repr__(self) -> str:
        return f"StepEngine({self.records!r}, {self.config!r})"

    def use_samplers(self, samplers: list[IndexSampler]) -> None:
        """See ``Loader.use_samplers``."""
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

    @property
    def num_batches(self) -> int | None:
        """Steps in the run (``None`` when ``num_epochs`` is ``None``)."""
        return self.steps.num_batches

    def _decode(
        self, component: int, windows: Windows, threads: int | None = None
    ) -> dict[str, np.ndarray]:
        return self.block_decoder.decode(
            windows,
            self.components[component].packed,
            self.config.seq_len,
            start_token_id=self.start_token_id,
            pad_id=self.config.pad_id,
            threads=threads,
        )

    def request_rows(self, step: int, rows: np.ndarray, ahead: int = 0) -> Callable[[], Fetched]:
        """Starts reading the records of ``rows`` at ``step`` (``ahead``: see
        ``StepSamples.records``); the function returned waits for them."""
        waiting = request_parts(self.components, *self.steps.records(step, rows, ahead))
        return lambda: Fetched(rows.size, waiting())

    def fields(
        self, fetched: Fetched, step: int, threads: int | None = None, counted: bool = True
    ) -> dict[str, np.ndarray]:
        """The layout's fields of records read by :meth:`request_rows` at ``step``,
        decoded on at most ``threads`` threads (default: the decoder's), after
        the instance filter (its rejections noted for ``step`` when ``counted``)."""
        noted = step if counted else None
        out, starts = join_parts(
            fetched.rows,
            fetched.parts,
            lambda c, windows: self._decode(c, windows, threads),
            [r.packed for r in self.components],
            self.config.seq_len,
            self.config.pad_id,
        )
        out = self.filter.apply(out, noted, threads)
        if self.layout.plain:
            return out
        rows = self.host_rows_at(step)
        return self.layout.apply(out, starts, where=f"step {step}", rows=rows)

    def host_batch(self, step: int) -> dict[str, np.ndarray]:
        """See ``Loader.host_batch`` (the instance filter's rejections are not counted)."""
        fetched = self.request_rows(step, self.host_rows_at(step))()
        return self.fields(fetched, step, counted=False)

    def request(
        self, step: int, ahead: int = 0, host: bool = False
    ) -> Callable[[], Fetched | Blocks]:
        """Starts a step's first stage; the function returned waits for it:
        its records, read; or, to be decoded on the devices
        (``decode="device"``, or the sequence dimension sharded; unless
        ``host``), its blocks (read here)."""
        if host:
            return self.request_rows(step, self.host_rows_at(step), ahead)
        device = self.config.decode == "device"
        plan = self.device_plan(step) if device else self.plan_at(step)
        if plan is not None and (device or plan.columns_sharded):
            blocks = Blocks(plan, self.block_reads(step, plan))
            return lambda: blocks
        return self.request_rows(step, self.host_rows_at(step), ahead)

    def device_plan(self, step: int) -> HostPlan:
        """The blocks this host decodes on its devices at ``step``."""
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

    def block_reads(self, step: int, plan: HostPlan) -> dict[Block, BlockData]:
        """The encoded tokens of ``plan``'s blocks at ``step``."""
        data = {b: self._block_data(step, b) for b in plan.blocks}
        if self.layout.max_segments is not None:
            where = f"step {step}"
            self.layout.check_blocks(data, self.config.seq_len, self.config.packing, where)
        return data

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

    def provenance(self, step: int) -> list[dict[str, Any]]:
        """See ``Loader.provenance``."""
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

    def door(
        self,
        finish: Callable[[int, Fetched | Blocks, int | None], Done],
        name: str,
        host: bool = False,
    ) -> Door[Done]:
        """A consumer's steps, read ahead (see :class:`Door`)."""
        made = Door(self, finish, name, host)
        if self._last is None:
            self._last = made
        return made

    def handed(self, door: Door[Any], step: int) -> None:
        """Counts ``step`` handed out by ``door``: the filter's rejections in it."""
        self._last = door
        self.filter.handed(step)

    def stats(self) -> dict[str, float | int]:
        """See ``Loader.stats``: the read-ahead's of the door that handed out
        the last step (the first door made, before any), and the filter's."""
        feed = self._last.feed.stats() if self._last is not None else {}
        return {**feed, **self.filter.stats()}


class Door(Generic[Done]):
    """One consumer's steps of a :class:`StepEngine`, read ahead by a
    :class:`~flat_tokens_jax.loader.feed.Feed` of their own. Thread-safe.

    Args:
        engine: whose steps.
        finish: a step's second stage, ``finish(step, fetched, threads)`` on
            at most ``threads`` threads (``None``: the decoder's); a
            :class:`Blocks` is handed to it as read, and is not timed.
        name: the read-ahead threads' name prefix.
        host: whether the steps are decoded on the host whatever the config.
    """

    def __init__(
        self,
        engine: StepEngine,
        finish: Callable[[int, Fetched | Blocks, int | None], Done],
        name: str,
        host: bool = False,
    ) -> None:
        self.engine, self._finishing, self._name, self._host = engine, finish, name, host
        self.feed = Feed(
            engine.config,
            self._ahead,
            self._read,
            lambda s: engine.host_rows_at(s).size,
            engine.components,
        )
        self.wait_seconds = 0.0

    def _request(self, step: int, ahead: int) -> Callable[[], tuple[int, Fetched | Blocks]]:
        """Starts fetching ``step``; the function returned waits for it. The
        fetch is timed from its start to its end."""
        began = time.perf_counter()
        waiting = self.engine.request(step, ahead, self._host)

        def fetched() -> tuple[int, Fetched | Blocks]:
            out = waiting()
            self.feed.fetched(time.perf_counter() - began)
            return step, out

        return fetched

    def _finish(self, step: int, part: Fetched | Blocks, threads: int | None) -> Done:
        if isinstance(part, Blocks):  # decoded on the devices, in step order
            return self._finishing(step, part, threads)
        done: Done = timed(
            self.feed.measures.finished, lambda: self._finishing(step, part, threads)
        )
        return done

    def _ahead(self) -> Ahead[tuple[int, Fetched | Blocks], Done]:
        """Background threads that prepare steps in order, reading records
        for several steps per sampler call (see :mod:`~flat_tokens_jax.loader.pipeline`)."""
        return Ahead(
            lambda step: self._request(step, self.engine.lookup),
            lambda done: self._finish(*done, self.engine.ahead_threads),
            self._name,
            fetchers=self.feed.fetchers(),
        )

    def _read(self, step: int) -> Done:
        """A step prepared in the caller's thread."""
        return self._finish(*self._request(step, 0)(), None)

    def take(self, step: int, ahead: bool, end: int | None, deliver: Callable[[Done], Out]) -> Out:
        """``deliver`` of step ``step`` prepared (``ahead``: read ahead even
        after a jump; nothing read at or past ``end``); its wait, ``deliver``
        included, is measured and the next steps go on."""
        began = time.perf_counter()
        out = deliver(self.feed.take(step, ahead, end))
        now = time.perf_counter()
        self.wait_seconds = now - began
        self.feed.handed(step, now - began, now, end)
        self.engine.handed(self, step)
        return out

    def start(self, step: int, end: int | None) -> None:
        """Starts ``step`` and the steps after it (see ``Loader.start``)."""
        self.feed.start(step, end)

    def close(self) -> None:
        """Stops the read-ahead (a later step starts it again)."""
        self.feed.close()


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
