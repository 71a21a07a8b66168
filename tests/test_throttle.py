"""A throttled bucket (issue 39): a :class:`ThrottleProxy` in front of
fake-gcs-server and moto's S3 answers the requests over its rate 429 (GCS) or
503 SlowDown (S3). The loader backs off and every batch is exact; the
refusals are counted in ``stats()`` and named by the stall warning."""

from __future__ import annotations

import dataclasses
import http.client
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from buckets import S3
from proxies import ThrottleProxy
from servers import gcs_through

import flat_tokens_jax as ftj
from flat_tokens_jax.store.options import StoreError

pytestmark = pytest.mark.remote
RNG = np.random.default_rng(5)
SEQS = [RNG.integers(1, 1000, int(n)) for n in RNG.integers(20, 300, 400)]
SMALL = ftj.StorageFormat(shard_tokens=1 << 10, chunk_tokens=1 << 6)
# Backoff scaled down from the defaults (1 s, doubling to 32 s) to keep the
# tests short, with attempts enough to outlast the refusals (about 20 s of
# waits); no chunk cache, so that every step sends requests.
PATIENT = {"retries": 100, "retry_delay": 0.01, "max_retry_delay": 0.2, "cache_bytes": 0}


@dataclasses.dataclass(frozen=True)
class Throttled:
    """A bucket behind a :class:`ThrottleProxy` (not throttling until its
    ``requests_per_s`` is set): ``root`` is ``gs://bucket`` or ``s3://bucket``,
    ``options`` reach it through the proxy."""

    root: str
    proxy: ThrottleProxy
    options: ftj.StoreOptions

    def dataset(self, tmp_path: Path) -> tuple[str, Path]:
        """The same dataset in the bucket (a URL no other test uses) and on local disk."""
        url = f"{self.root}/ds-{time.monotonic_ns()}"
        ftj.write_dataset(url, {"train": SEQS}, storage_format=SMALL, options=self.options)
        ftj.write_dataset(tmp_path, {"train": SEQS}, storage_format=SMALL)
        return url, tmp_path


@pytest.fixture(scope="module")
def throttled_gcs(gcs: str) -> Iterator[Throttled]:
    proxy = ThrottleProxy(int(gcs.rsplit(":", 1)[1]), "gcs", None)
    try:
        with gcs_through(f"http://127.0.0.1:{proxy.port}"):
            yield Throttled("gs://bucket", proxy, ftj.StoreOptions())
    finally:
        proxy.close()


@pytest.fixture(scope="module")
def throttled_s3(s3: S3) -> Iterator[Throttled]:
    proxy = ThrottleProxy(s3.port, "s3", None)
    endpoint = f"http://127.0.0.1:{proxy.port}"
    try:
        yield Throttled("s3://bucket", proxy, dataclasses.replace(s3.options, endpoint=endpoint))
    finally:
        proxy.close()


@pytest.fixture(params=["gcs", "s3"])
def throttled(request: pytest.FixtureRequest) -> Iterator[Throttled]:
    found: Throttled = request.getfixturevalue(f"throttled_{request.param}")
    yield found
    found.proxy.requests_per_s = None


@pytest.mark.parametrize(
    ("service", "status", "reason", "marker"),
    [
        ("gcs", 429, "Too Many Requests", b'"reason": "rateLimitExceeded"'),
        ("s3", 503, "Slow Down", b"<Code>SlowDown</Code>"),
    ],
)
def test_the_proxy_refuses_what_its_token_bucket_has_no_token_for(
    gcs: str, service: str, status: int, reason: str, marker: bytes
) -> None:
    """A bucket of 3 tokens that (practically) never refills: of 10 requests
    on one connection the first 3 reach the server and the other 7 get the
    service's answer to a throttled request; the connection stays open."""
    proxy = ThrottleProxy(int(gcs.rsplit(":", 1)[1]), service, 1e-9, burst=3)
    conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=30)
    try:
        answers = []
        for _ in range(10):
            conn.request("GET", "/storage/v1/b?project=test")
            reply = conn.getresponse()
            answers.append((reply.status, reply.reason, reply.read()))
    finally:
        conn.close()
        proxy.close()
    assert [a[0] for a in answers] == [200] * 3 + [status] * 7
    assert all(a[1] == reason and marker in a[2] for a in answers[3:])
    assert (proxy.forwarded, proxy.refused, proxy.count()) == (3, 7, 10)


def test_a_throttled_store_gives_the_exact_batches_counts_and_names_the_throttling(
    throttled: Throttled, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """51 steps of a trainer whose step (50 ms) is faster than a bucket serving
    150 requests/s can feed: tensorstore retries the refused requests, the
    batches are those of the same data on local disk, ``throttled_requests``
    counts the refusals (at most the proxy's: the metric counts the answers
    tensorstore received), and the one stall warning, after 50 steps that
    waited, names throttling and its knob.

    The read-ahead is pinned (``prefetch=4``): the requests in flight, each
    waiting its turn at 150 a second, stay within what the scaled-down retries
    outlast (with more in flight than the bucket serves in the waits of all
    attempts, some request is refused in every one of them; see
    docs/guide/remote.md)."""
    url, local = throttled.dataset(tmp_path)
    cfg = ftj.LoaderConfig(batch_size=8, seq_len=64, seed=3, prefetch=4)
    here = ftj.Loader(ftj.open_dataset(local)["train"], cfg)
    refused = throttled.proxy.refused
    options = dataclasses.replace(throttled.options, **PATIENT)  # type: ignore[arg-type]
    loader = ftj.Loader(ftj.open_dataset(url, options)["train"], cfg)
    throttled.proxy.requests_per_s, throttled.proxy.burst = 150.0, 2.0
    with caplog.at_level(logging.WARNING, logger="flat_tokens_jax.loader"):
        for step, batch in loader.iterate(0):
            expected = here.host_batch(step)
            for key, value in batch.items():
                np.testing.assert_array_equal(np.asarray(value), expected[key], err_msg=key)
            if step == 50:
                break
            time.sleep(0.05)
        stats = loader.stats()  # after the steps handed out were counted
    refused = throttled.proxy.refused - refused
    assert refused > 0
    assert 0 < stats["throttled_requests"] <= refused
    warnings = [r.getMessage() for r in caplog.records if "input stall" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "refused" in warnings[0] and "as throttled (HTTP 429 or 503)" in warnings[0]
    assert 'LoaderConfig(shuffle="blocks")' in warnings[0]


def test_a_store_that_throttles_every_attempt_fails_naming_throttling(
    throttled: Throttled, tmp_path: Path
) -> None:
    """No token after the first: a request refused in all its attempts fails
    the read with a :class:`StoreError` that says it was throttled and names
    the retry budget, not "is it reachable"."""
    url, _ = throttled.dataset(tmp_path)
    options = dataclasses.replace(
        throttled.options, retries=3, retry_delay=0.01, max_retry_delay=0.02
    )
    throttled.proxy.requests_per_s, throttled.proxy.burst = 1e-9, 1.0
    with pytest.raises(StoreError) as caught:
        cfg = ftj.LoaderConfig(batch_size=4, seq_len=32)
        ftj.Loader(ftj.open_dataset(url, options)["train"], cfg).host_batch(0)
    message = str(caught.value)
    assert "refused the request as throttled (HTTP 429 or 503) in all 3 attempts" in message
    assert "raise StoreOptions.retries" in message and "is it reachable" not in message
