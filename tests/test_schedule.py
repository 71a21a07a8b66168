"""Batch-size schedules: arithmetic against step-by-step walks, loaders against brute force.

The references here walk the run step by step (a Python loop over steps and
rows), which is what the schedule's arithmetic must equal.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from memurls import memory_url
from reference import padding_row, reference_batch

import flat_tokens_jax as ftj
from flat_tokens_jax import BatchSchedule, LoaderConfig, StateMismatch

RNG = np.random.default_rng(17)
SEQS = [RNG.integers(1, 90, int(k)).tolist() for k in RNG.integers(1, 12, 40)]
URL = memory_url("schedule")
ftj.write_dataset(
    URL, {"train": SEQS}, storage_format=ftj.StorageFormat(shard_tokens=128, chunk_tokens=16)
)
SPLIT = ftj.open_dataset(URL)["train"]
PARTS = SPLIT.split([1, 1, 1])  # three components of one mixture


def walk_sizes(entries: list[tuple[int, int]], steps: int) -> list[int]:
    """The size of each of ``steps`` steps, by looking up every step in the entries."""
    sizes = []
    for step in range(steps):
        size = None
        for start, n in entries:
            if start <= step:
                size = n
        assert size is not None
        sizes.append(size)
    return sizes


def schedules(max_entries: int = 4, max_size: int = 5) -> st.SearchStrategy[list[tuple[int, int]]]:
    """``[(0, size), (step, size), ...]``: steps strictly increasing, sizes >= 1."""
    gaps = st.lists(st.integers(1, 6), min_size=0, max_size=max_entries - 1)
    return gaps.flatmap(
        lambda g: st.lists(st.integers(1, max_size), min_size=len(g) + 1, max_size=len(g) + 1).map(
            lambda sizes: list(zip([0, *itertools.accumulate(g)], sizes, strict=True))
        )
    )


def changed_from(
    entries: list[tuple[int, int]], step: int, tail: list[tuple[int, int]]
) -> list[tuple[int, int]]:
    """``entries`` before ``step``, then ``tail`` (its steps shifted to start at ``step``)."""
    return [(s, n) for s, n in entries if s < step] + [(step + s, n) for s, n in tail]


# ---------------------------------------------------------------- arithmetic


@settings(max_examples=200)
@given(entries=schedules(6, 9), step=st.integers(0, 60))
def test_samples_before_equals_a_walk_over_steps(entries: list[tuple[int, int]], step: int) -> None:
    sched = BatchSchedule.of(entries)
    sizes = walk_sizes(entries, step + 1)
    assert sched.samples_before(step) == sum(sizes[:step])
    assert sched.size(step) == sizes[step]
    first = sum(sizes[:step])
    for g in range(first, first + sizes[step]):
        assert sched.step_of(g) == step
    total = first + 1
    assert sched.steps_to_cover(total) == step + 1


def test_the_arithmetic_needs_no_loop_over_steps() -> None:
    entries = [(i * 10**10, i % 7 + 1) for i in range(100)]
    sched = BatchSchedule.of(entries)
    # Sum over whole segments, then the part of the segment that holds the step.
    step = 10**12 + 3
    whole = sum((b - a) * n for (a, n), (b, _) in itertools.pairwise(entries))
    assert step > entries[-1][0]
    expected = whole + (step - entries[-1][0]) * entries[-1][1]
    assert sched.samples_before(step) == expected
    assert sched.step_of(expected) == step


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ([(0, 4), (5, 8), (5, 16)], r"entry 2 \(5, 16\) starts at step 5, not after .* step 5"),
        ([(0, 4), (9, 8), (3, 16)], r"entry 2 \(3, 16\) starts at step 3"),
        (
            [(1, 4), (5, 8)],
            r"entry 0 \(1, 4\) starts at step 1: the first entry must start at step 0",
        ),
        ([(0, 4), (5, 0)], r"entry 1 \(5, 0\): the size must be an int >= 1, got 0"),
        ([(0, -2)], r"entry 0 \(0, -2\): the size must be an int >= 1, got -2"),
        ([(0, 4), (5,)], r"entry 1 must be a pair \[start_step, size\], got \(5,\)"),
        ([(0, 4), (5, 2.5)], r"entry 1 \(5, 2.5\): the size must be an int"),
        ([], r"at least one"),
        ("256", r"an int or a schedule"),
        (0, r"batch_size must be an int >= 1, got 0"),
    ],
)
def test_bad_schedules_name_the_entry(value: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LoaderConfig(batch_size=value, seq_len=4)


def test_schedule_forms_and_yaml(tmp_path: Path) -> None:
    want = LoaderConfig(batch_size=[(0, 2), (3, 4)], seq_len=4)
    assert want.batch_size == ((0, 2), (3, 4))
    assert LoaderConfig(batch_size={0: 2, 3: 4}, seq_len=4) == want
    assert LoaderConfig(batch_size=[[0, 2], [3, 4], [5, 4]], seq_len=4) == want  # merged
    assert LoaderConfig(batch_size=[(0, 6)], seq_len=4).batch_size == 6  # one size: the int
    for text in ("[[0, 2], [3, 4]]", "{0: 2, 3: 4}", "\n    - [0, 2]\n    - [3, 4]"):
        (tmp_path / "c.yaml").write_text(f"loader:\n  seq_len: 4\n  batch_size: {text}\n")
        assert LoaderConfig.from_yaml(tmp_path / "c.yaml") == want, text
    assert want.batch_defining()["batch_size"] == [[0, 2], [3, 4]]
    assert [want.batch_size_at(s) for s in range(5)] == [2, 2, 2, 4, 4]
    numpy_ints = [(np.int64(0), np.int32(2)), (np.uint8(3), np.int64(4))]
    assert LoaderConfig(batch_size=numpy_ints, seq_len=4) == want
    assert BatchSchedule(((0, 2), (3, 4), (5, 4))) == BatchSchedule.of([(0, 2), (3, 4)])
    with pytest.raises(ValueError, match="step must be an int >= 0, got -1"):
        want.schedule.samples_before(-1)


# ---------------------------------------------------------------- loader vs brute force


def brute_force_run(
    sizes: list[int], total: int | None, cfg: dict[str, Any]
) -> tuple[list[dict[str, Any]], list[list[int]]]:
    """Each step's rows, walking the sample order step by step and row by row;
    and each step's global samples (``-1`` for padding)."""
    batches, samples, g = [], [], 0
    for size in sizes:
        rows, step_samples = [], []
        for _ in range(size):
            if total is not None and g >= total:
                rows.append(padding_row(cfg["seq_len"], cfg["pad_id"]))
                step_samples.append(-1)
            else:
                one = reference_batch(SEQS, g, 1, **cfg)
                rows.append({k: v[0].tolist() for k, v in one.items()})
                step_samples.append(g)
            g += 1
        batches.append({k: [r[k] for r in rows] for k in rows[0]})
        samples.append(step_samples)
    return batches, samples


def as_lists(batch: dict[str, Any]) -> dict[str, Any]:
    return {k: np.asarray(v).astype(int).tolist() for k, v in batch.items()}


def samples_of(loader: ftj.Loader, step: int) -> list[int]:
    return [row.get("sample", -1) for row in loader.provenance(step)]


@settings(max_examples=40)
@given(
    first=schedules(),
    tail=schedules(),
    saved_at=st.integers(0, 12),
    packing=st.booleans(),
    shuffle=st.booleans(),
    seed=st.integers(0, 2**32),
    num_epochs=st.none() | st.integers(1, 2),
)
def test_restart_with_changed_sizes_equals_the_step_by_step_reference(
    first: list[tuple[int, int]],
    tail: list[tuple[int, int]],
    saved_at: int,
    packing: bool,
    shuffle: bool,
    seed: int,
    num_epochs: int | None,
) -> None:
    seq_len = 5 if packing else 6
    cfg = {"seq_len": seq_len, "packing": packing, "shuffle": shuffle, "seed": seed}
    cfg |= {"num_epochs": num_epochs, "start_token_id": 0, "pad_id": 0}
    before = ftj.Loader(SPLIT, LoaderConfig(batch_size=first, prefetch=0, **cfg))
    before.next_step = saved_at
    state = json.loads(json.dumps(before.state()))
    second = changed_from(first, saved_at, tail)
    after = ftj.Loader(SPLIT, LoaderConfig(batch_size=second, prefetch=0, **cfg))
    assert after.restore(state) == saved_at
    assert state["samples"] == sum(walk_sizes(first, saved_at))

    records = len(after.components[0])
    total = None if num_epochs is None else records * num_epochs
    steps = after.num_batches if total is not None else saved_at + 8
    assert steps is not None
    sizes = walk_sizes(second, steps)
    if total is not None:  # the run ends at the first step that reaches the last sample
        assert sum(sizes[:-1]) < total <= sum(sizes)
    want, want_samples = brute_force_run(sizes, total, cfg)
    seen = []
    for step in range(steps):
        loader = before if step < saved_at else after
        assert as_lists(loader.host_batch(step)) == want[step], step
        assert samples_of(loader, step) == want_samples[step], step
        seen += [g for g in samples_of(loader, step) if g >= 0]
    assert seen == list(range(len(seen))), "no sample skipped or repeated"
    if total is not None:
        assert len(seen) == total
        with pytest.raises(IndexError, match="past the end"):
            after.host_batch(steps)


def mixture(weights: list[list[int]], weight_steps: list[int]) -> ftj.Mixture:
    schedule = list(zip(weight_steps, weights[1:], strict=True))
    parts = [(name, part, w) for name, part, w in zip("abc", PARTS, weights[0], strict=True)]
    return ftj.Mixture(parts, seed=5, period=12, schedule=schedule)


@settings(max_examples=30)
@given(
    first=schedules(),
    tail=schedules(),
    saved_at=st.integers(0, 10),
    weights=st.lists(
        st.lists(st.integers(0, 3), min_size=3, max_size=3).filter(any), min_size=1, max_size=3
    ),
    gaps=st.lists(st.integers(1, 8), min_size=2, max_size=2),
    seed=st.integers(0, 2**32),
)
def test_mixture_weight_boundaries_are_steps_under_any_schedule(
    first: list[tuple[int, int]],
    tail: list[tuple[int, int]],
    saved_at: int,
    weights: list[list[int]],
    gaps: list[int],
    seed: int,
) -> None:
    """A weight change at step s starts at the first row of step s. The reference
    walks the steps to find that row's sample, and reads the same blend with the
    boundaries given in samples (a batch of one sample per step)."""
    weight_steps = list(itertools.accumulate(gaps))[: len(weights) - 1]
    cfg = {"seq_len": 3, "seed": seed, "prefetch": 0}
    before = ftj.Loader(mixture(weights, weight_steps), LoaderConfig(batch_size=first, **cfg))
    before.next_step = saved_at
    second = changed_from(first, saved_at, tail)
    after = ftj.Loader(mixture(weights, weight_steps), LoaderConfig(batch_size=second, **cfg))
    assert after.restore(before.state()) == saved_at

    steps = max([saved_at, *weight_steps]) + 4
    sizes = walk_sizes(second, steps)
    at_sample = [sum(sizes[:s]) for s in weight_steps]
    one = ftj.Loader(mixture(weights, at_sample), LoaderConfig(batch_size=1, **cfg))
    g, seen = 0, []
    for step, size in enumerate(sizes):
        loader = before if step < saved_at else after
        rows = [as_lists(one.host_batch(g + r)) for r in range(size)]
        want = {k: [row[k][0] for row in rows] for k in rows[0]}
        assert as_lists(loader.host_batch(step)) == want, step
        prov = loader.provenance(step)
        want_prov = [one.provenance(g + r)[0] for r in range(size)]
        assert [p["component"] for p in prov] == [p["component"] for p in want_prov]
        seen += [p["sample"] for p in prov]
        g += size
    assert seen == list(range(g)), "no sample skipped or repeated"


def test_a_weight_change_at_a_step_starts_at_that_steps_first_row() -> None:
    mix = ftj.Mixture([("a", PARTS[0], 1), ("b", PARTS[1], 0)], schedule=[(3, [0, 1])])
    loader = ftj.Loader(mix, LoaderConfig(batch_size=[(0, 2), (2, 5)], seq_len=2))
    # Step 3 starts at sample 2 + 2 + 5 = 9, not at 3 * size.
    assert loader.samples_before(3) == 9
    assert {r["component_name"] for r in loader.provenance(2)} == {"a"}
    assert {r["component_name"] for r in loader.provenance(3)} == {"b"}
    constant = ftj.Loader(mix, LoaderConfig(batch_size=5, seq_len=2))
    assert {r["component_name"] for r in constant.provenance(3)} == {"b"}
    assert constant.provenance(3)[0]["sample"] == 15


def test_a_step_far_out_costs_the_same_and_lands_where_the_sum_says() -> None:
    entries = [(i * 10**10, (i % 4 + 1) * 8) for i in range(100)]
    loader = ftj.Loader(SPLIT, LoaderConfig(batch_size=entries, seq_len=4, prefetch=0))
    step = 10**12
    expected = sum((b - a) * n for (a, n), (b, _) in itertools.pairwise(entries))
    expected += (step - entries[-1][0]) * entries[-1][1]
    prov = loader.provenance(step)
    assert [r["sample"] for r in prov] == list(range(expected, expected + entries[-1][1]))
    assert loader.host_batch(step)["targets"].shape == (entries[-1][1], 4)


def test_a_step_past_the_int64_samples_names_the_last_step() -> None:
    loader = ftj.Loader(SPLIT, LoaderConfig(batch_size=[(0, 1), (10, 4)], seq_len=1))
    last = 10 + (2**63 - 10) // 4 - 1
    assert loader.provenance(last)[-1]["sample"] <= 2**63 - 1
    with pytest.raises(ValueError, match=rf"the last step is {last}$"):
        loader.host_batch(last + 1)


# ---------------------------------------------------------------- restore


def test_restore_refuses_other_sizes_before_the_saved_step_and_names_the_fix() -> None:
    saved = ftj.Loader(SPLIT, LoaderConfig(batch_size=[(0, 2), (4, 4)], seq_len=4))
    saved.next_step = 6
    state = saved.state()
    assert state["samples"] == 4 * 2 + 2 * 4
    later = LoaderConfig(batch_size=[(0, 2), (4, 4), (6, 8)], seq_len=4)
    assert ftj.Loader(SPLIT, later).restore(state) == 6
    for bad, step in (([(0, 2), (5, 4), (6, 8)], 4), (8, 0), ([(0, 2), (4, 4), (5, 8)], 5)):
        loader = ftj.Loader(SPLIT, LoaderConfig(batch_size=bad, seq_len=4))
        with pytest.raises(StateMismatch, match=rf"batch_size: saved .* step {step} had") as e:
            loader.restore(state)
        assert "may change only from the saved step 6 on: batch_size [[0, 2], [4, 4], [6, " in str(
            e.value
        )
    other = ftj.Loader(SPLIT, LoaderConfig(batch_size=8, seq_len=4, seed=1))
    with pytest.raises(StateMismatch) as e:
        other.restore(state)
    assert "config.seed: saved 0, now 1" in str(e.value)
    assert "batch_size: saved [[0, 2], [4, 4]], now 8" in str(e.value)
    with pytest.raises(StateMismatch, match=r"samples: saved 3, but the 6 steps .* hold 16"):
        ftj.Loader(SPLIT, later).restore({**state, "samples": 3})


def test_a_state_of_one_batch_size_restores_with_a_later_change() -> None:
    loader = ftj.Loader(SPLIT, LoaderConfig(batch_size=4, seq_len=4, start_token_id=0))
    old = loader.state(5)
    grown = ftj.Loader(SPLIT, LoaderConfig(batch_size=[(0, 4), (5, 8)], seq_len=4))
    assert grown.restore(old) == 5
    assert grown.provenance(5)[0]["sample"] == 20
    assert ftj.Loader(SPLIT, LoaderConfig(batch_size=4, seq_len=4)).restore(old) == 5
    with pytest.raises(StateMismatch, match=r"step 0 had 4 rows, now 8"):
        ftj.Loader(SPLIT, LoaderConfig(batch_size=8, seq_len=4)).restore(old)


def test_fingerprint_separates_the_order_from_the_cut() -> None:
    a = ftj.Loader(SPLIT, LoaderConfig(batch_size=[(0, 2), (4, 4)], seq_len=4))
    b = ftj.Loader(SPLIT, LoaderConfig(batch_size=2, seq_len=4))
    assert a.fingerprint()["config"] == b.fingerprint()["config"]
    assert "batch_size" not in a.fingerprint()["config"]
    assert a.fingerprint()["batch_size"] == [[0, 2], [4, 4]]
    assert b.fingerprint()["batch_size"] == 2


# ---------------------------------------------------------------- sharding


def test_every_size_must_divide_over_the_mesh_named_by_step() -> None:
    mesh = jax.make_mesh((8,), ("data",))
    sharding = NamedSharding(mesh, P("data"))
    ftj.Loader(SPLIT, LoaderConfig(batch_size=[(0, 8), (3, 16)], seq_len=4), sharding=sharding)
    with pytest.raises(ValueError, match=r"entry \(3, 12\): from step 3 global batch 12 does not"):
        ftj.Loader(SPLIT, LoaderConfig(batch_size=[(0, 8), (3, 12)], seq_len=4), sharding=sharding)


@pytest.mark.parametrize(
    ("shape", "axes", "spec"),
    [((8,), ("data",), P("data")), ((4, 2), ("data", "seq"), P("data", "seq"))],
    ids=["rows", "rows_and_sequence"],
)
def test_sharded_batches_follow_the_schedule(
    shape: tuple[int, ...], axes: tuple[str, ...], spec: P
) -> None:
    cfg = LoaderConfig(batch_size=[(0, 8), (2, 16), (3, 8)], seq_len=6, num_epochs=2, prefetch=2)
    single = ftj.Loader(SPLIT, cfg)
    sharding = NamedSharding(jax.make_mesh(shape, axes), spec)
    sharded = ftj.Loader(SPLIT, cfg, sharding=sharding)
    assert sharded.num_batches == single.num_batches
    got = dict(sharded.iterate(0))
    assert sorted(got) == list(range(single.num_batches or 0))
    for step, batch in got.items():
        want = single.host_batch(step)
        assert batch["targets"].shape == (cfg.batch_size_at(step), 6)
        for key in want:
            np.testing.assert_array_equal(np.asarray(batch[key]), want[key], err_msg=key)
