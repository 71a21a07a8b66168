"""Where a store lives: URLs to tensorstore specs, group metadata, array handles.

Every store is reached through tensorstore key-value stores, so local paths,
``file://``, ``memory://``, ``gs://`` and ``s3://`` behave alike. Arrays open
with tensorstore's ``zarr3`` or ``zarr`` (v2) driver; an array whose codecs
tensorstore cannot decode (numcodecs filters such as ``Delta``) opens with
zarr-python instead.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
from collections.abc import Mapping
from typing import Any, Literal, Protocol

import numpy as np
import tensorstore as ts
import zarr

from flat_tokens_jax.format import FormatError
from flat_tokens_jax.localshards import LocalShards, plain_shard_geometry
from flat_tokens_jax.urls import parse_url

V3_META = "zarr.json"
# Array attribute (zarr v3 metadata, zarr v2 .zattrs): every chunk was written,
# fill values included, so a missing chunk means a missing object, never a
# chunk of fill values.
EVERY_CHUNK_STORED = "every_chunk_stored"
V2_GROUP = ".zgroup"
V2_ARRAY = ".zarray"
V2_ATTRS = ".zattrs"
# The aws_credentials types that StoreOptions.credentials may name alone.
CREDENTIAL_TYPES = ("default", "anonymous", "environment", "imds", "ecs")


@dataclasses.dataclass(frozen=True)
class StoreOptions:
    """How to reach a store. Each field applies only to the schemes it names.

    Attributes:
        endpoint: ``s3://`` only: URL of an S3-compatible endpoint, e.g.
            ``"http://127.0.0.1:9000"``. ``None`` means AWS. (tensorstore does not
            read ``AWS_ENDPOINT_URL``; pass it here.)
        region: ``s3://`` only: the bucket's AWS region. ``None`` lets tensorstore
            ask the bucket.
        credentials: ``s3://`` only: a tensorstore ``aws_credentials`` spec, either
            a type name (``"default"``, ``"anonymous"``, ``"environment"``,
            ``"imds"``, ``"ecs"``) or a mapping such as ``{"type": "profile",
            "profile": "p", "credentials_file": "/path"}``. ``None``: tensorstore's
            default chain. ``gs://`` credentials come from the environment, as
            tensorstore reads them.
        concurrency: ``gs://``/``s3://``: HTTP requests in flight at once. A
            batch is about one request per row, and prefetching keeps several
            batches in flight, so this is what hides per-request latency.
        retries: ``gs://``/``s3://``: attempts per request before a read fails
            (throttling, 5xx answers, refused or dropped connections). A server
            that stays down fails a read after the waits between attempts,
            ``min(retry_delay * 2**k + jitter, max_retry_delay)`` for
            ``k < retries - 1``, with up to ``min(1, retry_delay)`` seconds of
            jitter: at most 100 s with the defaults (1+2+4+8+16, up to 1 s of
            jitter each, then 32+32).
        retry_delay: seconds before the first retry; doubling after each.
        max_retry_delay: the longest wait between two attempts, in seconds.
        timeout: seconds any one wait for data may take, retries included,
            before :class:`StoreError` (a server that accepts connections but
            never answers). ``None``: no limit.
        cache_bytes: memory for cached shard indexes and chunks, per dataset.
            Shard indexes are read once while they fit: ``16 * shard / chunk``
            bytes per shard (32 KiB with the default layout).
        context: a ``tensorstore.Context`` to share caches and concurrency limits
            between datasets; it replaces ``concurrency``, ``retries``, the delays
            and ``cache_bytes`` (see :func:`context_spec`). ``None``: one new
            context per dataset (one shared in-process store for ``memory://``).
    """

    endpoint: str | None = None
    region: str | None = None
    credentials: str | Mapping[str, Any] | None = None
    concurrency: int = 128
    retries: int = 8
    retry_delay: float = 1.0
    max_retry_delay: float = 32.0
    timeout: float | None = 600.0
    cache_bytes: int = 256 << 20
    context: ts.Context | None = None

    def __post_init__(self) -> None:
        for name in ("concurrency", "retries"):
            if getattr(self, name) < 1:
                raise ValueError(f"StoreOptions.{name} must be at least 1")
        if not 0 < self.retry_delay <= self.max_retry_delay:
            raise ValueError(
                f"StoreOptions.retry_delay ({self.retry_delay}) must be above 0 and at most "
                f"StoreOptions.max_retry_delay ({self.max_retry_delay})"
            )
        if self.timeout is not None and self.timeout <= 0:
            raise ValueError(f"StoreOptions.timeout must be positive or None, got {self.timeout}")
        if self.cache_bytes < 0:
            raise ValueError(f"StoreOptions.cache_bytes must be >= 0, got {self.cache_bytes}")
        if self.endpoint is not None and not self.endpoint.startswith(("http://", "https://")):
            raise ValueError(
                f"StoreOptions.endpoint must be an http:// or https:// URL, got {self.endpoint!r}"
            )
        if isinstance(self.credentials, str) and self.credentials not in CREDENTIAL_TYPES:
            raise ValueError(
                f"StoreOptions.credentials {self.credentials!r} is not a credentials type: use "
                "'default', 'anonymous', 'environment', 'imds', 'ecs' or a profile mapping"
            )


def resolve_options(
    options: StoreOptions | None, option_fields: Mapping[str, Any], caller: str
) -> StoreOptions:
    """The :class:`StoreOptions` of a function that takes ``options=`` or the
    same fields as keywords (``**option_fields``), but not both.

    Raises:
        TypeError: ``options`` is not a ``StoreOptions``, or a keyword is
            neither the caller's nor a field of ``StoreOptions``.
        ValueError: both ``options`` and keywords, or a bad field value.
    """
    if options is not None and not isinstance(options, StoreOptions):
        raise TypeError(f"{caller}: options must be a StoreOptions, got {type(options).__name__}")
    known = [f.name for f in dataclasses.fields(StoreOptions)]
    unknown = sorted(set(option_fields) - set(known))
    if unknown:
        raise TypeError(
            f"{caller} got unexpected keyword arguments {unknown}: besides its own, it "
            f"takes the fields of StoreOptions: {', '.join(known)}"
        )
    if options is not None and option_fields:
        raise ValueError(
            f"{caller}: pass either options=StoreOptions(...) or its fields as keywords "
            f"({', '.join(sorted(option_fields))}), not both"
        )
    return options if options is not None else StoreOptions(**option_fields)


class StoreError(OSError):
    """Reading or writing a store failed: the server is unreachable or keeps
    failing, access is denied, an object is missing, or a read timed out. The
    message names the URL and what to check."""


def _millis(seconds: float) -> str:
    return f"{round(seconds * 1000)}ms"


def context_spec(options: StoreOptions) -> dict[str, Any]:
    """The tensorstore context spec of ``options``: request concurrency and
    retries for GCS and S3, and the cache pool."""
    retries = {
        # tensorstore's max_retries counts the attempts after the first.
        "max_retries": options.retries - 1,
        "initial_delay": _millis(options.retry_delay),
        "max_delay": _millis(options.max_retry_delay),
    }
    return {
        "gcs_request_concurrency": {"limit": options.concurrency},
        "s3_request_concurrency": {"limit": options.concurrency},
        "gcs_request_retries": retries,
        "s3_request_retries": retries,
        "cache_pool": {"total_bytes_limit": options.cache_bytes},
    }


_HINTS = {
    "PERMISSION_DENIED": "access denied: check the credentials and their permissions",
    "UNAUTHENTICATED": "not authenticated: check the credentials",
    "NOT_FOUND": "an object of the store is missing (the store is incomplete or was deleted)",
    "DEADLINE_EXCEEDED": "the server did not answer in time",
    "DATA_LOSS": (
        "stored bytes fail their crc32c checksum (the file named below is corrupt): "
        "restore it, or write the dataset again"
    ),
}


def store_error(url: str, error: BaseException, options: StoreOptions) -> StoreError:
    """A :class:`StoreError` for a tensorstore failure at ``url``, saying what to check."""
    text = str(error)
    code = text.split(":", 1)[0]
    if isinstance(error, TimeoutError):
        hint = f"no answer within StoreOptions.timeout={options.timeout}s"
    elif "No space left on device" in text or "os_error_code='28'" in text:
        hint = "no space left on device: free space there, or write elsewhere"
    elif code in _HINTS:
        hint = _HINTS[code]
    elif "retry attempts failed" in text or code in ("UNAVAILABLE", "ABORTED"):
        hint = (
            f"the server failed {options.retries} attempts (StoreOptions.retries, "
            "StoreOptions.retry_delay, StoreOptions.max_retry_delay): is it reachable?"
        )
    else:
        hint = "the read or write failed"
    return StoreError(f"{url}: {hint}: {text}")


def remote_reads() -> dict[str, int]:
    """HTTP read requests sent to GCS and S3 by tensorstore in this process so
    far (its ``/tensorstore/kvstore/{gcs,s3}/batch_read`` metrics), by scheme."""
    counts = {}
    for scheme, driver in (("gs", "gcs"), ("s3", "s3")):
        found = ts.experimental_collect_matching_metrics(
            f"/tensorstore/kvstore/{driver}/batch_read"
        )
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
    by the URL rules of :mod:`flat_tokens_jax.urls`."""
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


def zarr_python_store(url: str | os.PathLike[str], options: StoreOptions) -> Any:
    """A zarr-python store for the same URL, for arrays tensorstore cannot decode."""
    text = os.fspath(url)
    where = parse_url(text)
    if where.scheme == "file":
        return zarr.storage.LocalStore(where.path, read_only=True)
    if where.scheme == "memory":
        raise FormatError(
            f"{text}: this array needs zarr-python (its codecs are not "
            "supported by tensorstore), which cannot reach memory:// stores"
        )
    storage: dict[str, Any] = {}
    if where.scheme == "s3" and options.endpoint:
        storage["endpoint_url"] = options.endpoint
    try:
        return zarr.storage.FsspecStore.from_url(
            f"{where.scheme}://{where.bucket}/{where.path}",
            storage_options=storage,
            read_only=True,
        )
    except ImportError as e:
        raise FormatError(
            f"{text}: this array needs zarr-python with fsspec "
            f"(pip install fsspec {'gcsfs' if where.scheme == 'gs' else 's3fs'}): {e}"
        ) from e


class Store:
    """A store root: JSON metadata and array handles under one kvstore and context."""

    def __init__(self, url: str | os.PathLike[str], options: StoreOptions | None = None) -> None:
        self.url = os.fspath(url)
        self.options = options or StoreOptions()
        self.spec = kvstore_spec(url, self.options)
        if self.options.context is not None:
            self.context = self.options.context
        elif self.spec["driver"] == "memory":
            self.context = _MemoryContext.get()
        else:
            self.context = ts.Context(context_spec(self.options))
        self.kv = self.wait(ts.KvStore.open(self.spec, context=self.context))

    def wait(self, future: Any) -> Any:
        """The result of a tensorstore future, within the timeout; failures as
        :class:`StoreError`."""
        return wait(future, self.url, self.options)

    def __repr__(self) -> str:
        return f"Store({self.url!r})"

    def sub(self, key: str) -> dict[str, Any]:
        """The kvstore spec of ``key`` (a folder) under the root."""
        return {**self.spec, "path": self.spec["path"] + key.strip("/") + "/"}

    def read_json(self, key: str) -> dict[str, Any] | None:
        """Parsed JSON at ``key``, or ``None`` if there is no such key."""
        got = self.wait(self.kv.read(key))
        if got.state != "value":
            return None
        try:
            value = json.loads(bytes(got.value))
        except ValueError as e:
            raise FormatError(f"{self.url}/{key}: not valid JSON ({e})") from e
        if not isinstance(value, dict):
            raise FormatError(f"{self.url}/{key}: expected a JSON object")
        return value

    def write_json(self, key: str, value: Mapping[str, Any]) -> None:
        self.wait(self.kv.write(key, json.dumps(value, indent=2, sort_keys=True).encode()))

    def keys(self) -> list[str]:
        return [k.decode() for k in self.wait(self.kv.list())]

    def delete(self, key: str) -> None:
        self.wait(self.kv.delete_range(ts.KvStore.KeyRange(key, key + "\0")))

    def delete_prefix(self, prefix: str) -> None:
        """Deletes every key under the folder ``prefix``."""
        folder = prefix.strip("/") + "/"
        # Keys under "a/" sort between "a/" and "a0" ("0" follows "/" in ASCII).
        self.wait(self.kv.delete_range(ts.KvStore.KeyRange(folder, folder[:-1] + "0")))

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
        """``(zarr_format, metadata)`` of the array at ``key``, or ``None``.

        A zarr v2 array's metadata is its ``.zarray``, with its ``.zattrs`` (or
        ``{}``) under ``"attributes"`` as zarr v3 keeps them.
        """
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

    def open_array(
        self,
        key: str,
        zarr_format: Literal[2, 3],
        meta: Mapping[str, Any] | None = None,
    ) -> ArrayReader:
        """A reader of the array at ``key``: tensorstore, else zarr-python.

        Missing chunks read as the fill value (zarr's rule, for writers that
        skip chunks of fill values), except in arrays whose metadata marks
        every chunk as stored (ours): there, a missing chunk fails the read.
        Arrays are immutable once written, so cached chunks and shard indexes
        are used without asking the server again. Given the array's metadata
        ``meta``, uncompressed zarr v3 shards on local disk are memory-mapped
        (see :mod:`flat_tokens_jax.localshards`).
        """
        driver = "zarr3" if zarr_format == 3 else "zarr"
        complete = bool(meta and (meta.get("attributes") or {}).get(EVERY_CHUNK_STORED))
        spec = {
            "driver": driver,
            "kvstore": self.sub(key),
            "open": True,
            "recheck_cached_data": False,
            "fill_missing_data_reads": not complete,
        }
        try:
            handle = ts.open(spec, context=self.context, read=True).result()
        except ValueError as ts_error:
            if not _unsupported_codec(ts_error):
                raise store_error(f"{self.url}/{key}", ts_error, self.options) from ts_error
            try:
                store = zarr_python_store(self.url, self.options)
                arr = zarr.open_array(store, path=key, mode="r", zarr_format=zarr_format)
            except Exception as zarr_error:
                raise FormatError(
                    f"{self.url}/{key}: cannot open the array with tensorstore "
                    f"({ts_error}) nor zarr-python ({zarr_error})"
                ) from zarr_error
            if arr.ndim != 1:
                raise FormatError(
                    f"{self.url}/{key}: expected a 1-D array, found shape {arr.shape}"
                ) from None
            return ZarrPythonArray(arr)
        if handle.rank != 1:
            raise FormatError(
                f"{self.url}/{key}: expected a 1-D array, found shape {tuple(handle.shape)}"
            )
        local = None
        if self.spec["driver"] == "file" and zarr_format == 3 and meta is not None:
            geometry = plain_shard_geometry(meta)
            if geometry is not None:
                folder = self.spec["path"] + key
                dtype = np.dtype(handle.dtype.numpy_dtype)
                local = LocalShards(folder, dtype, int(handle.shape[0]), geometry)
        return TensorStoreArray(handle, local, f"{self.url}/{key}", self.options)


def _unsupported_codec(error: ValueError) -> bool:
    """Whether tensorstore refused an array's metadata (so zarr-python may open it),
    rather than failed to reach it."""
    return str(error).startswith(("INVALID_ARGUMENT", "FAILED_PRECONDITION"))


def wait(future: Any, url: str, options: StoreOptions) -> Any:
    """``future.result()`` within ``options.timeout``; failures as :class:`StoreError`."""
    try:
        return future.result(timeout=options.timeout)
    except (ValueError, TimeoutError) as e:
        raise store_error(url, e, options) from e


class ByteCounter:
    """Bytes read so far, counted from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.value = 0

    def add(self, n: int) -> None:
        with self._lock:
            self.value += n


class Pending(Protocol):
    """Reads in flight."""

    def result(self) -> list[np.ndarray]: ...


class _Futures:
    """Values read already, and tensorstore futures."""

    def __init__(self, futures: list[Any], url: str, options: StoreOptions) -> None:
        self.futures, self.url, self.options = futures, url, options

    def result(self) -> list[np.ndarray]:
        return [
            f if isinstance(f, np.ndarray) else wait(f, self.url, self.options)
            for f in self.futures
        ]


class _Done:
    def __init__(self, values: list[np.ndarray]) -> None:
        self.values = values

    def result(self) -> list[np.ndarray]:
        return self.values


class ArrayReader(Protocol):
    """A 1-D array that reads many ranges at once. Thread-safe."""

    @property
    def size(self) -> int: ...

    @property
    def dtype(self) -> np.dtype[Any]: ...

    @property
    def bytes_read(self) -> ByteCounter:
        """Bytes of elements requested so far through this reader."""
        ...

    def request_ranges(self, starts: np.ndarray, stops: np.ndarray) -> Pending:
        """Requests elements ``[starts[i], stops[i])`` for every i; wait with ``.result()``."""
        ...

    def read_ranges(self, starts: np.ndarray, stops: np.ndarray) -> list[np.ndarray]:
        """``request_ranges(starts, stops).result()``."""
        ...

    def read_points(self, indices: np.ndarray) -> np.ndarray:
        """Elements at ``indices`` (``[k]``) in one request."""
        ...


class _Reader:
    """What every :class:`ArrayReader` shares: byte counting and sync reads."""

    dtype: np.dtype[Any]

    def __init__(self, size: int, dtype: np.dtype[Any]) -> None:
        self.size, self.dtype = size, dtype
        self.bytes_read = ByteCounter()

    def _count(self, elements: int) -> None:
        self.bytes_read.add(elements * self.dtype.itemsize)

    def request_ranges(self, starts: np.ndarray, stops: np.ndarray) -> Pending:
        raise NotImplementedError

    def read_ranges(self, starts: np.ndarray, stops: np.ndarray) -> list[np.ndarray]:
        return self.request_ranges(starts, stops).result()


class TensorStoreArray(_Reader):
    """An :class:`ArrayReader` over a tensorstore handle."""

    def __init__(
        self,
        store: ts.TensorStore,
        local: LocalShards | None = None,
        url: str = "",
        options: StoreOptions | None = None,
    ) -> None:
        super().__init__(int(store.shape[0]), np.dtype(store.dtype.numpy_dtype))
        self.store = store
        self.local = local
        self.url, self.options = url, options or StoreOptions()

    def request_ranges(self, starts: np.ndarray, stops: np.ndarray) -> Pending:
        self._count(int(np.sum(stops - starts)))
        pairs = zip(starts.tolist(), stops.tolist(), strict=True)
        if self.local is None:
            return _Futures([self.store[a:b].read() for a, b in pairs], self.url, self.options)
        out = []
        for a, b in pairs:
            value = self.local.read(a, b)
            out.append(self.store[a:b].read() if value is None else value)
        return _Futures(out, self.url, self.options)

    def read_points(self, indices: np.ndarray) -> np.ndarray:
        idx = np.asarray(indices, np.int64)
        self._count(idx.size)
        if idx.size == 0:
            return np.zeros(0, self.dtype)
        value = None if self.local is None else self.local.read_points(idx)
        if value is None:
            value = np.asarray(wait(self.store.vindex[idx].read(), self.url, self.options))
        return value


class ZarrPythonArray(_Reader):
    """An :class:`ArrayReader` over a zarr-python array (synchronous reads)."""

    def __init__(self, array: zarr.Array) -> None:
        super().__init__(int(array.shape[0]), np.dtype(array.dtype))
        self.array = array

    def request_ranges(self, starts: np.ndarray, stops: np.ndarray) -> Pending:
        self._count(int(np.sum(stops - starts)))
        pairs = zip(starts.tolist(), stops.tolist(), strict=True)
        return _Done([np.asarray(self.array[a:b]) for a, b in pairs])

    def read_points(self, indices: np.ndarray) -> np.ndarray:
        idx = np.asarray(indices, np.int64)
        self._count(idx.size)
        if idx.size == 0:
            return np.zeros(0, self.dtype)
        return np.asarray(self.array.get_coordinate_selection(idx))


def describe_layout(zarr_format: int, meta: Mapping[str, Any]) -> dict[str, Any]:
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
    shard = None
    chunk = grid
    if codecs and codecs[0].get("name") == "sharding_indexed":
        conf = codecs[0].get("configuration", {})
        shard, chunk = grid, conf.get("chunk_shape", [None])[0]
        codecs = conf.get("codecs", [])
    skipped = ("bytes", "transpose", "crc32c")
    names = [c.get("name") for c in codecs if c.get("name") not in skipped]
    return {
        "zarr_format": 3,
        "chunk": chunk,
        "shard": shard,
        "compression": "+".join(names) if names else None,
        "filters": [],
        "checksum": any(c.get("name") == "crc32c" for c in codecs),
    }
