"""Stored and cached packing plans: pack, info, validate, and plans that do not fit."""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest
import tensorstore as ts

import flat_tokens_jax as ftj
from flat_tokens_jax.cli import main
from flat_tokens_jax.data.binpack import ALGORITHM, build_plan
from flat_tokens_jax.data.bins import BinRecords
from flat_tokens_jax.data.plans import cached_plan, pack_dataset, read_stored_plan
from flat_tokens_jax.store.claim import MARKER, Claim


def seqs(n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 99, rng.integers(1, 30)) for _ in range(n)]


@pytest.fixture
def dataset(tmp_path: Path) -> Path:
    path = tmp_path / "ds"
    ftj.write_dataset(path, {"train": seqs(200), "validation": seqs(10, 1)})
    return path


def test_pack_stores_the_plan_that_loaders_use(dataset: Path, tmp_path: Path) -> None:
    plans = pack_dataset(dataset, 32)
    assert set(plans) == {"train", "validation"}
    ft = ftj.open_dataset(dataset)["train"]
    lengths = np.array([s.size for s in ft.sequences(range(ft.num_sequences))])
    starts, order = build_plan(lengths, 32)
    stored = read_stored_plan(ft, 32)
    assert stored is not None and stored.algorithm == ALGORITHM and stored.seq_len == 32
    np.testing.assert_array_equal(stored.bin_starts, starts)
    np.testing.assert_array_equal(stored.seq_order, order)
    records = BinRecords(ft, 32, cache_dir=tmp_path / "cache")
    assert records.plan.digest == plans["train"].digest
    assert not (tmp_path / "cache").exists(), "a stored plan needs no cache"
    attrs = json.loads((dataset / "train" / "bins_32" / "zarr.json").read_text())["attributes"]
    plan = attrs["flat_tokens_packing_plan"]
    assert plan["num_bins"] == starts.size - 1 and plan["source"]["num_sequences"] == 200
    ftj.validate(dataset)
    info = ftj.summary(dataset)["splits"]["train"]["packing_plans"]
    assert info["32"]["digest"] == plans["train"].digest


def test_a_stored_plan_of_other_data_is_refused_with_what_differs(
    dataset: Path, tmp_path: Path
) -> None:
    pack_dataset(dataset, 32)
    other = tmp_path / "other"
    ftj.write_dataset(other, {"train": seqs(201), "validation": seqs(10, 1)})
    shutil.copytree(dataset / "train" / "bins_32", other / "train" / "bins_32")
    ft = ftj.open_dataset(other)["train"]
    differs = r"num_sequences: plan 200, data 201.*rebuild it: flat-tokens pack"
    with pytest.raises(ftj.FormatError, match=differs):
        BinRecords(ft, 32, cache_dir=tmp_path / "cache")
    with pytest.raises(ftj.FormatError, match="train/bins_32: packing plan does not match"):
        ftj.validate(other)


def test_a_stored_plan_for_another_seq_len_is_refused(dataset: Path, tmp_path: Path) -> None:
    pack_dataset(dataset, 32)
    shutil.copytree(dataset / "train" / "bins_32", dataset / "train" / "bins_64")
    ft = ftj.open_dataset(dataset)["train"]
    with pytest.raises(ftj.FormatError, match="seq_len: plan 32, data 64"):
        BinRecords(ft, 64, cache_dir=tmp_path / "cache")
    assert len(BinRecords(ft, 32)) > 0


def test_validate_finds_a_broken_plan(dataset: Path) -> None:
    pack_dataset(dataset, 32)
    ft = ftj.open_dataset(dataset)["train"]
    plan = read_stored_plan(ft, 32)
    assert plan is not None
    # Still a permutation, but bins now overflow and the digest no longer matches.
    order = plan.seq_order[::-1].copy()
    store = ftj.open_dataset(dataset).store
    spec = {"driver": "zarr3", "kvstore": store.sub("train/bins_32/seq_order"), "open": True}
    ts.open(spec).result().write(order).result()
    with pytest.raises(ftj.FormatError, match="digest") as e:
        ftj.validate(dataset)
    assert any("more than seq_len=32" in str(p) for p in e.value.problems)


def test_an_interrupted_pack_leaves_no_plan(dataset: Path, tmp_path: Path) -> None:
    pack_dataset(dataset, 32)
    (dataset / "train" / "bins_32" / "zarr.json").unlink()  # metadata is written last
    ft = ftj.open_dataset(dataset)["train"]
    assert read_stored_plan(ft, 32) is None
    assert "32" not in ftj.summary(dataset)["splits"]["train"]["packing_plans"]
    ftj.validate(dataset)
    assert len(BinRecords(ft, 32, cache_dir=tmp_path / "cache")) > 0


def test_the_cache_is_used_only_for_the_same_data(dataset: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    ft = ftj.open_dataset(dataset)["train"]
    first = cached_plan(ft, 16, cache)
    files = list(cache.iterdir())
    assert len(files) == 1
    again = cached_plan(ft, 16, cache)
    assert again.digest == first.digest and list(cache.iterdir()) == files
    assert cached_plan(ft.view(0, 100), 16, cache).num_bins < first.num_bins
    assert len(list(cache.iterdir())) == 2, "a view has its own entry"
    # The same URL with other data: a new entry, never the old plan.
    ftj.write_dataset(dataset, {"train": seqs(200, 7)}, overwrite=True)
    changed = ftj.open_dataset(dataset)["train"]
    assert cached_plan(changed, 16, cache).digest != first.digest
    assert len(list(cache.iterdir())) == 3
    # An entry whose key does not match its name is not trusted.
    for f in cache.iterdir():
        f.write_bytes(files[0].read_bytes())
    assert cached_plan(changed, 16, cache).digest != first.digest


@pytest.mark.parametrize("source", [None, "[1, 2]"], ids=["no source", "not a mapping"])
def test_a_cache_entry_of_another_shape_is_built_again(
    dataset: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, source: str | None
) -> None:
    cache = tmp_path / "cache"
    ft = ftj.open_dataset(dataset)["train"]
    cached_plan(ft, 16, cache)
    (entry,) = cache.iterdir()
    # A valid plan, one sequence a bin, which the packing algorithm never makes:
    # were the entry used, it would come back.
    n = ft.num_sequences
    fields = {
        "key": np.load(entry)["key"],
        "bin_starts": np.arange(n + 1),
        "seq_order": np.arange(n),
    }
    if source is not None:
        fields["source"] = np.array(source)
    with entry.open("wb") as f:
        np.savez(f, **fields)
    with caplog.at_level("WARNING", logger="flat_tokens_jax.data.plans"):
        plan = cached_plan(ft, 16, cache)
    assert f"ignoring the unreadable cached packing plan {entry}" in caplog.text
    lengths = np.array([s.size for s in ft.sequences(range(n))])
    starts, order = build_plan(lengths, 16)
    assert plan.num_bins < n
    np.testing.assert_array_equal(plan.bin_starts, starts)
    np.testing.assert_array_equal(plan.seq_order, order)
    with np.load(entry) as f:  # written again, whole
        assert json.loads(str(f["source"]))["num_sequences"] == n
        np.testing.assert_array_equal(f["seq_order"], order)


def test_cli_pack_info_validate_show(
    dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["pack", str(dataset), "--seq-len", "48", "--split", "train"]) == 0
    out = capsys.readouterr().out
    assert f"{dataset}/train/bins_48: " in out and "of 200 sequences" in out
    assert not (dataset / "validation" / "bins_48").exists()
    assert main(["info", str(dataset)]) == 0
    assert "packing plan seq_len 48:" in capsys.readouterr().out
    assert main(["validate", str(dataset)]) == 0
    capsys.readouterr()
    args = ["show", str(dataset), "--step", "0", "--batch-size", "2", "--seq-len", "48"]
    assert main([*args, "--bins", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["config"]["packing"] == "bins"
    assert max(max(r["segment_ids"]) for r in shown["rows"]) > 1
    assert main(["pack", str(tmp_path / "nothing"), "--seq-len", "8"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("pack: ") and "no flat-tokens dataset here" in err
    assert err.count("\n") == 1


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_pack_zarr_v2_and_an_empty_split(tmp_path: Path, zarr_format: int) -> None:
    path = tmp_path / "ds"
    ftj.write_dataset(
        path, {"train": seqs(50)}, storage_format=ftj.StorageFormat(zarr_format=zarr_format)
    )
    plans = ftj.pack_dataset(path, 16)
    assert plans["validation"].num_bins == 0 and plans["train"].num_bins > 0
    ftj.validate(path)
    info = ftj.summary(path)["splits"]
    assert info["validation"]["packing_plans"]["16"]["num_bins"] == 0
    ft = ftj.open_dataset(path)["train"]
    assert BinRecords(ft, 16).plan.digest == plans["train"].digest


def test_an_unwritable_cache_still_gives_the_plan(dataset: Path, tmp_path: Path) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    ft = ftj.open_dataset(dataset)["train"]
    plan = cached_plan(ft, 16, blocked / "cache")
    assert plan.digest == cached_plan(ft, 16, tmp_path / "cache").digest


def stored_equals_reference(dataset: Path, seq_len: int) -> bool:
    ft = ftj.open_dataset(dataset)["train"]
    lengths = np.array([s.size for s in ft.sequences(range(ft.num_sequences))])
    starts, order = build_plan(lengths, seq_len)
    stored = read_stored_plan(ft, seq_len)
    return (
        stored is not None
        and np.array_equal(stored.bin_starts, starts)
        and np.array_equal(stored.seq_order, order)
    )


def test_a_pack_while_another_write_runs_is_refused_in_one_line(
    dataset: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 35: two packs at once deleted and wrote one plan's files under
    each other, and one ended in a raw tensorstore message."""
    ds = ftj.open_dataset(dataset)
    running = Claim(ds.store, ds.splits)  # what a pack (or a conversion) holds while it writes
    assert running.create()
    try:
        assert main(["pack", str(dataset), "--seq-len", "32"]) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"pack: {dataset}: another write to it is in progress (marker ")
        assert f"by pid {os.getpid()}" in err and "run pack again when it has finished" in err
        assert len(err.strip().splitlines()) == 1 and "tensorstore" not in err
        assert read_stored_plan(ds["train"], 32) is None
    finally:
        running.release()
    assert main(["pack", str(dataset), "--seq-len", "32"]) == 0
    assert stored_equals_reference(dataset, 32)
    assert not (dataset / MARKER).exists(), "pack drops its marker"


def test_a_dead_packs_marker_does_not_block_the_next(dataset: Path) -> None:
    (dataset / MARKER).write_text('{"writer": "gone", "pid": 1}')  # not locked: its writer died
    pack_dataset(dataset, 32)
    assert stored_equals_reference(dataset, 32)
    assert not (dataset / MARKER).exists()


def test_packs_at_once_leave_one_plan_and_say_why_they_stopped(dataset: Path) -> None:
    def pack(outcomes: list[str]) -> None:
        try:
            pack_dataset(dataset, 32)
            outcomes.append("packed")
        except FileExistsError as e:
            outcomes.append(str(e))
        except Exception as e:  # what two packs at once gave before: a raw tensorstore error
            outcomes.append(f"{type(e).__name__}: {e}")

    for _ in range(3):
        outcomes: list[str] = []
        threads = [threading.Thread(target=pack, args=(outcomes,)) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(outcomes) == 2 and "packed" in outcomes, outcomes
        assert all(o == "packed" or "another write to it is in progress" in o for o in outcomes)
        assert stored_equals_reference(dataset, 32)
