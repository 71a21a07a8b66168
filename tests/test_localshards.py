import json
from pathlib import Path

import numpy as np
import pytest
import tensorstore as ts
from hypothesis import given, settings
from hypothesis import strategies as st

import flat_tokens_jax as ftj
from flat_tokens_jax.store.arrays import TensorStoreArray
from flat_tokens_jax.store.localshards import plain_shard_geometry
from flat_tokens_jax.store.options import StoreError


def tokens_array(path: Path) -> TensorStoreArray:
    reader = ftj.open_dataset(path)["train"].encoded
    assert isinstance(reader, TensorStoreArray)
    return reader


@settings(max_examples=25)
@given(
    n=st.integers(1, 300),
    chunk=st.sampled_from([2, 4, 8]),
    per_shard=st.integers(1, 4),
    checksum=st.booleans(),
    data=st.data(),
)
def test_memory_mapped_reads_equal_tensorstore_reads(
    tmp_path_factory: pytest.TempPathFactory,
    n: int,
    chunk: int,
    per_shard: int,
    checksum: bool,
    data: st.DataObject,
) -> None:
    path = tmp_path_factory.mktemp("ds")
    values = data.draw(st.lists(st.integers(0, 2**31 - 1), min_size=n, max_size=n))
    ftj.write_dataset(
        path,
        {"train": [values]},
        storage_format=ftj.StorageFormat(
            shard_tokens=chunk * per_shard, chunk_tokens=chunk, checksum=checksum
        ),
    )
    reader = tokens_array(path)
    assert reader.local is not None
    lo = np.array(data.draw(st.lists(st.integers(0, n), min_size=1, max_size=20)))
    hi = np.minimum(
        lo + np.array(data.draw(st.lists(st.integers(0, n), min_size=lo.size, max_size=lo.size))), n
    )
    lo, hi = np.append(lo, n), np.append(hi, n)  # an empty read at the end, too
    expected = [reader.store[a:b].read().result() for a, b in zip(lo, hi, strict=True)]
    got = reader.read_ranges(lo, hi)
    assert [g.tolist() for g in got] == [e.tolist() for e in expected]
    points = np.array(data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=20)))
    assert (
        reader.read_points(points).tolist() == reader.store.vindex[points].read().result().tolist()
    )


def punch_hole(path: Path, start: int, stop: int) -> None:
    """Writes zeros (the fill value) over ``[start, stop)`` of train's tokens the
    way writers that skip fill values do: the chunk leaves its shard."""
    spec = {
        "driver": "zarr3",
        "kvstore": {"driver": "file", "path": str(path / "train" / "encoded_tokens")},
        "open": True,
    }
    array = ts.open(spec).result()
    array[start:stop].write(np.zeros(stop - start, np.uint32)).result()


def test_a_shard_that_is_not_plain_falls_back_to_tensorstore(tmp_path: Path) -> None:
    ftj.write_dataset(
        tmp_path,
        {"train": [[5] * 100]},
        storage_format=ftj.StorageFormat(shard_tokens=32, chunk_tokens=8),
    )
    punch_hole(tmp_path, 40, 48)
    meta_path = tmp_path / "train" / "encoded_tokens" / "zarr.json"
    meta = json.loads(meta_path.read_text())
    del meta["attributes"]["every_chunk_stored"]  # as zarr-python would write it
    meta_path.write_text(json.dumps(meta))
    reader = tokens_array(tmp_path)
    assert reader.local is not None
    assert reader.local.shard_array(0) is not None
    assert reader.local.shard_array(1) is None
    assert reader.local.read(30, 40) is None
    got = reader.read_ranges(np.array([0, 30, 60]), np.array([10, 50, 100]))
    assert [g.tolist() for g in got] == [[11] + [10] * 9, [10] * 10 + [0] * 8 + [10] * 2, [10] * 40]


def test_a_chunk_missing_from_our_own_store_fails_the_read(tmp_path: Path) -> None:
    ftj.write_dataset(
        tmp_path,
        {"train": [[5] * 100]},
        storage_format=ftj.StorageFormat(shard_tokens=32, chunk_tokens=8),
    )
    reader = tokens_array(tmp_path)
    assert reader.read_ranges(np.array([40]), np.array([48]))[0].tolist() == [10] * 8
    punch_hole(tmp_path, 40, 48)
    reader = tokens_array(tmp_path)
    assert reader.read_ranges(np.array([0]), np.array([40]))[0].tolist() == [11] + [10] * 39
    with pytest.raises(StoreError, match=r"missing.*encoded_tokens"):
        reader.read_ranges(np.array([30]), np.array([50]))


def test_compressed_or_foreign_storage_formats_are_not_memory_mapped(tmp_path: Path) -> None:
    ftj.write_dataset(
        tmp_path / "z", {"train": [[1, 2, 3]]}, storage_format=ftj.StorageFormat(compression="zstd")
    )
    assert tokens_array(tmp_path / "z").local is None
    ftj.write_dataset(
        tmp_path / "v2", {"train": [[1, 2, 3]]}, storage_format=ftj.StorageFormat(zarr_format=2)
    )
    assert tokens_array(tmp_path / "v2").local is None
    meta = {
        "shape": [10],
        "data_type": "uint32",
        "chunk_grid": {"configuration": {"chunk_shape": [10]}},
        "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}],
    }
    assert plain_shard_geometry(meta) is None


def test_an_empty_read_at_the_end_of_a_checksummed_array(tmp_path: Path) -> None:
    """The last shard holds one whole chunk; an empty read just past it is empty."""
    ftj.write_dataset(
        tmp_path,
        {"train": [list(range(12))]},
        storage_format=ftj.StorageFormat(shard_tokens=8, chunk_tokens=4),
    )
    reader = tokens_array(tmp_path)
    assert reader.local is not None and reader.local.checksummed
    got = reader.read_ranges(np.array([12, 11, 3]), np.array([12, 12, 9]))
    assert [g.tolist() for g in got] == [[], [22], [6, 8, 10, 12, 14, 16]]


@settings(max_examples=40)
@given(
    n=st.integers(1, 200),
    chunk=st.sampled_from([2, 4, 8]),
    per_shard=st.integers(1, 8),
    checksum=st.booleans(),
    right=st.booleans(),
    compiled_copy=st.booleans(),
    data=st.data(),
)
def test_rows_equal_the_ranges_stacked(
    tmp_path_factory: pytest.TempPathFactory,
    n: int,
    chunk: int,
    per_shard: int,
    checksum: bool,
    right: bool,
    compiled_copy: bool,
    data: st.DataObject,
) -> None:
    """``rows`` (memory-mapped rows copied into a reused buffer by the compiled
    kernel or by numpy, tensorstore where a range leaves its shard) equals
    tensorstore's ranges stacked, for tokens and masks."""
    path = tmp_path_factory.mktemp("ds")
    values = data.draw(st.lists(st.integers(0, 2**31 - 1), min_size=n, max_size=n))
    mask = data.draw(st.lists(st.integers(0, 1), min_size=n, max_size=n))
    storage_format = ftj.StorageFormat(
        shard_tokens=chunk * per_shard, chunk_tokens=chunk, checksum=checksum
    )
    ftj.write_dataset(
        path, {"train": [values]}, loss_masks={"train": [mask]}, storage_format=storage_format
    )
    ft = ftj.open_dataset(path)["train"]
    width = data.draw(st.integers(1, n))
    lo = np.array(data.draw(st.lists(st.integers(0, n), min_size=0, max_size=12)), np.int64)
    size = np.array(
        data.draw(st.lists(st.integers(0, width), min_size=lo.size, max_size=lo.size)), np.int64
    )
    hi = np.minimum(lo + size, n)
    for name, reader, dtype in (
        ("encoded_tokens", ft.encoded, np.uint32),
        ("loss_mask", ft.loss_mask, np.uint8),
    ):
        assert isinstance(reader, TensorStoreArray) and reader.local is not None
        assert reader.local.kernels is not None  # the test extra installs numba
        if not compiled_copy:
            reader.local.kernels = None
        expected = np.zeros((lo.size, width), dtype)
        for r, (a, b) in enumerate(zip(lo.tolist(), hi.tolist(), strict=True)):
            value = reader.store[a:b].read().result()
            if right:
                expected[r, width - (b - a) :] = value
            else:
                expected[r, : b - a] = value
        first = reader.request_ranges(lo, hi).rows(width, dtype, right)
        assert first.tolist() == expected.tolist(), name
        # A second read may reuse the first's buffer only once nothing holds it.
        again = reader.request_ranges(lo, hi).rows(width, dtype, right)
        assert again.tolist() == expected.tolist() == first.tolist(), name
        if first.size:
            assert again.ctypes.data != first.ctypes.data
        # The memory-mapped copy serves every range within one shard, over any
        # number of chunks (the others go through tensorstore).
        shard, last = chunk * per_shard, np.maximum(hi, lo + 1) - 1
        served = lo // shard == last // shard
        direct = np.zeros((int(served.sum()), width), dtype)
        assert reader.local.copy_rows(lo[served], hi[served], direct, right), name
        assert direct.tolist() == expected[served].tolist(), name


def test_rows_through_a_chunk_that_fails_its_checksum_fail(tmp_path: Path) -> None:
    ftj.write_dataset(
        tmp_path,
        {"train": [list(range(1, 65))]},
        storage_format=ftj.StorageFormat(shard_tokens=32, chunk_tokens=8),
    )
    shard = tmp_path / "train" / "encoded_tokens" / "c" / "0"
    raw = bytearray(shard.read_bytes())
    raw[8 * 4 + 4 + 1] ^= 0xFF  # a byte of chunk 1's first value
    shard.write_bytes(bytes(raw))
    reader = tokens_array(tmp_path)
    good = reader.request_ranges(np.array([0, 16]), np.array([8, 24])).rows(8, np.uint32)
    assert good.tolist() == [
        [2 * v + (v == 1) for v in range(1, 9)],
        [2 * v for v in range(17, 25)],
    ]
    with pytest.raises(StoreError, match=r"encoded_tokens"):
        reader.request_ranges(np.array([4, 20]), np.array([12, 28])).rows(8, np.uint32)
