"""Benchmark: records/s through grain pipelines against ``ftj.Loader`` on one local store.

Writes a synthetic dataset (Zipf-distributed ids, lognormal sequence lengths)
to local disk, then reads the same number of shuffled packed records of the
same store through each path, batch by batch:

* ``Loader.host_batch``: one batched read and decode per step (``prefetch=0``);
* ``Loader.iterate`` and ``Loader.to_grain()`` (a grain ``IterDataset`` of
  whole steps as host numpy dicts), each a fresh ``Loader`` with the default
  ``prefetch`` (the self-sizing read-ahead): the loader's steps read ahead, on
  the devices (``iterate``, every array waited for) or on the host (``to_grain``),
  and ``to_grain()`` with ``mp_prefetch`` over 2 worker processes (each reads
  its steps through its own loader);
* grain ``MapDataset.source(src).shuffle(seed).batch(B)``: one read per record;
* grain ``MapDataset.range(n).shuffle(seed).batch(B).map(src.read_batch)``:
  one batched read per batch, in this process and with ``mp_prefetch`` over 2
  worker processes;
* grain ``DataLoader`` (``IndexSampler``, ``Batch``) with 0 and 2 worker
  processes: one read per record, in the workers when there are any.

Every grain path runs once per ``--read-threads`` value (grain's
``ReadOptions.num_threads``: reader threads per process; grain's default is 16).

Each path's order is its own shuffle of the same records. Throughput counts
every batch, the first included (worker start-up too); the time to that first
batch is listed beside it. With numba installed, its kernels are loaded in
this process before any path is timed.

Run: ``python scripts/bench_grain.py [--tokens 80_000_000] [--records 40000]``
"""

from __future__ import annotations

import argparse
import functools
import itertools
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grain
import jax
from absl import flags

import flat_tokens_jax as ftj
from flat_tokens_jax.grain.grain import FlatTokensSource

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_loader import synthetic


def measure(batches: Callable[[], Iterator[Any]], steps: int) -> tuple[float, float]:
    """(seconds to the first batch, seconds for all ``steps`` batches, the first included).

    Timing from the first batch on would flatter pipelines that read ahead:
    while the first batch is awaited, their reader threads fill a buffer of
    later ones (grain's 16 threads, 16 batches: half of a short run).
    """
    began = time.perf_counter()
    it = batches()
    next(it)
    first = time.perf_counter()
    for _ in itertools.islice(it, steps - 1):
        pass
    took = time.perf_counter() - began
    if close := getattr(it, "close", None):
        close()  # a loader's read-ahead threads stop before the next path is timed
    return first - began, took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=80_000_000)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--records", type=int, default=40_000, help="records read per path")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument(
        "--read-threads",
        type=int,
        nargs="+",
        default=[16, 1],
        help="grain ReadOptions.num_threads to run each grain path with (16: grain's default)",
    )
    parser.add_argument("--dir", type=Path, default=None)
    args = parser.parse_args()
    # grain 0.2 reads an absl flag when it starts workers under jax
    # (google/grain#1355); outside absl.app.run, absl has parsed none.
    flags.FLAGS.mark_as_parsed()
    B, L = args.batch, args.seq_len
    root = args.dir or Path(tempfile.mkdtemp(prefix="ftj-bench-grain-"))
    try:
        path = root / "ds"
        began = time.perf_counter()
        with ftj.DatasetWriter(path, overwrite=True) as w:
            w.extend("train", synthetic(args.tokens))
        print(f"wrote {args.tokens:,} tokens in {time.perf_counter() - began:.1f}s")
        ft = ftj.open_dataset(path)["train"]
        src = FlatTokensSource(path, L)
        steps = min(args.records, len(src)) // B
        if steps < 1:
            raise SystemExit(f"{len(src)} records of {L} tokens: pass more --tokens")
        loader = ftj.Loader(ft, ftj.LoaderConfig(batch_size=B, seq_len=L, seed=1, prefetch=0))
        # Load the compiled kernels (the fast extra) before timing: a process
        # pays that once, whichever path reads first (scripts/bench_decode.py
        # prints what it costs).
        ftj.Loader(ft, ftj.LoaderConfig(batch_size=B, seq_len=L, seed=2)).host_batch(0)

        def data_loader(workers: int, read: grain.ReadOptions) -> Iterator[Any]:
            sampler = grain.samplers.IndexSampler(
                num_records=len(src),
                shard_options=grain.sharding.ShardByJaxProcess(drop_remainder=True),
                shuffle=True,
                num_epochs=1,
                seed=1,
            )
            return iter(
                grain.DataLoader(
                    data_source=src,
                    sampler=sampler,
                    operations=[grain.transforms.Batch(B, drop_remainder=True)],
                    worker_count=workers,
                    read_options=read,
                )
            )

        def per_record(read: grain.ReadOptions) -> Iterator[Any]:
            ds = grain.MapDataset.source(src).shuffle(seed=1).batch(B)
            return iter(ds.to_iter_dataset(read))

        def per_batch(read: grain.ReadOptions, workers: int = 0) -> Iterator[Any]:
            ds = grain.MapDataset.range(len(src)).shuffle(seed=1).batch(B).map(src.read_batch)
            out = ds.to_iter_dataset(read)
            if workers:
                out = out.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers))
            return iter(out)

        def iterate() -> Iterator[Any]:
            fresh = ftj.Loader(ft, ftj.LoaderConfig(batch_size=B, seq_len=L, seed=1))
            steps = fresh.iterate(0)
            try:
                for _, batch in steps:
                    yield jax.block_until_ready(batch)
            finally:
                steps.close()

        def to_grain(workers: int = 0) -> Iterator[Any]:
            fresh = ftj.Loader(ft, ftj.LoaderConfig(batch_size=B, seq_len=L, seed=1))
            ds = fresh.to_grain()
            if workers:
                ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers))
            return iter(ds)

        first, took = measure(lambda: map(loader.host_batch, itertools.count()), steps)
        rows = [("ftj.Loader.host_batch", "", steps * B / took, first)]
        for label, batches in [
            ("ftj.Loader.iterate", iterate),
            ("ftj.Loader.to_grain()", to_grain),
            (
                f"ftj.Loader.to_grain(), mp_prefetch({args.workers} workers)",
                functools.partial(to_grain, args.workers),
            ),
        ]:
            first, took = measure(batches, steps)
            rows.append((label, "", steps * B / took, first))
        batched = "MapDataset.range(n).shuffle.batch.map(src.read_batch)"
        for threads in args.read_threads:
            read = grain.ReadOptions(num_threads=threads)
            paths: list[tuple[str, Callable[[], Iterator[Any]]]] = [
                ("MapDataset.source(src).shuffle.batch", functools.partial(per_record, read)),
                (batched, functools.partial(per_batch, read)),
                (
                    f"{batched}, mp_prefetch({args.workers} workers)",
                    functools.partial(per_batch, read, args.workers),
                ),
                ("DataLoader, worker_count=0", functools.partial(data_loader, 0, read)),
                (
                    f"DataLoader, worker_count={args.workers}",
                    functools.partial(data_loader, args.workers, read),
                ),
            ]
            for label, batches in paths:
                first, took = measure(batches, steps)
                rows.append((label, str(threads), steps * B / took, first))
        base = rows[0][2]
        print(f"\nB={B}, L={L}, {steps * B:,} shuffled packed records per path, page cache warm\n")
        print("| path | read threads | records/s | vs ftj.Loader | first batch (s) |")
        print("| --- | ---: | ---: | ---: | ---: |")
        for label, threads, rate, first in rows:
            print(f"| {label} | {threads} | {rate:,.0f} | {rate / base:.2f}x | {first:.2f} |")
        print(f"\nLoader.to_grain() / Loader.iterate: {rows[2][2] / rows[1][2]:.2f}x (goal: 0.9x)")
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
