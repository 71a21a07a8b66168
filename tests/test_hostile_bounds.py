"""Issue 27, bounds: sizes over what the machine can hold, special files, plans of other data.

Each test fails on the code before the fix. Whatever could hang or grow without
bound on that code runs in a subprocess with a timeout and an address-space
limit, so a regression fails the test instead of blocking the suite or the
machine.
"""

from __future__ import annotations

import itertools
import logging
import os
import shutil
import subprocess
import sys
import textwrap
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import flat_tokens_jax as ftj
from flat_tokens_jax.core import limits
from flat_tokens_jax.core.limits import READ_BYTES_PER_TOKEN, ROW_BYTES, STEP_BYTES
from flat_tokens_jax.data.binpack import build_plan
from flat_tokens_jax.data.bins import BinRecords
from flat_tokens_jax.data.plans import (
    PLAN_ARRAYS,
    PLAN_ATTRIBUTE,
    PackingPlan,
    make_plan,
    plan_group,
)
from flat_tokens_jax.data.validation import summary
from flat_tokens_jax.store.storageformat import StorageFormat, create_array

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 3 << 30  # address space of a subprocess: the old code ran out of it, not of the machine


def python(code: str, timeout: float = 120, cwd: Path | None = None) -> tuple[int, str]:
    """Runs ``code`` in a fresh interpreter limited to :data:`LIMIT` bytes of address
    space; ``(exit status, stdout + stderr)``; a timeout fails the test."""
    prelude = (
        "import resource\n"
        f"resource.setrlimit(resource.RLIMIT_AS, ({LIMIT}, {LIMIT}))\n"
        "import sys\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    try:
        done = subprocess.run(
            [sys.executable, "-c", prelude + textwrap.dedent(code)],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            cwd=cwd,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"hung for {timeout} s:\n{code}")
    return done.returncode, done.stdout + done.stderr


def cli(*args: str, timeout: float = 120) -> tuple[int, str]:
    return python(
        f"from flat_tokens_jax.cli import main\nsys.exit(main({list(args)!r}))", timeout=timeout
    )


def write(path: Path, lengths: list[int], **splits: list[int]) -> Path:
    """A local dataset whose train split has sequences of ``lengths`` (other
    splits from ``splits``), small shards so that there are several."""

    def seqs(ls: list[int]) -> list[np.ndarray]:
        return [(np.arange(n) * 7 + i) % 1000 for i, n in enumerate(ls)]

    data = {"train": seqs(lengths), **{k: seqs(v) for k, v in splits.items()}}
    ftj.write_dataset(
        path, data, storage_format=ftj.StorageFormat(shard_tokens=256, chunk_tokens=32)
    )
    return path


def lengths_of(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(1, 40, n).tolist()


# Finding 5: work bounded by the data and the machine, not by a size from the user.


def test_the_packing_plan_takes_memory_by_sequences_not_seq_len() -> None:
    lengths = np.array(lengths_of(2000))
    tracemalloc.start()
    try:
        build_plan(lengths, 10**7)  # the old plan made 10**7 + 1 lists: ~600 MB
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 20 << 20


# Past int64, or a little past the total: the code before the fix allocated per
# seq_len, so a test of it may not try the sizes in between.
@given(
    st.lists(st.integers(0, 50), max_size=40),
    st.one_of(st.integers(0, 1000), st.integers(2**63, 2**70)),
)
def test_a_seq_len_past_every_sequence_packs_as_the_smallest_that_holds_them_all(
    lengths: list[int], extra: int
) -> None:
    # Brute force: once every bin can take all tokens, seq_len no longer matters.
    total = max(sum(lengths), 1)
    got = build_plan(np.array(lengths, np.int64), total + extra)
    want = build_plan(np.array(lengths, np.int64), total)
    assert [a.tolist() for a in got] == [a.tolist() for a in want]


@pytest.mark.parametrize("seq_len", [str(10**18), str(2**63)])
def test_pack_refuses_a_seq_len_no_row_can_hold(tmp_path: Path, seq_len: str) -> None:
    url = write(tmp_path / "ds", lengths_of(50), validation=lengths_of(20, 1))
    code, out = cli("pack", str(url), "--seq-len", seq_len)
    assert code == 1, out
    assert "Traceback" not in out and len(out.strip().splitlines()) == 1, out
    assert "seq_len" in out and "memory" in out and "at most" in out
    assert not (url / "train" / f"bins_{seq_len}").exists()


def test_a_grain_source_refuses_rows_over_memory_before_building(tmp_path: Path) -> None:
    url = write(tmp_path / "ds", lengths_of(50), validation=lengths_of(20, 1))
    code, out = python(
        f"""
        from flat_tokens_jax.grain.grain import FlatTokensSource
        for packing in ("bins", True, False):
            try:
                FlatTokensSource({str(url)!r}, 10**12, packing)
            except ValueError as e:
                print("refused", packing, e)
        """
    )
    assert code == 0, out
    assert out.count("refused") == 3, out
    assert "seq_len=1,000,000,000,000" in out and "at most" in out


def test_show_refuses_a_batch_over_memory(tmp_path: Path) -> None:
    url = write(tmp_path / "ds", lengths_of(50), validation=lengths_of(20, 1))
    code, out = cli("show", str(url), "--step", "0", "--batch-size", "100000000", "--seq-len", "8")
    assert code == 1, out
    assert "Traceback" not in out and len(out.strip().splitlines()) == 1, out
    assert "100,000,000" in out and "--batch-size of at most" in out


def test_loaders_refuse_steps_over_memory_before_allocating(tmp_path: Path) -> None:
    url = write(tmp_path / "ds", lengths_of(50), validation=lengths_of(20, 1))
    code, out = python(
        f"""
        import flat_tokens_jax as ftj
        ft = ftj.open_dataset({str(url)!r})["train"]
        for name, run in [
            ("batch", lambda: ftj.Loader(ft, ftj.LoaderConfig(batch_size=10**10, seq_len=16))),
            ("schedule", lambda: ftj.Loader(
                ft, ftj.LoaderConfig(batch_size=[(0, 4), (9, 10**10)], seq_len=16))),
            ("prefetch", lambda: [
                ftj.Loader(ft, ftj.LoaderConfig(batch_size=4, seq_len=16, prefetch=10**9)
                ).batch(s) for s in range(3)]),
        ]:
            try:
                run()
                print(name, "accepted")
            except ValueError as e:
                print(name, "refused:", e)
        """
    )
    assert code == 0, out
    for name in ("batch", "schedule", "prefetch"):
        line = next(x for x in out.splitlines() if x.startswith(name))
        assert "refused:" in line and "memory" in line and "at most" in line, out
    assert "prefetch 1,000,000,000" in out


def test_a_mixture_period_past_its_bound_is_refused_before_allocating(tmp_path: Path) -> None:
    url = write(tmp_path / "ds", lengths_of(50), validation=lengths_of(20, 1))
    code, out = python(
        f"""
        import flat_tokens_jax as ftj
        ds = ftj.open_dataset({str(url)!r})
        try:
            ftj.Mixture({{"a": (ds["train"], 1), "b": (ds["validation"], 2)}}, period=10**12)
            print("accepted")
        except ValueError as e:
            print("refused:", e)
        """
    )
    assert code == 0, out
    assert "refused: Mixture.period must be an int in [1, 16777216]" in out


# Issue 35: the estimate of a step counts every field of its layout.


def test_the_memory_estimate_counts_every_field_of_the_layout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step that fits in memory as the five fields but not as MaxText's six
    arrays, ``sequence_start`` and ``segment_lengths``: the second is refused
    (by ``Loader``), the first is not. The rows' bytes are
    measured on real batches."""
    url = write(tmp_path / "ds", lengths_of(50))
    ft = ftj.open_dataset(url)["train"]
    seq_len, rows = 64, 1000
    wide = {"layout": "maxtext", "sequence_start": True, "max_segments": seq_len}

    def row_nbytes(**kw: Any) -> int:
        batch = ftj.Loader(ft, ftj.LoaderConfig(2, seq_len, **kw)).host_batch(0)
        return sum(v.nbytes for v in batch.values()) // 2

    plain, widest = row_nbytes(), row_nbytes(**wide)
    assert widest > plain
    reading = rows * (seq_len * READ_BYTES_PER_TOKEN + ROW_BYTES) + STEP_BYTES
    monkeypatch.setattr(limits, "memory_bytes", lambda: reading + rows * (plain + widest) // 2)
    ftj.Loader(ft, ftj.LoaderConfig(rows, seq_len, prefetch=0))
    with pytest.raises(ValueError, match=r"LoaderConfig batch_size 1,000 .*memory.*at most"):
        ftj.Loader(ft, ftj.LoaderConfig(rows, seq_len, prefetch=0, **wide))


# Finding 6 (and 9: a shard that is a folder): special files refused at open, no hang.

SPECIAL = [
    "zarr.json",
    "train/zarr.json",
    "train/encoded_tokens/zarr.json",
    "train/encoded_tokens/c/1",
    "train/seq_starts/c/0",
]
KINDS = ["fifo", "folder"]


@pytest.fixture(scope="module")
def special_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, str]]:
    """For each key of :data:`SPECIAL` and each kind of :data:`KINDS`, a dataset
    whose file at that key is replaced by a FIFO or a folder, opened three ways
    (validate, info, a loader's batch) in one subprocess: by ``f"{key} {kind}"``,
    the dataset and the subprocess's output, a line ``f"{key} {kind} {way} ..."``
    for each way; a hang on any of them fails every test."""
    urls: dict[str, Path] = {}
    for key, kind in itertools.product(SPECIAL, KINDS):
        folder = tmp_path_factory.mktemp("special")
        url = write(folder / "ds", lengths_of(60), validation=lengths_of(20, 1))
        path = url / key
        path.unlink()
        if kind == "fifo":
            os.mkfifo(path)
        else:
            path.mkdir()
        urls[f"{key} {kind}"] = url
    cases = {case: str(url) for case, url in urls.items()}
    code, out = python(
        f"""
        import flat_tokens_jax as ftj
        from flat_tokens_jax.store.options import StoreError
        from flat_tokens_jax.data.validation import summary
        for case, url in {cases!r}.items():
            for name, run in [
                ("validate", lambda: ftj.validate(url)),
                ("info", lambda: summary(url)),
                ("loader", lambda: ftj.Loader(
                    ftj.open_dataset(url)["train"],
                    ftj.LoaderConfig(batch_size=4, seq_len=16, prefetch=0, shuffle=False),
                ).host_batch(0)),
            ]:
                try:
                    run()
                    print(case, name, "accepted", flush=True)
                except (ftj.FormatError, StoreError) as e:
                    print(case, name, "refused:", e, flush=True)
        """,
        timeout=120,
    )
    assert code == 0, out
    return {case: (url, out) for case, url in urls.items()}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("key", SPECIAL)
def test_a_special_file_in_the_store_is_refused_naming_it(
    special_files: dict[str, tuple[Path, str]], key: str, kind: str
) -> None:
    case = f"{key} {kind}"
    url, out = special_files[case]
    path = url / key
    what = "FIFO" if kind == "fifo" else "folder"
    for name in ("validate", "info", "loader"):
        line = next(x for x in out.splitlines() if x.startswith(f"{case} {name} "))
        assert f"refused: {path}: is a {what}" in line, out


def test_a_fifo_in_the_plan_cache_is_passed_over(tmp_path: Path) -> None:
    url = write(tmp_path / "ds", lengths_of(60), validation=lengths_of(20, 1))
    cache = tmp_path / "cache"
    cfg = ftj.LoaderConfig(batch_size=4, seq_len=64, packing="bins", prefetch=0)
    want = ftj.Loader(ftj.open_dataset(url)["train"], cfg, plan_cache=cache).host_batch(2)
    (entry,) = cache.iterdir()
    entry.unlink()
    os.mkfifo(entry)
    code, out = python(
        f"""
        import flat_tokens_jax as ftj
        cfg = ftj.LoaderConfig(batch_size=4, seq_len=64, packing="bins", prefetch=0)
        ft = ftj.open_dataset({str(url)!r})["train"]
        batch = ftj.Loader(ft, cfg, plan_cache={str(cache)!r}).host_batch(2)
        print(batch["targets"].tolist())
        """,
        timeout=60,
    )
    assert code == 0, out
    assert str(want["targets"].tolist()) in out
    assert f"ignoring the cached packing plan {entry}: it is a FIFO" in out
    assert entry.is_file()  # the rebuilt plan took its place


# Finding 8 (part): an empty plan_cache, and the fill of a plan.


def test_an_empty_plan_cache_is_refused_naming_the_field(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = write(tmp_path / "ds", lengths_of(60), validation=lengths_of(20, 1))
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    cfg = ftj.LoaderConfig(batch_size=4, seq_len=64, packing="bins", prefetch=0)
    with pytest.raises(ValueError, match="plan_cache is ''"):
        ftj.Loader(ftj.open_dataset(url)["train"], cfg, plan_cache="")
    assert list(work.iterdir()) == []


@pytest.mark.parametrize("seq_len", [8, 16, 100])
def test_info_reports_the_fill_of_a_plan_with_truncated_sequences(
    tmp_path: Path, seq_len: int
) -> None:
    lengths = lengths_of(300)
    url = write(tmp_path / "ds", lengths, validation=lengths_of(20, 1))
    (plan,) = ftj.pack_dataset(url, seq_len, splits=["train"]).values()
    # Brute force: tokens the bins hold, each sequence cut to seq_len.
    held = sum(min(n, seq_len) for n in lengths)
    filled = summary(url)["splits"]["train"]["packing_plans"][str(seq_len)]["filled"]
    assert filled == pytest.approx(held / (plan.num_bins * seq_len))
    assert filled <= 1
    code, out = cli("info", str(url))
    assert code == 0, out
    assert f"({held / (plan.num_bins * seq_len):.1%} filled)" in out


# Finding 9 (part): one-line errors instead of tracebacks.


def test_validate_names_a_plan_with_empty_trailing_bins(tmp_path: Path) -> None:
    url = write(tmp_path / "ds", lengths_of(60), validation=lengths_of(20, 1))
    ft = ftj.open_dataset(url)["train"]
    plan = make_plan(ft, 64)
    # The same plan with two empty bins at the end, stored whole with its own digest.
    starts = np.append(plan.bin_starts, [plan.bin_starts[-1]] * 2)
    bad = PackingPlan(64, plan.algorithm, starts, plan.seq_order, plan.source)
    group = plan_group("train", 64)
    for name, values in zip(PLAN_ARRAYS, (bad.bin_starts, bad.seq_order), strict=True):
        array = create_array(
            ft.store, group, name, np.dtype("<i8"), StorageFormat(), size=values.size
        )
        ft.store.wait(array[: values.size].write(values))
    ft.store.write_group(group, 3, {PLAN_ATTRIBUTE: bad.attributes()})
    with pytest.raises(ftj.FormatError, match="is empty"):
        ftj.validate(url)
    code, out = cli("validate", str(url))
    assert code == 1 and "Traceback" not in out and "is empty" in out, out


def test_a_truncated_cache_entry_is_built_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    url = write(tmp_path / "ds", lengths_of(60), validation=lengths_of(20, 1))
    cache = tmp_path / "cache"
    cfg = ftj.LoaderConfig(batch_size=4, seq_len=64, packing="bins", prefetch=0)
    ft = ftj.open_dataset(url)["train"]
    want = ftj.Loader(ft, cfg, plan_cache=cache).host_batch(1)
    (entry,) = cache.iterdir()
    entry.write_bytes(entry.read_bytes()[:100])
    with caplog.at_level(logging.WARNING, logger="flat_tokens_jax.data.plans"):
        got = ftj.Loader(ft, cfg, plan_cache=cache).host_batch(1)
    assert got["targets"].tolist() == want["targets"].tolist()
    assert f"ignoring the unreadable cached packing plan {entry}" in caplog.text
    assert np.load(entry)["seq_order"].size == ft.num_sequences  # written whole again


# Finding 10 (part): a plan is tied to the sequences it was made from.


def moved_boundary(lengths: list[int], seq_len: int) -> list[int]:
    """``lengths`` with one sequence bound moved, between the sequences whose
    bounds a plan samples (so the counts and the sample stay equal), such that
    the plan of the result overflows a bin of ``lengths`` (brute force)."""
    n = len(lengths)
    probes = set(np.unique(np.linspace(0, n, 64).astype(np.int64)).tolist())
    for k in (k for k in range(n // 2, n) if k not in probes):
        for d in range(1, lengths[k]):
            out = list(lengths)
            out[k - 1] += d
            out[k] -= d
            starts, order = build_plan(np.array(out), seq_len)
            bins = [order[a:b] for a, b in itertools.pairwise(starts)]
            if any(sum(min(lengths[i], seq_len) for i in b) > seq_len for b in bins):
                return out
    raise AssertionError("no such bound")


def test_a_stored_plan_of_other_sequences_with_equal_counts_is_refused_at_open(
    tmp_path: Path,
) -> None:
    ours = lengths_of(400)
    theirs = moved_boundary(ours, 64)
    a = write(tmp_path / "a", theirs, validation=[5, 6])
    b = write(tmp_path / "b", ours, validation=[5, 6])
    ftj.pack_dataset(a, 64, splits=["train"])
    shutil.copytree(a / plan_group("train", 64), b / plan_group("train", 64))
    ft = ftj.open_dataset(b)["train"]
    cfg = ftj.LoaderConfig(batch_size=8, seq_len=64, packing="bins", prefetch=0)
    with pytest.raises(ftj.FormatError, match=r"made from split 'train'.*not from FlatTokens"):
        ftj.Loader(ft, cfg, plan_cache=None)
    with pytest.raises(ftj.FormatError, match="made from split 'train'"):
        ftj.validate(b)


def test_a_plan_of_another_split_is_refused_naming_both(tmp_path: Path) -> None:
    ours = lengths_of(400)
    url = write(tmp_path / "ds", ours, validation=moved_boundary(ours, 64))
    ds = ftj.open_dataset(url)
    foreign = make_plan(ds["validation"], 64)
    with pytest.raises(ftj.FormatError) as e:
        BinRecords(ds["train"], 64, plan=foreign)
    assert "made from split 'validation'" in str(e.value)
    assert "split='train'" in str(e.value)


def test_a_plan_is_checked_by_its_digest_then_bin_by_bin(tmp_path: Path) -> None:
    ours = lengths_of(400)
    url = write(tmp_path / "ds", ours, validation=moved_boundary(ours, 64))
    ds = ftj.open_dataset(url)
    mine = make_plan(ds["train"], 64)
    plan = type(mine)
    # Without the digest of its bounds a plan cannot be tied to a split: refused.
    partial = {k: v for k, v in mine.source.items() if k != "starts_digest"}
    with pytest.raises(ftj.FormatError, match=r"records no digest .*source.starts_digest"):
        BinRecords(
            ds["train"], 64, plan=plan(64, mine.algorithm, mine.bin_starts, mine.seq_order, partial)
        )
    # The bins of the other split's plan under this split's digest: each bin is
    # still checked against this split's lengths.
    foreign = make_plan(ds["validation"], 64)
    mixed = plan(64, mine.algorithm, foreign.bin_starts, foreign.seq_order, dict(mine.source))
    with pytest.raises(ftj.FormatError, match="holds more than seq_len=64"):
        BinRecords(ds["train"], 64, plan=mixed)
    records = BinRecords(ds["train"], 64, plan=mine)
    assert len(records) == mine.num_bins
    windows = records.read(np.arange(len(records)))
    assert windows.lengths is not None and windows.lengths.sum() == sum(min(n, 64) for n in ours)
