"""Round trips of a cold start on a remote store (moto's S3 behind a delaying
proxy): opening a dataset or a mixture, making a loader and reading the first
batch wait a bounded number of sequential requests, whatever the number of
shards or components."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from servers import Record, RecordingProxy, aws_profile, moto_s3, rounds, timeline

import flat_tokens_jax as ftj
from flat_tokens_jax.sampling.mixconfig import mixture_from_config

pytestmark = pytest.mark.remote
DELAY = 0.3  # per request: above the time a busy machine takes to issue a round's requests
OPEN_ROUNDS = 3  # metadata; shard indexes and recorded digests; data (seq_starts' ends)
BATCH_ROUNDS = 2  # shard indexes and recorded digests; data


@dataclasses.dataclass
class S3:
    proxy: RecordingProxy
    options: ftj.StoreOptions

    def delayed(self) -> list[Record]:
        """Starts holding requests; returns (and forgets) those recorded so far."""
        self.proxy.delay = DELAY
        return self.proxy.take()


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3]:
    with moto_s3() as base:
        proxy = RecordingProxy(int(base.rsplit(":", 1)[1]))
        options = ftj.StoreOptions(
            endpoint=proxy.url,
            region="us-east-1",
            credentials=aws_profile(tmp_path_factory.mktemp("aws")),
        )
        try:
            yield S3(proxy, options)
        finally:
            proxy.close()


@pytest.fixture(autouse=True)
def _no_delay_to_write(s3: S3) -> None:
    s3.proxy.delay = 0


def write(s3: S3, name: str, layout: ftj.Layout, seed: int = 0, mask: bool = False) -> str:
    rng = np.random.default_rng(seed)
    seqs = [rng.integers(1, 1000, int(n)) for n in rng.integers(20, 600, 200)]
    url = f"s3://bucket/{name}"
    if mask:
        masks = [rng.integers(0, 2, s.size).astype(bool) for s in seqs]
        with ftj.DatasetWriter(url, layout=layout, options=s3.options) as w:
            for s, m in zip(seqs, masks, strict=True):
                w.append("train", s, loss_mask=m)
    else:
        ftj.write_dataset(
            url, {"train": seqs, "validation": seqs[:5]}, layout=layout, options=s3.options
        )
    return url


def test_rounds_counts_sequential_requests_only() -> None:
    r = [Record("GET", "/a", None, 0.0, 1.0), Record("GET", "/b", None, 0.1, 1.1)]
    assert rounds(r) == 1
    assert rounds([*r, Record("GET", "/c", None, 1.05, 2.0)]) == 2
    assert rounds([*r, Record("GET", "/c", None, 1.2, 2.0), Record("GET", "/d", None, 2.1, 3)]) == 3
    assert rounds([]) == 0


@pytest.mark.parametrize(
    ("name", "layout", "mask"),
    [
        ("one-shard", ftj.Layout(shard_tokens=1 << 17, chunk_tokens=1 << 10), False),
        ("many-shards", ftj.Layout(shard_tokens=1 << 10, chunk_tokens=1 << 8), False),
        ("loss-mask", ftj.Layout(shard_tokens=1 << 12, chunk_tokens=1 << 8), True),
    ],
)
@pytest.mark.parametrize("packing", [True, False])
def test_open_and_first_batch_wait_a_bounded_number_of_round_trips(
    s3: S3, name: str, layout: ftj.Layout, mask: bool, packing: bool
) -> None:
    # A loaded machine can hold one request back a round before it reaches the
    # proxy, which shares this process: the bound must hold in one of two cold
    # starts, each on a store of its own.
    for attempt in range(2):
        url = write(s3, f"{name}-{packing}-{attempt}", layout, mask=mask)
        s3.delayed()
        ft = ftj.open_dataset(url, s3.options)["train"]
        opened = s3.proxy.take()
        cfg = ftj.LoaderConfig(batch_size=16, seq_len=64, packing=packing, seed=3, prefetch=0)
        ftj.Loader(ft, cfg).host_batch(5)
        batch = s3.proxy.take()
        s3.proxy.delay = 0
        if rounds(opened) <= OPEN_ROUNDS and rounds(batch) <= BATCH_ROUNDS:
            break
    # Before: 14 rounds to open a split (27 for two), 5 more for a packed
    # batch (probes, then chunks, then the digests' side array opened and read).
    assert rounds(opened) <= OPEN_ROUNDS, timeline(opened)
    # Padded rows read their sequences' bounds first, here from the chunk of
    # seq_starts that the open read (a larger seq_starts: 2 more rounds).
    assert rounds(batch) <= BATCH_ROUNDS, timeline(batch)
    assert rounds(opened + batch) <= 5
    shards = {r.path for r in batch if "/encoded_tokens/c/" in r.path}
    assert len(shards) > (8 if name == "many-shards" else 0)  # the bound holds over many shards


def test_a_mixture_of_three_opens_in_the_round_trips_of_one(s3: S3, tmp_path: Path) -> None:
    layout = ftj.Layout(shard_tokens=1 << 13, chunk_tokens=1 << 8)
    for attempt in range(2):  # as above: one of two cold starts, each on stores of its own
        urls = [write(s3, f"mix-{attempt}-{i}", layout, seed=i) for i in range(3)]
        s3.delayed()
        config = {"datasets": {f"c{i}": {"url": u, "weight": 1.0} for i, u in enumerate(urls)}}
        mix = mixture_from_config({**config, "split": "90,10"}, "train", s3.options)
        cfg = ftj.LoaderConfig(batch_size=8, seq_len=32, packing="bins", seed=1)
        loader = ftj.Loader(mix, cfg)
        opened = s3.proxy.take()
        loader.state()  # the fingerprint: spaced tokens and bounds of every component
        fingerprint = s3.proxy.take()
        s3.proxy.delay = 0
        # views' bounds; plans' seq_starts
        if rounds(opened) <= OPEN_ROUNDS + 2 + 2 and rounds(fingerprint) <= 2:
            break
    # Before: each dataset opened after the one before (14 rounds a split),
    # then each view's bounds and each component's packing plan in turn.
    assert len({r.path.split("/")[2] for r in opened}) == 3
    assert rounds(opened) <= OPEN_ROUNDS + 2 + 2, timeline(opened)
    # Before: 4 rounds a component (tokens, then bounds; index, then data), in turn.
    assert len({r.path.split("/")[2] for r in fingerprint}) == 3
    assert rounds(fingerprint) <= 2, timeline(fingerprint)
