"""Benchmark: reading from an object store with per-request latency, hidden by prefetch.

Starts fake-gcs-server (``--server gcs``, default) or moto's S3 server
(``--server s3``) on 127.0.0.1 behind a proxy that can delay every request,
writes a dataset through it, then measures in one run:

* steady-state ``iterate()`` steps/s with no delay and with the delay;
* a training loop taking ``--step-time`` seconds per step over the delayed
  store: how long each step waited for its batch (``loader.wait_seconds``).

Both runs go through the proxy (delay 0, then ``--delay``), so they differ only
in the delay. Run: ``python scripts/bench_remote.py [--server gcs|s3] [--delay 0.02]
[--step-time 0.05] [--prefetch 8]`` (needs the test extras).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import flat_tokens_jax as ftj

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from servers import DelayProxy, aws_profile, fake_gcs, moto_s3


def steady_rate(ft: ftj.FlatTokens, cfg: ftj.LoaderConfig, warmup: int, steps: int) -> float:
    it = ftj.Loader(ft, cfg).iterate(0)
    for step, _ in it:
        if step == warmup:
            began = time.perf_counter()
        if step == warmup + steps:
            break
    it.close()
    return steps / (time.perf_counter() - began)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--server", choices=["gcs", "s3"], default="gcs")
    parser.add_argument("--delay", type=float, default=0.02, help="seconds per request")
    parser.add_argument("--step-time", type=float, default=0.05, help="simulated train step")
    parser.add_argument("--prefetch", type=int, default=8)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--tokens", type=int, default=8_000_000)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    lengths = rng.integers(100, 3000, args.tokens // 1500)
    seqs = [rng.integers(0, 50_000, n) for n in lengths]
    cfg = ftj.LoaderConfig(batch_size=args.batch, seq_len=args.seq_len, prefetch=args.prefetch)
    server = fake_gcs() if args.server == "gcs" else moto_s3()
    with server as base, tempfile.TemporaryDirectory() as tmp:
        proxy = DelayProxy(int(base.rsplit(":", 1)[1]), 0.0)
        through = f"http://127.0.0.1:{proxy.port}"
        if args.server == "gcs":
            os.environ["TENSORSTORE_GCS_HTTP_URL"] = through
            os.environ["GOOGLE_AUTH_TOKEN_FOR_TESTING"] = "benchmark"
            url, options = "gs://bucket/ds", ftj.StoreOptions()
        else:
            url, options = (
                "s3://bucket/ds",
                ftj.StoreOptions(
                    endpoint=through, region="us-east-1", credentials=aws_profile(Path(tmp))
                ),
            )
        with contextlib.closing(proxy):
            ftj.write_dataset(url, {"train": seqs}, options=options)
            ft = ftj.open_dataset(url, options)["train"]
            fast = steady_rate(ft, cfg, 5, args.steps)
            proxy.delay = args.delay
            slow = steady_rate(ft, cfg, 5, args.steps)
            loader = ftj.Loader(ft, cfg)
            waits = []
            for step, _ in loader.iterate(0):
                waits.append(loader.wait_seconds)
                time.sleep(args.step_time)
                if step == args.steps:
                    break
    tokens = args.batch * args.seq_len
    name = "fake-gcs-server" if args.server == "gcs" else "moto S3"
    print(
        f"\n{name} on 127.0.0.1, batch {args.batch} x {args.seq_len}, prefetch "
        f"{args.prefetch}, {args.steps} steady-state steps after 5 warm-up steps\n"
    )
    print("| store | steps/s | M tokens/s | vs no delay |")
    print("| --- | ---: | ---: | ---: |")
    print(f"| no delay | {fast:.1f} | {fast * tokens / 1e6:.2f} | 1.00 |")
    print(
        f"| +{args.delay * 1e3:.0f} ms per request | {slow:.1f} | {slow * tokens / 1e6:.2f} | "
        f"{slow / fast:.2f} |"
    )
    later = np.array(waits[1:]) * 1e3
    print(
        f"\ntraining loop of {args.step_time * 1e3:.0f} ms per step over the delayed store: "
        f"first step waited {waits[0] * 1e3:.1f} ms; later steps waited max "
        f"{later.max():.2f} ms, mean {later.mean():.2f} ms, "
        f"{int((later > 1).sum())} of {later.size} over 1 ms"
    )


if __name__ == "__main__":
    main()
