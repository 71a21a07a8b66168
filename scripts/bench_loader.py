"""Benchmark: packed batches from a local dataset against a raw np.memmap copy.

For each layout, writes a synthetic dataset (Zipf-distributed ids, which
compress like text) and a flat raw file of the same encoded tokens, then
measures side by side, in one run, over the same random steps:

* ``memmap``: copying each row's encoded window (``L + 1`` tokens) out of the
  raw file, ``out[row] = mm[start - 1 : start + L]`` into a preallocated
  ``[B, L + 1]`` uint32 array (``start = record * L``; record 0, which has no
  token before it, copies ``mm[0 : L + 1]``), the same random records as the
  loader's: the floor any reader pays;
* ``host_batch``: ``Loader.host_batch`` (all five fields as numpy);
* ``batch``: ``Loader.batch`` (all five fields as global ``jax.Array``\\ s),
  called with consecutive steps, so it reads ahead ``prefetch`` steps (2), and
  with ``prefetch=0`` (each step read when asked);
* ``iterate``: ``Loader.iterate`` (``prefetch`` 2);

reporting tokens/s, the ratio to memmap, and CPU seconds per million tokens
(process CPU time, all threads). The loader decodes each batch in row blocks
on ``decode_threads`` threads (printed; one fewer when reading ahead);
read-ahead and ``iterate`` prepare steps on two background threads, one
reading, one decoding. With numba installed (the ``fast`` extra) the copy and
the decode run compiled kernels; the uncompressed layout is then measured a
second time with numpy alone (``numpy, no numba``), in the same run. A last
table times each stage of a step alone on one thread (the sampler for one step
and for 8 steps in one call, as consecutive steps use it; the read; the
decode; ``jax.device_put``).
Also time-to-first-batch at step 0 and at step 10**9 (fresh loaders).

The default layout stores a crc32c after every chunk; ``uncompressed, no
checksums`` is the same layout without them, to measure their write and read
cost. ``--padded`` reads padded rows (one sequence per row) and also times the
integrity checks of a padded read alone (``seq_starts`` bounds and start
bits), as a fraction of ``host_batch``. Both modes time the shard-probe
checks and the chunk-digest checks of a read alone (:mod:`flat_tokens_jax.store.probes`,
:mod:`flat_tokens_jax.store.digests`, after each shard's or chunk's first touch) as a
fraction of ``host_batch``, and the chunk-digest checks alone when every
token chunk a step reads is a first touch (each step's chunks checked afresh:
the worst case, a run's first pass over a store larger than its steps read;
an upper bound where a check reads chunks whole, since the read then serves
its ranges from them), and what the checks add to ``host_batch`` on a freshly
opened split, with and without them.

``--side-chunks`` measures only what checking each shard's side chunk of
chunk digests against the array's attribute costs ``host_batch`` (see
:func:`side_chunk_costs`).

``--layouts`` measures only what each batch layout (``LoaderConfig.layout``,
with and without ``max_segments``) costs ``host_batch`` against the five
fields, on the uncompressed layout, side by side in one run.

Run: ``python scripts/bench_loader.py [--tokens 200_000_000] [--steps 20] [--padded] [--layouts]
[--side-chunks]``
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import jax
import numpy as np

import flat_tokens_jax as ftj
from flat_tokens_jax.data.records import PaddedRecords, check_start_bits
from flat_tokens_jax.decoding.hostdecode import BlockDecoder
from flat_tokens_jax.store.arrays import Done


def synthetic(num_tokens: int, seed: int = 0) -> Iterator[np.ndarray]:
    rng = np.random.default_rng(seed)
    left = num_tokens
    while left > 0:
        n = int(min(left, max(1, rng.lognormal(6.8, 0.8))))
        left -= n
        yield np.minimum(rng.zipf(1.2, n), 50_000)


def write(path: Path, storage_format: ftj.StorageFormat, num_tokens: int) -> float:
    began = time.perf_counter()
    with ftj.DatasetWriter(path, storage_format=storage_format, overwrite=True) as w:
        w.extend("train", synthetic(num_tokens))
    return time.perf_counter() - began


def numpy_only(path: Path, cfg: ftj.LoaderConfig) -> tuple[ftj.Loader, ftj.Loader]:
    """A loader and a reading-ahead loader (``prefetch`` 2) over the split at
    ``path`` that copy and decode with numpy, not the compiled kernels."""
    ft = ftj.open_dataset(path)["train"]
    for array in (ft.encoded, ft.loss_mask):
        local = getattr(array, "local", None)
        if local is not None:
            local.kernels = None
    loaders = []
    for prefetch in (0, 2):
        loader = ftj.Loader(ft, dataclasses.replace(cfg, prefetch=prefetch))
        loader.engine.block_decoder = BlockDecoder(
            loader.engine.block_decoder.threads, kernel="numpy"
        )
        loaders.append(loader)
    return loaders[0], loaders[1]


def timed(fn: Callable[[int], object], steps: list[int]) -> tuple[float, float]:
    """(wall, cpu) seconds for fn over every step, best of three passes."""
    best = (float("inf"), float("inf"))
    for _ in range(3):
        wall, cpu = time.perf_counter(), time.process_time()
        for s in steps:
            fn(s)
        best = min(best, (time.perf_counter() - wall, time.process_time() - cpu))
    return best


def timed_iterate(loader: ftj.Loader, steps: list[int]) -> tuple[float, float]:
    """(wall, cpu) seconds for ``loader.iterate`` over ``steps`` (consecutive), best of three."""
    best = (float("inf"), float("inf"))
    for _ in range(3):
        wall, cpu = time.perf_counter(), time.process_time()
        it = loader.iterate(steps[0])
        for _, (_, batch) in zip(steps, it, strict=False):
            for v in batch.values():
                v.block_until_ready()
        it.close()
        best = min(best, (time.perf_counter() - wall, time.process_time() - cpu))
    return best


CHECKS = (
    "shard-probe checks of a read",
    "chunk-digest checks of a read",
    "chunk-digest checks, every chunk a first touch",
    "chunk-digest checks, a fresh split's first pass",
)


def check_costs(
    ft: ftj.FlatTokens, loader: ftj.Loader, steps: list[int], name: str, padded: bool, L: int
) -> list[tuple[str, str, float, None, None]]:
    """The rows of :data:`CHECKS`: each check of the steps' token reads
    (``seq_len`` ``L``) alone, as a fraction of ``host_batch`` over the same
    steps; :data:`FIRST_TOUCH` checks each step's token chunks afresh (an upper
    bound of what a first touch adds: where the check reads chunks whole, the
    read then serves its ranges from them instead of reading them)."""
    B = int(loader.host_batch(steps[0])["inputs"].shape[0])
    spans = []
    for step in steps:
        idx = loader.sampler.records(np.arange(B, dtype=np.int64) + step * B)
        if padded:
            spans.append(ft.sequence_bounds(idx))
        else:
            spans.append((np.maximum(idx * L - 1, 0), idx * L + L))
    probes, digests = ft.probes.get(ft.tokens_name), ft.digests.get(ft.tokens_name)
    read = ft.encoded.read_ranges

    def probe_checks(i: int) -> None:
        assert probes is not None
        probes.start_check(lambda lo, hi: Done(list(read(lo, hi))), *spans[i])()

    def digest_checks(i: int) -> None:
        digests.check(ft.encoded, *spans[i])  # type: ignore[union-attr]

    def first_touches(i: int) -> None:
        digests.checked[:] = False  # type: ignore[union-attr]
        digests.check(ft.encoded, *spans[i])  # type: ignore[union-attr]

    rows = []
    host_wall, _ = timed(loader.host_batch, steps)
    checks = (probe_checks, digest_checks, first_touches)
    for label, check, present in zip(CHECKS[:3], checks, (probes, digests, digests), strict=True):
        if present is not None:
            wall, _ = timed(check, list(range(len(steps))))
            rows.append((name, label, wall / host_wall, None, None))
    return rows


def first_pass(path: Path, cfg: ftj.LoaderConfig, steps: list[int]) -> float:
    """What the chunk-digest checks add to ``host_batch`` over ``steps`` on a
    freshly opened split after one step elsewhere (nearly every chunk a first
    touch, tensorstore's cache cold), as a fraction: best of three with the
    checks over best of three without."""
    best = {True: float("inf"), False: float("inf")}
    for _ in range(3):
        for checked in (False, True):
            ft = ftj.open_dataset(path)["train"]
            if not checked:
                for array in ft.checked.values():
                    array.digests = None
            loader = ftj.Loader(ft, cfg)
            loader.host_batch(0)  # what a split pays once: opening arrays, mapping shards
            began = time.perf_counter()
            for step in steps:
                loader.host_batch(step)
            best[checked] = min(best[checked], time.perf_counter() - began)
    return best[True] / best[False] - 1


def stage_costs(
    ft: ftj.FlatTokens,
    cfg: ftj.LoaderConfig,
    steps: list[int],
    memmap_copy: Callable[[int], object],
) -> list[tuple[str, float]]:
    """Milliseconds a step of each stage of ``Loader.batch``, each timed alone
    over ``steps`` (best of three), decoding on one thread."""
    loader = ftj.Loader(ft, dataclasses.replace(cfg, decode_threads=1))
    records = loader.components[0]
    B = cfg.batch_size_at(0)
    samples = {s: np.arange(B, dtype=np.int64) + s * B for s in steps}
    chosen = {s: loader.sampler.records(samples[s]) for s in steps}
    windows = {s: records.read(chosen[s]) for s in steps}
    decoded = {s: loader.host_batch(s) for s in steps}
    numpy_decoder = BlockDecoder(1, kernel="numpy")
    span = np.concatenate([samples[s] for s in steps[:8]])

    def ms(fn: Callable[[int], object]) -> float:
        return timed(fn, steps)[0] / len(steps) * 1e3

    return [
        ("memmap copy of windows (the baseline, its sampler call included)", ms(memmap_copy)),
        ("sampler, one call a step", ms(lambda s: loader.sampler.records(samples[s]))),
        (
            "sampler, one call for 8 steps (what consecutive steps use), per step",
            timed(lambda _: loader.sampler.records(span), steps[:1])[0] / 8 * 1e3,
        ),
        ("read: the records' encoded windows", ms(lambda s: records.read(chosen[s]))),
        (
            f"decode: the five fields from the windows ({loader.engine.block_decoder.kernel})",
            ms(
                lambda s: loader.engine.block_decoder.decode(
                    windows[s], ftj.Packing.WINDOWS, cfg.seq_len, start_token_id=0, pad_id=0
                )
            ),
        ),
        (
            "decode: the same with numpy",
            ms(
                lambda s: numpy_decoder.decode(
                    windows[s], ftj.Packing.WINDOWS, cfg.seq_len, start_token_id=0, pad_id=0
                )
            ),
        ),
        ("jax.device_put of the five fields", ms(lambda s: jax.device_put(decoded[s]))),
        ("Loader.host_batch, consecutive steps", ms(loader.host_batch)),
    ]


def layout_costs(path: Path, cfg: ftj.LoaderConfig, steps: list[int]) -> None:
    """Prints ``host_batch`` ms a step for each batch layout, and its ratio to "fields"."""
    ft = ftj.open_dataset(path)["train"]
    variants = [
        (layout, segments)
        for segments in (None, 128)
        for layout in ("fields", "segments", "tokens", "maxtext")
    ]
    loaders = {
        v: ftj.Loader(ft, dataclasses.replace(cfg, layout=v[0], max_segments=v[1]))
        for v in variants
    }
    for loader in loaders.values():
        loader.host_batch(steps[0])
    # Interleaved passes, best of each: drift on a shared machine hits all alike.
    best = dict.fromkeys(variants, float("inf"))
    for _ in range(3):
        for v, loader in loaders.items():
            best[v] = min(best[v], timed(loader.host_batch, steps)[0] / len(steps) * 1e3)
    print("| layout | max_segments | host_batch ms a step | vs fields |")
    print("| --- | --- | ---: | ---: |")
    for layout, segments in variants:
        ratio = best[(layout, segments)] / best[("fields", None)]
        print(f"| {layout} | {segments} | {best[(layout, segments)]:.1f} | {ratio:.2f}x |")


def side_chunk_costs(root: Path, tokens: int, cfg: ftj.LoaderConfig, steps: list[int]) -> None:
    """Prints, for the default layout and shards of 2^16 tokens, what checking the
    side chunks of digests against the attribute (or, ``content`` alone, the side
    array read whole) adds to ``host_batch`` over ``steps`` on a fresh split
    (first pass) and on a second pass (steady state), over a split that trusts
    its side chunks, the three taking turns at each step; and the check alone
    (every side chunk of tokens and starts read and checked as reads do, minus
    read unchecked) over the first pass. Process CPU time (all threads: other
    jobs' load aside), medians over 15 repetitions."""
    variants = ("checked", "content only", "trusted")
    print("| layout | variant | first pass | steady state | check alone, first pass |")
    print("| --- | --- | ---: | ---: | ---: |")
    formats = (("default", ftj.StorageFormat()), ("2^16", ftj.StorageFormat(shard_tokens=1 << 16)))
    for name, storage_format in formats:
        write(path := root / name.replace("^", ""), storage_format, tokens)
        times = np.zeros((15, len(variants), 3))  # [rep, variant, (first, steady, alone)]
        for rep in range(15):
            loaders, alone = [], []
            for variant in variants:
                splits = [ftj.open_dataset(path)["train"] for _ in range(2)]
                for i, ft in enumerate(splits):
                    for d in (d for d in ft.digests.values() if d is not None):
                        d.shards = d.shards if variant == "checked" else None
                        if variant == "trusted" or (variant, i) == ("checked", 1):
                            d.content = None  # reads check shards alone; validate, content too
                loaders.append(ftj.Loader(splits[0], cfg))
                alone.append(splits[1])
            for column in range(2):
                for k, step in enumerate(steps):
                    for v in np.roll(np.arange(len(variants)), rep + k):  # each order alike
                        began = time.process_time()
                        loaders[v].host_batch(step)
                        times[rep, v, column] += time.process_time() - began
            for v in np.roll(np.arange(len(variants)), rep):
                found = [d for d in alone[v].digests.values() if d is not None]
                for d in found:
                    d.side()  # opened: what every variant pays alike
                began = time.process_time()
                for d in found:
                    d.side_problems()
                times[rep, v, 2] = time.process_time() - began
        trusted = times[:, 2]
        for v, variant in enumerate(variants[:2]):
            first, steady = np.median(times[:, v, :2] / trusted[:, :2] - 1, axis=0)
            check = np.median((times[:, v, 2] - trusted[:, 2]) / trusted[:, 0])
            print(f"| {name} | {variant} | {first:+.2%} | {steady:+.2%} | {check:+.3%} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=200_000_000)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--padded", action="store_true", help="padded rows, and time the checks")
    parser.add_argument("--layouts", action="store_true", help="only the batch layouts' cost")
    parser.add_argument("--side-chunks", action="store_true", help="only the side-chunk check")
    args = parser.parse_args()
    root = args.dir or Path(tempfile.mkdtemp(prefix="ftj-bench-"))
    if args.side_chunks:
        try:
            cfg = ftj.LoaderConfig(
                batch_size=args.batch, seq_len=args.seq_len, seed=1, packing=not args.padded
            )
            print(f"B={args.batch}, L={args.seq_len}, {args.steps} random steps\n")
            side_chunk_costs(root, args.tokens, cfg, list(range(1000, 1000 + args.steps)))
        finally:
            if args.dir is None:
                shutil.rmtree(root, ignore_errors=True)
        return
    if args.layouts:
        try:
            path = root / "uncompressed"
            write(path, ftj.StorageFormat(), args.tokens)
            cfg = ftj.LoaderConfig(
                batch_size=args.batch, seq_len=args.seq_len, seed=1, packing=not args.padded
            )
            print(f"B={args.batch}, L={args.seq_len}, {args.steps} random steps, best of 3\n")
            layout_costs(path, cfg, list(range(1000, 1000 + args.steps)))
        finally:
            if args.dir is None:
                shutil.rmtree(root, ignore_errors=True)
        return
    formats = {
        "uncompressed": ftj.StorageFormat(),
        "uncompressed, no checksums": ftj.StorageFormat(checksum=False),
        "zstd": ftj.StorageFormat(compression="zstd", chunk_tokens=1 << 14),
    }
    B, L = args.batch, args.seq_len
    rows = []
    stages: list[tuple[str, float]] = []
    try:
        for name, storage_format in formats.items():
            path = root / name
            write_s = write(path, storage_format, args.tokens)
            ft = ftj.open_dataset(path)["train"]
            raw = root / f"{name}.u32"
            ft.encoded_ranges([0], [ft.num_tokens])[0].tofile(raw)
            mm = np.memmap(raw, np.uint32, "r")
            cfg = ftj.LoaderConfig(
                batch_size=B, seq_len=L, seed=1, prefetch=0, packing=not args.padded
            )
            loader = ftj.Loader(ft, cfg)
            ahead = ftj.Loader(ft, dataclasses.replace(cfg, prefetch=2))
            steps = list(range(1000, 1000 + args.steps))
            out = np.empty((B, L + 1), np.uint32)

            def memmap_copy(
                step: int,
                loader: ftj.Loader = loader,
                mm: np.ndarray = mm,
                out: np.ndarray = out,
                ft: ftj.FlatTokens = ft,
            ) -> None:
                g = np.arange(B, dtype=np.int64) + step * B
                if args.padded:
                    lo = ft.sequence_bounds(loader.sampler.records(g))[0]
                    for row, s in enumerate(lo.tolist()):
                        out[row, :L] = mm[s : s + L]
                    return
                starts = loader.sampler.records(g) * L
                for row, s in enumerate(np.maximum(starts - 1, 0).tolist()):
                    out[row] = mm[s : s + L + 1]

            def device(step: int, loader: ftj.Loader = loader) -> None:
                for v in loader.batch(step).values():
                    v.block_until_ready()

            for fn in (memmap_copy, loader.host_batch, device, partial(device, loader=ahead)):
                fn(steps[0])
            base_wall, base_cpu = timed(memmap_copy, steps)
            tokens = B * L * len(steps)
            variants = [(name, loader, ahead)]
            if name == "uncompressed" and loader.engine.block_decoder.kernel == "numba":
                variants.append((f"{name}, numpy, no numba", *numpy_only(path, cfg)))
            for row_name, sync, reading_ahead in variants:
                for label, fn in (
                    ("memmap copy of windows", memmap_copy),
                    ("Loader.host_batch", sync.host_batch),
                    (
                        "Loader.batch (jax.Array), consecutive steps",
                        partial(device, loader=reading_ahead),
                    ),
                    ("Loader.batch (jax.Array), prefetch=0", partial(device, loader=sync)),
                    ("Loader.iterate (prefetch 2)", None),
                ):
                    if fn is memmap_copy:
                        if sync is not loader:
                            continue
                        wall, cpu = base_wall, base_cpu
                    elif fn is None:
                        wall, cpu = timed_iterate(reading_ahead, steps)
                    else:
                        fn(steps[0])
                        wall, cpu = timed(fn, steps)
                    rows.append(
                        (row_name, label, tokens / wall / 1e6, base_wall / wall, cpu / tokens * 1e6)
                    )
            if args.padded:
                records = PaddedRecords(ft, L)
                prepared = []
                for step in steps:
                    idx = loader.sampler.records(np.arange(B, dtype=np.int64) + step * B)
                    at = np.concatenate([idx, idx + 1])
                    values = ft.starts.read_points(at).astype(np.int64)
                    lo, hi = values[:B], values[B:]
                    prepared.append((idx, at, values, records.read(idx).encoded, lo, hi - lo))

                def checks(
                    i: int, prepared: list[tuple[np.ndarray, ...]] = prepared, ft: Any = ft
                ) -> None:
                    idx, at, values, rows, lo, lengths = prepared[i]
                    ft.check_bounds(at, values, B)
                    check_start_bits(ft, rows, idx, lo, lengths, True)

                wall, _ = timed(checks, list(range(len(steps))))
                host_wall, _ = timed(loader.host_batch, steps)
                rows.append((name, "checks of a padded read", wall / host_wall, None, None))
            rows.extend(check_costs(ft, loader, steps, name, args.padded, L))
            rows.append((name, CHECKS[3], first_pass(path, cfg, steps), None, None))
            if name == "uncompressed" and not args.padded:
                stages.extend(stage_costs(ft, cfg, steps, memmap_copy))
            for step in (0, 10**9):
                fresh = ftj.Loader(ftj.open_dataset(path)["train"], cfg)
                began = time.perf_counter()
                device(step, fresh)
                rows.append(
                    (name, f"first batch at step {step:,}", time.perf_counter() - began, None, None)
                )
            print(
                f"{name}: wrote {args.tokens:,} tokens in {write_s:.1f}s "
                f"({args.tokens * 4 / write_s / 1e6:.0f} MB/s)"
            )
        decoder = ftj.Loader(ft, cfg).engine.block_decoder
        print(
            f"\nB={B}, L={L}, {args.steps} random steps, best of 3, page cache warm; "
            f"decode_threads={decoder.threads} of {os.cpu_count()} cores "
            f"(reading ahead: {max(1, decoder.threads - 1)}); kernels: {decoder.kernel}\n"
        )
        print("| layout | path | M tokens/s (or s) | vs memmap | CPU s / M tokens |")
        print("| --- | --- | ---: | ---: | ---: |")
        for name, label, rate, ratio, cpu in rows:
            if label == "checks of a padded read" or label in CHECKS:
                print(f"| {name} | {label} | {rate:.1%} of host_batch | | |")
            elif ratio is None:
                print(f"| {name} | {label} | {rate:.3f} s | | |")
            else:
                print(f"| {name} | {label} | {rate:.1f} | {ratio:.2f}x | {cpu:.4f} |")
        if stages:
            print(
                "\nWhat a step costs, each stage alone on one thread (uncompressed, ms a step):\n"
            )
            print("| stage | ms |")
            print("| --- | ---: |")
            for label, ms in stages:
                print(f"| {label} | {ms:.2f} |")
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
