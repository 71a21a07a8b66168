"""Benchmark flat-tokens storage formats against a raw ``np.memmap`` file.

Writes synthetic tokens (Zipf-distributed ids, which compress like real BPE text,
in lognormal-length sequences of ~1,000 tokens) to a raw ``uint32`` file and to
datasets in several zarr storage formats, reads the same random slices through
``FlatTokens.encoded_ranges`` and ``np.memmap``, and prints a Markdown table.

Every file is read once before timing, so both readers run from a warm page
cache (it cannot be dropped without root); write rates are to the page cache,
without fsync. Each read rate is the best of ``--repeats`` runs, alternating
between readers, to damp noise from other jobs.

Run from the repository root (about 10 minutes on 2 cores with the defaults)::

    .venv/bin/python scripts/bench_store.py
    .venv/bin/python scripts/bench_store.py --tokens 50_000_000 --formats v3-c13,v3-c16-zstd3
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import tensorstore as ts

import flat_tokens_jax as ftj

VOCAB = 50257
GEN_BLOCK = 1 << 24  # tokens generated, or fed to the writer, at a time
DEFAULT = "v3-c13"
FORMATS = {
    DEFAULT: ftj.StorageFormat(),
    "v3-c13-nocrc": ftj.StorageFormat(checksum=False),
    "v3-c14": ftj.StorageFormat(chunk_tokens=1 << 14),
    "v3-c16": ftj.StorageFormat(chunk_tokens=1 << 16),
    "v3-c14-zstd3": ftj.StorageFormat(chunk_tokens=1 << 14, compression="zstd"),
    "v3-c16-zstd3": ftj.StorageFormat(chunk_tokens=1 << 16, compression="zstd"),
    "v2-c20": ftj.StorageFormat(zarr_format=2, shard_tokens=1 << 20, compression=None),
    "v2-c20-blosc": ftj.StorageFormat(zarr_format=2),
}

HEADER = (
    "layout | tokens | on disk (of raw uint32) | write MB/s | write Mtok/s"
    " | ours slices/s (MB/s) | memmap slices/s (MB/s) | ours/memmap"
)
ReadFn = Callable[[np.ndarray, np.ndarray], list[np.ndarray]]


def truncate(lengths: np.ndarray, n_tokens: int) -> np.ndarray:
    """The first sequence lengths ``[k] int64`` summing to ``n_tokens`` (the last cut short)."""
    ends = np.cumsum(lengths)
    k = int(np.searchsorted(ends, n_tokens)) + 1
    out = lengths[:k].copy()
    out[-1] -= ends[k - 1] - n_tokens
    return out


def make_raw(path: Path, n_tokens: int, seed: int) -> np.ndarray:
    """Writes ``n_tokens`` encoded tokens to ``path``; returns sequence lengths ``[k] int64``."""
    rng = np.random.default_rng(seed)
    draws = rng.lognormal(np.log(700), 1.0, n_tokens // 200 + 1000)  # mean length ~1150
    lengths = truncate(np.maximum(draws.astype(np.int64), 1), n_tokens)
    starts = np.cumsum(lengths) - lengths
    weights = 1.0 / (np.arange(VOCAB) + 2.7) ** 1.07  # Zipf-Mandelbrot, like BPE frequencies
    cdf = np.cumsum(weights) / weights.sum()
    with open(path, "wb") as f:
        for lo in range(0, n_tokens, GEN_BLOCK):
            hi = min(lo + GEN_BLOCK, n_tokens)
            ids = np.minimum(np.searchsorted(cdf, rng.random(hi - lo)), VOCAB - 1)
            enc = ids.astype(np.uint32) << np.uint32(1)
            enc[starts[np.searchsorted(starts, lo) : np.searchsorted(starts, hi)] - lo] |= 1
            enc.tofile(f)
    return lengths


def sequences(raw: np.ndarray, lengths: np.ndarray) -> Iterator[np.ndarray]:
    """Decoded ids of each sequence of ``lengths``, read from ``raw`` a block at a time."""
    ends = np.cumsum(lengths)
    first = 0
    while first < lengths.size:
        lo = int(ends[first] - lengths[first])
        last = max(int(np.searchsorted(ends, lo + GEN_BLOCK, side="right")), first + 1)
        ids = np.asarray(raw[lo : int(ends[last - 1])]) >> np.uint32(1)
        yield from np.split(ids, ends[first : last - 1] - lo)
        first = last


def warm(path: Path) -> None:
    """Reads every file at or under ``path`` once, so it sits in the page cache."""
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for p in files:
        with open(p, "rb", buffering=0) as f:
            while f.read(1 << 26):
                pass


def copying(read: ReadFn) -> ReadFn:
    """Copies what ``read`` returns, as the memmap reader does: local reads may be views."""
    return lambda lo, hi: [np.array(x) for x in read(lo, hi)]


def memmap_reader(raw: np.ndarray) -> ReadFn:
    return lambda lo, hi: [np.array(raw[a:b]) for a, b in zip(lo, hi, strict=True)]


def tensorstore_reader(store: ts.TensorStore) -> ReadFn:
    """Reads through tensorstore alone, without the memory-mapped fast path."""

    def read(lo: np.ndarray, hi: np.ndarray) -> list[np.ndarray]:
        futures = [store[int(a) : int(b)].read() for a, b in zip(lo, hi, strict=True)]
        return [f.result() for f in futures]

    return read


def rate(read: ReadFn, starts: np.ndarray, length: int, batch: int, max_s: float) -> float:
    """Slices per second reading ``[starts[i], starts[i] + length)``, ``batch`` per call."""
    read(starts[:batch], starts[:batch] + length)  # warm-up: opens files, shard indices
    done, t0 = 0, time.perf_counter()
    for i in range(0, starts.size, batch):
        done += len(read(starts[i : i + batch], starts[i : i + batch] + length))
        if time.perf_counter() - t0 > max_s:
            break
    return done / (time.perf_counter() - t0)


def compare(
    readers: dict[str, ReadFn], starts: np.ndarray, length: int, args: argparse.Namespace
) -> dict[str, float]:
    """Best slices/s of each reader over ``args.repeats`` alternating runs."""
    best = dict.fromkeys(readers, 0.0)
    for _ in range(args.repeats):
        for name, read in readers.items():
            best[name] = max(best[name], rate(read, starts, length, args.batch, args.max_seconds))
    return best


def measure(
    name: str, n: int, raw: np.ndarray, lengths: np.ndarray, root: Path, args: argparse.Namespace
) -> tuple[list[list[str]], dict[int, dict[str, float]]]:
    """Writes ``n`` tokens in storage format ``name`` and reads them; returns table rows and,
    for the default storage format at full size, slices/s by read length."""
    path = root / f"{name}-{n}"
    t0 = time.perf_counter()
    with ftj.DatasetWriter(path, storage_format=FORMATS[name], splits=("train",)) as w:
        w.extend("train", sequences(raw, truncate(lengths, n)))
    write_s = time.perf_counter() - t0
    disk = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    warm(path)
    ft = ftj.open_dataset(path)["train"]
    starts = np.random.default_rng(args.seed + 1).integers(0, n - args.slice, args.reads)
    readers = {"ours": copying(ft.encoded_ranges), "memmap": memmap_reader(raw)}
    probe = (starts[: args.batch], starts[: args.batch] + args.slice)
    for got, want in zip(readers["ours"](*probe), readers["memmap"](*probe), strict=True):
        if not np.array_equal(got, want):
            raise RuntimeError(f"{name}: encoded_ranges disagrees with the raw file")
    full = name == DEFAULT and n == args.tokens
    if full:
        readers["tensorstore only"] = tensorstore_reader(ft.encoded.store)  # type: ignore[attr-defined]
    rates = compare(readers, starts, args.slice, args)
    overhead = {1: compare(readers, starts, 1, args), args.slice: rates} if full else {}
    if not args.keep:
        shutil.rmtree(path)
    desc, mb, slice_mb = describe(FORMATS[name]), 4 * n / 1e6, 4 * args.slice / 1e6
    rows = [
        [
            desc if reader == "ours" else f"{desc} + {reader}",
            f"{n / 1e6:.0f}M",
            f"{disk / 1e6:,.0f} MB ({disk / (4 * n):.0%})",
            f"{mb / write_s:,.0f}",
            f"{n / write_s / 1e6:.1f}",
            f"{rates[reader]:,.0f} ({rates[reader] * slice_mb:,.0f})",
            f"{rates['memmap']:,.0f} ({rates['memmap'] * slice_mb:,.0f})",
            f"{rates[reader] / rates['memmap']:.2f}",
        ]
        for reader in readers
        if reader != "memmap"
    ]
    return rows, overhead


def describe(storage_format: ftj.StorageFormat) -> str:
    shard, chunk = (
        storage_format.shard_tokens.bit_length() - 1,
        storage_format.chunk_tokens.bit_length() - 1,
    )
    where = (
        f"v2 chunk 2^{shard}"
        if storage_format.zarr_format == 2
        else f"v3 shard 2^{shard} chunk 2^{chunk}"
    )
    codec = {
        "zstd": f" zstd{storage_format.zstd_level}",
        "blosc": f" blosc-zstd{storage_format.zstd_level}",
    }
    return (
        where
        + codec.get(storage_format.compression or "", " raw")
        + (" crc32c" if storage_format.checksum else "")
    )


def markdown(header: list[str], rows: list[list[str]]) -> str:
    lines = [header, ["---"] * len(header), *rows]
    return "\n".join("| " + " | ".join(r) + " |" for r in lines)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--tokens", type=int, default=500_000_000, help="default storage format's dataset"
    )
    p.add_argument(
        "--small-tokens", type=int, default=100_000_000, help="other storage formats' dataset"
    )
    p.add_argument("--dir", default=None, help="parent of the work folder (default: /tmp)")
    p.add_argument("--keep", action="store_true", help="keep the work folder")
    p.add_argument("--reads", type=int, default=20_000, help="random slices per measurement")
    p.add_argument("--slice", type=int, default=2049, help="tokens per slice")
    p.add_argument("--batch", type=int, default=256, help="slices per encoded_ranges call")
    p.add_argument("--repeats", type=int, default=3, help="runs per reader; the best counts")
    p.add_argument("--max-seconds", type=float, default=10.0, help="time cap per run")
    p.add_argument("--formats", default=",".join(FORMATS), help=f"subset of {','.join(FORMATS)}")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    names = args.formats.split(",")
    unknown = sorted(set(names) - FORMATS.keys())
    if unknown:
        raise SystemExit(f"unknown storage formats {unknown}: choose from {','.join(FORMATS)}")
    small = min(args.small_tokens, args.tokens)
    plan = [(n, args.tokens) for n in names if n == DEFAULT]
    plan += [(n, small) for n in names if (n, small) not in plan]
    root = Path(tempfile.mkdtemp(prefix="bench_store_", dir=args.dir))
    try:
        print(f"cpus {os.cpu_count()}, load {os.getloadavg()}, work folder {root}")
        t0 = time.perf_counter()
        lengths = make_raw(root / "tokens.u32", args.tokens, args.seed)
        print(
            f"generated {args.tokens:,} tokens, {lengths.size:,} sequences "
            f"(mean {lengths.mean():.0f}) in {time.perf_counter() - t0:.0f} s"
        )
        warm(root / "tokens.u32")
        raw = np.memmap(root / "tokens.u32", np.uint32, mode="r")
        rows, overhead = [], {}
        for name, n in plan:
            t0 = time.perf_counter()
            got, over = measure(name, n, raw, lengths, root, args)
            rows += got
            overhead |= over
            print(f"{name} at {n:,} tokens done in {time.perf_counter() - t0:.0f} s", flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(root)
    version = importlib.metadata.version("tensorstore")
    print(
        f"\ntensorstore {version}; page cache WARM for every reader (all files read once "
        f"before timing); {args.slice}-token slices, {args.batch} per call, best of "
        f"{args.repeats}; load average at the end {os.getloadavg()}\n"
    )
    print(markdown(HEADER.split(" | "), rows))
    if overhead:
        print(f"\nPer-read cost, default layout at {args.tokens / 1e6:.0f}M tokens:\n")
        cols = list(next(iter(overhead.values())))
        print(
            markdown(
                ["read length", *(f"{c} µs/read" for c in cols)],
                [[str(k), *(f"{1e6 / v[c]:.1f}" for c in cols)] for k, v in overhead.items()],
            )
        )


if __name__ == "__main__":
    main()
