"""Issue 46, the CLI and the memory errors: what `preview --requests` samples, how
far its work may grow, and errors that name the option to change with values
that are then accepted.

Each test fails on the code before the fix.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from commands import run_main

import flat_tokens_jax as ftj
from flat_tokens_jax.cli import main
from flat_tokens_jax.core import limits
from flat_tokens_jax.loader.state import StateMismatch
from flat_tokens_jax.tools import runview, show

SEQUENCES = [[7] * 50] * 100  # 5,000 tokens: 625 windows of 8 tokens


@pytest.fixture
def data(tmp_path: Path) -> Path:
    fmt = ftj.StorageFormat(shard_tokens=1024, chunk_tokens=64)
    ftj.write_dataset(tmp_path / "ds", {"train": SEQUENCES}, storage_format=fmt)
    return tmp_path / "ds"


def run_yaml(tmp_path: Path, data: Path, loader: str, extra: str = "") -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(f"data: {{datasets: {{web: {{url: {data}, weight: 1}}}}}}\nloader: {loader}\n")
    path.write_text(path.read_text() + extra)
    return path


REQUESTS = ("--requests", "--hosts", "2", "--step-seconds", "1")


def blocks_loader(data: Path, **fields: Any) -> ftj.Loader:
    ft = ftj.open_dataset(str(data))["train"]
    return ftj.Loader(ft, ftj.LoaderConfig(**{"batch_size": 8, "seq_len": 8, **fields}))


@pytest.mark.parametrize(
    "fields", [{"shuffle_block": 10**12}, {"shuffle_window": 10**6}, {"shuffle_block": 10**15}]
)
def test_a_block_or_window_larger_than_the_data_is_the_data(data: Path, fields: Any) -> None:
    """Accepted (it was refused as needing terabytes of block cache): each
    epoch reads every record once, and a state saved with the value restores
    to the same batches."""
    loader = blocks_loader(data, shuffle="blocks", prefetch=0, **fields)
    n = len(loader.components[0])
    steps = -(-2 * n // 8)  # 625 windows: two epochs
    rows = [r for s in range(steps) for r in loader.provenance(s)]
    for epoch in (0, 1):
        assert sorted(r["record"] for r in rows if r["epoch"] == epoch) == list(range(n))
    state = json.loads(json.dumps(loader.state(5)))
    again = blocks_loader(data, shuffle="blocks", prefetch=0, **fields)
    assert again.restore(state) == 5
    for step in (5, 6, steps + 1):
        assert again.provenance(step) == loader.provenance(step)
    tokens = ftj.open_dataset(str(data))["train"].num_tokens
    assert loader.engine.sources.block_cache_bytes <= (tokens + 1) * 4 + 4 * 8 * 2


def test_show_and_preview_take_a_block_larger_than_the_data(tmp_path: Path, data: Path) -> None:
    code, out, err = run_main(
        "show", str(data), "--step", "3", "--batch-size", "8", "--seq-len", "8", "--blocks",
        "--shuffle-block", str(10**12), "--shuffle-window", str(10**6), "--json",
    )  # fmt: skip
    assert (code, err) == (0, ""), err
    assert len(json.loads(out)["rows"]) == 8
    big = f"{{batch_size: 8, seq_len: 8, shuffle: blocks, shuffle_block: {10**12}}}"
    run = run_yaml(tmp_path, data, big)
    code, out, err = run_main("preview", str(run), *REQUESTS)
    assert (code, err) == (0, ""), err
    code, out, err = run_main("preview", str(run), "--steps", "10")
    assert (code, err) == (0, ""), err


def fixes(message: str) -> dict[str, int]:
    """``field: value`` of each ``lower/set FIELD (at most N`` in a message."""
    found = re.findall(r"(?:lower|set) (\w+) \(at most ([\d,]+)", message)
    return {name: int(value.replace(",", "")) for name, value in found}


def test_a_default_block_cache_over_memory_names_the_fields_that_size_it(
    data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default cache (each of 8 lanes holds 2 windows of 8 blocks of 4
    windows: 128 blocks of 132 bytes, 16,896 bytes) beside 2 steps of 6,208
    bytes, on a machine of 20,000: no batch size, seq_len nor read-ahead can
    fit it, a window of 3 or a block of 1 can. Each value named is accepted."""
    monkeypatch.setattr(limits, "memory_bytes", lambda: 20_000)
    fields = {"shuffle": "blocks", "shuffle_block": 4, "shuffle_window": 8, "read_ahead_bytes": 1}
    with pytest.raises(ValueError) as e:
        blocks_loader(data, **fields)
    message = str(e.value)
    assert "at most 0" not in message
    assert "a block cache of 16,896 bytes (block_cache_bytes None: sized by default)" in message
    assert fixes(message) == {"shuffle_window": 3, "shuffle_block": 1, "block_cache_bytes": 7584}
    for name, value in fixes(message).items():
        blocks_loader(data, **{**fields, name: value})  # accepted
        with pytest.raises(ValueError):  # and the largest that is
            blocks_loader(data, **{**fields, name: value + 1})


@pytest.mark.parametrize(
    "fields",
    [
        {"seq_len": 10**7},
        {"batch_size": 10**6},
        {"read_ahead_bytes": 10**9},
        {"prefetch": 10**6},
        {"shuffle": "blocks", "block_cache_bytes": 10**9},
        {"shuffle": "blocks", "block_cache_bytes": 10**9, "read_ahead_bytes": 1},
    ],
)
def test_a_loader_over_memory_suggests_only_values_that_fit(
    data: Path, monkeypatch: pytest.MonkeyPatch, fields: dict[str, Any]
) -> None:
    monkeypatch.setattr(limits, "memory_bytes", lambda: 3 << 20)
    with pytest.raises(ValueError, match="more than this machine's") as e:
        blocks_loader(data, **fields)
    message = str(e.value)
    assert "at most 0" not in message and fixes(message), message
    first = "set read_ahead_bytes 1 (one step ahead), then "
    base = {**fields, "read_ahead_bytes": 1} if first in message else fields
    for name, value in fixes(message).items():
        try:
            blocks_loader(data, **{**base, name: value})
        except ValueError as e:  # a seq_len longer than the data: accepted as to memory
            assert "more than this machine's" not in str(e)


def test_show_names_seq_len_when_not_one_row_fits(data: Path) -> None:
    code, out, err = run_main(
        "show", str(data), "--step", "0", "--batch-size", "8", "--seq-len", str(10**12)
    )
    assert code == 1 and not out
    assert "at most 0" not in err
    found = re.search(r"not one row fits: pass a --seq-len of at most ([\d,]+)$", err.strip())
    assert found, err
    most = int(found.group(1).replace(",", ""))
    config = ftj.LoaderConfig(batch_size=1, seq_len=most)
    show.check_show_memory(config, 1, 1)  # one row of it fits, printed
    with pytest.raises(ValueError):
        show.check_show_memory(ftj.LoaderConfig(batch_size=1, seq_len=most + 1), 1, 1)


def test_the_largest_value_found_is_the_largest_that_fits() -> None:
    for bound in [0, 1, 2, 7, 1000, 10**12]:
        fits = limits.largest(lambda v, b=bound: v <= b, 1, 10**13)
        assert fits == (bound if bound >= 1 else None)
    assert limits.largest(lambda v: True, 5, 4) is None
    assert np.all([limits.largest(lambda v, b=b: v <= b, 0, 9) == min(b, 9) for b in range(12)])


def test_a_block_state_suggests_a_batch_size_the_lanes_take(data: Path) -> None:
    """Saved at step 5 of batch 8 (8 lanes), restored at another size: the
    schedule suggested restores."""
    saved = blocks_loader(data, shuffle="blocks", shuffle_block=4).state(5)

    def refusal(now: Any) -> str:
        with pytest.raises(StateMismatch) as e:
            blocks_loader(data, shuffle="blocks", shuffle_block=4, batch_size=now).restore(saved)
        return str(e.value)

    told = {
        4: r"saved step 5 on: batch_size (.+?) \(with shuffle='blocks' the gcd of the batch "
        r"sizes, the lanes, must stay 8\)$",
        12: r"saved step 5 on: batch_size (.+?) \(with shuffle='blocks'",
        # Sizes that agree before the saved step: the lanes' line says the schedule.
        json.dumps([[0, 8], [5, 4]]): r"keep the gcd of the batch sizes at 8: batch_size (.+)$",
        json.dumps([[0, 8], [7, 12]]): r"keep the gcd of the batch sizes at 8: batch_size (.+)$",
        16: r"saved step 5 on: batch_size (\[\[0, 8\], \[5, 16\]\])$",  # taken as it is
    }
    for now, pattern in told.items():
        message = refusal(json.loads(now) if isinstance(now, str) else now)
        found = re.search(pattern, message)
        assert found, message
        suggested = json.loads(found.group(1))
        loader = blocks_loader(data, shuffle="blocks", shuffle_block=4, batch_size=suggested)
        assert loader.restore(saved) == 5


def sampled(monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """The steps each of ``preview --requests``'s counts is asked to sample."""
    asked: list[list[int]] = []
    count = runview.count_requests

    def spy(loader: Any, hosts: int, seconds: float, steps: Any) -> Any:
        asked.append(list(steps))
        return count(loader, hosts, seconds, steps)

    monkeypatch.setattr(runview, "count_requests", spy)
    return asked


def test_count_requests_samples_no_step_past_the_run(
    tmp_path: Path, data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 40-step run (its YAML's ``steps``, or ``--steps``) sampled for 1000
    steps samples steps 0 to 39, and says so."""
    run = run_yaml(tmp_path, data, "{batch_size: 8, seq_len: 8}", "steps: 40\n")
    asked = sampled(monkeypatch)
    code, out, err = run_main("preview", str(run), *REQUESTS, "--sample-steps", "1000")
    assert (code, err) == (0, "")
    assert asked == [list(range(40))] * 2  # as configured, and under the other shuffle
    assert "sampled its steps 0 to 39 (the run ends there, at step 40)" in out
    assert "--sample-steps 1000 is past the end of phase 0" in out
    asked.clear()
    run.write_text(run.read_text().replace("steps: 40\n", ""))
    code, out, _ = run_main("preview", str(run), *REQUESTS, "--sample-steps", "50", "--steps", "7")
    assert code == 0 and asked == [list(range(7))] * 2
    assert "sampled its steps 0 to 6" in out


def test_count_requests_samples_each_phase_only_within_it(
    tmp_path: Path, data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = tmp_path / "phases.yaml"
    phase = f"data: {{datasets: {{web: {{url: {data}, weight: 1}}}}}}, loader: "
    run.write_text(
        "phases:\n"
        f"  - {{start_step: 0, {phase}{{batch_size: 8, seq_len: 8}}}}\n"
        f"  - {{start_step: 3, {phase}{{batch_size: 4, seq_len: 8}}}}\n"
        f"  - {{start_step: 30, {phase}{{batch_size: 4, seq_len: 16}}}}\n"
    )
    asked = sampled(monkeypatch)
    code, out, err = run_main("preview", str(run), *REQUESTS, "--steps", "20")
    assert (code, err) == (0, "")
    # Phase 0 has 3 steps, phase 1 the 17 before the run's end, phase 2 none.
    assert asked == [[0, 1, 2]] * 2 + [list(range(8))] * 2
    assert "phase 2 (from step 30): sampled none of its steps" in out
    assert "phase 0 (from step 0): sampled its steps 0 to 2 (phase 1 (from step 3) starts" in out


def test_sample_steps_past_the_maximum_are_refused(tmp_path: Path, data: Path) -> None:
    """By argparse (exit status 2), naming the flag and the largest value."""
    run = run_yaml(tmp_path, data, "{batch_size: 8, seq_len: 8}")
    most = runview.MAX_SAMPLE_STEPS
    for steps in (2**63, 10**9, most + 1):
        err = io.StringIO()
        with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as e:
            main(["preview", str(run), *REQUESTS, "--sample-steps", str(steps)])
        assert e.value.code == 2
        assert f"argument --sample-steps: must be at most {most:,}, got {steps}" in err.getvalue()


def test_sampled_rows_past_the_maximum_are_refused_naming_the_steps_that_fit(
    tmp_path: Path, data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    batch = 1 << 20
    run = run_yaml(tmp_path, data, f"{{batch_size: {batch}, seq_len: 8}}")
    asked = sampled(monkeypatch)
    code, _, err = run_main("preview", str(run), *REQUESTS, "--sample-steps", "5")
    assert code == 1 and not asked
    most = runview.MAX_SAMPLED_ROWS // batch
    assert "--sample-steps 5: the steps sampled of phase 0 (from step 0) would hold" in err
    assert err.rstrip().endswith(f"give --sample-steps {most} or fewer"), err
    code, _, err = run_main("preview", str(run), *REQUESTS, "--sample-steps", str(most))
    assert (code, err) == (0, "")
    assert asked == [list(range(most))] * 2


def test_paths_are_named_by_their_flag(tmp_path: Path, data: Path) -> None:
    run = run_yaml(tmp_path, data, "{batch_size: 8, seq_len: 8}")
    missing = tmp_path / "no" / "such"
    code, _, err = run_main("preview", str(run), "--steps", "4", "--picture", f"{missing}/p.png")
    assert code == 1 and "Errno" not in err
    assert f"preview: --picture {missing}/p.png: the folder {missing} does not exist" in err
    code, _, err = run_main("show", "--state", str(tmp_path), "--step", "0")
    assert code == 1 and "Errno" not in err
    assert f"show: --state {tmp_path} is a folder: name a saved loader state's JSON file" in err
    code, _, err = run_main("export-megatron", str(data), f"{missing}/mega")
    assert code == 1 and ".tmp" not in err and "Errno" not in err
    assert f"the export prefix {missing}/mega: the folder {missing} does not exist" in err


def test_preview_refuses_flags_the_command_would_not_read(tmp_path: Path, data: Path) -> None:
    run = run_yaml(tmp_path, data, "{batch_size: 8, seq_len: 8}")
    code, out, err = run_main("preview", str(run), "--steps", "4", "--hosts", "2")
    assert (code, out) == (1, "")
    assert "--hosts applies to preview --requests only: add --requests, or drop --hosts" in err
    code, _, err = run_main("preview", str(run), "--steps", "4", "--sample-steps", "3")
    assert code == 1 and "--sample-steps applies to preview --requests only" in err
    code, _, err = run_main("preview", str(run), *REQUESTS, "--json")
    assert code == 1 and "--requests prints its table only, not --json: drop --json" in err
