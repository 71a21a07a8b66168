"""Multi-host example and benchmark: N local jax.distributed processes on CPU.

Starts N processes (gloo collectives, coordinator on 127.0.0.1), each with
``--devices`` CPU devices. Every process builds the same global batches through
``ftj.Loader(..., sharding=NamedSharding(mesh, P("data")))``, prints the rows it
loaded and a checksum of the global batch (a jitted sum: a real collective),
and its tokens/s and bytes read. Trains nothing.

Run:
    python scripts/launch_multihost.py DATASET --processes 2
    python scripts/launch_multihost.py DATASET --bench 1,2,4   # table in docs/benchmarks.md
(DATASET: a flat-tokens dataset, e.g. one written by scripts/quickstart.py; a
gs:// or s3:// URL takes the store flags of every command, ``--endpoint`` etc.)

Through an object store with latency:
    python scripts/launch_multihost.py DATASET --serve s3 --delay 0.1 --prefetch 8 --bench 4
copies DATASET's train split to a fresh moto S3 (or ``--serve gcs``:
fake-gcs-server) on 127.0.0.1 behind the proxy of ``tests/proxies.py``, which
holds each request ``--delay`` seconds (and caps the bandwidth at ``--rate``
MB/s), runs the processes on that copy and prints what the proxy saw.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any


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
    from flat_tokens_jax.convert.commands import store_options

    ft = ftj.open_dataset(args.dataset, store_options(args))["train"]
    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    cfg = ftj.LoaderConfig(batch_size=args.batch_size, seq_len=args.seq_len, prefetch=args.prefetch)
    sharding = NamedSharding(mesh, P("data"))
    loader = ftj.Loader(ft, cfg, sharding=sharding)
    # One step's bytes, read alone: reads ahead would blur a count over the timed steps.
    alone = ftj.Loader(ft, dataclasses.replace(cfg, prefetch=0), sharding=sharding)
    before = ft.bytes_read
    alone.host_batch(0)
    step_bytes = ft.bytes_read - before
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
    began = time.perf_counter()
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
                "bytes_read_per_step": step_bytes,
            }
        ),
        flush=True,
    )
    jax.distributed.shutdown()


def store_flags(args: argparse.Namespace) -> list[str]:
    """The store flags of ``args``, for the workers' command lines."""
    flags = []
    for name in ("endpoint", "region", "credentials", "concurrency", "timeout"):
        value = getattr(args, name)
        if value is not None:
            flags += [f"--{name}", str(value)]
    retries = ["--retries", str(args.retries), "--retry-delay", str(args.retry_delay)]
    return [*flags, *retries, "--max-retry-delay", str(args.max_retry_delay)]


@contextlib.contextmanager
def serve(args: argparse.Namespace) -> Iterator[Any]:
    """Copies ``args.dataset``'s train split to a fresh server of ``args.serve``
    behind a :class:`DelayProxy`; points ``args`` (dataset, store flags) and the
    environment the workers inherit at it; yields the proxy."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from proxies import DelayProxy
    from servers import fake_gcs, moto_s3

    import flat_tokens_jax as ftj

    source = ftj.open_dataset(args.dataset)["train"]
    server = fake_gcs() if args.serve == "gcs" else moto_s3()
    with server as base:
        proxy = DelayProxy(int(base.rsplit(":", 1)[1]))
        through = f"http://127.0.0.1:{proxy.port}"
        if args.serve == "gcs":
            os.environ["TENSORSTORE_GCS_HTTP_URL"] = through
            os.environ["GOOGLE_AUTH_TOKEN_FOR_TESTING"] = "benchmark"
            args.dataset = "gs://bucket/ds"
        else:
            os.environ["AWS_ACCESS_KEY_ID"] = os.environ["AWS_SECRET_ACCESS_KEY"] = "testing"
            args.endpoint, args.region, args.credentials = through, "us-east-1", "environment"
            args.dataset = "s3://bucket/ds"
        from flat_tokens_jax.convert.commands import store_options

        with contextlib.closing(proxy):
            with ftj.DatasetWriter(args.dataset, options=store_options(args)) as writer:
                block = 4096
                for lo in range(0, source.num_sequences, block):
                    hi = min(lo + block, source.num_sequences)
                    writer.extend("train", source.sequences(list(range(lo, hi))))
            proxy.delay = args.delay
            proxy.rate = None if args.rate is None else args.rate * 1e6
            yield proxy


def launch(args: argparse.Namespace, processes: int) -> list[dict[str, float]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    common = [
        sys.executable,
        __file__,
        args.dataset,
        *store_flags(args),
        "--prefetch",
        str(args.prefetch),
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
    parser.add_argument("--prefetch", type=int, default=0, help="LoaderConfig.prefetch")
    parser.add_argument(
        "--serve", choices=["gcs", "s3"], help="copy DATASET to this server behind a proxy"
    )
    parser.add_argument("--delay", type=float, default=0.1, help="--serve: seconds per request")
    parser.add_argument("--rate", type=float, help="--serve: MB/s cap of the answers")
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    from flat_tokens_jax.convert.commands import add_store_flags

    add_store_flags(parser)
    args = parser.parse_args()
    if args.worker is not None:
        worker(args)
        return
    counts = [int(c) for c in args.bench.split(",")] if args.bench else [args.processes]
    table = []
    with serve(args) if args.serve else contextlib.nullcontext() as proxy:
        for n in counts:
            if proxy is not None:
                proxy.reset()
            for r in sorted(launch(args, n), key=lambda r: r["process"]):
                table.append((n, r["process"], r["tokens_per_s"], r["bytes_read_per_step"]))
            if proxy is not None:
                print(
                    f"{n} processes through the proxy (+{args.delay * 1e3:.0f} ms per request): "
                    f"{proxy.count()} requests, at most {proxy.max_in_flight} in flight, "
                    f"{proxy.downloaded / 1e6:.1f} MB answered"
                )
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
