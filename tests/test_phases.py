"""Runs in phases against a brute-force reference that walks every step and
hands each row the next record of its stream, from each stream's whole order."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from memurls import memory_url
from reference import bin_row, packed_row, padded_row

import flat_tokens_jax as ftj
from flat_tokens_jax.cli import main
from flat_tokens_jax.data.bins import BinRecords
from flat_tokens_jax.loader.phasedloader import PhasedLoader
from flat_tokens_jax.loader.phases import STREAM_FIELDS, Phase, stream_key
from flat_tokens_jax.sampling.mixture import Mixture
from flat_tokens_jax.sampling.sampling import permute
from flat_tokens_jax.sampling.steering import Steering


@functools.cache
def splits() -> dict[str, tuple[ftj.FlatTokens, list[list[int]]]]:
    """Two small splits whose tokens tell rows apart; epochs end every few steps."""
    rng = np.random.default_rng(7)
    out = {}
    for name, count in (("a", 11), ("b", 8)):
        seqs = [rng.integers(1, 900, int(rng.integers(1, 10))).tolist() for _ in range(count)]
        url = memory_url(f"phases-{name}")
        ftj.write_dataset(url, {"train": seqs})
        out[name] = (ftj.open_dataset(url)["train"], seqs)
    return out


def build(spec: dict[str, Any]) -> Phase:
    """A Phase from a plain spec: ``source`` a split name or ``{name: weight}``."""
    data = splits()
    if isinstance(spec["source"], str):
        source: Any = data[spec["source"]][0]
    else:
        source = Mixture(
            {n: (data[n][0], w) for n, w in spec["source"].items()},
            seed=spec.get("mix_seed", 0),
            period=spec.get("period"),
            schedule=spec.get("weights_from", ()),
        )
    config = ftj.LoaderConfig(
        batch_size=spec["batch_size"],
        seq_len=spec["seq_len"],
        packing=spec["packing"],
        seed=spec["seed"],
        shuffle=spec["shuffle"],
        prefetch=0,
    )
    return Phase(spec["start"], source, config)


def reference(specs: list[dict[str, Any]], steps: int) -> list[dict[str, np.ndarray]]:
    """Every batch of ``steps`` steps: each row takes its stream's next record."""
    data = splits()
    drawn: dict[tuple[Any, ...], int] = {}
    # A stream keeps the shuffle key of the phase it first appears in, drawn
    # from there or not.
    seeds: dict[tuple[Any, ...], int] = {}
    for spec in specs:
        names = [spec["source"]] if isinstance(spec["source"], str) else list(spec["source"])
        for c, name in enumerate(names):
            key = (name, spec["seq_len"], spec["packing"], spec["seed"], spec["shuffle"])
            if key not in seeds:
                seeds[key] = spec["seed"]
                if not isinstance(spec["source"], str):
                    text = f"{spec['seed']}/{spec.get('mix_seed', 0)}/{c}".encode()
                    seeds[key] = int.from_bytes(hashlib.sha256(text).digest()[:8], "little")
    out = []
    for step in range(steps):
        k = max(j for j, s in enumerate(specs) if s["start"] <= step)
        spec, phase = specs[k], build(specs[k])
        local = step - spec["start"]
        schedule = phase.config.schedule
        first = schedule.samples_before(local)
        names = [spec["source"]] if isinstance(spec["source"], str) else list(spec["source"])
        rows = []
        for g in range(first, first + schedule.size(local)):
            c = 0
            if isinstance(phase.source, Mixture):
                c = int(Steering(phase.source, schedule).route(np.array([g]))[0][0])
            ft, seqs = data[names[c]]
            L, packing = spec["seq_len"], spec["packing"]
            key = (names[c], L, packing, spec["seed"], spec["shuffle"])
            bins = BinRecords(ft, L) if packing == "bins" else None
            n = sum(map(len, seqs)) // L if packing is True else len(bins or seqs)
            epoch, pos = divmod(drawn.get(key, 0), n)
            drawn[key] = drawn.get(key, 0) + 1
            record = pos
            if spec["shuffle"]:
                record = int(permute([pos], n, seed=seeds[key], epoch=epoch)[0])
            if bins is not None:
                members = bins.sequences(np.array([record]))[1].tolist()
                rows.append(bin_row(seqs, members, L))
            elif packing:
                rows.append(packed_row(seqs, record, L))
            else:
                rows.append(padded_row(seqs, record, L))
        out.append({f: np.array([r[f] for r in rows]) for f in rows[0]})
    return out


def check_steps(run: PhasedLoader, expected: list[dict[str, np.ndarray]], steps: range) -> None:
    for step in steps:
        got = run.host_batch(step)
        for field, want in expected[step].items():
            np.testing.assert_array_equal(got[field], want, err_msg=f"step {step} {field}")


phase_specs = st.fixed_dictionaries(
    {
        "length": st.integers(1, 4),
        "source": st.sampled_from(
            ["a", "b", {"a": 1, "b": 1}, {"b": 3, "a": 1}, {"a": 1, "b": 0}, {"b": 2}]
        ),
        "seq_len": st.sampled_from([3, 5]),
        "packing": st.sampled_from([True, False, "bins"]),
        "batch_size": st.sampled_from([1, 3, 4, [[0, 2], [2, 5]]]),
        "seed": st.sampled_from([0, 1]),
        "shuffle": st.booleans(),
        "mix_seed": st.sampled_from([0, 4]),
        "period": st.sampled_from([None, 3]),
        "weights_from": st.sampled_from([(), ((1, [1, 3]),)]),
    }
)


def run_specs(draw_specs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Starts from lengths; weight schedules only where the mixture has two components."""
    start, out = 0, []
    for spec in draw_specs:
        spec = {**spec, "start": start}
        if isinstance(spec["source"], str) or len(spec["source"]) != 2:
            spec["weights_from"] = ()
        start += spec["length"]
        out.append(spec)
    return out


@settings(max_examples=25)
@given(st.lists(phase_specs, min_size=1, max_size=4), st.data())
def test_every_step_matches_the_streams_reference(
    drawn_specs: list[dict[str, Any]], data: st.DataObject
) -> None:
    specs = run_specs(drawn_specs)
    steps = specs[-1]["start"] + 3
    expected = reference(specs, steps)
    run = PhasedLoader([build(s) for s in specs])
    check_steps(run, expected, range(steps))
    start = data.draw(st.integers(0, steps - 1))
    for (step, batch), want in zip(run.iterate(start), expected[start:], strict=False):
        np.testing.assert_array_equal(np.asarray(batch["targets"]), want["targets"])
        assert run.phase_at(step) == max(j for j, s in enumerate(specs) if s["start"] <= step)


@settings(max_examples=20)
@given(
    st.lists(phase_specs, min_size=1, max_size=3),
    st.lists(phase_specs, min_size=1, max_size=2),
    st.data(),
)
def test_restore_at_any_step_then_append_or_change_later_phases(
    first: list[dict[str, Any]], later: list[dict[str, Any]], data: st.DataObject
) -> None:
    specs = run_specs(first)
    saved_at = data.draw(st.integers(1, specs[-1]["start"] + 2))
    run = PhasedLoader([build(s) for s in specs])
    run.next_step = saved_at
    state = json.loads(json.dumps(run.state()))
    # The phases begun before the saved step stay; new ones follow from it on.
    kept = [s for s in specs if s["start"] < saved_at]
    fresh = [{**s, "start": s["start"] + saved_at} for s in run_specs(later)]
    resumed_specs = [*kept, *fresh]
    resumed = PhasedLoader([build(s) for s in resumed_specs])
    assert resumed.restore(state) == saved_at
    steps = resumed_specs[-1]["start"] + 2
    expected = reference(resumed_specs, steps)
    check_steps(resumed, expected, range(steps))
    assert all(
        np.array_equal(a["targets"], b["targets"])
        for a, b in zip(expected, reference(specs, saved_at), strict=False)
    ), "the resumed run repeats every batch seen before the saved step"


SPEC = {
    "source": {"a": 1, "b": 1},
    "seq_len": 3,
    "packing": True,
    "batch_size": 4,
    "seed": 0,
    "shuffle": True,
}


def test_one_phase_is_todays_loader() -> None:
    phase = build({**SPEC, "start": 0})
    loader = ftj.Loader(phase.source, phase.config)
    run = PhasedLoader([phase])
    for step in (0, 5, 1000):
        for field, want in loader.host_batch(step).items():
            np.testing.assert_array_equal(run.host_batch(step)[field], want)
    loader.next_step = run.next_step = 17
    assert run.state() == loader.state()
    assert run.provenance(3) == loader.provenance(3)


def test_an_old_loader_state_restores_into_appended_phases() -> None:
    phase = build({**SPEC, "start": 0})
    loader = ftj.Loader(phase.source, phase.config)
    loader.next_step = 6
    state = json.loads(json.dumps(loader.state()))
    longer = build({**SPEC, "start": 6, "seq_len": 5, "source": "b"})
    run = PhasedLoader([phase, longer])
    assert run.restore(state) == 6
    for step in range(6):
        np.testing.assert_array_equal(
            run.host_batch(step)["targets"], loader.host_batch(step)["targets"]
        )
    assert run.host_batch(6)["targets"].shape == (4, 5)
    assert PhasedLoader([phase]).restore(state) == 6


def test_a_change_to_a_seen_batch_is_refused_naming_phase_step_and_field() -> None:
    specs = [{**SPEC, "start": 0}, {**SPEC, "start": 4, "seq_len": 5}]
    run = PhasedLoader([build(s) for s in specs])
    run.next_step = 7
    state = run.state()
    changed = PhasedLoader([build(specs[0]), build({**specs[1], "seq_len": 3})])
    with pytest.raises(ftj.StateMismatch) as e:
        changed.restore(state)
    assert "phase 1 (from step 4), steps 4..6 seen before the saved step 7" in str(e.value)
    assert "fingerprint.config.seq_len: saved 5, now 3" in str(e.value)
    moved = PhasedLoader([build(specs[0]), build({**specs[1], "start": 5})])
    assert "start at steps [0, 4], these at [0, 5]" in "\n".join(moved.state_differences(state))
    # A later start at or after the saved step is a change from the saved step on.
    assert (
        PhasedLoader([build(specs[0]), build(specs[1]), build({**SPEC, "start": 7})]).restore(state)
        == 7
    )


def test_a_stream_that_returns_continues_its_epoch() -> None:
    specs = [
        {**SPEC, "source": "a", "start": 0, "shuffle": True},
        {**SPEC, "source": "b", "start": 1},
        {**SPEC, "source": "a", "start": 2},
    ]
    run = PhasedLoader([build(s) for s in specs])
    n = len(run.engines[0].components[0])
    first = run.provenance(0) + run.provenance(2)
    records = [r["record"] for r in first]
    assert n >= 8 and len(set(records)) == 8, "no record repeats within the stream's epoch"
    assert [r["epoch"] for r in first] == [0] * 8
    assert run.offsets[2] == [4]


def test_phases_out_of_order_or_bounded_are_refused() -> None:
    a = build({**SPEC, "start": 0})
    with pytest.raises(ValueError, match="first phase must start at 0"):
        PhasedLoader([build({**SPEC, "start": 2})])
    with pytest.raises(ValueError, match=r"phases\[1\] starts at step 0"):
        PhasedLoader([a, a])
    bounded = Phase(3, a.source, ftj.LoaderConfig(batch_size=2, seq_len=3, num_epochs=1))
    with pytest.raises(ValueError, match=r"phases\[1\].config.num_epochs is 1"):
        PhasedLoader([a, bounded])


def test_a_sampler_offset_continues_the_stream() -> None:
    g = np.arange(40)
    whole = ftj.IndexSampler(7, seed=3)
    later = ftj.IndexSampler(7, seed=3, offset=12)
    np.testing.assert_array_equal(later.records(g), whole.records(g + 12))
    np.testing.assert_array_equal(later.epochs(g), whole.epochs(g + 12))
    with pytest.raises(ValueError, match="offset 2 needs an endless stream"):
        ftj.IndexSampler(7, offset=2, num_epochs=1)


def test_one_stream_twice_in_a_phase_is_refused_and_a_bad_phase_is_named() -> None:
    a = splits()["a"][0]
    twice = Mixture({"x": (a, 1), "y": (a, 1)})
    cfg = ftj.LoaderConfig(batch_size=2, seq_len=3)
    assert PhasedLoader([Phase(0, twice, cfg)]).host_batch(0)["targets"].shape == (2, 3)
    with pytest.raises(
        ValueError, match=r"phase 1 'again' \(from step 2\): components \['x', 'y'\]"
    ):
        PhasedLoader([Phase(0, a, cfg), Phase(2, twice, cfg, "again")])
    with pytest.raises(ValueError, match=r"phase 1 \(from step 2\): .* has no records"):
        PhasedLoader([Phase(0, a, cfg), Phase(2, a, ftj.LoaderConfig(2, 10**6))])


@pytest.mark.parametrize(
    "change",
    [
        {"source": {"a": 0.2, "b": 0.8}},
        {"source": {"a": 0.5, "b": 0.5, "c": 1}},
        {"seq_len": 6},
    ],
    ids=["new weights", "added component", "longer rows"],
)
def test_the_issues_changes_decided_at_a_saved_step(change: dict[str, Any]) -> None:
    """A run of a 0.5/0.5 mixture saved at step 10 by a Loader goes on with a change."""
    data = {**splits(), "c": splits()["a"]}
    ab = Mixture({"a": (data["a"][0], 0.5), "b": (data["b"][0], 0.5)})
    cfg = ftj.LoaderConfig(batch_size=4, seq_len=3, prefetch=0)
    loader = ftj.Loader(ab, cfg)
    loader.next_step = 10
    state = json.loads(json.dumps(loader.state()))
    weights = change.get("source", {"a": 0.5, "b": 0.5})
    if "c" in weights:  # another split: the books of the issue
        c = memory_url("phases-c")
        ftj.write_dataset(c, {"train": [[901 + i] * 5 for i in range(9)]})
        data["c"] = (ftj.open_dataset(c)["train"], [])
    later = Mixture({n: (data[n][0], w) for n, w in weights.items()})
    run = PhasedLoader(
        [Phase(0, ab, cfg), Phase(10, later, ftj.LoaderConfig(4, change.get("seq_len", 3)))]
    )
    assert run.restore(state) == 10
    seen = [(r["component_name"], r["record"]) for s in range(10) for r in run.provenance(s)]
    assert seen == [
        (r["component_name"], r["record"]) for s in range(10) for r in loader.provenance(s)
    ]
    if "seq_len" in change:
        assert run.offsets[1] == [0, 0], "rows of another length are new streams"
        return
    a_records = len(loader.components[0])
    a_seen = [r for s in range(20) for r in run.provenance(s) if r["component_name"] == "a"]
    first_epoch = [r["record"] for r in a_seen if r["epoch"] == 0]
    assert len(a_seen) > a_records and len(first_epoch) == a_records
    assert sorted(first_epoch) == list(range(a_records)), "stream a: each record once per epoch"


def test_iterate_reads_ahead_across_a_boundary_with_the_runs_one_read_ahead() -> None:
    specs = [{**SPEC, "start": 0}, {**SPEC, "start": 12, "seq_len": 5, "source": "b"}]
    plain = PhasedLoader([build(s) for s in specs])
    phases = [build(s) for s in specs]
    run = PhasedLoader(
        [dataclasses.replace(p, config=dataclasses.replace(p.config, prefetch=4)) for p in phases]
    )
    steps = []
    for step, batch in run.iterate(0):
        if step == 10:  # the second phase's first steps are under way already
            assert max(run.prefetcher.steps()) >= 12
        np.testing.assert_array_equal(
            np.asarray(batch["targets"]), plain.host_batch(step)["targets"]
        )
        assert run.stats()["phase"] == int(step >= 12)
        steps.append(step)
        if step == 15:
            break
    assert steps == list(range(16))


def test_a_loaders_iterate_stops_before_its_stop_step() -> None:
    phase = build({**SPEC, "start": 0})
    loader = ftj.Loader(phase.source, dataclasses.replace(phase.config, prefetch=3))
    got = []
    for step, _ in loader.iterate(2, 6):
        assert loader.stats()["depth"] <= 5 - step
        got.append(step)
    assert got == [2, 3, 4, 5]


@pytest.mark.parametrize(("start", "stop"), [(0, 5), (3, 14), (2, 12), (9, 17), (13, 15), (6, 6)])
def test_a_phased_iterate_stops_before_its_stop_step_as_a_loaders_does(
    start: int, stop: int
) -> None:
    """Issue 46: ``PhasedLoader.iterate`` took no ``stop_step``. It yields
    ``[start, stop)``, and nothing is read at or past ``stop``, in either phase."""
    specs = [{**SPEC, "start": 0}, {**SPEC, "start": 12, "seq_len": 5, "source": "b"}]
    plain = PhasedLoader([build(s) for s in specs])
    three = [dataclasses.replace(p.config, prefetch=3) for p in map(build, specs)]
    run = PhasedLoader(
        [dataclasses.replace(build(s), config=c) for s, c in zip(specs, three, strict=True)]
    )
    got = []
    for step, batch in run.iterate(start, stop):
        assert all(step < s < stop for s in run.prefetcher.steps()), step
        want = plain.host_batch(step)["targets"]
        np.testing.assert_array_equal(np.asarray(batch["targets"]), want, f"step {step}")
        got.append(step)
    assert got == list(range(start, stop))
    one = PhasedLoader([build({**SPEC, "start": 0})])
    loader = ftj.Loader(one.phases[0].source, one.phases[0].config)
    assert [s for s, _ in one.iterate(start, stop)] == [s for s, _ in loader.iterate(start, stop)]


@pytest.mark.parametrize("stop", [-1, 2.5, "3"])
def test_a_bad_stop_step_of_a_phased_iterate_is_refused_as_a_loaders_is(stop: Any) -> None:
    phase = build({**SPEC, "start": 0})
    with pytest.raises(ValueError) as want:
        next(ftj.Loader(phase.source, phase.config).iterate(0, stop))
    with pytest.raises(ValueError) as got:
        next(PhasedLoader([phase, build({**SPEC, "start": 5})]).iterate(0, stop))
    assert str(got.value) == str(want.value)
    assert str(got.value).startswith(f"stop_step must be an int >= 0, got {stop!r}")


def test_a_phase_that_cannot_read_its_first_step_is_refused_naming_the_latest_start() -> None:
    """Issue 35: Phase(2**60 - 1, ...) ran into ``global sample index must be in
    [0, 7]`` at its first batch, naming no phase and no fix."""
    a = splits()["a"][0]
    eight, sixteen = ftj.LoaderConfig(8, 3, prefetch=0), ftj.LoaderConfig(16, 3, prefetch=0)
    # Brute force: the stream has drawn 8 * start samples when the phase starts,
    # and its first step draws 16 more: 8 * start + 15 <= 2**63 - 1.
    latest = max(s for s in range(2**60 - 8, 2**60) if 8 * s + 15 <= 2**63 - 1)
    with pytest.raises(ValueError) as e:
        PhasedLoader([Phase(0, a, eight), Phase(latest + 1, a, sixteen, "late")])
    message = str(e.value)
    assert message.startswith(f"phase 1 'late' (from step {latest + 1}) cannot read its first")
    assert f"start it at step {latest} at most" in message
    assert f"{8 * (latest + 1):,} samples drawn in earlier phases" in message
    run = PhasedLoader([Phase(0, a, eight), Phase(latest, a, sixteen, "late")])
    assert run.host_batch(latest)["targets"].shape == (16, 3)
    assert run.end_step == latest + 1, "its stream has no samples left for a second step"


def test_a_phase_whose_stream_runs_out_before_the_next_phase_is_refused() -> None:
    a, b = splits()["a"][0], splits()["b"][0]
    cfg = ftj.LoaderConfig(8, 3, prefetch=0)
    # 8 samples a step: sample index 2**63 - 1 is in step 2**60 - 1, the last one.
    with pytest.raises(ValueError) as e:
        PhasedLoader([Phase(0, a, cfg), Phase(2**60 + 5, b, cfg)])
    assert str(e.value).startswith(
        f"phase 0 (from step 0) cannot read its steps from step {2**60} on"
    )
    assert f"phases[1] starts at step {2**60 + 5}: start it at step {2**60} at most" in str(e.value)
    assert PhasedLoader([Phase(0, a, cfg), Phase(2**60, b, cfg)]).end_step == 2**60 + 2**60


def test_a_step_past_the_runs_reach_names_the_runs_step_and_its_phase(tmp_path: Path) -> None:
    """Issue 35: ``show --config run.yaml --step 4611686018427387904`` said
    ``step 4611686018427387874 is too large``, a step inside the phase."""
    a, b = splits()["a"][0], splits()["b"][0]
    phases = [Phase(0, a, ftj.LoaderConfig(8, 3)), Phase(30, b, ftj.LoaderConfig(4, 3), "anneal")]
    run = PhasedLoader(phases)
    # Phase 1 reads a new stream: its samples 4 * n .. 4 * n + 3 fit while 4 * n + 3 < 2**63.
    assert run.end_step == 30 + 2**61
    assert run.host_batch(30 + 2**61 - 1)["targets"].shape == (4, 3)
    step = 4611686018427387904
    for call in (run.host_batch, run.batch, run.provenance, run.start, run.encoded_batch):
        with pytest.raises(ValueError) as e:
            call(step)
        message = str(e.value)
        assert message.startswith(
            f"step {step} is past the last step this run can read, {30 + 2**61 - 1}"
        )
        assert "phase 1 'anneal' (from step 30)" in message
        assert str(step - 30) not in message
    with pytest.raises(ValueError, match=f"step {30 + 2**61} is past the last step"):
        next(run.iterate(30 + 2**61))
    (tmp_path / "run.yaml").write_text(
        "phases:\n"
        f"  - {{start_step: 0, data: {{datasets: {{'{a.url}': 1}}}}, "
        "loader: {batch_size: 8, seq_len: 3}}\n"
        f"  - {{name: anneal, start_step: 30, data: {{datasets: {{'{b.url}': 1}}}}, "
        "loader: {batch_size: 4}}\n"
    )
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["show", "--config", str(tmp_path / "run.yaml"), "--step", str(step)])
    assert code == 1
    assert err.getvalue().startswith(f"show: step {step} is past the last step")
    assert "phase 1 'anneal' (from step 30)" in err.getvalue()
    assert str(step - 30) not in err.getvalue()


def test_an_error_inside_a_phase_names_the_runs_step_and_the_phase() -> None:
    url = memory_url("phases-threes")
    ftj.write_dataset(url, {"train": [[i + 1] * 3 for i in range(50)]})
    threes = ftj.open_dataset(url)["train"]
    # Rows of 12 tokens hold 4 sequences of 3: more runs than max_segments=2.
    segs = ftj.LoaderConfig(2, 12, prefetch=0, max_segments=2)
    run = PhasedLoader(
        [Phase(0, threes, ftj.LoaderConfig(2, 4, prefetch=0)), Phase(10, threes, segs, "segs")]
    )
    for call in (run.host_batch, run.batch):
        with pytest.raises(ValueError) as e:
            call(13)
        assert str(e.value).startswith("step 13 (in phase 1 'segs' (from step 10), its step 3): ")
        assert "max_segments is 2" in str(e.value)
    taken = []
    with pytest.raises(ValueError, match=r"^step 10 \(in phase 1 'segs' \(from step 10\), its"):
        for step, _ in run.iterate(8):
            taken.append(step)
    assert taken == [8, 9]


@functools.cache
def known_split() -> ftj.FlatTokens:
    url = memory_url("phases-known")
    ftj.write_dataset(url, {"train": [[5, 6, 7], [8, 9], [10, 11, 12, 13]]})
    return ftj.open_dataset(url)["train"]


def known(packing: bool | str) -> tuple[dict[str, Any], ftj.LoaderConfig]:
    """A component's fingerprint of the known split, and its config."""
    cfg = ftj.LoaderConfig(batch_size=2, seq_len=3, packing=packing, seed=7, shuffle=False)
    return ftj.Loader(known_split(), cfg).fingerprint()["data"], cfg


def test_the_key_of_a_known_stream_is_frozen() -> None:
    assert stream_key(*known("bins")) == (
        '[{"content": "9d8cb93bfd7d12cc621069f599738875", "loss_mask": false, '
        '"max_token_id": 13, "num_sequences": 3, "num_tokens": 9, "plan": '
        '{"algorithm": "best-fit-decreasing/blocks-of-262144", "digest": "3c6738af4aac56f3"}, '
        '"records": "bins", "sample_digest": "3f50ee11472614f4", "seq_len": 3, '
        '"tokenizer": null}, 7, false]'
    )


@pytest.mark.parametrize("packing", [True, False, "bins"])
def test_a_key_is_todays_fingerprint_but_the_name_with_seed_and_shuffle(
    packing: bool | str,
) -> None:
    """Every stream of a run made so far keeps its key: the whole fingerprint but
    the component's name, as the key was before its fields were named."""
    a, b = known_split(), splits()["b"][0]
    cfg = ftj.LoaderConfig(batch_size=2, seq_len=3, packing=packing, seed=3)
    mixed = ftj.Loader(Mixture({"a": (a, 1), "b": (b, 2)}), cfg).fingerprint()["data"]
    parts = [*mixed["components"], known(packing)[0]]
    assert {"name"} < set(parts[0])
    for data in parts:
        whole = {k: v for k, v in data.items() if k != "name"}
        assert stream_key(data, cfg) == json.dumps([whole, 3, True], sort_keys=True)


@pytest.mark.parametrize("packing", [True, False, "bins"])
def test_a_fingerprint_field_outside_the_streams_fields_leaves_its_key(
    packing: bool | str,
) -> None:
    data, cfg = known(packing)
    key = stream_key(data, cfg)
    assert stream_key({**data, "name": "web", "added_later": [1, 2]}, cfg) == key


@pytest.mark.parametrize("field", [*STREAM_FIELDS, "seed", "shuffle"])
def test_changing_any_field_of_a_stream_changes_its_key(field: str) -> None:
    data, cfg = known("bins")
    other = {"seed": {"seed": cfg.seed + 1}, "shuffle": {"shuffle": not cfg.shuffle}}
    if field in other:
        changed, changed_cfg = data, dataclasses.replace(cfg, **other[field])
    else:
        assert field in data, "the known bins' fingerprint holds every stream field"
        changed, changed_cfg = {**data, field: {"changed": field}}, cfg
    assert stream_key(changed, changed_cfg) != stream_key(data, cfg)


def test_records_of_ones_own_are_known_by_their_whole_fingerprint_but_the_name() -> None:
    cfg = ftj.LoaderConfig(batch_size=2, seq_len=3)
    mine = {"name": "x", "num_tokens": 9, "source": "mine-v1"}
    key = stream_key(mine, cfg)
    assert stream_key({**mine, "name": "y"}, cfg) == key
    assert stream_key({**mine, "source": "mine-v2"}, cfg) != key
