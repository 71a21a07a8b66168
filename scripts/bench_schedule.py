"""Benchmark: a batch far out in a 100-entry batch-size schedule costs what step 1 does.

``samples_before(step)`` is arithmetic over the schedule's entries, so
``Loader.host_batch(10**12)`` should cost the same as ``host_batch(1)``. This
writes a small local dataset, builds loaders with a 100-entry schedule (the
size at step 1 and at step ``10**12`` is the same, so both read as many rows),
alone and as a two-component mixture with a weight schedule, and times the two
steps interleaved (each as the mean over the 16 steps from it, so that both
read a spread of records), reporting medians and their ratio. For scale, it also times
a constant batch size of 64 and the schedule arithmetic alone
(``BatchSchedule.samples_before``).

Run: ``python scripts/bench_schedule.py [--repeats 200]``
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

import flat_tokens_jax as ftj

FAR = 10**12
SPAN = 16  # steps 1.. and 10**12.. timed per repeat, averaging out which records they read
# Size 64 at steps 1.. and 10**12..: both read as many rows.
ENTRIES = [(i * 10**10, (64, 128, 32)[i % 3]) for i in range(100)]


def medians(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median seconds of each function, called in turn ``repeats`` times (interleaved,
    so drift in the machine's speed hits all alike)."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()  # warm-up: first reads, caches
    for _ in range(repeats):
        for name, fn in fns.items():
            began = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - began)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    schedule = ftj.BatchSchedule.of(ENTRIES)
    assert schedule.size(1) == schedule.size(FAR) == 64
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("a", "b"):
            seqs = (rng.integers(0, 50_000, int(n)) for n in rng.integers(50, 2000, 2000))
            ftj.write_dataset(Path(tmp) / name, {"train": seqs})
        a, b = (ftj.open_dataset(Path(tmp) / n)["train"] for n in ("a", "b"))
        cfg = ftj.LoaderConfig(batch_size=ENTRIES, seq_len=1024, seed=1, prefetch=0)
        mix = ftj.Mixture({"a": (a, 3), "b": (b, 1)}, schedule=[(10**6, [1, 1]), (10**11, [1, 3])])
        constant = ftj.LoaderConfig(batch_size=64, seq_len=1024, seed=1, prefetch=0)
        cases = {
            "host_batch, one split": (ftj.Loader(a, cfg), "host_batch"),
            "batch, one split": (ftj.Loader(a, cfg), "batch"),
            "host_batch, mixture": (ftj.Loader(mix, cfg), "host_batch"),
            "host_batch, constant 64": (ftj.Loader(a, constant), "host_batch"),
        }
        rows = []
        for label, (loader, method) in cases.items():
            fn = getattr(loader, method)
            got = medians(
                {
                    "1": lambda f=fn: [f(1 + k) for k in range(SPAN)],
                    "far": lambda f=fn: [f(FAR + k) for k in range(SPAN)],
                },
                args.repeats,
            )
            got = {k: v / SPAN for k, v in got.items()}
            rows.append((label, got["1"], got["far"]))
        got = medians(
            {"1": lambda: schedule.samples_before(1), "far": lambda: schedule.samples_before(FAR)},
            args.repeats * 300,
        )
        rows.append(("samples_before alone", got["1"], got["far"]))
    print(
        f"100-entry schedule, 64 rows x 1024 tokens at both steps; per step, mean of "
        f"{SPAN} steps, median of {args.repeats}"
    )
    print(f"| {'what':<24} | {'step 1':>12} | {'step 10**12':>12} | {'ratio':>6} |")
    print(f"|{'-' * 26}|{'-' * 14}|{'-' * 14}|{'-' * 8}|")
    for label, near, far in rows:
        unit, scale = ("ms", 1e3) if near > 1e-4 else ("us", 1e6)
        print(
            f"| {label:<24} | {near * scale:>9.3f} {unit} | {far * scale:>9.3f} {unit} "
            f"| {far / near:>6.2f} |"
        )


if __name__ == "__main__":
    main()
