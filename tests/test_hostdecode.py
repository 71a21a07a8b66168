"""Every way a batch is made equals the brute-force reference: host decode in row
blocks on threads, ``batch`` with read-ahead, and decoding on the devices."""

import dataclasses
from typing import Any

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from memurls import memory_url
from reference import reference_batch

import flat_tokens_jax as ftj
from flat_tokens_jax.core.buffers import Buffers
from flat_tokens_jax.data.records import Windows
from flat_tokens_jax.decoding.batch import FIELDS, empty_fields, window_fields
from flat_tokens_jax.decoding.hostdecode import BlockDecoder, request_parts

datasets = st.lists(
    st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=15), min_size=1, max_size=25
)


def as_lists(batch: dict) -> dict:
    return {k: np.asarray(v).astype(int).tolist() for k, v in batch.items()}


def split_of(seqs: list[list[int]], masks: list[list[int]] | None) -> ftj.FlatTokens:
    url = memory_url()
    storage_format = ftj.StorageFormat(shard_tokens=16, chunk_tokens=4)
    ftj.write_dataset(
        url,
        {"train": seqs},
        loss_masks=None if masks is None else {"train": masks},
        storage_format=storage_format,
    )
    return ftj.open_dataset(url)["train"]


def draw_case(
    seqs: list[list[int]], data: st.DataObject
) -> tuple[ftj.FlatTokens, list[list[int]] | None, ftj.LoaderConfig] | None:
    masks = None
    if data.draw(st.booleans()):
        masks = [
            data.draw(st.lists(st.integers(0, 1), min_size=len(s), max_size=len(s))) for s in seqs
        ]
    packing = data.draw(st.booleans())
    num_tokens = sum(map(len, seqs))
    seq_len = data.draw(st.integers(1, max(1, num_tokens if packing else 20)))
    if packing and num_tokens < seq_len:
        return None
    cfg = ftj.LoaderConfig(
        batch_size=data.draw(st.integers(1, 40)),
        seq_len=seq_len,
        packing=packing,
        shuffle=data.draw(st.booleans()),
        seed=data.draw(st.integers(0, 2**64 - 1)),
        num_epochs=data.draw(st.sampled_from([None, 1, 2])),
        start_token_id=data.draw(st.integers(0, 5)),
        pad_id=data.draw(st.integers(0, 5)),
        prefetch=data.draw(st.integers(0, 3)),
    )
    return split_of(seqs, masks), masks, cfg


def expected(seqs: list[list[int]], masks: list[list[int]] | None, cfg, step: int) -> dict:
    return reference_batch(
        seqs,
        step,
        cfg.batch_size,
        cfg.seq_len,
        packing=cfg.packing.value,
        shuffle=cfg.shuffle,
        seed=cfg.seed,
        num_epochs=cfg.num_epochs,
        start_token_id=cfg.start_token_id or 0,
        pad_id=cfg.pad_id,
        masks=masks,
    )


@settings(max_examples=40, deadline=None)
@given(seqs=datasets, data=st.data())
def test_row_blocks_on_threads_equal_reference(seqs: list[list[int]], data: st.DataObject) -> None:
    case = draw_case(seqs, data)
    if case is None:
        return
    ft, masks, cfg = case
    loader = ftj.Loader(ft, cfg)
    threads = data.draw(st.integers(1, 5))
    kernel = data.draw(st.sampled_from(["numba", "numpy"]))
    loader.engine.block_decoder = BlockDecoder(
        threads, min_block_rows=data.draw(st.integers(1, 4)), kernel=kernel
    )
    last = (loader.num_batches or 30) - 1
    steps = sorted({0, last, data.draw(st.integers(0, last))})
    for step in steps:
        assert as_lists(loader.host_batch(step)) == as_lists(expected(seqs, masks, cfg, step))
    # batch() with consecutive steps reads ahead: the same batches.
    for step in range(min(last + 1, 4)):
        assert as_lists(loader.batch(step)) == as_lists(expected(seqs, masks, cfg, step))


@settings(max_examples=15, deadline=None)
@given(seqs=datasets, data=st.data())
def test_device_decode_equals_reference(seqs: list[list[int]], data: st.DataObject) -> None:
    case = draw_case(seqs, data)
    if case is None:
        return
    ft, masks, cfg = case
    loader = ftj.Loader(ft, dataclasses.replace(cfg, decode="device"))
    last = (loader.num_batches or 30) - 1
    step = data.draw(st.integers(0, last))
    want = as_lists(expected(seqs, masks, cfg, step))
    got = loader.batch(step)
    assert {k: v.dtype for k, v in got.items()} == {
        **{k: np.dtype(np.int32) for k in FIELDS[:4]},
        "loss_mask": np.dtype(bool),
    }
    assert as_lists(got) == want
    encoded = loader.encoded_batch(step)
    assert ("stored_mask" in encoded) == (masks is not None)
    assert as_lists(jax.jit(loader.decoder(step))(encoded)) == want


def test_blocks_cover_the_rows_in_order() -> None:
    decoder = BlockDecoder(3, min_block_rows=4)
    assert decoder.blocks(256) == [(0, 85), (85, 170), (170, 256)]
    assert decoder.blocks(9) == [(0, 4), (4, 9)]
    assert decoder.blocks(3) == [(0, 3)]
    with pytest.raises(ValueError, match="threads must be an int >= 1, got 0"):
        BlockDecoder(0)


@pytest.mark.parametrize("threads", [0, True, 2.0, "2", None])
def test_threads_must_be_a_positive_int(threads: object) -> None:
    with pytest.raises(ValueError, match=r"^BlockDecoder\.threads must be an int >= 1, got "):
        BlockDecoder(threads)  # type: ignore[arg-type]
    assert BlockDecoder(np.int64(2)).threads == 2


def test_fields_are_aligned_so_jax_uses_them_in_place() -> None:
    out = empty_fields(8, 4096)
    offsets = {v.ctypes.data % 4096 for v in out.values()}
    assert all(v.ctypes.data % 64 == 0 for v in out.values())
    assert len(offsets) == 5
    if jax.default_backend() == "cpu":
        for value in out.values():
            assert jax.device_put(value).unsafe_buffer_pointer() == value.ctypes.data


def test_out_arrays_are_checked() -> None:
    windows = Windows(np.zeros((2, 5), np.uint32))
    bad = {k: np.zeros((2, 4), np.int32) for k in FIELDS}
    want = r"out\['loss_mask'\] must be a C-contiguous \[2, 4\] bool"
    with pytest.raises(ValueError, match=want):
        window_fields(windows, ftj.Packing.WINDOWS, out=bad)


def in_flight(loader: ftj.Loader) -> list[int]:
    """The steps the loader has in flight (topped up when a step is handed out,
    in the caller's thread)."""
    return loader.prefetcher.steps()


def test_batch_reads_ahead_only_after_consecutive_steps() -> None:
    rng = np.random.default_rng(3)
    seqs = [rng.integers(0, 100, rng.integers(1, 30)).tolist() for _ in range(200)]
    ft = split_of(seqs, None)
    cfg = ftj.LoaderConfig(batch_size=4, seq_len=8, seed=1, prefetch=2)
    loader = ftj.Loader(ft, cfg)
    loader.batch(10)
    assert not in_flight(loader)
    loader.batch(11)
    assert in_flight(loader) == [12, 13]
    assert as_lists(loader.batch(12)) == as_lists(expected(seqs, None, cfg, 12))
    assert in_flight(loader) == [13, 14]
    loader.batch(3)  # a jump drops what was read ahead
    assert not in_flight(loader)


def test_device_decode_needs_a_named_sharding() -> None:
    ft = split_of([[1, 2, 3, 4, 5, 6, 7, 8, 9]], None)
    single = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    cfg = ftj.LoaderConfig(batch_size=2, seq_len=2, decode="device")
    with pytest.raises(ValueError, match="decoding on the devices needs a NamedSharding"):
        ftj.Loader(ft, cfg, sharding=single)
    with pytest.raises(ValueError, match=r"LoaderConfig\.decode must be 'host' or 'device'"):
        ftj.LoaderConfig(batch_size=2, seq_len=2, decode="gpu")


def test_buffers_are_reused_only_when_nothing_holds_them() -> None:
    buffers = Buffers(keep=2)
    first = empty_fields(4, 8, buffers)
    address = first["inputs"].ctypes.data
    second = empty_fields(4, 8, buffers)  # `first` is alive: a new buffer
    assert second["inputs"].ctypes.data != address
    targets = first["targets"]
    del first
    third = empty_fields(4, 8, buffers)  # one field of `first` still holds its buffer
    reused = third["inputs"].ctypes.data
    assert reused not in (address, second["inputs"].ctypes.data)
    del targets, third
    assert empty_fields(4, 8, buffers)["inputs"].ctypes.data == reused
    assert len(buffers._buffers) == 2  # keeps at most `keep`


def test_read_ahead_stops_at_the_last_step() -> None:
    ft = split_of([[i % 5 + 1] * 7 for i in range(20)], None)
    cfg = ftj.LoaderConfig(batch_size=4, seq_len=8, num_epochs=1, prefetch=3)
    loader = ftj.Loader(ft, cfg)
    last = loader.num_batches - 1
    loader.batch(last - 2)
    loader.batch(last - 1)
    assert in_flight(loader) == [last]
    loader.batch(last)
    assert not in_flight(loader)


@settings(max_examples=30, deadline=None)
@given(seqs=datasets, data=st.data())
def test_consecutive_steps_equal_reference(seqs: list[list[int]], data: st.DataObject) -> None:
    """Steps asked for in order take their records from one sampler call for
    several steps (kept for the next ones): the batches are the reference's,
    through the end of the run and its padding rows."""
    case = draw_case(seqs, data)
    if case is None:
        return
    ft, masks, cfg = case
    loader = ftj.Loader(ft, dataclasses.replace(cfg, prefetch=0))
    last = (loader.num_batches or 30) - 1
    first = data.draw(st.integers(0, last))
    for step in range(first, min(last, first + 12) + 1):
        assert as_lists(loader.host_batch(step)) == as_lists(expected(seqs, masks, cfg, step))
    stop = min(last, first + 10) + 1
    ahead = ftj.Loader(ft, dataclasses.replace(cfg, prefetch=data.draw(st.integers(1, 3))))
    for (step, got), want in zip(ahead.iterate(first), range(first, stop), strict=False):
        assert step == want
        assert as_lists(got) == as_lists(expected(seqs, masks, cfg, step))


def test_consecutive_steps_of_a_scheduled_mixture_equal_fresh_loaders() -> None:
    """A mixture whose batch size changes: steps read in order (one sampler call
    for several steps, across the size change) equal each step read by a loader
    that has read nothing before."""
    rng = np.random.default_rng(5)
    parts = [
        split_of([rng.integers(0, 50, rng.integers(1, 20)).tolist() for _ in range(n)], None)
        for n in (40, 90)
    ]
    mix = ftj.Mixture({"a": (parts[0], 0.3), "b": (parts[1], 0.7)})
    cfg = ftj.LoaderConfig(batch_size=[(0, 4), (5, 8)], seq_len=6, seed=2, prefetch=0)
    loader = ftj.Loader(mix, cfg)
    calls = []
    lookup = loader.steps.lookup
    loader.steps.lookup = lambda g: calls.append(g.size) or lookup(g)  # type: ignore[method-assign]
    for step in range(0, 14):
        fresh = ftj.Loader(mix, cfg).host_batch(step)
        assert as_lists(loader.host_batch(step)) == as_lists(fresh), step
    assert len(calls) < 14 and max(calls) > 8  # several steps' samples in one call


class Noted:
    """Packed records that note when their reads start and when they are waited for."""

    def __init__(self, ft: ftj.FlatTokens, name: str, notes: list[str]) -> None:
        self.inner, self.name, self.notes = ftj.PackedRecords(ft, 4), name, notes
        self.seq_len, self.packing = 4, ftj.Packing.WINDOWS

    def __len__(self) -> int:
        return len(self.inner)

    def read(self, indices: np.ndarray, columns: tuple[int, int] | None = None) -> Windows:
        return self.request(indices, columns)()

    def request(self, indices: np.ndarray, columns: tuple[int, int] | None = None) -> Any:
        self.notes.append(f"request {self.name}")
        waiting = self.inner.request(indices, columns)

        def windows() -> Windows:
            self.notes.append(f"wait {self.name}")
            return waiting()

        return windows


def test_a_step_of_several_components_starts_every_read_before_waiting_for_one() -> None:
    url = memory_url()
    ftj.write_dataset(url, {"train": [list(range(1, 40))] * 3})
    ft = ftj.open_dataset(url)["train"]
    notes: list[str] = []
    components = [Noted(ft, "a", notes), Noted(ft, "b", notes)]
    comp = np.array([1, 0, 1], np.int64)
    records = np.array([2, 5, 7], np.int64)
    real = np.array([True, True, False, True])
    waiting = request_parts(components, comp, records, real)
    assert notes == ["request a", "request b"]
    parts = waiting()
    assert notes == ["request a", "request b", "wait a", "wait b"]
    got = {c: (rows.tolist(), w.encoded.tolist()) for c, rows, w in parts}
    direct = ftj.PackedRecords(ft, 4)
    assert got == {
        0: ([1], direct.read(np.array([5])).encoded.tolist()),
        1: ([0, 3], direct.read(np.array([2, 7])).encoded.tolist()),
    }
