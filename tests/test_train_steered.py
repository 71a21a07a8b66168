"""End to end: ``scripts/train_steered.py``, a trainer that sets its mixture's
weights from each source's loss every few steps, SIGKILLed at random steps and
resumed each time from its newest checkpoint, trains as an uninterrupted run
does, bit for bit: losses, per-source losses, weight changes and final state.

Every run is a real process on 8 CPU devices (``test_train_example``'s
environment and log reader)."""

from __future__ import annotations

import json
import random
import re
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from test_train_example import ENV, read_log
from trainruns import kill_when, script_command

import flat_tokens_jax as ftj

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "train_steered.py"
STEPS = 24
EVERY = 4  # steps between weight changes
KILL_SEED = 38


def write_data(folder: Path) -> dict[str, str]:
    """Three sources the model learns at different speeds: random ids, a
    repeated pattern, and random ids from a few."""
    rng = np.random.default_rng(0)
    kinds = {
        "web": lambda n: rng.integers(1, 300, n),
        "code": lambda n: np.arange(n) % 17 + 1,
        "books": lambda n: rng.integers(1, 12, n),
    }
    urls = {}
    for name, make in kinds.items():
        urls[name] = str(folder / name)
        ftj.write_dataset(urls[name], {"train": [make(int(n)) for n in rng.integers(10, 80, 150)]})
    return urls


def write_config(folder: Path, urls: dict[str, str]) -> Path:
    config = yaml.safe_load((ROOT / "configs" / "train_steered.yaml").read_text())
    for name, url in urls.items():
        config["data"]["datasets"][name]["url"] = url
    config["learning_rate"] = 0.03  # the easy sources' losses fall within the run
    path = folder / "run.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def command(config: Path, checkpoints: Path, log: Path, steps: int) -> list[str]:
    return script_command(
        SCRIPT,
        config=config,
        checkpoint_dir=checkpoints,
        log_jsonl=log,
        steps=steps,
        reweight_every=EVERY,
    )


def logged_steps(log: Path) -> list[int]:
    """The steps of the lines written whole so far."""
    if not log.exists():
        return []
    return [json.loads(line)["step"] for line in log.read_text().split("\n")[:-1]]


def run_and_kill(config: Path, checkpoints: Path, log: Path, at: int) -> str:
    """Starts a run far longer than needed, SIGKILLs it once it has logged
    step ``at`` and a step after its first (so it saved a checkpoint); its output."""

    def logged() -> bool:
        steps = logged_steps(log)
        return max(steps, default=-1) >= at and len(steps) >= 2

    run = command(config, checkpoints, log, 100_000)
    return kill_when(run, ENV, log.with_suffix(".out"), logged, f"step {at} logged")


def resumed_at(output: str) -> int:
    found = re.search(r"^(?:starting|resuming) at step (\d+) of", output, re.MULTILINE)
    assert found, output
    return int(found.group(1))


def tokens_per_source(loader: ftj.Loader, step: int) -> dict[str, int]:
    """Each source's trained tokens at ``step``, counted from the rows'
    provenance and ``loss_mask`` (what the trainer's ``per_source`` counts)."""
    mask = loader.host_batch(step)["loss_mask"]
    out = dict.fromkeys(loader.source_names, 0)
    for row, found in zip(mask, loader.provenance(step), strict=True):
        out[found["component_name"]] += int(row.sum())
    return out


def test_killed_at_random_steps_it_resumes_bit_identically(tmp_path: Path) -> None:
    urls = write_data(tmp_path / "data")
    config = write_config(tmp_path, urls)
    # In the first half: a kill that lands a few steps late leaves steps to resume.
    kills = sorted(random.Random(KILL_SEED).sample(range(2, STEPS // 2), 2))
    print(f"SIGKILLed once steps {kills} are logged")
    reference = subprocess.Popen(
        command(config, tmp_path / "reference", tmp_path / "reference.jsonl", STEPS),
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    killed = tmp_path / "killed"
    outputs = [
        run_and_kill(config, killed, tmp_path / f"part{i}.jsonl", at) for i, at in enumerate(kills)
    ]
    last = subprocess.run(
        command(config, killed, tmp_path / "last.jsonl", STEPS),
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert last.returncode == 0, last.stderr
    reference_out, _ = reference.communicate(timeout=300)
    assert reference.returncode == 0, reference_out
    ref = read_log(tmp_path / "reference.jsonl")
    assert sorted(ref) == list(range(STEPS))

    # Each part starts at its predecessor's newest checkpoint, after at least
    # one step of it, and every step it logged is the reference's, bit for bit.
    parts = [read_log(tmp_path / f"part{i}.jsonl") for i in range(len(kills))]
    parts.append(read_log(tmp_path / "last.jsonl"))
    starts = [resumed_at(out) for out in [*outputs, last.stdout]]
    print(f"the parts started at steps {starts}")
    assert starts[0] == 0
    for i, part in enumerate(parts):
        assert sorted(part) == list(range(starts[i], starts[i] + len(part)))
        if i:
            assert 0 < starts[i] <= max(parts[i - 1]) + 1 and starts[i] > starts[i - 1]
        for step, record in part.items():
            assert record == ref[step], f"part {i}, step {step}"
    assert max(parts[-1]) == STEPS - 1

    # The last checkpoints are one: model, optimizer, window and loader state.
    with (
        np.load(killed / str(STEPS) / "state.npz") as got,
        np.load(tmp_path / "reference" / str(STEPS) / "state.npz") as want,
    ):
        assert sorted(got.files) == sorted(want.files)
        for name in want.files:
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    state = json.loads((killed / str(STEPS) / "loader.json").read_text())
    assert state == json.loads((tmp_path / "reference" / str(STEPS) / "loader.json").read_text())

    # The weights changed every EVERY steps, as the logged losses said, and the
    # run read (and trained on) the rows those weights give, not the first ones.
    changes = state["weights"]
    assert [t for t, _ in changes] == list(range(EVERY, STEPS + 1, EVERY))
    assert [t + 1 for t in sorted(ref) if "weights" in ref[t]] == [t for t, _ in changes]
    config_doc = yaml.safe_load(config.read_text())
    mix = ftj.mixture_from_config(config_doc["data"], "train")
    names = mix.names
    for t, counts in changes:  # the samples per period of 100 the logged weights round to
        weights = np.array([ref[t - 1]["weights"][n] for n in names])
        assert np.abs(np.array(counts) / 100 - weights / weights.sum()).max() <= 0.01, t
    assert len({tuple(c) for _, c in changes}) > 1 and changes[0][1] != [34, 33, 33]
    cfg = ftj.LoaderConfig.from_dict(config_doc["loader"])
    steered, plain = ftj.Loader(mix, cfg), ftj.Loader(mix, cfg)
    steered.restore(state)
    logged = [ref[t]["source_tokens"] for t in range(STEPS)]
    assert logged == [tokens_per_source(steered, t) for t in range(STEPS)]
    unsteered = [tokens_per_source(plain, t) for t in range(STEPS)]
    assert logged[:EVERY] == unsteered[:EVERY] and logged[EVERY:] != unsteered[EVERY:]
    means: dict[str, Any] = ref[STEPS - 1]["source_loss"]
    assert set(means) == set(names) and all(v is None or v > 0 for v in means.values())
