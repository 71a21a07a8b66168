"""``preview``'s shares of a steered run (``share_segments``, ``draw_shares``)
against a brute-force count of each step's rows from ``provenance()``."""

from __future__ import annotations

import itertools
import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from commands import run_main
from hypothesis import given, settings
from hypothesis import strategies as st
from test_steering import NAMES, PERIOD, STEPS, apply, config, for_phases, mixture, ops_strategy

import flat_tokens_jax as ftj
from flat_tokens_jax.tools.runview import share_segments


def counted_shares(run: ftj.PhasedLoader, step: int) -> dict[str, float]:
    """Each component's share of the rows ``step`` reads, from ``provenance``."""
    rows = run.provenance(step)
    names = run.engines[run.phase_at(step)].names
    found = Counter(r["component_name"] for r in rows)
    return {n: found[n] / len(rows) for n in names}


def check_shares(run: ftj.PhasedLoader, changes: list[int]) -> None:
    """The segments tile the steps, start at every weight change and phase,
    and give each step the shares its rows have (a step holds whole periods),
    as ``steering_at`` of its saved state does."""
    segments = share_segments(run, STEPS)
    assert segments[0][0] == 0 and segments[-1][1] == STEPS
    assert all(b == a for (_, b, _), (a, _, _) in itertools.pairwise(segments))
    firsts = {a for a, _, _ in segments}
    assert {t for t in changes if t < STEPS} <= firsts
    assert {f for f in run.firsts if f < STEPS} <= firsts
    state = json.loads(json.dumps(run.state()))
    for a, b, shares in segments:
        for step in range(a, b):
            assert counted_shares(run, step) == shares, f"step {step} in [{a}, {b})"
            assert ftj.steering_at(state, step).shares == shares, f"step {step}"


@settings(max_examples=30, deadline=None)
@given(
    ops_strategy,
    st.sampled_from([PERIOD, [[0, PERIOD], [5, 2 * PERIOD]]]),
    st.sampled_from([(), ((6, [0, 1, 3]),)]),
)
def test_shares_follow_weight_changes_and_skips(
    ops: list[tuple[Any, ...]], batch_size: Any, schedule: Any
) -> None:
    run = ftj.PhasedLoader([ftj.Phase(0, mixture(NAMES, [2, 1, 1], schedule), config(batch_size))])
    apply(run, ops)
    check_shares(run, [op[1] for op in ops if op[0] == "weights"])


@settings(max_examples=20, deadline=None)
@given(ops_strategy)
def test_shares_of_a_phased_run_follow_its_changes_across_the_boundary(
    drawn: list[tuple[Any, ...]],
) -> None:
    ops = for_phases(drawn)
    run = ftj.PhasedLoader(
        [
            ftj.Phase(0, mixture(NAMES, [2, 1, 1]), config(PERIOD)),
            ftj.Phase(6, mixture(("b", "a"), [3, 1]), config(PERIOD)),
        ]
    )
    apply(run, ops)
    check_shares(run, [op[1] for op in ops if op[0] == "weights"])


def test_a_segment_every_step_of_which_is_skipped_is_left_out() -> None:
    mix = mixture(NAMES, [2, 1, 1], [(5, [0, 4, 0]), (6, [0, 0, 4])])
    run = ftj.PhasedLoader([ftj.Phase(0, mix, config(PERIOD))])
    run.set_weights(2, [1, 1, 2])
    run.skip(4, 2)  # step 4 reads data step 6: no step reads the segment at data step 5
    assert share_segments(run, 8) == [
        (0, 2, {"a": 0.5, "b": 0.25, "c": 0.25}),
        (2, 4, {"a": 0.25, "b": 0.25, "c": 0.5}),
        (4, 8, {"a": 0.0, "b": 0.0, "c": 1.0}),
    ]
    assert [counted_shares(run, t)["c"] for t in (1, 3, 4, 7)] == [0.25, 0.5, 1.0, 1.0]


@pytest.mark.parametrize("suffix", ["png", "svg"])
def test_preview_draws_a_states_changes_and_skips(tmp_path: Path, suffix: str) -> None:
    pytest.importorskip("matplotlib")
    mix = mixture(NAMES, [2, 1, 1])
    (tmp_path / "run.yaml").write_text(
        json.dumps(
            {
                "data": {
                    "datasets": {
                        n: {"url": source.store.url, "weight": w}
                        for n, source, w in zip(NAMES, mix.sources, [2, 1, 1], strict=True)
                    },
                    "seed": 3,
                    "period": PERIOD,
                },
                "loader": {"batch_size": PERIOD, "seq_len": 2, "packing": False, "seed": 5},
            }
        )
    )
    loader = ftj.Loader(mix, config(PERIOD))
    loader.set_weights(3, [0, 1, 3])
    loader.skip(6, 3)
    loader.set_weights(9, [4, 0, 0])
    (tmp_path / "s.json").write_text(json.dumps(loader.state()))
    picture = tmp_path / f"p.{suffix}"
    code, _, err = run_main(
        "preview",
        str(tmp_path / "run.yaml"),
        "--state",
        str(tmp_path / "s.json"),
        "--steps",
        "12",
        "--picture",
        str(picture),
    )
    assert code == 0, err
    if suffix == "png":
        assert picture.read_bytes().startswith(b"\x89PNG")
    else:
        text = picture.read_text()
        assert "skip 3" in text and "weight change" in text
        assert "<!-- step (a skip: the data jumps ahead there) -->" in text
