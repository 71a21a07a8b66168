"""scripts/recipe_*.py: each trainer-shaped grain recipe SIGKILLs itself, resumes
through grain's checkpointing bit-identically, and refuses another seed's state."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

import flat_tokens_jax as ftj
from flat_tokens_jax.trainers.nanodo import get_in_out

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
STEPS, EVERY, KILL_AT = 8, 2, 5


def maxtext_config() -> ftj.LoaderConfig:
    """What configs/recipe_maxtext.yaml means to MaxText, written out by hand
    (``grain_packing_type: first_fit`` packs whole sequences: bins)."""
    c = yaml.safe_load((ROOT / "configs" / "recipe_maxtext.yaml").read_text())
    assert c["packing"] is True and c["grain_packing_type"] == "first_fit"
    return ftj.LoaderConfig(
        batch_size=c["global_batch_size_to_load"],
        seq_len=c["max_target_length"],
        packing="bins",
        seed=c["data_shuffle_seed"],
        num_epochs=c["num_epoch"],
        vocab_size=c["vocab_size"],
        layout="maxtext",
    )


def nanodo_config() -> ftj.LoaderConfig:
    """recipe_nanodo.py's Config() through nanodo's ``py_batched_tfds``, written out by hand."""
    return ftj.LoaderConfig(batch_size=16, seq_len=32, seed=0, layout="tokens")


RECIPES = {"maxtext": maxtext_config, "nanodo": nanodo_config}


def run(name: str, tmp: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    """scripts/recipe_NAME.py's whole check in ``tmp``, at small sizes."""
    script = ROOT / "scripts" / f"recipe_{name}.py"
    sizes = [f"--steps={STEPS}", f"--every={EVERY}", f"--kill-at={KILL_AT}"]
    command = [sys.executable, str(script), str(tmp), *sizes, *flags]
    return subprocess.run(command, capture_output=True, text=True, env=ENV, timeout=600)


@dataclasses.dataclass(frozen=True)
class Check:
    """A recipe's whole check, run once."""

    name: str
    dir: Path
    out: subprocess.CompletedProcess[str]

    def log(self, name: str) -> list[dict[str, Any]]:
        return [json.loads(line) for line in (self.dir / f"{name}.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module", params=sorted(RECIPES))
def check(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Check:
    tmp = tmp_path_factory.mktemp(request.param)
    return Check(request.param, tmp, run(request.param, tmp))


def test_the_killed_run_resumes_bit_identically(check: Check) -> None:
    """The run killed after step 5 resumed from a checkpoint at or before it, and
    its losses and batches from there equal the uninterrupted run's (the
    script's verdict, and its logs read here)."""
    assert check.out.returncode == 0, check.out.stdout + check.out.stderr
    lines = check.out.stdout.splitlines()
    assert lines[:3] == ["full: exit 0", "killed: exit -9", "resumed: exit 0"]
    full, killed, resumed = (check.log(n) for n in ("full", "killed", "resumed"))
    assert [e["step"] for e in full] == list(range(STEPS))
    assert killed == full[: KILL_AT + 1]
    first = resumed[0]["step"]
    assert 0 < first <= KILL_AT + 1
    assert [e["step"] for e in resumed] == list(range(first, STEPS))
    assert resumed == full[first:]
    assert lines[3] == f"resume: identical, steps {first}-{STEPS - 1}"
    assert full[-1]["loss"] < full[0]["loss"]


def test_its_batches_are_the_loaders(check: Check) -> None:
    """Every step's arrays are ``Loader.host_batch`` of the config (one process:
    the whole batch), hashed as the script hashes them; the checkpointed
    iterator state is the loader's state at the checkpoint's step."""
    loader = ftj.Loader(ftj.open_dataset(check.dir / "data")["train"], RECIPES[check.name]())
    for entry in check.log("full"):
        batch = loader.host_batch(entry["step"])
        digest = hashlib.sha256(b"".join(batch[k].tobytes() for k in sorted(batch)))
        assert entry["digest"] == digest.hexdigest(), entry["step"]
    saved = check.dir.glob("killed/*/*/process_0-of-1.json")
    finalized = [p for p in saved if p.parent.parent.name.isdigit()]  # not "6.orbax-...-tmp"
    assert finalized
    for path in finalized:
        step = int(path.parent.parent.name)
        assert json.loads(path.read_text()) == json.loads(json.dumps(loader.state(step)))


def test_another_seeds_restore_is_refused(check: Check) -> None:
    """A run of seed 1 on the saved checkpoints stops on ``StateMismatch``
    naming the seed before it trains a step."""
    last = check.out.stdout.splitlines()[-1]
    assert re.fullmatch(r"other seed: refused: StateMismatch: .*", last), last
    assert "fingerprint.config.seed: saved 0, now 1" in last
    assert not (check.dir / "other-seed.jsonl").exists()  # no step logged


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_the_guides_excerpt_is_the_scripts(name: str) -> None:
    """The trainers guide's excerpt of each recipe is its text, line by line in
    order, indentation aside (the excerpt leaves lines out and dedents)."""
    guide = (ROOT / "docs" / "guide" / "trainers.md").read_text()
    mark = f'<!--pytest.mark.skip(reason="an excerpt of scripts/recipe_{name}.py'
    block = guide[guide.index(mark) :].split("```python\n", 1)[1].split("```", 1)[0]
    script = [line.strip() for line in (ROOT / "scripts" / f"recipe_{name}.py").open()]
    at = 0
    for line in filter(None, (line.strip() for line in block.splitlines())):
        assert line in script[at:], f"{line!r} is not in recipe_{name}.py after line {at}"
        at += script[at:].index(line) + 1


def test_nanodos_get_in_out_is_the_loaders_inputs_targets_and_mask(tmp_path: Path) -> None:
    """The nanodo adapter's ``get_in_out`` of a ``"tokens"`` batch: targets and
    weights are the ``"fields"`` layout's targets and loss mask, inputs the
    targets shifted by one after the first column's input; targets of id 0 (a
    real token in its data) are weighted, which ``targets != pad_id`` would drop."""
    r = np.random.default_rng(0)
    ftj.write_dataset(
        tmp_path, {"train": [(r.integers(64) + np.arange(n)) % 64 for n in r.integers(8, 99, 400)]}
    )
    train = ftj.open_dataset(tmp_path)["train"]
    fields = ftj.Loader(train, dataclasses.replace(nanodo_config(), layout="fields"))
    tokens = ftj.Loader(train, nanodo_config())
    for step in range(3):
        x, y, weights = get_in_out(tokens.host_batch(step))
        want = fields.host_batch(step)
        np.testing.assert_array_equal(y, want["targets"])
        np.testing.assert_array_equal(x[:, 0], want["inputs"][:, 0])
        np.testing.assert_array_equal(x[:, 1:], want["targets"][:, :-1])  # one stream, shifted
        np.testing.assert_array_equal(weights, want["loss_mask"].astype(np.float32))
        assert ((np.asarray(y) == 0) & (np.asarray(weights) == 1)).any()


def test_a_resume_with_a_stale_iterator_state_is_caught(tmp_path: Path) -> None:
    """With the newest checkpoint's iterator state replaced by the one before
    (a wrong resume: the params of one step, the data of another) the check
    says DIFFERENT and exits 1."""
    out = run("maxtext", tmp_path, "--stale-iterator")
    assert out.returncode == 1, out.stdout + out.stderr
    assert re.search(r"^resume: DIFFERENT, steps \d+-7$", out.stdout, re.MULTILINE), out.stdout
    assert out.stdout.splitlines()[-1].startswith("other seed: refused: ")
