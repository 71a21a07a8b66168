"""Real jax.distributed processes on CPU with gloo collectives."""

import dataclasses
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from multihost_worker import digest
from proxies import DelayProxy, FaultProxy
from rawstore import chunks_read, stored
from servers import aws_profile, moto_s3

import flat_tokens_jax as ftj
from flat_tokens_jax.store.probes import PROBE

pytestmark = pytest.mark.multihost
WORKER = Path(__file__).with_name("multihost_worker.py")
LOADER = {"batch_size": 16, "seq_len": 32, "seed": 9, "prefetch": 2}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("multihost") / "ds"
    rng = np.random.default_rng(3)
    ftj.write_dataset(
        path, {"train": [rng.integers(0, 30000, rng.integers(1, 90)) for _ in range(500)]}
    )
    return path


def launch(
    dataset: Path | str,
    out: Path,
    processes: int,
    jobs: dict[str, dict[str, Any]],
    **extra: Any,
) -> dict[str, list[dict[str, Any]]]:
    """``jobs`` run one after another by the same ``processes`` processes (2 CPU
    devices each): each job's reports, one per process, by job name. A job
    takes ``num_steps`` (3), a mesh (``mesh_shape``, ``mesh_axes``: every device
    on ``"data"``), ``spec`` (``["data"]``), ``loader`` fields (``LOADER``) or
    ``phases``, and ``restore_from``, ``save_state``, ``to_grain``."""
    devices = 2
    default = {
        "num_steps": 3,
        "mesh_shape": [processes * devices],
        "mesh_axes": ["data"],
        "spec": ["data"],
        "loader": LOADER,
    }
    config = {
        "dataset": str(dataset),
        "processes": processes,
        "port": free_port(),
        "devices": devices,
        "jobs": {name: {**default, **job} for name, job in jobs.items()},
        "out": str(out),
        **extra,
    }
    # Without the session's compilation cache: where one process compiles a
    # program and another reads it from the cache, the two can disagree on its
    # collectives (jax 0.6: gloo's "op.preamble.length <= op.nbytes" aborts).
    drop = ("XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), json.dumps(config), str(i)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(processes)
    ]
    outputs = []
    for p in procs:
        try:
            out_text, _ = p.communicate(timeout=600)  # a bound for a hang
        finally:
            p.kill()
        outputs.append(out_text)
    failed = [
        f"process {i} failed:\n"
        + "\n".join([ln for ln in out_text.splitlines() if not ln.startswith("[Gloo]")][-40:])
        for i, (p, out_text) in enumerate(zip(procs, outputs, strict=True))
        if p.returncode != 0
    ]
    assert not failed, "\n".join(failed)  # each one's: the first to fail may not be the first
    reports = [json.loads(Path(f"{out}.{i}.json").read_text()) for i in range(processes)]
    return {name: [report[name] for report in reports] for name in jobs}


def reference(
    dataset: Path,
    steps: range,
    loader_config: dict[str, Any] = LOADER,
    mixture: dict[str, float] | None = None,
) -> dict[str, dict[str, Any]]:
    ft = ftj.open_dataset(dataset)["train"]
    source = ft if mixture is None else ftj.Mixture({n: (ft, w) for n, w in mixture.items()})
    loader = ftj.Loader(source, ftj.LoaderConfig(**loader_config))
    out = {}
    for step in steps:
        batch = loader.host_batch(step)
        out[str(step)] = {
            "digest": digest(batch),
            "target_row_sums": batch["targets"].astype(np.int64).sum(1).tolist(),
        }
    return out


# A phase at step 2 doubles the batch and the sequence length: a new stream.
PHASES = [[0, LOADER], [2, {**LOADER, "batch_size": 32, "seq_len": 64}]]
SEQ_MESH = {"mesh_shape": [2, 2], "mesh_axes": ["seq", "data"]}  # process p: devices 2p, 2p+1
GROWN = {**LOADER, "batch_size": [[0, 16], [2, 32]]}
MORE_ROWS = {**LOADER, "batch_size": [[0, 16], [3, 32]]}  # from the restart's step on
# The split blended with itself, its rows' sources a field of the batch; steered mid-run:
# [after_step, call, step, value], each call made once after_step is handed out.
STEERED = {"loader": {**LOADER, "source_field": True}, "mixture": {"x": 1.0, "y": 1.0}}
STEER = [[1, "set_weights", 3, [1, 3]], [2, "skip", 4, 2], [4, "set_weights", 6, [3, 1]]]
SOURCES = {"mixture": {"x": 1.0, "y": 3.0}}
# The block shuffle: blocks of 3 windows, windows of 2 blocks; 16 lanes.
BLOCKS = {**LOADER, "shuffle": "blocks", "shuffle_block": 3, "shuffle_window": 2}
# Rows balanced over 4 groups, the sequence axis sharded too on two processes.
BALANCED = {**LOADER, "balance_groups": 4}


@dataclasses.dataclass(frozen=True)
class Runs:
    """The module's multi-host runs, by job name (see :func:`runs`), and the
    states they saved (``elastic``, ``restart``, ``phases``) in ``tmp``."""

    reports: dict[str, list[dict[str, Any]]]
    tmp: Path

    def state(self, name: str) -> Path:
        return self.tmp / f"{name}.json"


@pytest.fixture(scope="module")
def runs(dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Runs:
    """Every run of the tests below, in four launches of fresh processes: the
    jobs of a launch run one after another in its processes, each in a loader
    of its own; a restore is always in a later launch than the save."""
    tmp = tmp_path_factory.mktemp("runs")
    names = ("elastic", "restart", "phases", "balanced")
    state = {name: str(tmp / f"{name}.json") for name in names}
    reports = launch(
        dataset,
        tmp / "four",
        4,
        {
            "four": {"save_state": state["elastic"]},
            "blocks_on_four": {"loader": BLOCKS},
            "balanced_on_four": {"loader": BALANCED, "save_state": state["balanced"]},
        },
    )
    reports |= launch(
        dataset,
        tmp / "two",
        2,
        {
            "two": {"save_state": state["restart"]},
            "read_ahead": {"num_steps": 8, "loader": {**LOADER, "prefetch": None}},
            "sequence": {"num_steps": 2, **SEQ_MESH, "spec": ["data", "seq"]},
            "bins": {
                "num_steps": 2,
                **SEQ_MESH,
                "spec": ["data", "seq"],
                "loader": {**LOADER, "packing": "bins"},
            },
            "doubling_rows": {"num_steps": 4, "loader": GROWN},
            "doubling_rows_and_sequence": {
                "num_steps": 4,
                **SEQ_MESH,
                "spec": ["data", "seq"],
                "loader": GROWN,
            },
            "phases": {"num_steps": 4, "phases": PHASES, "save_state": state["phases"]},
            "to_grain": {"to_grain": True},
            "steered": {"num_steps": 8, **STEERED, "steer": STEER},
            "source_host": {
                **SOURCES,
                "loader": {**LOADER, "source_field": True, "decode": "host"},
            },
            "source_device": {
                **SOURCES,
                "loader": {**LOADER, "source_field": True, "decode": "device"},
            },
            "elastic_on_two": {"num_steps": 2, "restore_from": state["elastic"]},
            "blocks_on_two": {"loader": BLOCKS},
            "balanced_on_two": {"loader": BALANCED, **SEQ_MESH, "spec": ["data", "seq"]},
        },
    )
    reports |= launch(
        dataset,
        tmp / "restarted",
        2,
        {"more_rows": {"num_steps": 2, "loader": MORE_ROWS, "restore_from": state["restart"]}},
    )
    reports |= launch(
        dataset,
        tmp / "one",
        1,
        {
            "elastic_on_one": {"num_steps": 2, "restore_from": state["elastic"]},
            "phases_on_one": {"num_steps": 2, "phases": PHASES, "restore_from": state["phases"]},
            "blocks_on_one": {"loader": BLOCKS},
            "balanced_on_one": {
                "num_steps": 2,
                "loader": BALANCED,
                "restore_from": state["balanced"],
            },
        },
    )
    return Runs(reports, tmp)


@pytest.mark.remote
def test_four_processes_read_one_s3_store_through_a_proxy(dataset: Path, tmp_path: Path) -> None:
    """Each process reads only its own rows from moto's S3 server, every
    request held 20 ms by a proxy, and builds the single-process batches."""
    ft = ftj.open_dataset(dataset)["train"]
    seqs = ft.sequences(np.arange(ft.num_sequences))
    with moto_s3() as base:
        proxy = DelayProxy(int(base.rsplit(":", 1)[1]), 0.02)
        try:
            through = {
                "endpoint": f"http://127.0.0.1:{proxy.port}",
                "region": "us-east-1",
                "credentials": aws_profile(tmp_path),
            }
            direct = ftj.StoreOptions(**{**through, "endpoint": base})
            ftj.write_dataset("s3://bucket/ds", {"train": seqs}, options=direct)
            proxy.reset()
            reports = launch("s3://bucket/ds", tmp_path / "report", 4, {"s3": {}}, options=through)[
                "s3"
            ]
            assert proxy.count() > 0 and proxy.in_flight == 0
        finally:
            proxy.close()
    expected = reference(dataset, range(3))
    for report in reports:
        assert report["steps"] == expected
    rows = sorted(r for report in reports for r in report["rows"])
    assert rows == list(range(16)), "every row is read by exactly one host"
    full = LOADER["batch_size"] * (LOADER["seq_len"] + 1) * 4
    for report in reports:
        assert report["token_bytes_one_step"] == full // 4


def through_proxies(
    tmp_path: Path,
    seqs: list[np.ndarray],
    storage: ftj.StorageFormat,
    processes: int,
    job: dict[str, Any],
) -> tuple[list[dict[str, Any]], dict[str, bytes], list[list[tuple[str, str, str | None]]]]:
    """``seqs`` written to ``tmp_path / "ds"`` and to moto's S3 server, then
    ``job`` run by ``processes`` processes, each reading the server through a
    proxy of its own: the reports, the store's bytes by key and the requests
    each proxy forwarded."""
    ftj.write_dataset(tmp_path / "ds", {"train": seqs}, storage_format=storage)
    with moto_s3() as base:
        direct = {"endpoint": base, "region": "us-east-1", "credentials": aws_profile(tmp_path)}
        ftj.write_dataset("s3://bucket/ds", {"train": seqs}, storage_format=storage, **direct)
        raw = stored("s3://bucket/ds", ftj.StoreOptions(**direct))
        proxies = [FaultProxy(int(base.rsplit(":", 1)[1])) for _ in range(processes)]
        try:
            reports = launch(
                "s3://bucket/ds",
                tmp_path / "report",
                processes,
                {"job": job},
                options=direct,
                endpoints=[p.url for p in proxies],
            )["job"]
        finally:
            for p in proxies:
                p.close()
    return reports, raw, [p.requests for p in proxies]


# Blocks of 3 inner chunks of PROBE tokens, shards of 3 blocks: a block's
# chunks but its last (which holds the next block's token before) and a
# shard's first (which the shard's probe reads) are read only to read that
# block. 35 steps of 64 lanes are one epoch of 2,240 windows, 23 blocks and a
# third; each host's stretch of every lane's records, 560 windows, ends
# inside a block.
PROXIED = {
    **BLOCKS,
    "batch_size": 64,
    "prefetch": 0,  # nothing read past the epoch
    "shuffle_block": 3 * PROBE // 32,
    "shuffle_window": 1,  # with w > 1 a seam is a window of w blocks
}
PROXIED_STEPS = 35


@pytest.mark.remote
def test_each_process_reads_only_its_lanes_blocks_counted_at_its_proxy(tmp_path: Path) -> None:
    """4 processes read one epoch of the block shuffle from moto's S3 server,
    each through a proxy of its own that records the byte ranges it forwards:
    each process reads exactly the blocks of its rows, so a block is read by
    one process but for at most 3 at the seams of the hosts' stretches (read
    by 2); the global batches are the single process's."""
    records, block = PROXIED_STEPS * 64, PROXIED["shuffle_block"]
    rng = np.random.default_rng(5)
    cuts = np.sort(rng.choice(np.arange(1, records * 32 + 1), 40, replace=False))
    seqs = np.split(rng.integers(0, 30000, records * 32 + 1), cuts)
    storage = ftj.StorageFormat(chunk_tokens=PROBE, shard_tokens=9 * PROBE)
    job = {"num_steps": PROXIED_STEPS, "loader": PROXIED}
    reports, raw, requests = through_proxies(tmp_path, seqs, storage, 4, job)
    read = [
        {c // 3 for c in chunks_read(raw, "train/encoded_tokens", 9, r) if c % 3 != 2 and c % 9}
        for r in requests
    ]
    one = ftj.Loader(ftj.open_dataset(tmp_path / "ds")["train"], ftj.LoaderConfig(**PROXIED))
    need: list[set[int]] = [set() for _ in reports]
    epoch = []
    for step in range(PROXIED_STEPS):
        rows = one.provenance(step)
        epoch += [row["record"] for row in rows if row["epoch"] == 0]
        for pid, report in enumerate(reports):
            need[pid] |= {rows[r]["record"] // block for r in report["rows_at"][str(step)]}
    assert sorted(epoch) == list(range(records)), "the steps are one epoch"
    assert read == need, "each process reads exactly the blocks of its rows"
    blocks = range(-(-records // block))  # the last one partial
    assert set().union(*read) == set(blocks), "every block is read"
    by = [sum(b in r for r in read) for b in blocks]
    assert max(by) <= 2 and 0 < by.count(2) <= 3, "only a block at a seam, by 2 hosts"
    expected = reference(tmp_path / "ds", range(PROXIED_STEPS), PROXIED)
    for report in reports:
        assert report["steps"] == expected


@pytest.mark.parametrize("processes", [2, 4])
def test_global_batches_equal_the_single_process_batches(
    dataset: Path, runs: Runs, processes: int
) -> None:
    reports = runs.reports[{2: "two", 4: "four"}[processes]]
    assert len(reports) == processes
    expected = reference(dataset, range(3))
    for report in reports:
        assert report["steps"] == expected
    rows = sorted(r for report in reports for r in report["rows"])
    assert rows == list(range(16)), "every row is read by exactly one host"
    full = LOADER["batch_size"] * (LOADER["seq_len"] + 1) * 4
    for report in reports:
        assert report["token_bytes_one_step"] == full // processes


def test_hosts_steered_mid_run_equal_one_process_steered_the_same(
    dataset: Path, runs: Runs
) -> None:
    """Two processes change the weights and skip batches while steps are read
    ahead; their global batches, ``source`` included, are one process's with
    the same changes."""
    loader, mixture = STEERED["loader"], STEERED["mixture"]
    reports = runs.reports["steered"]
    one = ftj.Mixture({n: (ftj.open_dataset(dataset)["train"], w) for n, w in mixture.items()})
    steered = ftj.Loader(one, ftj.LoaderConfig(**loader))
    for _, call, at, value in STEER:
        getattr(steered, call)(at, value)
    for step in range(8):
        batch = steered.host_batch(step)
        want = {"digest": digest(batch), "target_row_sums": batch["targets"].sum(1).tolist()}
        for report in reports:
            assert report["steps"][str(step)] == want, f"step {step}"
    assert reports[0]["steps"] != reference(dataset, range(8), loader, mixture), "they change it"


@pytest.mark.parametrize("decode", ["host", "device"])
def test_the_source_field_of_a_mixture_is_the_single_process_one(
    dataset: Path, runs: Runs, decode: str
) -> None:
    """``source`` (issue 38) is one global array over 2 processes, each
    holding its rows' sources: its digest, with every other field's, equals
    the single process's batch."""
    loader = {**LOADER, "source_field": True, "decode": decode}
    mixture = SOURCES["mixture"]
    reports = runs.reports[f"source_{decode}"]
    expected = reference(dataset, range(3), loader, mixture)
    for report in reports:
        assert report["steps"] == expected
    one = ftj.Mixture({n: (ftj.open_dataset(dataset)["train"], w) for n, w in mixture.items()})
    sources = ftj.Loader(one, ftj.LoaderConfig(**loader)).host_batch(0)["source"]
    assert set(sources.tolist()) == {0, 1}  # the digests cover both sources


def test_read_ahead_sized_on_each_host_gives_the_single_process_batches(
    dataset: Path, runs: Runs
) -> None:
    """Each host measures its own times and keeps its own depth in flight
    (prefetch None); the global batches are still the single process's."""
    expected = reference(dataset, range(8), {**LOADER, "prefetch": None})
    for report in runs.reports["read_ahead"]:
        assert report["steps"] == expected


def test_sequence_sharded_hosts_read_only_their_columns(dataset: Path, runs: Runs) -> None:
    # Process p holds devices 2p, 2p+1: the "seq" axis runs across processes.
    reports = runs.reports["sequence"]
    expected = reference(dataset, range(2))
    for report in reports:
        assert report["steps"] == expected
    half = LOADER["seq_len"] // 2
    for pid, report in enumerate(reports):
        assert {tuple(b[1]) for b in report["blocks"]} == {(pid * half, (pid + 1) * half)}
        assert report["token_bytes_one_step"] == LOADER["batch_size"] * (half + 1) * 4


def test_bins_on_hosts_equal_the_single_process_bins(dataset: Path, runs: Runs) -> None:
    # Each process finds (or builds) the same plan; the sequence axis runs across processes.
    expected = reference(dataset, range(2), {**LOADER, "packing": "bins"})
    assert expected != reference(dataset, range(2))
    for report in runs.reports["bins"]:
        assert report["steps"] == expected


def test_elastic_restart_on_fewer_hosts(dataset: Path, runs: Runs) -> None:
    assert json.loads(runs.state("elastic").read_text())["step"] == 3
    expected = reference(dataset, range(5))
    assert runs.reports["four"][0]["steps"] == {k: expected[k] for k in ("0", "1", "2")}
    second, third = runs.reports["elastic_on_two"], runs.reports["elastic_on_one"]
    assert (len(second), len(third)) == (2, 1)
    for report in second + third:
        assert report["steps"] == {k: expected[k] for k in ("3", "4")}


@pytest.mark.parametrize("spec", ["rows", "rows_and_sequence"])
def test_a_batch_size_that_doubles_equals_the_single_process_run(
    dataset: Path, runs: Runs, spec: str
) -> None:
    reports = runs.reports[f"doubling_{spec}"]
    expected = reference(dataset, range(4), GROWN)
    assert [len(expected[str(s)]["target_row_sums"]) for s in range(4)] == [16, 16, 32, 32]
    for report in reports:
        assert report["steps"] == expected
    if spec == "rows":
        for step, size in (("1", 16), ("3", 32)):
            rows = sorted(r for report in reports for r in report["rows_at"][step])
            assert rows == list(range(size)), "every row is read by exactly one host"


def test_restart_on_more_rows_continues_at_the_next_sample(dataset: Path, runs: Runs) -> None:
    assert json.loads(runs.state("restart").read_text())["samples"] == 3 * 16
    expected = reference(dataset, range(5), MORE_ROWS)
    for report in runs.reports["more_rows"]:
        assert report["steps"] == {k: expected[k] for k in ("3", "4")}


def reference_phases(dataset: Path, steps: range) -> dict[str, dict[str, Any]]:
    ft = ftj.open_dataset(dataset)["train"]
    run = ftj.PhasedLoader([ftj.Phase(s, ft, ftj.LoaderConfig(**c)) for s, c in PHASES])
    out = {}
    for step in steps:
        batch = run.host_batch(step)
        out[str(step)] = {
            "digest": digest(batch),
            "target_row_sums": batch["targets"].astype(np.int64).sum(1).tolist(),
        }
    return out


def test_a_phase_changing_batch_size_and_seq_len_across_hosts_and_a_restart(
    dataset: Path, runs: Runs
) -> None:
    first = runs.reports["phases"]
    expected = reference_phases(dataset, range(6))
    assert [len(expected[str(s)]["target_row_sums"]) for s in range(4)] == [16, 16, 32, 32]
    for report in first:
        assert report["steps"] == {k: expected[k] for k in ("0", "1", "2", "3")}
    rows = sorted(r for report in first for r in report["rows_at"]["3"])
    assert rows == list(range(32)), "every row of the new phase is read by exactly one host"
    assert json.loads(runs.state("phases").read_text())["step"] == 4
    # Inside the second phase, on one process instead of two.
    second = runs.reports["phases_on_one"]
    assert second[0]["steps"] == {k: expected[k] for k in ("4", "5")}


def test_to_grain_yields_each_process_only_its_rows(dataset: Path, runs: Runs) -> None:
    """Two processes: each ``to_grain()`` element holds that process's rows of the
    single-process batch, and together they hold every row once."""
    reports = runs.reports["to_grain"]
    loader = ftj.Loader(ftj.open_dataset(dataset)["train"], ftj.LoaderConfig(**LOADER))
    for step in range(3):
        sums = loader.host_batch(step)["targets"].astype(np.int64).sum(1)
        held = [report["grain"][str(step)] for report in reports]
        assert sorted(r for h in held for r in h["rows"]) == list(range(16))
        for h in held:
            assert 0 < len(h["rows"]) < 16
            assert h["target_row_sums"] == sums[h["rows"]].tolist()


def test_block_shuffle_batches_are_the_same_for_one_two_and_four_processes(
    dataset: Path, runs: Runs
) -> None:
    """``shuffle="blocks"``: the global batches of 1, 2 and 4 processes are
    the single process's, and each process's rows are whole lanes."""
    expected = reference(dataset, range(3), BLOCKS)
    assert expected != reference(dataset, range(3)), "not the full shuffle's batches"
    for processes, name in ((1, "blocks_on_one"), (2, "blocks_on_two"), (4, "blocks_on_four")):
        reports = runs.reports[name]
        assert len(reports) == processes
        for pid, report in enumerate(reports):
            assert report["steps"] == expected, (name, pid)
            lanes = 16 // processes
            assert report["rows"] == list(range(pid * lanes, (pid + 1) * lanes))


def test_balanced_rows_are_the_same_on_one_two_and_four_processes(
    dataset: Path, runs: Runs
) -> None:
    """Every host orders each step's rows from all rows' sequence boundaries
    and reads only its own; four processes save at step 3, one restores."""
    expected = reference(dataset, range(5), BALANCED)
    assert expected != reference(dataset, range(5)), "the rows move"
    first = {k: expected[k] for k in ("0", "1", "2")}
    for report in runs.reports["balanced_on_four"] + runs.reports["balanced_on_two"]:
        assert report["steps"] == first
    assert json.loads(runs.state("balanced").read_text())["step"] == 3
    (restored,) = runs.reports["balanced_on_one"]
    assert restored["steps"] == {k: expected[k] for k in ("3", "4")}


# Rows of 8 inner chunks (PROBE tokens each), 8 rows a shard; 2 processes hold
# the 4 column blocks of a zigzag batch with context_parallel=2: process 0
# the rows' chunks 0 and 3 (columns [0, L/4) and [3L/4, L)), process 1 chunks
# 1 and 2. The whole batch on every process (rows unsharded).
CHUNKED = {"batch_size": 4, "seq_len": 8 * PROBE, "seed": 2, "prefetch": 0, "context_parallel": 2}


@pytest.mark.remote
def test_each_process_reads_only_its_sequence_chunks_counted_at_its_proxy(tmp_path: Path) -> None:
    """Two processes read zigzag sequence chunks from moto's S3 server, each
    through a proxy of its own that records the byte ranges it forwards: each
    reads exactly the store chunks of its columns of each row (and of the
    token before each run of them), decodes them with no gather, and builds the
    single-process batches."""
    rng = np.random.default_rng(8)
    tokens = 40 * CHUNKED["seq_len"] + 1
    seqs = np.split(rng.integers(0, 30000, tokens), np.sort(rng.choice(tokens - 1, 90) + 1))
    storage = ftj.StorageFormat(chunk_tokens=PROBE, shard_tokens=64 * PROBE)
    job = {"num_steps": 3, "mesh_shape": [4], "mesh_axes": ["context"], "spec": [None, "context"]}
    reports, raw, requests = through_proxies(tmp_path, seqs, storage, 2, {**job, "loader": CHUNKED})
    expected = reference(tmp_path / "ds", range(3), CHUNKED)
    one = ftj.Loader(ftj.open_dataset(tmp_path / "ds")["train"], ftj.LoaderConfig(**CHUNKED))
    q, order = CHUNKED["seq_len"] // 4, ftj.zigzag_order(CHUNKED["seq_len"], 2)
    first_of_shard = set(range(0, tokens // PROBE + 1, 64))  # each shard's probe reads it
    for pid, (report, asked) in enumerate(zip(reports, requests, strict=True)):
        assert report["steps"] == expected
        columns = np.sort(np.concatenate([order[slice(*b[1])] for b in report["blocks"]]))
        want = [(0, q), (3 * q, 4 * q)] if pid == 0 else [(q, 3 * q)]
        assert columns.tolist() == [c for a, b in want for c in range(a, b)]
        need: set[int] = set()
        for step in range(3):
            for row in one.provenance(step):
                start = row["tokens"][0]
                for a, b in want:
                    need |= set(range(max(start + a - 1, 0) // PROBE, (start + b - 1) // PROBE + 1))
        read = chunks_read(raw, "train/encoded_tokens", 64, asked)
        assert read - first_of_shard == need - first_of_shard, f"process {pid}"
