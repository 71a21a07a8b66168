"""scripts/train_steps.py: a step-indexed trainer resumes bit-identically."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "train_steps.py"
ENV = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
SMALL = ["--steps", "6", "--save-at", "3", "--batch-size", "8", "--seq-len", "16"]


def test_a_resumed_run_repeats_the_uninterrupted_one(tmp_path: Path) -> None:
    """It saves after step 2, restores in a new loader, and the steps after
    agree with the uninterrupted run in losses and batches (the script's verdict)."""
    out = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path), *SMALL],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == "resume: identical, steps 3-5"
    losses = re.findall(r"^step (\d+) loss (\S+)$", out.stdout, re.MULTILINE)
    steps = [int(s) for s, _ in losses]
    assert steps == [0, 1, 2, 3, 4, 5, 3, 4, 5]  # the whole run, then the resumed one
    assert losses[3:6] == losses[6:]
    saved = np.load(tmp_path / "checkpoint.npz")
    assert int(saved["step"]) == 3 and '"step": 3' in str(saved["loader"])
