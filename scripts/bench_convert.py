"""Benchmark ``convert`` against the tokenizer alone on the same texts.

For each worker count, times side by side, ``--repeats`` times in turn: the
tokenizer's own ``encode_batch`` over all texts at once (the texts already in
memory, the tokenizer's default thread pool), the same with
``encode_batch_fast`` (what ``convert`` calls where tokenizers has it), and
``convert(corpus, tmp, workers=N)``, which also reads and parses the JSONL and
writes the dataset (no validation split). Prints a Markdown table of the best
rates, and of convert's rate over each baseline's: the median over repeats of
the ratio within a repeat, since runs side by side share the machine's noise,
and the CPU seconds (user + system, worker processes included) each took.

Run from the repository root (about 4 minutes on 2 cores with the defaults)::

    .venv/bin/python scripts/bench_convert.py
    .venv/bin/python scripts/bench_convert.py --workers 1,2,4 --repeats 3 \\
        --tokenizer ../shared/data/tokenizer-phi3-mini.json
    .venv/bin/python scripts/bench_convert.py --profile 1   # cProfile of convert, workers=1
"""

from __future__ import annotations

import argparse
import cProfile
import importlib.metadata
import json
import os
import pstats
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from flat_tokens_jax.convert.text import convert

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"  # beside the repository


def _cpu_seconds() -> float:
    """CPU time of this process and of its children that have ended (worker processes)."""
    own, children = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _encode_all(tok: Tokenizer, texts: list[str], method: str) -> tuple[float, float, int]:
    started, cpu = time.perf_counter(), _cpu_seconds()
    encodings = getattr(tok, method)(texts, add_special_tokens=False)
    seconds, cpu = time.perf_counter() - started, _cpu_seconds() - cpu
    return seconds, cpu, sum(len(e.ids) for e in encodings)


def _convert(args: argparse.Namespace, out: Path, workers: int) -> dict[str, Any]:
    return convert(
        [args.corpus],
        out,
        tokenizer=args.tokenizer,
        text_key=args.text_key,
        workers=workers,
        overwrite=True,
        progress=False,
    )


METHODS = ("encode_batch", "encode_batch_fast", "convert")
HEADER = (
    "| workers | tokens | encode_batch M tok/s | encode_batch_fast M tok/s | convert M tok/s "
    "| convert / encode_batch | convert / encode_batch_fast | CPU s: encode_batch_fast / convert |"
)


def _rounded(seconds: dict[str, list[float]]) -> dict[str, list[float]]:
    return {k: [round(x, 2) for x in v] for k, v in seconds.items()}


def _row(
    workers: int, tokens: int, seconds: dict[str, list[float]], cpu: dict[str, list[float]]
) -> str:
    """Best rates, the median of each repeat's ratio (runs side by side share the
    noise), and the least CPU seconds of encode_batch_fast and of convert."""
    best = {k: tokens / min(v) / 1e6 for k, v in seconds.items()}
    ratio = {
        k: statistics.median(b / c for b, c in zip(seconds[k], seconds["convert"], strict=True))
        for k in METHODS[:2]
    }
    rates = " | ".join(f"{best[m]:.3f}" for m in METHODS)
    ratios = " | ".join(f"{ratio[m]:.2f}" for m in METHODS[:2])
    used = f"{min(cpu['encode_batch_fast']):.1f} / {min(cpu['convert']):.1f}"
    return f"| {workers} | {tokens:,} | {rates} | {ratios} | {used} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--corpus", default=str(DATA / "corpus.jsonl"), help="a JSONL file")
    parser.add_argument("--tokenizer", default=str(DATA / "tokenizer-gpt2.json"))
    parser.add_argument("--text-key", default="text")
    parser.add_argument("--workers", default="1,2", help="comma-separated worker counts")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each, in turn")
    parser.add_argument("--profile", type=int, metavar="WORKERS", help="profile convert only")
    args = parser.parse_args()

    out = Path(tempfile.mkdtemp(prefix="bench-convert-")) / "ds"
    try:
        if args.profile is not None:
            profiler = cProfile.Profile()
            profiler.runcall(_convert, args, out, args.profile)
            pstats.Stats(profiler).sort_stats("cumulative").print_stats(25)
            pstats.Stats(profiler).sort_stats("tottime").print_stats(15)
            return
        with open(args.corpus, "rb") as f:
            texts = [json.loads(line)[args.text_key] for line in f if line.strip()]
        tok = Tokenizer.from_file(args.tokenizer)
        tok.no_truncation()
        tok.no_padding()
        print(
            f"{args.corpus}: {len(texts):,} texts, {sum(map(len, texts)) / 1e6:.1f}M characters; "
            f"{Path(args.tokenizer).name}; tokenizers "
            f"{importlib.metadata.version('tokenizers')}, {os.cpu_count()} CPUs, "
            f"{args.repeats} repeats",
            file=sys.stderr,
        )
        rows = []
        for workers in (int(w) for w in args.workers.split(",")):
            seconds: dict[str, list[float]] = {m: [] for m in METHODS}
            cpu: dict[str, list[float]] = {m: [] for m in METHODS}
            tokens = 0
            for _ in range(args.repeats):
                for method in METHODS[:2]:
                    took, used, tokens = _encode_all(tok, texts, method)
                    seconds[method].append(took)
                    cpu[method].append(used)
                used = _cpu_seconds()
                summary = _convert(args, out, workers)
                cpu["convert"].append(_cpu_seconds() - used)
                if summary["tokens"] != tokens:
                    raise SystemExit(f"convert wrote {summary['tokens']} tokens, not {tokens}")
                seconds["convert"].append(summary["seconds"])
                print(
                    f"workers {workers}: s {_rounded(seconds)} cpu {_rounded(cpu)}", file=sys.stderr
                )
            rows.append(_row(workers, tokens, seconds, cpu))
        print(HEADER)
        print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        print("\n".join(rows))
    finally:
        shutil.rmtree(out.parent, ignore_errors=True)


if __name__ == "__main__":
    main()
