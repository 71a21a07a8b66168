"""The importers' rates and memory, each in a fresh process, beside ``import-megatron``.

The same documents (random ids below 50,000 in documents of 1 to 4,000 tokens,
``uint16``) are written once in each format, as each tool writes them: Megatron's
``.bin/.idx`` (by ``export-megatron``), datatrove's ``.ds`` files (datatrove's own
``TokenizedFile``, four files, with a loss file), dolma's ``.npy`` and ``.csv.gz``
(four files) and a Levanter cache (tensorstore, as ``JaggedArrayStore`` writes it).
Each import then runs ``--repeats`` times in its own interpreter, the formats
alternating so that a change in the machine's load touches them all alike, at
corpus sizes of ``--tokens`` times each of ``--scales``. The table gives the median
seconds inside the import call, its tokens/s and their ratio to ``import-megatron``
in the same round (a cold process: the first import of the process), and the
process's peak resident memory (``VmHWM``; Megatron's counts the pages of the
``.bin`` it maps) at each size. The first row, ``writer``, is ``DatasetWriter``
alone writing as many tokens from memory, a million a call: what any import costs
once its input is read.

Run from the repository root (the test extra installed; about 3 minutes on 2 cores,
5 GB of temporary files)::

    .venv/bin/python scripts/bench_importers.py
"""

from __future__ import annotations

import argparse
import csv
import gzip
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import tensorstore as ts

import flat_tokens_jax as ftj
from flat_tokens_jax.convert.megatron import export_megatron

FORMATS = ("writer", "megatron", "datatrove", "dolma", "levanter")
FILES = 4  # files of the datatrove and dolma corpora

# Run in a fresh interpreter: one import, then its seconds and the peak memory (Linux).
CHILD = textwrap.dedent(
    """
    import json, sys, time
    import numpy as np
    from flat_tokens_jax.convert.corpora import import_datatrove, import_dolma, import_levanter
    from flat_tokens_jax.convert.megatron import import_megatron
    from flat_tokens_jax.core.format import encode_concatenated
    from flat_tokens_jax.data.writer import DatasetWriter
    kind, source, out = sys.argv[1:4]
    inputs = json.loads(source)
    began = time.perf_counter()
    if kind == "writer":  # the same number of tokens from memory, 1M a call
        lengths = np.full(512, 2048)
        chunk = encode_concatenated(np.arange(1 << 20) % 50_000, np.cumsum(lengths) - lengths)
        with DatasetWriter(out, overwrite=True, splits=["train"]) as w:
            for _ in range(inputs[0] >> 20):
                w.extend_encoded("train", chunk, lengths)
        done = {"tokens": (inputs[0] >> 20) << 20}
    elif kind == "megatron":
        done = import_megatron(inputs, out, overwrite=True)
    elif kind == "datatrove":
        done = import_datatrove(inputs, out, overwrite=True)
    elif kind == "dolma":
        done = import_dolma(inputs, out, dtype="uint16", overwrite=True)
    else:
        done = import_levanter(inputs[0], out, overwrite=True)
    seconds = time.perf_counter() - began
    # VmHWM: this process's own peak (ru_maxrss would carry the parent's across exec).
    status = open("/proc/self/status").read().split("VmHWM:")[1]
    peak = int(status.split()[0]) * 1024
    print(json.dumps({"seconds": seconds, "tokens": done["tokens"], "peak": peak}))
    """
)


def documents(tokens: int, seed: int) -> list[np.ndarray]:
    """Documents of 1 to 4,000 ids below 50,000, ``tokens`` ids in all."""
    rng = np.random.default_rng(seed)
    out, total = [], 0
    while total < tokens:
        n = min(int(rng.integers(1, 4001)), tokens - total)
        out.append(rng.integers(0, 50_000, n, dtype=np.uint16))
        total += n
    return out


def write_corpora(folder: Path, docs: list[np.ndarray]) -> dict[str, list[Any]]:
    """The documents in each format under ``folder``: each format's inputs."""
    from datatrove.pipeline.tokens.tokenizer import TokenizedFile

    store = folder / "store"
    ftj.write_dataset(store, {"train": docs}, overwrite=True)
    export_megatron(store, folder / "megatron", dtype_code=8)
    shards = np.array_split(np.arange(len(docs)), FILES)
    (folder / "datatrove").mkdir()
    rng = np.random.default_rng(1)
    for k, part in enumerate(shards):
        out = TokenizedFile(
            str(folder / "datatrove"),
            f"{k:03d}.ds",
            save_loss_metadata=True,
            tokenizer_name_or_path="gpt2",
            save_final_metadata=True,
            token_size=2,
        )
        for i in part.tolist():
            out.write(docs[i].tolist(), rng.integers(0, 2, docs[i].size).astype(bool))
        out.close()
        base = folder / f"dolma-{k}"
        np.concatenate([docs[i] for i in part]).astype("<u2").tofile(base.with_suffix(".npy"))
        with gzip.open(base.with_suffix(".csv.gz"), "wt") as f:
            rows, at = csv.writer(f), 0
            for i in part.tolist():
                rows.writerow((at, at + docs[i].size, f"doc-{i}", "src.json.gz", i))
                at += docs[i].size
    write_levanter(folder / "levanter", docs)
    return {
        "writer": [sum(d.size for d in docs)],
        "megatron": [str(folder / "megatron")],
        "datatrove": [str(folder / "datatrove")],
        "dolma": [str(folder / f"dolma-{k}.npy") for k in range(FILES)],
        "levanter": [str(folder / "levanter")],
    }


def write_levanter(folder: Path, docs: list[np.ndarray]) -> None:
    """``input_ids/{offsets,data}`` and the ledger, as Levanter's ``JaggedArrayStore``."""

    def array(name: str, dtype: str) -> Any:
        chunk = {"name": "regular", "configuration": {"chunk_shape": [256 * 1024 * 512]}}
        inner = {"chunk_shape": [256 * 1024], "codecs": [{"name": "blosc"}]}
        codecs = [{"name": "sharding_indexed", "configuration": inner}]
        spec = {
            "driver": "zarr3",
            "kvstore": {"driver": "file", "path": str(folder / "input_ids" / name)},
            "metadata": {"chunk_grid": chunk, "codecs": codecs},
        }
        return ts.open(spec, dtype=dtype, shape=[2**54], create=True).result()

    offsets, data = array("offsets", "int64"), array("data", "int32")
    lengths = np.array([d.size for d in docs], np.int64)
    data[: int(lengths.sum())].write(np.concatenate(docs).astype(np.int32)).result()
    offsets[1 : len(docs) + 1].write(np.cumsum(lengths)).result()
    offsets[0].write(len(docs)).result()
    ledger = {
        "total_num_rows": len(docs),
        "shard_rows": {"": len(docs)},
        "is_finished": True,
        "finished_shards": [""],
        "field_counts": {},
        "metadata": {},
    }
    (folder / "shard_ledger.json").write_text(json.dumps(ledger))


def run(kind: str, inputs: list[Any], out: Path) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-c", CHILD, kind, json.dumps(inputs), str(out)],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=20_000_000, help="the smallest corpus")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--scales", default="1,4,12", help="corpus sizes, times --tokens")
    args = parser.parse_args()
    sizes = tuple(args.tokens * int(k) for k in args.scales.split(","))
    found: dict[tuple[str, int], list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        corpora = {}
        for size in sizes:
            folder = Path(tmp) / str(size)
            folder.mkdir()
            corpora[size] = write_corpora(folder, documents(size, seed=size))
        for r in range(args.repeats):
            for size in sizes:
                order = FORMATS if r % 2 == 0 else FORMATS[::-1]
                for kind in order:
                    out = Path(tmp) / "out"
                    found.setdefault((kind, size), []).append(run(kind, corpora[size][kind], out))
                    shutil.rmtree(out)
    print("| format | tokens | seconds | M tokens/s | / megatron | peak RSS MiB |")
    print("| --- | --- | --- | --- | --- | --- |")
    for size in sizes:
        base = found[("megatron", size)]
        for kind in FORMATS:
            runs = found[(kind, size)]
            ratio = statistics.median(
                (r["tokens"] / r["seconds"]) / (b["tokens"] / b["seconds"])
                for r, b in zip(runs, base, strict=True)
            )
            seconds = statistics.median(r["seconds"] for r in runs)
            peak = statistics.median(r["peak"] for r in runs) / 2**20
            rate = runs[0]["tokens"] / seconds / 1e6
            print(
                f"| {kind} | {runs[0]['tokens']:,} | {seconds:.2f} | {rate:.1f} | "
                f"{ratio:.2f} | {peak:.0f} |"
            )


if __name__ == "__main__":
    main()
