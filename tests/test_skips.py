"""Skips against restarts and the index space: a skip stated again after a
restore (the trainer's set-up code run again) changes nothing in either
order, a skip past the largest sample index is refused at ``skip`` and at
its YAML entry, and a change at the end of many extends what the loader
holds instead of rebuilding it."""

from __future__ import annotations

import json
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from commands import run_main
from hypothesis import given, settings
from hypothesis import strategies as st
from test_steering import NAMES, config, mixture, ops_loader, phased_run, splits

import flat_tokens_jax as ftj
from flat_tokens_jax.sampling.schedule import BatchSchedule
from flat_tokens_jax.sampling.skips import Skips
from flat_tokens_jax.sampling.steering import Steering

MAKERS: dict[str, Callable[[], Any]] = {
    "Loader": ops_loader,
    "one phase": lambda: ftj.PhasedLoader([ftj.Phase(0, mixture(NAMES, [2, 1, 1]), config(3))]),
    "two phases": phased_run,  # step 10 reads phase 1 (from step 6)
}


def same_batches(got: Any, want: Any, steps: range) -> None:
    for t in steps:
        np.testing.assert_array_equal(
            got.host_batch(t)["targets"], want.host_batch(t)["targets"], f"step {t}"
        )


@pytest.mark.parametrize("kind", MAKERS)
def test_a_skip_restated_after_a_restore_changes_nothing_in_either_order(kind: str) -> None:
    make = MAKERS[kind]
    call = "Loader.skip" if kind == "Loader" else "PhasedLoader.skip"
    run = make()
    run.skip(10, 3)
    run.skip(2, 1)
    saved = json.loads(json.dumps(run.state(5)))  # skips [[2, 1], [10, 3]]
    for order in ("skip, then restore", "restore, then skip"):
        again = make()
        if order == "skip, then restore":
            again.skip(10, 3)
        again.restore(saved)
        if order == "restore, then skip":
            again.skip(10, 3)
        again.skip(2, 1)  # before the saved step: restated, not refused
        assert again.state(5)["skips"] == [[2, 1], [10, 3]], order
        same_batches(again, run, range(5, 16))
    # Restated once after the restore, a skip there adds up as on a live loader.
    again.skip(10, 3)
    assert again.state(5)["skips"] == [[2, 1], [10, 6]]
    live = make()
    live.skip(10, 3)
    live.skip(10, 3)
    assert live.state()["skips"] == [[10, 6]]
    other = make()
    other.restore(saved)
    with pytest.raises(ValueError, match=rf"{call}: the restored run skips 3 batches at step 10, "):
        other.skip(10, 2)
    with pytest.raises(ValueError, match=r"skips 1 batches at step 2, this call 4: .*pass count 1"):
        other.skip(2, 4)
    assert other.state(5)["skips"] == [[2, 1], [10, 3]]


def test_a_yaml_skip_list_applied_before_or_after_a_restore_skips_once() -> None:
    listed = [{"step": 5, "count": 3}, {"step": 2, "count": 1}]
    run = ops_loader()
    ftj.apply_skips(run, listed)
    assert run.state()["skips"] == [[2, 1], [5, 3]]
    saved = run.state(4)
    for before in (True, False):
        again = ops_loader()
        if before:
            ftj.apply_skips(again, listed)
        again.restore(saved)
        if not before:
            ftj.apply_skips(again, listed)
        assert again.state(4)["skips"] == [[2, 1], [5, 3]]
        same_batches(again, run, range(4, 12))
    other = ops_loader()
    other.restore(saved)
    with pytest.raises(ValueError, match=r"^skip\[1\]: Loader.skip: the restored run skips 1 "):
        ftj.apply_skips(other, [{"step": 5, "count": 3}, {"step": 2, "count": 2}])


def last_data_step(batch_size: int) -> int:
    """The last data step whose samples ``[b * d, b * d + b)`` stay within ``2**63 - 1``."""
    return 2**63 // batch_size - 1


@pytest.mark.parametrize("kind", MAKERS)
def test_a_skip_past_the_largest_sample_index_is_refused_naming_the_largest_count(
    kind: str,
) -> None:
    run = MAKERS[kind]()
    call = "Loader.skip" if kind == "Loader" else "PhasedLoader.skip"
    # The run's last phase reads batches of 3 (2 for two phases), from data step 0 (6).
    last = last_data_step(3) if kind != "two phases" else 6 + last_data_step(2)
    most = last - 3
    big = 2**62 + 10**6
    with pytest.raises(ValueError) as e:
        run.skip(3, big)
    assert str(e.value) == (
        f"{call}: count {big} would make step 3 read data step {3 + big}, past data step "
        f"{last}, the last whose samples have indices within 2**63 - 1: pass a count of at "
        f"most {most}"
    )
    with pytest.raises(ValueError, match=rf"pass a count of at most {most}$"):
        run.skip(3, most + 1)
    run.skip(20, 1)  # a later skip moves with it: step 20 must stay within too
    with pytest.raises(ValueError, match=rf"would make step 20 .* at most {most - 18}$"):
        run.skip(3, most - 17)
    run.skip(3, most - 18)
    assert run.host_batch(20)["targets"].shape[0] == (2 if kind == "two phases" else 3)
    if kind != "two phases":  # a run of phases counts its samples over them all
        saved = run.state(20)
        assert ftj.steering_at(saved, 20).data_step == last
        assert MAKERS[kind]().restore(json.loads(json.dumps(saved))) == 20
    with pytest.raises(ValueError, match=r"step 20 read data step .*: no count fits$"):
        run.skip(4, 1)


def test_a_yaml_skip_past_the_largest_sample_index_is_named_by_its_entry(tmp_path: Path) -> None:
    most = last_data_step(3) - 3
    listed = [{"step": 9, "count": 1}, {"step": 3, "count": 2**62}]
    with pytest.raises(ValueError) as e:
        ftj.apply_skips(ops_loader(), listed)
    assert str(e.value).startswith(f"skip[1].count {2**62} would make step 3 read data step")
    assert str(e.value).endswith(f"pass a count of at most {most}")
    data = splits()["a"]
    (tmp_path / "run.yaml").write_text(
        json.dumps(
            {
                "data": {"datasets": {"a": {"url": data.store.url, "weight": 1}}},
                "loader": {"batch_size": 3, "seq_len": 2, "packing": False},
                "skip": listed,
                "steps": 4,
            }
        )
    )
    for command in (["show", "--step", "0", "--config"], ["preview"]):
        code, _, err = run_main(*command, str(tmp_path / "run.yaml"))
        assert code == 1, err
        assert f"run.yaml: skip[1].count {2**62} would make step 3 read data step" in err
        assert err.strip().endswith(f"pass a count of at most {most}")


COUNTS = [(2, 1, 1), (1, 2, 1), (1, 1, 2)]  # weights that are their own samples per period


def bytes_a_change(change: Callable[[int], None], first: int, n: int) -> float:
    """Bytes ``change(step)`` allocates on average over steps ``[n, n + 1000)``,
    after the changes of steps ``[first, n)``."""
    for step in range(first, n):
        change(step)
    tracemalloc.start()
    try:
        total = 0
        for step in range(n, n + 1000):
            tracemalloc.reset_peak()
            before = tracemalloc.get_traced_memory()[0]
            change(step)
            total += tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    return total / 1000


def test_a_change_at_the_end_extends_what_the_loader_holds() -> None:
    """10**4 weight changes and skips, each at or after the last: each adds
    its rows to the lists the steering before it holds (the same lists from
    the first change on), and allocates a few KiB on average, where a copy of
    the changes before it would take 8 bytes each (80 KiB)."""
    mix = mixture(NAMES, [2, 1, 1], ((10**9, [0, 1, 3]),))  # a declared entry after every change
    loader = ftj.Loader(mix, config(3))

    def change(step: int) -> None:
        if step % 4:
            loader.set_weights(step, COUNTS[step % 3])
        else:
            loader.skip(step, 1)

    change(1)
    change(4)
    first = loader.steering
    n = 10**4
    assert bytes_a_change(change, 5, n) < 16 * 1024
    now = loader.steering
    assert now._log is first._log and now.skips._rows is first.skips._rows
    assert now._segs is first._segs
    steps = [1, 4, *range(5, n + 1000)]
    assert now.changes == tuple((t, COUNTS[t % 3]) for t in steps if t % 4)
    assert now.skips.entries == tuple((t, 1) for t in steps if t % 4 == 0)


ops = st.lists(
    st.tuples(
        st.integers(0, 30),  # which earlier steering to change
        st.booleans(),  # skip, else a weight change
        st.integers(0, 14),
        st.integers(1, 3),
        st.sampled_from([(4, 0, 0), (1, 1, 2), (0, 3, 1)]),
    ),
    max_size=30,
)


@settings(max_examples=40, deadline=None)
@given(ops, st.sampled_from([(), ((6, [0, 1, 3]),)]))
def test_steerings_changed_from_any_earlier_one_route_as_one_built_afresh(
    drawn: list[tuple[Any, ...]], schedule: Any
) -> None:
    mix = mixture(NAMES, [2, 1, 1], schedule)
    batches = BatchSchedule.of([(0, 3), (5, 2)])
    made = [Steering(mix, batches)]
    for pick, is_skip, step, count, counts in drawn:
        at = made[pick % len(made)]
        made.append(at.with_skip(step, count) if is_skip else at.with_change(step, counts))
    g = np.arange(120)
    for steering in made:
        fresh = Steering(mix, batches, Skips(steering.skips.entries), steering.changes)
        for got, want in zip(steering.route(g), fresh.route(g), strict=True):
            np.testing.assert_array_equal(got, want)
        assert [steering.drawn(k) for k in range(0, 120, 7)] == [
            fresh.drawn(k) for k in range(0, 120, 7)
        ]
        assert steering.stretches(40) == fresh.stretches(40)


def test_a_change_in_the_last_phase_of_a_run_extends_what_it_holds() -> None:
    """Issue 46: a PhasedLoader rebuilt every phase's changes at each change
    (3 ms and 10 ms a call after 5,000). Changes in its last phase, each at or
    after the last, extend what that phase's steering and the run hold: a few
    KiB a change, where a copy of the changes before it would take 80 KiB."""
    mix = mixture(NAMES, [2, 1, 1])
    run = ftj.PhasedLoader([ftj.Phase(0, mix, config(3)), ftj.Phase(5, mix, config(3))])

    def change(step: int) -> None:
        if step % 4:
            run.set_weights(step, COUNTS[step % 3])
        else:
            run.skip(step, 1)

    n = 10**4
    assert bytes_a_change(change, 6, n) < 16 * 1024
    steps = range(6, n + 1000)
    saved = run.state()
    assert saved["weights"] == [[t, list(COUNTS[t % 3])] for t in steps if t % 4]
    assert saved["skips"] == [[t, 1] for t in steps if t % 4 == 0]
    again = ftj.PhasedLoader([ftj.Phase(0, mix, config(3)), ftj.Phase(5, mix, config(3))])
    again.restore(saved)
    for step in (7, 5000, n + 999):
        assert (again.host_batch(step)["targets"] == run.host_batch(step)["targets"]).all()
