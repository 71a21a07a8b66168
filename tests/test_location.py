"""Claiming an output: overwrite deletes only our own keys, racing writers,
outputs overlapping inputs, and cleaning up a failed final write."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import pickle
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import zarr
from commands import run_main
from memurls import memory_url
from textdata import files

import flat_tokens_jax as ftj
from flat_tokens_jax.convert.chat import convert_chat
from flat_tokens_jax.convert.megatron import export_megatron, import_megatron
from flat_tokens_jax.convert.merge import merge
from flat_tokens_jax.convert.text import convert
from flat_tokens_jax.store.location import MARKER, OverwriteNeeded
from flat_tokens_jax.store.options import StoreError
from flat_tokens_jax.store.store import Store

SMALL = ftj.StorageFormat(shard_tokens=1 << 10, chunk_tokens=1 << 6)


def tokens(url: str | Path) -> list[list[int]]:
    ft = ftj.open_dataset(url)["train"]
    return [s.tolist() for s in ft.sequences(np.arange(ft.num_sequences))]


def good_jsonl(path: Path) -> Path:
    path.write_text("".join(json.dumps({"text": f"hello {i}"}) + "\n" for i in range(3)))
    return path


def test_cli_overwrite_keeps_files_that_are_not_ours(tmp_path: Path, eos_tokenizer: Path) -> None:
    """The issue's reproduction: README.md next to a train/ folder of images."""
    proj = tmp_path / "proj"
    (proj / "train").mkdir(parents=True)
    (proj / "train" / "img.png").write_text("x")
    (proj / "README.md").write_text("hi")
    good = good_jsonl(tmp_path / "good.jsonl")
    before = files(proj)
    code, _, err = run_main(
        "convert", str(good), str(proj), "--tokenizer", str(eos_tokenizer), "--overwrite"
    )
    assert code == 1
    assert len([x for x in err.splitlines() if x.startswith("convert:")]) == 1
    assert "README.md" in err and "train/img.png" in err
    assert "(README.md, train/img.png: 2 files in all)" in err and "refusing to delete them" in err
    assert files(proj) == before


def test_overwrite_refuses_a_sibling_dataset_and_another_zarr_group(tmp_path: Path) -> None:
    proj = tmp_path / "proj"
    ftj.write_dataset(proj / "sibling", {"train": [[1, 2]]})
    before = files(proj)
    with pytest.raises(FileExistsError, match=r"\(sibling/: 17 files in all\); refusing") as e:
        ftj.write_dataset(proj, {"train": [[3]]}, overwrite=True)
    assert not isinstance(e.value, OverwriteNeeded)
    assert files(proj) == before
    assert tokens(proj / "sibling") == [[1, 2]]

    group = zarr.open_group(str(tmp_path / "other"), mode="w")
    group.create_array("weights", shape=(4,), dtype="f4")[:] = 1.0
    before = files(tmp_path / "other")
    with pytest.raises(FileExistsError, match=r"\(weights/: 2 files in all\)"):
        ftj.write_dataset(tmp_path / "other", {"train": [[3]]}, overwrite=True)
    assert files(tmp_path / "other") == before


def test_a_file_inside_a_dataset_makes_overwrite_refuse(tmp_path: Path) -> None:
    url = tmp_path / "ds"
    ftj.write_dataset(url, {"train": [[1, 2]]}, loss_masks={"train": [[0, 1]]})
    (url / "train" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match=r"train/notes.txt"):
        ftj.write_dataset(url, {"train": [[3]]}, overwrite=True)
    assert tokens(url) == [[1, 2]]


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_an_old_dataset_without_the_attribute_is_still_overwritten(
    tmp_path: Path, zarr_format: int
) -> None:
    url = tmp_path / "ds"
    storage_format = ftj.StorageFormat(
        shard_tokens=1 << 10, chunk_tokens=1 << 6, zarr_format=zarr_format
    )
    ftj.write_dataset(
        url, {"train": [[1, 2]]}, loss_masks={"train": [[0, 1]]}, storage_format=storage_format
    )
    # What older versions wrote: no flat_tokens root attribute.
    meta = json.loads((url / "zarr.json").read_text()) if zarr_format == 3 else None
    if meta is not None:
        meta["attributes"].pop("flat_tokens", None)
        (url / "zarr.json").write_text(json.dumps(meta))
    ftj.write_dataset(url, {"train": [[5, 6, 7]]}, overwrite=True)
    assert tokens(url) == [[5, 6, 7]]
    assert ftj.open_dataset(url)["train"].loss_mask is None


def test_a_dataset_that_says_so_is_overwritten_with_its_own_splits(tmp_path: Path) -> None:
    url = tmp_path / "ds"
    ftj.write_dataset(
        url, {"train": [[1]], "test": [[2]]}
    )  # says {"flat_tokens": {"dataset": ...}}
    assert ftj.open_dataset(url).attributes["flat_tokens"]["dataset"] == "flat-tokens"
    ftj.write_dataset(url, {"train": [[3]]}, overwrite=True)
    assert tokens(url) == [[3]]
    assert not (url / "test").exists() or not files(url / "test")


def test_a_finished_write_leaves_no_marker_and_a_failed_one_nothing(tmp_path: Path) -> None:
    ftj.write_dataset(tmp_path / "ok", {"train": [[1]]})
    assert MARKER not in files(tmp_path / "ok")
    with (
        pytest.raises(RuntimeError),
        ftj.DatasetWriter(tmp_path / "bad", storage_format=SMALL) as w,
    ):
        w.extend("train", [[1, 2, 3]] * 500)
        raise RuntimeError("stop")
    assert files(tmp_path / "bad") == {}


def test_a_refusal_names_five_foreign_files_and_counts_them_all(tmp_path: Path) -> None:
    for i in range(7):
        (tmp_path / f"f{i}.txt").write_text("x")
    with pytest.raises(
        FileExistsError, match=r"\(f0.txt, f1.txt, f2.txt, f3.txt, f4.txt, \.\.\.: 7 files in all"
    ):
        ftj.write_dataset(tmp_path, {"train": [[1]]}, overwrite=True)
    assert len(files(tmp_path)) == 7


def test_a_write_in_progress_is_refused_naming_its_marker(tmp_path: Path) -> None:
    url = tmp_path / "ds"
    first = ftj.DatasetWriter(url, splits=("train", "validation", "test"))
    first.append("train", [1, 2])
    marker = json.loads((url / MARKER).read_text())
    assert marker["pid"] == os.getpid() and marker["splits"] == ["train", "validation", "test"]
    assert {"writer", "host", "started"} <= set(marker)
    with pytest.raises(
        OverwriteNeeded, match=f"leftover of an interrupted write.*pid {os.getpid()}"
    ):
        ftj.write_dataset(url, {"train": [[3]]})
    first.close()
    assert tokens(url) == [[1, 2]]


def test_python_and_cli_errors_name_their_own_overwrite(tmp_path: Path) -> None:
    ftj.write_dataset(tmp_path / "a", {"train": [[1, 2]]})
    ftj.write_dataset(tmp_path / "out", {"train": [[3]]})
    with pytest.raises(FileExistsError, match=r"pass overwrite=True to replace it"):
        merge([tmp_path / "a"], tmp_path / "out")
    with pytest.raises(OverwriteNeeded) as e:
        merge([tmp_path / "a"], tmp_path / "out")
    copy = pickle.loads(pickle.dumps(e.value))
    assert str(copy) == str(e.value) and copy.cli_message() == e.value.cli_message()
    code, _, err = run_main("merge", str(tmp_path / "a"), str(tmp_path / "out"))
    assert code == 1
    assert "pass --overwrite to replace it" in err
    assert "overwrite=True" not in err
    assert tokens(tmp_path / "out") == [[3]]


def test_merge_into_its_own_input_is_refused_and_the_input_kept(tmp_path: Path) -> None:
    m = tmp_path / "m"
    ftj.write_dataset(m, {"train": [[1, 2], [3]]})
    before = files(m)
    code, _, err = run_main("merge", str(m), str(m), "--overwrite")
    assert code == 1
    assert "is the input" in err, err
    assert files(m) == before
    for output, how in ((m / "sub", "lies inside"), (tmp_path, "contains")):
        with pytest.raises(ValueError, match=how):
            merge([m], output, overwrite=True)
    with pytest.raises(ValueError, match="is the input"):
        merge([f"{m}/./"], m, overwrite=True)
    (tmp_path / "link").symlink_to(m)
    with pytest.raises(ValueError, match="is the input"):
        merge([tmp_path / "link"], m, overwrite=True)
    assert files(m) == before
    url = memory_url()
    ftj.write_dataset(url, {"train": [[4]]})
    with pytest.raises(ValueError, match="lies inside"):
        merge([url], url + "/inner", overwrite=True)


def test_every_command_refuses_an_output_overlapping_an_input(
    tmp_path: Path, eos_tokenizer: Path
) -> None:
    proj = tmp_path / "proj"
    proj.mkdir()
    text = good_jsonl(proj / "good.jsonl")
    chat = proj / "chat.jsonl"
    chat.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(ValueError, match="contains the input"):
        convert(text, proj, tokenizer=eos_tokenizer, overwrite=True)
    with pytest.raises(ValueError, match="contains the input"):
        convert_chat(chat, proj, tokenizer=eos_tokenizer, overwrite=True)
    ds = tmp_path / "ds"
    ftj.write_dataset(ds, {"train": [[1, 2], [3]]})
    with pytest.raises(ValueError, match="lies inside the input"):
        export_megatron(ds, ds / "train" / "meg")
    export_megatron(ds, tmp_path / "meg")
    with pytest.raises(ValueError, match="contains the input"):
        import_megatron([tmp_path / "meg"], tmp_path, overwrite=True)
    assert sorted(files(proj)) == ["chat.jsonl", "good.jsonl"]
    assert tokens(ds) == [[1, 2], [3]]
    code, _, err = run_main("import-megatron", str(tmp_path / "meg"), str(tmp_path), "--overwrite")
    assert code == 1 and "contains the input" in err


def race(url: str | Path, writers: int) -> list[BaseException | None]:
    """``writers`` threads write one dataset each to ``url`` at once; their outcomes."""
    barrier = threading.Barrier(writers)
    outcomes: list[BaseException | None] = [None] * writers

    def write(i: int) -> None:
        barrier.wait()
        try:
            ftj.write_dataset(url, {"train": [[i + 1] * 5000] * 20}, storage_format=SMALL)
        except FileExistsError as e:
            outcomes[i] = e

    threads = [threading.Thread(target=write, args=(i,)) for i in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outcomes


def check_race(url: str | Path, outcomes: list[BaseException | None]) -> None:
    winners = [i for i, e in enumerate(outcomes) if e is None]
    assert len(winners) == 1, outcomes
    assert tokens(url) == [[winners[0] + 1] * 5000] * 20
    for e in outcomes:
        if e is not None:
            assert "another write" in str(e) or "already holds" in str(e)


@pytest.mark.parametrize("round_", range(5))
def test_racing_writers_on_local_disk_one_wins(tmp_path: Path, round_: int) -> None:
    check_race(tmp_path / "ds", race(tmp_path / "ds", 4))


def test_racing_writers_in_memory_one_wins() -> None:
    url = memory_url()
    check_race(url, race(url, 4))


def test_racing_processes_one_wins(tmp_path: Path) -> None:
    script = textwrap.dedent("""
        import sys, time
        import flat_tokens_jax as ftj
        from pathlib import Path
        url, value, folder = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
        small = ftj.StorageFormat(shard_tokens=1 << 10, chunk_tokens=1 << 6)
        (folder / f"ready-{value}").touch()
        while len(list(folder.glob("ready-*"))) < 2:  # both started: go
            time.sleep(0.001)
        try:
            ftj.write_dataset(url, {"train": [[value] * 5000] * 20}, storage_format=small)
        except FileExistsError as e:
            print(e, file=sys.stderr)
            sys.exit(3)
    """)
    ready = tmp_path / "ready"
    ready.mkdir()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(tmp_path / "ds"), str(v), str(ready)],
            stderr=subprocess.PIPE,
            text=True,
        )
        for v in (1, 2)
    ]
    codes = [p.wait(timeout=120) for p in procs]
    assert sorted(codes) == [0, 3], [p.stderr.read() for p in procs if p.stderr]
    winner = (1, 2)[codes.index(0)]
    assert tokens(tmp_path / "ds") == [[winner] * 5000] * 20


@contextlib.contextmanager
def tiny_disk(folder: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` mounted at ``folder``; skips where mounting is not permitted."""
    folder.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs to fill up needs root")
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
        capture_output=True,
        text=True,
    )
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.strip()}")
    try:
        yield folder
    finally:
        # A store read last may still hold a file open until it is collected,
        # or a background thread of tensorstore's closes it: a busy mount is
        # tried again (bounded), then detached, so the tmpfs never outlives
        # the test.
        for _ in range(50):
            gc.collect()
            if subprocess.run(["umount", str(folder)], capture_output=True).returncode == 0:
                break
            time.sleep(0.2)
        else:
            subprocess.run(["umount", "--lazy", str(folder)], check=True)


def test_a_full_disk_at_the_final_write_leaves_nothing_and_says_so(tmp_path: Path) -> None:
    # 384k: a dataset of three tokens in the default storage format takes about 270k
    # on a tmpfs (whole inner chunks, shard indexes of 2,048 entries, and a
    # side chunk of 2,048 chunk digests per shard).
    with tiny_disk(tmp_path / "disk", "384k") as disk:
        filler = disk / "filler"
        filler.write_bytes(b"\0" * (200 << 10))
        url = disk / "ds"
        # One sequence, smaller than a shard: it is written only by close().
        big = ftj.StorageFormat(shard_tokens=1 << 16, chunk_tokens=1 << 10)
        with pytest.raises(StoreError, match="no space left on device"):
            ftj.write_dataset(url, {"train": [np.arange(1, 30_000)]}, storage_format=big)
        assert Store(url).keys() == []
        # Now not even the marker fits.
        with contextlib.suppress(OSError), open(disk / "more", "wb", buffering=0) as f:
            f.write(b"\0" * (256 << 10))
        with pytest.raises(OSError, match=r"(?i)no space left on device"):
            ftj.write_dataset(url, {"train": [[1, 2, 3]]})
        assert Store(url).keys() == []
        (disk / "more").unlink()
        filler.unlink()
        ftj.write_dataset(url, {"train": [[1, 2, 3]]})  # no overwrite needed
        assert tokens(url) == [[1, 2, 3]]


def test_a_failed_final_write_leaves_nothing_without_root(tmp_path: Path) -> None:
    """The same cleanup where mounting is not possible: a file size limit makes
    the final shard's write fail (EFBIG) in a child process."""
    script = textwrap.dedent("""
        import resource, signal, sys
        import numpy as np
        import flat_tokens_jax as ftj
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 10, 16 << 10))
        big = ftj.StorageFormat(shard_tokens=1 << 16, chunk_tokens=1 << 16)
        try:
            ftj.write_dataset(sys.argv[1], {"train": [np.arange(1, 30_000)]}, storage_format=big)
        except OSError as e:
            print(e, file=sys.stderr)
            sys.exit(3)
    """)
    url = tmp_path / "ds"
    done = subprocess.run(
        [sys.executable, "-c", script, str(url)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 3, done.stderr
    assert files(url) == {}
    ftj.write_dataset(url, {"train": [[1, 2, 3]]})
    assert tokens(url) == [[1, 2, 3]]
