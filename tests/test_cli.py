import json
import subprocess
import sys
from pathlib import Path

from rawstore import SPEC_TOKENS, flat_split, write_raw

import flat_tokens_jax as ftj
from flat_tokens_jax.cli import main


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "flat_tokens_jax.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_validate_exit_status_and_report(tmp_path: Path) -> None:
    ftj.write_dataset(tmp_path / "good", {"train": [[1, 2], [3]]})
    ok = run("validate", str(tmp_path / "good"))
    assert ok.returncode == 0 and "valid" in ok.stdout
    write_raw(
        tmp_path / "bad",
        {"train": flat_split(SPEC_TOKENS, [0, 3, 5, 8], 8), "validation": flat_split([], [0], 0)},
    )
    bad = run("validate", str(tmp_path / "bad"))
    assert bad.returncode == 1
    assert "INVALID" in bad.stderr
    assert "train/encoded_tokens[3]: seq_starts marks a sequence start here" in bad.stderr
    assert "train/encoded_tokens[2]: start bit set where" in bad.stderr


def test_info_text_and_json(tmp_path: Path, capsys: object) -> None:
    ftj.write_dataset(
        tmp_path,
        {"train": [[1, 2], [3, 4, 5]], "validation": [[9]]},
        layout=ftj.Layout(shard_tokens=1024, chunk_tokens=64, compression="zstd"),
    )
    out = run("info", str(tmp_path), "--json")
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["splits"]["train"]["num_tokens"] == 5
    assert info["splits"]["validation"]["max_token_id"] == 9
    text = run("info", str(tmp_path)).stdout
    assert "train: 5 tokens, 2 sequences, max_token_id 5" in text
    assert "encoded_tokens: chunk 64, shard 1024, compression zstd" in text


def test_info_on_missing_dataset_fails_cleanly(tmp_path: Path) -> None:
    assert main(["info", str(tmp_path / "nothing")]) == 1
    assert main(["validate", str(tmp_path / "nothing")]) == 1


def test_show_prints_the_batch_and_its_provenance(tmp_path: Path) -> None:
    ftj.write_dataset(tmp_path, {"train": [[1, 2], [3, 4, 5], [6, 7, 8]]})
    out = run(
        "show",
        str(tmp_path),
        "--step",
        "0",
        "--batch-size",
        "2",
        "--seq-len",
        "4",
        "--no-shuffle",
        "--json",
    )
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)["rows"]
    assert rows[1]["targets"] == [5, 6, 7, 8] and rows[1]["inputs"] == [4, 0, 6, 7]
    assert rows[1]["tokens"] == [4, 8] and rows[1]["record"] == 1
    text = run(
        "show",
        str(tmp_path),
        "--step",
        "0",
        "--batch-size",
        "1",
        "--seq-len",
        "4",
        "--padded",
        "--no-shuffle",
    ).stdout
    assert "row 0: sample 0, epoch 0, record 0, tokens [0, 2)" in text
    assert "targets     [1, 2, 0, 0]" in text
    bad = run("show", str(tmp_path), "--step", "0", "--batch-size", "1", "--seq-len", "9")
    assert bad.returncode == 1 and "has no records" in bad.stderr
