"""Checking every invariant of a stored dataset, streaming, and summarising it."""

from __future__ import annotations

import functools
import itertools
import os
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from flat_tokens_jax.core.format import (
    LOSS_MASK,
    SEQ_STARTS,
    SPLITS,
    FormatError,
    Problem,
    check_starts_block,
    check_tokens_block,
    listed_problems,
)
from flat_tokens_jax.data.dataset import FlatTokens, open_dataset
from flat_tokens_jax.data.plans import check_stored_plans, plans_summary
from flat_tokens_jax.store.arrays import ArrayReader
from flat_tokens_jax.store.digests import DIGESTS, ChunkDigests
from flat_tokens_jax.store.identity import DatasetInfo, dataset_splits
from flat_tokens_jax.store.options import StoreError, StoreOptions, resolve_options
from flat_tokens_jax.store.store import Store

BLOCK = 1 << 22
# validate(quick=True): sequences sampled per split, and tokens read from the start of each.
QUICK_SAMPLES = 1024
QUICK_TOKENS = 64


def validate(
    url: str | os.PathLike[str],
    options: StoreOptions | None = None,
    block: int = BLOCK,
    *,
    quick: bool = False,
    samples: int = QUICK_SAMPLES,
    **option_fields: Any,
) -> None:
    """Checks every invariant of the dataset at ``url``, reading it in blocks.

    Checks every split is present (``train``, ``validation`` and those the root
    attribute ``flat_tokens.splits`` records); dtypes and shapes; ``seq_starts`` starts at
    0, strictly increases and ends at the token count; start bits sit exactly at
    ``seq_starts``; every id is ``<= max_token_id``; an optional ``loss_mask``
    has one ``uint8`` 0/1 entry per token; the root attribute ``flat_tokens``
    is well formed; every stored packing plan places each sequence once, keeps
    bins within its ``seq_len`` and was made from the split as it is; every
    shard probe and recorded chunk digest. ``options`` (or its fields as
    keywords) say how to reach the store, as for :func:`open_dataset`.

    ``quick=True`` reads a sample instead of everything, for stores too big to
    scan: the metadata, both ends of ``seq_starts``, and ``samples`` sequences
    (the same ones every time): their bounds, the start bits and ids of their
    first :data:`QUICK_TOKENS` tokens, and the digests of the chunks read.

    Raises:
        FormatError: listing every violation found, each with its array and index.
    """
    store = Store(url, resolve_options(options, option_fields, "validate"))
    root = store.group_attributes("")
    if root is None:
        why = "no flat-tokens dataset here (no zarr group metadata at the root; the path is wrong"
        raise FormatError(Problem(store.url, f"{why} or a write did not finish)"))
    problems: list[Problem] = []
    names: tuple[str, ...] = SPLITS
    info = None
    try:
        info = DatasetInfo.from_attributes(root[1])
        names = dataset_splits(root[1])
    except FormatError as e:
        problems += e.problems
    for split in names:
        try:
            ft = FlatTokens(store, split, check_end=False, info=info)
        except FormatError as e:
            problems += e.problems
            continue
        try:
            problems += _check_probes(ft)
            side, digests = _check_side(ft)
            problems += side
            if quick:
                problems += _check_sample(ft, samples, digests)
            else:
                problems += _check_split(ft, block, digests)
        except StoreError as e:
            if "DATA_LOSS" not in str(e):
                raise
            problems.append(Problem(f"{ft.url}/{ft.split_name}", str(e)))
        problems += check_stored_plans(ft)
    if problems:
        raise FormatError(problems)


def _check_probes(ft: FlatTokens) -> list[Problem]:
    """Every shard's probe, where recorded."""
    return [
        Problem(f"{ft.split_name}/{name}", message)
        for name, c in ft.checked.items()
        if c.probes is not None
        for message in c.probes.verify_all(c.reader.read_ranges)
    ]


def _check_side(ft: FlatTokens) -> tuple[list[Problem], dict[str, ChunkDigests]]:
    """Every shard's recorded chunk digests against its array's attribute; and
    the digests of the arrays whose recorded digests all pass, to check chunks with."""
    problems: list[Problem] = []
    trusted = {}
    for name, digests in ft.digests.items():
        if digests is None:
            continue
        found = _digest_problems(f"{ft.split_name}/{name}/{DIGESTS}", digests.side_problems)
        problems += found
        if not found:
            trusted[name] = digests
    return problems, trusted


def _check_digests(
    digests: ChunkDigests | None, reader: ArrayReader, starts: np.ndarray, stops: np.ndarray
) -> list[Problem]:
    """The chunk ``digests`` (where trusted) of the chunks ranges ``[starts, stops)`` touch."""
    if digests is None:
        return []
    try:
        digests.check(reader, starts, stops)  # raises at the first chunk that differs
    except FormatError as e:
        return e.problems
    return []


def _check_split(ft: FlatTokens, block: int, digests: dict[str, ChunkDigests]) -> list[Problem]:
    """The checks of :func:`validate` on every value of ``ft``."""
    problems = _check_arrays(
        f"{ft.split_name}/{ft.tokens_name}",
        ft.encoded,
        f"{ft.split_name}/{SEQ_STARTS}",
        ft.starts,
        ft.max_token_id,
        block,
        (digests.get(ft.tokens_name), digests.get(SEQ_STARTS)),
    )
    if ft.loss_mask is not None:
        where = f"{ft.split_name}/{LOSS_MASK}"
        if ft.loss_mask.dtype != np.uint8:
            problems.append(Problem(where, f"dtype is {ft.loss_mask.dtype}, expected uint8"))
        else:
            mask_digests = digests.get(LOSS_MASK)
            for offset, values in _blocks(ft.loss_mask, block, mask_digests, where, problems):
                bad = np.flatnonzero(values > 1)
                problems += listed_problems(
                    where, "loss mask entries must be 0 or 1", bad, values, offset
                )
    return problems


def _check_sample(ft: FlatTokens, samples: int, digests: dict[str, ChunkDigests]) -> list[Problem]:
    """The checks of :func:`validate` on ``samples`` sequences of ``ft`` and both ends."""
    tokens_where = f"{ft.split_name}/{ft.tokens_name}"
    starts_where = f"{ft.split_name}/{SEQ_STARTS}"
    n, num_tokens = ft.starts.size - 1, ft.encoded.size
    drawn = np.random.default_rng(0).choice(n, min(samples, n), replace=False)
    seqs = np.unique(np.concatenate([[0, n - 1], drawn])) if n else drawn
    at = np.unique(np.concatenate([[0], seqs, seqs + 1]))  # ascending seq_starts indices
    values = ft.starts.read_points(at)
    runs = np.flatnonzero(np.diff(at) > 1) + 1  # where consecutive indices break off
    problems: list[Problem] = []
    previous = None
    for run, run_values in zip(np.split(at, runs), np.split(values, runs), strict=True):
        problems += check_starts_block(run_values, int(run[0]), previous, num_tokens, starts_where)
        previous = int(run_values[-1])
    problems += _last_start(starts_where, n, previous, num_tokens)
    if n == 0 or problems:
        return problems
    lo = values[np.searchsorted(at, seqs)].astype(np.int64)
    hi = np.minimum(values[np.searchsorted(at, seqs + 1)].astype(np.int64), lo + QUICK_TOKENS)
    problems += _check_digests(digests.get(SEQ_STARTS), ft.starts, at, at + 1)
    problems += _check_digests(digests.get(ft.tokens_name), ft.encoded, lo, hi)
    for start, enc in zip(lo.tolist(), ft.encoded.read_ranges(lo, hi), strict=True):
        problems += check_tokens_block(enc, start, np.array([start]), ft.max_token_id, tokens_where)
    return problems[: FormatError.max_listed]


def _check_arrays(
    tokens_where: str,
    tokens: ArrayReader,
    starts_where: str,
    starts: ArrayReader,
    max_token_id: int,
    block: int,
    digests: tuple[ChunkDigests | None, ChunkDigests | None] = (None, None),
) -> list[Problem]:
    """Streams both arrays once, side by side, checking their chunk ``digests``
    (of tokens, of starts) where given."""
    problems: list[Problem] = []
    num_tokens = tokens.size
    if starts.size == 0:
        return [Problem(starts_where, "empty; it needs num_sequences + 1 entries")]
    previous: int | None = None
    pending = np.zeros(0, np.uint64)
    starts_iter = _blocks(starts, block, digests[1], starts_where, problems)
    starts_done = False
    for t_offset, enc in _blocks(tokens, block, digests[0], tokens_where, problems):
        t_end = t_offset + enc.size
        while not starts_done and (pending.size == 0 or int(pending[-1]) < t_end):
            nxt = next(starts_iter, None)
            if nxt is None:
                starts_done = True
                break
            s_offset, values = nxt
            problems += check_starts_block(values, s_offset, previous, num_tokens, starts_where)
            previous = int(values[-1])
            pending = np.concatenate([pending, values])
        in_block = pending[(pending >= np.uint64(t_offset)) & (pending < np.uint64(t_end))]
        problems += check_tokens_block(enc, t_offset, in_block, max_token_id, tokens_where)
        pending = pending[pending >= np.uint64(t_end)]
    for s_offset, values in starts_iter:
        problems += check_starts_block(values, s_offset, previous, num_tokens, starts_where)
        previous = int(values[-1])
    return problems + _last_start(starts_where, starts.size - 1, previous, num_tokens)


def _last_start(where: str, index: int, last: int | None, num_tokens: int) -> list[Problem]:
    if last is None or last == num_tokens:
        return []
    return [Problem(where, f"last entry must equal the token count {num_tokens}", index, last)]


def _blocks(
    array: ArrayReader,
    block: int,
    digests: ChunkDigests | None,
    where: str,
    problems: list[Problem],
) -> Iterator[tuple[int, np.ndarray]]:
    """``(offset, values)`` blocks of an array, in order. With ``digests``, blocks
    hold whole chunks, and each chunk that fails its digest adds to ``problems``."""
    if digests is not None:
        block = max(block // digests.chunk, 1) * digests.chunk
    bounds = np.arange(0, array.size + block, block, dtype=np.int64).clip(max=array.size)
    for lo, hi in itertools.pairwise(bounds):
        if hi > lo:
            values = array.read_ranges(np.array([lo]), np.array([hi]))[0]
            if digests is not None:
                check = functools.partial(digests.check_block, int(lo), values)
                problems += _digest_problems(where, check)
            yield int(lo), values


def _digest_problems(where: str, check: Callable[[], list[str]]) -> list[Problem]:
    """The chunks ``check()`` finds failing their digests (listed or raised), or
    its side array's fault."""
    try:
        return [Problem(where, m) for m in check()]
    except FormatError as e:
        return e.problems


def summary(
    url: str | os.PathLike[str],
    options: StoreOptions | None = None,
    max_sampled: int = 1 << 20,
    **option_fields: Any,
) -> dict[str, Any]:
    """What made the dataset, and counts, sequence lengths and layout of every split.

    Length quantiles and the ``"histogram"`` (counts of lengths in
    ``[edges[i], edges[i + 1])``, ``edges`` powers of two) are exact up to
    ``max_sampled`` sequences and taken over evenly spaced sequences beyond
    that (``"lengths_sampled": true``). ``"packing_plans"`` maps the
    ``seq_len`` of each stored plan to its attributes.
    """
    ds = open_dataset(url, resolve_options(options, option_fields, "summary"))
    out: dict[str, Any] = {
        "url": ds.url,
        "zarr_format": ds.zarr_format,
        "info": None if ds.info is None else ds.info.to_attributes(),
        "splits": {},
    }
    for name, ft in ds.items():
        n = ft.num_sequences
        info: dict[str, Any] = {
            "num_tokens": ft.num_tokens,
            "num_sequences": n,
            "max_token_id": ft.max_token_id,
            "loss_mask": ft.loss_mask is not None,
            "layout": ft.storage_formats(),  # info --json's key
            "packing_plans": plans_summary(ft),
        }
        if n:
            idx = np.unique(np.linspace(0, n - 1, min(n, max_sampled)).astype(np.int64))
            lo, hi = ft.sequence_bounds(idx)
            lengths = hi - lo
            q = np.quantile(lengths, [0.0, 0.5, 0.9, 0.99, 1.0])
            info["lengths"] = {
                "mean": ft.num_tokens / n,
                "min": int(q[0]),
                "median": float(q[1]),
                "p90": float(q[2]),
                "p99": float(q[3]),
                "max": int(q[4]),
            }
            low = int(lengths.min()).bit_length() - 1
            edges = [1 << k for k in range(low, int(lengths.max()).bit_length() + 1)]
            # frexp's exponent is floor(log2(x)) + 1, exactly, for integers below 2**53.
            bucket = np.frexp(lengths.astype(np.float64))[1].astype(np.int64) - 1 - low
            counts = np.bincount(bucket, minlength=len(edges) - 1).astype(int).tolist()
            info["histogram"] = {"edges": edges, "counts": counts}
            info["lengths_sampled"] = bool(idx.size < n)
            _plans_filled(info["packing_plans"], lengths, n)
        out["splits"][name] = info
    return out


def _plans_filled(plans: dict[str, Any], lengths: np.ndarray, n: int) -> None:
    """Adds ``"filled"`` to each plan: the share of its bins' tokens that hold
    tokens (from ``lengths`` of ``n`` sequences where the plan records none)."""
    for seq_len, plan in plans.items():
        if not isinstance(plan, dict) or not isinstance(plan.get("num_bins"), int):
            continue
        tokens = plan.get("tokens")
        if not isinstance(tokens, int):
            tokens = round(float(np.minimum(lengths, int(seq_len)).mean()) * n)
            plan["filled_sampled"] = bool(lengths.size < n)
        plan["filled"] = tokens / max(plan["num_bins"] * int(seq_len), 1)
