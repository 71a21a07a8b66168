"""Tokenizing: load a tokenizer, tokenize batches in threads or worker processes,
in order, and choose the validation split. ``tokenizers`` (and ``transformers`` for
a tokenizer directory) are imported only when a tokenizer is loaded."""

from __future__ import annotations

import collections
import contextlib
import ctypes
import dataclasses
import hashlib
import logging
import multiprocessing
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from concurrent.futures import (
    BrokenExecutor,
    Executor,
    Future,
    ProcessPoolExecutor,
    ThreadPoolExecutor,
)
from pathlib import Path
from typing import Any

import numpy as np

from flat_tokens_jax.convert.inputs import require
from flat_tokens_jax.core.format import MAX_TOKEN_ID
from flat_tokens_jax.store.identity import TokenizerInfo, tokenizer_info

log = logging.getLogger(__name__)

EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>")
BOS_CANDIDATES = ("<s>", "<|begin_of_text|>", "<bos>", "<|startoftext|>")

Packed = tuple[np.ndarray, np.ndarray]  # (ids [num_tokens] int32, lengths [num_docs] int64)


@dataclasses.dataclass(frozen=True)
class LoadedTokenizer:
    """A ``tokenizers.Tokenizer`` (truncation and padding off), where it came from
    (``name``), its special ids (``None``: none), and the ``transformers`` tokenizer
    it came from (``hf``, for its chat template; ``None`` for a JSON file)."""

    tokenizer: Any
    name: str
    bos_id: int | None
    eos_id: int | None
    hf: Any = None


def identity(tok: LoadedTokenizer) -> TokenizerInfo:
    """The :class:`TokenizerInfo` that a dataset made with ``tok`` records."""
    pad = getattr(tok.hf, "pad_token_id", None) if tok.hf is not None else None
    return tokenizer_info(tok.tokenizer, tok.name, bos_id=tok.bos_id, eos_id=tok.eos_id, pad_id=pad)


def resolve_start_token_id(value: int | str | None, tok: LoadedTokenizer | None) -> int | None:
    """``value`` as an id: an int as it is, ``"bos"``/``"eos"`` as ``tok``'s id.
    Warns when ``tok`` would have its ordinary token 0 fed at sequence starts."""
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        value = int(value)
    is_id = isinstance(value, int) and value >= 0
    if not (value is None or is_id or value in ("bos", "eos")):
        raise ValueError(f"start_token_id must be a token id >= 0, bos or eos, got {value!r}")
    if isinstance(value, str):
        if tok is None:
            raise ValueError(
                f"start_token_id={value!r} needs tokenizer= to find the id; "
                "or give the id as a number"
            )
        found = tok.bos_id if value == "bos" else tok.eos_id
        if found is None:
            raise ValueError(
                f"start_token_id {value}: tokenizer {tok.name} has none; give the id as a number"
            )
        value = found
    if tok is not None and value in (None, 0):
        zero = tok.tokenizer.id_to_token(0)
        special = {i for i, t in tok.tokenizer.get_added_tokens_decoder().items() if t.special}
        if zero is not None and 0 not in special:
            log.warning(
                "%s: token id 0 (%r) is an ordinary token, but flat-tokens readers feed id 0 as "
                "the input where a sequence starts, so a model cannot tell a start from %r: "
                "convert with --start-token-id eos (recorded in the dataset) or train with "
                "LoaderConfig(start_token_id=<a special id, e.g. the eos id>)",
                tok.name,
                zero,
                zero,
            )
    return value


def load_tokenizer(path: str | os.PathLike[str]) -> LoadedTokenizer:
    """Loads a ``tokenizers`` JSON file or a ``transformers`` tokenizer directory.

    A directory is read with ``AutoTokenizer.from_pretrained(path,
    local_files_only=True)`` and must hold a fast tokenizer; its backend
    ``tokenizers.Tokenizer`` does the work, with the directory's
    ``bos_token_id`` and ``eos_token_id``. A JSON file's special ids are the
    first of :data:`BOS_CANDIDATES` / :data:`EOS_CANDIDATES` in its vocabulary.
    Truncation and padding stored in the tokenizer are turned off.

    Raises:
        FileNotFoundError: no such file or directory.
        ValueError: not a tokenizers JSON file, a slow tokenizer, or ids above ``2**31 - 1``.
        ImportError: ``tokenizers`` (or ``transformers`` for a directory) missing.
    """
    p = Path(path)
    tokenizers = require("tokenizers", "convert")
    hf = None
    if p.is_dir():
        transformers = require("transformers", "hf")
        hf = transformers.AutoTokenizer.from_pretrained(str(p), local_files_only=True)
        if not getattr(hf, "is_fast", False):
            raise ValueError(
                f"{p}: {type(hf).__name__} is a slow (Python) tokenizer; save a fast one "
                "(with tokenizer.json) there, e.g. AutoTokenizer.from_pretrained(..., "
                "use_fast=True).save_pretrained(dir)"
            )
        tok = tokenizers.Tokenizer.from_str(hf.backend_tokenizer.to_str())
        bos, eos = hf.bos_token_id, hf.eos_token_id
    elif p.is_file():
        try:
            tok = tokenizers.Tokenizer.from_file(str(p))
        except Exception as e:  # tokenizers raises a bare Exception for a file it cannot parse
            raise ValueError(
                f"{p}: not a tokenizers JSON file ({e}): pass a tokenizer.json saved by "
                "tokenizers, or a transformers tokenizer directory"
            ) from e
        bos, eos = (
            next((i for t in names if (i := tok.token_to_id(t)) is not None), None)
            for names in (BOS_CANDIDATES, EOS_CANDIDATES)
        )
    else:
        raise FileNotFoundError(f"tokenizer {p}: no such file or directory")
    tok.no_truncation()
    tok.no_padding()
    vocab = tok.get_vocab(with_added_tokens=True)
    token, top = max(vocab.items(), key=lambda kv: kv[1], default=("", 0))
    if top > MAX_TOKEN_ID:
        raise ValueError(
            f"{p}: token {token!r} has id {top}, above {MAX_TOKEN_ID}, the largest id "
            "the flat-tokens format stores; use a tokenizer with a smaller vocabulary"
        )
    return LoadedTokenizer(tok, str(p), bos, eos, hf)


def _digest(doc: str | np.ndarray) -> bytes:
    data = doc.encode("utf-8") if isinstance(doc, str) else doc.astype("<u4").tobytes()
    return hashlib.blake2b(data, digest_size=8).digest()


def validation_mask(docs: Sequence[str | np.ndarray], fraction: float) -> np.ndarray:
    """``[len(docs)] bool``: which documents belong to the validation split.

    Document ``d`` does when ``h(d) / 2**64 < fraction``, where ``h(d)`` is
    blake2b with an 8-byte digest (``digest_size=8``) of its UTF-8 text, or of
    its token ids as little-endian ``uint32`` for pre-tokenized input, read as a
    big-endian integer. A pure function of each document: the same whatever its
    position, file, worker count or machine.

    Example:
        >>> validation_mask(["a", "b", "c", "d", "e", "f"], 0.5).tolist()
        [True, False, True, False, True, True]
    """
    if fraction <= 0:
        return np.zeros(len(docs), bool)
    limit = int(fraction * 2**64)
    return np.fromiter(
        (int.from_bytes(_digest(d), "big") < limit for d in docs), bool, count=len(docs)
    )


@dataclasses.dataclass(frozen=True)
class BatchTokenizer:
    """Turns a batch of documents (texts, or ``int32`` token arrays when ``tokenizer``
    is ``None``) into :data:`Packed` ids, ``bos_id``/``eos_id`` (if set) around each;
    thread-safe. ``encode_batch_fast`` (no offsets) spreads a batch over the
    tokenizer's thread pool."""

    tokenizer: Any
    bos_id: int | None
    eos_id: int | None
    add_special_tokens: bool

    def __call__(self, docs: list[Any]) -> Packed:
        if self.tokenizer is not None:
            encode = (
                getattr(self.tokenizer, "encode_batch_fast", None) or self.tokenizer.encode_batch
            )
            encodings = encode(list(docs), add_special_tokens=self.add_special_tokens)
            docs = [np.array(e.ids, np.int32) for e in encodings]
        if self.bos_id is not None or self.eos_id is not None:
            pre = np.array([] if self.bos_id is None else [self.bos_id], np.int32)
            post = np.array([] if self.eos_id is None else [self.eos_id], np.int32)
            docs = [np.concatenate([pre, d, post]) for d in docs]
        lengths = np.fromiter((d.size for d in docs), np.int64, count=len(docs))
        ids = np.concatenate(docs).astype(np.int32, copy=False) if docs else np.zeros(0, np.int32)
        return ids, lengths


# Set by _init_worker in each worker process of the pool, and only there: the
# pool's tasks carry documents, not the tokenizer, which every task would re-send.
_worker_tokenize: BatchTokenizer | None = None


_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def _exit_with(parent: int) -> None:
    """Ends this worker process soon after ``parent`` dies, however it dies.

    A parent killed by SIGKILL runs no cleanup, and its workers, blocked reading
    a task pipe that they hold open themselves, would live on, holding the
    parent's stdout (a reader of it would never see its end) and its resource
    tracker. On Linux the kernel kills the worker with its parent
    (``PR_SET_PDEATHSIG``); everywhere, a thread checks the parent each second.
    """
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # it died before the line above
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def _init_worker(parent: int, tokenizer_file: str, settings: tuple[Any, ...], threads: int) -> None:
    global _worker_tokenize
    _exit_with(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and stops the pool
    os.environ["TOKENIZERS_PARALLELISM"] = "true" if threads > 1 else "false"
    os.environ["RAYON_NUM_THREADS"] = str(threads)
    tokenizers = require("tokenizers", "convert")
    _worker_tokenize = BatchTokenizer(tokenizers.Tokenizer.from_file(tokenizer_file), *settings)


def _work(docs: list[str]) -> Packed:
    if _worker_tokenize is None:
        raise RuntimeError("_work runs only in a worker started by _init_worker")
    return _worker_tokenize(docs)


Batch = tuple[list[Any], np.ndarray]  # (documents, validation mask [k] bool)
Encoder = Callable[[Iterable[Batch]], Generator[tuple[np.ndarray, Packed], None, None]]


def _ordered(
    pool: Executor, fn: Callable[[list[Any]], Packed], batches: Iterable[Batch], depth: int
) -> Generator[tuple[np.ndarray, Packed], None, None]:
    """Results of ``fn`` on each batch's documents, in order, at most ``depth`` in flight.

    The bound keeps reading from running far ahead of tokenizing (``Pool.imap``
    would read the whole input into memory).
    """
    window: collections.deque[tuple[np.ndarray, Future[Packed]]] = collections.deque()
    try:
        for docs, mask in batches:
            window.append((mask, pool.submit(fn, docs)))
            if len(window) >= depth:
                done_mask, future = window.popleft()
                yield done_mask, future.result()
        while window:
            done_mask, future = window.popleft()
            yield done_mask, future.result()
    except BrokenExecutor as e:
        raise BrokenExecutor(
            "a tokenizer worker process died (out of memory? or a script that starts "
            "workers=N without `if __name__ == '__main__':`)"
        ) from e
    finally:
        for _, future in window:
            future.cancel()


@contextlib.contextmanager
def batch_encoder(tokenize: BatchTokenizer, workers: int) -> Iterator[Encoder]:
    """Yields a function from batches to their (validation mask, Packed), in order.

    With ``workers == 1`` the work runs in this process's threads; otherwise in
    ``workers`` processes started with "spawn", each loading the tokenizer once
    (so a script that converts with workers must guard its top level with
    ``if __name__ == "__main__":``). Either way the results, and so the
    output, are the same. Worker processes end with this one, even when it is
    killed (see :func:`_exit_with`).
    """
    if tokenize.tokenizer is None:
        yield lambda batches: ((mask, tokenize(docs)) for docs, mask in batches)
        return
    pool: Executor
    fn: Callable[[list[Any]], Packed]
    stack = contextlib.ExitStack()
    if workers == 1:
        # Two batches in flight on the tokenizer's one thread pool (encode releases
        # the GIL) keep its threads busy through each batch's last, longest
        # documents, and reading and writing overlap tokenizing.
        pool = ThreadPoolExecutor(2, thread_name_prefix="tokenize")
        fn, depth = tokenize, 2
    else:
        # The tokenizer travels as a file: spawn pipes its arguments to each
        # child, and CPython (3.11) blocks for good writing more than a pipe's
        # buffer to a child that died before reading it.
        scratch = stack.enter_context(tempfile.TemporaryDirectory(prefix="flat-tokens-"))
        tokenizer_file = os.path.join(scratch, "tokenizer.json")
        tokenize.tokenizer.save(tokenizer_file)
        settings = (tokenize.bos_id, tokenize.eos_id, tokenize.add_special_tokens)
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        threads = max(1, (cpus or 1) // workers)
        # spawn: the parent may hold tensorstore and jax threads, which fork would copy broken.
        pool = ProcessPoolExecutor(
            workers,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_init_worker,
            initargs=(os.getpid(), tokenizer_file, settings, threads),
        )
        fn, depth = _work, 2 * workers
    with stack:
        try:
            yield lambda batches: _ordered(pool, fn, batches, depth)
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
