"""Measured: how tensorstore turns reads into HTTP requests; the request counts checked on it.

Starts fake-gcs-server and moto's S3 server on 127.0.0.1 (``tests/servers.py``),
writes a store of ``--tokens`` random tokens to each in the default
``StorageFormat`` (zarr v3, 2**24-token shards of 2**13-token chunks) and in a
smaller one (2**16-token shards of 2**10-token chunks), touches every shard
once (its index, probe and chunk digests, read once per process), then counts
with ``remote_reads()`` and ``remote_bytes()``:

* the rule ``flat_tokens_jax.tools.requestcount`` counts by: one 2049-token
  window (inside a chunk, and straddling two), a contiguous range of 2**18
  tokens (inside a shard, and across a shard boundary), two ranges read at
  once in adjacent chunks and one chunk apart, and 4 to 1,024 adjacent chunks;
* the counted requests and bytes per step for steps of ``--batch`` random
  2048-token windows (one host) beside those measured around
  ``Loader.host_batch`` of each step; and the requests the count itself sent
  (none: it reads no token).

Counts, not times: the machine's load does not change them. Run:
``python -u scripts/bench_requestcount.py`` (needs the test extras);
``--json`` prints the check's rows as JSON instead (``tests/test_requestcount.py``
runs it with ``--gcs BASE`` against a server it started).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

import flat_tokens_jax as ftj
from flat_tokens_jax.store.store import remote_bytes, remote_reads
from flat_tokens_jax.tools.requestcount import count_requests

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from servers import aws_profile, fake_gcs, moto_s3

FORMATS = {
    "default": ftj.StorageFormat(),
    "small": ftj.StorageFormat(shard_tokens=1 << 16, chunk_tokens=1 << 10),
}


@contextlib.contextmanager
def server(name: str, gcs: str | None) -> Iterator[tuple[str, ftj.StoreOptions]]:
    """``(bucket URL, options)`` of fake-gcs-server (``gcs``: one running
    there already) or moto's S3 server."""
    if name == "gcs":
        with contextlib.ExitStack() as stack:
            base = gcs or stack.enter_context(fake_gcs())
            # tensorstore reads these at its first gcs open in this process.
            os.environ["TENSORSTORE_GCS_HTTP_URL"] = base
            os.environ["GOOGLE_AUTH_TOKEN_FOR_TESTING"] = "benchmark"
            yield "gs://bucket", ftj.StoreOptions()
        return
    with moto_s3() as base, tempfile.TemporaryDirectory() as tmp:
        creds = aws_profile(Path(tmp))
        yield "s3://bucket", ftj.StoreOptions(endpoint=base, region="us-east-1", credentials=creds)


def counted(scheme: str, read: Callable[[], Any]) -> tuple[int, int]:
    """Requests and bytes that ``read()`` sent and got back."""
    requests, got = remote_reads()[scheme], remote_bytes()[scheme]
    read()
    return remote_reads()[scheme] - requests, remote_bytes()[scheme] - got


def written(url: str, options: ftj.StoreOptions, fmt: ftj.StorageFormat, tokens: int) -> Any:
    """A split of ``tokens`` random tokens in sequences of 3,000, every shard touched once."""
    rng = np.random.default_rng(0)
    flat = rng.integers(1, 50_000, tokens, dtype=np.int64)
    ftj.write_dataset(
        url,
        {"train": np.split(flat, np.arange(3000, tokens, 3000))},
        storage_format=fmt,
        options=options,
    )
    ft = ftj.open_dataset(url, options)["train"]
    for shard in range(-(-tokens // fmt.shard_tokens)):
        ft.tokens(shard * fmt.shard_tokens, shard * fmt.shard_tokens + 1)
    return ft


def rule(ft: Any, fmt: ftj.StorageFormat, scheme: str) -> list[tuple[str, int, int]]:
    """``(what, requests, bytes)`` of reads, each in chunks no earlier read touched."""
    c, s = fmt.chunk_tokens, fmt.shard_tokens
    rows = []
    at = 2 * c  # where the next read may start: past every chunk read so far, and one more

    def show(what: str, starts: list[int], stops: list[int]) -> None:
        nonlocal at
        rows.append((what, *counted(scheme, lambda: ft.encoded_ranges(starts, stops))))
        at = (max(stops) // c + 2) * c

    def in_one_shard(chunks: int) -> int:
        return at if at // s == (at + chunks * c - 1) // s else (at // s + 1) * s + c

    show("one 2049-token window inside a chunk", [at + 5], [at + 5 + 2049])
    show("one 2049-token window from a chunk's last 1000 tokens", [at + c - 1000], [at + c + 1049])
    first = in_one_shard((1 << 18) // c + 1) + 17
    show("2**18 tokens, one shard", [first], [first + (1 << 18)])
    first = (at // s + 1) * s - 1000
    show("2**18 tokens across a shard boundary", [first], [first + (1 << 18)])
    first = in_one_shard(2)
    show(
        "two ranges in adjacent chunks, read at once",
        [first + 1, first + c + 1],
        [first + 9, first + c + 9],
    )
    first = in_one_shard(3)
    show(
        "two ranges a chunk apart, read at once",
        [first + 1, first + 2 * c + 1],
        [first + 9, first + 2 * c + 9],
    )
    for k in (4, 16, 63, 64, 128, 256, 1024):
        first = in_one_shard(k)
        if first + k * c > ft.num_tokens:
            rows.append((f"{k} adjacent chunks: past the store's end (more --tokens)", 0, 0))
            continue
        show(f"{k} adjacent chunks", [first], [first + k * c])
    return rows


def check(ft: Any, scheme: str, batch: int, steps: int) -> dict[str, Any]:
    """The counted requests and bytes per step beside those measured."""
    cfg = ftj.LoaderConfig(batch_size=batch, seq_len=2048, seed=1, prefetch=0)
    loader = ftj.Loader(ft, cfg)
    counts = None

    def count() -> None:
        nonlocal counts
        counts = count_requests(loader, 1, 1.0, range(steps))

    sent, _ = counted(scheme, count)
    assert counts is not None
    rows = []
    for step in range(steps):
        requests, got = counted(scheme, lambda step=step: loader.host_batch(step))
        rows.append(
            {
                "step": step,
                "counted_requests": int(counts.reads.requests[step, 0]),
                "measured_requests": requests,
                "counted_bytes": int(counts.reads.bytes[step, 0]),
                "measured_bytes": got,
            }
        )
    return {"count_requests": sent, "steps": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--servers", nargs="+", default=["gcs", "moto"], choices=["gcs", "moto"])
    parser.add_argument("--tokens", type=int, default=1 << 25)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    parser.add_argument("--gcs", help="base URL of a fake-gcs-server running already")
    parser.add_argument("--json", action="store_true", help="print the check's rows as JSON")
    args = parser.parse_args()
    out: dict[str, Any] = {}
    for name in args.servers:
        with server(name, args.gcs) as (bucket, options):
            scheme = bucket[:2]
            for fmt_name in args.formats:
                fmt = FORMATS[fmt_name]
                ft = written(f"{bucket}/{fmt_name}", options, fmt, args.tokens)
                # The rule first: chunks cached by the check's steps would split its runs.
                measured = [] if args.json else rule(ft, fmt, scheme)
                found = check(ft, scheme, args.batch, args.steps)
                out[f"{name}/{fmt_name}"] = found
                if args.json:
                    continue
                print(
                    f"\n{name}, {fmt_name} format (shard {fmt.shard_tokens}, chunk "
                    f"{fmt.chunk_tokens} tokens), {args.tokens:,} tokens"
                )
                print("| read | requests | bytes |\n| --- | ---: | ---: |")
                for what, requests, got in measured:
                    print(f"| {what} | {requests} | {got:,} |")
                print(f"\nthe count itself sent {found['count_requests']} requests")
                print("| step | counted requests | measured | counted bytes | measured |")
                print("| ---: | ---: | ---: | ---: | ---: |")
                for r in found["steps"]:
                    print(
                        f"| {r['step']} | {r['counted_requests']} | {r['measured_requests']} | "
                        f"{r['counted_bytes']:,} | {r['measured_bytes']:,} |"
                    )
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
