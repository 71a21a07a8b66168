"""Batch layouts and per-row sequence lengths against brute-force references.

Every layout field is built twice in plain Python: from the raw sequences
(which token starts a sequence, where each row's runs begin) and from the
reference five fields; the loader's host and device decodes, every sharding
and the grain adapter must equal them. Then the error for a row of too many
runs, and the cap on runs per bin of the packing plan.
"""

from __future__ import annotations

import dataclasses
import itertools

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from memurls import memory_url
from reference import bin_row, packed_row, padded_row, padding_row
from test_binpack import GOLDEN_DIGEST
from test_sharding import CASES, mesh

import flat_tokens_jax as ftj
from flat_tokens_jax.data.binpack import ALGORITHM, build_plan, plan_digest
from flat_tokens_jax.decoding.layouts import BatchLayout
from flat_tokens_jax.grain.grain import FlatTokensSource
from flat_tokens_jax.tools.show import build_loader, rows_of

LAYOUTS = ("fields", "segments", "tokens", "maxtext")


def split_of(seqs: list[list[int]]) -> ftj.FlatTokens:
    url = memory_url("layouts")
    ftj.write_dataset(
        url, {"train": seqs}, storage_format=ftj.StorageFormat(shard_tokens=64, chunk_tokens=8)
    )
    return ftj.open_dataset(url)["train"]


def raw_rows(
    seqs: list[list[int]], records: list[int | None], members: list[list[int]] | None, cfg: dict
) -> list[dict[str, list]]:
    """Per row: the five reference fields, and from the raw sequences the
    token before column 0 (``before``), ``sequence_start`` and the run lengths."""
    seq_len, start_id, pad_id = cfg["seq_len"], cfg["start_token_id"], cfg["pad_id"]
    flat = [t for s in seqs for t in s]
    is_start = [j == 0 for s in seqs for j in range(len(s))]
    rows = []
    for r in records:
        if r is None:
            row = padding_row(seq_len, pad_id)
            row.update(before=pad_id, starts=[False] * seq_len, runs=[seq_len])
        elif cfg["packing"] is True:
            row = packed_row(seqs, r, seq_len, start_id)
            lo = r * seq_len
            starts = is_start[lo : lo + seq_len]
            cuts = [0] + [t for t in range(1, seq_len) if starts[t]] + [seq_len]
            before = start_id if starts[0] else flat[lo - 1]
            runs = [b - a for a, b in itertools.pairwise(cuts)]
            row.update(before=before, starts=starts, runs=runs)
        else:
            held = [seqs[r]] if cfg["packing"] is False else [seqs[i] for i in members[r]]
            if cfg["packing"] is False:
                row = padded_row(seqs, r, seq_len, start_id, pad_id)
            else:
                row = bin_row(seqs, members[r], seq_len, start_id, pad_id)
            sizes = [len(s[:seq_len]) for s in held]
            pad = seq_len - sum(sizes)
            starts = []
            for n in sizes:
                starts += [True] + [False] * (n - 1)
            row.update(
                before=start_id,
                starts=starts + [False] * pad,
                runs=sizes + ([pad] if pad else []),
            )
        rows.append(row)
    return rows


def expected_layout(
    rows: list[dict[str, list]], layout: str, max_segments: int | None, sequence_start: bool = False
) -> dict:
    """A layout's arrays from the raw-sequence facts of :func:`raw_rows`."""
    out: dict[str, list] = {}
    for row in rows:
        seg, pos, mask = row["segment_ids"], row["positions"], row["loss_mask"]
        fields = {k: row[k] for k in ("inputs", "targets", "segment_ids", "positions", "loss_mask")}
        if layout == "fields":
            got = dict(fields)
        elif layout == "segments":
            got = {**fields, "sequence_start": row["starts"]}
        elif layout == "tokens":
            got = {
                "tokens": [row["before"], *row["targets"]],
                "loss_mask": mask,
                "segment_ids": seg,
                "positions": pos,
                "sequence_start": row["starts"],
            }
        else:
            got = {
                "inputs": row["inputs"],
                "inputs_segmentation": seg,
                "inputs_position": pos,
                "targets": row["targets"],
                "targets_segmentation": [s if m else 0 for s, m in zip(seg, mask, strict=True)],
                "targets_position": pos,
            }
        if sequence_start:
            got["sequence_start"] = row["starts"]
        if max_segments is not None:
            got["segment_lengths"] = row["runs"] + [0] * (max_segments - len(row["runs"]))
        for k, v in got.items():
            out.setdefault(k, []).append(v)
    return {k: np.array(v) for k, v in out.items()}


def from_five_fields(batch: dict[str, np.ndarray], rows: list[dict]) -> None:
    """Checks the layout fields of a "tokens" batch with ``segment_lengths``
    against the reference five fields, one column at a time."""
    for i, row in enumerate(rows):
        tokens = batch["tokens"][i].tolist()
        assert tokens[1:] == row["targets"]
        for t in range(len(row["inputs"])):
            starts_inside = t > 0 and row["positions"][t] == 0 and row["segment_ids"][t] != 0
            first_padding = t > 0 and row["segment_ids"][t] == 0 and row["segment_ids"][t - 1] != 0
            if not (starts_inside or first_padding):
                assert tokens[t] == row["inputs"][t], (i, t)
            real_start = row["positions"][t] == 0 and row["segment_ids"][t] != 0
            flagged = bool(batch["sequence_start"][i][t])
            assert flagged == (real_start and (t > 0 or row["starts"][0]))
        runs, length = [], 0
        for t in range(len(row["inputs"])):
            new = t > 0 and (
                row["segment_ids"][t] != row["segment_ids"][t - 1] or batch["sequence_start"][i][t]
            )
            if new:
                runs.append(length)
                length = 0
            length += 1
        runs.append(length)
        lengths = batch["segment_lengths"][i].tolist()
        assert lengths[: len(runs)] == runs and not any(lengths[len(runs) :])


def records_of(loader: ftj.Loader, step: int, batch: int) -> list[int | None]:
    """In-order records of the rows of ``step`` (``None``: padding past the last epoch)."""
    n = len(loader.components[0])
    total = n * (loader.config.num_epochs or 1)
    return [g % n if g < total else None for g in range(step * batch, (step + 1) * batch)]


def bin_members(loader: ftj.Loader) -> list[list[int]] | None:
    plan = getattr(loader.components[0], "plan", None)
    if plan is None:
        return None
    s, o = plan.bin_starts, plan.seq_order
    return [o[a:b].tolist() for a, b in itertools.pairwise(s)]


def check_step(loader: ftj.Loader, seqs: list[list[int]], step: int, got: dict) -> list[dict]:
    cfg = loader.config
    facts = {
        "seq_len": cfg.seq_len,
        "packing": cfg.packing.value,
        "start_token_id": loader.start_token_id,
        "pad_id": cfg.pad_id,
    }
    rows = raw_rows(seqs, records_of(loader, step, cfg.batch_size), bin_members(loader), facts)
    want = expected_layout(rows, cfg.layout, cfg.max_segments, cfg.sequence_start)
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        array = np.asarray(got[key])
        assert array.dtype == (bool if key in ("loss_mask", "sequence_start") else np.int32), key
        np.testing.assert_array_equal(array, value.astype(array.dtype), err_msg=f"{key} {step}")
    return rows


@st.composite
def runs_case(draw: st.DrawFn) -> tuple[list[list[int]], int, int]:
    lengths = draw(st.lists(st.integers(1, 12), min_size=1, max_size=20))
    seqs = [draw(st.lists(st.integers(0, 99), min_size=n, max_size=n)) for n in lengths]
    seq_len = draw(st.integers(1, 16))
    batch = draw(st.integers(1, 5))
    return seqs, seq_len, batch


@settings(max_examples=15)
@given(case=runs_case(), start=st.integers(0, 3), pad=st.integers(0, 3), flag=st.booleans())
def test_host_layouts_equal_the_references(
    case: tuple[list[list[int]], int, int], start: int, pad: int, flag: bool
) -> None:
    seqs, seq_len, batch = case
    split = split_of(seqs)
    for packing, layout in itertools.product((True, False, "bins"), LAYOUTS):
        if packing is True and sum(map(len, seqs)) < seq_len:
            continue
        cfg = ftj.LoaderConfig(
            batch_size=batch,
            seq_len=seq_len,
            packing=packing,
            shuffle=False,
            num_epochs=1,
            start_token_id=start,
            pad_id=pad,
            layout=layout,
            sequence_start=flag,
            # A row holds at most seq_len runs, and a cap on bins is at least 2.
            max_segments=None if packing == "bins" and seq_len < 2 else seq_len,
        )
        loader = ftj.Loader(split, cfg)
        for step in range(loader.num_batches):
            got = loader.host_batch(step)
            rows = check_step(loader, seqs, step, got)
            if layout == "tokens" and cfg.max_segments is not None:
                from_five_fields(got, rows)


SEQS = [[i % 97 + 3] * n for i, n in enumerate([5, 1, 9, 3, 12, 2, 7, 4, 6, 8, 2, 3, 11, 1, 5, 4])]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("packing", [True, False, "bins"], ids=["packed", "padded", "bins"])
def test_device_decode_equals_the_references(packing: bool | str, layout: str) -> None:
    split = split_of(SEQS)
    kw = dict(batch_size=4, seq_len=8, packing=packing, shuffle=False, num_epochs=1, pad_id=1)
    # One packing asks for sequence_start: a layout that lacks it gains it inside jit too.
    kw.update(start_token_id=2, layout=layout, max_segments=6, sequence_start=packing is False)
    device = ftj.Loader(split, ftj.LoaderConfig(**kw, decode="device"))
    for step in range(device.num_batches):
        check_step(device, SEQS, step, device.batch(step))
    enc = device.encoded_batch(0)
    check_step(device, SEQS, 0, jax.jit(device.decoder(0))(enc))


@pytest.mark.parametrize("decode", ["host", "device"])
@pytest.mark.parametrize("packing", [True, False, "bins"], ids=["packed", "padded", "bins"])
@pytest.mark.parametrize(("mesh_name", "spec"), CASES)
def test_every_sharding_lays_out_every_width(
    mesh_name: str, spec: P, packing: bool | str, decode: str
) -> None:
    split = split_of(SEQS)
    kw = dict(batch_size=8, seq_len=8, packing=packing, shuffle=False, num_epochs=2)
    cfg = ftj.LoaderConfig(**kw, layout="tokens", max_segments=8, decode=decode)
    sharding = NamedSharding(mesh(mesh_name), spec)
    loader = ftj.Loader(split, cfg, sharding=sharding)
    rows_only = NamedSharding(sharding.mesh, P((*tuple(spec), None)[0], None))
    for step in range(loader.num_batches):
        got = loader.batch(step)
        for key, value in got.items():
            # segment_lengths is [8, 8] here, as wide as a row: still rows only.
            want = rows_only if key in ("tokens", "segment_lengths") else sharding
            assert value.sharding.is_equivalent_to(want, 2), key
        check_step(loader, SEQS, step, got)


@pytest.mark.parametrize("decode", ["host", "device"])
def test_a_row_of_too_many_runs_is_refused(decode: str) -> None:
    # Record 0 of seq_len 8 holds [3] * 5, [4] and the start of [5] * 9: three
    # runs; record 1 two.
    split = split_of(SEQS)
    cfg = ftj.LoaderConfig(batch_size=2, seq_len=8, shuffle=False, max_segments=2, decode=decode)
    loader = ftj.Loader(split, cfg)
    with pytest.raises(ValueError, match=r"step 0: row 0 has 3 runs .* max_segments is 2"):
        loader.batch(0)
    padded = ftj.LoaderConfig(batch_size=2, seq_len=8, packing=False, shuffle=False, max_segments=1)
    with pytest.raises(ValueError, match=r"step 0: row 0 has 2 runs .* max_segments is 1"):
        ftj.Loader(split, padded).host_batch(0)
    source = FlatTokensSource(split, seq_len=8, layout="tokens", max_segments=2)
    with pytest.raises(ValueError, match=r"row 0 has 3 runs .* max_segments is 2"):
        source.read_batch([1, 0])


@pytest.mark.parametrize(("max_segments", "flag"), [(None, False), (5, False), (None, True)])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_batch_holds_the_bytes_its_layout_counts(
    layout: str, max_segments: int | None, flag: bool
) -> None:
    """Issue 35: the memory estimate counts every field the layout makes
    (``tokens`` ``[B, L + 1]``, MaxText's six, ``sequence_start``,
    ``segment_lengths`` ``[B, M]``): the bytes of real batches, host and
    device decode, field by field."""
    split = split_of(SEQS)
    kw = dict(batch_size=3, seq_len=8, packing="bins", layout=layout, max_segments=max_segments)
    kw["sequence_start"] = flag
    counted = BatchLayout(layout, max_segments, flag).row_bytes(8)
    for decode in ("host", "device"):
        batch = ftj.Loader(split, ftj.LoaderConfig(**kw, decode=decode)).batch(0)
        assert sum(np.asarray(v).nbytes for v in batch.values()) == 3 * counted, decode


FIVE = ["inputs", "targets", "segment_ids", "positions", "loss_mask"]
MAXTEXT = [
    "inputs",
    "inputs_segmentation",
    "inputs_position",
    "targets",
    "targets_segmentation",
    "targets_position",
]
KEYS = {
    "fields": FIVE,
    "segments": [*FIVE, "sequence_start"],
    "tokens": ["tokens", "loss_mask", "segment_ids", "positions", "sequence_start"],
    "maxtext": MAXTEXT,
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_layout_holds_exactly_its_keys_with_and_without_the_flags(layout: str) -> None:
    """Issue 36: ``"maxtext"`` is exactly MaxText's six keys (a seventh made
    MaxText compile ``train_step`` twice); ``sequence_start=True`` and
    ``max_segments`` add their keys, on the host, inside ``jax.jit``, and
    through grain's source, its batches and the YAML form."""
    split = split_of(SEQS)
    kw = dict(batch_size=4, seq_len=8, packing="bins", layout=layout)
    for flag, cap in itertools.product((False, True), (None, 4)):
        want = set(KEYS[layout]) | ({"sequence_start"} if flag else set())
        want |= {"segment_lengths"} if cap else set()
        cfg = ftj.LoaderConfig(**kw, sequence_start=flag, max_segments=cap)
        loader = ftj.Loader(split, cfg)
        assert set(loader.host_batch(0)) == want, (flag, cap)
        assert set(jax.jit(loader.decoder(0))(loader.encoded_batch(0))) == want
        assert set(ftj.Loader(split, dataclasses.replace(cfg, decode="device")).batch(0)) == want
        source = FlatTokensSource(
            split, 8, "bins", layout=layout, sequence_start=flag, max_segments=cap
        )
        assert set(source[0]) == want and set(source.read_batch([0, 1])) == want
        yaml_cfg = ftj.LoaderConfig.from_dict(
            {**kw, "sequence_start": flag, "max_segments": cap}, "loader"
        )
        assert yaml_cfg == cfg
    assert len(KEYS["maxtext"]) == 6
    with pytest.raises(ValueError, match=r"^loader.sequence_start must be True or False, got 1"):
        ftj.LoaderConfig.from_dict({**kw, "sequence_start": 1}, "loader")
    with pytest.raises(ValueError, match=r"^sequence_start must be True or False, got 'yes'"):
        FlatTokensSource(split, 8, sequence_start="yes")


def test_max_segments_above_seq_len_is_refused_naming_both() -> None:
    """Issue 35: ``max_segments=10**8`` at ``seq_len=16`` was accepted and
    allocated 1.6 GB a step of zeros; a row of ``L`` columns holds at most
    ``L`` runs."""
    with pytest.raises(ValueError) as e:
        ftj.LoaderConfig(batch_size=4, seq_len=16, max_segments=10**8)
    assert str(e.value) == (
        "LoaderConfig.max_segments must be <= seq_len (16): a row of 16 columns holds at "
        "most 16 runs, got 100,000,000; set max_segments <= 16"
    )
    with pytest.raises(ValueError, match=r"^loader.max_segments must be <= seq_len \(8\)"):
        ftj.LoaderConfig.from_dict(
            {"batch_size": 4, "seq_len": 8, "packing": "bins", "max_segments": 9}, "loader"
        )
    split = split_of(SEQS)
    for packing in (True, False, "bins"):
        with pytest.raises(ValueError, match=r"^max_segments must be <= seq_len \(8\)"):
            FlatTokensSource(split, seq_len=8, packing=packing, max_segments=9)
    records = ftj.PackedRecords(split, 8)
    with pytest.raises(ValueError, match=r"^max_segments must be <= seq_len \(8\)"):
        FlatTokensSource(records, max_segments=9)
    assert ftj.LoaderConfig(batch_size=4, seq_len=8, max_segments=8).max_segments == 8


def test_grain_source_holds_the_layout_as_the_loader_does() -> None:
    split = split_of(SEQS)
    cfg = ftj.LoaderConfig(
        batch_size=4, seq_len=8, packing="bins", shuffle=False, layout="maxtext", max_segments=4
    )
    loader = ftj.Loader(split, cfg)
    source = FlatTokensSource(split, seq_len=8, packing="bins", layout="maxtext", max_segments=4)
    for step in range(len(source) // 4):
        want, got = loader.host_batch(step), source.read_batch(np.arange(4 * step, 4 * step + 4))
        assert sorted(got) == sorted(want)
        for key in want:
            np.testing.assert_array_equal(got[key], want[key], err_msg=key)
    assert source[0]["segment_lengths"].shape == (4,)
    plain = FlatTokensSource(split, seq_len=8, packing="bins")
    assert repr(plain) != repr(source) and "layout=" not in repr(plain)


def capped_reference(lengths: list[int], seq_len: int, cap: int) -> list[list[int]]:
    """Best fit decreasing, one sequence at a time, where a bin holds at most
    ``cap`` runs: ``cap - 1`` sequences, or ``cap`` that fill it; ties go to a
    bin one short of the cap, then to the bin filled most recently."""
    sizes = [min(n, seq_len) for n in lengths]
    free: list[int] = []
    last_used: list[int] = []
    members: list[list[int]] = []
    for t, i in enumerate(sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))):
        fits = [
            b
            for b in range(len(free))
            if (len(members[b]) < cap - 1 and free[b] >= sizes[i])
            or (len(members[b]) == cap - 1 and free[b] == sizes[i])
        ]
        if fits:
            b = min(fits, key=lambda b: (free[b], len(members[b]) != cap - 1, -last_used[b]))
        else:
            free.append(seq_len)
            last_used.append(-1)
            members.append([])
            b = len(free) - 1
        free[b] -= sizes[i]
        last_used[b] = t
        members[b].append(i)
    return [sorted(m) for m in members]


@given(
    lengths=st.lists(st.integers(1, 40), max_size=60),
    seq_len=st.integers(1, 48),
    cap=st.integers(2, 6),
)
def test_capped_plan_equals_its_reference_and_no_bin_exceeds_the_cap(
    lengths: list[int], seq_len: int, cap: int
) -> None:
    starts, order = build_plan(np.array(lengths, np.int64), seq_len, cap)
    got = [order[a:b].tolist() for a, b in itertools.pairwise(starts)]
    assert got == capped_reference(lengths, seq_len, cap)
    assert sorted(i for b in got for i in b) == list(range(len(lengths)))
    for members in got:
        used = sum(min(lengths[i], seq_len) for i in members)
        assert used <= seq_len
        assert len(members) + (used < seq_len) <= cap


def test_uncapped_plans_are_unchanged_and_the_cap_names_the_plan() -> None:
    lengths = (np.arange(1000) * 7919 % 997 + 1).astype(np.int64)
    assert plan_digest(*build_plan(lengths, 2048)) == GOLDEN_DIGEST
    assert plan_digest(*build_plan(lengths, 2048, None)) == GOLDEN_DIGEST
    split = split_of(SEQS)
    plain = ftj.Loader(split, ftj.LoaderConfig(batch_size=2, seq_len=16, packing="bins"))
    capped = ftj.Loader(
        split, ftj.LoaderConfig(batch_size=2, seq_len=16, packing="bins", max_segments=2)
    )
    algorithm = capped.fingerprint()["data"]["plan"]["algorithm"]
    assert algorithm.endswith("/max-segments-2")
    assert plain.fingerprint()["data"]["plan"]["algorithm"] == ALGORITHM
    assert capped.state_differences(plain.state())
    for step in range(len(capped.components[0]) // 2):
        assert capped.host_batch(step)["segment_lengths"].shape == (2, 2)
    with pytest.raises(ValueError, match=r"max_segments must be >= 2 with packing='bins'"):
        ftj.LoaderConfig(batch_size=2, seq_len=16, packing="bins", max_segments=1)


def test_config_values_are_checked_and_change_no_fingerprint() -> None:
    with pytest.raises(ValueError, match=r"LoaderConfig.layout must be one of"):
        ftj.LoaderConfig(batch_size=2, seq_len=8, layout="flat")
    with pytest.raises(ValueError, match=r"LoaderConfig.max_segments"):
        ftj.LoaderConfig(batch_size=2, seq_len=8, max_segments=0)
    split = split_of(SEQS)
    base = ftj.Loader(split, ftj.LoaderConfig(batch_size=2, seq_len=8))
    other = ftj.Loader(
        split,
        ftj.LoaderConfig(
            batch_size=2, seq_len=8, layout="maxtext", max_segments=8, sequence_start=True
        ),
    )
    assert other.state_differences(base.state()) == []
    assert sorted(base.host_batch(0)) == sorted(
        ["inputs", "targets", "segment_ids", "positions", "loss_mask"]
    )


def test_yaml_fields_and_mixture_components_take_the_layout() -> None:
    cfg = ftj.LoaderConfig.from_dict(
        {"batch_size": 4, "seq_len": 8, "packing": "bins", "layout": "segments", "max_segments": 3},
        "loader",
    )
    with pytest.raises(ValueError, match=r"loader.layout must be one of"):
        ftj.LoaderConfig.from_dict({"batch_size": 4, "seq_len": 8, "layout": 1}, "loader")
    mixture = ftj.Mixture({"a": (split_of(SEQS), 1), "b": (split_of(SEQS[::-1]), 2)}, seed=1)
    loader = ftj.Loader(mixture, cfg)
    for records in loader.components:
        assert records.plan.algorithm.endswith("/max-segments-3")
    for step in range(4):
        batch = loader.host_batch(step)
        assert batch["segment_lengths"].sum(axis=1).tolist() == [8] * 4
        assert (batch["segment_lengths"] > 0).sum(axis=1).max() <= 3
        starts = batch["sequence_start"] & (batch["positions"] == 0)
        np.testing.assert_array_equal(starts, batch["sequence_start"])


def test_show_prints_the_five_fields_of_a_run_in_any_layout() -> None:
    split = split_of(SEQS)
    config = {"loader": {"batch_size": 2, "seq_len": 8, "layout": "tokens", "max_segments": 8}}
    loader = build_loader(url=split.url, config=config)
    assert loader.config.layout == "fields" and loader.config.max_segments == 8
    rows = rows_of(loader, 0, [0, 1])
    run = ftj.Loader(split, ftj.LoaderConfig(**config["loader"]))
    tokens = run.host_batch(0)["tokens"]
    for i, row in enumerate(rows):
        assert row["targets"] == tokens[i, 1:].tolist()
