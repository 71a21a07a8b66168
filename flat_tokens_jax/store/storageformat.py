"""The storage format of a dataset's arrays (:class:`StorageFormat`), and creating
them, so that a streaming writer and a distributed one write the same bytes."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import tensorstore as ts

from flat_tokens_jax.core.format import SEQ_STARTS
from flat_tokens_jax.store.arrays import TensorStoreArray
from flat_tokens_jax.store.digests import DIGESTS, attribute, chunk_digests
from flat_tokens_jax.store.probes import ATTRIBUTE as PROBES
from flat_tokens_jax.store.probes import probe_attribute
from flat_tokens_jax.store.store import EVERY_CHUNK_STORED, V2_ATTRS, V3_META, Store

# The size arrays are created with when the final one is not known yet; the
# writer shrinks them to their size at the end (a metadata-only resize).
PROVISIONAL_SIZE = 1 << 50


@dataclasses.dataclass(frozen=True)
class StorageFormat:
    """How a dataset's arrays are stored: zarr version, shard and chunk sizes,
    compression and checksums. Fields left unset take the defaults of the zarr
    version (docs/format.md, "Default layout").

    Attributes:
        zarr_format: 3 (default) or 2, for readers that only know zarr v2.
        shard_tokens: tokens per shard file (zarr v3) or per chunk file (zarr v2),
            each written once, whole.
        chunk_tokens: tokens per inner chunk of a shard, the unit of a read in zarr
            v3 (a random read of ``L`` tokens fetches about ``L + chunk_tokens``);
            divides ``shard_tokens``; in zarr v2 (no inner chunks) equal to it.
        compression: ``None``, ``"zstd"``, or (zarr v2 only) ``"blosc"``: blosc
            with zstd inside and byte shuffling.
        zstd_level: zstd level, 1 (fast) to 22 (for blosc, its clevel: at most 9).
        checksum: zarr v3 only: a crc32c after every inner chunk (and the shard
            index), so that a flipped byte fails the read instead of reading as a token.
    """

    zarr_format: int = 3
    shard_tokens: int = None  # type: ignore[assignment]  # set in __post_init__
    chunk_tokens: int = None  # type: ignore[assignment]
    compression: str | None = "default"
    zstd_level: int = 3
    checksum: bool = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.zarr_format not in (2, 3):
            raise ValueError(f"StorageFormat.zarr_format must be 2 or 3, got {self.zarr_format!r}")
        v2 = self.zarr_format == 2
        if self.shard_tokens is None:
            default = self.chunk_tokens if v2 and self.chunk_tokens is not None else None
            object.__setattr__(self, "shard_tokens", default or (1 << 20 if v2 else 1 << 24))
        if self.chunk_tokens is None:
            object.__setattr__(self, "chunk_tokens", self.shard_tokens if v2 else 1 << 13)
        if self.compression == "default":
            object.__setattr__(self, "compression", "blosc" if v2 else None)
        if self.checksum is None:
            object.__setattr__(self, "checksum", not v2)
        if v2 and self.checksum:
            raise ValueError(
                "StorageFormat.checksum=True needs zarr_format=3: zarr v2 has no checksum codec "
                "that tensorstore reads"
            )
        if self.chunk_tokens < 2 or self.shard_tokens < 2:
            raise ValueError(
                f"StorageFormat.chunk_tokens ({self.chunk_tokens}) and shard_tokens "
                f"({self.shard_tokens}) must be at least 2"
            )
        if self.shard_tokens % self.chunk_tokens:
            raise ValueError(
                f"StorageFormat.chunk_tokens {self.chunk_tokens} must divide "
                f"shard_tokens {self.shard_tokens}"
            )
        if self.compression not in (None, "zstd", "blosc"):
            raise ValueError(
                "StorageFormat.compression must be None, 'zstd' or 'blosc', "
                f"got {self.compression!r}"
            )
        if self.compression == "blosc" and not v2:
            raise ValueError(
                "StorageFormat.compression='blosc' needs zarr_format=2: use 'zstd' in v3"
            )
        if not 1 <= self.zstd_level <= 22:
            raise ValueError(f"StorageFormat.zstd_level must be in [1, 22], got {self.zstd_level}")

    def elements(self, array: str) -> tuple[int, int]:
        """``(per shard, per chunk)`` elements of ``array``: ``seq_starts`` (8-byte
        entries) uses half of each, so its shards hold about the tokens' bytes."""
        if array == SEQ_STARTS and self.zarr_format == 2:
            return max(self.shard_tokens // 2, 1), max(self.shard_tokens // 2, 1)
        if array == SEQ_STARTS:
            return max(self.shard_tokens // 2, self.chunk_tokens), max(self.chunk_tokens // 2, 1)
        return self.shard_tokens, self.chunk_tokens

    def array_spec(
        self, dtype: np.dtype[Any], elements_per_shard: int, elements_per_chunk: int, size: int
    ) -> dict[str, Any]:
        """zarr metadata of a 1-D array of ``dtype`` and ``size`` elements."""
        if self.zarr_format == 2:
            compressor = {"id": "zstd", "level": self.zstd_level} if self.compression else None
            if self.compression == "blosc":
                compressor = {
                    "id": "blosc",
                    "cname": "zstd",
                    "clevel": min(self.zstd_level, 9),
                    "shuffle": 1,
                    "blocksize": 0,
                }
            return {
                "shape": [size],
                "chunks": [elements_per_shard],
                "dtype": dtype.str,
                "fill_value": 0,
                "order": "C",
                "filters": None,
                "compressor": compressor,
            }
        inner: list[dict[str, Any]] = [{"name": "bytes", "configuration": {"endian": "little"}}]
        if self.compression:
            inner.append(
                {"name": "zstd", "configuration": {"level": self.zstd_level, "checksum": False}}
            )
        if self.checksum:
            inner.append({"name": "crc32c"})
        return {
            "shape": [size],
            "data_type": dtype.name,
            "fill_value": 0,
            "attributes": {EVERY_CHUNK_STORED: True},
            "chunk_grid": {
                "name": "regular",
                "configuration": {"chunk_shape": [elements_per_shard]},
            },
            "codecs": [
                {
                    "name": "sharding_indexed",
                    "configuration": {
                        "chunk_shape": [elements_per_chunk],
                        "codecs": inner,
                        "index_codecs": [
                            {"name": "bytes", "configuration": {"endian": "little"}},
                            {"name": "crc32c"},
                        ],
                    },
                }
            ],
        }


def create_array(
    store: Store,
    split: str,
    array: str,
    dtype: np.dtype[Any],
    storage_format: StorageFormat,
    size: int = PROVISIONAL_SIZE,
) -> ts.TensorStore:
    """Creates (replacing any old one) the array ``split/array`` of ``size`` elements.
    Whole shards written give the same bytes at any ``size`` (final, or provisional
    and resized at the end)."""
    per_shard, per_chunk = storage_format.elements(array)
    meta = storage_format.array_spec(dtype, per_shard, per_chunk, size)
    return _create(store, f"{split}/{array}", meta, storage_format.zarr_format)


def _create(store: Store, key: str, meta: dict[str, Any], zarr_format: int) -> ts.TensorStore:
    """Creates (replacing) the array ``key`` of metadata ``meta``."""
    spec = {
        "driver": "zarr3" if zarr_format == 3 else "zarr",
        "kvstore": store.sub(key),
        "metadata": meta,
        "create": True,
        "delete_existing": True,
        "store_data_equal_to_fill_value": True,
    }
    created = store.wait(ts.open(spec, context=store.context))
    if zarr_format == 2:
        # zarr v3 keeps this mark in the array's metadata; v2 in its .zattrs.
        store.write_json(f"{key}/{V2_ATTRS}", {EVERY_CHUNK_STORED: True})
    return created


def open_for_writing(
    store: Store, split: str, array: str, storage_format: StorageFormat
) -> ts.TensorStore:
    """Opens the array ``split/array`` that :func:`create_array` made, to write shards."""
    spec = {
        "driver": "zarr3" if storage_format.zarr_format == 3 else "zarr",
        "kvstore": store.sub(f"{split}/{array}"),
        "open": True,
        "store_data_equal_to_fill_value": True,
    }
    return store.wait(ts.open(spec, context=store.context))


def create_digests(
    store: Store,
    split: str,
    array: str,
    storage_format: StorageFormat,
    size: int = PROVISIONAL_SIZE,
) -> ts.TensorStore:
    """Creates the side array of chunk digests of the array ``split/array``:
    ``[ceil(size / chunk)] uint32``, one side chunk per shard of the array."""
    per_shard, per_chunk = storage_format.elements(array)
    count, per_side = -(-size // per_chunk), per_shard // per_chunk
    plain = dataclasses.replace(storage_format, compression=None)
    meta = plain.array_spec(np.dtype("<u4"), per_side, per_side, count)
    if storage_format.zarr_format == 3:  # not sharded: a side chunk is one file
        meta["codecs"] = meta["codecs"][0]["configuration"]["codecs"]
    return _create(store, f"{split}/{array}/{DIGESTS}", meta, storage_format.zarr_format)


def open_digests(
    store: Store, split: str, array: str, storage_format: StorageFormat
) -> ts.TensorStore:
    """Opens the side array that :func:`create_digests` made, to write digests."""
    return open_for_writing(store, split, f"{array}/{DIGESTS}", storage_format)


def write_digests(
    side: ts.TensorStore, lo: int, values: np.ndarray, storage_format: StorageFormat, array: str
) -> Any:
    """Starts writing the digests of ``values``, the elements of ``array`` from
    ``lo`` (the start of a shard), into its side array; returns the write's future."""
    chunk = storage_format.elements(array)[1]
    found = chunk_digests(values, chunk)
    return side[lo // chunk : lo // chunk + found.size].write(found)


def record_probes(
    store: Store, split: str, array: str, storage_format: StorageFormat, handle: ts.TensorStore
) -> None:
    """Adds the ``shard_probes`` and ``chunk_crc32c`` attributes to the finished
    array ``split/array``, whose values ``handle`` reads and whose digests are all written."""
    reader = TensorStoreArray(handle, None, f"{store.url}/{split}/{array}", store.options)
    per_shard, per_chunk = storage_format.elements(array)
    probes = probe_attribute(reader.read_ranges, reader.size, per_shard)
    side = open_digests(store, split, array, storage_format)
    count = int(side.domain.exclusive_max[0])
    # Digests per read: 16 MiB in whole side chunks, one per shard.
    step = max((1 << 22) // (per_shard // per_chunk), 1) * (per_shard // per_chunk)
    blocks = (
        np.asarray(store.wait(side[a : min(a + step, count)].read())) for a in range(0, count, step)
    )
    digests = attribute(per_chunk, per_shard, blocks)
    key = f"{split}/{array}/{V3_META if storage_format.zarr_format == 3 else V2_ATTRS}"
    meta = store.read_json(key) or {}
    if storage_format.zarr_format == 3:
        meta["attributes"] = {**meta.get("attributes", {}), PROBES: probes, DIGESTS: digests}
    else:
        meta.update({PROBES: probes, DIGESTS: digests})
    store.write_json(key, meta)
