"""Benchmark: a run whose trainer changes the weights every 100 steps for 10**6
steps (10**4 changes) costs at step 10**6 what it costs at step 1.

This writes ten small local splits, blends them in a ``Mixture`` (default
period), and calls ``set_weights`` every 100 steps with random weights, 10**4
times. It times, interleaved (median of the repeats), at step 1 and step
10**6: ``host_batch`` (the mean over the 64 steps from each, 64 rows x 1024
tokens, decoded on one thread) and the sampler path alone,
``StepSamples.records`` of a whole step (every other step, so no call finds
its records ahead); beside the same loader without changes. A step that opens
a segment whose period tables are not built yet (a step right after a change,
each repeat a new one) is timed too. It also reports the time ``set_weights``
takes (the last 1,000 of the 10**4), the size of ``state()`` as JSON, the time
a fresh loader takes to restore it (every change replayed), and the Python
calls a step makes at both steps (timings on a shared machine move; the count
does not).

With ``--per-change``, it times instead what one change costs as changes
pile up: ``set_weights`` (random weights) and ``skip`` (1 batch), each at a
step after every change before, the mean over the 1,000 calls after
10**3, 10**4 and 10**5 changes (``--most`` lowers the last).

Run: ``python scripts/bench_steering.py [--repeats 30]`` or
``python scripts/bench_steering.py --per-change [--most 100000]``
"""

from __future__ import annotations

import argparse
import itertools
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from bench_phases import FIXED, calls, medians  # this folder is on the path of a script run

import flat_tokens_jax as ftj

FAR = 10**6
EVERY = 100
CHANGES = FAR // EVERY
SPAN = 64
COMPONENTS = 10


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--per-change", action="store_true", help="time one change instead")
    parser.add_argument("--most", type=int, default=10**5, help="--per-change: changes at most")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        parts = {}
        for c in range(COMPONENTS):
            seqs = (rng.integers(0, 50_000, int(n)) for n in rng.integers(50, 2000, 500))
            ftj.write_dataset(Path(tmp) / f"s{c}", {"train": seqs})
            parts[f"s{c}"] = (ftj.open_dataset(Path(tmp) / f"s{c}")["train"], 1.0)
        mix = ftj.Mixture(parts)
        cfg = ftj.LoaderConfig(batch_size=64, seq_len=1024, **FIXED)
        if args.per_change:
            per_change(mix, cfg, args.most, rng)
            return
        steered, plain = ftj.Loader(mix, cfg), ftj.Loader(mix, cfg)
        weights = rng.uniform(0.1, 1.0, (CHANGES, COMPONENTS))  # default periods up to 10**4
        began = time.perf_counter()
        for k in range(CHANGES - 1_000):
            steered.set_weights(EVERY * (k + 1), weights[k].tolist())
        middle = time.perf_counter()
        for k in range(CHANGES - 1_000, CHANGES):
            steered.set_weights(EVERY * (k + 1), weights[k].tolist())
        ended = time.perf_counter()
        rows = steered.host_rows_at(0)

        def batches(loader: ftj.Loader, first: int) -> Callable[[], object]:
            return lambda: [loader.host_batch(first + k) for k in range(SPAN)]

        def records(loader: ftj.Loader, first: int) -> Callable[[], object]:
            return lambda: [loader.steps.records(first + 2 * k, rows) for k in range(SPAN)]

        def opening(loader: ftj.Loader) -> Callable[[], object]:
            # A segment's first step, its tables not built yet: a new segment each call.
            index = itertools.count()
            return lambda: loader.steps.records(FAR - EVERY * (2 + 3 * next(index)), rows)

        got = medians(
            {
                "batch 1": batches(steered, 1),
                "batch far": batches(steered, FAR),
                "plain batch 1": batches(plain, 1),
                "plain batch far": batches(plain, FAR),
                "records 1": records(steered, 1),
                "records far": records(steered, FAR),
                "plain records 1": records(plain, 1),
                "plain records far": records(plain, FAR),
                "opening": opening(steered),
            },
            args.repeats,
        )
        got = {k: v if k == "opening" else v / SPAN for k, v in got.items()}
        counted = {
            "1": calls(lambda: [steered.host_batch(1 + k) for k in range(SPAN)]) / SPAN,
            "far": calls(lambda: [steered.host_batch(FAR + k) for k in range(SPAN)]) / SPAN,
            "plain": calls(lambda: [plain.host_batch(1 + k) for k in range(SPAN)]) / SPAN,
        }
        state = steered.state(FAR)
        size = len(json.dumps(state).encode())
        base = len(json.dumps(plain.state(FAR)).encode())
        began_restore = time.perf_counter()
        fresh = ftj.Loader(mix, cfg)
        fresh.restore(json.loads(json.dumps(state)))
        restored = time.perf_counter() - began_restore
        assert all(
            np.array_equal(fresh.host_batch(s)["targets"], steered.host_batch(s)["targets"])
            for s in (FAR, FAR + 1)
        )
    print(
        f"{COMPONENTS} components, default period; a weight change every {EVERY} steps, "
        f"{CHANGES:,} changes; 64 rows x 1024 tokens; per step, mean of {SPAN} steps, "
        f"median of {args.repeats}"
    )
    print("| what | step 1 | step 10**6 | ratio |")
    print("| --- | ---: | ---: | ---: |")
    for label, key in (
        ("`host_batch`, 10^4 changes", "batch"),
        ("`host_batch`, no change", "plain batch"),
        ("`StepSamples.records`, 10^4 changes", "records"),
        ("`StepSamples.records`, no change", "plain records"),
    ):
        one, far = got[f"{key} 1"], got[f"{key} far"]
        print(f"| {label} | {one * 1e3:.3f} ms | {far * 1e3:.3f} ms | {far / one:.2f} |")
    print(
        f"a segment's first step, its period table built then: "
        f"{got['opening'] * 1e3:.3f} ms (`StepSamples.records`)"
    )
    print(
        f"Python calls per step: {counted['1']:.0f} at step 1, {counted['far']:.0f} at step "
        f"10**6 ({counted['far'] / counted['1']:.3f}x); without changes: {counted['plain']:.0f}"
    )
    print(
        f"set_weights: {(middle - began) / (CHANGES - 1_000) * 1e3:.2f} ms each over the first "
        f"{CHANGES - 1_000:,}, {(ended - middle) / 1_000 * 1e3:.2f} ms each over the last 1,000"
    )
    print(
        f"state() as JSON: {size:,} bytes with {CHANGES:,} changes ({(size - base) / CHANGES:.1f} "
        f"bytes a change), {base:,} without; a fresh loader restores it in {restored:.2f} s"
    )


def per_change(
    mix: ftj.Mixture, cfg: ftj.LoaderConfig, most: int, rng: np.random.Generator
) -> None:
    """Prints the mean time of a ``set_weights`` and of a ``skip`` call after
    10**3, 10**4 and 10**5 (at most ``most``) changes of their kind, on a
    ``Loader`` and on a ``PhasedLoader`` of two phases (its changes in the last)."""
    weights = rng.uniform(0.1, 1.0, (1000, COMPONENTS)).tolist()
    calls = {
        "set_weights": lambda loader, k: loader.set_weights(k + 2, weights[k % 1000]),
        "skip": lambda loader, k: loader.skip(k + 2, 1),
    }
    makers = {
        "Loader": lambda: ftj.Loader(mix, cfg),
        "PhasedLoader": lambda: ftj.PhasedLoader([ftj.Phase(0, mix, cfg), ftj.Phase(1, mix, cfg)]),
    }
    print("| changes before | " + " | ".join(f"{k}.{c}" for k in makers for c in calls) + " |")
    print("| ---: |" + " ---: |" * (len(makers) * len(calls)))
    loaders = {(k, c): make() for k, make in makers.items() for c in calls}
    done = 0
    for n in (10**3, 10**4, 10**5):
        if n > most:
            break
        took = {}
        for (kind, name), loader in loaders.items():
            for k in range(done, n):
                calls[name](loader, k)
            began = time.perf_counter()
            for k in range(n, n + 1000):
                calls[name](loader, k)
            took[kind, name] = (time.perf_counter() - began) / 1000
        done = n + 1000
        print(f"| {n:,} | " + " | ".join(f"{t * 1e3:.3f} ms" for t in took.values()) + " |")


if __name__ == "__main__":
    main()
