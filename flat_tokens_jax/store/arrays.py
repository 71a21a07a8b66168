"""Readers of 1-D arrays: tensorstore (memory-mapped local shards first), or zarr-python
(the ``zarr`` extra, imported only for an array whose codecs tensorstore cannot decode,
such as numcodecs' ``Delta``: it costs ~0.15 s). zarr 2 (``>=2.18``) opens zarr v2
arrays; zarr 3 opens v2 and v3 arrays."""

from __future__ import annotations

import importlib
import os
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

import numpy as np
import tensorstore as ts

from flat_tokens_jax.core.buffers import Buffers
from flat_tokens_jax.core.extras import install_hint
from flat_tokens_jax.core.format import FormatError
from flat_tokens_jax.core.urls import parse_url
from flat_tokens_jax.store.localshards import LocalShards
from flat_tokens_jax.store.options import StoreOptions, wait

if TYPE_CHECKING:
    import zarr


class Known(NamedTuple):
    """The integrity checks in flight of what a read touches: a read gives no
    values before ``wait()`` (raising the error naming a bad shard or chunk)
    returns, which gives the ``chunks`` the checks read whole (chunk number to
    its ``[chunk]`` elements), to serve the read's ranges from."""

    chunk: int
    chunks: frozenset[int]
    wait: Callable[[], Mapping[int, np.ndarray] | None]

    def covers(self, start: int, stop: int) -> bool:
        """Whether ``chunks`` hold every element of ``[start, stop)`` (non-empty)."""
        first, last = start // self.chunk, (stop - 1) // self.chunk
        return stop > start and all(c in self.chunks for c in range(first, last + 1))


def from_chunks(values: Mapping[int, np.ndarray], chunk: int, start: int, stop: int) -> np.ndarray:
    """Elements ``[start, stop)`` (non-empty) of whole chunks ``values`` that hold them."""
    parts = []
    for c in range(start // chunk, (stop - 1) // chunk + 1):
        base = c * chunk
        parts.append(values[c][max(start, base) - base : min(stop, base + chunk) - base])
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


class Pending:
    """Reads in flight."""

    def result(self) -> list[np.ndarray]:
        """Each range's elements, in order."""
        raise NotImplementedError

    def rows(self, width: int, dtype: Any, right: bool = False) -> np.ndarray:
        """The ranges as the rows of a ``[k, width]`` array of ``dtype``, zero-filled
        past each range (or before it, ``right=True``); ranges hold at most ``width``."""
        pieces = self.result()
        if pieces and all(piece.size == width for piece in pieces):  # one copy, in C
            return np.concatenate(pieces).astype(dtype, copy=False).reshape(len(pieces), width)
        out = np.zeros((len(pieces), width), dtype)
        for row, piece in enumerate(pieces):
            if right:
                out[row, width - piece.size :] = piece
            else:
                out[row, : piece.size] = piece
        return out


def _checked(known: Known | None) -> Mapping[int, np.ndarray]:
    """Waits for ``known``'s checks; the whole chunks they read."""
    values = None if known is None else known.wait()
    return {} if values is None else values


class _Futures(Pending):
    """Values read already, tensorstore futures, and ranges the checks'
    chunks serve (``None`` entries), given once the checks have passed."""

    def __init__(
        self,
        futures: list[Any],
        url: str,
        options: StoreOptions,
        known: Known | None,
        pairs: list[tuple[int, int]],
    ) -> None:
        self.futures, self.url, self.options = futures, url, options
        self.known, self.pairs = known, pairs

    def result(self) -> list[np.ndarray]:
        values = _checked(self.known)
        chunk = 0 if self.known is None else self.known.chunk
        out = []
        for f, pair in zip(self.futures, self.pairs, strict=True):
            if f is None:
                out.append(from_chunks(values, chunk, *pair))
            else:
                out.append(f if isinstance(f, np.ndarray) else wait(f, self.url, self.options))
        return out


class Done(Pending):
    """Values read already, given once the checks have passed."""

    def __init__(self, values: list[np.ndarray], known: Known | None = None) -> None:
        self.values, self.known = values, known

    def result(self) -> list[np.ndarray]:
        _checked(self.known)
        return self.values


class _LocalRanges(Pending):
    """Ranges of an array with memory-mapped local shards, copied when asked for:
    ``rows`` copies each range straight into one reused buffer; a range the shards
    cannot serve sends the whole request through :meth:`TensorStoreArray.per_range`."""

    def __init__(
        self,
        array: TensorStoreArray,
        local: LocalShards,
        starts: np.ndarray,
        stops: np.ndarray,
        known: Known | None,
    ) -> None:
        self.array, self.local, self.starts, self.stops = array, local, starts, stops
        self.known = known

    def result(self) -> list[np.ndarray]:
        return self.array.per_range(self.starts, self.stops, self.known).result()

    def rows(self, width: int, dtype: Any, right: bool = False) -> np.ndarray:
        _checked(self.known)
        if np.dtype(dtype) != self.array.dtype:
            return super().rows(width, dtype, right)
        out = self.array.buffers.array((self.starts.size, width), dtype)
        if (self.stops - self.starts != width).any():
            out.fill(0)
        if self.local.copy_rows(self.starts, self.stops, out, right):
            return out
        return super().rows(width, dtype, right)


class ArrayReader:
    """A 1-D array that reads many ranges at once. Thread-safe."""

    def __init__(self, size: int, dtype: np.dtype[Any]) -> None:
        self.size, self.dtype = size, dtype
        self.bytes_read = 0  # bytes of elements requested so far, from any thread
        self._lock = threading.Lock()  # for bytes_read

    def _count(self, elements: int) -> None:
        with self._lock:
            self.bytes_read += elements * self.dtype.itemsize

    def request_ranges(
        self, starts: np.ndarray, stops: np.ndarray, known: Known | None = None
    ) -> Pending:
        """Requests elements ``[starts[i], stops[i])`` for every i; wait with
        ``.result()``, which waits for ``known``'s checks first. A reader may
        serve ranges from ``known``'s chunks instead of reading them."""
        raise NotImplementedError

    def read_ranges(self, starts: np.ndarray, stops: np.ndarray) -> list[np.ndarray]:
        return self.request_ranges(starts, stops).result()

    def read_points(self, indices: np.ndarray) -> np.ndarray:
        """Elements at ``indices`` (``[k]``) in one request."""
        idx = np.asarray(indices, np.int64)
        self._count(idx.size)
        return self._points(idx) if idx.size else np.zeros(0, self.dtype)

    def _points(self, idx: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def stored_crc32c(self, chunks: np.ndarray, chunk: int) -> np.ndarray | None:
        """The crc32c each of ``chunks`` (``[k] int64``, sorted, unique; of ``chunk``
        elements) is stored with, ``[k] uint32``, where the reader has them at
        hand, verified; else ``None``."""
        return None


class TensorStoreArray(ArrayReader):
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
        self.buffers = Buffers()
        self.url, self.options = url, options or StoreOptions()

    def request_ranges(
        self, starts: np.ndarray, stops: np.ndarray, known: Known | None = None
    ) -> Pending:
        """Memory-mapped shards copy ranges without ``known``'s chunks;
        tensorstore reads only the ranges those chunks cannot serve."""
        self._count(int(np.sum(stops - starts)))
        if self.local is None:
            return self.per_range(starts, stops, known)
        return _LocalRanges(self, self.local, starts, stops, known)

    def per_range(
        self, starts: np.ndarray, stops: np.ndarray, known: Known | None = None
    ) -> Pending:
        """Each range from the memory-mapped shards, or through tensorstore where
        they cannot serve it (which then fails naming a corrupt shard); without
        memory-mapped shards, from ``known`` chunks where they serve it."""
        local, pairs = self.local, list(zip(starts.tolist(), stops.tolist(), strict=True))
        served = [None if local is None else local.read(a, b) for a, b in pairs]
        chunks = [local is None and known is not None and known.covers(a, b) for a, b in pairs]
        # One batch: tensorstore reads each chunk that ranges share once, and
        # the chunks of one shard in as few requests as their byte ranges allow.
        with ts.Batch() as batch:
            out = [
                None if whole else self.store[a:b].read(batch=batch) if value is None else value
                for (a, b), value, whole in zip(pairs, served, chunks, strict=True)
            ]
        return _Futures(out, self.url, self.options, known, pairs)

    def stored_crc32c(self, chunks: np.ndarray, chunk: int) -> np.ndarray | None:
        """From the memory-mapped shards' chunk checksums (see :class:`LocalShards`)."""
        return None if self.local is None else self.local.stored_crc32c(chunks, chunk)

    def _points(self, idx: np.ndarray) -> np.ndarray:
        value = None if self.local is None else self.local.read_points(idx)
        if value is None:
            value = np.asarray(wait(self.store.vindex[idx].read(), self.url, self.options))
        return value


class ZarrPythonArray(ArrayReader):
    """An :class:`ArrayReader` over a zarr-python array (synchronous reads)."""

    def __init__(self, array: zarr.Array) -> None:
        super().__init__(int(array.shape[0]), np.dtype(array.dtype))
        self.array = array

    @classmethod
    def open(
        cls,
        url: str | os.PathLike[str],
        options: StoreOptions,
        key: str,
        zarr_format: Literal[2, 3],
    ) -> ZarrPythonArray:
        """The zarr-python array at ``key`` of the store at ``url``, opened read-only;
        ``FormatError`` where the installed zarr-python (if any) cannot open it."""
        text = os.fspath(url)
        try:
            zarr = importlib.import_module("zarr")
        except ImportError as e:
            raise FormatError(
                f"{text}/{key}: this array's codecs are not supported by tensorstore, so reading "
                f"it needs zarr-python, which is not installed ({e}): "
                f"{install_hint('zarr')}, or any zarr>=2.18"
            ) from e
        v2 = int(str(zarr.__version__).split(".", 1)[0]) < 3
        if v2 and zarr_format == 3:
            raise FormatError(
                f"{text}/{key}: this zarr v3 array's codecs are not supported by tensorstore, "
                f"and zarr-python {zarr.__version__} reads only zarr v2: "
                "pip install 'zarr>=3' to read it"
            )
        where = parse_url(text)
        if where.scheme == "memory":
            raise FormatError(
                f"{text}: this array needs zarr-python (its codecs are not "
                "supported by tensorstore), which cannot reach memory:// stores"
            )
        if where.scheme == "file":
            if v2:
                store = zarr.storage.DirectoryStore(where.path)
            else:
                store = zarr.storage.LocalStore(where.path, read_only=True)
        else:
            storage: dict[str, Any] = {}
            if where.scheme == "s3" and options.endpoint:
                storage["endpoint_url"] = options.endpoint
            remote = f"{where.scheme}://{where.bucket}/{where.path}"
            try:
                if v2:
                    store = zarr.storage.FSStore(remote, mode="r", **storage)
                else:
                    store = zarr.storage.FsspecStore.from_url(
                        remote, storage_options=storage, read_only=True
                    )
            except ImportError as e:
                raise FormatError(
                    f"{text}: this array needs zarr-python with fsspec "
                    f"(pip install fsspec {'gcsfs' if where.scheme == 'gs' else 's3fs'}): {e}"
                ) from e
        if v2:
            array = zarr.open_array(store, path=key, mode="r")
        else:
            array = zarr.open_array(store, path=key, mode="r", zarr_format=zarr_format)
        if array.ndim != 1:
            raise FormatError(f"{text}/{key}: expected a 1-D array, found shape {array.shape}")
        return cls(array)

    def request_ranges(
        self, starts: np.ndarray, stops: np.ndarray, known: Known | None = None
    ) -> Pending:
        self._count(int(np.sum(stops - starts)))
        pairs = zip(starts.tolist(), stops.tolist(), strict=True)
        return Done([np.asarray(self.array[a:b]) for a, b in pairs], known)

    def _points(self, idx: np.ndarray) -> np.ndarray:
        return np.asarray(self.array.get_coordinate_selection(idx))
