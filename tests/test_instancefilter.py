"""The load-time instance filter: against a brute-force n-gram counter, in
every decode path (host, device, grain), in states, statistics and ``show``."""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
import yaml
from commands import run_main
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from memurls import memory_url

import flat_tokens_jax as ftj
from flat_tokens_jax.decoding.instancefilter import MAX_ROW_TOKENS
from flat_tokens_jax.grain.grain import FlatTokensSource

RULE = ftj.InstanceFilter(max_period=3, max_count=4)


def brute_rejects(targets: list[int], segment_ids: list[int], rule: ftj.InstanceFilter) -> bool:
    """Whether some n-gram of length min_period..max_period occurs max_count
    times back to back in the row's real (non-padding) targets: counted
    copy by copy from every start (an n-gram longer than the row has no copy)."""
    tokens = [t for t, s in zip(targets, segment_ids, strict=True) if s != 0]
    n = len(tokens)
    for p in range(rule.min_period, min(rule.max_period, n) + 1):
        for i in range(n - p + 1):
            gram = tokens[i : i + p]
            copies = 1
            while (
                i + (copies + 1) * p <= n and tokens[i + copies * p : i + (copies + 1) * p] == gram
            ):
                copies += 1
            if copies >= rule.max_count:
                return True
    return False


def brute_rows(batch: dict[str, Any], rule: ftj.InstanceFilter) -> np.ndarray:
    targets, segments = np.asarray(batch["targets"]), np.asarray(batch["segment_ids"])
    return np.array(
        [
            brute_rejects(t.tolist(), s.tolist(), rule)
            for t, s in zip(targets, segments, strict=True)
        ],
        bool,
    )


rules = st.builds(
    lambda lo, extra, count: ftj.InstanceFilter(
        max_period=lo + extra, min_period=lo, max_count=count
    ),
    st.integers(1, 3),
    st.integers(0, 3),
    st.integers(2, 6),
)
# Rows made of short n-grams, each repeated a few times: runs near any threshold.
pieces = st.lists(
    st.tuples(st.lists(st.integers(0, 3), min_size=1, max_size=4), st.integers(1, 7)), max_size=6
)
WIDTH = 40


KERNELS = ["numpy", "numba"]  # the test extra installs numba


@pytest.mark.parametrize("kernel", KERNELS)
@given(rule=rules, rows=st.lists(st.tuples(pieces, st.integers(0, WIDTH)), min_size=1, max_size=6))
def test_rejects_what_a_brute_force_counter_rejects(
    kernel: str, rule: ftj.InstanceFilter, rows: list[tuple[list[tuple[list[int], int]], int]]
) -> None:
    targets = np.full((len(rows), WIDTH), 7, np.int32)  # padding targets repeat: never counted
    segments = np.zeros((len(rows), WIDTH), np.int32)
    for r, (row_pieces, length) in enumerate(rows):
        tokens = [t for gram, times in row_pieces for t in gram * times][:length]
        targets[r, : len(tokens)] = tokens
        segments[r, : len(tokens)] = 1 + np.arange(len(tokens)) // 5  # boundaries don't matter
    want = brute_rows({"targets": targets, "segment_ids": segments}, rule)
    assert rule.rejected(targets, segments, kernel).tolist() == want.tolist()


@pytest.mark.parametrize("kernel", KERNELS)
@settings(max_examples=40)
@given(
    gram=st.lists(st.integers(0, 99), min_size=1, max_size=5, unique=True),
    count=st.integers(2, 8),
    at_least=st.booleans(),
    before=st.integers(0, 6),
    after=st.integers(0, 6),
)
def test_a_run_of_max_count_copies_rejects_and_one_fewer_does_not(
    kernel: str, gram: list[int], count: int, at_least: bool, before: int, after: int
) -> None:
    """``max_count - 1`` or ``max_count`` copies of an n-gram of distinct
    tokens, between tokens that occur nowhere else, at the row's first or
    last column too (``before`` or ``after`` 0)."""
    rule = ftj.InstanceFilter(max_period=len(gram), max_count=count)
    copies = count if at_least else count - 1
    tokens = [*range(1000, 1000 + before), *(gram * copies), *range(2000, 2000 + after)]
    row = {"targets": np.array([tokens]), "segment_ids": np.ones((1, len(tokens)), np.int32)}
    assert brute_rows(row, rule).tolist() == [at_least]
    assert rule.rejected(row["targets"], row["segment_ids"], kernel).tolist() == [at_least]


@pytest.mark.parametrize(
    "rule", [RULE, ftj.InstanceFilter(max_period=5, min_period=2, max_count=3)]
)
def test_the_jax_twin_rejects_what_the_brute_force_counter_rejects(
    rule: ftj.InstanceFilter,
) -> None:
    """Inside ``jax.jit``: random rows of n-gram runs with padding tails, and
    rows at ``max_count - 1`` and ``max_count`` copies at both edges."""
    rng = np.random.default_rng(0)
    rows = []
    for _ in range(200):
        grams = [rng.integers(0, 3, int(rng.integers(1, 5))).tolist() for _ in range(6)]
        tokens = [t for g in grams for t in g * int(rng.integers(1, 7))]
        rows.append(tokens[: int(rng.integers(0, WIDTH + 1))])
    for p in range(rule.min_period, rule.max_period + 1):
        gram = list(range(p))
        for copies in (rule.max_count - 1, rule.max_count):
            rows += [gram * copies, [50, *(gram * copies)], [*(gram * copies), 60]]
    targets = np.full((len(rows), WIDTH), 7, np.int32)
    segments = np.zeros((len(rows), WIDTH), np.int32)
    for r, tokens in enumerate(rows):
        targets[r, : len(tokens)], segments[r, : len(tokens)] = tokens, 1
    want = brute_rows({"targets": targets, "segment_ids": segments}, rule)
    assert 0 < want.sum() < len(rows)
    assert np.asarray(jax.jit(rule.rejected_jax)(targets, segments)).tolist() == want.tolist()
    for kernel in KERNELS:
        assert rule.rejected(targets, segments, kernel).tolist() == want.tolist()


def every_path_against_the_brute_force(
    rule: ftj.InstanceFilter, targets: np.ndarray, segments: np.ndarray
) -> np.ndarray:
    """The brute-force verdicts, after asserting that the jitted filter and
    both host kernels give the same."""
    want = brute_rows({"targets": targets, "segment_ids": segments}, rule)
    got = np.asarray(jax.jit(rule.rejected_jax)(targets, segments))
    assert got.tolist() == want.tolist()
    for kernel in KERNELS:
        assert rule.rejected(targets, segments, kernel).tolist() == want.tolist(), kernel
    return want


def edge_rows(width: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows that sit at the edge of what a row holds: one token ``width``
    times (and once less, the last column padding), a ``width // 2``-gram of
    distinct tokens twice (and broken in its last token), distinct tokens
    only, and short n-grams repeated, each with and without a padding tail."""
    half = list(range(100, 100 + width // 2))
    rows = [
        [5] * width,
        [5] * (width - 1),
        half * 2,
        [*half, *half[:-1], 7],
        list(range(200, 200 + width)),
        [1, 2, 3] * (width // 3),
        ([1, 2] * width)[: width - 3],
    ]
    targets = np.full((len(rows), width), 9, np.int32)
    segments = np.zeros((len(rows), width), np.int32)
    for r, tokens in enumerate(rows):
        targets[r, : len(tokens)], segments[r, : len(tokens)] = tokens, 1
    return targets, segments


@pytest.mark.parametrize(
    "fields",
    [
        {"min_period": 3, "max_period": 13, "max_count": MAX_ROW_TOKENS // 3},
        {"min_period": 3, "max_period": MAX_ROW_TOKENS, "max_count": MAX_ROW_TOKENS // 3},
        {"min_period": 1, "max_period": MAX_ROW_TOKENS, "max_count": 2},
        {"min_period": WIDTH // 2, "max_period": MAX_ROW_TOKENS, "max_count": 2},
        {"min_period": 1, "max_period": MAX_ROW_TOKENS, "max_count": WIDTH},
        {"min_period": 1, "max_period": 3, "max_count": WIDTH // 3},
    ],
)
def test_host_device_and_brute_force_agree_at_the_largest_accepted_values(
    fields: dict[str, int],
) -> None:
    """Issue 35, finding 3: at the largest values a filter accepts, and at
    the largest a row of ``WIDTH`` holds, the compiled kernel, numpy, the
    jitted filter and the brute force give the same rows (the compiled
    kernel once wrapped its counts in int64 and rejected every row)."""
    rule = ftj.InstanceFilter(**fields)
    targets, segments = edge_rows(WIDTH)
    want = every_path_against_the_brute_force(rule, targets, segments)
    if rule.max_count * rule.min_period <= WIDTH:
        assert 0 < want.sum() < len(want)  # the rows hold runs of this rule and rows without
    else:
        assert not want.any()


@pytest.mark.parametrize(
    "fields, message",
    [
        (
            {"min_period": 3, "max_period": 13, "max_count": 2**62},
            "InstanceFilter.max_count must be at most 715,827,882 (a row holds at most "
            "2,147,483,647 tokens, so no more copies of an n-gram of min_period 3), got "
            f"{2**62}",
        ),
        (
            {"max_period": 2**63},
            "InstanceFilter.max_period must be at most 2,147,483,647 (a row holds at most "
            f"2,147,483,647 tokens), got {2**63}",
        ),
        (
            {"min_period": 2**31, "max_period": 2**31},
            "InstanceFilter.min_period must be at most 2,147,483,647",
        ),
        (
            {"max_count": MAX_ROW_TOKENS + 1},
            "InstanceFilter.max_count must be at most 2,147,483,647",
        ),
    ],
)
def test_values_past_what_a_row_holds_are_refused_when_made(
    fields: dict[str, int], message: str
) -> None:
    """Issue 35, finding 3: refused at construction, naming the field, the
    value and the largest that works (``max_period=2**63`` was an
    ``OverflowError`` at the first batch)."""
    with pytest.raises(ValueError) as e:
        ftj.InstanceFilter(**fields)
    assert message in str(e.value)


def test_a_filter_that_can_reject_no_row_of_the_run_is_refused() -> None:
    """``max_count`` copies of the shortest n-gram longer than ``seq_len``:
    refused where the filter meets the run's ``seq_len``, naming both."""
    rule = ftj.InstanceFilter(min_period=2, max_count=9)
    with pytest.raises(ValueError) as e:
        ftj.LoaderConfig(8, 16, instance_filter=rule)
    assert str(e.value) == (
        "LoaderConfig.instance_filter.max_count is 9: 9 copies of an n-gram of min_period 2 "
        "take 18 tokens, more than a row of seq_len 16 holds, so the filter could reject no "
        "row; set max_count <= 8 or seq_len >= 18"
    )
    with pytest.raises(ValueError, match=r"^loader.instance_filter.max_count is 32: "):
        ftj.LoaderConfig.from_dict(
            {"batch_size": 2, "seq_len": 16, "instance_filter": {"max_count": 32}}, "loader"
        )
    with pytest.raises(ValueError, match=r"^instance_filter.max_count is 9: .* seq_len 16"):
        FlatTokensSource(split(), seq_len=16, instance_filter=rule)
    fits = ftj.InstanceFilter(min_period=2, max_count=8)  # 8 copies of a 2-gram: 16 tokens
    assert ftj.LoaderConfig(8, 16, instance_filter=fits).instance_filter == fits


def lowered(rule: ftj.InstanceFilter, targets: np.ndarray, segments: np.ndarray) -> str:
    """The program ``jax.jit`` compiles for the filter, its numbers masked."""
    text = jax.jit(rule.rejected_jax).lower(targets, segments).as_text()
    return re.sub(r"[0-9]+", "0", text)


def test_the_jitted_filter_is_the_same_program_for_any_max_period() -> None:
    """Issue 35: the jitted filter unrolled one chain per period (66 s to
    compile ``max_period=100`` at seq_len 2048). Its program is now one loop:
    the same, but for its bounds, at 2 periods or a million; and it still
    rejects what the brute force and the host kernels reject."""
    width = 256
    rng = np.random.default_rng(1)
    rows = []
    for _ in range(24):
        gram = rng.integers(0, 1000, int(rng.integers(1, 130))).tolist()
        head = rng.integers(1000, 2000, int(rng.integers(0, 20))).tolist()
        rows.append((head + gram * 2 + rng.integers(2000, 3000, width).tolist())[:width])
    targets = np.array(rows, np.int32)
    segments = np.ones_like(targets)
    segments[::3, -int(width / 4) :] = 0
    programs = {
        lowered(ftj.InstanceFilter(max_period=p, max_count=2), targets, segments)
        for p in (2, 100, 10**6)
    }
    assert len(programs) == 1
    rule = ftj.InstanceFilter(max_period=100, max_count=2)
    want = every_path_against_the_brute_force(rule, targets, segments)
    assert 0 < want.sum() < len(want)


def test_config_from_yaml_and_bad_values_named_by_path(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(
        yaml.safe_dump(
            {"loader": {"batch_size": 2, "seq_len": 8, "instance_filter": {"max_count": 5}}}
        )
    )
    cfg = ftj.LoaderConfig.from_yaml(path)
    assert cfg.instance_filter == ftj.InstanceFilter(max_count=5)
    assert ftj.LoaderConfig(2, 8).instance_filter is None
    for bad, where in [
        ({"max_count": 1}, "loader.instance_filter.max_count must be an int >= 2, got 1"),
        (
            {"max_period": 2, "min_period": 3},
            "loader.instance_filter.max_period must be >= min_period (3)",
        ),
        (
            {"max_perid": 3},
            "loader.instance_filter has unknown field 'max_perid' (did you mean 'max_period'?)",
        ),
        ({"max_count": 2.0}, "loader.instance_filter.max_count"),
        (True, "loader.instance_filter must be None or a mapping of InstanceFilter fields"),
    ]:
        path.write_text(
            yaml.safe_dump({"loader": {"batch_size": 2, "seq_len": 8, "instance_filter": bad}})
        )
        with pytest.raises(ValueError, match="instance_filter") as e:
            ftj.LoaderConfig.from_yaml(path)
        assert where in str(e.value)
    with pytest.raises(ValueError, match=r"InstanceFilter.min_period must be an int >= 1, got 0"):
        ftj.InstanceFilter(min_period=0)


def repetitive_dataset(seed: int = 0) -> str:
    """Sequences of random tokens, some holding an n-gram repeated 2 to 7 times."""
    rng = np.random.default_rng(seed)
    seqs = []
    for _ in range(60):
        seq = rng.integers(10, 1000, int(rng.integers(1, 12))).tolist()
        if rng.random() < 0.6:
            gram = rng.integers(1, 5, int(rng.integers(1, 4))).tolist()
            at = int(rng.integers(0, len(seq) + 1))
            seq[at:at] = gram * int(rng.integers(2, 8))
        seqs.append(seq)
    url = memory_url("filter")
    ftj.write_dataset(
        url, {"train": seqs}, storage_format=ftj.StorageFormat(shard_tokens=256, chunk_tokens=16)
    )
    return url


URL = repetitive_dataset()


def split() -> ftj.FlatTokens:
    return ftj.open_dataset(URL)["train"]


def filtered_like_brute(off: dict[str, Any], on: dict[str, Any], rule: ftj.InstanceFilter) -> int:
    """Asserts ``on`` is ``off`` with the masks of the rows the brute-force
    counter rejects cleared; returns how many."""
    off = {k: np.asarray(v) for k, v in off.items()}
    on = {k: np.asarray(v) for k, v in on.items()}
    rejected = brute_rows(off, rule)
    for key in ("inputs", "targets", "segment_ids", "positions"):
        np.testing.assert_array_equal(on[key], off[key])
    np.testing.assert_array_equal(on["loss_mask"], off["loss_mask"] & ~rejected[:, None])
    return int(rejected.sum())


@pytest.mark.parametrize("packing", [True, False, "bins"])
def test_host_and_device_decode_clear_the_rows_the_brute_force_counter_rejects(
    packing: bool | str,
) -> None:
    mesh = jax.make_mesh((4, 2), ("data", "seq"))
    rejected = 0
    for step in range(2):
        cfg = ftj.LoaderConfig(8, 16, packing=packing, seed=3, prefetch=0)
        off = ftj.Loader(split(), cfg).host_batch(step)
        for how in [
            {"decode": "host"},
            {"decode": "device"},
            {"decode": "host", "sharding": NamedSharding(mesh, P("data", "seq"))},
            {"decode": "device", "sharding": NamedSharding(mesh, P("data"))},
        ]:
            sharding = how.pop("sharding", None)
            on_cfg = ftj.LoaderConfig(
                8, 16, packing=packing, seed=3, prefetch=0, instance_filter=RULE, **how
            )
            loader = ftj.Loader(split(), on_cfg, sharding=sharding)
            found = filtered_like_brute(off, loader.batch(step), RULE)
            if sharding is None and how["decode"] == "host":
                assert filtered_like_brute(off, loader.host_batch(step), RULE) == found
        rejected += found
    assert rejected > 0  # the data holds rows to reject


def test_device_decoder_applies_the_filter() -> None:
    cfg = ftj.LoaderConfig(8, 16, seed=1, instance_filter=RULE)
    loader = ftj.Loader(split(), cfg)
    decode = jax.jit(loader.decoder())
    plain = ftj.Loader(split(), ftj.LoaderConfig(8, 16, seed=1))
    step = next(s for s in range(20) if brute_rows(plain.host_batch(s), RULE).any())
    off = plain.host_batch(step)
    assert filtered_like_brute(off, decode(loader.encoded_batch(step)), RULE) > 0


def test_rows_are_judged_on_their_own_targets() -> None:
    """A run across a packed row's edge counts in neither row; one across a
    sequence boundary inside a row counts; a row holding the whole run is
    rejected; padding never counts."""
    url = memory_url("edges")
    rule = ftj.InstanceFilter(max_period=2, max_count=4)
    # Packed rows of 8: row 0 ends with 3 copies of [1, 2], row 1 starts with 2 more.
    # Row 2 holds [5, 5] ending one sequence and [5, 5] starting the next.
    seqs = [
        [90, 91, 1, 2, 1, 2, 1, 2, 1, 2, 1, 2, 92, 93, 94, 95],
        [96, 97, 98, 99, 5, 5],
        [5, 5, 80, 81, 82, 83],
    ]
    ftj.write_dataset(url, {"train": seqs})
    ft = ftj.open_dataset(url)["train"]
    packed = ftj.Loader(ft, ftj.LoaderConfig(4, 8, shuffle=False, instance_filter=rule)).host_batch(
        0
    )
    assert packed["loss_mask"].all(axis=1).tolist() == [True, True, False, True]
    # Padded rows: each sequence alone (the first holds all 5 copies of [1, 2]),
    # padded with pad_id 0 far past max_count.
    padded = ftj.Loader(
        ft, ftj.LoaderConfig(3, 40, packing=False, shuffle=False, instance_filter=rule)
    )
    batch = padded.host_batch(0)
    assert (batch["segment_ids"] == 0).sum(axis=1).min() >= 24
    assert batch["loss_mask"].sum(axis=1).tolist() == [0, 6, 6]


def test_grain_source_applies_the_filter_as_the_loader_does() -> None:
    src = FlatTokensSource(split(), seq_len=16, instance_filter={"max_period": 3, "max_count": 4})
    assert src.instance_filter == RULE and "instance_filter=InstanceFilter(" in repr(src)
    plain = FlatTokensSource(split(), seq_len=16)
    indices = np.arange(len(src))
    rejected = filtered_like_brute(plain.read_batch(indices), src.read_batch(indices), RULE)
    assert rejected > 0
    cfg = ftj.LoaderConfig(8, 16, shuffle=False, num_epochs=1, instance_filter=RULE)
    loader = ftj.Loader(split(), cfg)
    for step in range(len(src) // 8):
        got = src.read_batch(np.arange(8 * step, 8 * step + 8))
        for key, value in loader.host_batch(step).items():
            np.testing.assert_array_equal(got[key], value)
    first = int(np.flatnonzero(brute_rows(plain.read_batch(indices), RULE))[0])
    assert not src[first]["loss_mask"].any() and plain[first]["loss_mask"].any()


def test_restore_with_another_filter_is_refused_naming_both() -> None:
    def loader(rule: ftj.InstanceFilter | None) -> ftj.Loader:
        return ftj.Loader(split(), ftj.LoaderConfig(4, 16, instance_filter=rule))

    on = loader(RULE)
    on.next_step = 3
    state = json.loads(json.dumps(on.state()))
    assert state["fingerprint"]["config"]["instance_filter"] == {
        "max_period": 3,
        "min_period": 1,
        "max_count": 4,
    }
    assert loader(RULE).restore(state) == 3
    with pytest.raises(ftj.StateMismatch) as e:
        loader(ftj.InstanceFilter(max_period=3, max_count=5)).restore(state)
    assert "fingerprint.config.instance_filter.max_count: saved 4, now 5" in str(e.value)
    with pytest.raises(ftj.StateMismatch) as e:
        loader(None).restore(state)
    assert (
        "fingerprint.config.instance_filter: saved {'max_period': 3, 'min_period': 1, "
        "'max_count': 4}, now None" in str(e.value)
    )
    off = loader(None).state()
    with pytest.raises(ftj.StateMismatch) as e:
        loader(RULE).restore(off)
    assert "fingerprint.config.instance_filter: saved None, now {'max_period': 3" in str(e.value)


def test_a_state_without_the_field_restores_with_the_filter_off(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A state saved with the filter off holds no ``instance_filter``: it
    resumes, without a warning, on a loader whose filter is off."""
    before = ftj.Loader(split(), ftj.LoaderConfig(4, 16))
    before.next_step = 5
    saved = json.loads(json.dumps(before.state()))
    assert "instance_filter" not in saved["fingerprint"]["config"]
    with caplog.at_level(logging.WARNING, logger="flat_tokens_jax"):
        assert ftj.Loader(split(), ftj.LoaderConfig(4, 16)).restore(saved) == 5
    assert not caplog.records


@pytest.mark.parametrize("prefetch", [0, 2])
def test_stats_count_the_rows_filtered_in_the_steps_handed_out(prefetch: int) -> None:
    cfg = ftj.LoaderConfig(8, 16, seed=2, prefetch=prefetch, instance_filter=RULE)
    loader = ftj.Loader(split(), cfg)
    plain = ftj.Loader(split(), ftj.LoaderConfig(8, 16, seed=2))
    counts = [int(brute_rows(plain.host_batch(s), RULE).sum()) for s in range(6)]
    assert sum(counts) > 0
    for step, _ in loader.iterate(0, 5):
        assert loader.stats()["filtered_rows_last"] == counts[step]
    loader.host_batch(5)  # not handed out: not counted
    stats = loader.stats()
    assert stats["filtered_rows"] == sum(counts[:5]) and stats["filtered_rows_last"] == counts[4]
    device = ftj.Loader(
        split(), ftj.LoaderConfig(8, 16, seed=2, decode="device", instance_filter=RULE)
    )
    # Decoded on the devices, step 0's rejected rows are cleared but not counted.
    assert filtered_like_brute(plain.host_batch(0), device.batch(0), RULE) == counts[0] > 0
    assert device.stats()["filtered_rows"] == 0


def test_stats_count_the_steps_and_filtered_rows_a_grain_iterator_hands_out() -> None:
    loader = ftj.Loader(split(), ftj.LoaderConfig(8, 16, seed=2, instance_filter=RULE))
    plain = ftj.Loader(split(), ftj.LoaderConfig(8, 16, seed=2))
    counts = [int(brute_rows(plain.host_batch(s), RULE).sum()) for s in range(5)]
    assert sum(counts) > 0
    iterator = iter(loader.to_grain())
    for step in range(5):
        next(iterator)
        assert loader.stats()["filtered_rows_last"] == counts[step]
    stats = loader.stats()
    assert stats["steps"] == 5 and stats["filtered_rows"] == sum(counts)
    assert stats["tokens"] == 5 * 8 * 16


def test_show_marks_the_filtered_rows(tmp_path: Path) -> None:
    config = tmp_path / "run.yaml"
    loader_fields = {"batch_size": 8, "seq_len": 16, "seed": 4}
    config.write_text(
        yaml.safe_dump(
            {"loader": {**loader_fields, "instance_filter": {"max_period": 3, "max_count": 4}}}
        )
    )
    plain = ftj.Loader(split(), ftj.LoaderConfig(**loader_fields))
    step = next(s for s in range(20) if brute_rows(plain.host_batch(s), RULE).any())
    rejected = brute_rows(plain.host_batch(step), RULE)
    code, out, err = run_main("show", URL, "--config", str(config), "--step", str(step), "--json")
    assert code == 0, err
    rows = json.loads(out)["rows"]
    assert [bool(r.get("filtered")) for r in rows] == rejected.tolist()
    assert all(not any(r["loss_mask"]) for r in rows if r.get("filtered"))
    code, out, err = run_main("show", URL, "--config", str(config), "--step", str(step))
    assert code == 0, err
    marked = [line for line in out.splitlines() if line.startswith("row ")]
    assert [
        "filtered (instance_filter: loss_mask 0)" in line for line in marked
    ] == rejected.tolist()


def test_show_names_a_bad_filter_value_by_its_place_in_the_file(tmp_path: Path) -> None:
    config = tmp_path / "run.yaml"
    loader = {"batch_size": 8, "seq_len": 16, "instance_filter": {"max_count": 1}}
    config.write_text(yaml.safe_dump({"loader": loader}))
    code, _, err = run_main("show", URL, "--config", str(config), "--step", "0")
    assert code == 1
    assert f"{config}: loader.instance_filter.max_count must be an int >= 2, got 1" in err


@pytest.mark.parametrize("decode", ["host", "device"])
def test_a_layout_carries_the_filters_verdict(decode: str) -> None:
    """The filter acts on the five fields before a layout is made of them:
    ``tokens`` carries its ``loss_mask``, and MaxText's ``targets_segmentation``
    (which weights MaxText's loss) is 0 on a rejected row."""
    plain = ftj.LoaderConfig(8, 16, seed=3, prefetch=0)
    rejected = 0
    for step in range(3):
        rows = brute_rows(ftj.Loader(split(), plain).host_batch(step), RULE)
        rejected += int(rows.sum())
        for layout, field in [("tokens", "loss_mask"), ("maxtext", "targets_segmentation")]:
            cfg = dataclasses.replace(plain, layout=layout, instance_filter=RULE, decode=decode)
            got = np.asarray(ftj.Loader(split(), cfg).batch(step)[field])
            assert not got[rows].any(), (layout, step)
            assert got[~rows].any(axis=1).all(), (layout, step)
    assert rejected > 0
