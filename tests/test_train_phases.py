"""End to end: the example trainer on a three-phase run, SIGKILLed and resumed.

``configs/train_phases.yaml`` (pretraining mixture, annealing with an added
source, long context in bins) runs as real processes of
``scripts/train_example.py`` on 8 CPU devices. One run is killed once it has a
checkpoint past the first phase boundary; a copy resumes across the next
boundary and must train bit-identically to a run never interrupted. Another
copy resumes with a phase appended from its checkpoint's step on.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from test_train_example import finalized, read_log
from trainruns import kill_when, script_command

import flat_tokens_jax as ftj

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "train_example.py"
CONFIG = ROOT / "configs" / "train_phases.yaml"
KILL_AT = 4  # killed once a checkpoint at the anneal phase's start (step 4) or later exists
STEPS = 12  # at least: the long-context phase starts at 8, so a resume from 4 or 6 crosses it


@dataclasses.dataclass(frozen=True)
class Crash:
    tmp: Path
    config: Path
    killed: Path
    killed_log: dict[int, dict[str, Any]]
    resume_step: int
    steps: int  # where every run stops: STEPS, or 4 past a late kill
    reference_log: dict[int, dict[str, Any]]


def env(tmp: Path) -> dict[str, str]:
    return {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
        "XDG_CACHE_HOME": str(tmp / "cache"),
    }


def run_config(tmp: Path, phases: list[dict[str, Any]] | None = None) -> Path:
    """configs/train_phases.yaml with its data in ``tmp`` (and ``phases``, if given)."""
    config = yaml.safe_load(CONFIG.read_text())
    for phase in config["phases"]:
        for entry in phase.get("data", {}).get("datasets", {}).values():
            entry["url"] = str(tmp / entry["url"])
    if phases is not None:
        config["phases"] += phases
    path = tmp / f"run{len(config['phases'])}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def command(config: Path, checkpoints: Path, log: Path, steps: int) -> list[str]:
    return script_command(
        SCRIPT, config=config, checkpoint_dir=checkpoints, log_jsonl=log, steps=steps, mesh=8
    )


def train(config: Path, checkpoints: Path, log: Path, tmp: Path, steps: int) -> str:
    done = subprocess.run(
        command(config, checkpoints, log, steps),
        env=env(tmp),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.fixture(scope="module")
def crash(tmp_path_factory: pytest.TempPathFactory) -> Crash:
    tmp = tmp_path_factory.mktemp("train_phases")
    rng = np.random.default_rng(0)
    for name, count in (("web", 300), ("code", 200), ("books", 150)):
        seqs = [rng.integers(1, 300, rng.integers(10, 120)) for _ in range(count)]
        ftj.write_dataset(tmp / "data" / name, {"train": seqs})
    config = run_config(tmp)
    killed, log = tmp / "killed", tmp / "killed.jsonl"
    kill_when(
        command(config, killed, log, 100_000),
        env(tmp),
        tmp / "killed.out",
        lambda: max(finalized(killed), default=-1) >= KILL_AT,
        f"checkpoint {KILL_AT}",
    )
    resume_step = finalized(killed)[-1]
    steps = max(STEPS, resume_step + 4)
    train(config, tmp / "reference", tmp / "reference.jsonl", tmp, steps)
    return Crash(
        tmp=tmp,
        config=config,
        killed=killed,
        killed_log=read_log(log),
        resume_step=resume_step,
        steps=steps,
        reference_log=read_log(tmp / "reference.jsonl"),
    )


def test_killed_across_phases_resumes_bit_identically(crash: Crash, tmp_path: Path) -> None:
    ref = crash.reference_log
    assert sorted(ref) == list(range(crash.steps))
    assert [len(ref[s]["samples"]) for s in (0, 4, 8)] == [8, 8, 8]
    before = range(crash.resume_step)
    assert crash.resume_step >= KILL_AT, "the killed run crossed the boundary at step 4"
    assert [crash.killed_log[s]["loss"] for s in before] == [ref[s]["loss"] for s in before]
    checkpoints = tmp_path / "checkpoints"
    shutil.copytree(crash.killed, checkpoints)
    out = train(crash.config, checkpoints, tmp_path / "log.jsonl", crash.tmp, crash.steps)
    assert f"resuming at step {crash.resume_step} of {crash.steps}" in out
    log = read_log(tmp_path / "log.jsonl")
    assert sorted(log) == list(range(crash.resume_step, crash.steps))
    assert {s: r["loss"] for s, r in log.items()} == {s: ref[s]["loss"] for s in log}
    assert {s: r["samples"] for s, r in log.items()} == {s: ref[s]["samples"] for s in log}


def test_a_phase_appended_at_resume_trains_like_a_run_that_had_it(
    crash: Crash, tmp_path: Path
) -> None:
    start = max(crash.resume_step, 9)
    web = {"datasets": {"web": {"url": str(crash.tmp / "data" / "web"), "weight": 1}}}
    appended = {
        "name": "web-again",
        "start_step": start,
        "data": web,
        "loader": {"batch_size": 16, "seq_len": 32, "packing": True},
    }
    config = run_config(crash.tmp, [appended])
    checkpoints = tmp_path / "checkpoints"
    shutil.copytree(crash.killed, checkpoints)
    out = train(config, checkpoints, tmp_path / "log.jsonl", crash.tmp, crash.steps)
    assert f"resuming at step {crash.resume_step} of {crash.steps}" in out
    resumed = read_log(tmp_path / "log.jsonl")
    fresh = tmp_path / "fresh"
    train(config, fresh, tmp_path / "fresh.jsonl", crash.tmp, crash.steps)
    fresh_log = read_log(tmp_path / "fresh.jsonl")
    assert {s: r["loss"] for s, r in resumed.items()} == {s: fresh_log[s]["loss"] for s in resumed}
    after = range(start, crash.steps)
    assert [len(fresh_log[s]["samples"]) for s in after] == [16] * len(after)
    before = range(start)
    assert [fresh_log[s]["loss"] for s in before] == [
        crash.reference_log[s]["loss"] for s in before
    ]
