"""Real GCS and S3 servers on 127.0.0.1 (fake-gcs-server, moto), started by the tests."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from buckets import S3
from proxies import DelayProxy, FaultProxy
from servers import aws_profile, fake_gcs, gcs_through, moto_s3, moto_s3_with_auth

import flat_tokens_jax as ftj
from flat_tokens_jax import cli
from flat_tokens_jax.store.location import MARKER
from flat_tokens_jax.store.options import StoreError
from flat_tokens_jax.store.store import Store

pytestmark = pytest.mark.remote
SEQS = [[i % 500 + 1] * (i % 37 + 1) for i in range(400)]
SMALL = ftj.StorageFormat(shard_tokens=1 << 10, chunk_tokens=1 << 6)
# Retries that give up fast: 3 attempts, 0.05 s then 0.1 s apart.
FAST = {"retries": 3, "retry_delay": 0.05, "max_retry_delay": 0.2}


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


@dataclasses.dataclass
class Remote:
    """A bucket behind a :class:`FaultProxy`: ``root`` is ``gs://bucket`` or
    ``s3://bucket``, ``options`` reach it through the proxy."""

    root: str
    proxy: FaultProxy
    options: ftj.StoreOptions

    def with_options(self, **changes: object) -> ftj.StoreOptions:
        return dataclasses.replace(self.options, **changes)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def faulty_gcs(gcs: str) -> Iterator[Remote]:
    proxy = FaultProxy(port_of(gcs))
    try:
        with gcs_through(proxy.url):
            yield Remote("gs://bucket", proxy, ftj.StoreOptions())
    finally:
        proxy.close()


@pytest.fixture(scope="module")
def faulty_s3(s3: S3) -> Iterator[Remote]:
    proxy = FaultProxy(s3.port)
    try:
        yield Remote("s3://bucket", proxy, dataclasses.replace(s3.options, endpoint=proxy.url))
    finally:
        proxy.close()


@pytest.fixture(params=["gcs", "s3"])
def remote(request: pytest.FixtureRequest) -> Remote:
    found: Remote = request.getfixturevalue(f"faulty_{request.param}")
    return found


def unique(remote: Remote, name: str) -> str:
    """A URL under the bucket that no other test uses."""
    return f"{remote.root}/{name}-{time.monotonic_ns()}"


def local_and_remote(remote: Remote, tmp_path: Path, options: ftj.StoreOptions) -> tuple[str, Path]:
    url = unique(remote, "ds")
    ftj.write_dataset(tmp_path, {"train": SEQS, "validation": SEQS[:9]}, storage_format=SMALL)
    ftj.write_dataset(
        url, {"train": SEQS, "validation": SEQS[:9]}, storage_format=SMALL, options=options
    )
    return url, tmp_path


def assert_same_batches(url: str, options: ftj.StoreOptions, local: Path, **config: int) -> None:
    for packing in (True, False):
        cfg = ftj.LoaderConfig(batch_size=8, seq_len=32, packing=packing, seed=2, **config)
        remote = ftj.Loader(ftj.open_dataset(url, options)["train"], cfg)
        here = ftj.Loader(ftj.open_dataset(local)["train"], cfg)
        for step in (0, 3, 17):
            for key, value in remote.host_batch(step).items():
                np.testing.assert_array_equal(value, here.host_batch(step)[key])


def test_round_trip_equals_local(remote: Remote, tmp_path: Path) -> None:
    url, local = local_and_remote(remote, tmp_path, remote.options)
    ftj.validate(url, remote.options)
    assert ftj.summary(url, remote.options)["splits"]["train"]["num_tokens"] == sum(map(len, SEQS))
    with pytest.raises(FileExistsError):
        ftj.write_dataset(url, {"train": SEQS}, options=remote.options)
    assert_same_batches(url, remote.options, local)


def store_flags(remote: Remote) -> list[str]:
    if remote.root.startswith("gs://"):
        return []
    assert remote.options.endpoint is not None
    endpoint = ["--endpoint", remote.options.endpoint, "--region", "us-east-1"]
    return [*endpoint, "--credentials", "environment"]


def test_commands_read_and_write_remote_stores(
    remote: Remote,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"tokens": s}) + "\n" for s in SEQS))
    converted, merged = unique(remote, "converted"), unique(remote, "merged")
    flags = store_flags(remote)
    command = ["convert", str(docs), converted, "--tokens-key", "tokens", "--no-progress"]
    assert cli.main(command + flags) == 0
    assert cli.main(["merge", converted, converted, merged, *flags]) == 0
    assert cli.main(["validate", merged, *flags]) == 0
    capsys.readouterr()
    assert cli.main(["info", merged, "--json", *flags]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["splits"]["train"]["num_sequences"] == 2 * len(SEQS)
    ft = ftj.open_dataset(merged, remote.options)["train"]
    got = [s.tolist() for s in ft.sequences(np.arange(ft.num_sequences))]
    assert got == SEQS + SEQS


@pytest.mark.parametrize("status", [503, 500, 429])
def test_transient_errors_are_retried_with_identical_batches(
    remote: Remote, tmp_path: Path, status: int
) -> None:
    url, local = local_and_remote(remote, tmp_path, remote.options)
    failed = remote.proxy.failed
    remote.proxy.fail(3, status)
    assert_same_batches(url, remote.with_options(retries=5, retry_delay=0.01), local)
    assert remote.proxy.failed == failed + 3


def iterate_until_error(loader: ftj.Loader, steps: int) -> float:
    """Seconds from the first failing step's request to its error; fails if none comes."""
    began = time.perf_counter()
    with pytest.raises(StoreError, match="attempts") as caught:
        for step, _ in loader.iterate(2):
            began = time.perf_counter()
            assert step < steps
    assert "is it reachable" in str(caught.value)
    return time.perf_counter() - began


def test_s3_server_stopped_mid_run_fails_within_the_retry_budget(tmp_path: Path) -> None:
    with contextlib.ExitStack() as server:
        base = server.enter_context(moto_s3())
        options = ftj.StoreOptions(
            endpoint=base, region="us-east-1", credentials=aws_profile(tmp_path), **FAST
        )
        ftj.write_dataset("s3://bucket/ds", {"train": SEQS}, storage_format=SMALL, options=options)
        cfg = ftj.LoaderConfig(batch_size=8, seq_len=32, seed=1, prefetch=4)
        loader = ftj.Loader(ftj.open_dataset("s3://bucket/ds", options)["train"], cfg)
        loader.host_batch(0)
        loader.host_batch(1)
        server.close()
        assert iterate_until_error(loader, 40) < 5


def test_gcs_server_stopped_mid_run_fails_within_the_retry_budget(faulty_gcs: Remote) -> None:
    kept = faulty_gcs.proxy.target_port
    try:
        with contextlib.ExitStack() as server:
            faulty_gcs.proxy.target_port = port_of(server.enter_context(fake_gcs()))
            options = faulty_gcs.with_options(**FAST)
            ftj.write_dataset(
                "gs://bucket/ds", {"train": SEQS}, storage_format=SMALL, options=options
            )
            cfg = ftj.LoaderConfig(batch_size=8, seq_len=32, seed=1, prefetch=4)
            loader = ftj.Loader(ftj.open_dataset("gs://bucket/ds", options)["train"], cfg)
            loader.host_batch(0)
            server.close()
            assert iterate_until_error(loader, 40) < 5
    finally:
        faulty_gcs.proxy.target_port = kept


def test_a_server_that_never_answers_times_out(faulty_s3: Remote, tmp_path: Path) -> None:
    url, _ = local_and_remote(faulty_s3, tmp_path, faulty_s3.options)
    proxy = DelayProxy(faulty_s3.proxy.port, 0)
    # A timeout that the open, answered by moto on a loaded machine, stays below.
    options = faulty_s3.with_options(endpoint=f"http://127.0.0.1:{proxy.port}", timeout=5.0)
    try:
        ft = ftj.open_dataset(url, options)["train"]
        proxy.delay = 600
        began = time.perf_counter()
        with pytest.raises(StoreError, match=r"no answer within StoreOptions.timeout=5.0s"):
            ft.tokens(1000, 2000)
        assert time.perf_counter() - began < 60  # a bound for a hang, not for the wait
    finally:
        proxy.close()


def test_a_missing_object_fails_the_read_naming_it(remote: Remote, tmp_path: Path) -> None:
    url, _ = local_and_remote(remote, tmp_path, remote.options)
    Store(url, remote.options).delete("train/encoded_tokens/c/2")
    ft = ftj.open_dataset(url, remote.options)["train"]
    assert ft.tokens(0, 2048).size == 2048
    with pytest.raises(StoreError, match=rf"{url}/train/encoded_tokens: .*missing"):
        ft.tokens(2048, 3072)
    cfg = ftj.LoaderConfig(batch_size=64, seq_len=32, shuffle=False)
    with pytest.raises(StoreError, match="missing"):
        ftj.Loader(ft, cfg).host_batch(1)


def test_a_missing_bucket_or_dataset_is_named(remote: Remote) -> None:
    scheme = remote.root.split("://")[0]
    for url in (f"{scheme}://no-such-bucket/ds", f"{remote.root}/no-such-dataset"):
        with pytest.raises(ftj.FormatError, match=f"{url}: no flat-tokens dataset.*bucket"):
            ftj.open_dataset(url, remote.options)


def test_wrong_s3_credentials_are_named(tmp_path: Path) -> None:
    with moto_s3_with_auth() as (base, key_id, secret):
        good = ftj.StoreOptions(
            endpoint=base, region="us-east-1", credentials=aws_profile(tmp_path, key_id, secret)
        )
        ftj.write_dataset("s3://bucket/ds", {"train": SEQS}, options=good)
        assert ftj.open_dataset("s3://bucket/ds", good)["train"].tokens(0, 1).tolist() == [1]
        for folder, wrong_id, wrong_secret in (
            ("secret", key_id, "not-the-secret"),
            ("key", "AKIANOSUCHKEY0000000", secret),
        ):
            (tmp_path / folder).mkdir()
            bad = dataclasses.replace(
                good, credentials=aws_profile(tmp_path / folder, wrong_id, wrong_secret)
            )
            with pytest.raises(
                StoreError, match="s3://bucket/ds: access denied: check the credentials"
            ):
                ftj.open_dataset("s3://bucket/ds", bad)


def test_refused_gcs_credentials_are_named(faulty_gcs: Remote, tmp_path: Path) -> None:
    url, _ = local_and_remote(faulty_gcs, tmp_path, faulty_gcs.options)
    ft = ftj.open_dataset(url, faulty_gcs.options)["train"]
    for status, hint in ((401, "not authenticated|access denied"), (403, "access denied")):
        faulty_gcs.proxy.fail(1, status)
        with pytest.raises(StoreError, match=f"({hint}): check the credentials"):
            ft.tokens(0, 100 + status)


def test_a_packed_batch_costs_about_one_request_per_row_and_each_index_one_read(
    faulty_s3: Remote,
) -> None:
    rng = np.random.default_rng(5)
    seqs = [rng.integers(1, 1000, int(n)).tolist() for n in rng.integers(20, 600, 300)]
    url = unique(faulty_s3, "requests")
    storage_format = ftj.StorageFormat(shard_tokens=1 << 13, chunk_tokens=1 << 10)
    ftj.write_dataset(
        url, {"train": seqs}, storage_format=storage_format, options=faulty_s3.options
    )
    cfg = ftj.LoaderConfig(batch_size=16, seq_len=64, seed=3, prefetch=0)
    opened = faulty_s3.proxy.count()
    ft = ftj.open_dataset(url, faulty_s3.options)["train"]
    loader = ftj.Loader(ft, cfg)
    key = url.split("://", 1)[1].split("/", 1)[1] + "/train/encoded_tokens/c/"
    data_reads = rows = 0
    for step in range(12):
        first = faulty_s3.proxy.count()
        loader.host_batch(step)
        chunks = set()
        for row in loader.provenance(step):
            lo, hi = row["tokens"]
            chunks.update(range(max(lo - 1, 0) >> 10, ((hi - 1) >> 10) + 1))
            # A shard's first touch also reads its probe, in the shard's first chunk.
            shards = range(max(lo - 1, 0) >> 13, ((hi - 1) >> 13) + 1)
            chunks.update(s << 3 for s in shards)
        reads = [r for r in faulty_s3.proxy.requests[first:] if key in r[1]]
        batch_data = sum(1 for r in reads if not (r[2] or "").startswith("bytes=-"))
        assert batch_data <= len(chunks)  # one request per chunk at most, cached ones free
        data_reads += batch_data
        rows += cfg.batch_size
    index_reads = [
        r[1] for r in faulty_s3.proxy.requests[opened:] if (r[2] or "").startswith("bytes=-")
    ]
    shards = [p for p in index_reads if key in p]
    # Every shard's index is read once, and only once.
    assert len(shards) == len(set(shards)) == -(-ft.num_tokens // storage_format.shard_tokens)
    assert data_reads <= rows * 1.25


class RefusingServer:
    """Accepts connections on 127.0.0.1 and closes them at once, counting them:
    a server that is down, but one that counts the attempts."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.connections = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = self.sock.accept()
                self.connections += 1
                conn.close()

    def close(self) -> None:
        self.sock.close()


@pytest.mark.parametrize("retries", [1, 3])
def test_a_server_that_is_down_gets_retries_attempts_in_the_documented_time(retries: int) -> None:
    # Before: retries=N made N+1 attempts and N waits (130 s with the defaults,
    # where docs/guide/remote.md promises at most 100 s).
    server = RefusingServer()
    delay, most = 0.2, 0.4
    try:
        options = ftj.StoreOptions(
            endpoint=server.endpoint,
            region="us-east-1",
            credentials="anonymous",
            retries=retries,
            retry_delay=delay,
            max_retry_delay=most,
        )
        began = time.perf_counter()
        with pytest.raises(StoreError, match=f"failed {retries} attempts"):
            # One object: open_dataset reads its metadata objects at once, each
            # with its own attempts.
            Store("s3://bucket/ds", options).read_json("zarr.json")
        took = time.perf_counter() - began
    finally:
        server.close()
    assert server.connections == retries
    # docs/guide/remote.md's bound: min(delay * 2**k + jitter, most) for k < retries - 1,
    # jitter below min(1, delay); the waits are at least delay * 2**k.
    waits = [min(delay * 2**k, most) for k in range(retries - 1)]
    bound = sum(min(w + delay, most) for w in waits)
    assert sum(waits) <= took < bound + 2.0


def test_the_commands_name_the_retry_flags_of_a_server_that_is_down(
    capsys: pytest.CaptureFixture[str],
) -> None:
    server = RefusingServer()
    try:
        flags = ["--endpoint", server.endpoint, "--region", "us-east-1", "--retries", "1"]
        assert cli.main(["info", "s3://bucket/ds", *flags, "--credentials", "anonymous"]) == 1
    finally:
        server.close()
    err = capsys.readouterr().err
    assert err.startswith("info: s3://bucket/ds: the server failed 1 attempts (--retries, ")
    assert "--retry-delay, --max-retry-delay): is it reachable?" in err
    assert "StoreOptions" not in err and err.count("\n") == 1


def test_racing_writers_on_s3_one_wins(faulty_s3: Remote) -> None:
    """S3 honours the marker's conditional write (If-None-Match), moto too."""
    url, writers = unique(faulty_s3, "race"), 4
    barrier = threading.Barrier(writers)
    outcomes: list[BaseException | None] = [None] * writers

    def write(i: int) -> None:
        barrier.wait()
        try:
            ftj.write_dataset(
                url, {"train": [[i + 1] * 300]}, storage_format=SMALL, options=faulty_s3.options
            )
        except FileExistsError as e:
            outcomes[i] = e

    threads = [threading.Thread(target=write, args=(i,)) for i in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [i for i, e in enumerate(outcomes) if e is None]
    assert len(winners) == 1, outcomes
    ft = ftj.open_dataset(url, faulty_s3.options)["train"]
    assert ft.sequences([0])[0].tolist() == [winners[0] + 1] * 300
    assert ft.num_sequences == 1


def test_the_gcs_marker_is_created_only_if_absent(faulty_gcs: Remote) -> None:
    """GCS creates the marker only if no object has its name (ifGenerationMatch=0);
    fake-gcs-server ignores that condition, so the race itself is not tested here."""
    url = unique(faulty_gcs, "marker")
    start = faulty_gcs.proxy.count()
    ftj.write_dataset(url, {"train": [[1]]}, options=faulty_gcs.options)
    uploads = [p for m, p, _ in faulty_gcs.proxy.requests[start:] if m == "POST" and MARKER in p]
    assert len(uploads) == 1, faulty_gcs.proxy.requests[start:]
    assert "ifGenerationMatch=0" in uploads[0]


@pytest.mark.parametrize("prefetch", [None, 1, 4, 16])
def test_steps_fetched_at_once_give_the_same_batches_under_any_latency(
    faulty_s3: Remote, tmp_path: Path, prefetch: int | None
) -> None:
    """Read-ahead fetches the steps in flight at once on an object store (a
    pinned depth, or one sized from measured times: None); the requests answer
    in whatever order a latency that changes under them gives, and every step
    is still the local store's batch, in order."""
    url, local = local_and_remote(faulty_s3, tmp_path, faulty_s3.options)
    proxy = DelayProxy(faulty_s3.proxy.port, 0)
    stop = threading.Event()

    def vary() -> None:
        rng = np.random.default_rng(prefetch or 0)
        while not stop.is_set():
            proxy.delay = float(rng.choice([0.0, 0.002, 0.01, 0.03]))
            time.sleep(0.003)

    changing = threading.Thread(target=vary, daemon=True)
    changing.start()
    try:
        options = faulty_s3.with_options(endpoint=f"http://127.0.0.1:{proxy.port}")
        for packing in (True, False):
            cfg = ftj.LoaderConfig(
                batch_size=8, seq_len=32, packing=packing, seed=5, prefetch=prefetch
            )
            here = ftj.Loader(ftj.open_dataset(local)["train"], cfg)
            loader = ftj.Loader(ftj.open_dataset(url, options)["train"], cfg)
            steps = []
            for step, batch in loader.iterate(0):
                steps.append(step)
                for key, value in batch.items():
                    np.testing.assert_array_equal(np.asarray(value), here.host_batch(step)[key])
                if step == 24:
                    break
            assert steps == list(range(25))
    finally:
        stop.set()
        changing.join(5)
        proxy.close()


def test_steps_fetched_ahead_grow_to_cover_the_latency_within_the_budget(
    faulty_s3: Remote, tmp_path: Path
) -> None:
    """With 40 ms a request and a trainer step of 2 ms, the automatic depth
    keeps many steps in flight (counted, fetched at once); a budget of 3
    steps holds it at 3, and the batches stay the local store's."""
    url, local = local_and_remote(faulty_s3, tmp_path, faulty_s3.options)
    proxy = DelayProxy(faulty_s3.proxy.port, 0.04)
    try:
        options = faulty_s3.with_options(endpoint=f"http://127.0.0.1:{proxy.port}")
        step_bytes = 8 * 32 * 17
        most = {}
        for budget in (1 << 30, 3 * step_bytes):
            cfg = ftj.LoaderConfig(batch_size=8, seq_len=32, seed=5, read_ahead_bytes=budget)
            here = ftj.Loader(ftj.open_dataset(local)["train"], cfg)
            loader = ftj.Loader(ftj.open_dataset(url, options)["train"], cfg)
            depths = []
            for step, batch in loader.iterate(0):
                depths.append(loader.stats()["depth"])
                for key, value in batch.items():
                    np.testing.assert_array_equal(np.asarray(value), here.host_batch(step)[key])
                time.sleep(0.002)
                if step == 20:
                    break
            most[budget] = max(depths)
            assert loader.stats()["read_ahead_bytes_peak"] <= max(budget, step_bytes)
        assert most[1 << 30] >= 16, most  # more than the 8 it starts with
        assert most[3 * step_bytes] == 3, most
    finally:
        proxy.close()
