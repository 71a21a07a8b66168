"""Where a store lives: URLs to tensorstore specs, group metadata, array handles.

Every store is reached through tensorstore key-value stores, so local paths,
``file://``, ``memory://``, ``gs://`` and ``s3://`` behave alike. Arrays open
with tensorstore's ``zarr3`` or ``zarr`` (v2) driver; an array whose codecs
tensorstore cannot decode (numcodecs filters such as ``Delta``) opens with
zarr-python instead (:meth:`ZarrPythonArray.open`).
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import numpy as np
import tensorstore as ts

from flat_tokens_jax.core.format import FormatError
from flat_tokens_jax.core.limits import check_array_files, check_chunk_files, check_regular_file
from flat_tokens_jax.core.urls import parse_url
from flat_tokens_jax.store.arrays import ArrayReader, TensorStoreArray, ZarrPythonArray
from flat_tokens_jax.store.localshards import LocalShards, plain_shard_geometry
from flat_tokens_jax.store.options import (
    StoreOptions,
    context_spec,
    store_error,
    wait,
)

V3_META = "zarr.json"
# Array attribute (zarr v3 metadata, zarr v2 .zattrs): every chunk was written,
# fill values included, so a missing chunk means a missing object, never a
# chunk of fill values.
EVERY_CHUNK_STORED = "every_chunk_stored"
V2_GROUP = ".zgroup"
V2_ARRAY = ".zarray"
V2_ATTRS = ".zattrs"


def remote_reads() -> dict[str, int]:
    """HTTP read requests sent to GCS and S3 by tensorstore in this process so
    far (its ``/tensorstore/kvstore/{gcs,s3}/batch_read`` metrics), by scheme."""
    return _by_scheme("batch_read")


def remote_bytes() -> dict[str, int]:
    """Bytes that tensorstore's HTTP reads from GCS and S3 returned in this
    process so far (its ``/tensorstore/kvstore/{gcs,s3}/bytes_read`` metrics),
    by scheme: whole chunks and shard indexes."""
    return _by_scheme("bytes_read")


# The HTTP answers of a throttled bucket: GCS's 429 Too Many Requests, S3's 503
# SlowDown. tensorstore retries both (StoreOptions.retries).
THROTTLED_CODES = ("429", "503")


def throttled_requests() -> int:
    """HTTP requests of this process that a server answered 429 or 503 so far
    (:data:`THROTTLED_CODES`), each one an attempt that tensorstore retried after
    a backoff (its ``/tensorstore/http/response_codes`` metric)."""
    found = ts.experimental_collect_matching_metrics("/tensorstore/http/response_codes")
    return sum(
        int(v.get("value", 0))
        for m in found
        for v in m["values"]
        if str(v.get("code")) in THROTTLED_CODES
    )


def _by_scheme(metric: str) -> dict[str, int]:
    counts = {}
    for scheme, driver in (("gs", "gcs"), ("s3", "s3")):
        found = ts.experimental_collect_matching_metrics(f"/tensorstore/kvstore/{driver}/{metric}")
        counts[scheme] = sum(int(v.get("value", 0)) for m in found for v in m["values"])
    return counts


class _MemoryContext:
    """The one in-process context behind ``memory://`` URLs, so a writer and a
    later reader in the same process see the same bytes."""

    lock = threading.Lock()
    context: ts.Context | None = None

    @classmethod
    def get(cls) -> ts.Context:
        with cls.lock:
            if cls.context is None:
                cls.context = ts.Context()
            return cls.context


def kvstore_spec(url: str | os.PathLike[str], options: StoreOptions) -> dict[str, Any]:
    """The tensorstore kvstore spec of a store's root (its path ends with ``/``),
    by the URL rules of :mod:`flat_tokens_jax.core.urls`."""
    where = parse_url(url)
    if where.scheme == "file":
        return {"driver": "file", "path": where.path.rstrip("/") + "/"}
    path = where.path + "/" if where.path else ""
    if where.scheme == "memory":
        return {"driver": "memory", "path": (where.bucket + "/" + path).lstrip("/")}
    spec: dict[str, Any] = {
        "driver": "gcs" if where.scheme == "gs" else "s3",
        "bucket": where.bucket,
        "path": path,
    }
    if where.scheme == "s3":
        if options.endpoint is not None:
            spec["endpoint"] = options.endpoint
        if options.region is not None:
            spec["aws_region"] = options.region
        if options.credentials is not None:
            creds = options.credentials
            spec["aws_credentials"] = {"type": creds} if isinstance(creds, str) else dict(creds)
    return spec


# tensorstore's HTTP threads, where the environment does not set them: enough
# to send every request of the steps in flight at once (tensorstore's own
# default follows the core count, and on a host with few cores it sends a
# batch's requests in waves, a round trip each).
HTTP_THREADS = 64


class Store:
    """A store root: JSON metadata and array handles under one kvstore and context."""

    def __init__(self, url: str | os.PathLike[str], options: StoreOptions | None = None) -> None:
        self.url = os.fspath(url)
        self.options = options or StoreOptions()
        self.spec = kvstore_spec(url, self.options)
        if self.spec["driver"] in ("gcs", "s3"):  # read at the process's first HTTP request
            os.environ.setdefault("TENSORSTORE_HTTP_THREADS", str(HTTP_THREADS))
        if self.options.context is not None:
            self.context = self.options.context
        elif self.spec["driver"] == "memory":
            self.context = _MemoryContext.get()
        else:
            self.context = ts.Context(context_spec(self.options))
        self.kv = self.wait(ts.KvStore.open(self.spec, context=self.context))
        # Keys read ahead by prefetch_json: their bytes, or None where absent.
        self._fetched: dict[str, bytes | None] = {}
        self._fetched_lock = threading.Lock()

    def wait(self, future: Any) -> Any:
        """:func:`~flat_tokens_jax.store.options.wait` with this store's options."""
        return wait(future, self.url, self.options)

    def __repr__(self) -> str:
        return f"Store({self.url!r})"

    def sub(self, key: str) -> dict[str, Any]:
        """The kvstore spec of ``key`` (a folder) under the root."""
        return {**self.spec, "path": self.spec["path"] + key.strip("/") + "/"}

    def local_path(self, key: str) -> str | None:
        """The file of ``key`` on local disk, or ``None`` for other stores."""
        return self.spec["path"] + key if self.spec["driver"] == "file" else None

    def prefetch_json(self, keys: Sequence[str]) -> None:
        """Reads ``keys`` at once (one round trip to an object store), so that
        :meth:`read_json` of any of them needs no request. Local stores read
        nothing ahead (they are read where special files can be refused)."""
        if self.spec["driver"] == "file":
            return
        with self._fetched_lock:
            todo = [k for k in dict.fromkeys(keys) if k not in self._fetched]
        futures = [self.kv.read(k) for k in todo]
        for key, future in zip(todo, futures, strict=True):
            got = self.wait(future)
            value = bytes(got.value) if got.state == "value" else None
            with self._fetched_lock:
                self._fetched[key] = value

    def _forget(self, prefix: str) -> None:
        with self._fetched_lock:
            for key in [k for k in self._fetched if k.startswith(prefix)]:
                del self._fetched[key]

    def read_json(self, key: str) -> dict[str, Any] | None:
        """Parsed JSON at ``key``, or ``None`` if there is no such key. Raises
        ``FormatError`` for a local FIFO, device or folder (tensorstore would wait
        on a FIFO forever)."""
        path = self.local_path(key)
        if path is not None:
            check_regular_file(path, "zarr metadata (JSON)")
        with self._fetched_lock:
            fetched, raw = key in self._fetched, self._fetched.get(key)
        if not fetched:
            got = self.wait(self.kv.read(key))
            raw = bytes(got.value) if got.state == "value" else None
        if raw is None:
            return None
        try:
            value = json.loads(raw)
        except ValueError as e:
            raise FormatError(f"{self.url}/{key}: not valid JSON ({e})") from e
        if not isinstance(value, dict):
            raise FormatError(f"{self.url}/{key}: expected a JSON object")
        return value

    def write_json(self, key: str, value: Mapping[str, Any]) -> None:
        self._forget(key)
        self.wait(self.kv.write(key, json.dumps(value, indent=2, sort_keys=True).encode()))

    def keys(self) -> list[str]:
        return [k.decode() for k in self.wait(self.kv.list())]

    def delete(self, key: str) -> None:
        self._forget(key)
        self.wait(self.kv.delete_range(ts.KvStore.KeyRange(key, key + "\0")))

    def delete_prefix(self, prefix: str) -> None:
        """Deletes every key under the folder ``prefix``."""
        folder = prefix.strip("/") + "/"
        self._forget(folder)
        # Keys under "a/" sort between "a/" and "a0" ("0" follows "/" in ASCII).
        self.wait(self.kv.delete_range(ts.KvStore.KeyRange(folder, folder[:-1] + "0")))
        if self.spec["driver"] == "file":  # files go; empty folders are removed here
            top = os.path.join(self.spec["path"], folder)
            for sub, _, _ in sorted(os.walk(top), key=lambda w: -len(w[0])):
                with contextlib.suppress(OSError):  # not empty, or gone already
                    os.rmdir(sub)

    def group_attributes(self, key: str) -> tuple[int, dict[str, Any]] | None:
        """``(zarr_format, attributes)`` of the group at ``key`` (``""`` is the root)."""
        prefix = key + "/" if key else ""
        meta = self.read_json(prefix + V3_META)
        if meta is not None:
            if meta.get("node_type") != "group":
                raise FormatError(
                    f"{self.url}/{prefix}{V3_META}: expected a zarr group, "
                    f"found node_type {meta.get('node_type')!r}"
                )
            return 3, dict(meta.get("attributes") or {})
        if self.read_json(prefix + V2_GROUP) is not None:
            return 2, self.read_json(prefix + V2_ATTRS) or {}
        return None

    def write_group(self, key: str, zarr_format: int, attributes: Mapping[str, Any]) -> None:
        prefix = key + "/" if key else ""
        if zarr_format == 3:
            meta = {"zarr_format": 3, "node_type": "group", "attributes": dict(attributes)}
            self.write_json(prefix + V3_META, meta)
        else:
            if attributes:
                self.write_json(prefix + V2_ATTRS, attributes)
            self.write_json(prefix + V2_GROUP, {"zarr_format": 2})

    def array_metadata(self, key: str) -> tuple[Literal[2, 3], dict[str, Any]] | None:
        """``(zarr_format, metadata)`` of the array at ``key``, or ``None``; a zarr v2
        array's ``.zattrs`` go under ``"attributes"``, as zarr v3 keeps them."""
        meta = self.read_json(f"{key}/{V3_META}")
        if meta is not None:
            if meta.get("node_type") != "array":
                raise FormatError(
                    f"{self.url}/{key}: expected a zarr array, "
                    f"found node_type {meta.get('node_type')!r}"
                )
            return 3, meta
        meta = self.read_json(f"{key}/{V2_ARRAY}")
        if meta is None:
            return None
        return 2, {**meta, "attributes": self.read_json(f"{key}/{V2_ATTRS}") or {}}

    def _open_assumed(
        self, spec: dict[str, Any], zarr_format: int, meta: Mapping[str, Any] | None
    ) -> ts.TensorStore | None:
        """A zarr v3 array opened from the metadata ``meta`` read already (no
        request); ``None`` where tensorstore does not take it as given, to open
        the array the usual way."""
        if zarr_format != 3 or meta is None:
            return None
        try:
            assumed = {**spec, "metadata": dict(meta), "assume_metadata": True}
            return ts.open(assumed, context=self.context, read=True).result()
        except ValueError:
            return None

    def open_array(
        self,
        key: str,
        zarr_format: Literal[2, 3],
        meta: Mapping[str, Any] | None = None,
    ) -> ArrayReader:
        """A reader of the array at ``key``: tensorstore, else zarr-python.

        Missing chunks read as the fill value (zarr's rule), except in arrays
        marked :data:`EVERY_CHUNK_STORED` (ours), where they fail the read.
        Arrays are immutable once written, so cached chunks and shard indexes
        are never rechecked. Given ``meta``, a zarr v3 array opens without
        reading it again, and its plain shards on local disk are memory-mapped.
        """
        folder = self.local_path(key)
        if folder is not None:  # tensorstore and zarr-python would block on a FIFO chunk
            check_array_files(folder)
        driver = "zarr3" if zarr_format == 3 else "zarr"
        complete = bool(meta and (meta.get("attributes") or {}).get(EVERY_CHUNK_STORED))
        spec = {
            "driver": driver,
            "kvstore": self.sub(key),
            "open": True,
            "recheck_cached_data": False,
            "fill_missing_data_reads": not complete,
        }
        handle = self._open_assumed(spec, zarr_format, meta)
        try:
            if handle is None:
                handle = ts.open(spec, context=self.context, read=True).result()
        except ValueError as ts_error:
            # Only metadata tensorstore refused (not a failure to reach it) may open in zarr-python.
            if not str(ts_error).startswith(("INVALID_ARGUMENT", "FAILED_PRECONDITION")):
                raise store_error(f"{self.url}/{key}", ts_error, self.options) from ts_error
            try:
                reader = ZarrPythonArray.open(self.url, self.options, key, zarr_format)
            except FormatError:
                raise
            except Exception as zarr_error:
                raise FormatError(
                    f"{self.url}/{key}: cannot open the array with tensorstore "
                    f"({ts_error}) nor zarr-python ({zarr_error})"
                ) from zarr_error
            if folder is not None:
                check_chunk_files(folder)
            return reader
        if handle.rank != 1:
            raise FormatError(
                f"{self.url}/{key}: expected a 1-D array, found shape {tuple(handle.shape)}"
            )
        if folder is not None:
            check_chunk_files(folder)
        local = None
        if self.spec["driver"] == "file" and zarr_format == 3 and meta is not None:
            geometry = plain_shard_geometry(meta)
            if geometry is not None:
                folder = self.spec["path"] + key
                dtype = np.dtype(handle.dtype.numpy_dtype)
                local = LocalShards(folder, dtype, int(handle.shape[0]), geometry)
        return TensorStoreArray(handle, local, f"{self.url}/{key}", self.options)


def describe_storage_format(zarr_format: int, meta: Mapping[str, Any]) -> dict[str, Any]:
    """Chunking and compression of an array, from its zarr metadata, for ``info``."""
    if zarr_format == 2:
        comp = meta.get("compressor")
        return {
            "zarr_format": 2,
            "chunk": meta.get("chunks", [None])[0],
            "shard": None,
            "compression": comp.get("id") if comp else None,
            "filters": [f.get("id") for f in meta.get("filters") or []],
            "checksum": False,
        }
    grid = meta.get("chunk_grid", {}).get("configuration", {}).get("chunk_shape", [None])[0]
    codecs = list(meta.get("codecs", []))
    shard, chunk = None, grid
    if codecs and codecs[0].get("name") == "sharding_indexed":
        conf = codecs[0].get("configuration", {})
        shard, chunk = grid, conf.get("chunk_shape", [None])[0]
        codecs = conf.get("codecs", [])
    names = [c.get("name") for c in codecs if c.get("name") not in ("bytes", "transpose", "crc32c")]
    return {
        "zarr_format": 3,
        "chunk": chunk,
        "shard": shard,
        "compression": "+".join(names) if names else None,
        "filters": [],
        "checksum": any(c.get("name") == "crc32c" for c in codecs),
    }
