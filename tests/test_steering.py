"""A run steered by its trainer (``set_weights``, ``skip``) against a brute-force
reference that materialises every component's stream and walks every data
step with the changes in effect, sample by sample."""

from __future__ import annotations

import functools
import hashlib
import json
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from commands import run_main
from hypothesis import given, settings
from hypothesis import strategies as st
from memurls import memory_url

import flat_tokens_jax as ftj
from flat_tokens_jax import steering_at
from flat_tokens_jax.loader.state import StateMismatch
from flat_tokens_jax.loader.steered import skips_from_config, skips_from_yaml
from flat_tokens_jax.sampling.mixture import Period, period_counts, prefix_counts
from flat_tokens_jax.sampling.sampling import permute
from flat_tokens_jax.sampling.schedule import BatchSchedule
from flat_tokens_jax.sampling.skips import Skips
from flat_tokens_jax.sampling.steering import TABLES_KEPT

NAMES = ("a", "b", "c")
SIZES = {"a": 7, "b": 5, "c": 3}  # records (sequences: packing=False) of each split
PERIOD = 4


@functools.cache
def splits() -> dict[str, ftj.FlatTokens]:
    out = {}
    for name, count in SIZES.items():
        base = 100 * (NAMES.index(name) + 1)
        url = memory_url(f"steer-{name}")
        ftj.write_dataset(url, {"train": [[base + i, base + i] for i in range(count)]})
        out[name] = ftj.open_dataset(url)["train"]
    return out


def mixture(names: tuple[str, ...], weights: list[int], schedule: Any = ()) -> ftj.Mixture:
    data = splits()
    return ftj.Mixture(
        {n: (data[n], w) for n, w in zip(names, weights, strict=True)},
        seed=3,
        period=PERIOD,
        schedule=schedule,
    )


def config(batch_size: Any, prefetch: int = 0) -> ftj.LoaderConfig:
    return ftj.LoaderConfig(
        batch_size=batch_size, seq_len=2, packing=False, seed=5, prefetch=prefetch
    )


# The reference: plain loops, written from the semantics, not from the code.


def layout(counts: list[int]) -> list[int]:
    """The component at each offset of a period: ``c``'s ``k``-th at ``(k + 1/2) / n_c``."""
    slots = [(Fraction(2 * k + 1, 2 * n), c) for c, n in enumerate(counts) for k in range(n)]
    return [c for _, c in sorted(slots)]


def stream_record(name: str, component: int, index: int) -> tuple[int, int]:
    """``(epoch, record)`` of sample ``index`` of ``name``'s stream (first seen as component)."""
    n = SIZES[name]
    key = int.from_bytes(hashlib.sha256(f"5/3/{component}".encode()).digest()[:8], "little")
    epoch, pos = divmod(index, n)
    return epoch, int(permute([pos], n, seed=key, epoch=epoch)[0])


def data_steps(ops: list[tuple[Any, ...]], steps: int) -> list[int]:
    """``d(t)`` of each trainer step: ``t`` plus every count skipped at steps <= t."""
    skipped: dict[int, int] = {}
    for op in ops:
        if op[0] == "skip":
            skipped[op[1]] = skipped.get(op[1], 0) + op[2]
    return [t + sum(n for s, n in skipped.items() if s <= t) for t in range(steps)]


def reference(phases: list[dict[str, Any]], ops: list[tuple[Any, ...]], steps: int) -> list[Any]:
    """Each trainer step's rows as ``(component name, component index, epoch,
    record, sample in its phase)``: every data step up to the last one read is
    walked, and every sample of it given to its component's stream, read or
    skipped."""
    changes = {op[1]: op[2] for op in ops if op[0] == "weights"}  # the last at a step wins
    d = data_steps(ops, max([steps, *[t + 1 for t in changes]]))
    starts = [p["start"] for p in phases]

    def phase_of(x: int) -> int:
        return max(k for k, s in enumerate(starts) if s <= x)

    segments = []  # per phase: {its data step: counts}, a trainer's change over a declared one
    for k, p in enumerate(phases):
        mine = {0: p["weights"], **dict(p.get("schedule", ()))}
        for t in sorted(changes):
            if phase_of(d[t]) == k:
                mine[d[t] - starts[k]] = changes[t]
        segments.append(mine)
    drawn: dict[str, int] = {}
    # A stream keeps the shuffle key of the phase it first appears in, drawn there or not.
    first_component: dict[str, int] = {}
    for p in phases:
        for c, name in enumerate(p["names"]):
            first_component.setdefault(name, c)
    rows_at: dict[int, list[Any]] = {}
    for x in range(d[steps - 1] + 1):
        k = phase_of(x)
        p = phases[k]
        size = BatchSchedule.of(p["batch_size"])
        local = x - starts[k]
        first = sum(size.size(y) for y in range(local))
        rows = []
        for g in range(first, first + size.size(local)):
            seg = max(s for s in segments[k] if sum(size.size(y) for y in range(s)) <= g)
            seg_first = sum(size.size(y) for y in range(seg))
            c = layout(list(segments[k][seg]))[(g - seg_first) % PERIOD]
            name = p["names"][c]
            index = drawn.get(name, 0)
            drawn[name] = index + 1
            rows.append((name, c, *stream_record(name, first_component[name], index), g))
        rows_at[x] = rows
    return [rows_at[x] for x in d[:steps]]


def apply(run: Any, ops: list[tuple[Any, ...]]) -> None:
    for op in ops:
        if op[0] == "skip":
            run.skip(op[1], op[2])
        else:
            run.set_weights(op[1], list(op[2]))


def check(run: Any, expected: list[Any], steps: range, phased: bool = False) -> None:
    for t in steps:
        got = [
            (r["component_name"], r["component"], r["epoch"], r["record"], r["sample"])
            for r in run.provenance(t)
        ]
        want = [(n, c, e, rec, g) for n, c, e, rec, g in expected[t]]
        if phased:  # samples count over the run there: compare the rest
            got, want = [r[:4] for r in got], [r[:4] for r in want]
        assert got == want, f"step {t}"


def counts_of(period: int) -> st.SearchStrategy[list[int]]:
    """Three ints >= 0 summing to ``period``: weights that are their own counts."""
    return st.lists(st.integers(0, period), min_size=2, max_size=2).map(
        lambda cut: [min(cut), max(cut) - min(cut), period - max(cut)]
    )


ops_strategy = st.lists(
    st.one_of(
        st.tuples(st.just("skip"), st.integers(0, 12), st.integers(1, 4)),
        st.tuples(st.just("weights"), st.integers(0, 12), counts_of(PERIOD).map(tuple)),
    ),
    max_size=6,
)
STEPS = 16


@settings(max_examples=40, deadline=None)
@given(
    ops_strategy,
    st.sampled_from([3, [[0, 2], [5, 3]]]),
    st.sampled_from([(), ((6, [0, 1, 3]),)]),
    st.data(),
)
def test_every_step_matches_the_streams_reference_and_restores_anywhere(
    ops: list[tuple[Any, ...]], batch_size: Any, schedule: Any, data: st.DataObject
) -> None:
    spec = {"start": 0, "names": NAMES, "weights": [2, 1, 1], "batch_size": batch_size}
    spec["schedule"] = schedule
    expected = reference([spec], ops, STEPS)
    mix = mixture(NAMES, [2, 1, 1], schedule)
    loader = ftj.Loader(mix, config(batch_size))
    apply(loader, ops)
    check(loader, expected, range(STEPS))
    # Each component's samples never repeat within an epoch.
    seen: dict[str, set[tuple[int, int]]] = {}
    for t in range(STEPS):
        for row in loader.provenance(t):
            key = (row["epoch"], row["record"])
            assert key not in seen.setdefault(row["component_name"], set()), f"step {t}"
            seen[row["component_name"]].add(key)
    # Restored anywhere, a change's step included: the same batches.
    changed = sorted({op[1] for op in ops})
    at = data.draw(
        st.sampled_from(changed) if changed and data.draw(st.booleans()) else st.integers(0, STEPS)
    )
    state = json.loads(json.dumps(loader.state(at)))
    resumed = ftj.Loader(mix, config(batch_size))
    assert resumed.restore(state) == at
    for t in range(STEPS):
        for field, value in loader.host_batch(t).items():
            np.testing.assert_array_equal(resumed.host_batch(t)[field], value, err_msg=f"{t}")
    assert resumed.fingerprint() == ftj.Loader(mix, config(batch_size)).fingerprint()


PHASES = [
    {"start": 0, "names": NAMES, "weights": [2, 1, 1], "batch_size": 3},
    # Another order, one stream fewer: streams go on by name.
    {"start": 6, "names": ("b", "a"), "weights": [3, 1], "batch_size": 2},
]


def phased_run() -> ftj.PhasedLoader:
    return ftj.PhasedLoader(
        [
            ftj.Phase(0, mixture(NAMES, [2, 1, 1]), config(3)),
            ftj.Phase(6, mixture(("b", "a"), [3, 1]), config(2)),
        ]
    )


def for_phases(ops: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """Skips first, then weight changes, each with the weights of the phase
    whose data its step reads (two for phase 1)."""
    d = data_steps(ops, 20)
    skips = [op for op in ops if op[0] == "skip"]
    weights = [
        op if d[op[1]] < 6 else ("weights", op[1], (op[2][0] + op[2][2], op[2][1]))
        for op in ops
        if op[0] == "weights"
    ]
    return skips + weights


@settings(max_examples=25, deadline=None)
@given(ops_strategy, st.data())
def test_a_phased_run_steered_across_its_boundary_matches_the_reference(
    drawn_ops: list[tuple[Any, ...]], data: st.DataObject
) -> None:
    ops = for_phases(drawn_ops)
    expected = reference(PHASES, ops, STEPS)
    run = phased_run()
    apply(run, ops)
    check(run, expected, range(STEPS), phased=True)
    at = data.draw(st.integers(0, STEPS))
    state = json.loads(json.dumps(run.state(at)))
    resumed = phased_run()
    assert resumed.restore(state) == at
    for t in range(STEPS):
        np.testing.assert_array_equal(
            resumed.host_batch(t)["targets"], run.host_batch(t)["targets"]
        )
    for t, batch in resumed.iterate(at):
        if t >= STEPS:
            break
        np.testing.assert_array_equal(batch["targets"], run.host_batch(t)["targets"], f"step {t}")


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 9), min_size=1, max_size=5), st.data())
def test_prefix_counts_match_the_period_tables(counts: list[int], data: st.DataObject) -> None:
    if not any(counts):
        counts[0] = 1
    table = Period.of_counts(counts)
    rest = data.draw(st.integers(0, table.period))
    want = np.bincount(table.component[:rest], minlength=len(counts))
    np.testing.assert_array_equal(prefix_counts(counts, rest), want)
    np.testing.assert_array_equal(
        Period.of_counts(period_counts(counts, sum(counts))).component, table.component
    )


@settings(max_examples=100, deadline=None)
@given(st.dictionaries(st.integers(0, 30), st.integers(1, 5), max_size=5), st.integers(0, 60))
def test_data_steps_increase_and_trainer_step_inverts_them(
    entries: dict[int, int], data_step: int
) -> None:
    skips = Skips(tuple(sorted(entries.items())))
    d = [t + sum(n for s, n in entries.items() if s <= t) for t in range(70)]
    assert [skips.data_step(t) for t in range(70)] == d
    assert skips.trainer_step(data_step) == min(t for t in range(70) if d[t] >= data_step)


def ops_loader(prefetch: int = 0) -> ftj.Loader:
    return ftj.Loader(mixture(NAMES, [2, 1, 1]), config(3, prefetch))


def test_steps_read_ahead_past_a_change_are_dropped_and_read_again() -> None:
    want = ops_loader()
    want.set_weights(5, [0, 1, 3])
    want.skip(7, 2)
    loader = ops_loader(prefetch=4)
    got = {}
    for step, batch in loader.iterate(0, 14):
        got[step] = np.asarray(batch["targets"])
        if step == 2:
            assert loader.stats()["depth"] >= 3, "steps 3.. are read ahead"
            loader.set_weights(5, [0, 1, 3])
        if step == 4:
            assert loader.stats()["depth"] >= 3
            loader.skip(7, 2)
    for step in range(14):
        np.testing.assert_array_equal(got[step], want.host_batch(step)["targets"], f"step {step}")


def test_host_batch_and_provenance_inspect_and_change_nothing() -> None:
    loader = ops_loader()
    loader.skip(2, 1)
    before = loader.state()
    rows = loader.provenance(4)
    batch = loader.host_batch(4)
    assert loader.state() == before and loader.next_step == 0
    assert [r["sample"] for r in rows] == [15, 16, 17]  # data step 5
    assert batch["targets"].shape == (3, 2)


def test_a_step_before_the_next_step_is_refused_naming_both() -> None:
    loader = ops_loader()
    assert [step for step, _ in loader.iterate(0, 6)] == list(range(6))
    for call in (lambda: loader.set_weights(3, [1, 1, 1]), lambda: loader.skip(5, 1)):
        with pytest.raises(ValueError, match=r"step [35] is before the loader's next step 6"):
            call()
    loader.set_weights(6, [1, 1, 1])  # the next step itself is the first allowed
    run = phased_run()
    run.next_step = 9
    with pytest.raises(ValueError, match=r"PhasedLoader.skip: step 8 is before .* next step 9"):
        run.skip(8, 1)


def test_weights_and_counts_are_checked_by_the_mixtures_own_checks() -> None:
    loader = ops_loader()
    with pytest.raises(ValueError, match="expected 3 weights, one per component, got 2"):
        loader.set_weights(1, [1, 1])
    with pytest.raises(ValueError, match=r"missing \['c'\]"):
        loader.set_weights(1, {"a": 1, "b": 1})
    with pytest.raises(ValueError, match="are all zero"):
        loader.set_weights(1, [0, 0, 0])
    with pytest.raises(ValueError, match=r"Loader\.skip: count must be an int in"):
        loader.skip(1, 0)
    with pytest.raises(ValueError, match=r"Loader\.skip: step must be an int"):
        loader.skip(True, 1)
    single = ftj.Loader(splits()["a"], config(3))
    with pytest.raises(ValueError, match="a single source, which has no weights"):
        single.set_weights(0, [1])
    # By name; a second change at one step replaces the first; skips add up.
    loader.set_weights(2, [1, 1, 2])
    loader.set_weights(2, {"a": 0.5, "b": 0.25, "c": 0.25})
    loader.skip(3, 1)
    loader.skip(3, 2)
    assert loader.steering.changes == ((2, (2, 1, 1)),)
    assert loader.steering.skips.entries == ((3, 3),)


def test_a_run_without_changes_saves_todays_state_and_changes_leave_the_fingerprint() -> None:
    loader = ops_loader()
    plain = loader.state(4)
    assert set(plain) == {"step", "samples", "fingerprint", "sources"}
    loader.set_weights(2, [1, 0, 3])
    loader.skip(3, 2)
    steered = loader.state(4)
    assert steered["fingerprint"] == plain["fingerprint"]
    assert steered["weights"] == [[2, [1, 0, 3]]] and steered["skips"] == [[3, 2]]
    assert steered["samples"] == 6 * 3  # step 4 reads data step 6
    # A state saved before any change restores, and continues without them.
    fresh = ops_loader()
    assert fresh.restore(plain) == 4 and fresh.steering.changes == ()


def test_a_state_saved_right_at_a_change_and_after_it_replays_it() -> None:
    loader = ops_loader()
    loader.set_weights(4, [0, 0, 4])
    loader.skip(6, 1)
    for at in (3, 4, 5, 6, 7):
        resumed = ops_loader()
        resumed.restore(json.loads(json.dumps(loader.state(at))))
        for t in range(at, at + 4):
            np.testing.assert_array_equal(
                resumed.host_batch(t)["targets"], loader.host_batch(t)["targets"]
            )


def test_changes_in_both_phases_and_a_skip_across_the_boundary() -> None:
    ops = [
        ("skip", 4, 3),
        ("weights", 1, (0, 1, 3)),
        ("weights", 5, (1, 3)),
        ("weights", 9, (4, 0)),
    ]
    expected = reference(PHASES, ops, STEPS)
    run = phased_run()
    apply(run, ops)
    assert run.firsts == [0, 4] and run.phase_at(4) == 1  # data step 7, in phase 1
    check(run, expected, range(STEPS), phased=True)
    at = steering_at(run, 10)
    assert (at.data_step, at.phase, at.counts, at.since) == (13, 1, (4, 0), 9)
    assert at.names == ("b", "a") and at.changed
    state = run.state(10)
    assert steering_at(state, 10) == at


def test_a_skip_that_moves_a_weight_change_into_another_phase_is_refused() -> None:
    run = phased_run()
    run.set_weights(3, [1, 1, 2])  # data step 3: phase 0's weights
    with pytest.raises(ValueError, match=r"moves the weight change at step 3 from phase 0"):
        run.skip(2, 5)  # step 3 would read data step 8, in phase 1
    state = run.state()
    assert "skips" not in state and state["weights"] == [[3, [1, 1, 2]]]


def steered_state() -> dict[str, Any]:
    loader = ops_loader()
    loader.set_weights(2, [1, 0, 3])
    loader.skip(3, 2)
    return json.loads(json.dumps(loader.state(4)))


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"skips": [[3, 0]]}, "skips[0][1] must be an int in [1, 2**63 - 1], got 0"),
        ({"skips": [[3, 1], [2, 1]]}, "skips[1][0]: step 2 is not after the previous entry's, 3"),
        ({"skips": []}, "skips: expected a non-empty list of [step, count] pairs, got []"),
        ({"skips": [[3, 1, 1]]}, "skips[0]: expected [step, count] pairs, got [3, 1, 1]"),
        ({"weights": [[2, [1, 3]]]}, "weights[0][1]: expected 3 ints >= 0, one per component"),
        ({"weights": [[2, [1, 3, -1]]]}, "weights[0][1][2] must be an int in [0,"),
        ({"weights": [[2, [0, 0, 0]]]}, "weights[0][1]: the samples of each component per period"),
        ({"weights": [[-2, [1, 1, 1]]]}, "weights[0][0] must be an int in [0, 2**63 - 1], got -2"),
        ({"weights": [[2, [1.5, 1, 1]]]}, "weights[0][1][0] must be an int"),
    ],
)
def test_a_bad_change_in_a_state_is_named_by_its_path(
    change: dict[str, Any], named: str, tmp_path: Path
) -> None:
    state = {**steered_state(), **change}
    with pytest.raises(StateMismatch) as e:
        ops_loader().restore(state)
    assert named in str(e.value)
    (tmp_path / "s.json").write_text(json.dumps(state))
    code, _, err = run_main("show", "--state", str(tmp_path / "s.json"), "--step", "0")
    assert code == 1 and named in err and len(err.strip().splitlines()) == 1


def test_weights_in_the_state_of_a_single_source_are_refused() -> None:
    single = ftj.Loader(splits()["a"], config(3))
    state = {**single.state(2), "weights": [[1, [1]]]}
    with pytest.raises(StateMismatch, match=r"weights\[0\]: the data is a single source"):
        ftj.Loader(splits()["a"], config(3)).restore(state)


def test_a_yaml_skip_list_is_read_strictly_and_agrees_with_a_restored_state(
    tmp_path: Path,
) -> None:
    run = tmp_path / "run.yaml"
    run.write_text(
        "loader: {batch_size: 3, seq_len: 2}\nskip: [{step: 3, count: 2}, {step: 9, count: 1}]\n"
    )
    assert skips_from_yaml(run) == [(3, 2), (9, 1)]
    (tmp_path / "none.yaml").write_text("loader: {batch_size: 3, seq_len: 2}\n")
    assert skips_from_yaml(tmp_path / "none.yaml") == []
    for bad, named in [
        ([{"step": 3, "count": 0}], "skip[0].count must be an int in [1,"),
        ([{"stepp": 3, "count": 1}], "skip[0] has unknown key 'stepp' (did you mean 'step'?)"),
        ([{"step": 3}], "skip[0] must say 'count'"),
        (
            [{"step": 3, "count": 1}, {"step": 3, "count": 2}],
            "skip[1].step repeats step 3 of skip[0]",
        ),
        ({"step": 3, "count": 1}, "skip must be a list of {step, count}"),
    ]:
        with pytest.raises(ValueError) as e:
            skips_from_config(bad)
        assert named in str(e.value)
    saved = steered_state()  # saved at step 4: skips [[3, 2]]
    agrees = ops_loader()
    for step, count in skips_from_yaml(run):
        agrees.skip(step, count)
    agrees.restore(saved)  # (3, 2) is what the run did; (9, 1) is still ahead
    assert agrees.steering.skips.entries == ((3, 2), (9, 1))
    other = ops_loader()
    other.skip(3, 1)
    with pytest.raises(
        StateMismatch, match=r"skips at step 3: the saved state has count 2, this loader 1"
    ):
        other.restore(saved)
    late = ops_loader()
    late.skip(1, 1)
    with pytest.raises(
        StateMismatch,
        match=r"skips at step 1: this loader has count 1, but the run saved at step 4 had none",
    ):
        late.restore(saved)


def test_show_prints_the_data_step_and_the_weights_a_step_reads(tmp_path: Path) -> None:
    loader = ops_loader()
    loader.skip(5, 3)
    loader.set_weights(7, [3, 1, 0])
    (tmp_path / "s.json").write_text(json.dumps(loader.state(5)))
    code, out, err = run_main(
        "show", "--state", str(tmp_path / "s.json"), "--step", "7", "--rows", "0"
    )
    assert code == 0, err
    assert "step 7 reads the data of step 10: 3 batches skipped at step 5" in out
    assert (
        "weights at step 7: a 0.75, b 0.25, c 0 ([3, 1, 0] samples per period of 4; set at step 7)"
        in out
    )
    code, out, err = run_main(
        "show", "--state", str(tmp_path / "s.json"), "--step", "9", "--skip", "8:2", "--json"
    )
    assert code == 0, err
    shown = json.loads(out)
    assert shown["steering"]["data_step"] == 14 and shown["steering"]["skipped"] == [[5, 3], [8, 2]]
    loader.skip(8, 2)
    assert [r["record"] for r in shown["rows"]] == [r["record"] for r in loader.provenance(9)]
    code, _, err = run_main(
        "show", "--state", str(tmp_path / "s.json"), "--step", "9", "--skip", "8"
    )
    assert code == 1 and "--skip '8': expected STEP:COUNT" in err
    code, _, err = run_main(
        "show", "--state", str(tmp_path / "s.json"), "--step", "9", "--skip", "4:1"
    )
    assert code == 1 and "step 4 is before the loader's next step 5" in err


def test_show_and_preview_read_a_yaml_skip_list(tmp_path: Path) -> None:
    data = splits()
    (tmp_path / "run.yaml").write_text(
        json.dumps(
            {
                "data": {
                    "datasets": {
                        n: {"url": data[n].store.url, "weight": w}
                        for n, w in zip(NAMES, [2, 1, 1], strict=True)
                    },
                    "seed": 3,
                    "period": PERIOD,
                },
                "loader": {"batch_size": 3, "seq_len": 2, "packing": False, "seed": 5},
                "skip": [{"step": 5, "count": 3}],
                "steps": 12,
            }
        )
    )
    code, out, err = run_main(
        "show", "--config", str(tmp_path / "run.yaml"), "--step", "7", "--json"
    )
    assert code == 0, err
    loader = ops_loader()
    loader.skip(5, 3)
    assert [r["record"] for r in json.loads(out)["rows"]] == [
        r["record"] for r in loader.provenance(7)
    ]
    loader.set_weights(6, [0, 1, 3])
    (tmp_path / "s.json").write_text(json.dumps(loader.state(5)))
    code, out, err = run_main(
        "preview", str(tmp_path / "run.yaml"), "--state", str(tmp_path / "s.json")
    )
    assert code == 0, err
    told = "step 5 reads the data of step 8 (3 batches skipped there); weights from it: "
    assert told + "a 0.5, b 0.25, c 0.25" in out
    assert "step 6 reads the data of step 9; weights from it: a 0, b 0.25, c 0.75" in out


def test_thousands_of_changes_keep_a_small_state_and_few_period_tables() -> None:
    data = splits()
    mix = ftj.Mixture({n: (data[n], 1) for n in NAMES})  # default periods: 1000 and more
    loader = ftj.Loader(mix, config(3))
    rng = np.random.default_rng(0)
    for k in range(2_000):
        loader.set_weights(100 * (k + 1), rng.integers(1, 100, 3).tolist())
    before = len(json.dumps(ftj.Loader(mix, config(3)).state()))
    grown = len(json.dumps(loader.state())) - before
    assert grown < 2_000 * 40, f"{grown} bytes: about 30 a change of 3 components"
    assert steering_at(loader, 10**6).since == 200_000  # the last change's step
    for step in range(0, 200_000, 997):  # a step in most segments
        loader.provenance(step)
    assert len(loader.steering._tables) <= TABLES_KEPT


def test_a_grain_iterator_follows_changes_made_while_it_reads_ahead() -> None:
    run = phased_run()
    steps = iter(run.to_grain())
    got = [next(steps)["targets"] for _ in range(3)]
    run.skip(4, 3)  # phase 1, declared at step 6, now starts at step 4
    run.set_weights(8, [0, 4])
    got += [next(steps)["targets"] for _ in range(9)]
    for step, targets in enumerate(got):
        np.testing.assert_array_equal(targets, run.host_batch(step)["targets"], f"step {step}")
    assert run.firsts == [0, 4]


def test_a_skip_ends_a_bounded_run_sooner_even_while_iterating() -> None:
    split = splits()["a"]  # 7 records: 3 steps of 3 rows, the last padded
    cfg = ftj.LoaderConfig(batch_size=3, seq_len=2, packing=False, num_epochs=2, prefetch=2)
    loader = ftj.Loader(split, cfg)
    assert loader.num_batches == 5
    want = ftj.Loader(split, cfg)
    seen = []
    for step, batch in loader.iterate():
        seen.append((step, np.asarray(batch["targets"])))
        if step == 0:
            loader.skip(1, 2)
    assert [s for s, _ in seen] == [0, 1, 2] and loader.num_batches == 3
    for step, targets in seen:
        np.testing.assert_array_equal(targets, want.host_batch(step + 2 * (step >= 1))["targets"])
    with pytest.raises(
        IndexError, match=r"step 3 \(it reads data step 5\) is past the end: this run has 3 steps"
    ):
        loader.host_batch(3)
