"""Megatron/Nanotron MMIDIDX indexed datasets (``PREFIX.idx`` + ``PREFIX.bin``) in and out:
``import-megatron`` and ``export-megatron`` (the index format: :mod:`.mmidx`)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from flat_tokens_jax.convert.commands import (
    add_output_flags,
    path_error,
    run_command,
    store_options,
)
from flat_tokens_jax.convert.importer import (
    CHUNK_TOKENS,
    add_import_flags,
    import_files,
    run_import,
)
from flat_tokens_jax.convert.mmidx import (
    DTYPES,
    HEADER,
    MAGIC,
    MegatronIndex,
    read_index,
    read_tokens,
)
from flat_tokens_jax.convert.tokenizer import identity, load_tokenizer
from flat_tokens_jax.core.format import decode
from flat_tokens_jax.data.dataset import open_dataset
from flat_tokens_jax.data.writer import StorageFormat
from flat_tokens_jax.store.identity import DatasetInfo
from flat_tokens_jax.store.location import refuse_overlap
from flat_tokens_jax.store.options import StoreOptions, resolve_options

log = logging.getLogger(__name__)

_BLOCK = 1 << 20  # index entries written at a time


@dataclasses.dataclass(frozen=True)
class _MegatronFile:
    """A checked index's documents (sequences concatenated) or sequences, as a TokenFile."""

    index: MegatronIndex
    per_sequence: bool

    @property
    def num_documents(self) -> int:
        return self.index.sizes.size if self.per_sequence else self.index.doc_idx.size - 1

    def _sequences(self, lo: int, hi: int) -> np.ndarray:
        return np.arange(lo, hi + 1) if self.per_sequence else self.index.doc_idx[lo : hi + 1]

    def lengths(self, lo: int, hi: int) -> np.ndarray:
        bounds = self._sequences(lo, hi).astype(np.int64)
        tokens = np.zeros(bounds[-1] - bounds[0] + 1, np.int64)
        np.cumsum(self.index.sizes[bounds[0] : bounds[-1]], out=tokens[1:])
        return np.diff(tokens[bounds - bounds[0]])

    def read(self, lo: int, hi: int) -> tuple[np.ndarray, None]:
        bounds = self._sequences(lo, hi)
        return read_tokens(self.index, int(bounds[0]), int(bounds[-1])), None

    def stats(self) -> dict[str, Any]:
        ix = self.index
        return {
            "prefix": ix.prefix,
            "dtype": ix.dtype.name,
            "dtype_code": ix.dtype_code,
            "documents": ix.doc_idx.size - 1,
            "sequences": ix.sizes.size,
        }


def import_megatron(
    prefixes: Sequence[str | os.PathLike[str]],
    output: str | os.PathLike[str],
    *,
    per_sequence: bool = False,
    storage_format: StorageFormat | None = None,
    overwrite: bool = False,
    split: str = "train",
    progress: Callable[[int, int], None] | None = None,
    options: StoreOptions | None = None,
    chunk_tokens: int = CHUNK_TOKENS,
    tokenizer: str | os.PathLike[str] | None = None,
    **option_fields: Any,
) -> dict[str, Any]:
    """Writes Megatron indexed datasets, concatenated in order, as a new flat-tokens dataset.

    Every index is checked before anything is written. Each Megatron document (its
    sequences concatenated), or with ``per_sequence`` each sequence, becomes one sequence;
    empty ones are skipped and counted. The root attribute ``{"megatron": {"dtype_code": c}}``
    records the source dtype when all prefixes agree, for :func:`export_megatron`.

    Args:
        prefixes: paths without ``.idx``/``.bin``.
        output: the new dataset's path or URL.
        storage_format, overwrite, options: as for :class:`DatasetWriter`
            (or ``options``' fields as keywords: ``**option_fields``).
        split: the split that receives everything (``train`` and ``validation``
            are written even when empty).
        progress: called after each chunk with ``(tokens_done, tokens_total)``.
        chunk_tokens: tokens per write, in whole units. Recommended: ``1 << 20``.
        tokenizer: the tokenizer that made the ids (a ``tokenizers`` JSON file
            or ``transformers`` directory), only to record its identity.

    The output's :class:`DatasetInfo` hashes each prefix as its ``.idx`` then its ``.bin``.

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
    prefixes = [prefixes] if isinstance(prefixes, str | os.PathLike) else list(prefixes)
    if not prefixes:
        raise ValueError("import_megatron needs at least one prefix")
    indexes = [read_index(p) for p in prefixes]
    tok = None if tokenizer is None else identity(load_tokenizer(tokenizer))
    codes = sorted({ix.dtype_code for ix in indexes})
    code = codes[0] if len(codes) == 1 else None
    flags = {"converter": "import-megatron", "per_sequence": per_sequence, "dtype_code": code}
    summary = import_files(
        [functools.partial(_MegatronFile, ix, per_sequence) for ix in indexes],
        output,
        hashed=[f"{os.fspath(p)}{ext}" for p in prefixes for ext in (".idx", ".bin")],
        info=DatasetInfo(tokenizer=tok, flags=flags),
        names=[os.fspath(p) for p in prefixes],
        key="prefixes",
        split=split,
        storage_format=storage_format,
        overwrite=overwrite,
        options=options,
        chunk_tokens=chunk_tokens,
        attributes={} if code is None else {"megatron": {"dtype_code": code}},
        progress=progress,
        total=sum(int(ix.sizes.sum(dtype=np.int64)) for ix in indexes),
    )
    return {**summary, "per_sequence": per_sequence, "dtype_code": code}


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
        ValueError: a split the dataset lacks, an unknown dtype code, a dtype
            that cannot hold ``max_token_id``, or a ``PREFIX`` inside the dataset,
            that is a directory, or in a folder that does not exist.
        FormatError: no valid dataset at ``url``.
    """
    options = resolve_options(options, option_fields, "export_megatron")
    began = time.perf_counter()
    prefix = os.fspath(prefix)
    if not os.path.basename(prefix) or os.path.isdir(prefix):
        # The files would be the hidden PREFIX/.bin and PREFIX/.idx.
        raise ValueError(
            f"the export prefix {prefix} is a directory, but Megatron's files are "
            f"PREFIX.bin and PREFIX.idx: name them, e.g. "
            f"{os.path.join(prefix, split)} for {os.path.join(prefix, split)}.bin/.idx"
        )
    if not os.path.isdir(os.path.dirname(os.path.abspath(prefix))):
        # Found before the data is read, and prefix as given, not as the temporary files.
        raise path_error("the export prefix", prefix, FileNotFoundError(), "a PREFIX")
    refuse_overlap([url], [prefix + ext for ext in (".bin", ".idx")])
    ds = open_dataset(url, options)
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
    except OSError as e:  # named by the files asked for, not their temporary names
        raise OSError(
            f"the export prefix {prefix}: cannot write {prefix}.bin/.idx: {e.strerror or e}"
        ) from None
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
    p.add_argument("inputs", nargs="+", metavar="PREFIX", help="paths without .idx/.bin")
    p.add_argument("output", metavar="OUTPUT", help="the new dataset")
    p.add_argument(
        "--per-sequence",
        action="store_true",
        help="one sequence per Megatron sequence, not per document",
    )
    add_import_flags(p)
    run = functools.partial(run_import, import_megatron, "Megatron dataset(s)", ["per_sequence"])
    p.set_defaults(run=run)
    p = subparsers.add_parser("export-megatron", help="one split to Megatron PREFIX.idx/.bin")
    p.add_argument("url", metavar="URL", help="dataset path or URL")
    p.add_argument("prefix", metavar="PREFIX", help="output path without .idx/.bin")
    p.add_argument("--split", default="train", help="the split to export")
    p.add_argument(
        "--dtype-code",
        type=int,
        choices=sorted(DTYPES),
        help="1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16 "
        "(default: the imported one, else 8 if max_token_id < 65500, else 4)",
    )
    add_output_flags(p, overwrite=False)
    p.set_defaults(run=_cmd_export)


def _cmd_export(args: argparse.Namespace) -> int:
    def describe(s: dict[str, Any]) -> str:
        return (
            f"exported {s['url']} [{s['split']}] to {s['prefix']}.idx/.bin: "
            f"{s['sequences']:,} sequences, {s['tokens']:,} tokens as {s['dtype']} "
            f"(code {s['dtype_code']}), in {s['seconds']:.1f}s"
        )

    return run_command(
        args,
        lambda: export_megatron(
            args.url,
            args.prefix,
            split=args.split,
            dtype_code=args.dtype_code,
            options=store_options(args),
        ),
        describe,
    )
