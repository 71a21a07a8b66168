"""Megatron/Nanotron MMIDIDX indexes (``PREFIX.idx`` + ``PREFIX.bin``), read and checked.

The index holds a 34-byte header (magic ``MMIDIDX\\0\\0``, version ``uint64`` 1,
dtype code ``uint8``, ``num_sequences`` and ``num_documents + 1`` as ``uint64``),
then ``sizes int32[num_sequences]``, ``pointers int64[num_sequences]`` (byte
offsets into ``.bin``) and ``doc_idx int64[num_documents + 1]`` (the sequence
where each document starts). All little-endian.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import struct
from typing import Any

import numpy as np

from flat_tokens_jax.core.format import MAX_TOKEN_ID

log = logging.getLogger(__name__)

MAGIC = b"MMIDIDX\x00\x00"
HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, len(sizes), len(doc_idx)
# Megatron-core's DType codes (legacy Megatron read 6 and 7 both as float64).
_CODES = {1: "u1", 2: "i1", 3: "<i2", 4: "<i4", 5: "<i8", 6: "<f8", 7: "<f4", 8: "<u2"}
DTYPES: dict[int, np.dtype[Any]] = {code: np.dtype(name) for code, name in _CODES.items()}
_BLOCK = 1 << 20  # index entries checked at a time


class MegatronFormatError(ValueError):
    """An ``.idx``/``.bin`` pair that breaks the MMIDIDX layout, or holds unstorable tokens."""


@dataclasses.dataclass(frozen=True)
class MegatronIndex:
    """A checked ``PREFIX.idx`` (views of the mapped file) and ``PREFIX.bin`` mapped.

    ``sizes`` ``[num_sequences] int32`` tokens per sequence; ``pointers``
    ``[num_sequences] int64`` their byte offsets in ``bin`` (``[bin_bytes] uint8``);
    ``doc_idx`` ``[num_documents + 1] int64`` the first sequence of each document.
    """

    prefix: str
    dtype_code: int
    sizes: np.ndarray
    pointers: np.ndarray
    doc_idx: np.ndarray
    bin: np.ndarray

    @property
    def dtype(self) -> np.dtype[Any]:
        return DTYPES[self.dtype_code]


def _map(path: str) -> np.ndarray:
    return np.memmap(path, np.uint8, "r") if os.path.getsize(path) else np.zeros(0, np.uint8)


def read_index(prefix: str | os.PathLike[str]) -> MegatronIndex:
    """Parses and checks ``PREFIX.idx`` against ``PREFIX.bin``.

    Raises:
        MegatronFormatError: naming the file, the field or byte offset, and the
            expected and found values.
        FileNotFoundError: either file is missing.
    """
    prefix = os.fspath(prefix)
    idx_path, bin_path = prefix + ".idx", prefix + ".bin"
    idx = _map(idx_path)
    head = bytes(idx[: HEADER.size])
    if head[:9] != MAGIC:
        raise MegatronFormatError(
            f"{idx_path}: bytes 0-8 are {head[:9]!r}, expected the magic {MAGIC!r}: "
            "not a Megatron MMIDIDX index"
        )
    if len(head) < HEADER.size:
        raise MegatronFormatError(
            f"{idx_path}: {len(head)} bytes, shorter than the {HEADER.size}-byte header"
        )
    _, version, code, n, m = HEADER.unpack(head)
    if version != 1:
        raise MegatronFormatError(f"{idx_path}: version (byte 9) is {version}, expected 1")
    if code not in DTYPES:
        raise MegatronFormatError(
            f"{idx_path}: dtype code (byte 17) is {code}, expected one of {sorted(DTYPES)}"
        )
    offset = HEADER.size
    arrays: list[np.ndarray] = []
    for name, dtype, count in (("sizes", "<i4", n), ("pointers", "<i8", n), ("doc_idx", "<i8", m)):
        end = offset + np.dtype(dtype).itemsize * count
        if end > idx.size:
            raise MegatronFormatError(
                f"{idx_path}: {name} ({count} entries from byte {offset}) would end at byte "
                f"{end}, beyond the file's {idx.size} bytes: truncated, or a wrong count"
            )
        arrays.append(np.frombuffer(idx, dtype, count, offset))
        offset = end
    if offset < idx.size:
        log.warning("%s: %d bytes after doc_idx ignored", idx_path, idx.size - offset)
    sizes, pointers, doc_idx = arrays
    index = MegatronIndex(prefix, code, sizes, pointers, doc_idx, _map(bin_path))
    _check_doc_idx(index, idx_path)
    _check_sequences(index, idx_path)
    return index


def _check_doc_idx(index: MegatronIndex, where: str) -> None:
    doc, n = index.doc_idx, index.sizes.size
    if doc.size == 0 or doc[0] != 0 or doc[-1] != n:
        found = "empty" if doc.size == 0 else f"[{doc[0]}, ..., {doc[-1]}]"
        raise MegatronFormatError(
            f"{where}: doc_idx is {found}, expected to start at 0 and end at num_sequences {n}"
        )
    for lo in range(0, doc.size - 1, _BLOCK):
        block = doc[lo : lo + _BLOCK + 1]
        bad = np.flatnonzero(block[1:] < block[:-1])
        if bad.size:
            i = lo + int(bad[0]) + 1
            raise MegatronFormatError(
                f"{where}: doc_idx[{i}] is {doc[i]}, below doc_idx[{i - 1}] = {doc[i - 1]}: "
                "expected non-decreasing"
            )


def _check_sequences(index: MegatronIndex, where: str) -> None:
    limit = index.bin.size
    for lo in range(0, index.sizes.size, _BLOCK):
        sizes = index.sizes[lo : lo + _BLOCK].astype(np.int64)
        ptrs = index.pointers[lo : lo + _BLOCK]
        bad = np.flatnonzero(sizes < 0)
        if bad.size:
            i = lo + int(bad[0])
            raise MegatronFormatError(f"{where}: sizes[{i}] is {sizes[i - lo]}, expected >= 0")
        nbytes = sizes * index.dtype.itemsize
        bad = np.flatnonzero((ptrs < 0) | (ptrs > limit) | (nbytes > limit - ptrs))
        if bad.size:
            i = lo + int(bad[0])
            raise MegatronFormatError(
                f"{where}: sequence {i} (pointers[{i}] = {ptrs[i - lo]}, sizes[{i}] = "
                f"{sizes[i - lo]}) spans bytes [{ptrs[i - lo]}, "
                f"{int(ptrs[i - lo]) + int(nbytes[i - lo])}), "
                f"expected within the {limit} bytes of {index.prefix}.bin"
            )


def read_tokens(index: MegatronIndex, first: int, stop: int) -> np.ndarray:
    """Token ids ``[sum(sizes[first:stop])] int64`` of sequences ``[first, stop)``,
    checked to be whole numbers in ``[0, 2**31 - 1]`` (else MegatronFormatError)."""
    size = index.dtype.itemsize
    nbytes = index.sizes[first:stop].astype(np.int64) * size
    ptrs = index.pointers[first:stop]
    ends = np.cumsum(nbytes)
    total = int(ends[-1]) if ends.size else 0
    if ptrs.size and np.array_equal(ptrs[1:] - ptrs[0], ends[:-1]):
        raw = np.asarray(index.bin[ptrs[0] : ptrs[0] + total])
    else:  # sequences not stored back to back (rare): gather their bytes
        raw = index.bin[np.repeat(ptrs - (ends - nbytes), nbytes) + np.arange(total)]
    # Compare floats as float64: float32(2**31 - 1) rounds up to 2**31.
    values = raw.view(index.dtype).astype(np.float64 if index.dtype.kind == "f" else np.int64)
    ok = (values >= 0) & (values <= MAX_TOKEN_ID)
    if index.dtype.kind == "f":
        ok &= values == np.floor(values)
    if not ok.all():
        pos = int(np.flatnonzero(~ok)[0])
        seq = int(np.searchsorted(ends // size, pos, side="right"))
        at = pos - (int(ends[seq - 1]) // size if seq else 0)
        raise MegatronFormatError(
            f"{index.prefix}.bin: sequence {first + seq}, token {at} (byte "
            f"{int(ptrs[seq]) + at * size}) is {values[pos]}, expected a whole number "
            f"in [0, {MAX_TOKEN_ID}]"
        )
    return values.astype(np.int64, copy=False)
