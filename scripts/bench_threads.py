"""Benchmark: the loader's default decode threads and read-ahead against
explicit settings, the first loader of a process against later ones, and
the first batch of a fresh process.

Three tables, each measured side by side in one run:

* **Steady state, alternating rounds** (one process): for each batch shape,
  rounds of ``Loader.iterate`` under the default ``decode_threads`` and under
  each explicit count from 1 to the cores this process may use (capped at 8),
  in turn (each round starting one setting later than the one before), each
  a fresh loader after one warm-up loader, timing steps
  3 to 23 (the trainer does nothing: the input's own ceiling). Tokens/s is
  each setting's median over the rounds; the default's ratio to the best
  explicit count is the figure to watch, as the ratio of the medians and as
  the median of each round's own ratio (the default against the best count
  in the same round, minutes apart at most: the machine's drift cancels).
* **First loader against later ones** (fresh processes): in each of
  ``--processes`` new Python processes, the first ``Loader`` of the process
  iterates steps 0 to 23 and a second loader of the same data and config
  (another seed) does the same; tokens/s over steps 3 to 23 of each, and the
  first's ratio to the second's (the median over the processes, and the range).
* **Cold start** (the same fresh processes): seconds in ``Loader(...)`` and
  to the first batch of ``iterate``, and to the second.

Batches are the five fields placed on the default device (``jax.Array``).
Each timed loader starts after a garbage collection, so that a collection of
the loaders before it (a tenth of a second in a process that imported jax)
is not billed to it. The load average is printed with the tables: on a
shared machine, compare runs of a like load.

Run: ``python scripts/bench_threads.py [--tokens 50_000_000] [--shapes 64x2048 256x2048]
[--rounds 5] [--processes 3] [--steady-last 23] [--tables fresh steady] [--data DIR]``
(``--data``: a dataset written before, with a ``train`` split, instead of a new one;
``--steady-last``: the steady table times steps 3 to it)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import flat_tokens_jax as ftj
from flat_tokens_jax.decoding.hostdecode import default_threads

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_loader import synthetic  # the same documents as bench_loader's

FIRST, LAST = 3, 23  # the steps timed: after the opening burst


def tokens_per_second(loader: ftj.Loader, batch: int, seq_len: int, last: int = LAST) -> float:
    """Tokens/s of ``loader.iterate`` over steps FIRST to ``last``, each batch waited for."""
    return timed_steps(loader, batch, seq_len, last)["tokens_s"]


def timed_steps(loader: ftj.Loader, batch: int, seq_len: int, last: int = LAST) -> dict[str, float]:
    """``loader.iterate`` from step 0 to ``last``, each batch waited for: seconds to
    the first batch and from it to the second, tokens/s over steps FIRST to ``last``,
    and the threads it decoded on at the end."""
    gc.collect()
    at = [time.perf_counter()]
    for _, out in loader.iterate(0, last + 1):
        out["targets"].block_until_ready()
        at.append(time.perf_counter())
    return {
        "first_batch_s": at[1] - at[0],
        "second_batch_s": at[2] - at[1],
        "tokens_s": (last - FIRST + 1) * batch * seq_len / (at[last + 1] - at[FIRST]),
        "threads": loader.stats()["decode_threads"],
    }


def loader(path: str, batch: int, seq_len: int, seed: int, threads: int | None) -> ftj.Loader:
    cfg = ftj.LoaderConfig(batch_size=batch, seq_len=seq_len, seed=seed, decode_threads=threads)
    return ftj.Loader(ftj.open_dataset(path)["train"], cfg)


def steady(path: str, shapes: list[tuple[int, int]], rounds: int, last: int) -> None:
    counts = list(range(1, min(default_threads(), 8) + 1))
    settings: list[int | None] = [None, *counts]
    print(f"\nSteady state, {rounds} alternating rounds, steps {FIRST}-{last}, one process")
    print(
        "| shape | "
        + " | ".join(_name(t) for t in settings)
        + " | default / best | default / best, per round (range) | default's threads |"
    )
    print("| --- |" + " ---: |" * (len(settings) + 3))
    for batch, seq_len in shapes:
        tokens_per_second(loader(path, batch, seq_len, 99, None), batch, seq_len, last)  # warm-up
        seen: dict[int | None, list[float]] = {t: [] for t in settings}
        chosen = []
        for r in range(rounds):
            for t in settings[r % len(settings) :] + settings[: r % len(settings)]:
                out = timed_steps(loader(path, batch, seq_len, r, t), batch, seq_len, last)
                seen[t].append(out["tokens_s"])
                if t is None:
                    chosen.append(out["threads"])
        med = {t: statistics.median(v) for t, v in seen.items()}
        best = max(counts, key=lambda t: med[t])
        paired = [d / b for d, b in zip(seen[None], seen[best], strict=True)]
        cells = " | ".join(f"{med[t] / 1e6:.1f} M" for t in settings)
        threads = ", ".join(map(str, chosen))
        print(
            f"| {batch} x {seq_len} | {cells} | {med[None] / med[best]:.2f} | "
            f"{statistics.median(paired):.2f} ({min(paired):.2f}-{max(paired):.2f}) | {threads} |",
            flush=True,
        )


def _name(threads: int | None) -> str:
    return "default" if threads is None else f"{threads} thread{'s' * (threads > 1)}"


def cold(path: str, batch: int, seq_len: int) -> dict[str, float]:
    """Run in a fresh process: the first loader's times, then a second loader's."""
    began = time.perf_counter()
    first = loader(path, batch, seq_len, 0, None)
    made = time.perf_counter() - began
    out = timed_steps(first, batch, seq_len)
    later = tokens_per_second(loader(path, batch, seq_len, 1, None), batch, seq_len)
    return {**out, "loader_s": made, "first": out["tokens_s"], "later": later}


def load() -> str:
    """The load averages over 1, 5 and 15 minutes, and the cores."""
    one, five, fifteen = os.getloadavg()
    return f"load {one:.2f} {five:.2f} {fifteen:.2f} on {os.cpu_count()} cores"


def fresh(path: str, shapes: list[tuple[int, int]], processes: int) -> None:
    print(f"\nFirst loader of a fresh process against a later one ({processes} processes)")
    print(
        "| shape | first loader | later loader | first / later, median (range) | `Loader()` | "
        "first batch | "
        "second batch |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for batch, seq_len in shapes:
        runs = []
        for _ in range(processes):
            out = subprocess.run(
                [sys.executable, __file__, "--cold", path, f"{batch}x{seq_len}"],
                check=True,
                capture_output=True,
                text=True,
            )
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        ratios = [r["first"] / r["later"] for r in runs]
        print(
            f"| {batch} x {seq_len} | {med['first'] / 1e6:.1f} M | {med['later'] / 1e6:.1f} M | "
            f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}) | "
            f"{med['loader_s']:.2f} s | "
            f"{med['first_batch_s']:.2f} s | {med['second_batch_s'] * 1e3:.0f} ms |",
            flush=True,
        )


def shape(text: str) -> tuple[int, int]:
    batch, seq_len = text.lower().split("x")
    return int(batch), int(seq_len)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=50_000_000)
    parser.add_argument("--shapes", nargs="+", type=shape, default=[(64, 2048), (256, 2048)])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--processes", type=int, default=3)
    parser.add_argument(
        "--steady-last",
        type=int,
        default=LAST,
        help="the last step the steady table times (a longer window, less noise)",
    )
    parser.add_argument(
        "--tables", nargs="+", choices=("fresh", "steady"), default=["fresh", "steady"]
    )
    parser.add_argument("--data", help="a dataset with a train split (default: one written here)")
    parser.add_argument("--cold", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.cold:
        print(json.dumps(cold(args.cold[0], *shape(args.cold[1]))))
        return
    with tempfile.TemporaryDirectory() as tmp:
        path = args.data
        if path is None:
            path = str(Path(tmp) / "data")
            with ftj.DatasetWriter(path, overwrite=True) as w:
                w.extend("train", synthetic(args.tokens))
        tokens = ftj.open_dataset(path)["train"].num_tokens
        print(f"{tokens:,} tokens; cores {default_threads()}; {load()}")
        if "fresh" in args.tables:
            fresh(path, args.shapes, args.processes)
        if "steady" in args.tables:
            steady(path, args.shapes, args.rounds, args.steady_last)
        print(f"\n{load()}")


if __name__ == "__main__":
    main()
