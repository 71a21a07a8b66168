"""Benchmark: a step of a 100-phase run costs at step 10**12 what it costs at step 1.

Each phase's stream counts are summed once, when the run is built, so a step
finds its phase by bisection and its records by the phase loader's own
arithmetic. This writes two small local splits, builds a 100-phase run (every
``10**10`` steps a new phase; three kinds of phase in turn: a mixture with
packed rows of 1024, one split with rows of 2048, a mixture with a weight
schedule; phase 0 and phase 99, which holds step ``10**12``, are of the same
kind), and times ``host_batch`` at the two steps interleaved (each the mean
over the 64 steps from it, median of the repeats), beside the same config as a
plain ``Loader`` at the same two steps. It also reports the time to build the run and the size of
its ``state()`` as JSON, for 1 and 100 phases, and counts the Python calls a
step makes at both steps (timings on a shared machine move; the count does not).

Run: ``python scripts/bench_phases.py [--repeats 30]``
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

import flat_tokens_jax as ftj

FAR = 10**12
SPAN = 64
PHASES = 100
EVERY = 10**10
# Decoding on one thread keeps thread scheduling on a shared machine out of the timings.
FIXED = {"seed": 1, "prefetch": 0, "decode_threads": 1}


def medians(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median seconds of each function, called in turn ``repeats`` times (interleaved)."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(repeats):
        for name, fn in fns.items():
            began = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - began)
    return {name: statistics.median(t) for name, t in times.items()}


def calls(fn: Callable[[], object]) -> int:
    """Python function calls that ``fn`` makes (a count that load on the machine cannot move)."""
    fn()
    profile = cProfile.Profile()
    profile.enable()
    fn()
    profile.disable()
    return int(pstats.Stats(profile).total_calls)  # type: ignore[attr-defined]


def phases(a: ftj.FlatTokens, b: ftj.FlatTokens, count: int) -> list[ftj.Phase]:
    out = []
    for k in range(count):
        kind = k % 3
        if kind == 0:
            source: ftj.FlatTokens | ftj.Mixture = ftj.Mixture({"a": (a, 3), "b": (b, 1)})
            cfg = ftj.LoaderConfig(batch_size=64, seq_len=1024, **FIXED)
        elif kind == 1:
            source = a
            cfg = ftj.LoaderConfig(batch_size=32, seq_len=2048, **FIXED)
        else:
            source = ftj.Mixture({"a": (a, 1), "b": (b, 1)}, schedule=[(10**6, [1, 3])])
            cfg = ftj.LoaderConfig(batch_size=64, seq_len=1024, **FIXED)
        out.append(ftj.Phase(k * EVERY, source, cfg, f"p{k}"))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("a", "b"):
            seqs = (rng.integers(0, 50_000, int(n)) for n in rng.integers(50, 2000, 2000))
            ftj.write_dataset(Path(tmp) / name, {"train": seqs})
        a, b = (ftj.open_dataset(Path(tmp) / n)["train"] for n in ("a", "b"))
        began = time.perf_counter()
        run = ftj.PhasedLoader(phases(a, b, PHASES))
        built = time.perf_counter() - began
        assert run.phase_at(FAR) == PHASES - 1 and (PHASES - 1) % 3 == 0
        one = ftj.PhasedLoader(phases(a, b, 1))
        plain = ftj.Loader(run.phases[0].source, run.phases[0].config)
        got = medians(
            {
                "phased 1": lambda: [run.host_batch(1 + k) for k in range(SPAN)],
                "phased far": lambda: [run.host_batch(FAR + k) for k in range(SPAN)],
                "plain 1": lambda: [plain.host_batch(1 + k) for k in range(SPAN)],
                "plain far": lambda: [plain.host_batch(FAR + k) for k in range(SPAN)],
            },
            args.repeats,
        )
        got = {k: v / SPAN for k, v in got.items()}
        counted = {
            "phased 1": calls(lambda: [run.host_batch(1 + k) for k in range(SPAN)]),
            "phased far": calls(lambda: [run.host_batch(FAR + k) for k in range(SPAN)]),
            "plain 1": calls(lambda: [plain.host_batch(1 + k) for k in range(SPAN)]),
        }
        run.next_step = FAR + SPAN
        one.next_step = SPAN
        sizes = {n: len(json.dumps(r.state()).encode()) for n, r in ((PHASES, run), (1, one))}
    print(
        f"{PHASES} phases, a new one every 10**10 steps; 64 rows x 1024 tokens at both "
        f"steps; per step, mean of {SPAN} steps, median of {args.repeats}"
    )
    print("| what | step 1 | step 10**12 | ratio |")
    print("| --- | ---: | ---: | ---: |")
    ratio = got["phased far"] / got["phased 1"]
    print(
        f"| `host_batch`, {PHASES}-phase run | {got['phased 1'] * 1e3:.3f} ms "
        f"| {got['phased far'] * 1e3:.3f} ms | {ratio:.2f} |"
    )
    ratio = got["plain far"] / got["plain 1"]
    print(
        f"| `host_batch`, phase 0's config as a `Loader` | {got['plain 1'] * 1e3:.3f} ms "
        f"| {got['plain far'] * 1e3:.3f} ms | {ratio:.2f} |"
    )
    print(
        f"Python calls per step: {counted['phased 1'] / SPAN:.0f} at step 1, "
        f"{counted['phased far'] / SPAN:.0f} at step 10**12 "
        f"({counted['phased far'] / counted['phased 1']:.3f}x); a Loader of phase 0's "
        f"config: {counted['plain 1'] / SPAN:.0f}"
    )
    print(f"building the {PHASES}-phase run: {built:.2f} s")
    print(f"state() as JSON: {sizes[1]:,} bytes (1 phase), {sizes[PHASES]:,} bytes ", end="")
    print(f"({PHASES} phases)")


if __name__ == "__main__":
    main()
