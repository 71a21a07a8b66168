"""Bins of whole sequences: rows against a brute-force reference, loaders, grain, restore."""

from __future__ import annotations

import itertools
import pickle
from collections import Counter
from pathlib import Path

import jax
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from memurls import memory_url
from reference import bin_row

import flat_tokens_jax as ftj
from flat_tokens_jax.data import binpack
from flat_tokens_jax.data.bins import BinRecords
from flat_tokens_jax.data.plans import make_plan
from flat_tokens_jax.decoding.batch import FIELDS, bin_fields, window_fields
from flat_tokens_jax.decoding.batch_jax import bin_fields_jax
from flat_tokens_jax.grain.grain import FlatTokensSource


def split_of(seqs: list[list[int]], masks: list[list[int]] | None = None) -> ftj.FlatTokens:
    url = memory_url("bins")
    ftj.write_dataset(
        url,
        {"train": seqs},
        loss_masks=None if masks is None else {"train": masks},
        storage_format=ftj.StorageFormat(shard_tokens=64, chunk_tokens=8),
    )
    return ftj.open_dataset(url)["train"]


@st.composite
def split_data(draw: st.DrawFn) -> tuple[list[list[int]], list[list[int]] | None, int]:
    lengths = draw(st.lists(st.integers(1, 30), min_size=1, max_size=25))
    seqs = [draw(st.lists(st.integers(0, 999), min_size=n, max_size=n)) for n in lengths]
    masked = draw(st.booleans())
    masks = (
        [draw(st.lists(st.integers(0, 1), min_size=n, max_size=n)) for n in lengths]
        if masked
        else None
    )
    # seq_len below the longest sequence in about half the cases: truncation.
    seq_len = draw(st.integers(1, 2 * max(lengths)))
    return seqs, masks, seq_len


@given(data=split_data(), start=st.integers(0, 5), pad=st.integers(0, 5))
def test_rows_equal_the_reference(
    data: tuple[list[list[int]], list[list[int]] | None, int], start: int, pad: int
) -> None:
    seqs, masks, seq_len = data
    records = BinRecords(split_of(seqs, masks), seq_len)
    plan = records.plan
    members = [plan.seq_order[a:b].tolist() for a, b in itertools.pairwise(plan.bin_starts)]
    assert sorted(i for m in members for i in m) == list(range(len(seqs)))
    got = window_fields(
        records.read(np.arange(len(records))), ftj.Packing.BINS, start_token_id=start, pad_id=pad
    )
    for b, m in enumerate(members):
        expected = bin_row(seqs, m, seq_len, start, pad, masks)  # refuses bins over seq_len
        for key in FIELDS:
            assert got[key][b].astype(int).tolist() == expected[key], (key, b)
        # Attention never crosses a sequence: each segment holds one sequence's tokens.
        for segment, i in enumerate(m, start=1):
            here = got["segment_ids"][b] == segment
            assert got["targets"][b][here].tolist() == seqs[i][:seq_len]


@given(data=split_data(), cut=st.data())
def test_columns_read_part_of_the_rows(
    data: tuple[list[list[int]], list[list[int]] | None, int], cut: st.DataObject
) -> None:
    seqs, masks, seq_len = data
    records = BinRecords(split_of(seqs, masks), seq_len)
    c0 = cut.draw(st.integers(0, seq_len - 1))
    c1 = cut.draw(st.integers(c0 + 1, seq_len))
    idx = np.arange(len(records))[::-1]
    whole, part = records.read(idx), records.read(idx, columns=(c0, c1))
    np.testing.assert_array_equal(part.encoded, whole.encoded[:, c0 : c1 + 1])
    np.testing.assert_array_equal(part.lengths, whole.lengths)
    if masks is not None:
        np.testing.assert_array_equal(part.stored_mask, whole.stored_mask[:, c0:c1])


def test_neighbouring_sequences_are_one_read() -> None:
    ft = split_of([[1, 2], [3, 4], [5, 6], [7, 8]])
    records = BinRecords(ft, 8)
    assert len(records) == 1
    ft.encoded_ranges([0], [1])  # checks the shard's probe, once
    before = ft.encoded.bytes_read
    requested = []
    original = ft.request_encoded

    def spy(starts: np.ndarray, stops: np.ndarray) -> object:
        requested.append(len(starts))
        return original(starts, stops)

    ft.request_encoded = spy  # type: ignore[method-assign]
    records.read(np.array([0]))
    assert requested == [1]
    assert ft.encoded.bytes_read - before == 8 * 4


def test_one_epoch_trains_on_every_sequence_once(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    seqs = [rng.integers(1, 500, rng.integers(1, 50)).tolist() for _ in range(300)]
    ft = split_of(seqs)
    cfg = ftj.LoaderConfig(batch_size=8, seq_len=40, packing="bins", num_epochs=1, seed=3)
    loader = ftj.Loader(ft, cfg, plan_cache=tmp_path)
    seen: Counter[tuple[int, ...]] = Counter()
    for _, batch in loader.iterate(0):
        segs, targets = np.asarray(batch["segment_ids"]), np.asarray(batch["targets"])
        for row in range(segs.shape[0]):
            for s in range(1, int(segs[row].max(initial=0)) + 1):
                seen[tuple(targets[row][segs[row] == s].tolist())] += 1
    assert seen == Counter(tuple(s[:40]) for s in seqs)
    kept = sum(min(len(s), 40) for s in seqs)
    assert kept / (len(loader.components[0]) * 40) > 0.95, "bins are nearly full"


def test_fingerprint_names_the_plan_and_restore_refuses_another(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ft = split_of([[i] * (1 + i % 7) for i in range(60)])
    cfg = ftj.LoaderConfig(batch_size=4, seq_len=8, packing="bins")
    loader = ftj.Loader(ft, cfg, plan_cache=tmp_path)
    plan = loader.fingerprint()["data"]["plan"]
    assert plan == {"algorithm": binpack.ALGORITHM, "digest": loader.components[0].plan.digest}
    state = loader.state()
    monkeypatch.setattr(binpack, "BLOCK", 16)
    other = ftj.Loader(BinRecords(ft, 8, plan=make_plan(ft, 8)), cfg)
    with pytest.raises(ftj.StateMismatch, match=r"data\.plan\.digest: saved"):
        other.restore(state)
    assert ftj.Loader(ft, cfg, plan_cache=tmp_path).restore(state) == 0


def test_a_plan_for_other_data_or_seq_len_is_refused() -> None:
    ft = split_of([[1, 2, 3], [4, 5], [6]])
    other = split_of([[1, 2, 3], [4, 5], [6, 7]])
    with pytest.raises(ftj.FormatError, match="seq_len: plan 8, data 4"):
        BinRecords(ft, 4, plan=make_plan(ft, 8))
    with pytest.raises(ftj.FormatError, match="num_tokens: plan 7, data 6"):
        BinRecords(ft, 8, plan=make_plan(other, 8))


def test_config_values(tmp_path: Path) -> None:
    assert ftj.LoaderConfig(batch_size=1, seq_len=4, packing="bins").packing is ftj.Packing.BINS
    with pytest.raises(ValueError, match=r"LoaderConfig.packing must be True .* got 'bin'"):
        ftj.LoaderConfig(batch_size=1, seq_len=4, packing="bin")
    path = tmp_path / "c.yaml"
    path.write_text("loader:\n  batch_size: 2\n  seq_len: 8\n  packing: bins\n")
    assert ftj.LoaderConfig.from_yaml(path).packing is ftj.Packing.BINS


@pytest.mark.parametrize("packing", ["bin", 1, 0, np.True_, None])
def test_every_surface_refuses_a_packing_in_the_same_words(packing: object) -> None:
    """LoaderConfig, a Mixture's records and the grain source check packing in
    one place: only True, False and "bins" pass, a 1 or numpy's True no more
    than a misspelt "bin"."""
    ft = split_of([[1, 2, 3], [4, 5], [6]])
    words = r"packing must be True \(packed windows\), False \(padded sequences\) or 'bins'"
    with pytest.raises(ValueError, match=rf"^LoaderConfig\.{words}.* got {packing!r}$"):
        ftj.LoaderConfig(batch_size=1, seq_len=4, packing=packing)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=rf"^{words}.* got {packing!r}$"):
        ftj.Mixture({"a": (ft, 1)}).records(4, packing)  # type: ignore[arg-type]
    if packing is not None:  # the grain source's None: the records' own packing
        with pytest.raises(ValueError, match=rf"^{words}.* got {packing!r}$"):
            FlatTokensSource(ft, 4, packing)  # type: ignore[arg-type]


@pytest.mark.parametrize("seq_len", [0, -1, True, 4.0, "4"])
def test_bins_refuse_a_seq_len_that_is_not_a_positive_int(seq_len: object) -> None:
    ft = split_of([[1, 2, 3], [4, 5], [6]])
    with pytest.raises(ValueError, match=r"^BinRecords\.seq_len must be an int >= 1, got "):
        BinRecords(ft, seq_len)  # type: ignore[arg-type]
    assert len(BinRecords(ft, np.int64(4))) == len(BinRecords(ft, 4)) == 2


def test_mixture_components_are_bins(tmp_path: Path) -> None:
    a, b = split_of([[1, 2], [3], [4, 5, 6]]), split_of([[7] * 5, [8, 9]])
    cfg = ftj.LoaderConfig(batch_size=4, seq_len=6, packing="bins")
    loader = ftj.Loader(ftj.Mixture({"a": (a, 1.0), "b": (b, 1.0)}), cfg, plan_cache=tmp_path)
    assert all(isinstance(r, BinRecords) for r in loader.components)
    batch = loader.host_batch(0)
    assert set(np.unique(batch["segment_ids"]).tolist()) <= {0, 1, 2, 3}
    assert loader.sources()[0]["split"] == "train"


def test_grain_source_rows_equal_the_loader_rows(tmp_path: Path) -> None:
    url = tmp_path / "ds"
    rng = np.random.default_rng(5)
    ftj.write_dataset(url, {"train": [rng.integers(0, 99, rng.integers(1, 20)) for _ in range(80)]})
    ft = ftj.open_dataset(url)["train"]
    cfg = ftj.LoaderConfig(batch_size=5, seq_len=24, packing="bins", shuffle=False, num_epochs=1)
    loader = ftj.Loader(ft, cfg, plan_cache=tmp_path / "cache")
    src = FlatTokensSource(url, 24, "bins", plan_cache=tmp_path / "cache")
    assert len(src) == len(loader.components[0])
    again = pickle.loads(pickle.dumps(src))
    for step in range(2):
        batch = loader.host_batch(step)
        rows = again.read_batch(np.arange(step * 5, step * 5 + 5))
        for key in FIELDS:
            np.testing.assert_array_equal(rows[key], batch[key])
    with pytest.raises(ValueError, match="packing must be True"):
        FlatTokensSource(url, 24, "binned")


def test_provenance_lists_each_bins_sequences(tmp_path: Path) -> None:
    seqs = [[1, 2, 3], [4], [5, 6], [7, 8, 9, 10], [11]]
    ft = split_of(seqs)
    cfg = ftj.LoaderConfig(batch_size=3, seq_len=5, packing="bins", shuffle=False)
    loader = ftj.Loader(ft, cfg, plan_cache=tmp_path)
    batch = loader.host_batch(0)
    for row in loader.provenance(0):
        got = batch["targets"][row["row"]][batch["segment_ids"][row["row"]] > 0].tolist()
        assert got == [t for i in row["sequences"] for t in seqs[i]]
        first, last = row["sequences"][0], row["sequences"][-1]
        bounds = [sum(map(len, seqs[:first])), sum(map(len, seqs[: last + 1]))]
        assert row["tokens"] == bounds


bins_jit = jax.jit(bin_fields_jax)


@given(data=split_data(), start=st.integers(0, 5), pad=st.integers(0, 5))
def test_device_decode_equals_the_host_decode(
    data: tuple[list[list[int]], list[list[int]] | None, int], start: int, pad: int
) -> None:
    seqs, masks, seq_len = data
    records = BinRecords(split_of(seqs, masks), seq_len)
    w = records.read(np.arange(len(records)))
    host = bin_fields(
        w.encoded, w.lengths, start_token_id=start, pad_id=pad, stored_mask=w.stored_mask
    )
    device = bins_jit(
        w.encoded, w.lengths, start_token_id=start, pad_id=pad, stored_mask=w.stored_mask
    )
    for key in FIELDS:
        np.testing.assert_array_equal(np.asarray(device[key]), host[key], err_msg=key)


def test_bin_lengths_past_the_row_are_refused() -> None:
    with pytest.raises(ValueError, match=r"lengths must lie in \[0, 2\]"):
        bin_fields(np.zeros((1, 3), np.uint32), np.array([3]))
