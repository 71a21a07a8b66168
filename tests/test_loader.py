import dataclasses
import json
import subprocess
import sys
import threading
import time
import tracemalloc
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
import zarr
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding, PartitionSpec
from memurls import memory_url
from reference import reference_batch

import flat_tokens_jax as ftj
from flat_tokens_jax.grain.grain import FlatTokensSource
from flat_tokens_jax.loader.config import LoaderConfig
from flat_tokens_jax.loader.state import StateMismatch

SPEC = [[1, 2], [3, 4, 5], [6, 7, 8]]


def split_of(seqs: list[list[int]], **storage: int) -> ftj.FlatTokens:
    url = memory_url()
    fmt = (
        ftj.StorageFormat(**storage)
        if storage
        else ftj.StorageFormat(shard_tokens=64, chunk_tokens=8)
    )
    ftj.write_dataset(url, {"train": seqs}, storage_format=fmt)
    return ftj.open_dataset(url)["train"]


def as_lists(batch: dict) -> dict:
    return {k: np.asarray(v).astype(int).tolist() for k, v in batch.items()}


def test_spec_golden_rows() -> None:
    ft = split_of(SPEC)
    b = ftj.Loader(ft, LoaderConfig(batch_size=1, seq_len=8, shuffle=False)).host_batch(0)
    assert b["inputs"].tolist() == [[0, 1, 0, 3, 4, 0, 6, 7]]
    assert b["targets"].tolist() == [[1, 2, 3, 4, 5, 6, 7, 8]]
    b = ftj.Loader(ft, LoaderConfig(batch_size=2, seq_len=4, shuffle=False)).host_batch(0)
    assert b["targets"][1].tolist() == [5, 6, 7, 8]
    assert b["inputs"][1].tolist() == [4, 0, 6, 7]
    assert b["segment_ids"][1].tolist() == [1, 2, 2, 2]
    assert b["positions"][1].tolist() == [0, 0, 1, 2]
    cfg = LoaderConfig(batch_size=3, seq_len=5, packing=False, shuffle=False, pad_id=9)
    b = ftj.Loader(ft, cfg).host_batch(0)
    assert b["targets"][1].tolist() == [3, 4, 5, 9, 9]
    assert b["inputs"][1].tolist() == [0, 3, 4, 9, 9]
    assert b["loss_mask"][1].tolist() == [True, True, True, False, False]
    assert b["segment_ids"][1].tolist() == [1, 1, 1, 0, 0]


def test_field_dtypes_and_shapes() -> None:
    batch = ftj.Loader(split_of(SPEC), LoaderConfig(batch_size=2, seq_len=3)).batch(0)
    for key in ("inputs", "targets", "segment_ids", "positions"):
        assert batch[key].dtype == np.int32 and batch[key].shape == (2, 3)
    assert batch["loss_mask"].dtype == np.bool_


datasets = st.lists(
    st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=15), min_size=1, max_size=25
)


@settings(max_examples=40)
@given(seqs=datasets, data=st.data())
def test_batches_equal_brute_force_reference(seqs: list[list[int]], data: st.DataObject) -> None:
    ft = split_of(seqs)
    assert ft.loss_mask is None
    assert_matches_reference(ft, seqs, None, data)


@settings(max_examples=40)
@given(seqs=datasets, data=st.data())
def test_stored_loss_mask_batches_equal_brute_force_reference(
    seqs: list[list[int]], data: st.DataObject
) -> None:
    masks = [data.draw(st.lists(st.integers(0, 1), min_size=len(s), max_size=len(s))) for s in seqs]
    url = memory_url()
    storage_format = ftj.StorageFormat(shard_tokens=16, chunk_tokens=4)
    ftj.write_dataset(
        url, {"train": seqs}, loss_masks={"train": masks}, storage_format=storage_format
    )
    ft = ftj.open_dataset(url)["train"]
    assert ft.loss_mask is not None
    assert_matches_reference(ft, seqs, masks, data)


def assert_matches_reference(
    ft: ftj.FlatTokens, seqs: list[list[int]], masks: list[list[int]] | None, data: st.DataObject
) -> None:
    packing = data.draw(st.booleans())
    num_tokens = sum(map(len, seqs))
    seq_len = data.draw(st.integers(1, max(1, num_tokens if packing else 20)))
    if packing and num_tokens < seq_len:
        return
    cfg = LoaderConfig(
        batch_size=data.draw(st.integers(1, 9)),
        seq_len=seq_len,
        packing=packing,
        shuffle=data.draw(st.booleans()),
        seed=data.draw(st.integers(0, 2**64 - 1)),
        num_epochs=data.draw(st.sampled_from([None, 1, 2])),
        start_token_id=data.draw(st.integers(0, 5)),
        pad_id=data.draw(st.integers(0, 5)),
        prefetch=0,
    )
    loader = ftj.Loader(ft, cfg)
    last = (loader.num_batches or 50) - 1
    for step in sorted({0, last, data.draw(st.integers(0, last))}):
        expected = reference_batch(
            seqs,
            step,
            cfg.batch_size,
            seq_len,
            packing=packing,
            shuffle=cfg.shuffle,
            seed=cfg.seed,
            num_epochs=cfg.num_epochs,
            start_token_id=cfg.start_token_id,
            pad_id=cfg.pad_id,
            masks=masks,
        )
        assert as_lists(loader.host_batch(step)) == as_lists(expected), step


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
def test_stored_loss_mask_on_disk_and_sequence_sharded(tmp_path: Path, packing: bool) -> None:
    """Memory-mapped local shards, and rows split over devices along the sequence axis."""
    rng = np.random.default_rng(7)
    seqs = [rng.integers(0, 5000, rng.integers(1, 40)).tolist() for _ in range(300)]
    masks = [rng.integers(0, 2, len(s)).tolist() for s in seqs]
    storage_format = ftj.StorageFormat(shard_tokens=256, chunk_tokens=32)
    ftj.write_dataset(
        tmp_path, {"train": seqs}, loss_masks={"train": masks}, storage_format=storage_format
    )
    assert (tmp_path / "train" / "loss_mask" / "zarr.json").is_file()
    ft = ftj.open_dataset(tmp_path)["train"]
    cfg = LoaderConfig(batch_size=8, seq_len=16, packing=packing, seed=2, pad_id=3)
    mesh = jax.make_mesh((2, 4), ("data", "seq"))
    sharding = NamedSharding(mesh, PartitionSpec("data", "seq"))
    sharded = ftj.Loader(ft, cfg, sharding=sharding)
    for step in (0, 3, 11):
        want = reference_batch(seqs, step, 8, 16, packing=packing, seed=2, pad_id=3, masks=masks)
        got = sharded.batch(step)
        assert got["loss_mask"].sharding == sharding
        assert as_lists(got) == as_lists(want), step
        assert not np.asarray(got["loss_mask"]).all()


def test_restart_and_prefetch_never_change_a_batch() -> None:
    rng = np.random.default_rng(1)
    seqs = [rng.integers(0, 1000, rng.integers(1, 50)).tolist() for _ in range(300)]
    ft = split_of(seqs)
    base = LoaderConfig(batch_size=4, seq_len=16, seed=3, prefetch=0)
    straight = [
        as_lists(b) for _, (_, b) in zip(range(30), ftj.Loader(ft, base).iterate(0), strict=False)
    ]
    for k in (0, 1, 7, 29):
        for depth in (1, 3, 8):
            cfg = LoaderConfig(batch_size=4, seq_len=16, seed=3, prefetch=depth)
            it = ftj.Loader(ft, cfg).iterate(k)
            for step, batch in it:
                assert as_lists(batch) == straight[step]
                if step == 29:
                    break
            it.close()


def test_state_restore_and_fingerprint() -> None:
    ft = split_of([[i % 7 + 1] * (i % 5 + 1) for i in range(200)])
    cfg = LoaderConfig(batch_size=2, seq_len=8, seed=5)
    loader = ftj.Loader(ft, cfg)
    for step, _ in loader.iterate(0):
        if step == 4:
            break
    state = loader.state()
    assert state["step"] == 5
    again = ftj.Loader(ft, cfg)
    assert again.restore(state) == 5
    assert next(again.iterate())[0] == 5
    with pytest.raises(StateMismatch, match=r"config.seed: saved 5, now 6"):
        ftj.Loader(ft, LoaderConfig(batch_size=2, seq_len=8, seed=6)).restore(state)
    other = split_of([[i % 7 + 2] * (i % 5 + 1) for i in range(200)])
    with pytest.raises(StateMismatch, match=r"data.sample_digest"):
        ftj.Loader(other, cfg).restore(state)
    shorter = split_of([[i % 7 + 1] * (i % 5 + 1) for i in range(199)])
    with pytest.raises(StateMismatch, match=r"data.num_tokens"):
        ftj.Loader(shorter, cfg).restore(state)
    prefetch_only = LoaderConfig(batch_size=2, seq_len=8, seed=5, prefetch=7)
    assert ftj.Loader(ft, prefetch_only).restore(state) == 5


def test_state_at_a_step_resumes_there() -> None:
    """A step-indexed loop (``loader.batch(step)``) saves ``state(step + 1)``,
    which resumes where ``iterate`` would have, for one config and for phases;
    ``state()`` and ``iterate`` after ``batch`` are as they were."""
    ft = split_of([[i % 7 + 1] * (i % 5 + 1) for i in range(200)])
    cfg = LoaderConfig(batch_size=2, seq_len=8, seed=5)
    for make in (
        lambda: ftj.Loader(ft, cfg),
        lambda: ftj.PhasedLoader([ftj.Phase(0, ft, cfg), ftj.Phase(3, ft, cfg)]),
    ):
        loader = make()
        for step in range(5):
            loader.batch(step)
        state = loader.state(5)
        iterated = make()
        for step, _ in iterated.iterate(0):
            if step == 4:
                break
        assert state == iterated.state() and state["step"] == 5
        assert loader.state()["step"] == 0 and next(loader.iterate())[0] == 0
        again = make()
        assert again.restore(state) == 5
        assert as_lists(again.batch(5)) == as_lists(make().batch(5))
        for bad in (-1, 2.0, True, "5"):
            with pytest.raises(ValueError, match=r"an int >= 0, got .*pass s \+ 1"):
                loader.state(bad)


@pytest.mark.parametrize("bad", ["3", 3.0, True, -1])
def test_a_step_that_is_not_an_int_is_refused_naming_it_and_spoils_nothing(bad: object) -> None:
    """Issue 35: ``host_batch("3")`` raised Python's ``'<' not supported``, and a
    bad ``batch`` step left the read-ahead broken for every later call."""
    ft = split_of([[i % 7 + 1] * (i % 5 + 1) for i in range(50)])
    cfg = LoaderConfig(batch_size=2, seq_len=4, prefetch=2)
    loader = ftj.Loader(ft, cfg)
    calls = {
        "batch": loader.batch,
        "host_batch": loader.host_batch,
        "encoded_batch": loader.encoded_batch,
        "provenance": loader.provenance,
        "host_blocks_at": loader.host_blocks_at,
        "host_rows_at": loader.host_rows_at,
        "samples_before": loader.samples_before,
        "start": loader.start,
        "iterate": lambda step: next(loader.iterate(step)),
    }
    for name, call in calls.items():
        with pytest.raises(ValueError) as e:
            call(bad)
        prefix = {"iterate": "start_", "start": "Loader.start: "}.get(name, "")
        assert str(e.value).startswith(f"{prefix}step must be an int >= 0, got {bad!r}"), name
    assert as_lists(loader.batch(2)) == as_lists(ftj.Loader(ft, cfg).batch(2))
    assert next(loader.iterate(3))[0] == 3


def test_fingerprint_holds_what_changes_batches_only() -> None:
    ft = split_of([[i % 7 + 1] * (i % 5 + 1) for i in range(50)])
    cfg = LoaderConfig(batch_size=2, seq_len=4)
    fp = ftj.Loader(ft, cfg).fingerprint()
    assert "vocab_size" not in fp["config"] and "prefetch" not in fp["config"]
    state = ftj.Loader(ft, cfg).state(3)
    checked = LoaderConfig(batch_size=2, seq_len=4, vocab_size=64)
    assert ftj.Loader(ft, checked).restore(state) == 3  # vocab_size changes no batch
    assert fp["data"]["loss_mask"] is False
    seqs = [[i % 7 + 1] * (i % 5 + 1) for i in range(50)]
    url = memory_url()
    ftj.write_dataset(url, {"train": seqs}, loss_masks={"train": [[1] * len(q) for q in seqs]})
    masked = ftj.open_dataset(url)["train"]
    assert ftj.Loader(masked, cfg).fingerprint()["data"]["loss_mask"] is True
    with pytest.raises(StateMismatch, match=r"data\.loss_mask: saved False, now True"):
        ftj.Loader(masked, cfg).restore(state)


def test_state_says_where_the_data_is() -> None:
    ft = split_of(SPEC)
    train, valid = ft.split([2, 1])
    mix = ftj.Mixture({"a": (train, 1), "b": (valid, 1)})
    state = ftj.Loader(mix, LoaderConfig(batch_size=2, seq_len=1)).state()
    assert state["sources"] == [
        {"name": "a", "url": ft.url, "split": "train", "sequences": [0, 2]},
        {"name": "b", "url": ft.url, "split": "train", "sequences": [2, 3]},
    ]


def test_bad_values_are_refused_not_coerced() -> None:
    ft = split_of(SPEC)
    for field, value in (("packing", "no"), ("shuffle", None), ("packing", 1)):
        with pytest.raises(ValueError, match=f"LoaderConfig.{field} must be True"):
            LoaderConfig(batch_size=1, seq_len=2, **{field: value})
    loader = ftj.Loader(ft, LoaderConfig(batch_size=1, seq_len=2))
    with pytest.raises(StateMismatch, match=r"step must be an int in \[0, 2\*\*63 - 1\], got True"):
        loader.restore({**loader.state(), "step": True})
    with pytest.raises(TypeError, match=r"restore takes the mapping that loader\.state"):
        loader.restore(None)  # type: ignore[arg-type]
    with pytest.raises(
        TypeError, match=r"expected a FlatTokens split \(ds\['train'\]\) or Records, got NoneType"
    ):
        ftj.Loader(None, LoaderConfig(batch_size=1, seq_len=2))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="config must be a LoaderConfig"):
        ftj.Loader(ft, {"batch_size": 1, "seq_len": 2})  # type: ignore[arg-type]


def test_common_mistakes_name_the_fix() -> None:
    url = memory_url()
    ftj.write_dataset(url, {"train": SPEC})
    ds = ftj.open_dataset(url)
    cfg = LoaderConfig(batch_size=8, seq_len=2)
    with pytest.raises(TypeError, match=r"pick a split: ds\['train'\]"):
        ftj.Loader(ds, cfg)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"ftj.open_dataset\('memory://"):
        ftj.Loader(url, cfg)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"wrap it: NamedSharding\(mesh, P\(...\)\)"):
        ftj.Loader(ds["train"], cfg, sharding=PartitionSpec("data"))  # type: ignore[arg-type]
    records = ftj.PaddedRecords(ds["train"], 4)
    with pytest.raises(
        ValueError,
        match=r"^the source is PaddedRecords\(.*\) with seq_len 4 and packing False, but "
        r"seq_len 2 and packing True were asked for: pass the FlatTokens split and let the "
        r"LoaderConfig make its records$",
    ):
        ftj.Loader(records, cfg)


@pytest.mark.parametrize(
    ("written", "member"),
    [(True, ftj.Packing.WINDOWS), (False, ftj.Packing.PADDED), ("bins", ftj.Packing.BINS)],
)
def test_packing_is_held_as_its_type_and_saved_as_written(
    written: bool | str, member: ftj.Packing, tmp_path: Path
) -> None:
    """Each way of saying a packing gives one config, holding its Packing; the
    fingerprint holds the value as written (its JSON type too); a Packing has
    no truth value to test by mistake."""
    cfg = LoaderConfig(batch_size=2, seq_len=8, packing=written)
    assert cfg.packing is member
    assert cfg == LoaderConfig(batch_size=2, seq_len=8, packing=written)
    assert cfg == LoaderConfig(batch_size=2, seq_len=8, packing=member)
    assert hash(cfg) == hash(LoaderConfig(batch_size=2, seq_len=8, packing=member))
    assert dataclasses.replace(cfg, seed=1).packing is member
    assert LoaderConfig.from_dict({"batch_size": 2, "seq_len": 8, "packing": written}) == cfg
    yaml_word = {True: "true", False: "false", "bins": "bins"}[written]
    path = tmp_path / "loader.yaml"
    path.write_text(f"loader:\n  batch_size: 2\n  seq_len: 8\n  packing: {yaml_word}\n")
    assert LoaderConfig.from_yaml(path) == cfg
    saved = cfg.batch_defining()["packing"]
    assert saved == written and type(saved) is type(written)
    assert f'"packing": {json.dumps(written)}' in json.dumps(cfg.batch_defining())
    with pytest.raises(TypeError, match="no truth value: compare it with a Packing member"):
        bool(member)
    assert LoaderConfig(batch_size=2, seq_len=8).packing is ftj.Packing.WINDOWS


def test_records_of_ones_own_must_say_their_packing_as_a_packing() -> None:
    """A ``packing = True`` on records of one's own, written as in a config,
    is refused naming the members, where the records are given."""

    class Written:
        seq_len, packing = 2, True

        def __init__(self) -> None:
            self.inner = ftj.PackedRecords(split_of(SPEC), 2)

        def __len__(self) -> int:
            return len(self.inner)

        def read(self, indices: np.ndarray, columns: tuple[int, int] | None = None) -> Any:
            return self.inner.read(indices, columns)

        def token_ranges(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            return self.inner.token_ranges(indices)

        def fingerprint(self) -> dict[str, Any]:
            return self.inner.fingerprint()

    words = r"Written.packing is True; records say how they decode with a flat_tokens_jax.Packing"
    cfg = LoaderConfig(batch_size=2, seq_len=2)
    with pytest.raises(TypeError, match=rf"^the Loader's source: {words}"):
        ftj.Loader(Written(), cfg)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=rf"^component 'w': {words}"):
        ftj.Mixture({"w": (Written(), 1)})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match=rf"^the source: {words}"):
        FlatTokensSource(Written(), 2)  # type: ignore[arg-type]
    mine = Written()
    mine.packing = ftj.Packing.WINDOWS  # type: ignore[assignment]
    assert as_lists(ftj.Loader(mine, cfg).host_batch(0)) == as_lists(
        ftj.Loader(mine.inner, cfg).host_batch(0)
    )


# Loader.state() of GOLDEN_SEQS (written in the default storage format) under
# LoaderConfig(batch_size=2, seq_len=8, seed=3, packing=...), saved at step 3 when
# packing was a bool or "bins" inside too: the states this version reads and writes.
GOLDEN_SEQS = [[i % 7 + 1] * (i % 5 + 1) for i in range(60)]
GOLDEN_DATA = (
    '"num_tokens": 180, "num_sequences": 60, "max_token_id": 7, "loss_mask": false, '
    '"sample_digest": "63035f0af0e32763", "tokenizer": null, '
    '"content": "11a0483f6ab75781a024adcf348c50f8"'
)
GOLDEN_PLAN = (
    '"plan": {"algorithm": "best-fit-decreasing/blocks-of-262144", "digest": "b02fb1be2cb58ea2"}, '
)
GOLDEN_STATES = {
    True: '{"step": 3, "samples": 6, "fingerprint": {"data": {"records": "packed", '
    '"seq_len": 8, ' + GOLDEN_DATA + '}, "config": {"seq_len": 8, "packing": true, '
    '"shuffle": true, "seed": 3, "num_epochs": null, "start_token_id": 0, "pad_id": 0}, '
    '"batch_size": 2}, "sources": [{"name": "0", "url": "URL", "split": "train", '
    '"sequences": [0, 60]}]}',
    False: '{"step": 3, "samples": 6, "fingerprint": {"data": {"records": "padded", '
    '"seq_len": 8, ' + GOLDEN_DATA + '}, "config": {"seq_len": 8, "packing": false, '
    '"shuffle": true, "seed": 3, "num_epochs": null, "start_token_id": 0, "pad_id": 0}, '
    '"batch_size": 2}, "sources": [{"name": "0", "url": "URL", "split": "train", '
    '"sequences": [0, 60]}]}',
    "bins": '{"step": 3, "samples": 6, "fingerprint": {"data": {"records": "bins", '
    '"seq_len": 8, ' + GOLDEN_PLAN + GOLDEN_DATA + '}, "config": {"seq_len": 8, '
    '"packing": "bins", "shuffle": true, "seed": 3, "num_epochs": null, '
    '"start_token_id": 0, "pad_id": 0}, "batch_size": 2}, "sources": [{"name": "0", '
    '"url": "URL", "split": "train", "sequences": [0, 60]}]}',
}


@pytest.mark.parametrize("packing", [True, False, "bins"], ids=["packed", "padded", "bins"])
def test_saved_state_golden(packing: bool | str, tmp_path: Path) -> None:
    """A state saved as this version saves it restores, and the state saved
    now is the same text, key for key."""
    url = memory_url()
    ftj.write_dataset(url, {"train": GOLDEN_SEQS})
    cfg = LoaderConfig(batch_size=2, seq_len=8, seed=3, packing=packing)
    loader = ftj.Loader(ftj.open_dataset(url)["train"], cfg, plan_cache=tmp_path)
    golden = GOLDEN_STATES[packing].replace('"URL"', json.dumps(url))
    assert loader.restore(json.loads(golden)) == 3
    assert json.dumps(loader.state(3)) == golden


@pytest.mark.parametrize("batch_size", [1, 4, 3])
def test_a_step_past_the_int64_samples_is_refused(batch_size: int) -> None:
    loader = ftj.Loader(split_of(SPEC), LoaderConfig(batch_size=batch_size, seq_len=1))
    last = (2**63) // batch_size - 1  # its samples end exactly at 2**63 - 1 or below
    rows = loader.provenance(last)
    assert rows[-1]["sample"] == last * batch_size + batch_size - 1 <= 2**63 - 1
    for step in (last + 1, last + 2**20, 4611686018427387904, 10**19):
        if step <= last:
            continue
        with pytest.raises(ValueError, match=f"the last step is {last}"):
            loader.host_batch(step)


def test_epoch_covers_every_record_once_and_epochs_differ() -> None:
    seqs = [[i + 1] for i in range(103)]
    ft = split_of(seqs)
    loader = ftj.Loader(ft, LoaderConfig(batch_size=103, seq_len=1, seed=11))
    first = loader.host_batch(0)["targets"][:, 0]
    second = loader.host_batch(1)["targets"][:, 0]
    assert sorted(first.tolist()) == sorted(second.tolist()) == list(range(1, 104))
    assert first.tolist() != second.tolist()
    assert first.tolist() != sorted(first.tolist())


def test_validation_pass_pads_the_last_batch() -> None:
    seqs = [[i + 1, i + 2] for i in range(10)]
    cfg = LoaderConfig(
        batch_size=4, seq_len=3, packing=False, shuffle=False, num_epochs=1, pad_id=0
    )
    loader = ftj.Loader(split_of(seqs), cfg)
    assert loader.num_batches == 3
    batches = [b for _, b in loader.iterate(0)]
    assert len(batches) == 3
    targets = np.concatenate([np.asarray(b["targets"]) for b in batches])
    mask = np.concatenate([np.asarray(b["loss_mask"]) for b in batches])
    assert targets[:10, 0].tolist() == [i + 1 for i in range(10)]
    assert not mask[10:].any() and mask[:10, :2].all()
    with pytest.raises(IndexError, match="step 3 is past the end: this run has 3 steps"):
        loader.batch(3)


def test_config_errors_name_the_field(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"LoaderConfig\.batch_size must be an int >= 1, got 0"):
        LoaderConfig(batch_size=0, seq_len=4)
    with pytest.raises(ValueError, match=r"LoaderConfig has unknown field 'seqlen' \(did you"):
        LoaderConfig.from_dict({"batch_size": 1, "seq_len": 2, "seqlen": 3})
    with pytest.raises(ValueError, match="pad_id 40 is outside the vocabulary"):
        LoaderConfig(batch_size=1, seq_len=2, vocab_size=32, pad_id=40)
    ft = split_of(SPEC)
    with pytest.raises(
        ValueError, match="max_token_id is 8 but vocab_size is 8: set vocab_size >= 9"
    ):
        ftj.Loader(ft, LoaderConfig(batch_size=1, seq_len=2, vocab_size=8))
    with pytest.raises(ValueError, match="has no records"):
        ftj.Loader(ft, LoaderConfig(batch_size=1, seq_len=9))


def test_config_from_yaml(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("loader:\n  batch_size: 8  # rows\n  seq_len: 128\n  packing: false\n")
    assert LoaderConfig.from_yaml(path) == LoaderConfig(batch_size=8, seq_len=128, packing=False)
    repo_config = Path(__file__).parent.parent / "configs" / "loader.yaml"
    assert LoaderConfig.from_yaml(repo_config).seq_len > 0


def test_provenance_names_records_and_token_ranges() -> None:
    ft = split_of(SPEC)
    loader = ftj.Loader(ft, LoaderConfig(batch_size=2, seq_len=4, shuffle=False))
    prov = loader.provenance(0)
    assert prov == [
        {"row": 0, "sample": 0, "epoch": 0, "record": 0, "tokens": [0, 4]},
        {"row": 1, "sample": 1, "epoch": 0, "record": 1, "tokens": [4, 8]},
    ]
    padded = ftj.Loader(
        ft, LoaderConfig(batch_size=2, seq_len=2, packing=False, shuffle=False, num_epochs=1)
    )
    assert padded.provenance(1) == [
        {"row": 0, "sample": 2, "epoch": 0, "record": 2, "tokens": [5, 7]},
        {"row": 1, "padding": True},
    ]


def test_any_step_is_cheap_on_a_huge_sparse_array(tmp_path: Path) -> None:
    """10^12 tokens declared but never written: batch(step) costs the same at any step."""
    n = 10**12
    group = zarr.open_group(str(tmp_path), mode="w")
    for split in ("train", "validation"):
        sub = group.create_group(split)
        sub.attrs["max_token_id"] = 0
        sub.create_array(
            "encoded_tokens", shape=(n,), dtype="uint32", chunks=(1 << 16,), fill_value=0
        )
        starts = sub.create_array("seq_starts", shape=(2,), dtype="uint64", chunks=(2,))
        starts[:] = [0, n]
    ft = ftj.open_dataset(tmp_path)["train"]
    loader = ftj.Loader(ft, LoaderConfig(batch_size=16, seq_len=2048, seed=1))

    def measure(step: int) -> tuple[float, int]:
        tracemalloc.start()
        began = time.perf_counter()
        batch = loader.host_batch(step)
        took = time.perf_counter() - began
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert batch["targets"].shape == (16, 2048)
        return took, peak

    measure(0)
    t0, m0 = min(measure(0) for _ in range(3))
    far = 10**12 // 16
    t1, m1 = min(measure(far) for _ in range(3))
    assert t1 < 10 * t0 + 0.05, (t0, t1)
    assert m1 < 2 * m0 + (1 << 20), (m0, m1)
    assert loader.provenance(far)[0]["epoch"] == far * 16 // len(loader.records)


def test_iterate_runs_prefetch_in_background_threads() -> None:
    ft = split_of([[1, 2, 3]] * 50)
    loader = ftj.Loader(ft, LoaderConfig(batch_size=2, seq_len=4, prefetch=2))
    before = set(threading.enumerate())  # other loaders' threads, left for the collector
    it = loader.iterate(0)
    next(it)
    names = {t.name for t in set(threading.enumerate()) - before}
    assert any(n.startswith("ftj-prefetch") for n in names)
    it.close()
    time.sleep(0.1)
    left = set(threading.enumerate()) - before
    assert not any(t.name.startswith("ftj-prefetch") for t in left)


def split_with(info: ftj.DatasetInfo | None, seqs: list[list[int]] = SPEC) -> ftj.FlatTokens:
    url = memory_url()
    ftj.write_dataset(url, {"train": seqs}, info=info)
    return ftj.open_dataset(url)["train"]


def test_an_unset_start_token_id_is_the_one_the_data_records() -> None:
    recorded = split_with(ftj.DatasetInfo(start_token_id=7))
    plain = split_with(None)
    unset = LoaderConfig(batch_size=1, seq_len=8, shuffle=False)
    loader = ftj.Loader(recorded, unset)
    assert loader.host_batch(0)["inputs"].tolist() == [[7, 1, 7, 3, 4, 7, 6, 7]]
    assert loader.fingerprint()["config"]["start_token_id"] == 7
    said = LoaderConfig(batch_size=1, seq_len=8, shuffle=False, start_token_id=0)
    assert ftj.Loader(recorded, said).host_batch(0)["inputs"].tolist() == [[0, 1, 0, 3, 4, 0, 6, 7]]
    assert ftj.Loader(plain, unset).host_batch(0)["inputs"][0, 0] == 0
    assert ftj.Loader(plain, unset).fingerprint()["config"]["start_token_id"] == 0
    # A state saved with the resolved id restores under the explicit one, and not under another.
    state = loader.state(1)
    explicit = LoaderConfig(batch_size=1, seq_len=8, shuffle=False, start_token_id=7)
    assert ftj.Loader(recorded, explicit).restore(state) == 1
    with pytest.raises(StateMismatch, match=r"config\.start_token_id: saved 7, now 0"):
        ftj.Loader(recorded, said).restore(state)
    mix = ftj.Mixture({"a": (recorded, 1), "b": (plain, 1)})
    assert ftj.Loader(mix, LoaderConfig(batch_size=2, seq_len=2)).start_token_id == 7
    other = split_with(ftj.DatasetInfo(start_token_id=9))
    both = ftj.Mixture({"a": (recorded, 1), "b": (other, 1)})
    with pytest.raises(ValueError, match=r"different start_token_id values \('a': 7, 'b': 9\)"):
        ftj.Loader(both, LoaderConfig(batch_size=2, seq_len=2))
    assert (
        ftj.Loader(both, LoaderConfig(batch_size=2, seq_len=2, start_token_id=3)).start_token_id
        == 3
    )


def test_vocab_size_covers_the_recorded_tokenizer() -> None:
    tok = ftj.TokenizerInfo("tok.json", "sha256:0123456789abcdef", 500)
    ft = split_with(ftj.DatasetInfo(tokenizer=tok))
    with pytest.raises(
        ValueError, match=r"tokenized with tok.json \(500 ids\) but vocab_size is 100"
    ):
        ftj.Loader(ft, LoaderConfig(batch_size=1, seq_len=2, vocab_size=100))
    ftj.Loader(ft, LoaderConfig(batch_size=1, seq_len=2, vocab_size=512))


def test_loader_vocab_size_is_the_size_every_recorded_tokenizer_gives() -> None:
    """Issue 49: ``Loader.vocab_size`` (a PhasedLoader's over every phase, and on the
    dataset ``to_grain()`` returns) from the tokenizers the data records."""

    def recorded(name: str, hashed: str, size: int) -> ftj.FlatTokens:
        return split_with(ftj.DatasetInfo(tokenizer=ftj.TokenizerInfo(name, hashed, size)))

    gpt2, copy = recorded("gpt2", "sha256:aaaa", 50), recorded("copy", "sha256:aaaa", 50)
    llama, plain = recorded("llama", "sha256:bbbb", 30), split_with(None)
    cfg = LoaderConfig(batch_size=2, seq_len=2)
    for source, size in [
        (gpt2, 50),
        (plain, None),
        (ftj.Mixture({"web": (gpt2, 1), "old": (plain, 1), "same": (copy, 1)}), 50),
        (ftj.Mixture({"old": (plain, 1), "none": (split_with(ftj.DatasetInfo()), 1)}), None),
    ]:
        loader = ftj.Loader(source, cfg)
        assert (loader.vocab_size, loader.to_grain().vocab_size) == (size, size)
    run = ftj.PhasedLoader([ftj.Phase(0, plain, cfg), ftj.Phase(3, copy, cfg)])
    assert (run.vocab_size, run.to_grain().vocab_size) == (50, 50)
    both = ftj.Mixture({"web": (gpt2, 1), "code": (llama, 1)}, allow_mixed_tokenizers=True)
    named = r"'web' was tokenized with gpt2 \(50 ids\) but 'code' with llama \(30 ids\)"
    for loader in (ftj.Loader(both, cfg), ftj.PhasedLoader([ftj.Phase(0, both, cfg)])):
        with pytest.raises(ValueError, match=named):
            loader.vocab_size  # noqa: B018
        with pytest.raises(ValueError, match=named):
            loader.to_grain().vocab_size  # noqa: B018
    phases = ftj.PhasedLoader([ftj.Phase(0, gpt2, cfg), ftj.Phase(3, llama, cfg)])
    with pytest.raises(
        ValueError,
        match=r"phase 0 '0' was tokenized with gpt2 \(50 ids\) but phase 1 '0' with llama",
    ):
        phases.vocab_size  # noqa: B018


def test_a_process_that_exits_with_an_iterate_left_open_prints_nothing(tmp_path: Path) -> None:
    """A trainer that stops mid-run (its loop broken, the generator kept) exits
    quietly: the read-ahead threads end with the process, no traceback."""
    code = (
        "import sys, numpy as np, flat_tokens_jax as ftj\n"
        "ftj.write_dataset(sys.argv[1], {'train': [np.arange(1, 90)] * 40})\n"
        "loader = ftj.Loader(ftj.open_dataset(sys.argv[1])['train'], ftj.LoaderConfig(4, 16))\n"
        "it = loader.iterate()\n"
        "next(it); next(it)\n"
        "print('trained', loader.stats()['steps'])\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "d")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0 and r.stdout == "trained 2\n", r.stderr
    assert r.stderr == "", r.stderr
