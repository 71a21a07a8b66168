"""``import-datatrove``, ``import-dolma`` and ``import-levanter``: a reader of each format
(its layout, as its writer writes it, in its docstring) for :func:`.importer.import_files`."""

from __future__ import annotations

import csv
import dataclasses
import functools
import gzip
import importlib
import io
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorstore as ts

from flat_tokens_jax.convert.importer import (
    CHUNK_TOKENS,
    Blob,
    TokenFile,
    add_import_flags,
    checked_ids,
    expand,
    import_files,
    run_import,
)
from flat_tokens_jax.convert.inputs import InputError, require
from flat_tokens_jax.convert.tokenizer import identity, load_tokenizer
from flat_tokens_jax.core.values import choice
from flat_tokens_jax.data.writer import StorageFormat
from flat_tokens_jax.store.identity import DatasetInfo
from flat_tokens_jax.store.options import StoreError, StoreOptions, resolve_options
from flat_tokens_jax.store.store import Store

UNKNOWN_TOKENIZER = "Unknown Tokenizer"  # what datatrove's metadata names when it had none
LEDGER = "shard_ledger.json"  # a Levanter cache's CacheLedger


def _ends(ends: np.ndarray, where: str, what: str, first: int = 0, start: int = 0) -> np.ndarray:
    """``ends`` of documents ``first, ...`` as int64, refused if one decreases from ``start``."""
    bad = np.flatnonzero(np.diff(ends.astype(np.int64), prepend=start) < 0)
    if bad.size:
        at = int(bad[0])
        before = int(ends[at - 1]) if at else start
        raise InputError(f"{where}: {what} {first + at} ends at {int(ends[at])}, before {before}")
    return ends.astype(np.int64)


class _Ends:
    """A file of documents back to back, given by their end offsets ``[k] int64``."""

    ends: np.ndarray
    blob: Blob
    dtype: np.dtype[Any]
    loss: Blob | None = None

    @property
    def num_documents(self) -> int:
        return self.ends.size

    def _bounds(self, lo: int, hi: int) -> tuple[int, int]:
        return int(self.ends[lo - 1]) if lo else 0, int(self.ends[hi - 1])

    def lengths(self, lo: int, hi: int) -> np.ndarray:
        return np.diff(self.ends[lo:hi], prepend=self._bounds(lo, lo + 1)[0])

    def read(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray | None]:
        a, b = self._bounds(lo, hi)
        mask = None if self.loss is None else np.frombuffer(self.loss.read(a, b), np.uint8)
        raw = self.blob.read(a * self.dtype.itemsize, b * self.dtype.itemsize)
        return checked_ids(np.frombuffer(raw, self.dtype), self.blob.url, a), mask

    def stats(self) -> dict[str, Any]:
        return {"file": self.blob.url, "documents": self.num_documents, "dtype": self.dtype.name}


class DatatroveFile(_Ends):
    """A datatrove tokenized file, as datatrove 0.10's ``TokenizedFile``
    (``src/datatrove/pipeline/tokens/tokenizer.py``, written by ``DocumentTokenizer``
    and ``DocumentTokenizerMerger``) writes it:

    - ``NAME.ds``: the tokens, little-endian ``uint16`` (token size 2) or ``uint32``
      (4) back to back (``struct.pack("<%sH")`` / ``"<%sI"``);
    - ``NAME.ds.index``: ``uint64`` each document's END offset in tokens (no
      leading 0; ``struct.pack("<%sQ", *doc_ends)``);
    - ``NAME.ds.loss`` (with ``save_loss_metadata``): one byte a token, 0 or 1;
    - ``NAME.ds.metadata`` (``save_final_metadata``, the default): the lines
      ``TOKENIZER|TOKEN_SIZE`` (``Unknown Tokenizer|2|2`` without one), the token
      count, and the count humanized. Without it the token size is 2, as the
      merger assumes.
    """

    def __init__(self, url: str, options: StoreOptions, *, loss: bool, meta: bytes | None):
        self.blob = Blob(url, options)
        self.loss = Blob(url + ".loss", options) if loss else None
        self.tokenizer, self.dtype, count = _metadata(url, meta)
        try:
            index = Blob(url + ".index", options).read()
        except FileNotFoundError:
            raise _missing(self.blob, ".index", "datatrove") from None
        if len(index) % 8:
            raise InputError(f"{url}.index holds {len(index)} bytes, not whole uint64 ends")
        self.ends = _ends(np.frombuffer(index, "<u8"), f"{url}.index", "document")
        end = int(self.ends[-1]) if self.ends.size else 0
        if count is not None and count != end:
            raise InputError(f"{url}.metadata counts {count} tokens but {url}.index ends at {end}")
        why = f"{url}.index ends at token {end:,}"
        self.blob.check_size(end * self.dtype.itemsize, f"{why} ({self.dtype.name})")
        if self.loss is not None:
            self.loss.check_size(end, f"{why} (one loss byte a token)")


def _metadata(url: str, meta: bytes | None) -> tuple[str | None, np.dtype[Any], int | None]:
    """``(tokenizer, dtype, token count)`` of a datatrove ``.ds.metadata`` file."""
    if meta is None:
        return None, np.dtype("<u2"), None
    lines = meta.decode("utf-8", "replace").splitlines()
    name, _, size = lines[0].rpartition("|") if lines else ("", "", "")
    if size not in ("2", "4") or len(lines) < 2 or not lines[1].strip().isdigit():
        raise InputError(
            f"{url}.metadata: expected the lines TOKENIZER|TOKEN_SIZE (2 or 4) and the "
            f"token count, got {lines[:2]}"
        )
    known = None if name.startswith(UNKNOWN_TOKENIZER) else name
    return known, np.dtype("<u2" if size == "2" else "<u4"), int(lines[1])


class DolmaFile(_Ends):
    """A dolma (and OLMo) token memmap, as dolma 1.2's ``MemmapWriter``
    (``python/dolma/tokenizer/memmap_writer.py``) writes it:

    - ``NAME.npy``: the tokens, ``uint16`` or ``uint32`` (the user's dtype)
      back to back, with no numpy header (``np.memmap``);
    - ``NAME.csv.gz`` beside it (same stem): one CSV row a document,
      ``start,end,id,src,loc`` (``MemmapMetadata``), ``start``/``end`` its token
      offsets in the ``.npy``, documents back to back from 0 (checked).
    """

    def __init__(self, url: str, options: StoreOptions, dtype: np.dtype[Any]) -> None:
        self.blob, self.dtype = Blob(url, options), dtype
        table = _csv_name(url)
        rows: list[tuple[int, int]] = []
        with io.TextIOWrapper(gzip.GzipFile(fileobj=Blob(table, options).stream())) as f:
            try:
                rows.extend((int(row[0]), int(row[1])) for row in csv.reader(f))
            except FileNotFoundError:
                raise _missing(self.blob, ".csv.gz", "dolma") from None
            except (ValueError, IndexError, OSError, EOFError) as e:
                why = f"row {len(rows) + 1} is not start,end,id,src,loc ({e})"
                raise InputError(f"{table}: {why}") from e
        starts, ends = np.array(rows, np.int64).reshape(-1, 2).T
        self.ends = _ends(ends, table, "row")
        gaps = np.flatnonzero(starts != np.concatenate([[0], ends[:-1]]))
        if gaps.size:
            at, was = int(gaps[0]), int(ends[gaps[0] - 1]) if gaps[0] else 0
            raise InputError(f"{table}: row {at + 1} starts at {starts[at]}, not at {was}")
        end = int(self.ends[-1]) if self.ends.size else 0
        self.blob.check_size(end * dtype.itemsize, f"{table} ends at token {end:,} ({dtype.name})")


def _missing(blob: Blob, suffix: str, tool: str) -> FileNotFoundError:
    """The error for a data file whose ``suffix`` file is missing: the data file's
    own when it is missing too."""
    if not blob.exists():
        return FileNotFoundError(f"{blob.url}: no such file")
    beside = blob.url.removesuffix(".npy") + suffix if suffix == ".csv.gz" else blob.url + suffix
    return FileNotFoundError(f"{beside}: no such file, which {tool} writes beside {blob.url}")


def _csv_name(url: str) -> str:
    return url.removesuffix(".npy") + ".csv.gz"


class LevanterCache:
    """A Levanter cache's ``input_ids``, as levanter's ``JaggedArrayStore``
    (``src/levanter/store/jagged_array.py``, in a ``TreeStore``: one folder per
    field) writes it: zarr v3 arrays ``input_ids/offsets`` (``int64``; element 0
    the number of rows ``n``, element ``i + 1`` the end of row ``i`` in ``data``)
    and ``input_ids/data`` (the tokens back to back), each of a huge nominal
    length. Its ``shard_ledger.json`` (``CacheLedger``), when there, must say
    ``is_finished`` and ``total_num_rows`` ``n``; its
    ``metadata.preprocessor_metadata`` names the tokenizer. The layout since
    levanter#716 (September 2024): older caches (``cache_ledger.json``) are refused.
    """

    def __init__(self, url: str, options: StoreOptions) -> None:
        # Read once, in order: chunks kept in a cache would only hold memory.
        store = self.store = Store(url, dataclasses.replace(options, cache_bytes=0))
        self.url = url.rstrip("/")
        ledger = store.read_json(LEDGER)
        self.tokenizer_meta = ((ledger or {}).get("metadata") or {}).get("preprocessor_metadata")
        where = f"{self.url}/{LEDGER}"
        if ledger is not None and not ledger.get("is_finished"):
            raise InputError(f"{where}: the cache is not finished (is_finished is not true)")
        if ledger is None and store.read_json("cache_ledger.json") is not None:
            raise InputError(f"{self.url}/cache_ledger.json: a cache older than levanter#716")
        if ledger is None and store.read_json("input_ids/offsets/zarr.json") is None:
            raise InputError(
                f"{self.url}: no Levanter cache (neither {LEDGER} nor input_ids/offsets)"
            )

        def array(name: str) -> Any:
            # A read past the data written fails, not reads zeros.
            spec: dict[str, Any] = {"driver": "zarr3", "kvstore": store.sub(f"input_ids/{name}")}
            spec["fill_missing_data_reads"] = name == "offsets"
            return store.wait(ts.open(spec, context=store.context, open=True, read=True))

        self.offsets, self.data, self.wait = array("offsets"), array("data"), store.wait
        self.num_documents = int(self.wait(self.offsets[0].read()))
        rows = (ledger or {}).get("total_num_rows", self.num_documents)
        if rows != self.num_documents:
            raise InputError(
                f"{where}: total_num_rows is {rows} but {self.url}/input_ids/offsets "
                f"holds {self.num_documents} rows"
            )

    def _offsets(self, lo: int, hi: int) -> np.ndarray:
        """``[hi - lo + 1] int64``: where document ``lo`` starts, then each one's end."""
        ends = np.asarray(self.wait(self.offsets[lo : hi + 1].read()), np.int64)
        start = 0 if lo == 0 else int(ends[0])  # offsets[0] holds the row count
        where = f"{self.url}/input_ids/offsets"
        return np.concatenate([[start], _ends(ends[1:], where, "row", lo, start)])

    def lengths(self, lo: int, hi: int) -> np.ndarray:
        return np.diff(self._offsets(lo, hi))

    def read(self, lo: int, hi: int) -> tuple[np.ndarray, None]:
        ends = self._offsets(lo, hi)
        try:
            data = self.wait(self.data[int(ends[0]) : int(ends[-1])].read())
        except StoreError as e:
            where = f"{self.url}/input_ids/offsets: row {hi - 1} ends at {int(ends[-1])}"
            raise InputError(f"{where}, past the data written ({e})") from e
        return checked_ids(np.asarray(data), f"{self.url}/input_ids/data", int(ends[0])), None

    def stats(self) -> dict[str, Any]:
        tokenizer = (self.tokenizer_meta or {}).get("tokenizer")
        dtype, n = self.data.dtype.numpy_dtype.name, self.num_documents
        return {"cache": self.url, "documents": n, "tokenizer": tokenizer, "dtype": dtype}


def _import(
    converter: str,
    files: Sequence[Callable[[], TokenFile]],
    hashed: Sequence[Sequence[str]],
    output: str | os.PathLike[str],
    found: dict[str, Any],
    tokenizer: str | os.PathLike[str] | None,
    runner: str = "local",
    pipeline_args: Sequence[str] = (),
    **inputs: Any,
) -> dict[str, Any]:
    """Runs the import here or on Beam, recording ``tokenizer`` and the flags ``found``;
    ``hashed``: each file's files to hash."""
    tok = None if tokenizer is None else identity(load_tokenizer(tokenizer))
    info = DatasetInfo(tokenizer=tok, flags={"converter": converter, **found})
    if choice(runner, "runner", ("local", "beam")) == "local":
        if pipeline_args:
            raise ValueError(f"pipeline_args {list(pipeline_args)} are Beam's: add runner beam")
        every = [f for own in hashed for f in own]
        return import_files(files, output, hashed=every, info=info, **inputs)
    require("apache_beam", "beam")
    beam = importlib.import_module("flat_tokens_jax.convert.beam")  # apache_beam is optional
    summary: dict[str, Any] = beam.import_beam(
        files, hashed, output, info=info, pipeline_args=pipeline_args, **inputs
    )
    return summary


def import_datatrove(
    paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    output: str | os.PathLike[str],
    *,
    split: str = "train",
    tokenizer: str | os.PathLike[str] | None = None,
    storage_format: StorageFormat | None = None,
    overwrite: bool = False,
    options: StoreOptions | None = None,
    chunk_tokens: int = CHUNK_TOKENS,
    runner: str = "local",
    pipeline_args: Sequence[str] = (),
    **option_fields: Any,
) -> dict[str, Any]:
    """Writes datatrove tokenized files (:class:`DatatroveFile`), concatenated in
    order, as a new flat-tokens dataset: one sequence a document.

    Args:
        paths: ``.ds`` files, globs of them, or folders (their ``*.ds``): paths,
            or ``gs://``/``s3://``/``file://`` URLs read with ``options``.
        output, split, tokenizer, storage_format, overwrite, options,
            chunk_tokens, **option_fields: as for :func:`import_megatron`.
        runner: ``"local"``, or ``"beam"``: an Apache Beam pipeline of ``pipeline_args``,
            each file a part, writing byte for byte the local import's output.

    The ``.ds.loss`` files, when every input has one, become the loss mask. The info
    records the metadata's tokenizer (flag ``tokenizer``) and the inputs, each hashed as
    its ``.ds``, ``.ds.index``, ``.ds.loss`` and ``.ds.metadata`` (those there).
    Returns a summary as :func:`import_megatron`'s (per file: ``files``; on Beam,
    ``runner`` instead). Raises InputError for a file whose index, metadata and sizes
    disagree, inputs of two tokenizers, or loss files for some inputs only.
    """
    options = resolve_options(options, option_fields, "import_datatrove")
    urls = expand(paths, ".ds", options)
    metas = {u: Blob(u + ".metadata", options) for u in urls}
    meta = {u: m.read() if m.exists() else None for u, m in metas.items()}
    loss = {u: Blob(u + ".loss", options).exists() for u in urls}
    if len(set(loss.values())) > 1:
        have, lack = (next(u for u in urls if loss[u] == v) for v in (True, False))
        raise InputError(f"{have}.loss exists but {lack}.loss does not: give all or none")
    names = {name: u for u in urls if (name := _metadata(u, meta[u])[0]) is not None}
    if len(names) > 1:
        (x, a), (y, b) = list(names.items())[:2]
        raise InputError(f"{a} was made by tokenizer {x!r} but {b} by {y!r}: import them apart")
    kept = {".loss": loss, ".metadata": {u: meta[u] is not None for u in urls}}
    return _import(
        "import-datatrove",
        [functools.partial(DatatroveFile, u, options, loss=loss[u], meta=meta[u]) for u in urls],
        [[u, u + ".index", *(u + e for e, there in kept.items() if there[u])] for u in urls],
        output,
        {"tokenizer": next(iter(names), None), "loss_mask": loss[urls[0]]},
        tokenizer,
        runner,
        pipeline_args,
        names=urls,
        split=split,
        storage_format=storage_format,
        overwrite=overwrite,
        options=options,
        chunk_tokens=chunk_tokens,
    )


def import_dolma(
    paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    output: str | os.PathLike[str],
    *,
    dtype: str,
    split: str = "train",
    tokenizer: str | os.PathLike[str] | None = None,
    storage_format: StorageFormat | None = None,
    overwrite: bool = False,
    options: StoreOptions | None = None,
    chunk_tokens: int = CHUNK_TOKENS,
    runner: str = "local",
    pipeline_args: Sequence[str] = (),
    **option_fields: Any,
) -> dict[str, Any]:
    """Writes dolma/OLMo token memmaps (:class:`DolmaFile`), concatenated in
    order, as a new flat-tokens dataset: one sequence a document.

    Args:
        paths: ``.npy`` files, globs of them, or folders (their ``*.npy``): paths,
            or ``gs://``/``s3://``/``file://`` URLs read with ``options``.
        dtype: ``"uint16"`` or ``"uint32"``: the files carry no dtype (dolma's
            ``--dtype``, OLMo's ``memmap_dtype``).
        The others: as for :func:`import_datatrove`.

    The output's info records ``dtype`` and the inputs, each hashed as its
    ``.npy`` and ``.csv.gz``. Returns and raises as :func:`import_datatrove`
    (InputError for rows that do not tile their file), ValueError for another ``dtype``.
    """
    if dtype not in ("uint16", "uint32"):
        raise ValueError(f"dtype must be 'uint16' or 'uint32' (dolma's --dtype), got {dtype!r}")
    options = resolve_options(options, option_fields, "import_dolma")
    urls = expand(paths, ".npy", options)
    return _import(
        "import-dolma",
        [functools.partial(DolmaFile, u, options, np.dtype(dtype).newbyteorder("<")) for u in urls],
        [[u, _csv_name(u)] for u in urls],
        output,
        {"dtype": dtype},
        tokenizer,
        runner,
        pipeline_args,
        names=urls,
        split=split,
        storage_format=storage_format,
        overwrite=overwrite,
        options=options,
        chunk_tokens=chunk_tokens,
    )


def import_levanter(
    cache: str | os.PathLike[str],
    output: str | os.PathLike[str],
    *,
    split: str = "train",
    tokenizer: str | os.PathLike[str] | None = None,
    storage_format: StorageFormat | None = None,
    overwrite: bool = False,
    options: StoreOptions | None = None,
    chunk_tokens: int = CHUNK_TOKENS,
    **option_fields: Any,
) -> dict[str, Any]:
    """Writes a Levanter cache's ``input_ids`` (:class:`LevanterCache`) as a new
    flat-tokens dataset: one sequence a row. ``cache``: one split's folder
    (Levanter's ``cache_dir/train``), a path or URL; the rest as :func:`import_datatrove`.
    The output's info records the tokenizer and vocabulary size the ledger
    names (flags ``tokenizer``, ``vocab_size``) and the cache, hashed as every
    file under ``input_ids/`` and its ledger, by name. Returns and raises as
    :func:`import_datatrove` (InputError for an unfinished cache, a ledger whose
    row count disagrees with the offsets, or offsets past the data).
    """
    options = resolve_options(options, option_fields, "import_levanter")
    url = os.fspath(cache).rstrip("/")
    levanter = LevanterCache(url, options)
    keys = sorted(k.decode() for k in levanter.wait(levanter.store.kv.list()))
    meta = levanter.tokenizer_meta or {}
    return _import(
        "import-levanter",
        [lambda: levanter],
        [[f"{url}/{k}" for k in keys if k.startswith("input_ids/") or k == LEDGER]],
        output,
        {"tokenizer": meta.get("tokenizer"), "vocab_size": meta.get("vocab_size")},
        tokenizer,
        names=[url],
        key="caches",
        split=split,
        storage_format=storage_format,
        overwrite=overwrite,
        options=options,
        chunk_tokens=chunk_tokens,
    )


def add_commands(subparsers: Any) -> None:
    """Registers ``flat-tokens import-datatrove``, ``import-dolma`` and ``import-levanter``."""
    beam = ["runner", "pipeline_args"]  # a Levanter cache is one input: nothing to spread
    for name, what, function, own in (
        ("datatrove", "datatrove file(s)", import_datatrove, beam),
        ("dolma", "dolma file(s)", import_dolma, ["dtype", *beam]),
        ("levanter", "Levanter cache", import_levanter, []),
    ):
        p = subparsers.add_parser(f"import-{name}", help=f"{what} to flat-tokens")
        if name == "levanter":
            p.add_argument("inputs", metavar="CACHE", help="the cache folder (path or URL)")
        else:
            p.add_argument("inputs", nargs="+", metavar="PATH", help="files, globs or folders")
        p.add_argument("output", metavar="OUTPUT", help="the new dataset")
        if "dtype" in own:
            p.add_argument(
                "--dtype",
                required=True,
                choices=("uint16", "uint32"),
                help="the tokens' type, which the files do not record (dolma's --dtype)",
            )
        if "runner" in own:
            p.add_argument(
                "--runner",
                choices=("local", "beam"),
                default="local",
                help="local: this process; beam: an Apache Beam pipeline, one part per file, "
                "whose options follow '--' (e.g. -- --runner=DataflowRunner --project=P ...)",
            )
            p.set_defaults(takes_pipeline_args=True)
        add_import_flags(p)
        p.set_defaults(run=functools.partial(run_import, function, what, own), pipeline_args=[])
