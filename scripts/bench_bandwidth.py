"""Benchmark: the loader's read rate against a bandwidth cap at the object store.

Starts fake-gcs-server (``--server gcs``, default) or moto's S3 server
(``--server s3``) on 127.0.0.1 behind the proxy of ``tests/servers.py``, writes
a dataset through it, then, with the proxy's answers capped at each
``--rates`` MB/s (shared by all connections) and every request held
``--delay`` seconds, runs ``Loader.iterate`` with the default ``LoaderConfig``
(only the batch shape given; ``--prefetch`` pins the depth) on a freshly
opened dataset and prints:

* the bytes the proxy answered per second over the timed steps, against the
  cap: the share of the link the loader keeps busy (the issue asks >= 90%);
* the token bytes the batches needed per second (``FlatTokens.bytes_read``;
  a row reads whole chunks, so the link carries more than this);
* the same run with no cap: what this machine does at all (when it is below
  a cap, the cap does not bound the loader here).

Run: ``python scripts/bench_bandwidth.py [--server gcs|s3] [--rates 50]``
(needs the test extras).
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


def measure(
    url: str,
    options: ftj.StoreOptions,
    proxy: DelayProxy,
    cfg: ftj.LoaderConfig,
    warmup: int,
    steps: int,
) -> tuple[float, float, int]:
    """MB/s the proxy answered and MB/s of token bytes over ``steps`` steps
    after ``warmup``, and the most requests in flight."""
    ft = ftj.open_dataset(url, options)["train"]
    loader = ftj.Loader(ft, cfg)
    it = loader.iterate(0)
    for step, _ in it:
        if step == warmup:
            proxy.reset()
            began, read = time.perf_counter(), ft.bytes_read
        if step == warmup + steps:
            break
    seconds = time.perf_counter() - began
    answered, needed = proxy.downloaded, ft.bytes_read - read
    it.close()
    return answered / seconds / 1e6, needed / seconds / 1e6, proxy.max_in_flight


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--server", choices=["gcs", "s3"], default="gcs")
    parser.add_argument("--rates", type=float, nargs="+", default=[50.0], help="MB/s caps")
    parser.add_argument("--delay", type=float, default=0.02, help="seconds per request")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=100, help="timed steps")
    parser.add_argument("--tokens", type=int, default=40_000_000)
    parser.add_argument(
        "--prefetch", type=int, help="pin LoaderConfig.prefetch (default: its default)"
    )
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    lengths = rng.integers(100, 3000, args.tokens // 1550)
    seqs = [rng.integers(0, 50_000, n) for n in lengths]
    cfg = ftj.LoaderConfig(batch_size=args.batch, seq_len=args.seq_len)
    if args.prefetch is not None:
        cfg = ftj.LoaderConfig(batch_size=args.batch, seq_len=args.seq_len, prefetch=args.prefetch)
    server = fake_gcs() if args.server == "gcs" else moto_s3()
    rows = []
    with server as base, tempfile.TemporaryDirectory() as tmp:
        proxy = DelayProxy(int(base.rsplit(":", 1)[1]))
        through = f"http://127.0.0.1:{proxy.port}"
        if args.server == "gcs":
            os.environ["TENSORSTORE_GCS_HTTP_URL"] = through
            os.environ["GOOGLE_AUTH_TOKEN_FOR_TESTING"] = "benchmark"
            url, options = "gs://bucket/ds", ftj.StoreOptions()
        else:
            creds = aws_profile(Path(tmp))
            url = "s3://bucket/ds"
            options = ftj.StoreOptions(endpoint=through, region="us-east-1", credentials=creds)
        with contextlib.closing(proxy):
            ftj.write_dataset(url, {"train": seqs}, options=options)
            proxy.delay = args.delay
            for rate in [None, *args.rates]:
                proxy.rate = None if rate is None else rate * 1e6
                answered, needed, most = measure(url, options, proxy, cfg, args.warmup, args.steps)
                rows.append((rate, answered, needed, most))
    name = "fake-gcs-server" if args.server == "gcs" else "moto S3"
    print(
        f"\n{name} on 127.0.0.1 behind a proxy holding each request {args.delay * 1e3:.0f} ms, "
        f"batch {args.batch} x {args.seq_len}, LoaderConfig prefetch {cfg.prefetch}, "
        f"{args.tokens:,} tokens, {args.steps} timed steps after {args.warmup}, cold cache "
        f"each row, {os.cpu_count()} cores\n"
    )
    print("| cap MB/s | answered MB/s | of the cap | token MB/s | most requests in flight |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for rate, answered, needed, most in rows:
        share = "-" if rate is None else f"{answered / rate:.0%}"
        cap = "none" if rate is None else f"{rate:g}"
        print(f"| {cap} | {answered:.1f} | {share} | {needed:.1f} | {most} |")


if __name__ == "__main__":
    main()
