"""The request counts (``tools/requestcount``, ``tools/runview``): its
counts against a brute-force count of every row's chunks (full shuffle, hand-made
blocks, and a block-shuffled run's own blocks by lanes), the ramp of a fresh
bucket, the counts measured on fake-gcs-server, and ``flat-tokens preview --requests``."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from commands import run_main
from hypothesis import given
from hypothesis import strategies as st

import flat_tokens_jax as ftj
from flat_tokens_jax.tools.requestcount import (
    count_requests,
    ramp_minutes,
)
from flat_tokens_jax.tools.runview import counterpart

ROOT = Path(__file__).resolve().parent.parent
FORMATS = [
    ftj.StorageFormat(shard_tokens=64, chunk_tokens=16),
    ftj.StorageFormat(shard_tokens=1024, chunk_tokens=64),
    ftj.StorageFormat(zarr_format=2, shard_tokens=128),
]
_STORES: dict[int, ftj.FlatTokens] = {}


def store(k: int) -> ftj.FlatTokens:
    """Split ``train`` of a store of 300 sequences of 1 to 60 tokens in ``FORMATS[k]``."""
    if k not in _STORES:
        rng = np.random.default_rng(k)
        seqs = [rng.integers(1, 500, int(n)) for n in rng.integers(1, 60, 300)]
        url = tempfile.mkdtemp(prefix="requestcount-")
        ftj.write_dataset(url, {"train": seqs}, storage_format=FORMATS[k])
        _STORES[k] = ftj.open_dataset(url)["train"]
    return _STORES[k]


def chunks_of(lo: int, hi: int, chunk: int) -> set[int]:
    return set(range(lo // chunk, (hi - 1) // chunk + 1)) if hi > lo else set()


def requests_of(chunks: set[int], per_shard: int | None) -> int:
    """One request per run of adjacent chunks of one shard of ``per_shard``
    chunks (zarr v2, ``None``: one per chunk)."""
    count, last = 0, None
    for c in sorted(chunks):
        if per_shard is None or last is None or c != last + 1 or c % per_shard == 0:
            count += 1
        last = c
    return count


def brute_force(k: int, chunks: dict[str, set[int]]) -> tuple[int, int]:
    """Requests and bytes of one batch that touches ``chunks`` of each array."""
    fmt = FORMATS[k]
    requests = got = 0
    for array, touched in chunks.items():
        shard, chunk = fmt.elements(array)
        requests += requests_of(touched, shard // chunk if fmt.zarr_format == 3 else None)
        itemsize = 8 if array == "seq_starts" else 4
        got += len(touched) * (chunk * itemsize + (4 if fmt.checksum else 0))
    return requests, got


def row_chunks(
    ft: ftj.FlatTokens, k: int, row: dict[str, Any], packing: object, seq_len: int
) -> dict[str, set[int]]:
    """The chunks of each array that reading one row (``provenance``) touches."""
    tokens_chunk = FORMATS[k].elements("encoded_tokens")[1]
    starts_chunk = FORMATS[k].elements("seq_starts")[1]
    out: dict[str, set[int]] = {"encoded_tokens": set(), "seq_starts": set()}
    if packing == "bins":
        for s in row["sequences"]:
            start, stop = (int(x[0]) for x in ft.sequence_bounds([s]))
            out["encoded_tokens"] |= chunks_of(start, min(stop, start + seq_len), tokens_chunk)
            out["seq_starts"] |= chunks_of(s, s + 2, starts_chunk)
        return out
    lo, hi = row["tokens"]
    if packing:
        out["encoded_tokens"] = chunks_of(max(lo - 1, 0), hi, tokens_chunk)
    else:
        out["encoded_tokens"] = chunks_of(lo, hi, tokens_chunk)
        out["seq_starts"] = chunks_of(row["record"], row["record"] + 2, starts_chunk)
    return out


def add_block(
    touched: dict[str, set[int]],
    ft: ftj.FlatTokens,
    k: int,
    b: int,
    block: int,
    n: int,
    packing: bool,
    seq_len: int,
) -> None:
    """Adds the chunks that reading block ``b`` (of ``block`` records, ``n``
    in all) whole touches: from its first record's start to its last one's end."""
    fmt = FORMATS[k]
    first, last = b * block, min((b + 1) * block, n) - 1
    if packing:
        lo, hi = max(first * seq_len - 1, 0), (last + 1) * seq_len
    else:
        lo = int(ft.sequence_bounds([first])[0][0])
        start, stop = (int(x[0]) for x in ft.sequence_bounds([last]))
        hi = min(stop, start + seq_len)
        touched["seq_starts"] |= chunks_of(first, last + 2, fmt.elements("seq_starts")[1])
    touched["encoded_tokens"] |= chunks_of(lo, hi, fmt.chunk_tokens)


@given(
    k=st.integers(0, len(FORMATS) - 1),
    packing=st.sampled_from([True, False, "bins"]),
    seq_len=st.integers(4, 90),
    per_host=st.integers(1, 6),
    hosts=st.sampled_from([1, 2, 3, 4]),
    seed=st.integers(0, 100),
)
def test_full_shuffle_counts_every_rows_chunks_in_runs(
    k: int, packing: object, seq_len: int, per_host: int, hosts: int, seed: int
) -> None:
    ft = store(k)
    cfg = ftj.LoaderConfig(
        batch_size=per_host * hosts, seq_len=seq_len, packing=packing, seed=seed, prefetch=0
    )
    loader = ftj.Loader(ft, cfg)
    steps = [0, 1, 5]
    counts = count_requests(loader, hosts, 0.5, steps)
    for i, step in enumerate(steps):
        rows = loader.provenance(step)
        for h in range(hosts):
            touched: dict[str, set[int]] = {"encoded_tokens": set(), "seq_starts": set()}
            for row in rows[h * per_host : (h + 1) * per_host]:
                for array, chunks in row_chunks(ft, k, row, packing, seq_len).items():
                    touched[array] |= chunks
            expected = brute_force(k, touched)
            assert (counts.reads.requests[i, h], counts.reads.bytes[i, h]) == expected
    assert counts.requests_per_second == pytest.approx(
        counts.reads.requests.sum() / len(steps) / 0.5
    )


@given(
    k=st.integers(0, 1),
    packing=st.booleans(),
    seq_len=st.integers(4, 40),
    block=st.sampled_from([None, 1, 2, 3, 5, 8]),
    window=st.integers(1, 3),
    lanes_per_host=st.integers(1, 3),
    hosts=st.integers(1, 4),
    seed=st.integers(0, 100),
)
def test_a_block_shuffled_run_reads_its_samplers_blocks_by_lanes(
    k: int,
    packing: bool,
    seq_len: int,
    block: int | None,
    window: int,
    lanes_per_host: int,
    hosts: int,
    seed: int,
) -> None:
    """``shuffle="blocks"`` with batches of ``2L`` rows, then ``3L`` from
    step 4 (``L`` lanes, the gcd): each host holds the rows of its lanes (a
    step's sample ``j`` in row ``(j mod L) * (bs / L) + j // L``, host ``row //
    (bs / H)``, worked out here from the sample index) and reads each block
    of the resolved ``shuffle_block`` its rows need, whole, once per epoch."""
    ft = store(k)
    lanes = lanes_per_host * hosts
    cfg = ftj.LoaderConfig(
        batch_size=[(0, 2 * lanes), (4, 3 * lanes)],
        seq_len=seq_len,
        packing=packing,
        seed=seed,
        shuffle="blocks",
        shuffle_block=block,
        shuffle_window=window,
    )
    loader = ftj.Loader(ft, cfg)
    resolved = loader.fingerprint()["config"]["shuffle_block"]
    assert block is None or resolved == block
    n = len(loader.components[0])
    steps = list(range(8))
    counts = count_requests(loader, hosts, 1.0, steps)
    assert (counts.shuffle, counts.block, counts.window) == ("blocks", (resolved,), window)
    seen: set[tuple[int, int, int]] = set()
    for i, step in enumerate(steps):
        size = (2 if step < 4 else 3) * lanes
        before = 2 * lanes * min(step, 4) + 3 * lanes * max(step - 4, 0)
        touched: list[dict[str, set[int]]] = [
            {"encoded_tokens": set(), "seq_starts": set()} for _ in range(hosts)
        ]
        for row in loader.provenance(step):
            if row.get("padding"):
                continue
            j = row["sample"] - before
            placed = (j % lanes) * (size // lanes) + j // lanes
            assert row["row"] == placed
            h = placed // (size // hosts)
            b = row["record"] // resolved
            if (h, row["epoch"], b) not in seen:
                seen.add((h, row["epoch"], b))
                add_block(touched[h], ft, k, b, resolved, n, packing, seq_len)
        for h in range(hosts):
            found = (counts.reads.requests[i, h], counts.reads.bytes[i, h])
            assert found == brute_force(k, touched[h])


def test_the_ramp_of_a_fresh_bucket() -> None:
    assert ramp_minutes(0) == ramp_minutes(4999.0) == ramp_minutes(5000) == 0
    assert ramp_minutes(10_000) == 20
    assert ramp_minutes(40_000) == 60
    assert ramp_minutes(5000 * 2**0.5) == pytest.approx(10)
    assert ramp_minutes(160_000, initial=1000, doubling=10) == pytest.approx(10 * math.log2(160))


def test_bad_values_are_named() -> None:
    loader = ftj.Loader(store(1), ftj.LoaderConfig(batch_size=6, seq_len=16))
    with pytest.raises(ValueError, match="hosts: 4 hosts do not split step 0's batch of 6"):
        count_requests(loader, 4, 1.0)
    with pytest.raises(ValueError, match="hosts must be an int >= 1"):
        count_requests(loader, 0, 1.0)
    with pytest.raises(ValueError, match="step_seconds must be > 0"):
        count_requests(loader, 2, 0)


def test_the_counterpart_is_the_other_shuffle() -> None:
    full = ftj.LoaderConfig(batch_size=6, seq_len=16, seed=3)
    blocks = dataclasses.replace(full, shuffle="blocks", shuffle_block=5, shuffle_window=2)
    of_full = counterpart(ftj.Loader(store(1), full).engine)
    assert of_full.config == dataclasses.replace(full, shuffle="blocks")
    default = ftj.Loader(store(1), dataclasses.replace(full, shuffle="blocks"))
    assert of_full.sources.fingerprint() == default.fingerprint()
    assert counterpart(ftj.Loader(store(1), blocks).engine).config == full


@pytest.mark.remote
def test_the_counts_match_the_requests_measured_on_fake_gcs(gcs: str) -> None:
    """``scripts/bench_requestcount.py`` in a process of its own (tensorstore
    reads the server's address at its first gcs open): per step of 32
    random 2048-token windows, the count is an upper bound that
    chunks cached by earlier steps lower by at most a few, and the count
    itself sends no request."""
    found = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "bench_requestcount.py"),
            "--json",
            "--servers",
            "gcs",
            "--gcs",
            gcs,
            "--formats",
            "small",
            "--tokens",
            str(1 << 22),
            "--steps",
            "4",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        check=True,
    )
    checked = json.loads(found.stdout.strip().splitlines()[-1])["gcs/small"]
    assert checked["count_requests"] == 0
    for r in checked["steps"]:
        assert r["counted_requests"] >= 32  # 32 windows of 2048 tokens: a run each at least
        assert r["counted_requests"] - 3 <= r["measured_requests"] <= r["counted_requests"]
        assert 0.9 * r["counted_bytes"] <= r["measured_bytes"] <= r["counted_bytes"]


def test_the_command_prints_the_counts(tmp_path: Path) -> None:
    """Unshuffled rows of 64 tokens in chunks of 64 and shards of 16 chunks:
    each of 2 hosts reads 4 consecutive rows a step (5 chunks, 4 at step 0),
    one request unless the chunks cross a shard (host 0 at step 2): 9
    requests and 39 chunks of 260 bytes over steps 0 to 3. Beside it the
    block shuffle at the default block: 2**18 tokens of 64-token windows,
    4096, more than the 78 windows there are, so both hosts read the one
    block, 78 chunks in 5 shards, at step 0 (10 requests), then nothing."""
    fmt = ftj.StorageFormat(shard_tokens=1024, chunk_tokens=64)
    ftj.write_dataset(tmp_path / "ds", {"train": [[7] * 50] * 100}, storage_format=fmt)
    run = tmp_path / "run.yaml"
    run.write_text(
        f"data: {{datasets: {{web: {{url: {tmp_path / 'ds'}, weight: 1}}}}}}\n"
        "loader: {batch_size: 8, seq_len: 64, shuffle: false}\n"
    )
    flags = ["--hosts", "2", "--step-seconds", "0.25", "--sample-steps", "4"]
    code, out, err = run_main("preview", str(run), "--requests", *flags)
    assert (code, err) == (0, "")
    head, row, blocks = out.splitlines()[:3]
    assert head.split()[:3] == ["shuffle", "requests/step", "requests/s"]
    # 9 requests / 4 steps; 39 * 260 / 4 bytes a step; 8 rows of 64 4-byte tokens.
    assert " ".join(row.split()) == "none * 2 9 10.1 kB 8.19 kB 5.0 2 0 min"
    assert " ".join(blocks.split()) == "blocks B=4096 w=1 0 0 0 B 8.19 kB 0.0 10 0 min"
    assert "2 hosts, 0.25 s a step" in out
    run.write_text(run.read_text().replace("shuffle: false", "shuffle: blocks"))
    code, out, err = run_main("preview", str(run), "--requests", *flags)
    assert (code, err) == (0, "")
    full, blocks = out.splitlines()[1:3]
    assert full.split()[0] == "full"
    assert " ".join(blocks.split()) == "blocks B=4096 w=1 * 0 0 0 B 8.19 kB 0.0 10 0 min"
    code, _, err = run_main(
        "preview", str(run), "--requests", "--hosts", "3", "--step-seconds", "1"
    )
    assert code == 1
    assert "--hosts: 3 hosts do not split step 0's batch of 8 rows" in err
    code, _, err = run_main("preview", str(run), "--requests", "--hosts", "2")
    assert code == 1 and "give --step-seconds" in err
