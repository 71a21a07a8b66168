"""A step's blocks for decoding on the devices (``decode="device"``, or the
sequence dimension sharded): each block of this host's devices read as encoded
tokens (its columns only), and decoded into global ``jax.Array``\\ s there;
or, the sequence dimension sharded and decoded on the host, each block decoded
here from its columns alone (the rows' sequence boundaries give the segment id
and position its columns continue), so no host or device gathers a row.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from flat_tokens_jax.core.fields import Packing
from flat_tokens_jax.data.dataset import FlatTokens
from flat_tokens_jax.data.records import request_windows
from flat_tokens_jax.decoding.batch import FIELDS, chunk_fields, padding_fields, run_carry
from flat_tokens_jax.decoding.hostdecode import row_sources
from flat_tokens_jax.decoding.layouts import zigzag_order
from flat_tokens_jax.decoding.sharding import Block, BlockData, HostBlocks, host_blocks_per_size
from flat_tokens_jax.loader.sources import Sources
from flat_tokens_jax.sampling.stepsamples import StepSamples


@dataclasses.dataclass(frozen=True)
class Blocks:
    """A step's blocks read on this host: encoded, to be decoded on the devices,
    or their fields decoded here (``decoded``); ``sources`` ``[k] int32`` the
    run-wide source of each of this host's rows (``host_blocks.rows``), ``-1``
    for padding."""

    host_blocks: HostBlocks
    data: dict[Block, Any]
    sources: np.ndarray
    decoded: bool = False


class DeviceBlocks:
    """A loader's steps as encoded blocks, decoded on the devices or here (the
    engine's ``host_blocks`` per size, ``source_ids``, ``readers``, ``segments``)."""

    def __init__(
        self,
        sources: Sources,
        steps: StepSamples,
        sharding: jax.sharding.Sharding | None,
        host_blocks: dict[int, HostBlocks],
        source_ids: np.ndarray,
        readers: Callable[[int, np.ndarray], Sequence[Any]],
        segments: Sequence[Any],
    ) -> None:
        config = sources.config
        self._readers, self.source_ids = readers, source_ids
        self.components, self.steps, self.sharding = sources.components, steps, sharding
        self.config, self.layout = config, config.batch_layout
        self._host_blocks = host_blocks if sharding is not None else None
        # Decoded here from its columns alone: what a block needs of whole rows is known.
        self.here = (
            config.decode == "host"
            and config.instance_filter is None
            and self.layout.max_segments is None
            and self.layout.name != "tokens"
            and all(map(callable, segments))
        )
        self._segments = segments
        self._start_token_id = sources.start_token_id
        # A block is laid out in the batch's column order already: not reordered again.
        self._block_layout = dataclasses.replace(self.layout, context_parallel=1)
        self._order = zigzag_order(config.seq_len, config.context_parallel)
        # Whether a step ships a stored loss mask: unless every component is
        # a split known to store none (custom records may).
        fts = [getattr(r, "ft", None) for r in sources.components]
        self._ships_mask = not all(isinstance(f, FlatTokens) and f.loss_mask is None for f in fts)
        self._decoding: dict[str, Any] = {
            "packing": config.packing,
            "start_token_id": sources.start_token_id,
            "pad_id": config.pad_id,
            "instance_filter": config.instance_filter,
            "layout": self.layout,
        }
        self._jitted: dict[HostBlocks, Callable[..., Any]] = {}  # decoder, by batch size

    def host_blocks_at(self, step: int) -> HostBlocks:
        if self._host_blocks is None:  # no sharding: whole batches on the default device
            mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("batch",))
            one = NamedSharding(mesh, PartitionSpec())
            self._host_blocks = host_blocks_per_size(one, self.config.schedule, self.config.seq_len)
        held = self._host_blocks.get(self.steps.size(step))
        if held is None or not isinstance(held.sharding, NamedSharding):
            raise ValueError(
                "decoding on the devices needs a NamedSharding (or no sharding), got "
                f"{self.sharding!r}: use NamedSharding(mesh, PartitionSpec(...))"
            )
        return held

    def read(self, step: int, held: HostBlocks, here: bool = False) -> Blocks:
        """The blocks of ``step``; ``here``: decoded on this host (see the module)."""
        rows_of: dict[tuple[int, int], Any] = {}
        found = {
            b: self._block_fields(step, b, rows_of) if here else self._block_data(step, b)
            for b in held.blocks
        }
        data = {b: d for b, (d, _) in found.items()}
        if self.layout.max_segments is not None and not here:
            where = f"step {step}"
            self.layout.check_blocks(data, self.config.seq_len, self.config.packing, where)
        by_rows = {b.rows: source for b, (_, source) in sorted(found.items())}
        return Blocks(held, data, np.concatenate(list(by_rows.values())), here)

    def encoded(self, step: int) -> dict[str, jax.Array]:
        """``Loader.encoded_batch``: its arrays and their shapes are docs/guide/multihost.md's
        (``lengths``: tokens of padded rows and bins; ``real``: False for padding rows)."""
        blocks = self.read(step, self.host_blocks_at(step))
        return blocks.host_blocks.encoded_arrays(blocks.data, source=self.layout.source)

    def decoder(self, step: int) -> Callable[[Mapping[str, jax.Array]], dict[str, jax.Array]]:
        return self.host_blocks_at(step).decoder(**self._decoding)

    def decode(self, blocks: Blocks) -> dict[str, jax.Array]:
        """The fields of ``blocks``; it runs collectives: call it in step order."""
        held = blocks.host_blocks
        if held not in self._jitted:
            self._jitted[held] = jax.jit(held.decoder(**self._decoding))
        out: dict[str, jax.Array] = self._jitted[held](
            held.encoded_arrays(blocks.data, source=self.layout.source)
        )
        return out

    def _block_fields(
        self, step: int, block: Block, rows_of: dict[tuple[int, int], Any]
    ) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """A block's layout, decoded here from its columns alone, and its rows'
        sources; ``rows_of``: what blocks of the same rows share (their records
        and sequence boundaries), filled by the first."""
        if block.rows not in rows_of:
            rows_of[block.rows] = self._rows_of(step, block.rows)
        real, comp, parts, readers = rows_of[block.rows]
        (c0, c1), n = block.cols, real.size
        out = padding_fields(n, c1 - c0, self.config.pad_id)
        row_starts = np.zeros(n, bool)
        # The block's columns in the batch's order, as runs of the rows' own columns.
        cols = self._order[c0:c1]
        cuts = np.flatnonzero(np.diff(cols) != 1) + 1
        pieces = list(zip(np.r_[0, cuts].tolist(), np.r_[cuts, cols.size].tolist(), strict=True))
        # Every piece's reads requested before any is waited for: one round trip.
        asked = [
            (c, lo, hi, self._piece(readers[c], part[0], part[1], int(cols[lo]), hi - lo))
            for c, part in parts.items()
            for lo, hi in pieces
        ]
        for c, lo, hi, waiting in asked:
            _, idx, mine, run_row, run_length, lengths = parts[c]
            encoded, mask = waiting()
            first = int(cols[lo])
            fields = chunk_fields(
                encoded,
                lengths,
                first,
                run_carry(run_row, run_length, idx.size, first - 1),
                start_token_id=self._start_token_id,
                pad_id=self.config.pad_id,
                stored_mask=mask,
            )
            for key in FIELDS:
                out[key][mine, lo:hi] = fields[key]
            if lo == 0:
                row_starts[mine] = (encoded[:, 1] & 1) == 1
        sources = row_sources(comp, real, self.source_ids)
        laid_out = self._block_layout.apply(out, row_starts, where=f"step {step}", sources=sources)
        return laid_out, sources

    def _rows_of(self, step: int, span: tuple[int, int]) -> tuple[Any, ...]:
        """Rows ``span`` at ``step``: which are real, their components, per
        component ``(packing, records, rows, segments' rows and lengths, lengths
        before padding)``, and the readers."""
        rows = np.arange(*span, dtype=np.int64)
        g, real = self.steps.samples(step, rows)
        comp, records, _ = self.steps.lookup(g[real])
        at, parts = np.flatnonzero(real), {}
        for c in np.unique(comp).tolist():
            idx, packing = records[comp == c], self.components[c].packing
            run_row, run_length = self._segments[c](idx)
            lengths = np.full(idx.size, self.config.seq_len)
            if packing is not Packing.WINDOWS:
                lengths = np.bincount(run_row, run_length, idx.size).astype(np.int64)
            parts[c] = (packing, idx, at[comp == c], run_row, run_length, lengths)
        return real, comp, parts, self._readers(step, rows)

    @staticmethod
    def _piece(
        reader: Any, packing: Packing, idx: np.ndarray, first: int, width: int
    ) -> Callable[[], tuple[np.ndarray, np.ndarray | None]]:
        """Starts reading records ``idx``'s columns ``[first, first + width)``;
        the function returned gives them as windows (column 0 the token before
        ``first``) and their stored mask. A padded row's read holds no token
        before its columns, so one more is read."""
        early = int(packing is Packing.PADDED and first > 0)
        waiting = request_windows(reader, idx, (first - early, first + width))

        def windows() -> tuple[np.ndarray, np.ndarray | None]:
            read = waiting()
            encoded, mask = read.encoded, read.stored_mask
            if packing is Packing.PADDED and not early:
                encoded = np.pad(encoded, ((0, 0), (1, 0)))
            elif early and mask is not None:
                mask = mask[:, 1:]
            return encoded, mask

        return windows

    def _block_data(self, step: int, block: Block) -> tuple[BlockData, np.ndarray]:
        g, real = self.steps.samples(step, np.arange(*block.rows, dtype=np.int64))
        comp, records, _ = self.steps.lookup(g[real])
        n, width = g.size, block.cols[1] - block.cols[0]
        encoded = np.zeros((n, width), np.uint32)
        before = np.zeros((n, 1), np.uint32)
        lengths = np.zeros(n, np.int32)
        mask = np.ones((n, width), np.uint8) if self._ships_mask else None
        at = np.flatnonzero(real)
        readers = self._readers(step, np.arange(*block.rows, dtype=np.int64))
        for c in np.unique(comp).tolist():
            rows = at[comp == c]
            windows = readers[c].read(records[comp == c], columns=block.cols)
            packing = self.components[c].packing
            if packing is not Packing.PADDED:  # windows and bins: their column 0 is before
                encoded[rows], before[rows, 0] = windows.encoded[:, 1:], windows.encoded[:, 0]
            else:
                encoded[rows] = windows.encoded
            if packing is not Packing.WINDOWS:
                assert windows.lengths is not None
                lengths[rows] = windows.lengths
            if windows.stored_mask is not None and mask is not None:
                mask[rows] = windows.stored_mask
        sources = row_sources(comp, real, self.source_ids)
        return BlockData(encoded, before, lengths, mask, real, sources), sources
