"""Benchmark: reading from an object store with per-request latency, hidden by prefetch.

Starts fake-gcs-server (``--server gcs``, default) or moto's S3 server
(``--server s3``) on 127.0.0.1 behind a proxy that can hold every request a
fixed time, writes a dataset through it, then measures in one run:

* steady-state ``iterate()`` steps/s for each added latency (``--delays``) and
  prefetch depth (``--prefetch``), each against no latency at the same depth,
  with the HTTP read requests per batch (tensorstore's metrics, via
  ``flat_tokens_jax.store.remote_reads``) and a row with fewer concurrent
  requests (``--low-concurrency``);
* a training loop taking ``--step-time`` seconds per step at each latency: how
  long each step waited for its batch (``loader.wait_seconds``).

Every configuration opens the dataset afresh (a cold cache) and goes through
the proxy, so they differ only in what the table names. Run:
``python scripts/bench_remote.py [--server gcs|s3]`` (needs the test extras).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import flat_tokens_jax as ftj
from flat_tokens_jax.store import remote_reads

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from servers import DelayProxy, aws_profile, fake_gcs, moto_s3


@dataclasses.dataclass
class Run:
    url: str
    options: ftj.StoreOptions
    scheme: str
    warmup: int
    steps: int

    def rate(self, cfg: ftj.LoaderConfig, concurrency: int = 128) -> tuple[float, float]:
        """Steady-state steps/s and HTTP read requests per batch."""
        options = dataclasses.replace(self.options, concurrency=concurrency)
        loader = ftj.Loader(ftj.open_dataset(self.url, options)["train"], cfg)
        it = loader.iterate(0)
        for step, _ in it:
            if step == self.warmup:
                began, reads = time.perf_counter(), remote_reads()[self.scheme]
            if step == self.warmup + self.steps:
                break
        seconds = time.perf_counter() - began
        it.close()
        # Prefetched batches past the last step are counted too: at most
        # cfg.prefetch batches over self.steps, a small overestimate.
        requests = (remote_reads()[self.scheme] - reads) / self.steps
        return self.steps / seconds, requests

    def waits(self, cfg: ftj.LoaderConfig, step_time: float) -> np.ndarray:
        loader = ftj.Loader(ftj.open_dataset(self.url, self.options)["train"], cfg)
        waits = []
        for step, _ in loader.iterate(0):
            waits.append(loader.wait_seconds)
            time.sleep(step_time)
            if step == self.steps:
                break
        return np.array(waits) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--server", choices=["gcs", "s3"], default="gcs")
    parser.add_argument("--delays", type=float, nargs="+", default=[0.02, 0.1], help="seconds")
    parser.add_argument("--prefetch", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--low-concurrency", type=int, default=16)
    parser.add_argument("--step-time", type=float, default=0.05, help="simulated train step")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--tokens", type=int, default=40_000_000)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    lengths = rng.integers(100, 3000, args.tokens // 1550)
    seqs = [rng.integers(0, 50_000, n) for n in lengths]
    server = fake_gcs() if args.server == "gcs" else moto_s3()
    rows = []
    with server as base, tempfile.TemporaryDirectory() as tmp:
        proxy = DelayProxy(int(base.rsplit(":", 1)[1]), 0.0)
        through = f"http://127.0.0.1:{proxy.port}"
        if args.server == "gcs":
            os.environ["TENSORSTORE_GCS_HTTP_URL"] = through
            os.environ["GOOGLE_AUTH_TOKEN_FOR_TESTING"] = "benchmark"
            url, options = "gs://bucket/ds", ftj.StoreOptions()
        else:
            creds = aws_profile(Path(tmp))
            url = "s3://bucket/ds"
            options = ftj.StoreOptions(endpoint=through, region="us-east-1", credentials=creds)
        run = Run(url, options, url[:2], 3, args.steps)
        with contextlib.closing(proxy):
            ftj.write_dataset(url, {"train": seqs}, options=options)
            ftj.open_dataset(url, options)["train"]
            for prefetch in args.prefetch:
                cfg = ftj.LoaderConfig(
                    batch_size=args.batch, seq_len=args.seq_len, prefetch=prefetch
                )
                proxy.delay = 0.0
                fast, requests = run.rate(cfg)
                rows.append((0.0, prefetch, 128, fast, requests, 1.0))
                for delay in args.delays:
                    proxy.delay = delay
                    slow, requests = run.rate(cfg)
                    rows.append((delay, prefetch, 128, slow, requests, slow / fast))
            deepest = max(args.prefetch)
            cfg = ftj.LoaderConfig(batch_size=args.batch, seq_len=args.seq_len, prefetch=deepest)
            proxy.delay = 0.0
            fast, _ = run.rate(cfg, args.low_concurrency)
            proxy.delay = max(args.delays)
            slow, requests = run.rate(cfg, args.low_concurrency)
            rows.append((proxy.delay, deepest, args.low_concurrency, slow, requests, slow / fast))
            waits = {}
            for delay in args.delays:
                proxy.delay = delay
                waits[delay] = run.waits(cfg, args.step_time)
    tokens = args.batch * args.seq_len
    name = "fake-gcs-server" if args.server == "gcs" else "moto S3"
    print(
        f"\n{name} on 127.0.0.1, batch {args.batch} x {args.seq_len}, {args.tokens:,} tokens, "
        f"{args.steps} steady-state steps after 3 warm-up steps, cold cache each row\n"
    )
    print(
        "| added latency | prefetch | concurrency | steps/s | M tokens/s | "
        "requests/batch | vs no latency |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for delay, prefetch, concurrency, rate, requests, ratio in rows:
        print(
            f"| {delay * 1e3:.0f} ms | {prefetch} | {concurrency} | {rate:.1f} | "
            f"{rate * tokens / 1e6:.2f} | {requests:.1f} | {ratio:.2f} |"
        )
    print()
    for delay, w in waits.items():
        later = w[1:]
        print(
            f"training loop of {args.step_time * 1e3:.0f} ms per step, +{delay * 1e3:.0f} ms "
            f"per request, prefetch {deepest}: first step waited {w[0]:.1f} ms; later steps "
            f"waited max {later.max():.2f} ms, mean {later.mean():.3f} ms, "
            f"{int((later > 1).sum())} of {later.size} over 1 ms"
        )


if __name__ == "__main__":
    main()
