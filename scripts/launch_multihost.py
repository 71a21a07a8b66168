"""Multi-host example and benchmark: N local jax.distributed processes on CPU.

Starts N processes (gloo collectives, coordinator on 127.0.0.1), each with
``--devices`` CPU devices. Every process builds the same global batches through
``ftj.Loader(..., sharding=NamedSharding(mesh, P("data")))``, prints the rows it
loaded and a checksum of the global batch (a jitted sum: a real collective),
and its tokens/s and bytes read. Trains nothing.

Run:
    python scripts/launch_multihost.py DATASET --processes 2
    python scripts/launch_multihost.py DATASET --bench 1,2,4   # table for the README
(DATASET: a flat-tokens dataset, e.g. one written by scripts/quickstart.py.)
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time


def worker(args: argparse.Namespace) -> None:
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"
    import jax
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{args.port}",
        num_processes=args.processes,
        process_id=args.worker,
    )
    import flat_tokens_jax as ftj

    ft = ftj.open_dataset(args.dataset)["train"]
    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    cfg = ftj.LoaderConfig(batch_size=args.batch_size, seq_len=args.seq_len, prefetch=0)
    loader = ftj.Loader(ft, cfg, sharding=NamedSharding(mesh, P("data")))
    checksum = jax.jit(lambda x: x.astype(np.uint32).sum(dtype=np.uint32))
    for step in range(2):
        total = int(checksum(loader.batch(step)["targets"]))
        print(
            f"process {args.worker}: step {step} rows {loader.host_rows.min()}.."
            f"{loader.host_rows.max()} ({loader.host_rows.size} rows), "
            f"global targets checksum {total}",
            flush=True,
        )
    multihost_utils.sync_global_devices("timed")
    before, began = ft.bytes_read, time.perf_counter()
    for step in range(2, 2 + args.steps):
        for v in loader.batch(step).values():
            v.block_until_ready()
    took = time.perf_counter() - began
    tokens = loader.host_rows.size * args.seq_len * args.steps
    print(
        "RESULT "
        + json.dumps(
            {
                "process": args.worker,
                "tokens_per_s": tokens / took,
                "bytes_read_per_step": (ft.bytes_read - before) / args.steps,
            }
        ),
        flush=True,
    )
    jax.distributed.shutdown()


def launch(args: argparse.Namespace, processes: int) -> list[dict[str, float]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    common = [
        sys.executable,
        __file__,
        args.dataset,
        "--processes",
        str(processes),
        "--port",
        str(port),
        "--devices",
        str(args.devices),
        "--steps",
        str(args.steps),
        "--batch-size",
        str(args.batch_size),
        "--seq-len",
        str(args.seq_len),
    ]
    procs = [
        subprocess.Popen([*common, "--worker", str(i)], stdout=subprocess.PIPE, text=True)
        for i in range(processes)
    ]
    results = []
    for p in procs:
        out, _ = p.communicate(timeout=600)
        for line in out.splitlines():
            if line.startswith("RESULT "):
                results.append(json.loads(line[7:]))
            else:
                print(line)
        if p.returncode:
            raise SystemExit(f"a worker failed with exit status {p.returncode}")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("dataset")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--devices", type=int, default=2, help="CPU devices per process")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=20, help="timed steps")
    parser.add_argument("--bench", help="comma-separated process counts, e.g. 1,2,4")
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker(args)
        return
    counts = [int(c) for c in args.bench.split(",")] if args.bench else [args.processes]
    table = []
    for n in counts:
        for r in sorted(launch(args, n), key=lambda r: r["process"]):
            table.append((n, r["process"], r["tokens_per_s"], r["bytes_read_per_step"]))
    full = args.batch_size * (args.seq_len + 1) * 4
    print(
        f"\nglobal batch {args.batch_size} x {args.seq_len}, {args.devices} CPU devices per "
        f"process, {args.steps} timed steps, {os.cpu_count()} cores shared by all processes\n"
    )
    print("| processes | process | host tokens/s (M) | bytes read per step | of global batch |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for n, pid, rate, read in table:
        print(f"| {n} | {pid} | {rate / 1e6:.1f} | {read:,.0f} | {read / full:.2f} |")


if __name__ == "__main__":
    main()
