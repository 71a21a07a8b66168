"""Benchmark: what the instance filter adds to ``Loader.host_batch``.

Writes a synthetic packed dataset (Zipf-distributed ids and lognormal
sequence lengths, as ``bench_loader.py``; a share of the sequences, 2% by
default, hold an n-gram of 1 to 13 tokens repeated 40 times, so the filter has
rows to reject), then times, side by side in one run over the same random
steps (each step timed for each path in turn, the best of ``--repeats``):

* ``host_batch``, filter off: ``LoaderConfig(instance_filter=None)``;
* ``host_batch``, filter on: ``InstanceFilter()`` (OLMo's defaults: periods
  1 to 13, 32 copies);
* the filter alone: ``InstanceFilter().rejected`` on each step's decoded
  targets and segment ids, on one thread (the numba kernel where numba is
  installed, and the numpy path).

It prints tokens/s, the ratio of each to ``host_batch`` with the filter off,
and the share of rows rejected.

Run: ``python scripts/bench_filter.py [--tokens 50_000_000] [--steps 50]``
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

import flat_tokens_jax as ftj
from flat_tokens_jax.core import compiled


def synthetic(num_tokens: int, repeated: float, seed: int = 0) -> Iterator[np.ndarray]:
    """Sequences of Zipf ids; a ``repeated`` share of them holds a repeated n-gram."""
    rng = np.random.default_rng(seed)
    left = num_tokens
    while left > 0:
        n = int(min(left, max(1, rng.lognormal(6.8, 0.8))))
        seq = np.minimum(rng.zipf(1.2, n), 50_000)
        if rng.random() < repeated:
            gram = rng.integers(1, 50_000, int(rng.integers(1, 14)))
            at = int(rng.integers(0, n + 1))
            seq = np.concatenate([seq[:at], np.tile(gram, 40), seq[at:]])[:n]
        left -= seq.size
        yield seq


def per_step(
    fns: dict[str, Callable[[int], object]], steps: list[int], repeats: int
) -> dict[str, float]:
    """Seconds of each ``fns`` over ``steps``: each step timed for every fn in
    turn, ``repeats`` times, its fastest time kept (so drift and other jobs on
    the machine hit every fn alike)."""
    out = dict.fromkeys(fns, 0.0)
    for step in steps:
        for name, fn in fns.items():
            fastest = float("inf")
            for _ in range(repeats):
                began = time.perf_counter()
                fn(step)
                fastest = min(fastest, time.perf_counter() - began)
            out[name] += fastest
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=50_000_000)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--repeated", type=float, default=0.02, help="share of sequences")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-filter-"))
    try:
        ftj.write_dataset(tmp / "ds", {"train": synthetic(args.tokens, args.repeated)})
        ft = ftj.open_dataset(tmp / "ds")["train"]
        rule = ftj.InstanceFilter()
        kernel = "numpy" if compiled.kernels() is None else "numba"
        base = {"batch_size": args.batch_size, "seq_len": args.seq_len, "seed": 1, "prefetch": 0}
        off = ftj.Loader(ft, ftj.LoaderConfig(**base))
        on = ftj.Loader(ft, ftj.LoaderConfig(**base, instance_filter=rule))
        rng = np.random.default_rng(0)
        steps = rng.integers(0, 10**6, args.steps).tolist()
        decoded = {s: _filter_input(off.host_batch(s)) for s in steps}
        rejected = sum(int(rule.rejected(*decoded[s]).sum()) for s in steps)
        fns: dict[str, Callable[[int], object]] = {
            "off": off.host_batch,
            "on": on.host_batch,
            "alone": lambda s: rule.rejected(*decoded[s]),
            "numpy": lambda s: rule.rejected(*decoded[s], kernel="numpy"),
        }
        times = per_step(fns, steps, args.repeats)
        tokens = args.steps * args.batch_size * args.seq_len
        rate = {k: tokens / v / 1e6 for k, v in times.items()}
        print(
            f"{args.tokens:,} tokens, {args.steps} random steps of {args.batch_size} x "
            f"{args.seq_len}, each the best of {args.repeats}; rows rejected: {rejected:,} of "
            f"{args.steps * args.batch_size:,} ({rejected / (args.steps * args.batch_size):.1%})"
        )
        print("| path | M tokens/s | time vs filter off |")
        print("| --- | ---: | ---: |")
        names = {
            "off": "`Loader.host_batch`, filter off",
            "on": "`Loader.host_batch`, `InstanceFilter()`",
            "alone": f"`InstanceFilter().rejected` alone ({kernel})",
            "numpy": "`InstanceFilter().rejected` alone (numpy)",
        }
        for key, name in names.items():
            print(f"| {name} | {rate[key]:,.1f} | {times[key] / times['off']:.2f}x |")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _filter_input(batch: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    return batch["targets"].copy(), batch["segment_ids"].copy()


if __name__ == "__main__":
    main()
