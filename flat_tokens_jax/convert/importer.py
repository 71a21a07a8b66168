"""The one loop of every importer of corpora another tool tokenized (Megatron, datatrove,
dolma, Levanter): each :class:`TokenFile` is written in runs of whole documents of about
``chunk_tokens`` tokens, so memory stays bounded; a :class:`Blob` is an input file read by
byte range, local or on an object store."""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import io
import itertools
import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import IO, Any, Protocol

import numpy as np

from flat_tokens_jax.convert.commands import add_output_flags, run_command, store_options
from flat_tokens_jax.convert.inputs import InputError, Patterns, hash_inputs
from flat_tokens_jax.core.format import MAX_TOKEN_ID, encode_concatenated
from flat_tokens_jax.data.writer import DatasetWriter, StorageFormat
from flat_tokens_jax.store.identity import DatasetInfo, inputs_field
from flat_tokens_jax.store.location import refuse_overlap
from flat_tokens_jax.store.options import StoreOptions, store_error
from flat_tokens_jax.store.store import Store

CHUNK_TOKENS = 1 << 20
_BLOCK = 1 << 20  # documents whose lengths are read at a time
_READ = 1 << 20  # bytes a Blob stream reads at a time


class TokenFile(Protocol):
    """One input of an importer: ``num_documents`` documents, in order."""

    def lengths(self, lo: int, hi: int) -> np.ndarray:
        """Tokens ``[hi - lo] int64`` of documents ``[lo, hi)`` (0 for an empty one)."""

    def read(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Documents ``[lo, hi)`` concatenated: token ids ``[n] int64`` in
        ``[0, MAX_TOKEN_ID]``, and their loss mask ``[n] uint8`` or ``None``."""

    @property
    def num_documents(self) -> int: ...

    def stats(self) -> dict[str, Any]:
        """The file's entry of the summary (``tokens`` and ``skipped_empty`` are added)."""


def checked_ids(values: np.ndarray, where: str, first: int) -> np.ndarray:
    """``values`` (``where``'s, from token ``first``) as int64, each in [0, MAX_TOKEN_ID]."""
    ids = values.astype(np.int64)
    bad = np.flatnonzero((ids < 0) | (ids > MAX_TOKEN_ID))
    if bad.size:
        raise InputError(
            f"{where}: token {first + int(bad[0])} is {ids[bad[0]]}, outside [0, {MAX_TOKEN_ID}]"
        )
    return ids


class Blob:
    """One input file, a path or ``file://``, ``gs://`` or ``s3://`` URL, read by byte range
    through the stores' kvstore (so the store options' endpoint and credentials apply)."""

    def __init__(self, url: str, options: StoreOptions) -> None:
        self.url = url
        folder, _, self.key = url.rpartition("/")
        self.store = Store(folder + "/" if folder or url.startswith("/") else ".", options)

    def _get(self, lo: int, hi: int | None) -> bytes | None:
        """Bytes ``[lo, hi)`` (to the end when ``hi`` is None); ``None`` past the end."""
        future = self.store.kv.read(self.key, byte_range=slice(lo, hi))
        try:
            got = future.result(timeout=self.store.options.timeout)
        except ValueError as e:
            if str(e).startswith("OUT_OF_RANGE"):
                return None
            raise store_error(self.url, e, self.store.options) from e
        if got.state != "value":
            raise FileNotFoundError(f"{self.url}: no such file")
        return bytes(got.value)

    def exists(self) -> bool:
        got = self.store.wait(self.store.kv.read(self.key, byte_range=slice(0, 0)))
        return bool(got.state == "value")

    def read(self, lo: int = 0, hi: int | None = None) -> bytes:
        """Bytes ``[lo, hi)``, all there (else InputError); the whole file by default."""
        got = self._get(lo, hi) if hi is None or hi > lo else b""
        if got is None:
            raise InputError(f"{self.url} ends before byte {hi}")
        return got

    def check_size(self, size: int, why: str) -> None:
        """Refuses a file of other than ``size`` bytes, saying ``why`` that many."""
        short = size > 0 and self._get(size - 1, size) is None
        if short or self._get(size, size + 1) is not None:
            more = "fewer" if short else "more"
            raise InputError(f"{self.url} holds {more} than {size:,} bytes, but {why}")

    def stream(self) -> IO[bytes]:
        """The file's bytes as a binary file read in order, ``_READ`` bytes at a time."""
        blob = self

        class Raw(io.RawIOBase):
            at = 0

            def readable(self) -> bool:
                return True

            def readinto(self, buffer: Any) -> int:
                n = min(len(buffer), _READ)
                got = blob._get(self.at, self.at + n) or blob._get(self.at, None) or b""  # tail
                buffer[: len(got)] = got
                self.at += len(got)
                return len(got)

        return io.BufferedReader(Raw(), _READ)


def blob_opener(options: StoreOptions) -> Callable[[str], IO[bytes]]:
    return lambda url: Blob(url, options).stream()


def expand(patterns: Patterns, suffix: str, options: StoreOptions) -> list[str]:
    """Files of ``patterns``, each a file, a folder (its ``*{suffix}`` files) or a
    glob (of one folder, for a URL); sorted within each pattern, in pattern order."""
    out: list[str] = []
    for given in [patterns] if isinstance(patterns, str | os.PathLike) else patterns:
        pattern = os.fspath(given)
        if pattern.endswith("/") or ("://" not in pattern and os.path.isdir(pattern)):
            pattern = pattern.rstrip("/") + "/*" + suffix
        if not any(c in pattern for c in "*?["):
            out.append(pattern)
            continue
        folder, _, name = pattern.rpartition("/")
        store = Store(folder + "/" if folder else ".", options)
        keys = [k.decode() for k in store.wait(store.kv.list())]
        at = folder + "/" if folder else ""
        found = sorted(at + k for k in keys if "/" not in k and fnmatch.fnmatch(k, name))
        if not found:
            raise FileNotFoundError(f"no file matches {pattern!r}")
        out.extend(found)
    if not out:
        raise ValueError("no input files given")
    return out


def add_import_flags(parser: argparse.ArgumentParser) -> None:
    """The flags every ``import-*`` command takes: ``--split``, ``--tokenizer``, the outputs'."""
    parser.add_argument("--split", default="train", help="the split to write (e.g. test)")
    parser.add_argument(
        "--tokenizer",
        help="the tokenizer that made the ids (JSON file or transformers directory), recorded "
        "in the dataset's info so that merge and Mixture can check it",
    )
    add_output_flags(parser)


def run_import(
    function: Callable[..., dict[str, Any]],
    what: str,
    own: Sequence[str],
    args: argparse.Namespace,
) -> int:
    """Runs an ``import-*`` command: ``function`` of ``args.inputs``, ``args.output``, the
    flags of :func:`add_import_flags` and its ``own``; ``what`` names the inputs."""

    def line(s: dict[str, Any]) -> str:
        return (
            f"imported {s['inputs']} {what} into {s['output']} [{s['split']}]: "
            f"{s['sequences_written']:,} sequences, {s['tokens']:,} tokens, "
            f"{s['skipped_empty']:,} empty skipped, in {s['seconds']:.1f}s"
        )

    return run_command(
        args,
        lambda: function(
            args.inputs,
            args.output,
            split=args.split,
            tokenizer=args.tokenizer,
            overwrite=args.overwrite,
            options=store_options(args),
            **{name: getattr(args, name) for name in own},
        ),
        line,
        errors=(ValueError, OSError, ImportError, RuntimeError),  # a Beam job's failure too
        output=args.output,
    )


def _runs(file: TokenFile, chunk_tokens: int) -> Iterator[tuple[int, int, np.ndarray]]:
    """Runs ``(first, stop, lengths)`` of whole documents ``[first, stop)`` of
    about ``chunk_tokens`` tokens (at least one document), ``lengths`` ``[k] int64``."""
    for lo in range(0, file.num_documents, _BLOCK):
        lengths = file.lengths(lo, min(lo + _BLOCK, file.num_documents))
        window = (np.cumsum(lengths) - lengths) // chunk_tokens
        cuts = [0, *(np.flatnonzero(np.diff(window)) + 1).tolist(), lengths.size]
        for a, b in itertools.pairwise(cuts):
            yield lo + a, lo + b, lengths[a:b]


def import_files(
    files: Sequence[Callable[[], TokenFile]],
    output: str | os.PathLike[str],
    *,
    hashed: Sequence[str],
    info: DatasetInfo,
    names: Sequence[str],
    key: str = "files",
    split: str = "train",
    storage_format: StorageFormat | None = None,
    overwrite: bool = False,
    options: StoreOptions | None = None,
    chunk_tokens: int = CHUNK_TOKENS,
    attributes: dict[str, Any] | None = None,
    progress: Callable[[int, int], None] | None = None,
    total: int = 0,
) -> dict[str, Any]:
    """Writes the documents of ``files`` (each opened in its turn, so one index is held at
    a time), in order, as ``split`` of a new dataset; empty ones are skipped and counted.

    The output's info is ``info`` with ``inputs``: ``names`` and the SHA-256 digests of
    ``hashed`` (hashed on a thread meanwhile). Returns the summary: per file (under
    ``key``) its :meth:`TokenFile.stats`, tokens and skipped empties; the totals.
    """
    began = time.perf_counter()
    options = options or StoreOptions()
    refuse_overlap(hashed, [output])
    done = written = 0
    stats: list[dict[str, Any]] = []
    with (
        DatasetWriter(
            output,
            storage_format=storage_format,
            overwrite=overwrite,
            options=options,
            splits=[split],
            attributes=attributes or {},
        ) as writer,
        hash_inputs(hashed, blob_opener(options)) as digests,
    ):
        for open_file in files:
            file, tokens, skipped = open_file(), 0, 0
            for first, stop, lengths in _runs(file, chunk_tokens):
                ids, mask = file.read(first, stop)
                kept = lengths[lengths > 0]
                if kept.size:
                    encoded = encode_concatenated(ids, np.cumsum(kept) - kept)
                    writer.extend_encoded(split, encoded, kept, loss_mask=mask)
                skipped += lengths.size - kept.size
                written += kept.size
                tokens += ids.size
                if progress is not None:
                    progress(done + tokens, total)
            done += tokens
            stats.append({**file.stats(), "tokens": tokens, "skipped_empty": skipped})
        writer.info = dataclasses.replace(info, inputs=inputs_field(list(names), digests()))
    return {
        "output": os.fspath(output),
        "split": split,
        "inputs": len(stats),
        key: stats,
        "sequences_written": written,
        "tokens": done,
        "skipped_empty": sum(s["skipped_empty"] for s in stats),
        "seconds": round(time.perf_counter() - began, 3),
    }
