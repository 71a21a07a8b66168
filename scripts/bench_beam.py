"""Benchmark the Beam conversion against the local converter on the same files.

Splits the corpus into ``--files`` JSONL files (contiguous runs of lines: a
Beam conversion works file by file), then, ``--repeats`` times in turn,
converts them with ``convert(workers=N)`` and with ``convert_beam`` on Beam's
FnApiRunner in N worker processes (``--direct_running_mode=multi_processing``),
checking each time that the two outputs are the same, byte for byte. Prints a
Markdown table of the best rates and of Beam's over the local converter's (the
median over repeats of the ratio within a repeat: runs side by side share the
machine's noise), then an estimate for a larger corpus on Dataflow, from the
measured rate per core and the corpus's bytes per token.

Run from the repository root (about 2 minutes on 2 cores with the defaults)::

    .venv/bin/python scripts/bench_beam.py
    .venv/bin/python scripts/bench_beam.py --workers 2 --files 32 --repeats 3
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from flat_tokens_jax.convert.beam import convert_beam
from flat_tokens_jax.convert.text import convert

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"  # beside the repository


def _split(corpus: Path, folder: Path, files: int) -> int:
    """Writes ``corpus``'s lines to ``files`` files of contiguous lines; returns its text bytes."""
    lines = corpus.read_bytes().splitlines(keepends=True)
    per = -(-len(lines) // files)
    for i in range(files):
        (folder / f"part-{i:05d}.jsonl").write_bytes(b"".join(lines[i * per : (i + 1) * per]))
    return sum(len(json.loads(line)["text"].encode()) for line in lines if line.strip())


def _tree(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--corpus", default=str(DATA / "corpus.jsonl"), help="a JSONL file")
    parser.add_argument("--tokenizer", default=str(DATA / "tokenizer-gpt2.json"))
    parser.add_argument("--files", type=int, default=16, help="input files to split it into")
    parser.add_argument("--workers", type=int, default=2, help="processes, in both converters")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each, in turn")
    parser.add_argument("--estimate-tb", type=float, default=1.0, help="corpus size to estimate")
    parser.add_argument("--vcpus", type=int, default=4, help="vCPUs per Dataflow worker")
    args = parser.parse_args()

    scratch = Path(tempfile.mkdtemp(prefix="bench-beam-"))
    try:
        inputs = scratch / "inputs"
        inputs.mkdir()
        text_bytes = _split(Path(args.corpus), inputs, args.files)
        pattern = str(inputs / "*.jsonl")
        print(
            f"{args.corpus}: {text_bytes / 1e6:.1f} MB of text in {args.files} files; "
            f"{Path(args.tokenizer).name}; "
            f"apache-beam {importlib.metadata.version('apache-beam')}, "
            f"{os.cpu_count()} CPUs, {args.workers} workers, {args.repeats} repeats",
            file=sys.stderr,
        )
        beam_args = [
            "--runner=FnApiRunner",
            "--direct_running_mode=multi_processing",
            f"--direct_num_workers={args.workers}",
        ]
        seconds: dict[str, list[float]] = {"local": [], "beam": []}
        tokens = 0
        for _ in range(args.repeats):
            local = convert(
                pattern,
                scratch / "local",
                tokenizer=args.tokenizer,
                workers=args.workers,
                overwrite=True,
                progress=False,
            )
            started = time.perf_counter()
            beam = convert_beam(
                pattern,
                scratch / "beam",
                tokenizer=args.tokenizer,
                overwrite=True,
                pipeline_args=beam_args,
            )
            seconds["beam"].append(time.perf_counter() - started)
            seconds["local"].append(local["seconds"])
            tokens = local["tokens"]
            if beam["tokens"] != tokens or _tree(scratch / "beam") != _tree(scratch / "local"):
                raise SystemExit("the Beam output differs from the local converter's")
            print(
                f"seconds { ({k: [round(x, 2) for x in v] for k, v in seconds.items()}) }",
                file=sys.stderr,
            )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    best = {k: tokens / min(v) for k, v in seconds.items()}
    pairs = zip(seconds["local"], seconds["beam"], strict=True)
    ratio = statistics.median(local_s / beam_s for local_s, beam_s in pairs)
    print("| converter | workers | tokens | best s | M tok/s | rate / local's |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, label in (("local", "`convert`"), ("beam", "`convert_beam`, FnApiRunner")):
        rel = "1.00" if name == "local" else f"{ratio:.2f}"
        print(
            f"| {label} | {args.workers} | {tokens:,} | {min(seconds[name]):.1f} | "
            f"{best[name] / 1e6:.3f} | {rel} |"
        )
    # What one core did, startup and assembly included: the Dataflow estimate's unit.
    per_core = best["beam"] / args.workers
    bytes_per_token = text_bytes / tokens
    total = args.estimate_tb * 1e12 / bytes_per_token
    core_hours = total / per_core / 3600
    print(
        f"\nEstimate for {args.estimate_tb:g} TB of text: {bytes_per_token:.2f} bytes/token gives "
        f"{total / 1e9:,.0f}B tokens; at {per_core / 1e3:,.0f}k tokens/s per core, "
        f"{core_hours:,.0f} core-hours."
    )
    print(f"\n| Dataflow workers ({args.vcpus} vCPUs) | cores | hours |")
    print("| ---: | ---: | ---: |")
    for n in (16, 64, 256):
        print(f"| {n} | {n * args.vcpus} | {core_hours / (n * args.vcpus):.1f} |")


if __name__ == "__main__":
    main()
