"""Requests in flight, failing and stalling servers, and a bandwidth cap, seen
through a :class:`DelayProxy` in front of a read-only S3 stand-in."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
from buckets import Served
from hypothesis import given
from hypothesis import strategies as st
from proxies import Link

import flat_tokens_jax as ftj
from flat_tokens_jax.store.options import StoreError

pytestmark = pytest.mark.remote
# Small shards, so that the rows of a few steps touch hundreds of them.
STORAGE_FORMAT = ftj.StorageFormat(shard_tokens=1 << 8, chunk_tokens=1 << 5)
ROWS, SEQ_LEN = 32, 32
# Retries that give up fast: 5 attempts, 0.01 s then up to 0.05 s apart.
FAST = {"retries": 5, "retry_delay": 0.01, "max_retry_delay": 0.05}
TIMEOUT = 3.0


def shards_read(loader: ftj.Loader, step: int) -> set[int]:
    """The shards of ``encoded_tokens`` that the rows of ``step`` read."""
    shards: set[int] = set()
    for row in loader.provenance(step):
        lo, hi = row["tokens"]
        shards.update(
            range(
                max(lo - 1, 0) // STORAGE_FORMAT.shard_tokens,
                (hi - 1) // STORAGE_FORMAT.shard_tokens + 1,
            )
        )
    return shards


def cold_requests(served: Served, cfg: ftj.LoaderConfig, step: int) -> int:
    """The requests that reading ``step`` alone costs a freshly opened dataset."""
    with served.proxied() as (proxy, options):
        loader = ftj.Loader(ftj.open_dataset(served.url, options)["train"], cfg)
        proxy.reset()
        loader.host_batch(step)
        return proxy.count()


def test_the_requests_of_the_steps_in_flight_reach_the_server_at_once(served: Served) -> None:
    """With ``prefetch=d`` the first ``d`` steps are fetched at once: each
    first reads the index of every shard its rows touch (to check the shard's
    probe), one request per shard not read yet, before any answer comes. The
    proxy holds every request until they are all there: a loader that
    fetched the steps one after another would never send the second step's
    requests, and one capped at 128 requests would stop at 128."""
    depth = 8
    cfg = ftj.LoaderConfig(batch_size=ROWS, seq_len=SEQ_LEN, seed=4, prefetch=depth)
    here = local_loader(served, cfg)
    shards = set().union(*(shards_read(here, s) for s in range(depth)))
    assert len(shards) > 128
    with served.proxied() as (proxy, options):
        loader = ftj.Loader(ftj.open_dataset(served.url, options)["train"], cfg)
        proxy.reset()
        proxy.stall(10**6)
        steps: list[int] = []

        def train() -> None:
            for step, _ in loader.iterate(0):
                steps.append(step)
                if step == depth:
                    return

        training = threading.Thread(target=train, daemon=True)
        training.start()
        deadline = time.monotonic() + 30  # a serial loader stays below forever
        while proxy.in_flight < len(shards) and time.monotonic() < deadline:
            time.sleep(0.05)
        seen = proxy.max_in_flight
        proxy.release()
        training.join(60)
    assert seen >= len(shards)
    assert steps == list(range(depth + 1))


def test_with_prefetch_1_no_more_than_two_steps_requests_are_in_flight(served: Served) -> None:
    """Each held 0.05 s: whatever the timing, no more than the requests of the
    step taken and the one read ahead (the first two are started together),
    each at most what the step that costs most costs read alone by a fresh
    process."""
    cfg = ftj.LoaderConfig(batch_size=ROWS, seq_len=SEQ_LEN, seed=4, prefetch=1)
    with served.proxied() as (proxy, options):
        loader = ftj.Loader(ftj.open_dataset(served.url, options)["train"], cfg)
        proxy.delay = 0.05
        proxy.reset()
        for step, _ in loader.iterate(0):
            if step == 2:
                break
        seen = proxy.max_in_flight
    one_step = max(cold_requests(served, cfg, s) for s in range(4))
    assert 0 < seen <= 2 * one_step


def test_a_pinned_concurrency_caps_the_requests_in_flight(served: Served) -> None:
    cfg = ftj.LoaderConfig(batch_size=ROWS, seq_len=SEQ_LEN, seed=4, prefetch=8)
    with served.proxied(concurrency=16) as (proxy, options):
        loader = ftj.Loader(ftj.open_dataset(served.url, options)["train"], cfg)
        proxy.delay = 0.05
        proxy.reset()
        for step, _ in loader.iterate(0):
            if step == 4:
                break
        assert proxy.max_in_flight == 16


def local_loader(served: Served, cfg: ftj.LoaderConfig) -> ftj.Loader:
    return ftj.Loader(ftj.open_dataset(served.local)["train"], cfg)


def run(
    loader: ftj.Loader, how: str, steps: int, start: int = 0
) -> Iterator[tuple[int, dict[str, np.ndarray]]]:
    """Batches of steps ``[start, steps)``, by ``iterate`` or by consecutive ``batch`` calls."""
    if how == "iterate":
        for step, batch in loader.iterate(start):
            yield step, {k: np.asarray(v) for k, v in batch.items()}
            if step + 1 == steps:
                return
    else:
        for step in range(start, steps):
            yield step, {k: np.asarray(v) for k, v in loader.batch(step).items()}


@pytest.mark.parametrize("how", ["iterate", "batch"])
def test_a_server_answering_503_mid_run_gives_the_same_batches(served: Served, how: str) -> None:
    cfg = ftj.LoaderConfig(batch_size=ROWS, seq_len=SEQ_LEN, seed=6, prefetch=4)
    here = local_loader(served, cfg)
    with served.proxied(**FAST) as (proxy, options):
        loader = ftj.Loader(ftj.open_dataset(served.url, options)["train"], cfg)
        steps = []
        for step, batch in run(loader, how, 12):
            if step == 3:
                proxy.fail(6)
            for key, value in here.host_batch(step).items():
                np.testing.assert_array_equal(batch[key], value)
            steps.append(step)
        assert steps == list(range(12))
        assert proxy.failed == 6  # all answered 503 mid-run, and retried


@pytest.mark.parametrize("how", ["iterate", "batch"])
def test_a_server_that_stalls_mid_run_fails_at_the_timeout_then_recovers(
    served: Served, how: str
) -> None:
    # Two steps read ahead: each step in flight when the server stalls waits
    # out a timeout that a step's reads from a server answering at once stay
    # far below, however loaded the machine.
    cfg = ftj.LoaderConfig(batch_size=ROWS, seq_len=SEQ_LEN, seed=6, prefetch=2)
    here = local_loader(served, cfg)
    with served.proxied(timeout=TIMEOUT) as (proxy, options):
        loader = ftj.Loader(ftj.open_dataset(served.url, options)["train"], cfg)
        began, done = None, -1
        with pytest.raises(StoreError, match=f"no answer within StoreOptions.timeout={TIMEOUT}s"):
            for step, batch in run(loader, how, 40):
                for key, value in here.host_batch(step).items():
                    np.testing.assert_array_equal(batch[key], value)
                done = step
                if step == 3:
                    proxy.stall(10**6)
                    began = time.perf_counter()
        assert began is not None, "the error came before the stall"
        # A hang would never end: the steps in flight each wait at most the
        # timeout (the bound is for a hang, not for how long they wait).
        assert time.perf_counter() - began < 20 * TIMEOUT
        assert proxy.in_flight > 0  # the stalled requests are still held
        # The server answers again: the run goes on from the step that failed.
        proxy.release()
        steps = []
        for step, batch in run(loader, how, done + 4, start=done + 1):
            for key, value in here.host_batch(step).items():
                np.testing.assert_array_equal(batch[key], value)
            steps.append(step)
        assert steps == [done + 1, done + 2, done + 3]


@given(
    st.lists(st.tuples(st.floats(0, 0.01), st.integers(1, 1 << 16)), min_size=1, max_size=40),
    st.sampled_from([1e3, 5e7]),
)
def test_the_proxy_link_carries_at_most_its_rate(
    arrivals: list[tuple[float, int]], rate: float
) -> None:
    """A reference: bytes leave in arrival order, each at ``rate`` once the
    link is free; by any departure, no more than ``rate`` times the time since
    the first arrival has left, and a link never idle carries exactly ``rate``."""
    link, now, free = Link(), 0.0, 0.0
    first = None
    sent = 0
    for gap, size in arrivals:
        now += gap
        first = now if first is None else first
        left = now + link.hold(size, now, rate)
        free = max(free, now) + size / rate
        sent += size
        assert left == pytest.approx(free)
        assert sent <= rate * (left - first) + 1e-3  # float rounding: a thousandth of a byte
    if all(gap == 0 for gap, _ in arrivals):
        assert free - first == pytest.approx(sent / rate)
