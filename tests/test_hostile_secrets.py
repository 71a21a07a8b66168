"""Issue 27, findings 7 and the writer parts of 8 and 10: no secret echoed,
one winner among concurrent writers, outputs that cannot work refused, and
clear refusals where the writer used to be unclear."""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from buckets import S3
from hypothesis import given, settings
from hypothesis import strategies as st
from proxies import DelayProxy

import flat_tokens_jax as ftj
from flat_tokens_jax import cli
from flat_tokens_jax.core import urls
from flat_tokens_jax.data import plans
from flat_tokens_jax.store import location
from flat_tokens_jax.store.location import MARKER
from flat_tokens_jax.store.store import Store

SECRET = "wJalrXUtnFEMIK7MDENGbPxRfiCYSECRET"
PRESIGNED = [
    f"https://bucket.s3.amazonaws.com/ds?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Signature={SECRET}",
    f"s3://bucket/ds?X-Amz-Credential=AKIA%2F20260101&X-Amz-Signature={SECRET}",
    f"gs://bucket/ds?X-Goog-Signature={SECRET}#{SECRET}",
    f"file:///data/ds?token={SECRET}",
]


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "flat_tokens_jax.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


# -- Finding 7: secrets are not echoed. ----------------------------------------------------


@pytest.mark.parametrize("url", PRESIGNED)
def test_a_presigned_url_is_refused_without_its_signature(
    url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text('{"tokens": [1, 2]}\n')
    commands = [
        ["validate", url],
        ["info", url],
        ["show", url, "--step", "0", "--batch-size", "1", "--seq-len", "2"],
        ["pack", url, "--seq-len", "8"],
        ["convert", str(src), url, "--tokens-key", "tokens", "--no-progress"],
        ["merge", url, str(tmp_path / "merged")],
        ["export-megatron", url, str(tmp_path / "prefix")],
    ]
    for command in commands:
        assert cli.main(command) == 1, command
        told = capsys.readouterr()
        assert SECRET not in told.out + told.err, command
        assert told.err.startswith(f"{command[0]}: ") and "REDACTED" in told.err
    for call in (ftj.open_dataset, ftj.validate, ftj.summary, ftj.DatasetWriter):
        with pytest.raises(ValueError) as caught:
            call(url)
        assert SECRET not in str(caught.value) and SECRET not in repr(caught.value.args)


def test_a_presigned_input_or_source_is_not_echoed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = PRESIGNED[0]
    commands = [
        ["convert", url, str(tmp_path / "out"), "--tokens-key", "tokens"],
        ["convert-chat", url, str(tmp_path / "out"), "--tokenizer", "t.json"],
        ["import-megatron", url, str(tmp_path / "out")],
    ]
    for command in commands:
        assert cli.main(command) == 1, command
        told = capsys.readouterr()
        assert SECRET not in told.out + told.err and "REDACTED" in told.err, told.err
    with pytest.raises(TypeError, match="is the URL") as caught:
        ftj.Loader(PRESIGNED[1], ftj.LoaderConfig(batch_size=1, seq_len=4))  # type: ignore[arg-type]
    assert SECRET not in str(caught.value)
    with pytest.raises(ValueError, match="lies inside the input") as overlap:
        location.refuse_overlap([f"gs://b/x?sig={SECRET}"], [f"gs://b/x/y?sig={SECRET}"])
    assert SECRET not in str(overlap.value)


_NAME = st.text("abcdefghijklmnopqrstuvwxyz0123456789-", min_size=1, max_size=8)
_SECRET = st.text("ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789+/:", min_size=12, max_size=20)


@settings(max_examples=300, deadline=None)
@given(
    scheme=st.sampled_from(["https", "http", "s3", "gs", "memory", "file", "ftp"]),
    user=st.none() | _SECRET,
    host=_NAME,
    path=st.lists(_NAME, max_size=3),
    query=st.none() | st.lists(st.tuples(_NAME, st.none() | _SECRET), min_size=1, max_size=3),
    fragment=st.none() | _SECRET,
)
def test_redact_keeps_the_location_and_drops_every_secret(
    scheme: str,
    user: str | None,
    host: str,
    path: list[str],
    query: list[tuple[str, str | None]] | None,
    fragment: str | None,
) -> None:
    where = host + "".join("/" + p for p in path)
    url = f"{scheme}://" + ("" if user is None else user + "@") + where
    # The reference: the same parts, built again with each secret replaced.
    expected = f"{scheme}://" + ("" if user is None else "REDACTED@") + where
    if query is not None:
        url += "?" + "&".join(k if v is None else f"{k}={v}" for k, v in query)
        expected += "?" + "&".join("REDACTED" if v is None else f"{k}=REDACTED" for k, v in query)
    if fragment is not None:
        url += "#" + fragment
        expected += "#REDACTED"
    assert urls.redact(url) == expected
    assert urls.redact(expected) == expected
    assert urls.redact(Path("/data/a?b=c#d@e")) == "/data/a?b=c#d@e"  # a plain path is a name


def test_a_bad_credentials_flag_is_refused_without_repeating_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    value = json.dumps({"type": "static", "secret_access_key": SECRET})
    for command in (["info", "s3://b/ds"], ["convert", "in.jsonl", "s3://b/ds"]):
        with pytest.raises(SystemExit) as exited:
            cli.main([*command, "--credentials", value])
        assert exited.value.code == 2
        err = capsys.readouterr().err
        assert "argument --credentials: invalid choice" in err and "anonymous" in err
        assert SECRET not in err and "secret_access_key" not in err
    with pytest.raises(ValueError, match="not a credentials type") as refused:
        ftj.StoreOptions(credentials=SECRET)
    assert SECRET not in str(refused.value)


def test_the_repr_of_store_options_shows_no_credential_values() -> None:
    options = ftj.StoreOptions(
        endpoint=f"https://user:{SECRET}@s3.example.com",
        credentials={"type": "profile", "profile": "p", "secret_access_key": SECRET},
    )
    shown = repr(options)
    assert SECRET not in shown and SECRET not in str(options)
    assert "'secret_access_key': <set>" in shown and "'type': 'profile'" in shown
    assert "https://REDACTED@s3.example.com" in shown
    assert ftj.StoreOptions(credentials="anonymous") == ftj.StoreOptions(credentials="anonymous")
    assert "credentials='anonymous'" in repr(ftj.StoreOptions(credentials="anonymous"))


# -- Finding 8: one winner among concurrent writers. --------------------------------------


@dataclasses.dataclass
class Backend:
    """Where the racing writers write: ``root`` (a folder or bucket URL), the
    command's store ``flags`` and the ``env`` of its processes, ``slowed``:
    the flags and env of a writer whose requests pass a :class:`DelayProxy`
    (so that its write surely lasts longer than a command takes to start),
    and ``listing``, the URL of an HTTP listing of the bucket (``None``: local
    disk)."""

    root: str
    flags: list[str]
    env: dict[str, str]
    slowed: tuple[list[str], dict[str, str]]
    listing: str | None = None

    def marker_seen(self, out: str) -> bool:
        if self.listing is None:
            return (Path(out) / MARKER).exists()
        prefix = out.split("/", 3)[3] + "/" + MARKER
        with urllib.request.urlopen(self.listing + urllib.parse.quote(prefix), timeout=10) as r:
            body = r.read().decode()
        if body.startswith("{"):  # GCS's JSON
            return prefix in [item["name"] for item in json.loads(body).get("items", [])]
        return f"<Key>{prefix}</Key>" in body  # S3's XML, which repeats the prefix asked


@pytest.fixture
def local(tmp_path: Path) -> Backend:
    return Backend(str(tmp_path), [], dict(os.environ), ([], dict(os.environ)))


_DELAY = 0.05  # seconds per request, and per 64 KiB sent


@pytest.fixture(scope="module")
def s3_backend(s3: S3) -> Iterator[Backend]:
    proxy = DelayProxy(s3.port, _DELAY)
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
    flags = ["--region", "us-east-1", "--credentials", "environment"]
    slowed = ["--endpoint", f"http://127.0.0.1:{proxy.port}", *flags]
    try:
        yield Backend(
            "s3://bucket",
            ["--endpoint", s3.base, *flags],
            env,
            (slowed, env),
            f"{s3.base}/bucket?list-type=2&prefix=",
        )
    finally:
        proxy.close()


@pytest.fixture(scope="module")
def gcs_backend(gcs: str) -> Iterator[Backend]:
    proxy = DelayProxy(int(gcs.rsplit(":", 1)[1]), _DELAY)
    env = {**os.environ, "GOOGLE_AUTH_TOKEN_FOR_TESTING": "test"}
    slowed = {**env, "TENSORSTORE_GCS_HTTP_URL": f"http://127.0.0.1:{proxy.port}"}
    try:
        yield Backend(
            "gs://bucket",
            [],
            {**env, "TENSORSTORE_GCS_HTTP_URL": gcs},
            ([], slowed),
            f"{gcs}/storage/v1/b/bucket/o?prefix=",
        )
    finally:
        proxy.close()


def _inputs(folder: Path, docs: list[int]) -> list[Path]:
    """Pre-tokenized inputs: input ``i`` holds ``docs[i]`` documents of 200 ``i + 1``."""
    made = []
    for i, count in enumerate(docs):
        path = folder / f"in{i}.jsonl"
        path.write_text((json.dumps({"tokens": [i + 1] * 200}) + "\n") * count)
        made.append(path)
    return made


_CONVERT = [
    *(sys.executable, "-m", "flat_tokens_jax.cli", "convert"),
    *("--tokens-key", "tokens", "--no-progress"),
]


def _writer(src: Path, out: str, flags: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*_CONVERT, str(src), out, "--overwrite", *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


# Run in a process of its own: tensorstore reads the GCS test server's address
# from the environment once per process.
_CONTENTS = """
import json, sys
import numpy as np
import flat_tokens_jax as ftj
from flat_tokens_jax.cli import build_parser
from flat_tokens_jax.convert.commands import store_options
from flat_tokens_jax.store.store import Store
args = build_parser().parse_args(["info", *sys.argv[1:]])
ft = ftj.open_dataset(args.url, store_options(args))["train"]
n = ft.num_sequences
seqs = ft.sequences(np.array([0, n // 2, n - 1]))
print(json.dumps({
    "tokens": ft.num_tokens,
    "sequences": n,
    "seen": sorted({int(t) for s in seqs for t in s}),
    "keys": Store(args.url, store_options(args)).keys(),
}))
"""


def _winner_is_alone(
    procs: list[subprocess.Popen[str]], out: str, backend: Backend, docs: list[int]
) -> list[tuple[str, str]]:
    """Waits for ``procs``; asserts exactly one exited 0, the others named the
    claim they lost to, and ``out`` holds exactly the winner's input."""
    results = [p.communicate(timeout=300) for p in procs]
    codes = [p.returncode for p in procs]
    assert sorted(codes) == [0] + [1] * (len(procs) - 1), (codes, results)
    won = codes.index(0)
    for i, (_, err) in enumerate(results):
        if i != won:
            said = err.strip().splitlines()[-1]  # after tensorstore's log line, on GCS
            assert said.startswith("convert: another write to ") and MARKER in said, err
            assert f"pid {procs[won].pid}" in err or "just now" in err, err
    read = subprocess.run(
        [sys.executable, "-c", _CONTENTS, out, *backend.flags],
        capture_output=True,
        text=True,
        env=backend.env,
        timeout=120,
    )
    assert read.returncode == 0, read.stderr
    found = json.loads(read.stdout)
    assert found["sequences"] == docs[won] and found["tokens"] == docs[won] * 200
    assert found["seen"] == [won + 1]
    assert MARKER not in found["keys"]
    return results


def _marked_pid(out: str) -> int | None:
    """The process id in the local marker at ``out``, once it is written."""
    try:
        return int(json.loads((Path(out) / MARKER).read_text())["pid"])
    except (OSError, ValueError, KeyError):
        return None


def _race(backend: Backend, tmp_path: Path, docs: int, staggered: bool) -> None:
    """A dataset at one output, then two ``convert --overwrite`` onto it:
    slowed and started at once (local disk only: the test reads the marker's
    process id); or the second, small and not slowed, once the first's
    marker is there. The writer whose marker is there is stopped (SIGSTOP)
    until the other has ended, so the other meets a live claim however a
    loaded machine times the two."""
    sizes = [docs, docs // 100] if staggered else [docs, docs]
    srcs = _inputs(tmp_path, sizes)
    out = f"{backend.root}/race-{staggered}-{time.monotonic_ns()}"
    first = subprocess.run(
        [*_CONVERT, str(srcs[1]), out, *backend.flags],
        capture_output=True,
        text=True,
        env=backend.env,
        timeout=300,
    )
    assert first.returncode == 0, first.stderr
    procs = [_writer(srcs[0], out, *backend.slowed)]
    if not staggered:
        procs.append(_writer(srcs[1], out, *backend.slowed))

    def holder() -> subprocess.Popen[str] | None:
        if staggered:
            return procs[0] if backend.marker_seen(out) else None
        pid = _marked_pid(out)
        return next((p for p in procs if p.pid == pid), None)

    deadline = time.monotonic() + 120
    while (holding := holder()) is None:
        assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
        assert time.monotonic() < deadline, "no marker within 120 s"
        time.sleep(0.01)
    holding.send_signal(signal.SIGSTOP)
    try:
        if staggered:
            procs.append(_writer(srcs[1], out, backend.flags, backend.env))
        for p in procs:
            if p is not holding:
                p.wait(timeout=300)
    finally:
        holding.send_signal(signal.SIGCONT)
    results = _winner_is_alone(procs, out, backend, sizes)
    assert holding.returncode == 0, (results, [p.pid for p in procs])


@pytest.mark.parametrize("staggered", [False, True])
def test_of_two_overwrites_at_once_exactly_one_wins_on_local_disk(
    local: Backend, tmp_path: Path, staggered: bool
) -> None:
    _race(local, tmp_path, docs=10_000, staggered=staggered)


@pytest.mark.remote
def test_an_overwrite_while_an_s3_write_runs_is_refused(
    s3_backend: Backend, tmp_path: Path
) -> None:
    """Two started at the exact same time were already decided by the marker's
    conditional create (S3's If-None-Match): the overwrite that finds the
    other's marker is what used to win too."""
    _race(s3_backend, tmp_path, docs=2_000, staggered=True)


@pytest.mark.remote
def test_an_overwrite_while_a_gcs_write_runs_is_refused(
    gcs_backend: Backend, tmp_path: Path
) -> None:
    """fake-gcs-server ignores the conditions of writes (ifGenerationMatch), so
    only the live writer's lease decides here: the second writer starts once
    the first one's marker is there."""
    _race(gcs_backend, tmp_path, docs=2_000, staggered=True)


def test_an_overwrite_refuses_a_live_writer_in_this_process(tmp_path: Path) -> None:
    for url in (str(tmp_path / "ds"), f"memory://live-{time.monotonic_ns()}"):
        first = ftj.DatasetWriter(url)
        first.append("train", [1, 2])
        with pytest.raises(FileExistsError, match=r"another write to .* is in progress \(marker"):
            ftj.write_dataset(url, {"train": [[3]]}, overwrite=True)
        first.close()
        assert [s.tolist() for s in ftj.open_dataset(url)["train"].sequences([0])] == [[1, 2]]
        ftj.write_dataset(url, {"train": [[3]]}, overwrite=True)  # finished: replaced


def _leftover(url: str, marker: dict[str, object]) -> Store:
    """What a writer killed before it finished leaves: its marker and an array."""
    ftj.write_dataset(url, {"train": [[7, 8]]})
    store = Store(url)
    store.delete("zarr.json")
    store.wait(store.kv.write(MARKER, json.dumps(marker).encode()))
    return store


def test_an_overwrite_replaces_a_dead_remote_writer_only_once_its_lease_ran_out() -> None:
    now = datetime.datetime.now(datetime.UTC)
    lease = {"writer": "w", "pid": 1, "host": "h", "started": now.isoformat(), "lease_seconds": 60}
    old = (now - datetime.timedelta(seconds=61)).isoformat()
    live = {**lease, "renewed": now.isoformat()}
    for marker, alive in ((live, True), ({**lease, "renewed": old}, False), ({"pid": 1}, False)):
        url = f"memory://lease-{time.monotonic_ns()}"
        _leftover(url, marker)  # a lease renewed now, one that ran out, none (older versions)
        if alive:
            with pytest.raises(FileExistsError, match=r"its lease runs until .* if that write"):
                ftj.write_dataset(url, {"train": [[3]]}, overwrite=True)
            continue
        ftj.write_dataset(url, {"train": [[3]]}, overwrite=True)
        assert ftj.open_dataset(url)["train"].sequences([0])[0].tolist() == [3]


def test_a_write_that_lost_its_claim_fails_and_deletes_nothing() -> None:
    url = f"memory://lost-{time.monotonic_ns()}"
    writer = ftj.DatasetWriter(url)
    writer.append("train", [1, 2])
    store = Store(url)
    theirs = {"writer": "another", "pid": 1, "host": "h", "started": "2026-01-01T00:00:00"}
    store.wait(store.kv.write(MARKER, json.dumps(theirs).encode()))  # as after a lapsed lease
    with pytest.raises(FileExistsError, match="lost its claim"):
        writer.close()
    assert json.loads(bytes(store.wait(store.kv.read(MARKER)).value)) == theirs
    failing = ftj.DatasetWriter(f"{url}-2")
    failing.append("train", [1])
    other = Store(f"{url}-2")
    other.wait(other.kv.write(MARKER, json.dumps(theirs).encode()))
    before = sorted(other.keys())
    failing.abort()
    assert sorted(other.keys()) == before and len(before) > 1


def test_a_remote_claim_renews_its_lease_and_notices_a_takeover() -> None:
    store = Store(f"memory://renew-{time.monotonic_ns()}")
    claim = location.claim_location(store, overwrite=False)
    first = store.read_json(MARKER)
    assert first is not None and first["writer"] == claim.writer and first["lease_seconds"] == 60
    time.sleep(0.01)
    claim.renew()
    renewed = store.read_json(MARKER)
    assert renewed is not None and renewed["renewed"] > first["renewed"]
    assert renewed["started"] == first["started"] and not claim.lost
    store.wait(store.kv.write(MARKER, json.dumps({"writer": "other", "pid": 2}).encode()))
    claim.renew()
    assert "another writer replaced its marker" in claim.lost and "pid 2" in claim.lost
    with pytest.raises(FileExistsError, match="lost its claim"):
        claim.release()
    assert store.read_json(MARKER) == {"writer": "other", "pid": 2}
    done = location.claim_location(Store(f"{store.url}-2"), overwrite=False)
    done.release()
    done.renew()  # after the release: nothing happens
    assert Store(f"{store.url}-2").keys() == []


def test_a_memory_output_is_refused_by_the_commands(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text('{"tokens": [1, 2]}\n')
    ftj.write_dataset(tmp_path / "ds", {"train": [[1, 2]]})
    for command in (
        ["convert", str(src), "memory://out", "--tokens-key", "tokens", "--no-progress"],
        ["merge", str(tmp_path / "ds"), "memory://out"],
    ):
        assert cli.main(command) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"{command[0]}: memory://out ") and "write to a path" in err


def test_export_megatron_to_a_directory_writes_no_hidden_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ftj.write_dataset(tmp_path / "ds", {"train": [[1, 2, 3]]})
    out = tmp_path / "out"
    out.mkdir()
    for prefix in (f"{out}/", str(out)):
        assert cli.main(["export-megatron", str(tmp_path / "ds"), prefix]) == 1
        err = capsys.readouterr().err
        assert "is a directory" in err and f"{out}/train.bin" in err
    assert os.listdir(out) == []
    assert cli.main(["export-megatron", str(tmp_path / "ds"), str(out / "train")]) == 0
    assert sorted(os.listdir(out)) == ["train.bin", "train.idx"]


# -- Finding 10 (writer part): clear answers. --------------------------------------------


def test_convert_overwrite_replaces_a_dataset_with_packing_plans(tmp_path: Path) -> None:
    url = tmp_path / "ds"
    ftj.write_dataset(url, {"train": [[1, 2, 3]] * 40, "validation": [[4]]})
    ftj.pack_dataset(url, 8)
    ftj.pack_dataset(url, 16)
    assert (url / "train" / "bins_8" / "seq_order").is_dir()
    src = tmp_path / "in.jsonl"
    src.write_text('{"tokens": [5, 6]}\n')
    done = run("convert", str(src), str(url), "--tokens-key", "tokens", "--overwrite")
    assert done.returncode == 0, done.stderr
    assert ftj.open_dataset(url)["train"].sequences([0])[0].tolist() == [5, 6]
    assert not (url / "train" / "bins_8").exists()
    assert location._PLAN_ARRAYS == plans.PLAN_ARRAYS


@pytest.mark.parametrize("stray", ["train/bins_8/notes.txt", "train/bins_x/zarr.json"])
def test_files_beside_packing_plans_are_still_not_ours(tmp_path: Path, stray: str) -> None:
    url = tmp_path / "ds"
    ftj.write_dataset(url, {"train": [[1, 2, 3]] * 40})
    ftj.pack_dataset(url, 8)
    (url / stray).parent.mkdir(parents=True, exist_ok=True)
    (url / stray).write_text("x")
    with pytest.raises(FileExistsError, match=f"not part of a flat-tokens dataset \\({stray}"):
        ftj.write_dataset(url, {"train": [[1]]}, overwrite=True)
    assert (url / stray).exists()


def test_parquet_errors_name_the_file_and_the_row(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    table = pa.table({"tokens": [[1, 2, 3 + i % 50] for i in range(5000)]})
    good = tmp_path / "good.parquet"
    pq.write_table(table, good, row_group_size=1000, compression="none")
    damaged = bytearray(good.read_bytes())
    damaged[len(damaged) // 2 : len(damaged) // 2 + 200] = b"\xff" * 200
    (tmp_path / "damaged.parquet").write_bytes(bytes(damaged))
    (tmp_path / "short.parquet").write_bytes(b"PAR1")
    for name, said in (
        ("short.parquet", "not a readable Parquet file"),
        ("damaged.parquet", "cannot read the rows of column 'tokens' after row "),
    ):
        out = run("convert", str(tmp_path / name), str(tmp_path / "out"), "--tokens-key", "tokens")
        assert out.returncode == 1
        assert out.stderr.startswith(f"convert: {tmp_path / name}: {said}"), out.stderr
    rows = int(out.stderr.split("after row ")[1].split()[0])
    assert 0 < rows < 5000  # rows read before the damage
