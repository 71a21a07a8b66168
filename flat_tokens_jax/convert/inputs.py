"""Reading one field of every document from JSONL (``.jsonl``/``.json``, optionally
``.gz``/``.zst``), Parquet and ``datasets.Dataset.save_to_disk`` directories, in order.

Optional libraries (pyarrow, zstandard, datasets) are imported only when a file needs them.
"""

from __future__ import annotations

import contextlib
import glob
import gzip
import hashlib
import importlib
import io
import json
import logging
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType
from typing import IO, Any, cast

import numpy as np

from flat_tokens_jax.core.extras import install_hint
from flat_tokens_jax.core.format import MAX_TOKEN_ID
from flat_tokens_jax.core.urls import redact

log = logging.getLogger(__name__)

JSONL_SUFFIXES = (".jsonl", ".json")
COMPRESSION_SUFFIXES = ("", ".gz", ".zst")
HF_MARKERS = ("dataset_info.json", "state.json")
ARROW_BATCH_ROWS = 1024
_WARN_BAD = 5  # bad documents logged one by one before the rest are only counted


# A local file or directory, or the URL of a file that an Opener reads.
InputPath = Path | str
Where = tuple[InputPath, str, int]  # (file, "line" or "row", 1-based number; 0: the whole file)
Opener = Callable[[str], IO[bytes]]  # a URL's raw (still compressed) bytes, as a binary file
Patterns = str | os.PathLike[str] | Sequence[str | os.PathLike[str]]  # one path or glob, or several


class InputError(ValueError):
    """A bad input file or document; the message names the file and its line or row."""


class BadDocument(ValueError):
    """Raised by a :class:`DocumentReader` ``check`` for a document it refuses; says why."""


def require(module: str, extra: str) -> ModuleType:
    """Imports an optional dependency, or says which extra installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"{module.split('.')[0]} is not installed: {install_hint(extra)}") from e


def input_kind(path: InputPath) -> str:
    """``"jsonl"``, ``"parquet"`` or ``"hf"`` (a ``save_to_disk`` directory) for ``path``
    (a URL, a ``str``, is never a directory); InputError for any other."""
    if isinstance(path, Path) and path.is_dir():
        if any((path / m).is_file() for m in HF_MARKERS):
            return "hf"
        if (path / "dataset_dict.json").is_file():
            splits = sorted(p.name for p in path.iterdir() if p.is_dir())
            raise InputError(
                f"{path} holds a DatasetDict with splits {splits}: name one split's "
                f"directory, e.g. {path / (splits[0] if splits else 'train')}"
            )
        raise InputError(
            f"{path} is a directory but not a dataset saved with save_to_disk (it has "
            f"no {' or '.join(HF_MARKERS)}): name its files, e.g. '{path}/*.jsonl'"
        )
    name = (path.name if isinstance(path, Path) else path.rsplit("/", 1)[-1]).lower()
    if name.endswith(".parquet"):
        return "parquet"
    if any(name.endswith(s + c) for s in JSONL_SUFFIXES for c in COMPRESSION_SUFFIXES):
        return "jsonl"
    raise InputError(
        f"{path}: unknown input format; expected .jsonl or .json (optionally .gz or .zst), "
        ".parquet, or a directory saved by datasets' save_to_disk"
    )


def expand_inputs(
    patterns: Patterns,
    match: Callable[[str], list[str]] | None = None,
) -> list[InputPath]:
    """Paths of ``patterns``: globs expanded and sorted per pattern, pattern order kept;
    URLs matched by ``match`` when given. FileNotFoundError for a pattern that
    matches nothing, InputError for a file of an unknown format."""
    paths: list[InputPath] = []
    for pattern in [patterns] if isinstance(patterns, str | os.PathLike) else patterns:
        text = os.fspath(pattern)
        matches: list[InputPath]
        if match is not None and "://" in text:
            matches = list(match(text))
        elif any(c in text for c in "*?["):
            matches = [Path(m) for m in sorted(glob.glob(text, recursive=True))]
        elif os.path.exists(text):
            matches = [Path(text)]
        else:
            raise FileNotFoundError(f"{redact(text)}: no such file or directory")
        if not matches:
            raise FileNotFoundError(f"no file matches {redact(text)!r}")
        for m in matches:
            input_kind(m)
            paths.append(m)
    return paths


def check_splits(
    train: Sequence[InputPath], validation: Sequence[InputPath], fraction: float
) -> None:
    """Refuses no inputs, and validation chosen both by files and by ``fraction``."""
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"validation_fraction must be in [0, 1), got {fraction}")
    if not train:
        raise ValueError("no inputs given")
    if validation and fraction:
        raise ValueError("pass validation_fraction or validation_inputs, not both")


def open_local(path: str) -> IO[bytes]:
    """The :data:`Opener` of local files."""
    return open(path, "rb", buffering=1 << 20)


def _open(path: InputPath, opener: Opener) -> IO[bytes]:
    return open_local(str(path)) if isinstance(path, Path) else opener(path)


def file_sha256(
    path: InputPath, opener: Opener = open_local, stop: threading.Event | None = None
) -> str | None:
    """The SHA-256 hex digest of an input's bytes as stored (still compressed).

    A directory (a ``save_to_disk`` dataset) hashes, for each file under it in
    sorted order of relative path, that path and the file's digest, one
    ``"<path> <digest>"`` line each. ``None`` when ``stop`` is set before the end.
    """
    if isinstance(path, Path) and path.is_dir():
        lines = hashlib.sha256()
        for member in sorted(p for p in path.rglob("*") if p.is_file()):
            digest = file_sha256(member, opener, stop)
            if digest is None:
                return None
            lines.update(f"{member.relative_to(path).as_posix()} {digest}\n".encode())
        return lines.hexdigest()
    h = hashlib.sha256()
    with _open(path, opener) as f:
        while block := f.read(1 << 20):
            if stop is not None and stop.is_set():
                return None
            h.update(block)
    return h.hexdigest()


@contextlib.contextmanager
def hash_inputs(
    paths: Sequence[InputPath], opener: Opener = open_local
) -> Iterator[Callable[[], list[str]]]:
    """Hashes ``paths`` (:func:`file_sha256`) on a thread while the block runs.

    Yields a function that waits for and returns the digests, in order. An
    error in the block stops the hashing. The digests never depend on how the
    block reads the same files (its workers, its batches).
    """
    stop = threading.Event()

    def digests() -> list[str]:
        out = []
        for path in paths:
            digest = file_sha256(path, opener, stop)
            if digest is None:
                raise InterruptedError("hashing the inputs was stopped")
            out.append(digest)
        return out

    with ThreadPoolExecutor(1, thread_name_prefix="hash-inputs") as pool:
        future = pool.submit(digests)
        try:
            yield future.result
        except BaseException:
            stop.set()
            raise


def _decompressed(path: InputPath, raw: IO[bytes]) -> tuple[IO[bytes], tuple[type[Exception], ...]]:
    """``raw`` decompressed as ``path``'s name says (``raw`` itself when it is
    not compressed), and the errors that mean it cannot be read. Closing a
    decompressing reader leaves ``raw`` open: the caller closes both."""
    name = str(path).lower()
    unreadable: tuple[type[Exception], ...] = (OSError, EOFError)
    if name.endswith(".gz"):
        return cast(IO[bytes], gzip.GzipFile(fileobj=raw, mode="rb")), unreadable
    if name.endswith(".zst"):
        zstandard = require("zstandard", "convert")
        reader = zstandard.ZstdDecompressor().stream_reader(raw, closefd=False)
        return io.BufferedReader(reader, buffer_size=1 << 20), (*unreadable, zstandard.ZstdError)
    return raw, unreadable


class DocumentReader:
    """Iterates, in order, over one field of every document of ``paths``: texts, or
    ``int32`` token arrays ``[n]`` with ``tokens=True``; with ``key=None``, whole
    documents (a JSON object, or a row ``dict``) that ``check(document, where)``
    turns into what is yielded.

    Empty values are counted in :attr:`skipped_empty`. A bad document (a check's
    :class:`BadDocument` included) raises :class:`InputError` naming the file and
    1-based line or row, or with ``skip_bad`` is counted in :attr:`skipped_bad`; a
    file that cannot be read at all always raises. ``opener`` reads URL (``str``) paths.
    """

    def __init__(
        self,
        paths: Sequence[InputPath],
        key: str | None,
        *,
        tokens: bool = False,
        skip_bad: bool = False,
        check: Callable[[Any, Where], Any] | None = None,
        opener: Opener = open_local,
    ) -> None:
        self.paths = list(paths)
        self.opener = opener
        self.key = key
        self.tokens = tokens
        self.skip_bad = skip_bad
        self.skipped_bad = 0
        self.skipped_empty = 0
        if check is None and key is None:
            raise ValueError("DocumentReader(key=None) reads whole documents and needs a check")
        self.check = self._rejecting(check or (self._check_tokens if tokens else self._check_text))

    def __iter__(self) -> Iterator[str | np.ndarray]:
        for path in self.paths:
            kind = input_kind(path)
            if kind == "jsonl":
                yield from self._jsonl(path)
            elif kind == "parquet":
                yield from self._parquet(path)
            else:
                yield from self._hf(Path(path))

    def _rejecting(self, check: Callable[[Any, Where], Any]) -> Callable[[Any, Where], Any]:
        """``check`` with the documents it refuses (:class:`BadDocument`) rejected."""

        def checked(value: Any, where: Where) -> Any:
            try:
                return check(value, where)
            except BadDocument as e:
                self.reject(where, str(e))
                return None

        return checked

    def reject(self, where: Where, why: str, count: int = 1) -> None:
        """A bad document: counted with ``skip_bad``, else InputError."""
        path, unit, number = where
        at = f"{path} {unit} {number}" if number else str(path)
        if not self.skip_bad:
            raise InputError(f"{at}: {why} (skip_bad skips such documents)")
        if self.skipped_bad < _WARN_BAD:
            log.warning("skipping %s: %s", at, why)
        self.skipped_bad += count

    def _check_text(self, value: Any, where: Where) -> str | None:
        if not isinstance(value, str):
            raise BadDocument(f"{self.key!r} is {type(value).__name__}, not a string")
        if not value:
            self.skipped_empty += 1
            return None
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise BadDocument(f"{self.key!r} is not valid Unicode ({e})") from None
        return value

    def _check_tokens(self, value: Any, where: Where) -> np.ndarray | None:
        if not isinstance(value, list | np.ndarray):
            raise BadDocument(f"{self.key!r} is {type(value).__name__}, not a list of token ids")
        if len(value) == 0:
            self.skipped_empty += 1
            return None
        try:
            arr = np.asarray(value)
        except ValueError as e:
            raise BadDocument(f"{self.key!r} is not a flat list of token ids ({e})") from None
        if arr.ndim != 1 or arr.dtype.kind not in "iu":
            raise BadDocument(f"{self.key!r} must be a flat list of integers, got {value!r:.60}")
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi > MAX_TOKEN_ID:
            raise BadDocument(f"token id {lo if lo < 0 else hi} is outside [0, {MAX_TOKEN_ID}]")
        return arr.astype(np.int32)

    def _jsonl(self, path: InputPath) -> Iterator[str | np.ndarray]:
        key, check = self.key, self.check
        line = 0
        with contextlib.ExitStack() as stack:
            raw = stack.enter_context(_open(path, self.opener))
            file, unreadable = _decompressed(path, raw)
            f = stack.enter_context(file)
            try:
                for line, raw_line in enumerate(f, 1):
                    try:
                        document = json.loads(raw_line)
                    except ValueError as e:
                        if raw_line.strip():
                            why = f"not valid JSON ({e}); expected one JSON object per line"
                            self.reject((path, "line", line), why)
                        continue
                    if not isinstance(document, dict):
                        self.reject((path, "line", line), "not a JSON object")
                        continue
                    if key is not None and key not in document:
                        keys = sorted(document)[:10]
                        self.reject((path, "line", line), f"no key {key!r} (keys: {keys})")
                        continue
                    value = check(document if key is None else document[key], (path, "line", line))
                    if value is not None:
                        yield value
            except unreadable as e:
                raise InputError(f"{path}: cannot read past line {line}: {e}") from e

    def _arrow(self, table: Any, path: InputPath, first_row: int) -> Iterator[Any]:
        """Checks and yields an Arrow table or batch whose first row is ``first_row``
        (0-based): its rows as dicts (``key=None``), else its one column's values."""
        if self.key is None:
            values = table.to_pylist()
        else:
            column = table.column(0)
            types = require("pyarrow", "convert").types
            is_view = getattr(types, "is_string_view", lambda t: False)  # pyarrow >= 16
            text = types.is_string(column.type) or types.is_large_string(column.type)
            if not self.tokens and not (text or is_view(column.type)):
                self.reject(
                    (path, "row", first_row + 1),
                    f"column {self.key!r} is of type {column.type}, not a string",
                    count=len(column),
                )
                return
            values = column.to_pylist()
        for i, value in enumerate(values, first_row + 1):
            if value is None:
                self.reject((path, "row", i), f"{self.key!r} is null")
                continue
            checked = self.check(value, (path, "row", i))
            if checked is not None:
                yield checked

    def _missing_column(self, path: InputPath, names: Sequence[str], rows: int) -> None:
        self.reject((path, "", 0), f"no column {self.key!r} (columns: {list(names)})", count=rows)

    def _parquet(self, path: InputPath) -> Iterator[str | np.ndarray]:
        pa = require("pyarrow", "convert")
        pq = require("pyarrow.parquet", "convert")
        # pyarrow's messages name neither the file nor the row: ours do.
        broken = (pa.ArrowException, OSError)
        with contextlib.ExitStack() as stack:
            source = (
                path if isinstance(path, Path) else stack.enter_context(_open(path, self.opener))
            )
            try:
                pf = pq.ParquetFile(source)
            except broken as e:
                raise InputError(f"{path}: not a readable Parquet file ({e})") from e
            if self.key is not None and self.key not in pf.schema_arrow.names:
                self._missing_column(path, pf.schema_arrow.names, pf.metadata.num_rows)
                return
            row = 0
            columns = None if self.key is None else [self.key]
            batches = pf.iter_batches(batch_size=ARROW_BATCH_ROWS, columns=columns)
            while True:
                try:
                    batch = next(batches, None)
                except broken as e:
                    what = "" if self.key is None else f" of column {self.key!r}"
                    raise InputError(
                        f"{path}: cannot read the rows{what} after row {row} "
                        f"(the file is damaged or truncated): {e}"
                    ) from e
                if batch is None:
                    return
                yield from self._arrow(batch, path, row)
                row += batch.num_rows

    def _hf(self, path: Path) -> Iterator[str | np.ndarray]:
        datasets = require("datasets", "hf")
        ds = datasets.load_from_disk(str(path))
        if self.key is not None and self.key not in ds.column_names:
            self._missing_column(path, ds.column_names, len(ds))
            return
        row = 0
        selected = ds if self.key is None else ds.select_columns([self.key])
        for table in selected.with_format("arrow").iter(batch_size=ARROW_BATCH_ROWS):
            yield from self._arrow(table, path, row)
            row += table.num_rows
