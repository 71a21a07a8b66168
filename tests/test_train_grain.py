"""scripts/train_grain.py: a grain-pipeline trainer resumes bit-identically from grain's state."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import flat_tokens_jax as ftj

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "train_grain.py"
ENV = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
SMALL = ["--steps", "6", "--save-at", "3", "--batch-size", "8", "--seq-len", "16"]


def run(tmp_path: Path, *flags: str) -> tuple[subprocess.CompletedProcess[str], list[float]]:
    """The script's run at small sizes, and its losses in the order printed."""
    out = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path), *SMALL, *flags],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=300,
    )
    losses = re.findall(r"^step (\d+) loss (\S+)$", out.stdout, re.MULTILINE)
    assert [int(s) for s, _ in losses] == [0, 1, 2, 3, 4, 5, 3, 4, 5], out.stdout + out.stderr
    return out, [float(v) for _, v in losses]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_resumed_run_repeats_the_uninterrupted_one(tmp_path: Path, workers: int) -> None:
    """It saves the grain iterator's state after step 2, restores it in a new
    pipeline, and the steps after agree with the uninterrupted run in losses and
    batches (the script's verdict); the loss falls; with a worker process too,
    which leaves no traceback at exit."""
    out, losses = run(tmp_path, "--workers", str(workers))
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == "resume: identical, steps 3-5"
    assert losses[3:6] == losses[6:]
    assert losses[5] < losses[0]
    saved = np.load(tmp_path / "checkpoint.npz")
    state = json.loads(str(saved["data"]))
    assert int(saved["step"]) == 3
    if workers:  # each worker's loader state: worker 0 read steps 0 and 2, worker 1 step 1
        assert [s["step"] for s in state["iterators_in_use_states"]] == [4, 3], state
        assert state["next_index_in_cycle"] == 1, state
        assert "Traceback" not in out.stderr and "Exception ignored" not in out.stderr
    else:
        assert state["step"] == 3 and state["samples"] == 24, state
        # Its data trains on targets of id 0, which a mask from "token != 0" would drop.
        split = ftj.open_dataset(str(tmp_path / "data"))["train"]
        batch = ftj.Loader(split, ftj.LoaderConfig(8, 16, layout="tokens")).host_batch(0)
        assert ((batch["tokens"][:, 1:] == 0) & batch["loss_mask"]).sum() > 0


def test_a_wrong_restore_is_caught(tmp_path: Path) -> None:
    """A resume one batch late (one batch dropped after the restore) is reported
    as DIFFERENT with exit status 1."""
    out, losses = run(tmp_path, "--skip-on-restore", "1")
    assert out.returncode == 1, out.stderr
    assert out.stdout.splitlines()[-1] == "resume: DIFFERENT, steps 3-5"
    assert losses[3:6] != losses[6:]
