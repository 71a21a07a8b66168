"""``SavedState``, the one state: its JSON form is what ``state()`` returns,
its reader gives back what the loader holds, and ``restore`` reads a state once."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from test_savedstate_golden import GOLDEN, build, saved

import flat_tokens_jax as ftj
from flat_tokens_jax.loader import state as state_module
from flat_tokens_jax.loader.state import SavedState, StateMismatch


@pytest.mark.parametrize("case", sorted(GOLDEN))
def test_a_golden_text_read_is_the_restored_runs_state_and_writes_the_same_text(
    case: str, tmp_path: Path
) -> None:
    text = saved(case)
    read = SavedState.read(json.loads(text))
    assert json.dumps(read.to_json()) == text
    run = build(case, tmp_path)
    run.restore(read)
    assert run.saved_state(5) == read
    assert run.saved_state() == read  # restore moved next_step to the saved step 5
    assert run.state(5) == read.to_json() == json.loads(text)


def test_restore_reads_a_state_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    reads: list[Any] = []
    checked = state_module.checked

    def counted(value: Any) -> Any:
        reads.append(value)
        return checked(value)

    monkeypatch.setattr(state_module, "checked", counted)
    for case in ("steered", "phased"):
        reads.clear()
        assert build(case, tmp_path).restore(json.loads(saved(case))) == 5
        assert len(reads) == 1, case


def test_a_refusal_holds_the_lines_that_name_each_field() -> None:
    loader = build("packed", Path("unused"))
    state = loader.state()
    broken = {**state, "samples": -1, "sources": "nowhere"}
    with pytest.raises(StateMismatch) as refused:
        SavedState.read(broken)
    assert refused.value.lines == (
        "samples must be an int in [0, 2**63 - 1], got -1",
        "sources: expected a non-empty list, one per component, got 'nowhere' (a str)",
    )
    assert str(refused.value) == "\n  ".join(
        ["not a loader state this version reads:", *refused.value.lines]
    )
    assert loader.state_differences(broken) == list(refused.value.lines)


def test_steering_at_a_saved_state_is_that_of_its_json_and_of_the_loader(tmp_path: Path) -> None:
    run = build("steered", tmp_path)
    run.skip(2, 3)
    run.set_weights(4, {"a": 1, "b": 3})
    read = SavedState.read(run.state())
    for step in range(12):
        at = read.steering_at(step)
        assert at == ftj.steering_at(run, step) == ftj.steering_at(run.state(), step)
    assert read.steering_at(3).data_step == 6  # 3 batches skipped at step 2
    # 1:3 over the period of 3 rounds to [1, 2] (the golden "steered" state holds it too)
    assert read.steering_at(4).counts == (1, 2) and read.steering_at(4).since == 4
