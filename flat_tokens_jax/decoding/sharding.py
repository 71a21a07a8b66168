"""Global ``jax.Array`` batches in which each host loaded only its own (row range,
column range) blocks (docs/guide/multihost.md)."""

from __future__ import annotations

import dataclasses
import importlib
import math
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from flat_tokens_jax.core.fields import Packing
from flat_tokens_jax.decoding.batch_jax import (
    bin_fields_jax,
    blank_rows_jax,
    packed_fields_jax,
    padded_fields_jax,
)
from flat_tokens_jax.decoding.instancefilter import InstanceFilter, apply_filter_jax
from flat_tokens_jax.decoding.layouts import PLAIN, WHOLE_ROWS, BatchLayout
from flat_tokens_jax.sampling.schedule import BatchSchedule


@dataclasses.dataclass(frozen=True, order=True)
class Block:
    """Rows ``[rows[0], rows[1])`` and columns ``[cols[0], cols[1])`` of a batch."""

    rows: tuple[int, int]
    cols: tuple[int, int]

    @property
    def num_rows(self) -> int:
        return self.rows[1] - self.rows[0]


@dataclasses.dataclass(frozen=True)
class BlockData:
    """What a host read for one block: the block's rows and columns of
    :meth:`HostBlocks.encoded_arrays` (``before`` ``[rows, 1]``; ``stored_mask``
    ``None`` when no record of the loader has one)."""

    encoded: np.ndarray
    before: np.ndarray
    lengths: np.ndarray
    stored_mask: np.ndarray | None
    real: np.ndarray
    source: np.ndarray


def _block(index: tuple[slice, ...] | None, shape: tuple[int, int]) -> Block:
    spans = [s.indices(n)[:2] for s, n in zip(index or (), shape, strict=False)]
    spans += [(0, n) for n in shape[len(spans) :]]
    return Block(rows=spans[0], cols=spans[1])


def _axis_shards(sharding: NamedSharding, dim: int) -> tuple[int, tuple[str, ...]]:
    spec = tuple(sharding.spec) + (None,) * 2
    entry = spec[dim]
    names: tuple[str, ...] = (
        () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))
    )
    return math.prod(sharding.mesh.shape[n] for n in names), names


def check_divisible(sharding: jax.sharding.Sharding, batch_size: int, seq_len: int) -> None:
    """Refuses a batch shape that the sharding cannot split evenly."""
    shape = (batch_size, seq_len)
    if isinstance(sharding, NamedSharding):
        if len(sharding.spec) > 2:
            raise ValueError(
                f"the partition spec {sharding.spec} has more than the 2 "
                "dimensions of a batch [batch_size, seq_len]"
            )
        for dim, (name, size) in enumerate((("global batch", batch_size), ("seq_len", seq_len))):
            shards, axes = _axis_shards(sharding, dim)
            if size % shards:
                raise ValueError(
                    f"{name} {size} does not divide over {shards} shards (mesh "
                    f"axes {axes} of sizes "
                    f"{tuple(sharding.mesh.shape[a] for a in axes)})"
                )
        return
    sizes = {
        (b.num_rows, b.cols[1] - b.cols[0])
        for b in (_block(i, shape) for i in sharding.devices_indices_map(shape).values())
    }
    if len(sizes) > 1:
        raise ValueError(
            f"the sharding splits a [{batch_size}, {seq_len}] batch unevenly: "
            f"block shapes {sorted(sizes)}"
        )


class HostBlocks:
    """The distinct ``blocks`` (sorted) of a ``[batch_size, seq_len]`` batch that
    this host's devices hold, the ``rows`` ``[k] int64`` they cover, ascending,
    and whether some block is less than whole rows (``columns_sharded``)."""

    def __init__(self, sharding: jax.sharding.Sharding, batch_size: int, seq_len: int) -> None:
        check_divisible(sharding, batch_size, seq_len)
        self.sharding, self.shape = sharding, (batch_size, seq_len)
        index_map = sharding.addressable_devices_indices_map(self.shape)
        self.blocks = sorted({_block(idx, self.shape) for idx in index_map.values()})
        self.rows = np.unique(np.concatenate([np.arange(*b.rows) for b in self.blocks]))
        self.columns_sharded = any(b.cols != (0, seq_len) for b in self.blocks)
        if self.columns_sharded and not isinstance(sharding, NamedSharding):
            raise ValueError("sharding the sequence dimension needs a NamedSharding")

    def __repr__(self) -> str:
        return f"HostBlocks({len(self.blocks)} blocks, {self.rows.size} rows of {self.shape})"

    def assemble_rows(self, host: Mapping[str, np.ndarray]) -> dict[str, jax.Array]:
        """Global arrays from this host's whole rows (``host[k]`` ``[rows.size, ...]``)."""

        def make(key: str, values: np.ndarray) -> jax.Array:
            shape = (self.shape[0], *values.shape[1:])
            sharding = self.rows_sharding(values.ndim) if key in WHOLE_ROWS else self.sharding

            def piece(index: tuple[slice, ...] | None) -> np.ndarray:
                b = _block(index, (shape[0], shape[-1] if values.ndim > 1 else 1))
                at = int(np.searchsorted(self.rows, b.rows[0]))
                if values.ndim == 1:
                    return values[at : at + b.num_rows]
                return values[at : at + b.num_rows, b.cols[0] : b.cols[1]]

            return jax.make_array_from_callback(shape, sharding, piece)

        return {k: make(k, v) for k, v in host.items()}

    def assemble_fields(
        self, data: Mapping[Block, Mapping[str, np.ndarray]]
    ) -> dict[str, jax.Array]:
        """Global arrays from fields decoded block by block (``data[b][key]``:
        block ``b``'s rows and columns, or its rows of a per-row field)."""
        by_rows = {b.rows: fields for b, fields in data.items()}

        def make(key: str, example: np.ndarray) -> jax.Array:
            if key not in WHOLE_ROWS:
                pieces = lambda index: data[_block(index, self.shape)][key]  # noqa: E731
                return jax.make_array_from_callback(self.shape, self.sharding, pieces)
            shape = (self.shape[0], *example.shape[1:])

            def rows(index: tuple[slice, ...] | None) -> np.ndarray:
                return by_rows[_block(index, (shape[0], 1)).rows][key]

            return jax.make_array_from_callback(shape, self.rows_sharding(example.ndim), rows)

        return {key: make(key, value) for key, value in next(iter(data.values())).items()}

    def rows_sharding(self, ndim: int = 2) -> jax.sharding.Sharding:
        """The sharding's split of the batch axis alone, for ``ndim`` dimensions."""
        if not isinstance(self.sharding, NamedSharding):
            raise ValueError(
                "a layout with tokens, segment_lengths or source needs a NamedSharding, "
                f"got {self.sharding!r}: "
                "use NamedSharding(mesh, PartitionSpec(...))"
            )
        spec = tuple(self.sharding.spec) + (None,) * 2
        return NamedSharding(self.sharding.mesh, PartitionSpec(spec[0], *[None] * (ndim - 1)))

    def encoded_arrays(
        self, data: Mapping[Block, BlockData], source: bool = False
    ) -> dict[str, jax.Array]:
        """Global arrays of what the blocks hold, laid out as the batch is: the
        ``encoded_batch`` of docs/guide/multihost.md."""
        assert isinstance(self.sharding, NamedSharding)
        mesh, spec = self.sharding.mesh, tuple(self.sharding.spec) + (None,) * 2
        col_shards, _ = _axis_shards(self.sharding, 1)
        by_rows = {b.rows: d for b, d in data.items()}
        width = self.shape[1] // col_shards

        def make(
            shape: tuple[int, ...], part: PartitionSpec, take: Callable[[Block], np.ndarray]
        ) -> jax.Array:
            def piece(index: tuple[slice, ...] | None) -> np.ndarray:
                full = _block(index, (shape[0], shape[1] if len(shape) > 1 else 1))
                if len(shape) == 1:
                    return take(Block(full.rows, (-1, -1)))
                cols = (
                    full.cols
                    if shape[1] == self.shape[1]
                    else (full.cols[0] * width, full.cols[0] * width + width)
                )
                return take(Block(full.rows, cols))

            return jax.make_array_from_callback(shape, NamedSharding(mesh, part), piece)

        batch, seq = self.shape
        rows_part, both = PartitionSpec(spec[0]), PartitionSpec(spec[0], spec[1])
        out = {
            "encoded": make((batch, seq), both, lambda b: data[b].encoded),
            "before": make((batch, col_shards), both, lambda b: data[b].before),
            "lengths": make((batch,), rows_part, lambda b: by_rows[b.rows].lengths),
            "real": make((batch,), rows_part, lambda b: by_rows[b.rows].real),
        }
        if source:
            out["source"] = make((batch,), rows_part, lambda b: by_rows[b.rows].source)
        if any(d.stored_mask is not None for d in data.values()):
            masks = {
                b: np.ones(d.encoded.shape, np.uint8) if d.stored_mask is None else d.stored_mask
                for b, d in data.items()
            }
            out["stored_mask"] = make((batch, seq), both, masks.__getitem__)
        return out

    def decoder(
        self,
        packing: Packing,
        start_token_id: int,
        pad_id: int,
        instance_filter: InstanceFilter | None = None,
        layout: BatchLayout = PLAIN,
    ) -> Callable[[Mapping[str, jax.Array]], dict[str, jax.Array]]:
        """The function (to call inside ``jax.jit``) from :meth:`encoded_arrays`
        to the fields of ``layout``, laid out as :meth:`assemble_rows` lays them out."""
        assert isinstance(self.sharding, NamedSharding)
        mesh, spec = self.sharding.mesh, tuple(self.sharding.spec) + (None,) * 2
        # Segment ids and positions scan whole rows: decode on row-sharded
        # copies (columns gathered on device), then lay the fields out as asked.
        whole_rows = NamedSharding(mesh, PartitionSpec(spec[0], None))
        by_row = NamedSharding(mesh, PartitionSpec(spec[0]))
        explicit = jax.sharding.AxisType.Explicit in mesh.axis_types
        lay_out = _reshard() if explicit else jax.lax.with_sharding_constraint
        sharding = self.sharding

        def decode(encoded: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
            mask = encoded.get("stored_mask")
            rows = lay_out(encoded["encoded"], whole_rows)
            fields = _decode(
                rows,
                lay_out(encoded["before"], whole_rows),
                encoded["lengths"],
                None if mask is None else lay_out(mask, whole_rows),
                encoded["real"],
                packing=packing,
                start_token_id=start_token_id,
                pad_id=pad_id,
            )
            fields = apply_filter_jax(instance_filter, fields)
            if not layout.plain:
                starts = (
                    (rows[:, 0] & 1) == 1 if packing is Packing.WINDOWS else encoded["lengths"] > 0
                )
                sources = encoded.get("source")
                fields = layout.apply(fields, starts & encoded["real"], xp=jnp, sources=sources)
            rows_only = {1: by_row, 2: whole_rows}
            return {
                k: lay_out(v, rows_only[v.ndim] if k in WHOLE_ROWS else sharding)
                for k, v in fields.items()
            }

        return decode


def _decode(
    encoded: jax.Array,
    before: jax.Array,
    lengths: jax.Array,
    stored_mask: jax.Array | None,
    real: jax.Array,
    *,
    packing: Packing,
    start_token_id: int,
    pad_id: int,
) -> dict[str, jax.Array]:
    if packing is Packing.BINS:
        windows = jnp.concatenate([before[:, :1], encoded], axis=1)
        fields = bin_fields_jax(
            windows, lengths, start_token_id=start_token_id, pad_id=pad_id, stored_mask=stored_mask
        )
    elif packing is Packing.WINDOWS:
        windows = jnp.concatenate([before[:, :1], encoded], axis=1)
        fields = packed_fields_jax(windows, start_token_id=start_token_id, stored_mask=stored_mask)
    else:
        fields = padded_fields_jax(
            encoded, lengths, start_token_id=start_token_id, pad_id=pad_id, stored_mask=stored_mask
        )
    return blank_rows_jax(fields, real[:, None], pad_id)


def host_blocks_per_size(
    sharding: jax.sharding.Sharding | None, schedule: BatchSchedule, seq_len: int
) -> dict[int, HostBlocks]:
    """This host's blocks for each batch size of ``schedule`` (none without a sharding)."""
    held: dict[int, HostBlocks] = {}
    if sharding is None:
        return held
    for step, size in schedule.entries:
        if size not in held:
            try:
                held[size] = HostBlocks(sharding, size, seq_len)
            except ValueError as e:
                if schedule.constant is not None:
                    raise
                raise ValueError(
                    f"batch_size entry ({step}, {size}): from step {step} {e}; choose "
                    "sizes that divide over the mesh"
                ) from None
    return held


def _reshard() -> Callable[[jax.Array, NamedSharding], jax.Array]:
    """``jax.sharding.reshard``, or ``jax.experimental.shard.reshard`` on jax 0.6."""
    public = getattr(jax.sharding, "reshard", None)
    if public is not None:
        return public
    return importlib.import_module("jax.experimental.shard").reshard
