"""Measured: balanced rows (``LoaderConfig.balance_groups``) on long-context batches.

Writes a store of documents with lognormal lengths (mean ``--mean`` tokens,
sigma 1, the distribution of issue 48), then for each ``seq_len`` of
``--seq-lens``, each group count ``G`` of ``--groups`` (a batch of ``8 * G``
rows: eight rows a data-parallel group) and each packing (packed windows,
bins), over ``--steps`` steps:

* **imbalance**: the costliest group's attention cost over the mean group's
  (a row's cost: the sum of its segments' squared lengths, counted from the
  batch's decoded ``segment_ids``, not from the loader's own costs), the mean
  over the steps and the worst step, in the rows' plain order and balanced;
* **added host time**: ``Loader.host_batch(step)`` with balancing less without,
  the two loaders taking each step in turn (which goes first alternating) in
  one process after a warm-up step (steady state), the median of the steps'
  differences, and as a share of the plain ``host_batch``'s median.

Then, for each ``seq_len``, **bytes read per host**: ``--hosts`` real
``jax.distributed`` processes (gloo, 2 CPU devices each) on a ``(context,
data)`` mesh whose context axis runs across them, ``context_parallel`` the
host count, one step of ``--bytes-batch`` rows: the encoded-token and
``seq_starts`` bytes each host read with the sequence sharded
(``P("data", "context")``: its chunks) and with rows only (``P("data")``:
each host reads whole rows, as a loader that slices after loading does).

Run: ``python -u scripts/bench_longctx.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import flat_tokens_jax as ftj


def write_store(path: Path, tokens: int, mean: float, seed: int) -> ftj.FlatTokens:
    rng = np.random.default_rng(seed)
    lengths = np.maximum(1, rng.lognormal(np.log(mean) - 0.5, 1.0, int(3 * tokens / mean)))
    lengths = lengths.astype(np.int64)
    lengths = lengths[: int(np.searchsorted(np.cumsum(lengths), tokens)) + 1]
    with ftj.DatasetWriter(path) as writer:
        writer.extend("train", (rng.integers(1, 50_000, n, dtype=np.int32) for n in lengths))
    return ftj.open_dataset(path)["train"]


def group_costs(segment_ids: np.ndarray, groups: int) -> np.ndarray:
    """Each group's summed cost: the squared lengths of the runs of one nonzero id."""
    rows, width = segment_ids.shape
    edge = np.ones((rows, width + 1), bool)
    edge[:, 1:-1] = segment_ids[:, 1:] != segment_ids[:, :-1]
    r, c = np.nonzero(edge)
    runs = np.diff(c)[r[1:] == r[:-1]]
    row = r[1:][r[1:] == r[:-1]]
    first = c[:-1][r[1:] == r[:-1]]
    real = segment_ids[row, first] != 0
    costs = np.zeros(rows, np.int64)
    np.add.at(costs, row[real], runs[real].astype(np.int64) ** 2)
    return costs.reshape(groups, -1).sum(axis=1)


def measure(ft: ftj.FlatTokens, seq_len: int, groups: int, packing: object, steps: int) -> dict:
    base = {"batch_size": 8 * groups, "seq_len": seq_len, "packing": packing, "seed": 1}
    plain = ftj.Loader(ft, ftj.LoaderConfig(**base))
    balanced = ftj.Loader(ft, ftj.LoaderConfig(**base, balance_groups=groups))
    plain.host_batch(0)
    balanced.host_batch(0)
    ratios: dict[str, list[float]] = {"plain": [], "balanced": []}
    times: dict[str, list[float]] = {"plain": [], "balanced": []}
    pair = (("plain", plain), ("balanced", balanced))
    for step in range(1, steps + 1):
        for name, loader in pair if step % 2 else pair[::-1]:
            began = time.perf_counter()
            batch = loader.host_batch(step)
            times[name].append(time.perf_counter() - began)
            loads = group_costs(batch["segment_ids"], groups)
            ratios[name].append(float(loads.max() / loads.mean()))
    plain_s = statistics.median(times["plain"])
    added = statistics.median(b - a for a, b in zip(times["plain"], times["balanced"], strict=True))
    return {
        "before": (statistics.mean(ratios["plain"]), max(ratios["plain"])),
        "after": (statistics.mean(ratios["balanced"]), max(ratios["balanced"])),
        "plain_ms": 1e3 * plain_s,
        "added_ms": 1e3 * added,
    }


def host_bytes(args: argparse.Namespace) -> None:
    """A worker process: this host's bytes of one step under both shardings."""
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{args.port}", args.hosts, args.worker)
    ft = ftj.open_dataset(args.store)["train"]
    mesh = jax.make_mesh((args.hosts, 2), ("context", "data"))
    out = []
    for seq_len in args.seq_lens:
        row = {"seq_len": seq_len}
        for name, spec in (("chunks", P("data", "context")), ("rows", P("data"))):
            config = ftj.LoaderConfig(
                batch_size=args.bytes_batch,
                seq_len=seq_len,
                prefetch=0,
                context_parallel=args.hosts,
            )
            loader = ftj.Loader(ft, config, sharding=NamedSharding(mesh, spec))
            before = {k: c.data_bytes for k, c in ft.checked.items()}
            jax.block_until_ready(loader.batch(1))
            row[name] = {k: c.data_bytes - before[k] for k, c in ft.checked.items()}
        out.append(row)
    print("RESULT " + json.dumps({"host": args.worker, "rows": out}), flush=True)
    jax.distributed.shutdown()


def bytes_table(args: argparse.Namespace, store: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    common = [sys.executable, __file__, "--store", str(store), "--port", str(port)]
    common += ["--hosts", str(args.hosts), "--bytes-batch", str(args.bytes_batch)]
    common += ["--seq-lens", *map(str, args.seq_lens)]
    procs = [
        subprocess.Popen([*common, "--worker", str(i)], stdout=subprocess.PIPE, text=True)
        for i in range(args.hosts)
    ]
    results = []
    for p in procs:
        text, _ = p.communicate(timeout=1800)
        if p.returncode:
            raise SystemExit(f"a worker failed with exit status {p.returncode}:\n{text}")
        results += [json.loads(ln[7:]) for ln in text.splitlines() if ln.startswith("RESULT ")]
    print()
    print(
        f"bytes read per host, one step of {args.bytes_batch} rows, {args.hosts} hosts on the "
        f"context axis (context_parallel={args.hosts}); the largest host's:"
    )
    print()
    print(
        "| seq_len | tokens, sequence sharded | seq_starts, sequence sharded "
        "| tokens, whole rows | whole rows / sequence sharded |"
    )
    print("| ---: | ---: | ---: | ---: | ---: |")
    tokens, starts = "encoded_tokens", "seq_starts"
    for i, seq_len in enumerate(args.seq_lens):
        rows = [r["rows"][i] for r in results]
        chunk_tokens = max(r["chunks"][tokens] for r in rows)
        chunk_starts = max(r["chunks"][starts] for r in rows)
        whole = max(r["rows"][tokens] for r in rows)
        print(
            f"| {seq_len:,} | {chunk_tokens / 1e6:.3f} MB | {chunk_starts / 1e3:.1f} kB "
            f"| {whole / 1e6:.3f} MB | {whole / (chunk_tokens + chunk_starts):.2f}x |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[8192, 32768, 131072])
    parser.add_argument("--groups", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--mean", type=float, default=3000.0)
    parser.add_argument("--tokens", type=int, default=48_000_000)
    parser.add_argument("--hosts", type=int, default=4, help="processes for the bytes table")
    parser.add_argument("--bytes-batch", type=int, default=8, help="rows of the bytes table")
    parser.add_argument("--store", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        host_bytes(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        began = time.perf_counter()
        ft = write_store(Path(tmp) / "ds", args.tokens, args.mean, seed=0)
        print(
            f"{ft.num_tokens:,} tokens in {ft.num_sequences:,} documents (lognormal, mean "
            f"{args.mean:,.0f}, sigma 1), written in {time.perf_counter() - began:.1f} s; "
            f"{args.steps} steps after a warm-up step, batch 8 x G rows"
        )
        print()
        print(
            "| seq_len | G | batch | packing | max/mean before (mean, worst) "
            "| max/mean balanced (mean, worst) | host_batch | added by balancing |"
        )
        print("| ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: |")
        for seq_len in args.seq_lens:
            for groups in args.groups:
                for packing in (True, "bins"):
                    m = measure(ft, seq_len, groups, packing, args.steps)
                    name = "windows" if packing is True else "bins"
                    b, a = m["before"], m["after"]
                    print(
                        f"| {seq_len:,} | {groups} | {8 * groups} | {name} "
                        f"| {b[0]:.3f}, {b[1]:.3f} | {a[0]:.3f}, {a[1]:.3f} "
                        f"| {m['plain_ms']:.1f} ms | {m['added_ms']:+.1f} ms "
                        f"({100 * m['added_ms'] / m['plain_ms']:+.1f} %) |",
                        flush=True,
                    )
        bytes_table(args, Path(tmp) / "ds")


if __name__ == "__main__":
    main()
