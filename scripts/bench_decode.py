"""Micro-benchmark: decoding packed windows into model fields vs a raw ``np.memmap`` read.

Builds synthetic packed records (random ids; sequence starts with probability
``1 / --mean-seq-len`` per token, so geometric sequence lengths), writes their
``[records, seq_len + 1] uint32`` windows to a temp file, and times, for one
batch of ``--batch`` random records:

- baselines: reading the windows from an ``np.memmap`` of that file, by fancy
  indexing rows into a preallocated array with ``np.take(..., out=)`` (which
  buffers the copy unless ``mode="clip"``), with ``mode="clip"``, and into a new
  array (``mm[rows]``);
- each way of decoding those windows into the five model fields, and
  ``padded_fields`` on the same tokens for scale; among them the loader's
  ``BlockDecoder`` with numpy and, with numba installed (the ``fast`` extra),
  with the compiled kernels, on one thread and on every core.

With numba installed it also prints what the kernels cost before the first
batch: importing numba, the first decode in a process with an empty kernel
cache (compiling) and with a warm one, each in a fresh process, and the
installed size of numba and llvmlite.

A ratio is baseline time / variant time, so 0.5 means the variant produces
fields at half the rate that memmap copies windows. Variants run in interleaved
rounds and each reports its best and median round, to damp noise from other
jobs on the machine; the ratios use the best rounds.

Run from the repository root::

    .venv/bin/python scripts/bench_decode.py
    .venv/bin/python scripts/bench_decode.py --batch 64 --seq-len 8192 --rounds 30
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import jax
import numpy as np

from flat_tokens_jax.core import compiled
from flat_tokens_jax.core.fields import Packing
from flat_tokens_jax.data.records import Windows
from flat_tokens_jax.decoding.batch import FIELDS, packed_fields, padded_fields
from flat_tokens_jax.decoding.batch_jax import packed_fields_jax
from flat_tokens_jax.decoding.hostdecode import BlockDecoder

Fields = dict[str, np.ndarray]
IDS = {"start_token_id": 0, "pad_id": 0}
FIRST_DECODE = """
import sys, time
import numpy as np
t = time.perf_counter()
from flat_tokens_jax.core import compiled
kernels = compiled.kernels()
imported = time.perf_counter() - t
from flat_tokens_jax.core.fields import Packing
w = np.zeros((4, 9), np.uint32)
t = time.perf_counter()
kernels.decode_rows(w, None, None, Packing.WINDOWS, (0, 4), start_token_id=0, pad_id=0, out={
    k: np.empty((4, 8), bool if k == "loss_mask" else np.int32)
    for k in ("inputs", "targets", "segment_ids", "positions", "loss_mask")})
print(imported, time.perf_counter() - t)
"""

TAKE = "memmap -> preallocated, np.take(out=)"
TAKE_CLIP = "memmap -> preallocated, np.take(out=, mode=clip)"


def synthetic_windows(
    rng: np.random.Generator, records: int, seq_len: int, mean_seq_len: float
) -> np.ndarray:
    """``[records, seq_len + 1] uint32`` windows of consecutive packed records."""
    n = records * seq_len
    ids = rng.integers(0, 50_257, size=n, dtype=np.uint32)
    starts = rng.random(n) < 1.0 / mean_seq_len
    starts[0] = True
    stream = ids * 2 + starts
    windows = np.zeros((records, seq_len + 1), np.uint32)
    windows[:, 1:] = stream.reshape(records, seq_len)
    windows[1:, 0] = windows[:-1, -1]
    return windows


def naive(w: np.ndarray) -> Fields:
    """The obvious multi-pass version: a temporary per step, int64 scans."""
    seq_len = w.shape[1] - 1
    starts = (w[:, 1:] & 1).astype(bool)
    decoded = (w >> 1).astype(np.int32)
    col = np.arange(seq_len)
    last_start = np.maximum.accumulate(np.where(starts, col, 0), axis=1)
    return {
        "inputs": np.where(starts, 0, decoded[:, :-1]).astype(np.int32),
        "targets": decoded[:, 1:].copy(),
        "segment_ids": (np.cumsum(starts, axis=1) + ~starts[:, :1]).astype(np.int32),
        "positions": (col - last_start).astype(np.int32),
        "loss_mask": np.ones(starts.shape, bool),
    }


def dense_into(w: np.ndarray, out: Fields) -> Fields:
    """Every token visited by each step, but into preallocated outputs, int32 scans."""
    inputs, targets, segment_ids, positions, loss_mask = (out[k] for k in FIELDS)
    col = np.arange(w.shape[1] - 1, dtype=np.int32)
    np.right_shift(w[:, 1:], 1, out=targets.view(np.uint32))
    np.copyto(inputs[:, 1:], targets[:, :-1])
    np.right_shift(w[:, 0], 1, out=inputs[:, 0].view(np.uint32))
    np.bitwise_and(w[:, 1:], 1, out=loss_mask, casting="unsafe")
    np.copyto(inputs, 0, where=loss_mask)
    np.cumsum(loss_mask, axis=1, dtype=np.int32, out=segment_ids)
    segment_ids += ~loss_mask[:, :1]
    np.multiply(col, loss_mask, out=positions)
    np.maximum.accumulate(positions, axis=1, out=positions)
    np.subtract(col, positions, out=positions)
    loss_mask.fill(True)
    return out


def dense_blocked_into(w: np.ndarray, out: Fields, rows: int = 32) -> Fields:
    """``dense_into`` over blocks of ``rows`` rows, so that each block stays in cache."""
    for r in range(0, w.shape[0], rows):
        dense_into(w[r : r + rows], {k: v[r : r + rows] for k, v in out.items()})
    return out


def empty_fields(batch: int, seq_len: int) -> Fields:
    """Separate uninitialised outputs, for the variants that write into them."""
    out = {k: np.empty((batch, seq_len), np.int32) for k in FIELDS[:4]}
    out["loss_mask"] = np.empty((batch, seq_len), np.bool_)
    return out


def time_rounds(
    variants: dict[str, Callable[[], object]], rounds: int, calls: int
) -> dict[str, list[float]]:
    """Seconds per call of each variant in each round, variants interleaved."""
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            seconds[name].append((time.perf_counter() - t0) / calls)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256, help="rows per batch")
    parser.add_argument("--seq-len", type=int, default=2048, help="tokens per row")
    parser.add_argument(
        "--mean-seq-len", type=float, default=1000.0, help="mean sequence length (geometric)"
    )
    parser.add_argument("--records", type=int, default=2048, help="records in the file")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=10, help="calls per variant per round")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    batch, seq_len = args.batch, args.seq_len
    rng = np.random.default_rng(args.seed)
    all_windows = synthetic_windows(rng, max(args.records, batch), seq_len, args.mean_seq_len)

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "windows.u32"
        all_windows.tofile(path)
        mm = np.memmap(path, np.uint32, mode="r", shape=all_windows.shape)
        np.asarray(mm).sum()  # warm the page cache
        rows = rng.permutation(all_windows.shape[0])[:batch]
        buf = np.empty((batch, seq_len + 1), np.uint32)
        w = np.take(mm, rows, axis=0, out=buf).copy()

        jitted = jax.jit(packed_fields_jax)
        on_device = jax.device_put(w)
        prealloc = empty_fields(batch, seq_len)
        tokens = np.ascontiguousarray(w[:, 1:])
        lengths = rng.integers(1, seq_len + 1, batch)
        variants: dict[str, Callable[[], object]] = {
            TAKE: lambda: np.take(mm, rows, axis=0, out=buf),
            TAKE_CLIP: lambda: np.take(mm, rows, axis=0, out=buf, mode="clip"),
            "memmap -> new array, mm[rows]": lambda: mm[rows],
            "numpy naive multi-pass": lambda: naive(w),
            "numpy dense passes, out= prealloc": lambda: dense_into(w, prealloc),
            "numpy dense passes, out=, 32-row blocks": lambda: dense_blocked_into(w, prealloc),
            "packed_fields (numpy, sparse runs)": lambda: packed_fields(w),
            "jax.jit CPU incl. transfer + np.asarray": lambda: {
                k: np.asarray(v) for k, v in jitted(w).items()
            },
            "jax.jit CPU, input on device": lambda: [
                v.block_until_ready() for v in jitted(on_device).values()
            ],
            "padded_fields (numpy, same tokens)": lambda: padded_fields(tokens, lengths),
        }
        cores = os.cpu_count() or 1
        kernels = ["numpy"] + (["numba"] if compiled.kernels() is not None else [])
        decoders = {}
        for kernel in kernels:
            for threads in sorted({1, cores}):
                decoder = BlockDecoder(threads, kernel=kernel)
                name = f"BlockDecoder {kernel}, {threads} thread(s)"
                decoders[name] = decoder
                variants[name] = partial(
                    decoder.decode, Windows(w), Packing.WINDOWS, seq_len, **IDS
                )

        expected = packed_fields(w)
        for name, got in [
            ("naive", naive(w)),
            ("dense", dense_into(w, empty_fields(batch, seq_len))),
            ("dense blocked", dense_blocked_into(w, empty_fields(batch, seq_len))),
            ("jax", {k: np.asarray(v) for k, v in jitted(w).items()}),
            *(
                (name, d.decode(Windows(w), Packing.WINDOWS, seq_len, **IDS))
                for name, d in decoders.items()
            ),
        ]:
            for k in FIELDS:
                if not np.array_equal(got[k], expected[k]):
                    raise SystemExit(f"{name} disagrees with packed_fields on {k}")

        for fn in variants.values():  # warm up: compile, fault in, fill caches
            fn()
        seconds = time_rounds(variants, args.rounds, args.calls)

    best = {name: min(s) for name, s in seconds.items()}
    n_tokens = batch * seq_len
    starts = int(np.count_nonzero(w[:, 1:] & 1))
    print(
        f"batch {batch} x seq_len {seq_len} ({n_tokens:,} tokens, {starts} sequence starts); "
        f"{args.rounds} rounds x {args.calls} calls; numpy {np.__version__}, "
        f"jax {jax.__version__} ({jax.default_backend()}), {os.cpu_count()} CPUs, "
        f"{platform.processor() or platform.machine()}"
    )
    print()
    print("| variant | ms best | ms median | Mtok/s | vs take(out=) | vs take(out=, clip) |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, s in seconds.items():
        print(
            f"| {name} | {best[name] * 1e3:.3f} | {np.median(s) * 1e3:.3f} "
            f"| {n_tokens / best[name] / 1e6:,.0f} | {best[TAKE] / best[name]:.3f} "
            f"| {best[TAKE_CLIP] / best[name]:.3f} |"
        )


def kernel_costs() -> None:
    """Prints what the compiled kernels cost before the first batch, each in a
    fresh process: importing them (numba with them), and the first decode with
    an empty kernel cache, then with the cache it left."""
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "NUMBA_CACHE_DIR": cache}
        runs = []
        for _ in range(2):
            out = subprocess.run(
                [sys.executable, "-c", FIRST_DECODE], env=env, capture_output=True, text=True
            )
            out.check_returncode()
            runs.append([float(x) for x in out.stdout.split()])
    size = 0
    for dist in ("numba", "llvmlite"):
        files = importlib.metadata.distribution(dist).files or []
        size += sum(f.size or 0 for f in files)
    print()
    print("| compiled kernels (numba), in a fresh process | s |")
    print("|---|---:|")
    print(f"| import (numba with it) | {runs[0][0]:.2f} |")
    print(f"| first decode, empty kernel cache (compiles) | {runs[0][1]:.2f} |")
    print(f"| first decode, kernel cache warm | {runs[1][1]:.2f} |")
    print(
        f"\nnumba {importlib.metadata.version('numba')} and llvmlite installed: {size / 1e6:.0f} MB"
    )


if __name__ == "__main__":
    main()
    if compiled.kernels() is not None:
        kernel_costs()
