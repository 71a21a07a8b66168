"""Megatron/Nanotron MMIDIDX indexed datasets (``PREFIX.idx`` + ``PREFIX.bin``) in and out.

The index holds a 34-byte header (magic ``MMIDIDX\\0\\0``, version ``uint64`` 1,
dtype code ``uint8``, ``num_sequences`` and ``num_documents + 1`` as ``uint64``),
then ``sizes int32[num_sequences]``, ``pointers int64[num_sequences]`` (byte
offsets into ``.bin``) and ``doc_idx int64[num_documents + 1]`` (the sequence
where each document starts). All little-endian.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import logging
import os
import struct
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from flat_tokens_jax.convert.commands import add_store_flags, run_command, store_options
from flat_tokens_jax.convert.inputs import hash_inputs
from flat_tokens_jax.convert.tokenizer import identity, load_tokenizer
from flat_tokens_jax.core.format import MAX_TOKEN_ID, SPLITS, decode, encode_concatenated
from flat_tokens_jax.data.dataset import open_dataset
from flat_tokens_jax.data.writer import DatasetWriter, Layout
from flat_tokens_jax.store.identity import DatasetInfo, inputs_record
from flat_tokens_jax.store.location import refuse_overlap
from flat_tokens_jax.store.options import StoreOptions, resolve_options

log = logging.getLogger(__name__)

MAGIC = b"MMIDIDX\x00\x00"
HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, len(sizes), len(doc_idx)
# Megatron-core's DType codes (legacy Megatron read 6 and 7 both as float64).
_CODES = {1: "u1", 2: "i1", 3: "<i2", 4: "<i4", 5: "<i8", 6: "<f8", 7: "<f4", 8: "<u2"}
DTYPES: dict[int, np.dtype[Any]] = {code: np.dtype(name) for code, name in _CODES.items()}
CHUNK_TOKENS = 1 << 20
_BLOCK = 1 << 20  # index entries checked or converted at a time


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
    """Token ids ``[sum(sizes[first:stop])] int64`` of sequences ``[first, stop)``, checked.

    Raises:
        MegatronFormatError: a token that is not a whole number in ``[0, 2**31 - 1]``.
    """
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


def _runs(
    index: MegatronIndex, per_sequence: bool, chunk_tokens: int
) -> Iterator[tuple[int, int, np.ndarray]]:
    """Runs of whole units (documents, or sequences) of about ``chunk_tokens`` tokens.

    Yields ``(first, stop, lengths)``: the run is sequences ``[first, stop)`` and
    ``lengths`` ``[k] int64`` the token counts of its ``k`` units (at least one).
    """
    units = index.sizes.size if per_sequence else index.doc_idx.size - 1
    doc = index.doc_idx
    lo = 0
    while lo < units:
        hi = min(lo + _BLOCK, units)  # also at most about _BLOCK sequences:
        if not per_sequence:
            hi = min(hi, int(np.searchsorted(doc, doc[lo] + _BLOCK, "right")) - 1)
        hi = max(hi, lo + 1)
        bounds = np.arange(lo, hi + 1) if per_sequence else doc[lo : hi + 1].astype(np.int64)
        tokens = np.zeros(bounds[-1] - bounds[0] + 1, np.int64)
        np.cumsum(index.sizes[bounds[0] : bounds[-1]], out=tokens[1:])
        at = tokens[bounds - bounds[0]]
        window = at[:-1] // chunk_tokens
        cuts = [0, *(np.flatnonzero(np.diff(window)) + 1).tolist(), hi - lo]
        for a, b in itertools.pairwise(cuts):
            yield int(bounds[a]), int(bounds[b]), np.diff(at[a : b + 1])
        lo = hi


def import_megatron(
    prefixes: Sequence[str | os.PathLike[str]],
    output: str | os.PathLike[str],
    *,
    per_sequence: bool = False,
    layout: Layout | None = None,
    overwrite: bool = False,
    split: str = "train",
    progress: Callable[[int, int], None] | None = None,
    options: StoreOptions | None = None,
    chunk_tokens: int = CHUNK_TOKENS,
    tokenizer: str | os.PathLike[str] | None = None,
    **option_fields: Any,
) -> dict[str, Any]:
    """Writes Megatron indexed datasets, concatenated in order, as a new flat-tokens dataset.

    Every index is checked before anything is written. Each Megatron document
    (its sequences concatenated), or with ``per_sequence`` each sequence, becomes
    one flat-tokens sequence; empty ones cannot be stored and are skipped and
    counted. The root attribute ``{"megatron": {"dtype_code": c}}`` records the
    source dtype when all prefixes agree, for :func:`export_megatron`.

    Args:
        prefixes: paths without ``.idx``/``.bin``.
        output: the new dataset's path or URL.
        layout, overwrite, options: as for :class:`DatasetWriter`.
        **option_fields: or the fields of ``options`` as keywords.
        split: ``"train"`` or ``"validation"``: it receives everything; the other
            is written empty.
        progress: called after each chunk with ``(tokens_done, tokens_total)``.
        chunk_tokens: tokens per write, in whole units. Recommended: ``1 << 20``.
        tokenizer: the tokenizer that made the ids (a ``tokenizers`` JSON file
            or ``transformers`` directory), only to record its identity.

    The output records (:class:`DatasetInfo`) the tokenizer when given, the
    flags ``per_sequence`` and ``dtype_code``, and the prefixes with a SHA-256
    over the digests of each prefix's ``.idx`` then ``.bin``.

    Returns:
        A JSON-ready summary: per prefix its dtype, documents, sequences, tokens
        and skipped empty units; in all, the sequences and tokens written.

    Raises:
        MegatronFormatError: a broken index or an unstorable token; nothing valid
            is left at ``output``.
        FileExistsError: ``output`` holds a dataset and ``overwrite`` is false,
            or holds files that are not a flat-tokens dataset.
        ValueError: ``output`` is, contains or lies inside an input file.
    """
    options = resolve_options(options, option_fields, "import_megatron")
    began = time.perf_counter()
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    prefixes = [prefixes] if isinstance(prefixes, str | os.PathLike) else list(prefixes)
    if not prefixes:
        raise ValueError("import_megatron needs at least one prefix")
    refuse_overlap([os.fspath(p) + ext for p in prefixes for ext in (".bin", ".idx")], [output])
    indexes = [read_index(p) for p in prefixes]
    tok = None if tokenizer is None else identity(load_tokenizer(tokenizer))
    codes = sorted({ix.dtype_code for ix in indexes})
    code = codes[0] if len(codes) == 1 else None
    totals = [int(ix.sizes.sum(dtype=np.int64)) for ix in indexes]
    done = written = 0
    stats: list[dict[str, Any]] = []
    attributes = {} if code is None else {"megatron": {"dtype_code": code}}
    files = [Path(f"{os.fspath(p)}{ext}") for p in prefixes for ext in (".idx", ".bin")]
    with (
        DatasetWriter(
            output, layout=layout, overwrite=overwrite, options=options, attributes=attributes
        ) as writer,
        hash_inputs(files) as digests,
    ):
        for ix, tokens in zip(indexes, totals, strict=True):
            skipped = 0
            for first, stop, lengths in _runs(ix, per_sequence, chunk_tokens):
                ids = read_tokens(ix, first, stop)
                kept = lengths[lengths > 0]
                if kept.size:
                    encoded = encode_concatenated(ids, np.cumsum(kept) - kept)
                    writer.extend_encoded(split, encoded, kept)
                skipped += lengths.size - kept.size
                written += kept.size
                done += ids.size
                if progress is not None:
                    progress(done, sum(totals))
            stats.append(
                {
                    "prefix": ix.prefix,
                    "dtype": ix.dtype.name,
                    "dtype_code": ix.dtype_code,
                    "documents": ix.doc_idx.size - 1,
                    "sequences": ix.sizes.size,
                    "tokens": tokens,
                    "skipped_empty": skipped,
                }
            )
        writer.info = DatasetInfo(
            tokenizer=tok,
            flags={
                "converter": "import-megatron",
                "per_sequence": per_sequence,
                "dtype_code": code,
            },
            inputs=inputs_record([os.fspath(p) for p in prefixes], digests()),
        )
    return {
        "output": os.fspath(output),
        "split": split,
        "per_sequence": per_sequence,
        "prefixes": stats,
        "sequences_written": written,
        "tokens": done,
        "skipped_empty": sum(s["skipped_empty"] for s in stats),
        "dtype_code": code,
        "seconds": round(time.perf_counter() - began, 3),
    }


def _largest_id(dtype: np.dtype[Any]) -> int:
    """The largest token id ``dtype`` holds exactly (with every smaller one)."""
    return 2 ** (np.finfo(dtype).nmant + 1) if dtype.kind == "f" else int(np.iinfo(dtype).max)


def export_megatron(
    url: str | os.PathLike[str],
    prefix: str | os.PathLike[str],
    *,
    split: str = "train",
    dtype_code: int | None = None,
    options: StoreOptions | None = None,
    chunk_tokens: int = CHUNK_TOKENS,
    **option_fields: Any,
) -> dict[str, Any]:
    """Writes one split as ``PREFIX.bin``/``PREFIX.idx``, one sequence and document apiece.

    The dtype is ``dtype_code``, else the root attribute ``megatron.dtype_code``
    (set by :func:`import_megatron`), else Megatron's rule: ``uint16`` (8) when
    ``max_token_id < 65500``, ``int32`` (4) otherwise. Both files are written
    under temporary names and renamed at the end, ``.idx`` last, so an
    interrupted export leaves no pair that looks valid. Existing files are replaced.

    Returns:
        A JSON-ready summary: sequences, tokens and the dtype written.

    Raises:
        ValueError: a split the dataset lacks, an unknown dtype code, or a dtype
            that cannot hold ``max_token_id``.
        ValueError: also when ``PREFIX`` lies inside the dataset at ``url``,
            or is a directory (``dir/`` would write hidden ``dir/.bin``).
        FormatError: no valid dataset at ``url``.
    """
    options = resolve_options(options, option_fields, "export_megatron")
    began = time.perf_counter()
    named = os.fspath(prefix)
    if not os.path.basename(named) or os.path.isdir(named):
        # The files would be the hidden PREFIX/.bin and PREFIX/.idx.
        raise ValueError(
            f"the export prefix {named} is a directory, but Megatron's files are "
            f"PREFIX.bin and PREFIX.idx: name them, e.g. "
            f"{os.path.join(named, split)} for {os.path.join(named, split)}.bin/.idx"
        )
    refuse_overlap([url], [os.fspath(prefix) + ext for ext in (".bin", ".idx")])
    ds = open_dataset(url, options)
    if split not in ds:
        raise ValueError(f"{ds.url} has no split {split!r}; it has {ds.splits}")
    ft = ds[split]
    recorded = ds.attributes.get("megatron")
    origin = "given"
    if dtype_code is None and isinstance(recorded, dict):
        dtype_code, origin = recorded.get("dtype_code"), "from the megatron.dtype_code attribute"
    code = (8 if ft.max_token_id < 65500 else 4) if dtype_code is None else dtype_code
    if code not in DTYPES:
        raise ValueError(f"dtype code {code!r} is not one of Megatron's {sorted(DTYPES)}")
    dtype, n = DTYPES[code], ft.num_sequences
    if ft.max_token_id > _largest_id(dtype):
        raise ValueError(
            f"dtype code {code} ({dtype.name}, {origin}) holds token ids up to "
            f"{_largest_id(dtype)} but {ds.url} [{split}] has max_token_id {ft.max_token_id}: "
            "pass dtype_code=4 (int32; --dtype-code 4)"
        )
    if ft.loss_mask is not None:
        log.warning("%r: the loss_mask is not exported (Megatron files have none)", ft)
    prefix = os.fspath(prefix)
    tmp = {ext: f"{prefix}{ext}.tmp-{os.getpid()}-{time.time_ns()}" for ext in (".bin", ".idx")}
    try:
        with open(tmp[".bin"], "wb") as f:
            ahead, end = None, ft.num_tokens  # read the next chunk while writing one
            for a in range(0, end + chunk_tokens, chunk_tokens):
                read = ft.request_encoded([min(a, end)], [min(a + chunk_tokens, end)])
                if ahead is not None:
                    f.write(decode(ahead.result()[0]).astype(dtype).tobytes())
                ahead = read
        with open(tmp[".idx"], "wb") as f:
            f.write(HEADER.pack(MAGIC, 1, code, n, n + 1))
            for lo in range(0, n, _BLOCK):
                starts, stops = ft.sequence_bounds(np.arange(lo, min(lo + _BLOCK, n)))
                if int((stops - starts).max()) > np.iinfo(np.int32).max:
                    raise ValueError(f"{ft!r}: a sequence in [{lo}, {lo + _BLOCK}) is too long")
                f.seek(HEADER.size + 4 * lo)
                f.write((stops - starts).astype("<i4").tobytes())
                f.seek(HEADER.size + 4 * n + 8 * lo)
                f.write((starts * dtype.itemsize).astype("<i8").tobytes())
            f.seek(HEADER.size + 12 * n)
            for lo in range(0, n + 1, _BLOCK):
                f.write(np.arange(lo, min(lo + _BLOCK, n + 1), dtype="<i8").tobytes())
        with contextlib.suppress(FileNotFoundError):
            os.remove(prefix + ".idx")  # never pair an old index with the new .bin
        for ext in (".bin", ".idx"):
            os.replace(tmp[ext], prefix + ext)
    finally:
        for path in tmp.values():
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
    return {
        "url": ds.url,
        "split": split,
        "prefix": prefix,
        "sequences": n,
        "tokens": ft.num_tokens,
        "dtype": dtype.name,
        "dtype_code": code,
        "seconds": round(time.perf_counter() - began, 3),
    }


def add_commands(subparsers: Any) -> None:
    """Registers ``flat-tokens import-megatron`` and ``flat-tokens export-megatron``."""
    p = subparsers.add_parser("import-megatron", help="Megatron .idx/.bin pairs to flat-tokens")
    p.add_argument("prefixes", nargs="+", metavar="PREFIX", help="paths without .idx/.bin")
    p.add_argument("output", metavar="OUTPUT", help="the new dataset")
    p.add_argument(
        "--per-sequence",
        action="store_true",
        help="one sequence per Megatron sequence, not per document",
    )
    p.add_argument("--split", default="train", choices=SPLITS, help="the split to write")
    p.add_argument(
        "--tokenizer",
        help="the tokenizer that made the ids (JSON file or transformers directory), recorded "
        "in the dataset's info so that merge and Mixture can check it",
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing OUTPUT")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    add_store_flags(p)
    p.set_defaults(run=_cmd_import)
    p = subparsers.add_parser("export-megatron", help="one split to Megatron PREFIX.idx/.bin")
    p.add_argument("url", metavar="URL", help="dataset path or URL")
    p.add_argument("prefix", metavar="PREFIX", help="output path without .idx/.bin")
    p.add_argument("--split", default="train", choices=SPLITS, help="the split to export")
    p.add_argument(
        "--dtype-code",
        type=int,
        choices=sorted(DTYPES),
        help="1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16 "
        "(default: the imported one, else 8 if max_token_id < 65500, else 4)",
    )
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    add_store_flags(p)
    p.set_defaults(run=_cmd_export)


def _cmd_import(args: argparse.Namespace) -> int:
    def describe(s: dict[str, Any]) -> str:
        return (
            f"imported {len(s['prefixes'])} Megatron dataset(s) into {s['output']} "
            f"[{s['split']}]: {s['sequences_written']:,} sequences, {s['tokens']:,} tokens, "
            f"{s['skipped_empty']:,} empty skipped, in {s['seconds']:.1f}s"
        )

    return run_command(
        "import-megatron",
        lambda: import_megatron(
            args.prefixes,
            args.output,
            per_sequence=args.per_sequence,
            overwrite=args.overwrite,
            split=args.split,
            options=store_options(args),
            tokenizer=args.tokenizer,
        ),
        as_json=args.json,
        describe=describe,
        errors=(ValueError, OSError, ImportError),
    )


def _cmd_export(args: argparse.Namespace) -> int:
    def describe(s: dict[str, Any]) -> str:
        return (
            f"exported {s['url']} [{s['split']}] to {s['prefix']}.idx/.bin: "
            f"{s['sequences']:,} sequences, {s['tokens']:,} tokens as {s['dtype']} "
            f"(code {s['dtype_code']}), in {s['seconds']:.1f}s"
        )

    return run_command(
        "export-megatron",
        lambda: export_megatron(
            args.url,
            args.prefix,
            split=args.split,
            dtype_code=args.dtype_code,
            options=store_options(args),
        ),
        as_json=args.json,
        describe=describe,
    )
