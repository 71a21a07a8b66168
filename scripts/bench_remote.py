"""Benchmark: a training loop reading an object store with per-request latency, all defaults.

Starts fake-gcs-server, a read-only S3 stand-in (``tests/s3files.py``,
files served from a folder) and moto's S3 server on 127.0.0.1, each behind a
proxy that holds every request a fixed time, writes a dataset to each, then
runs a training loop with the **default** ``LoaderConfig`` and
``StoreOptions`` (no prefetch or concurrency set) for each step time
(``--step-times``) and added latency (``--delays``), each opening the dataset
afresh (a cold cache):

* each row for each of ``--paths``, side by side (one delay at a time, the
  paths in turn): ``Loader.iterate``; ``Loader.to_grain()``, the loader's
  steps as a grain ``IterDataset`` of host numpy dicts;

* the server's own ceiling: steps/s of a loop with ``prefetch=0`` and no added
  latency or step time (moto's server answers tens of requests a second on a
  busy machine, so its rows measure the server);

* how long the first step and the later steps waited for their batch (the
  loop's own clock around ``next()``), the later ones as a share of the step;
* the first step's wait in round trips: ``(wait - wait at no latency) / latency``;
* the read-ahead the loader chose (``loader.stats()``, of ``iterate`` or of
  the ``to_grain`` iterator): steps in flight, and the peak bytes of steps in
  flight against the budget ``read_ahead_bytes``;
* HTTP read requests per batch (tensorstore's metrics) and bytes read per
  useful token;
* ``--waits``: every step's wait, in milliseconds, for each row;
* ``--hosts N`` (``Loader.iterate`` only): the same loop on N
  ``jax.distributed`` processes (gloo, one CPU device each) reading one store
  through the proxy, each only its own rows;
* ``--bandwidth MB/s``: the proxy caps throughput instead, and the loop (no
  step time) reports the rate the loader reached against the cap;
* ``--throttle RATE``: in the rows (not the warm-up or the ceiling) the proxy
  answers the requests over RATE a second (a token bucket of one request)
  as a throttled bucket does (GCS: 429, S3: 503 SlowDown), and a column
  gives the requests refused per batch (``stats()["throttled_requests"]``);
* ``--shuffle full blocks``: each row for each shuffle, ``shuffle=True`` and
  ``shuffle="blocks"`` (its default block and window), with requests per
  1,000 rows, bytes read over the bytes of the tokens handed out, and beside
  them the request counts' (``count_requests`` for the steps the row read,
  those still ahead included; it counts no shard index, probe or digests,
  and no chunk cached by an earlier step). A block is one request of about
  2**18 tokens, read once an epoch by the lane that needs it, which keeps
  it about ``B * w`` steps (128 at 2048-token rows): ``--block-steps``
  (its rows' steps after the first, default ``--steps``) several times
  that gives a steady state. (Full-shuffle rows over as many steps would
  read much of a small store, which tensorstore's cache then holds.)

Run: ``python scripts/bench_remote.py`` (needs the test extras); ``--servers
gcs`` for one server. The cost model in docs/benchmarks.md is computed from the
requests per batch printed here.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import jax
import numpy as np

import flat_tokens_jax as ftj
from flat_tokens_jax.store.store import remote_bytes, remote_reads
from flat_tokens_jax.tools.requestcount import count_requests

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from proxies import ThrottleProxy
from servers import aws_profile, fake_gcs, free_port, moto_s3, s3_files

# List prices per 1,000 read requests (GCS Standard class B operations; S3
# Standard GET), US regions, as published by Google and AWS.
PRICE_PER_1000 = {"gs": 0.0004, "s3": 0.0004}


@dataclasses.dataclass(frozen=True)
class Where:
    """A store behind the proxy: how to reach it from this process and from workers."""

    server: str
    url: str
    options: ftj.StoreOptions
    env: dict[str, str]
    write_to: str | Path  # where the dataset is written: the url, or the stand-in's folder


def _serve_proxy(target_port: int, service: str, pipe: Connection) -> None:
    """A :class:`ThrottleProxy` (not throttling until told) in a process of its
    own, driven through ``pipe``: ``(name,)`` answers an attribute, ``(name,
    value)`` sets it."""
    proxy = ThrottleProxy(target_port, service, None)
    pipe.send(proxy.port)
    while (message := pipe.recv()) is not None:
        if len(message) == 2:
            setattr(proxy, *message)
        pipe.send(getattr(proxy, message[0]))
    proxy.close()


class ProxyProcess:
    """A throttling delay proxy in another process, so that its work on every
    request does not take this process's interpreter from the loader's threads
    (an object store runs elsewhere too). ``delay``, ``rate``,
    ``requests_per_s`` (settable) and ``downloaded`` as
    :class:`ThrottleProxy`'s."""

    def __init__(self, target_port: int, service: str) -> None:
        spawn = multiprocessing.get_context("spawn")  # not a fork of a process with threads
        self._pipe, theirs = spawn.Pipe()
        self._process = spawn.Process(
            target=_serve_proxy, args=(target_port, service, theirs), daemon=True
        )
        self._process.start()
        self.port = self._pipe.recv()

    def _ask(self, *message: Any) -> Any:
        self._pipe.send(message)
        return self._pipe.recv()

    def __setattr__(self, name: str, value: Any) -> None:
        if name in ("delay", "rate", "requests_per_s"):
            self._ask(name, value)
        else:
            super().__setattr__(name, value)

    @property
    def downloaded(self) -> int:
        return int(self._ask("downloaded"))

    def close(self) -> None:
        self._pipe.send(None)
        self._process.join(10)


NAMES = {"gcs": "fake-gcs-server", "s3": "S3 stand-in (tests/s3files.py)", "moto": "moto S3"}
SHUFFLES: dict[str, bool | str] = {"full": True, "blocks": "blocks"}
PATHS = {
    "iterate": "Loader.iterate",
    "to_grain": "Loader.to_grain()",
}


@contextlib.contextmanager
def served(server: str, tmp: Path) -> Iterator[tuple[Where, ProxyProcess]]:
    """The server, a proxy in front of it, and how to reach the store through it."""
    starts = {"gcs": fake_gcs, "moto": moto_s3, "s3": lambda: s3_files(tmp / "files")}
    with starts[server]() as base:
        proxy = ProxyProcess(int(base.rsplit(":", 1)[1]), "gcs" if server == "gcs" else "s3")
        through = f"http://127.0.0.1:{proxy.port}"
        if server == "gcs":
            env = {
                "TENSORSTORE_GCS_HTTP_URL": through,
                "GOOGLE_AUTH_TOKEN_FOR_TESTING": "benchmark",
            }
            os.environ.update(env)
            where = Where(server, "gs://bucket/ds", ftj.StoreOptions(), env, "gs://bucket/ds")
        else:
            creds = aws_profile(tmp)
            options = ftj.StoreOptions(endpoint=through, region="us-east-1", credentials=creds)
            local = tmp / "files" / "bucket" / "ds"
            where = Where(
                server, "s3://bucket/ds", options, {}, local if server == "s3" else "s3://bucket/ds"
            )
        with contextlib.closing(proxy):
            yield where, proxy


def opened(
    path: str, where: Where, cfg: ftj.LoaderConfig, sharding: Any
) -> tuple[Iterator[dict[str, Any]], Callable[[], dict[str, Any] | None]]:
    """The batches of ``path`` on a freshly opened store (every array ready
    when handed out), and what reads them ahead reports (``None``: unknown)."""
    ft = ftj.open_dataset(where.url, where.options)["train"]
    loader = ftj.Loader(ft, cfg, sharding=sharding)
    if path == "to_grain":  # loader.stats() reports the door that handed out the last step
        return iter(loader.to_grain()), loader.stats

    def placed() -> Iterator[dict[str, Any]]:
        steps = loader.iterate(0)
        try:
            for _, batch in steps:
                yield jax.block_until_ready(batch)
        finally:
            steps.close()

    return placed(), loader.stats


def loop(
    where: Where,
    cfg: ftj.LoaderConfig,
    step_time: float,
    steps: int,
    sharding: Any = None,
    path: str = "iterate",
    with_counts: bool = False,
) -> dict[str, Any]:
    """A training loop of ``steps`` steps after the first, on a freshly opened
    store; ``with_counts``: with the request counts of the steps it read (one host)."""
    scheme = where.url[:2]
    requests_before, bytes_before = remote_reads()[scheme], remote_bytes()[scheme]
    began = time.perf_counter()
    it, ahead = opened(path, where, cfg, sharding)
    opening = time.perf_counter() - began
    waits = []
    after_first = read_by_first = 0
    for _ in range(steps + 1):
        t = time.perf_counter()
        batch = next(it)
        waits.append(time.perf_counter() - t)
        if len(waits) == 1:
            after_first = remote_reads()[scheme]
            first_stats = ahead()
            # steps read by then: the first and those ahead of it
            read_by_first = 1 + (int(first_stats["depth"]) if first_stats else 0)
        if step_time:
            time.sleep(step_time)
    later_requests = remote_reads()[scheme] - after_first
    took = time.perf_counter() - began - opening
    stats = ahead()
    it.close()  # type: ignore[attr-defined]
    got = {
        "path": path,
        "opened": opening,
        "first": waits[0],
        "later": float(np.mean(waits[1:])),
        "later_p90": float(np.quantile(waits[1:], 0.9)),
        "later_max": float(np.max(waits[1:])),
        "waits": waits,
        "took": took,
        # this host's tokens handed out: a grain element holds this host's rows
        "tokens": (steps + 1) * next(iter(batch.values())).size,
    }
    if stats is None:
        return got
    got["tokens"] = int(stats["tokens"]) or got["tokens"]
    fetched = steps + 1 + int(stats["depth"])  # steps read, the ones still ahead included
    requests = remote_reads()[scheme] - requests_before
    received = remote_bytes()[scheme] - bytes_before
    batch_rows = next(iter(batch.values())).shape[0]
    rows = fetched * batch_rows
    if with_counts:  # after the counts: count_requests' open reads metadata
        ft = ftj.open_dataset(where.url, where.options)["train"]
        reads = count_requests(ftj.Loader(ft, cfg), 1, step_time or 1.0, range(fetched)).reads
        got["counted_per_1000_rows"] = 1000 * int(reads.requests.sum()) / rows
        got["counted_of_token_bytes"] = int(reads.bytes.sum()) / int(reads.useful.sum())
    return {
        **got,
        "shuffle": "blocks" if cfg.shuffle == "blocks" else "full",
        "per_1000_rows": 1000 * requests / rows,
        # from the first step's return to the last's, over the steps read in between
        # (those ahead at the end, less those read by the first's return): the
        # store's open and step 0 left out
        "later_per_1000_rows": 1000 * later_requests / ((fetched - read_by_first) * batch_rows),
        "block_reads": int(stats.get("block_reads", 0)),
        "depth": int(stats["depth_target"]),
        "peak": int(stats["read_ahead_bytes_peak"]),
        "budget": int(stats["read_ahead_bytes"]),
        "requests": requests / fetched,
        "throttled": int(stats["throttled_requests"]) / fetched,
        "bytes_per_token": received / (fetched * got["tokens"] / (steps + 1)),
    }


def write(where: Where, tokens: int) -> None:
    rng = np.random.default_rng(0)
    lengths = rng.integers(100, 3000, tokens // 1550)
    seqs = {"train": [rng.integers(0, 50_000, n) for n in lengths]}
    if isinstance(where.write_to, Path):
        ftj.write_dataset(where.write_to, seqs)
    else:
        ftj.write_dataset(where.write_to, seqs, options=where.options)


def single_host(
    args: argparse.Namespace, where: Where, proxy: ProxyProcess
) -> list[dict[str, Any]]:
    cfgs = {
        name: ftj.LoaderConfig(batch_size=args.batch, seq_len=args.seq_len, shuffle=SHUFFLES[name])
        for name in args.shuffle
    }
    proxy.delay = 0.0
    for path in args.paths:  # this process's one-time costs (jax, numba, grain), not reported
        for cfg in cfgs.values():
            loop(where, cfg, 0.0, 5, path=path)
    proxy.requests_per_s = args.throttle or None
    rows: list[dict[str, Any]] = []
    for step_time in args.step_times:
        bases: dict[tuple[str, str], dict[str, Any]] = {}
        for delay in [0.0, *args.delays]:
            proxy.delay = delay
            for (name, cfg), path in itertools.product(cfgs.items(), args.paths):
                steps = args.block_steps if name == "blocks" else args.steps
                got = loop(where, cfg, step_time, steps, path=path, with_counts=True)
                if args.waits:
                    each = " ".join(f"{w * 1000:.0f}" for w in got["waits"])
                    row = f"{PATHS[path]}, +{delay * 1e3:.0f} ms, {step_time * 1e3:.0f} ms steps"
                    print(f"{row}, {name} shuffle: {each}")
                base = bases.setdefault((name, path), got)
                trips = (got["first"] - base["first"]) / delay if delay else 0.0
                rows.append({**got, "delay": delay, "step_time": step_time, "trips": trips})
    proxy.requests_per_s = None
    return rows


def ceiling(args: argparse.Namespace, where: Where, proxy: ProxyProcess) -> float:
    """Steps/s the server gives a loop that reads one step at a time
    (``prefetch=0``), with no added latency and no step time, once warm."""
    cfg = ftj.LoaderConfig(batch_size=args.batch, seq_len=args.seq_len, prefetch=0)
    proxy.delay = 0.0
    got = loop(where, cfg, 0.0, 10)
    return 10 / (got["took"] - got["first"])


def worker(config: dict[str, Any], pid: int) -> None:
    """One of ``--hosts`` processes: the training loop over its own rows."""
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    os.environ.update(config["env"])
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{config['port']}",
        num_processes=config["hosts"],
        process_id=pid,
    )
    options = ftj.StoreOptions(**config["options"])
    where = Where(config["server"], config["url"], options, config["env"], config["url"])
    cfg = ftj.LoaderConfig(batch_size=config["batch"], seq_len=config["seq_len"])
    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    got = loop(where, cfg, config["step_time"], config["steps"], NamedSharding(mesh, P("data")))
    print("RESULT " + json.dumps(got), flush=True)


def multi_host(args: argparse.Namespace, where: Where, proxy: ProxyProcess) -> list[dict[str, Any]]:
    options = {k: getattr(where.options, k) for k in ("endpoint", "region", "credentials")}
    rows = []
    for step_time in args.step_times:
        for delay in args.delays:
            proxy.delay = delay
            config = {
                "env": where.env,
                "port": free_port(),
                "hosts": args.hosts,
                "options": options,
                "server": where.server,
                "url": where.url,
                "batch": args.batch,
                "seq_len": args.seq_len,
                "step_time": step_time,
                "steps": args.steps,
            }
            procs = [
                subprocess.Popen(
                    [sys.executable, __file__, "--worker", json.dumps(config), str(pid)],
                    stdout=subprocess.PIPE,
                    text=True,
                )
                for pid in range(args.hosts)
            ]
            outs = [p.communicate(timeout=600)[0] for p in procs]
            for pid, (p, out) in enumerate(zip(procs, outs, strict=True)):
                if p.returncode:
                    raise SystemExit(f"worker {pid} failed ({p.returncode}):\n{out}")
            got = [
                json.loads(line[7:])
                for o in outs
                for line in o.splitlines()
                if line.startswith("RESULT ")
            ]
            rows.append(
                {
                    "delay": delay,
                    "step_time": step_time,
                    "first": max(g["first"] for g in got),
                    "later": max(g["later"] for g in got),
                    "later_max": max(g["later_max"] for g in got),
                    "tokens": sum(g["tokens"] for g in got),
                    "requests": sum(g["requests"] for g in got),
                }
            )
    return rows


def bandwidth(args: argparse.Namespace, where: Where, proxy: ProxyProcess) -> dict[str, Any]:
    """Steady-state bytes/s through a proxy capped at ``--bandwidth`` MB/s, with
    a trainer that never waits: the bytes the proxy sent between step 3 and
    the last step over the time between them."""
    proxy.delay, proxy.rate = 0.02, args.bandwidth * 1e6
    cfg = ftj.LoaderConfig(batch_size=args.batch, seq_len=args.seq_len)
    loader = ftj.Loader(ftj.open_dataset(where.url, where.options)["train"], cfg)
    it = loader.iterate(0)
    for step, _ in it:
        if step == 3:
            began, before = time.perf_counter(), proxy.downloaded
        if step == 3 + args.steps:
            rate = (proxy.downloaded - before) / (time.perf_counter() - began)
            break
    it.close()
    proxy.delay, proxy.rate = 0.0, None
    return {"cap": args.bandwidth, "rate": rate / 1e6}


def print_rows(
    server: str, rows: list[dict[str, Any]], args: argparse.Namespace, top: float
) -> None:
    print(
        f"\n{server} on 127.0.0.1 behind a delay proxy, batch {args.batch} x {args.seq_len}, "
        f"{args.tokens:,} tokens, default LoaderConfig and StoreOptions, a cold cache each row, "
        f"{args.steps} steps after the first"
        + (f" ({args.block_steps} in the block rows)" if "blocks" in args.shuffle else "")
        + f"; the server's ceiling: {top:.1f} steps/s "
        f"({1e3 / top:.0f} ms a step) with prefetch=0, no added latency, no step time\n"
    )
    throttled = " | throttled/batch" if args.throttle else ""
    if args.throttle:
        print(f"the proxy refused requests over {args.throttle:g} a second in these rows\n")
    print(
        "| path | shuffle | step | added latency | open | first step waited | in round trips | "
        "later steps waited (mean) | share of the step | later waits p90 / max | steps ahead | "
        f"peak read-ahead / budget | requests/batch | bytes read / token{throttled} |"
    )
    print("| --- | --- |" + " ---: |" * (13 if args.throttle else 12))
    for r in rows:
        ahead = (
            f"{r['depth']} | {r['peak'] / 2**20:.0f} / {r['budget'] / 2**20:.0f} MiB | "
            f"{r['requests']:.1f} | {r['bytes_per_token']:.2f}"
            if "depth" in r
            else "- | - | - | -"
        )
        if args.throttle:
            ahead += f" | {r['throttled']:.1f}" if "throttled" in r else " | -"
        print(
            f"| {PATHS[r['path']]} | {r.get('shuffle', 'full')} | {r['step_time'] * 1e3:.0f} ms | "
            f"{r['delay'] * 1e3:.0f} ms | "
            f"{r['opened'] * 1e3:.0f} ms | {r['first'] * 1e3:.0f} ms | "
            f"{r['trips']:.1f} | {r['later'] * 1e3:.3f} ms | "
            f"{r['later'] / r['step_time'] * 100:.2f} % | "
            f"{r['later_p90'] * 1e3:.2f} / {r['later_max'] * 1e3:.1f} ms | {ahead} |"
        )
    print(
        "\nrequests and bytes over the steps read (those still ahead included) beside the "
        "request counts' for the same steps; after step 0: the requests sent between the "
        "first step's return and the last's, per 1,000 rows of the steps read in between "
        "(the store's open and step 0 left out); token bytes: 4 a token handed out\n"
    )
    print(
        "| path | shuffle | step | added latency | requests / 1,000 rows | after step 0 | "
        "counted | bytes read / token bytes | counted | block reads |"
    )
    print("| --- | --- |" + " ---: |" * 8)
    for r in rows:
        if "per_1000_rows" in r:
            print(
                f"| {PATHS[r['path']]} | {r['shuffle']} | {r['step_time'] * 1e3:.0f} ms | "
                f"{r['delay'] * 1e3:.0f} ms | {r['per_1000_rows']:.1f} | "
                f"{r['later_per_1000_rows']:.1f} | {r['counted_per_1000_rows']:.1f} | "
                f"{r['bytes_per_token'] / 4:.2f} | "
                f"{r['counted_of_token_bytes']:.2f} | {r['block_reads']} |"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--servers", nargs="+", choices=list(NAMES), default=list(NAMES))
    parser.add_argument("--delays", type=float, nargs="+", default=[0.02, 0.1, 0.25])
    parser.add_argument("--step-times", type=float, nargs="+", default=[0.05, 0.5])
    parser.add_argument("--paths", nargs="+", choices=list(PATHS), default=list(PATHS))
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--tokens", type=int, default=40_000_000)
    parser.add_argument("--hosts", type=int, default=0, help="also run on N processes")
    parser.add_argument("--bandwidth", type=float, default=0.0, help="MB/s cap row")
    parser.add_argument(
        "--throttle", type=float, default=0.0, help="requests/s over which the proxy refuses"
    )
    parser.add_argument("--waits", action="store_true", help="print every step's wait (ms)")
    parser.add_argument(
        "--shuffle", nargs="+", choices=list(SHUFFLES), default=["full"], help="rows for each"
    )
    parser.add_argument("--block-steps", type=int, help="steps of the block rows (--steps)")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.block_steps = args.block_steps or args.steps
    if args.worker:
        worker(json.loads(args.worker[0]), int(args.worker[1]))
        return
    tokens = args.batch * args.seq_len
    for server in args.servers:
        with tempfile.TemporaryDirectory() as tmp, served(server, Path(tmp)) as (where, proxy):
            write(where, args.tokens)
            top = ceiling(args, where, proxy)
            rows = single_host(args, where, proxy)
            hosts = multi_host(args, where, proxy) if args.hosts else []
            bw = bandwidth(args, where, proxy) if args.bandwidth else None
        name = NAMES[server]
        print_rows(name, rows, args, top)
        scheme = where.url[:2]
        for shuffle in args.shuffle:
            requests = float(
                np.mean(
                    [
                        r["requests"]
                        for r in rows
                        if r["delay"] and "requests" in r and r["shuffle"] == shuffle
                    ]
                )
            )
            per_trillion = requests * 1e12 / tokens
            print(
                f"\ncost model ({name}, {shuffle} shuffle): {requests:.1f} requests per batch of "
                f"{tokens:,} tokens = {per_trillion / 1e9:.2f} G requests per trillion tokens = "
                f"${per_trillion / 1000 * PRICE_PER_1000[scheme]:,.0f} at "
                f"${PRICE_PER_1000[scheme]} per 1,000; a 1,024-host pod, each host loading "
                f"{args.batch} x {args.seq_len} a step: {1024 * requests:,.0f} requests/s per "
                f"bucket at 1 s steps, {1024 * requests / 0.2:,.0f} at 0.2 s"
            )
        for r in hosts:
            print(
                f"{args.hosts} processes, {r['step_time'] * 1e3:.0f} ms steps, "
                f"+{r['delay'] * 1e3:.0f} ms: first step waited {r['first'] * 1e3:.0f} ms "
                f"(slowest host); later steps {r['later'] * 1e3:.3f} ms mean on the slowest "
                f"host ({r['later'] / r['step_time'] * 100:.2f} % of the step), max "
                f"{r['later_max'] * 1e3:.2f} ms; {r['requests']:.1f} requests per global batch"
            )
        if bw:
            print(
                f"bandwidth capped at {bw['cap']:.0f} MB/s (+20 ms), a trainer that never "
                f"waits: the loader read "
                f"{bw['rate']:.1f} MB/s through the proxy, {bw['rate'] / bw['cap'] * 100:.0f} % "
                "of the cap"
            )


if __name__ == "__main__":
    main()
