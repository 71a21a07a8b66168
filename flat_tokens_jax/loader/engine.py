"""The step engine: a step, this host's rows of it, their records and their fields in
the configured layout, in two stages (:meth:`StepEngine.request` starts the reads,
:meth:`StepEngine.finish` decodes) that the loader's read-ahead runs."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from flat_tokens_jax.core import fields
from flat_tokens_jax.data.bins import BinRecords
from flat_tokens_jax.data.records import Windows
from flat_tokens_jax.decoding.hostdecode import (
    BlockDecoder,
    RowDecode,
    default_threads,
    request_parts,
    row_sources,
)
from flat_tokens_jax.decoding.instancefilter import FilteredRows
from flat_tokens_jax.decoding.sharding import HostBlocks, host_blocks_per_size
from flat_tokens_jax.loader.blockcache import BlockCache
from flat_tokens_jax.loader.deviceblocks import Blocks, DeviceBlocks
from flat_tokens_jax.loader.sources import Sources
from flat_tokens_jax.sampling.balance import attention_costs
from flat_tokens_jax.sampling.steering import Steering
from flat_tokens_jax.sampling.stepsamples import LOOKUP_AHEAD, StepSamples


@dataclasses.dataclass(frozen=True)
class Fetched:
    """A step's rows on this host, read, still to be decoded: ``parts`` holds
    ``(component, rows, windows)`` (``rows`` ``None`` for all of them);
    ``sources`` ``[rows] int32`` each row's run-wide source, ``-1`` for padding."""

    rows: int
    parts: list[tuple[int, np.ndarray | None, Windows]]
    sources: np.ndarray


class StepEngine:
    """A loader's steps as this host's records and fields.

    Args:
        streams: component ``c``'s ``(seed, offset)``, where its stream goes on (a
            phase's); ``None``: the config's seeds, from sample 0.
        source_names: the run's sources (a phase's components are numbered over
            the run); ``None``: the components'.
        rows: without a sharding, the rows of each batch size this host reads (a
            grain worker's: its parent's); ``None``: all of them.

    Attributes:
        sent: why the engine's steering is fixed (its steps went to grain's
            worker processes), or ``None``.
    """

    def __init__(
        self,
        sources: Sources,
        sharding: jax.sharding.Sharding | None = None,
        streams: Sequence[tuple[int, int]] | None = None,
        source_names: Sequence[str] | None = None,
        rows: dict[int, np.ndarray] | None = None,
    ) -> None:
        config = sources.config
        self.sources, self.config, self.sharding = sources, config, sharding
        self.layout = config.batch_layout
        self.mixture, self.components = sources.mixture, sources.components
        self.names, self.start_token_id = sources.names, sources.start_token_id
        self.source_names = self.names if source_names is None else tuple(source_names)
        # Each component's index among the run's sources: what `source` holds.
        self.source_ids = np.array([self.source_names.index(n) for n in self.names], np.int32)
        self.records = sources.records
        self.samplers = sources.samplers(streams)
        self.sampler = self.samplers[0]
        self.schedule = config.schedule
        self._host_blocks = host_blocks_per_size(sharding, self.schedule, config.seq_len)
        self._rows = rows or {}
        self.sent: str | None = None
        # A constant batch size gives every step the same blocks and rows (skips
        # change which data a step reads, never its size): worked out once.
        self._fixed: tuple[HostBlocks | None, np.ndarray] | None = None
        constant = self.schedule.constant
        if constant is not None:
            held = self._host_blocks.get(constant)
            fixed = self._rows.get(constant, np.arange(constant, dtype=np.int64))
            fixed = fixed if held is None else held.rows
            fixed.setflags(write=False)
            self._fixed = (held, fixed)
        balance = None
        # Each component's segments(indices), where its records have one.
        self._segments = [getattr(r, "segments", None) for r in self.components]
        if config.balance_groups > 1:
            balance = (config.balance_groups, self._costs)
            for name, records, segments in zip(
                self.names, self.components, self._segments, strict=True
            ):
                if not callable(segments):
                    raise TypeError(
                        f"balance_groups needs each component's segment lengths, but "
                        f"{name!r} ({records!r}) has no segments(indices)"
                    )
        self.steps = StepSamples(
            self.samplers,
            self.mixture,
            self.schedule,
            self.host_rows_at,
            config.num_epochs,
            balance=balance,
        )
        # Under the block shuffle, rows are taken from whole blocks, each read once.
        self.block_cache = (
            BlockCache(self.components, self.samplers, sources.block, sources.block_cache_bytes)
            if config.shuffle == fields.BLOCKS
            else None
        )
        self.blocks = DeviceBlocks(
            sources,
            self.steps,
            sharding,
            self._host_blocks,
            self.source_ids,
            self.readers,
            self._segments,
        )
        self.block_decoder = BlockDecoder(config.decode_threads or default_threads())
        self.filter = FilteredRows(config.instance_filter, self.block_decoder.run_blocks)
        packings = tuple(r.packing for r in self.components)
        self.decode = RowDecode(
            packings, config.seq_len, self.start_token_id, config.pad_id, self.layout, self.filter
        )
        # Steps whose samples one sampler call looks up, reading ahead.
        self.lookup = max(config.prefetch or 0, LOOKUP_AHEAD)
        if config.decode == "device" and rows is None:
            self.blocks.host_blocks_at(0)  # refuses a sharding it cannot decode under

    def __repr__(self) -> str:
        return f"StepEngine({self.records!r}, {self.config!r})"

    def host_blocks_at(self, step: int) -> HostBlocks | None:
        if self._fixed is not None:
            return self._fixed[0]
        return self._host_blocks.get(self.steps.size(step))

    def host_rows_at(self, step: int) -> np.ndarray:
        if self._fixed is not None:
            return self._fixed[1]
        held = self.host_blocks_at(step)
        if held is not None:
            return held.rows
        size = self.steps.size(step)
        rows = self._rows.get(size)
        return np.arange(size, dtype=np.int64) if rows is None else rows

    @property
    def num_batches(self) -> int | None:
        return self.steps.num_batches

    def _costs(self, comp: np.ndarray, records: np.ndarray) -> np.ndarray:
        """The attention cost of each record (of component ``comp``) as a row."""
        out = np.zeros(comp.size, np.int64)
        for c in np.unique(comp).tolist():
            here = comp == c
            row, length = self._segments[c](records[here])
            out[here] = attention_costs(row, length, int(here.sum()))
        return out

    def readers(self, step: int, rows: np.ndarray) -> Sequence[Any]:
        """What reads each component's records for ``rows`` at ``step`` (under the
        block shuffle, the block cache's)."""
        if self.block_cache is None:
            return self.components
        return self.block_cache.readers(self.steps, step, rows)

    def request_rows(self, step: int, rows: np.ndarray, ahead: int = 0) -> Callable[[], Fetched]:
        """Starts reading the records of ``rows`` at ``step``; the function returned waits."""
        comp, records, real = self.steps.records(step, rows, ahead)
        waiting = request_parts(self.readers(step, rows), comp, records, real)
        sources = row_sources(comp, real, self.source_ids)
        return lambda: Fetched(rows.size, waiting(), sources)

    def fields(
        self, fetched: Fetched, step: int, threads: int | None = None, counted: bool = True
    ) -> dict[str, np.ndarray]:
        """The layout's fields of records read by :meth:`request_rows` at ``step``,
        after the instance filter (its rejections noted when ``counted``)."""
        return self.decode.fields(
            self.block_decoder,
            fetched.rows,
            fetched.parts,
            fetched.sources,
            where=f"step {step}",
            rows=None if self.layout.plain else self.host_rows_at(step),
            step=step if counted else None,
            threads=threads,
        )

    def finish(self, part: Fetched | Blocks, step: int, threads: int | None, host: bool) -> Any:
        """A step's second stage: its fields decoded on at most ``threads``
        threads and, unless ``host``, placed on the devices; blocks are returned
        as the call that decodes them on the devices (it runs collectives across
        hosts: call it in step order). Safe in any thread."""
        if isinstance(part, Blocks):
            if part.decoded:
                return part.host_blocks.assemble_fields(part.data)
            return functools.partial(self.blocks.decode, part)
        fields = self.fields(part, step, threads)
        if host:
            return fields
        held = self.host_blocks_at(step)
        return jax.device_put(fields) if held is None else held.assemble_rows(fields)

    def host_batch(self, step: int) -> dict[str, np.ndarray]:
        fetched = self.request_rows(step, self.host_rows_at(step))()
        return self.fields(fetched, step, counted=False)

    def request(
        self, step: int, ahead: int = 0, host: bool = False
    ) -> Callable[[], Fetched | Blocks]:
        """Starts a step's first stage; the function returned waits for its records,
        or, to be decoded on the devices (``decode="device"``, or the sequence
        dimension sharded; unless ``host``), gives its blocks (read here)."""
        if host:
            return self.request_rows(step, self.host_rows_at(step), ahead)
        device = self.config.decode == "device"
        held = self.blocks.host_blocks_at(step) if device else self.host_blocks_at(step)
        if held is not None and (device or held.columns_sharded):
            blocks = self.blocks.read(step, held, here=not device and self.blocks.here)
            return lambda: blocks
        return self.request_rows(step, self.host_rows_at(step), ahead)

    def provenance(self, step: int) -> list[dict[str, Any]]:
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

    def restream(self, streams: Sequence[tuple[int, int]]) -> None:
        """Continues component ``c``'s stream at ``streams[c]``, its ``(seed, offset)``."""
        self.samplers[:] = self.sources.samplers(streams)
        self.sampler = self.samplers[0]
        self.steer(self.steps.steering)

    def steer(self, steering: Steering) -> None:
        """Reads with ``steering`` from now on (the steps read ahead are the
        caller's to drop); refused once the steps went to grain's workers."""
        if self.sent is not None:
            raise ValueError(self.sent)
        self.steps.steer(steering)

    def stats(self) -> dict[str, Any]:
        cache = {} if self.block_cache is None else self.block_cache.stats()
        return {**self.filter.stats(), **cache}
