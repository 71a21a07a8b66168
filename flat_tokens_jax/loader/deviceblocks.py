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
    """A loader's steps as encoded blocks, decoded on the devices (the
    engine's ``host_blocks`` per batch size, ``source_ids`` and ``readers``)."""

    def __init__(
        self,
        sources: Sources,
        steps: StepSamples,
        sharding: jax.sharding.Sharding | None,
        host_blocks: dict[int, HostBlocks],
        source_ids: np.ndarray,
        readers: Callable[[int, np.ndarray], Sequence[Any]],
    ) -> None:
        config = sources.config
        self._readers, self.source_ids = readers, source_ids
        self.components, self.steps, self.sharding = sources.components, steps, sharding
        self.config, self.layout = config, config.batch_layout
        self._host_blocks = host_blocks if sharding is not None else None
        segments = [getattr(r, "segments", None) for r in sources.components]
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
        read = self._block_fields if here else self._block_data
        found = {b: read(step, b) for b in held.blocks}
        data = {b: d for b, (d, _) in found.items()}
        if self.layout.max_segments is not None and not here:
            where = f"step {step}"
            self.layout.check_blocks(data, self.config.seq_len, self.config.packing, where)
        by_rows = {b.rows: source for b, (_, source) in sorted(found.items())}
        return Blocks(held, data, np.concatenate(list(by_rows.values())), here)

    def encoded(self, step: int) -> dict[str, jax.Array]:
        """``Loader.encoded_batch``: ``encoded`` ``[batch_size, seq_len] uint32``
        (encoded tokens), ``before`` ``[batch_size, column shards] uint32`` (the
        token before each column shard), ``lengths`` ``[batch_size] int32`` (tokens
        of padded rows and bins), ``real`` ``[batch_size] bool`` (False for padding
        rows past the last epoch), ``stored_mask`` ``[batch_size, seq_len] uint8``
        when the data stores a loss mask, and ``source`` ``[batch_size] int32`` with
        ``config.source_field``; laid out as the loader's sharding (whole rows on
        one device without one)."""
        blocks = self.read(step, self.host_blocks_at(step))
        return blocks.host_blocks.encoded_arrays(blocks.data, source=self.layout.source)

    def decoder(self, step: int) -> Callable[[Mapping[str, jax.Array]], dict[str, jax.Array]]:
        return self.host_blocks_at(step).decoder(**self._decoding)

    def decode(self, blocks: Blocks) -> dict[str, jax.Array]:
        """The fields of ``blocks``; it runs collectives: call it in step order."""
        return blocks.host_blocks.assemble_blocks(blocks.data, **self._decoding)

    def _block_fields(self, step: int, block: Block) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """A block's layout, decoded here from its columns alone, and its rows' sources."""
        rows = np.arange(*block.rows, dtype=np.int64)
        g, real = self.steps.samples(step, rows)
        comp, records, _ = self.steps.lookup(g[real])
        (c0, c1), seq_len = block.cols, self.config.seq_len
        out = padding_fields(rows.size, c1 - c0, self.config.pad_id)
        row_starts = np.zeros(rows.size, bool)
        at, readers = np.flatnonzero(real), self._readers(step, rows)
        # The block's columns in the batch's order, as runs of the rows' own columns.
        cols = self._order[c0:c1]
        cuts = np.flatnonzero(np.diff(cols) != 1) + 1
        pieces = list(zip(np.r_[0, cuts].tolist(), np.r_[cuts, cols.size].tolist(), strict=True))
        for c in np.unique(comp).tolist():
            mine, idx = at[comp == c], records[comp == c]
            run_row, run_length = self._segments[c](idx)
            packing = self.components[c].packing
            lengths = np.full(idx.size, seq_len)
            if packing is not Packing.WINDOWS:
                lengths = np.bincount(run_row, run_length, idx.size).astype(np.int64)
            for lo, hi in pieces:
                first = int(cols[lo])
                encoded, mask = self._piece(readers[c], packing, idx, first, first + hi - lo)
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

    @staticmethod
    def _piece(
        reader: Any, packing: Packing, idx: np.ndarray, first: int, stop: int
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """Records ``idx``'s columns ``[first, stop)`` as windows (column 0 the
        token before ``first``) and their stored mask; a padded row's read holds
        no token before its columns, so one more is read."""
        early = int(packing is Packing.PADDED and first > 0)
        windows = reader.read(idx, columns=(first - early, stop))
        encoded, mask = windows.encoded, windows.stored_mask
        if packing is Packing.PADDED and not early:
            encoded = np.pad(encoded, ((0, 0), (1, 0)))
        elif early and mask is not None:
            mask = mask[:, 1:]
        return encoded, mask

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
