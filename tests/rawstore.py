"""Stores as bytes: written directly with zarr-python, as other tools write them, and read
back key by key."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numcodecs
import numpy as np
import zarr

from flat_tokens_jax.store.options import StoreOptions
from flat_tokens_jax.store.store import Store


def write_raw(
    path: Path, splits: dict[str, dict[str, Any]], zarr_format: int = 3, root: bool = True
) -> None:
    """Writes each split's arrays exactly as given.

    ``splits`` maps a split name to ``{"arrays": {name: (values, create_kwargs)},
    "attrs": {...}}``.
    """
    group = zarr.open_group(str(path), mode="w", zarr_format=zarr_format)  # type: ignore[arg-type]
    for name, spec in splits.items():
        sub = group.create_group(name)
        sub.attrs.update(spec.get("attrs", {}))
        for array_name, (values, kwargs) in spec["arrays"].items():
            values = np.asarray(values)
            arr = sub.create_array(
                array_name,
                shape=values.shape,
                dtype=values.dtype,
                chunks=kwargs.pop("chunks", (4,)),
                **kwargs,
            )
            arr[:] = values
    if not root:
        (path / ("zarr.json" if zarr_format == 3 else ".zgroup")).unlink()


def flat_split(
    tokens: list[int],
    starts: list[int],
    max_token_id: int,
    tokens_name: str = "encoded_tokens",
    **kwargs: Any,
) -> dict[str, Any]:
    return {
        "arrays": {
            tokens_name: (np.array(tokens, np.uint32), dict(kwargs.get("tokens_kwargs", {}))),
            "seq_starts": (np.array(starts, np.uint64), dict(kwargs.get("starts_kwargs", {}))),
        },
        "attrs": {"max_token_id": max_token_id},
    }


SPEC_TOKENS = [3, 4, 7, 8, 10, 13, 14, 16]
SPEC_STARTS = [0, 2, 5, 8]
BLOSC = {"compressors": numcodecs.Blosc(cname="lz4", clevel=5, shuffle=numcodecs.Blosc.SHUFFLE)}
DELTA = {"filters": [numcodecs.Delta(dtype="<u8")], "compressors": numcodecs.Blosc()}


def stored(url: str | Path, options: StoreOptions | None = None) -> dict[str, bytes]:
    """Every key of the store at ``url`` and its bytes."""
    store = Store(url, options)
    return {k: bytes(store.wait(store.kv.read(k)).value) for k in sorted(store.keys())}


def chunks_read(
    raw: dict[str, bytes],
    array: str,
    per_shard: int,
    requests: list[tuple[str, str, str | None]],
) -> set[int]:
    """The inner chunks of the sharded zarr v3 ``array`` (its key, e.g.
    ``train/encoded_tokens``) that the byte-range ``requests`` read (``(method,
    path, Range header)``, as :class:`proxies.FaultProxy` records them), by
    their index in the array, from the shard indexes in ``raw`` (the store's
    bytes by key, see :func:`stored`); ``per_shard``: chunks per shard."""
    found = set()
    for method, path, byte_range in requests:
        key = path.split("/", 3)[-1]  # /bucket/<store>/<key>
        shard = key.removeprefix(f"{array}/c/")
        if method != "GET" or not shard.isdigit() or not byte_range or "=-" in byte_range:
            continue  # not a read of chunks: a shard index is read as a suffix range
        first, last = map(int, byte_range.removeprefix("bytes=").split("-"))
        index = np.frombuffer(raw[key][-(16 * per_shard + 4) : -4], "<u8").reshape(-1, 2)
        for i, (offset, size) in enumerate(index.tolist()):
            if offset <= last and offset + size > first:
                found.add(int(shard) * per_shard + i)
    return found
