import re
import subprocess
import sys
from pathlib import Path

import numpy as np

import flat_tokens_jax as ftj

QUICKSTART = Path(__file__).resolve().parent.parent / "scripts" / "quickstart.py"


def test_quickstart_runs_and_ends_with_a_row_as_text(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, str(QUICKSTART), str(tmp_path / "qs")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("step 1, row 0:"))
    start, stop = map(int, re.search(r"tokens \[(\d+), (\d+)\)", lines[at]).groups())
    segments = [line.split("] ", 1)[1] for line in lines[at + 1 :]]
    train = ftj.open_dataset(tmp_path / "qs")["train"]
    assert "".join(segments) == bytes(train.tokens(start, stop).tolist()).decode()
    bounds = train.sequence_bounds(np.arange(train.num_sequences))[0]
    assert len(segments) == 1 + int(((bounds > start) & (bounds < stop)).sum())
