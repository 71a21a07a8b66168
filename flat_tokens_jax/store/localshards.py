"""A read path without per-read overhead for uncompressed zarr v3 shards on local disk.

tensorstore costs about 23 µs per read however small, which dominates a batch
of hundreds of short reads. An uncompressed shard that tensorstore wrote whole
holds its inner chunks back to back, then its index: we check the index once,
memory-map the shard, and a read becomes a slice. Any other shard is read
through tensorstore. A chunk's crc32c (our default) is verified the first time
a read touches it; a chunk that fails is left to tensorstore, whose read fails.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from types import ModuleType
from typing import Any, NamedTuple

import google_crc32c
import numpy as np

from flat_tokens_jax.core import compiled
from flat_tokens_jax.core.limits import check_regular_file


def crc32c(data: Any) -> int:
    """The crc32c of ``data`` (bytes, or a C-contiguous array's bytes)."""
    return int(google_crc32c.value(data))


class Geometry(NamedTuple):
    """How the shards of a memory-mappable array are laid out."""

    shard: int  # elements per shard
    chunk: int  # elements per inner chunk
    index_bytes: int  # of the shard index at the end of a shard file
    checksummed: bool  # whether each chunk is followed by its 4-byte crc32c


def plain_shard_geometry(meta: Mapping[str, Any]) -> Geometry | None:
    """The :class:`Geometry` of a 1-D zarr v3 array whose shards can be memory-mapped,
    or ``None`` when its codecs do anything but store raw bytes (and checksums)."""
    codecs = meta.get("codecs") or []
    if len(meta.get("shape", [])) != 1 or len(codecs) != 1:
        return None
    conf = codecs[0].get("configuration", {})
    inner = conf.get("codecs", [])
    checksummed = bool(inner) and inner[-1] == {"name": "crc32c"}
    inner = inner[:-1] if checksummed else inner
    raw_bytes = [{"name": "bytes"}] if meta.get("data_type") == "uint8" else None
    index = conf.get("index_codecs", [])
    index_names = [c.get("name") for c in index]
    keys = meta.get("chunk_key_encoding", {"name": "default"})
    plain = (
        codecs[0].get("name") == "sharding_indexed"
        and inner in ([{"name": "bytes", "configuration": {"endian": "little"}}], raw_bytes)
        and conf.get("index_location", "end") == "end"
        and index_names in (["bytes"], ["bytes", "crc32c"])
        and index[0].get("configuration", {}).get("endian", "little") == "little"
        and keys.get("name") == "default"
        and keys.get("configuration", {}).get("separator", "/") == "/"
    )
    if not plain:
        return None
    shard = int(meta["chunk_grid"]["configuration"]["chunk_shape"][0])
    chunk = int(conf["chunk_shape"][0])
    index_bytes = 16 * (shard // chunk) + (4 if "crc32c" in index_names else 0)
    return Geometry(shard, chunk, index_bytes, checksummed)


def touched(starts: np.ndarray, stops: np.ndarray, unit: int) -> np.ndarray:
    """The ``unit``-element blocks (chunks, shards) that the non-empty ranges
    ``[starts, stops)`` touch: ``[m] int64`` block numbers, some repeated."""
    keep = stops > starts
    first, last = starts[keep] // unit, (stops[keep] - 1) // unit
    blocks = np.concatenate([first, last])
    long = np.flatnonzero(last - first > 1)
    if long.size:
        blocks = np.concatenate([blocks, *(np.arange(first[i], last[i]) for i in long)])
    return blocks


class _Checksummed:
    """One memory-mapped shard whose chunks each end in a crc32c, verified on first use."""

    def __init__(
        self, raw: np.ndarray, dtype: np.dtype[Any], chunk: int, verified: np.ndarray
    ) -> None:
        """``raw``: ``[chunks, chunk bytes + 4] uint8``; ``verified``: ``[chunks] uint8``,
        set to 1 once a chunk passed (a view of its :class:`LocalShards`'s flags)."""
        chunk_bytes = chunk * dtype.itemsize
        self.raw, self.chunk, self.chunk_bytes = raw, chunk, chunk_bytes
        # [chunks, chunk] elements: a view that skips each chunk's 4 checksum bytes.
        self.data = raw[:, :chunk_bytes].view(dtype).view(np.ndarray)
        self.verified = verified
        # The shard as one run of elements with each checksum in between, when
        # the checksum is a whole number of elements: element e is at e + gap * (e // chunk).
        self.gap = 4 // dtype.itemsize if 4 % dtype.itemsize == 0 else 0
        self.words = raw.reshape(-1).view(dtype).view(np.ndarray) if self.gap else None
        # [chunks] uint32: the crc32c stored after each chunk (read where asked).
        self.crcs = raw[:, chunk_bytes:].view(np.ndarray).view("<u4")[:, 0]

    def verify(self, chunks: np.ndarray) -> bool:
        """Whether ``chunks`` (``[k]`` chunk numbers) match their checksums (each computed once)."""
        for j in np.unique(chunks[self.verified[chunks] == 0]).tolist():
            if crc32c(self.raw[j, : self.chunk_bytes]) != int(self.crcs[j]):
                return False
            self.verified[j] = 1
        return True

    def slice(self, start: int, stop: int) -> np.ndarray | None:
        """Elements ``[start, stop)`` of the shard, or ``None`` if a chunk they
        touch fails its checksum."""
        if stop <= start:
            return self.data[0, :0]
        chunk = self.chunk
        first, last = start // chunk, (stop - 1) // chunk
        # The common case, a read within one chunk or two, checked without a call.
        known = last - first <= 1 and self.verified[first] and self.verified[last]
        if not known and not self.verify(np.arange(first, last + 1)):
            return None
        a, b = start - first * chunk, stop - last * chunk
        if first == last:
            return self.data[first, a:b]
        middle = self.data[first + 1 : last].reshape(-1)
        return np.concatenate([self.data[first, a:], middle, self.data[last, :b]])

    def points(self, indices: np.ndarray) -> np.ndarray | None:
        """Elements at ``indices`` (``[k] int64``), or ``None`` as :meth:`slice`."""
        rows = indices // self.chunk
        if not self.verify(rows):
            return None
        return self.data[rows, indices - rows * self.chunk]


_Mapped = np.ndarray | _Checksummed


class LocalShards:
    """Memory-maps the shards of one array (each index read once, on first use).
    Thread-safe. ``kernels``: the compiled kernels :meth:`copy_rows` uses where
    numba is installed (imported on first use; set ``None`` to copy with numpy).
    """

    def __init__(self, folder: str, dtype: np.dtype[Any], size: int, geometry: Geometry) -> None:
        self.folder, self.dtype, self.size = folder, dtype, size
        self.shard, self.chunk, self.index_bytes, self.checksummed = geometry
        self._maps: dict[int, _Mapped | None] = {}
        self._lock = threading.Lock()
        self._copying = threading.Lock()
        self._kernels: ModuleType | bool | None = True  # True: not imported yet
        # Chunks whose checksum passed, over the whole array: [chunks] uint8.
        chunks = -(-size // self.chunk) if self.checksummed else 0
        self._verified = np.zeros(chunks, np.uint8)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_maps"], state["_lock"], state["_copying"] = {}, None, None
        state["_kernels"] = state["_kernels"] is not None
        state["_verified"] = np.zeros_like(self._verified)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock, self._copying = threading.Lock(), threading.Lock()

    @property
    def kernels(self) -> ModuleType | None:
        """The compiled kernels, or ``None``: copy with numpy."""
        if self._kernels is True:
            self._kernels = compiled.kernels()
        return self._kernels if isinstance(self._kernels, ModuleType) else None

    @kernels.setter
    def kernels(self, value: ModuleType | None) -> None:
        self._kernels = value

    def shard_array(self, i: int) -> _Mapped | None:
        """Shard ``i``'s elements as a read-only memory map, or ``None``."""
        try:
            return self._maps[i]
        except KeyError:
            pass
        with self._lock:
            if i not in self._maps:
                mapped = self._map(i)
                # Slices of a plain ndarray view cost ~3 µs less per read than a np.memmap's.
                if isinstance(mapped, np.memmap):
                    mapped = mapped.view(np.ndarray)
                self._maps[i] = mapped
            return self._maps[i]

    def _map(self, i: int) -> _Mapped | None:
        path = os.path.join(self.folder, "c", str(i))
        check_regular_file(path, f"shard {i}")
        try:
            file_size = os.path.getsize(path)
        except OSError:
            return None
        data_bytes = file_size - self.index_bytes
        n_chunks = self.shard // self.chunk
        if data_bytes < 0:
            return None
        with open(path, "rb") as f:
            f.seek(data_bytes)
            raw = f.read(self.index_bytes)
        if len(raw) != self.index_bytes:
            return None
        if self.index_bytes % 16 == 4:
            # As tensorstore does: an index that fails its checksum is not read.
            if crc32c(raw[:-4]) != int.from_bytes(raw[-4:], "little"):
                return None
            raw = raw[:-4]
        index = np.frombuffer(raw, "<u8").reshape(n_chunks, 2)
        chunk_bytes = self.chunk * self.dtype.itemsize
        stored_bytes = chunk_bytes + (4 if self.checksummed else 0)
        used = -(-(min(self.size - i * self.shard, self.shard)) // self.chunk)
        expected = np.arange(used, dtype=np.uint64) * np.uint64(stored_bytes)
        if not (
            np.array_equal(index[:used, 0], expected)
            and (index[:used, 1] == stored_bytes).all()
            and data_bytes >= used * stored_bytes
        ):
            return None
        if used == 0:
            return None
        if self.checksummed:
            chunks = np.memmap(path, np.uint8, "r", 0, (used, stored_bytes))
            at = i * (self.shard // self.chunk)
            return _Checksummed(chunks, self.dtype, self.chunk, self._verified[at : at + used])
        return np.memmap(path, self.dtype, "r", 0, (used * self.chunk,))

    def read(self, start: int, stop: int) -> np.ndarray | None:
        """Elements ``[start, stop)``, or ``None`` if a shard they touch is not plain."""
        first, last = start // self.shard, (max(stop, start + 1) - 1) // self.shard
        if first == last:
            arr = self.shard_array(first)
            if arr is None:
                return None
            base = first * self.shard
            if isinstance(arr, _Checksummed):
                return arr.slice(start - base, stop - base)
            return arr[start - base : stop - base]
        parts = []
        for i in range(first, last + 1):
            arr = self.shard_array(i)
            if arr is None:
                return None
            base = i * self.shard
            a, b = max(start, base) - base, min(stop, base + self.shard) - base
            part = arr.slice(a, b) if isinstance(arr, _Checksummed) else arr[a:b]
            if part is None:
                return None
            parts.append(part)
        return np.concatenate(parts)

    def copy_rows(
        self, starts: np.ndarray, stops: np.ndarray, out: np.ndarray, right: bool = False
    ) -> bool:
        """Copies elements ``[starts[r], stops[r])`` (``[k] int64``) into row ``r`` of
        ``out`` (``[k, width]`` of this array's dtype), at its end with ``right``;
        columns past a short range are left as they are. False when a range is not
        within one plain shard whose chunks pass their checksums: then read otherwise."""
        width = out.shape[1]
        row = np.flatnonzero(stops > starts)
        starts, stops = starts[row], stops[row]
        if not row.size:
            return True
        first = starts // self.shard
        if ((stops - 1) // self.shard != first).any():
            return False
        maps = {i: self.shard_array(i) for i in np.unique(first).tolist()}
        if any(m is None for m in maps.values()):
            return False
        count = stops - starts
        lo = starts - first * self.shard
        dest = row * width + (width - count if right else 0)
        flat = out.reshape(-1)
        if not self.checksummed:
            self._copy(maps, first, lo, count, dest, count, 0, flat)
            return True
        chunk, chunk_of = self.chunk, lo // self.chunk
        shards = {i: m for i, m in maps.items() if isinstance(m, _Checksummed)}
        gap = next(iter(shards.values())).gap
        if gap == 0:
            return False
        # Every chunk checked, no range over more than two: one vectorised test.
        a, b = starts // chunk, (stops - 1) // chunk
        if not ((b - a <= 1).all() and self._verified[a].all() and self._verified[b].all()):
            for i, m in shards.items():
                here = first == i
                if not m.verify(touched(lo[here], lo[here] + count[here], chunk)):
                    return False
        words = {i: m.words for i, m in shards.items() if m.words is not None}
        pos = lo + gap * chunk_of
        before = (chunk_of + 1) * chunk - lo  # elements before the next checksum
        self._copy(words, first, pos, count, dest, before, gap, flat)
        return True

    def _copy(
        self,
        words: Mapping[int, Any],
        first: np.ndarray,
        pos: np.ndarray,
        count: np.ndarray,
        dest: np.ndarray,
        before: np.ndarray,
        gap: int,
        flat: np.ndarray,
    ) -> None:
        """Copies ``count[r]`` elements of shard ``first[r]``'s ``words`` from
        ``pos[r]`` to ``flat[dest[r]:]``, skipping ``gap`` elements after the first
        ``before[r]`` and then after every chunk.

        The compiled kernel copies a shard's ranges in one call without the
        interpreter lock. Without it, one slice copy per row (numpy has no gather
        into an existing array without a batch-sized temporary); threads would
        hand the lock on at every row, so one caller copies at a time
        (``_copying``) while decodes in other threads run on. (Copies through
        memoryviews, which never hand it on, stalled those decodes instead.)
        """
        chunk = self.chunk
        kernels = self.kernels
        if kernels is not None:
            order = np.argsort(first, kind="stable")
            shards, at = np.unique(first[order], return_index=True)
            bounds = np.append(at, first.size).tolist()
            for i, a, b in zip(shards.tolist(), bounds[:-1], bounds[1:], strict=True):
                r = order[a:b]
                kernels.gather(words[i], pos[r], count[r], dest[r], before[r], chunk, gap, flat)
            return
        with self._copying:
            copies = zip(
                first.tolist(),
                pos.tolist(),
                count.tolist(),
                dest.tolist(),
                before.tolist(),
                strict=True,
            )
            for i, p, n, d, m in copies:
                w = words[i]
                if n <= m:
                    flat[d : d + n] = w[p : p + n]
                    continue
                flat[d : d + m] = w[p : p + m]
                p += m + gap
                while m < n:  # the next chunk, whole or the range's last part
                    k = min(chunk, n - m)
                    flat[d + m : d + m + k] = w[p : p + k]
                    m, p = m + k, p + k + gap

    def stored_crc32c(self, chunks: np.ndarray, chunk: int) -> np.ndarray | None:
        """The crc32c stored after each of ``chunks`` (``[k] int64`` chunk numbers
        over the whole array, sorted, unique), ``[k] uint32``, each chunk verified
        against it as a read would; ``None`` unless chunks of ``chunk`` elements
        carry checksums in plain shards and every one of these passes."""
        if not self.checksummed or chunk != self.chunk or not chunks.size:
            return None
        per_shard = self.shard // self.chunk
        out = np.empty(chunks.shape, np.uint32)
        shard_of = chunks // per_shard
        bounds = np.flatnonzero(np.diff(shard_of)) + 1
        for a, b in zip([0, *bounds.tolist()], [*bounds.tolist(), chunks.size], strict=True):
            i = int(shard_of[a])
            arr = self.shard_array(i)
            if not isinstance(arr, _Checksummed):
                return None
            local = chunks[a:b] - i * per_shard
            if local[-1] >= arr.crcs.size:
                return None
            if not arr.verify(local):
                return None
            out[a:b] = arr.crcs[local]
        return out

    def read_points(self, indices: np.ndarray) -> np.ndarray | None:
        """Elements at ``indices`` (``[k] int64``), or ``None`` as :meth:`read`."""
        out = np.empty(indices.shape, self.dtype)
        shard_of = indices // self.shard
        for i in np.unique(shard_of).tolist():
            arr = self.shard_array(i)
            if arr is None:
                return None
            here = shard_of == i
            local = indices[here] - i * self.shard
            values = arr.points(local) if isinstance(arr, _Checksummed) else arr[local]
            if values is None:
                return None
            out[here] = values
        return out
