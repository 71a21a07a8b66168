"""Issue 27, findings 3 and 4: a shard of another version, a flipped shard-index byte.

3. A shard of another version of the dataset (one token changed past the first
   1,024 values its probe covers) passes every checksum and probe; the chunk
   digests fail the loader, ``sequences``, ``validate`` and ``validate --quick``.
4. A flipped byte in a v3 shard index (the last bytes of a shard file) fails
   the memory-mapped read and ``validate``, as tensorstore's own reads do.

Every writer path records the digests, which a reference computes again
from the values (read with zarr-python, hashed with google_crc32c), and a
store each path wrote, with one value rewritten (valid checksums), is refused.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import google_crc32c
import numpy as np
import pytest
import tensorstore as ts
import zarr
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from servers import aws_profile, moto_s3

import flat_tokens_jax as ftj
from flat_tokens_jax.convert.assemble import (
    PartInfo,
    assemble_shard,
    create_arrays,
    finish,
    part_url,
    place_parts,
)
from flat_tokens_jax.convert.megatron import export_megatron, import_megatron
from flat_tokens_jax.convert.merge import merge
from flat_tokens_jax.convert.text import convert
from flat_tokens_jax.core.format import FormatError
from flat_tokens_jax.data.records import PackedRecords, PaddedRecords
from flat_tokens_jax.store.arrays import Known, from_chunks
from flat_tokens_jax.store.digests import DIGESTS
from flat_tokens_jax.store.options import StoreError
from flat_tokens_jax.store.store import Store

SHARD = 2048  # tokens per shard: each shard's probe covers only its first half
STORAGE_FORMATS = {
    "v3": ftj.StorageFormat(shard_tokens=SHARD, chunk_tokens=256),
    "v3-nocrc": ftj.StorageFormat(shard_tokens=SHARD, chunk_tokens=256, checksum=False),
    "v3-zstd": ftj.StorageFormat(shard_tokens=SHARD, chunk_tokens=256, compression="zstd"),
    "v2": ftj.StorageFormat(zarr_format=2, shard_tokens=SHARD),
}
FIXTURES = [HealthCheck.function_scoped_fixture]
FOREIGN = r"train/encoded_tokens: shard 3, chunk \d+ \(values \[\d+, \d+\)\) is not the one written"


def sequences(count: int = 1200) -> list[np.ndarray]:
    rng = np.random.default_rng(27)
    return [rng.integers(0, 1000, int(n)) for n in rng.integers(1, 20, count)]


def shard_file(path: Path, array: str, shard: int, fmt: int) -> Path:
    return path / "train" / array / (f"c/{shard}" if fmt == 3 else str(shard))


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = {}
    for name, storage_format in STORAGE_FORMATS.items():
        out[name] = tmp_path_factory.mktemp(name) / "ds"
        ftj.write_dataset(
            out[name],
            {"train": sequences(), "validation": sequences(5)},
            storage_format=storage_format,
        )
    return out


def other_version(name: str, position: int) -> tuple[Path, int]:
    """A copy of the module's dataset ``name`` whose train shard 3 is that of
    another version, which differs in the token at ``position`` alone; and
    the sequence holding that token."""
    seqs = sequences()
    ends = np.cumsum([s.size for s in seqs])
    index = int(np.searchsorted(ends, position, side="right"))
    at = position - (int(ends[index - 1]) if index else 0)
    seqs[index] = seqs[index].copy()
    seqs[index][at] = (seqs[index][at] + 1) % 1000
    root = Path(tempfile.mkdtemp())
    other = root / "other"
    storage_format = STORAGE_FORMATS[name]
    ftj.write_dataset(
        other, {"train": seqs, "validation": sequences(5)}, storage_format=storage_format
    )
    return root / "ds", index


def assert_other_version_fails(path: Path, index: int, position: int) -> None:
    """Every read of the swapped shard fails naming it; so does each validate."""
    ft = ftj.open_dataset(path)["train"]
    with pytest.raises(FormatError, match=FOREIGN):
        ft.sequences([index])
    ft = ftj.open_dataset(path)["train"]
    config = ftj.LoaderConfig(batch_size=8, seq_len=64, shuffle=False)
    with pytest.raises(FormatError, match=FOREIGN):
        ftj.Loader(ft, config).host_batch(position // 64 // 8)
    for packing in (PackedRecords, PaddedRecords):
        records = packing(ftj.open_dataset(path)["train"], 64)
        with pytest.raises(FormatError, match=FOREIGN):
            records.read(np.arange(len(records)))
    with pytest.raises(FormatError, match=FOREIGN):
        ftj.validate(path)
    with pytest.raises(FormatError, match=FOREIGN):
        ftj.validate(path, quick=True)


@pytest.mark.parametrize("name", list(STORAGE_FORMATS))
@settings(
    max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(offset=st.integers(1024, SHARD - 1))
@example(offset=1024)
@example(offset=SHARD - 1)
def test_a_shard_of_another_version_fails_every_read(
    written: dict[str, Path], name: str, offset: int
) -> None:
    """Finding 3: the swapped shard passes its checksums and its probe (its first
    1,024 values are ours), and fails wherever a read touches the changed chunk."""
    position = 3 * SHARD + offset
    path, index = other_version(name, position)
    fmt = STORAGE_FORMATS[name].zarr_format
    shutil.copytree(written[name], path)
    mine, theirs = (shard_file(p, "encoded_tokens", 3, fmt) for p in (path, path.parent / "other"))
    assert mine.read_bytes() != theirs.read_bytes()
    shutil.copyfile(theirs, mine)
    try:
        assert_other_version_fails(path, index, position)
    finally:
        shutil.rmtree(path.parent)


def test_the_same_shard_of_our_version_reads(written: dict[str, Path]) -> None:
    """The check refuses only what differs: every read of the store as written passes."""
    for name, path in written.items():
        ft = ftj.open_dataset(path)["train"]
        got = ft.sequences(np.arange(ft.num_sequences))
        for a, b in zip(got, sequences(), strict=True):
            np.testing.assert_array_equal(a, b)
        ftj.validate(path)
        ftj.validate(path, quick=True)
        digests = ft.digests["encoded_tokens"]
        assert digests is not None, name
        assert digests.checked.all()
        assert digests.side_bytes == 4 * digests.count
        # Checksummed chunks compare their stored crc32c: none is read to hash.
        assert digests.bytes_read == (0 if name == "v3" else 4 * ft.num_tokens), name


def test_a_shard_of_another_version_fails_remote_reads(tmp_path: Path) -> None:
    """Finding 3 on S3 (tensorstore reads, no memory map): the same failure."""
    position = 3 * SHARD + 1500
    local, index = other_version("v3", position)
    with moto_s3() as base:
        options = ftj.StoreOptions(
            endpoint=base, region="us-east-1", credentials=aws_profile(tmp_path)
        )
        url = "s3://bucket/ds"
        ftj.write_dataset(
            url,
            {"train": sequences(), "validation": sequences(5)},
            storage_format=STORAGE_FORMATS["v3"],
            options=options,
        )
        store = Store(url, options)
        theirs = shard_file(local.parent / "other", "encoded_tokens", 3, 3).read_bytes()
        store.wait(store.kv.write("train/encoded_tokens/c/3", theirs))
        ft = ftj.open_dataset(url, options)["train"]
        assert ft.encoded.local is None  # type: ignore[attr-defined]
        with pytest.raises(FormatError, match=FOREIGN):
            ft.sequences([index])
        with pytest.raises(FormatError, match=FOREIGN):
            ftj.validate(url, options)
        with pytest.raises(FormatError, match=FOREIGN):
            ftj.validate(url, options, quick=True)
    shutil.rmtree(local.parent)


def read_everything(path: Path) -> None:
    ft = ftj.open_dataset(path)["train"]
    ft.sequences(np.arange(ft.num_sequences))
    for packing in (PackedRecords, PaddedRecords):
        records = packing(ft, 64)
        records.read(np.arange(len(records)))


INDEX_BYTES = 16 * (SHARD // 256) + 4  # 8 chunks of (offset, length), then their crc32c


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(shard=st.integers(0, 6), back=st.integers(1, INDEX_BYTES), bit=st.integers(0, 7))
@example(shard=3, back=1, bit=0)  # the index's own crc32c
@example(shard=6, back=INDEX_BYTES - 16 * 7, bit=3)  # an unused entry of the last, partial shard
def test_a_flipped_byte_in_a_shard_index_fails_the_read(
    written: dict[str, Path], shard: int, back: int, bit: int
) -> None:
    """Finding 4: the memory-mapped path verifies the index's crc32c as tensorstore
    does, so the read fails naming the shard file; both validates report it."""
    path = Path(tempfile.mkdtemp()) / "ds"
    shutil.copytree(written["v3"], path)
    target = shard_file(path, "encoded_tokens", shard, 3)
    data = bytearray(target.read_bytes())
    data[-back] ^= 1 << bit
    target.write_bytes(bytes(data))
    named = rf"encoded_tokens/c/{shard}\".*Digest mismatch|encoded_tokens.*crc32c"
    try:
        assert ftj.open_dataset(path)["train"].encoded.local is not None  # type: ignore[attr-defined]
        with pytest.raises((StoreError, FormatError), match=named):
            read_everything(path)
        for quick in (False, True):
            with pytest.raises(FormatError, match=named):
                ftj.validate(path, quick=quick)
    finally:
        shutil.rmtree(path.parent)


def reference_digests(folder: Path, chunk: int) -> np.ndarray:
    """The crc32c of each ``chunk`` values of the array at ``folder`` (read with
    zarr-python), the last chunk padded with zeros: ``[chunks] uint32``."""
    values = np.asarray(zarr.open_array(str(folder), mode="r")[:])
    padded = np.zeros(-(-values.size // chunk) * chunk, values.dtype.newbyteorder("<"))
    padded[: values.size] = values
    rows = padded.reshape(-1, chunk)
    return np.array([google_crc32c.value(row.tobytes()) for row in rows], np.uint32)


def assert_digests_recorded(path: Path, storage_format: ftj.StorageFormat) -> None:
    for split in ("train", "validation"):
        for array in ("encoded_tokens", "seq_starts"):
            folder = path / split / array
            v3 = (folder / "zarr.json").exists()
            meta = json.loads((folder / ("zarr.json" if v3 else ".zattrs")).read_text())
            attributes = meta["attributes"] if v3 else meta
            shard, chunk = storage_format.elements(array)
            side = np.asarray(zarr.open_array(str(folder / DIGESTS), mode="r")[:])
            expected = reference_digests(folder, chunk)
            np.testing.assert_array_equal(side, expected)
            content = hashlib.sha256(np.asarray(expected, "<u4").tobytes()).hexdigest()
            per_shard = shard // chunk
            sides = [expected[i : i + per_shard] for i in range(0, expected.size, per_shard)]
            assert attributes[DIGESTS] == {
                "algorithm": "crc32c",
                "chunk": chunk,
                "shard": shard,
                "content": content,
                "shards": [google_crc32c.value(np.asarray(d, "<u4").tobytes()) for d in sides],
            }


def rewrite_value(path: Path, index: int) -> None:
    """Changes ``train/encoded_tokens[index]`` (past its shard's probe) as a buggy
    tool would: through tensorstore, checksums valid, the probes and digests kept."""
    folder = path / "train" / "encoded_tokens"
    v3 = (folder / "zarr.json").exists()
    spec = {
        "driver": "zarr3" if v3 else "zarr",
        "kvstore": {"driver": "file", "path": f"{folder}/"},
        "open": True,
        "store_data_equal_to_fill_value": True,
    }
    handle = ts.open(spec).result()
    value = int(handle[index].read().result())
    handle[index].write(value ^ 2).result()


def seqs_of(count: int) -> list[list[int]]:
    return [[int(t) for t in s] for s in sequences(count)]


def by_writer(tmp: Path, storage_format: ftj.StorageFormat) -> dict[str, Path]:
    """A dataset written by every writer path: ``{path name: dataset}``."""
    splits = {"train": seqs_of(600), "validation": seqs_of(7)}
    out: dict[str, Path] = {}
    out["writer"] = tmp / "writer"
    ftj.write_dataset(out["writer"], splits, storage_format=storage_format)
    jsonl = tmp / "in.jsonl"
    jsonl.write_text("".join(json.dumps({"ids": s}) + "\n" for s in splits["train"]))
    out["convert"] = tmp / "convert"
    convert(
        [jsonl],
        out["convert"],
        tokens_key="ids",
        validation_fraction=0.01,
        storage_format=storage_format,
    )
    half = {k: v[: len(v) // 2] for k, v in splits.items()}
    rest = {k: v[len(v) // 2 :] for k, v in splits.items()}
    ftj.write_dataset(tmp / "m1", half)
    ftj.write_dataset(tmp / "m2", rest)
    out["merge"] = tmp / "merge"
    merge([tmp / "m1", tmp / "m2"], out["merge"], storage_format=storage_format)
    export_megatron(out["writer"], tmp / "mega")
    out["import-megatron"] = tmp / "megatron"
    import_megatron([tmp / "mega"], out["import-megatron"], storage_format=storage_format)
    out["beam-assembler"] = tmp / "assembled"
    assemble(str(out["beam-assembler"]), [half, rest], storage_format)
    return out


def assemble(
    output: str, parts: list[dict[str, list[list[int]]]], storage_format: ftj.StorageFormat
) -> None:
    """What the Beam pipeline does after converting: parts joined shard by shard."""
    infos = []
    for index, splits in enumerate(parts):
        url = part_url(output, index, "t")
        ftj.write_dataset(url, splits)
        infos.append(PartInfo.read(index, url))
    store = Store(output)
    placement = place_parts(output, storage_format, infos)
    create_arrays(placement, store)
    for task in placement.tasks():
        assemble_shard(placement, task, store, ftj.open_dataset)
    finish(placement, store)


@pytest.fixture(scope="module")
def writers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, tuple[Path, Any]]]:
    out = {}
    for name in ("v3", "v2"):
        tmp = tmp_path_factory.mktemp(f"writers-{name}")
        for path_name, path in by_writer(tmp, STORAGE_FORMATS[name]).items():
            out[f"{path_name}-{name}"] = (path, STORAGE_FORMATS[name])
    yield out


PATHS = ("writer", "convert", "merge", "import-megatron", "beam-assembler")
WRITER_PATHS = [f"{p}-{f}" for f in ("v3", "v2") for p in PATHS]


@pytest.mark.parametrize("case", WRITER_PATHS)
def test_every_writer_path_records_the_digests(
    writers: dict[str, tuple[Path, ftj.StorageFormat]], case: str
) -> None:
    path, storage_format = writers[case]
    assert_digests_recorded(path, storage_format)


@pytest.mark.parametrize("case", WRITER_PATHS)
def test_a_value_rewritten_in_a_store_of_every_writer_path_is_refused(
    writers: dict[str, tuple[Path, ftj.StorageFormat]], case: str
) -> None:
    """One token past its shard's probe rewritten (checksums valid): reads and
    both validates fail naming the shard and chunk."""
    path = Path(tempfile.mkdtemp()) / "ds"
    shutil.copytree(writers[case][0], path)
    rewrite_value(path, 1500)
    message = r"train/encoded_tokens: shard 0, chunk \d+ \(values \[\d+, \d+\)\) is not the one"
    try:
        ft = ftj.open_dataset(path)["train"]
        with pytest.raises(FormatError, match=message):
            ft.tokens(1500, 1501)
        for quick in (False, True):
            with pytest.raises(FormatError, match=message):
                ftj.validate(path, quick=quick, samples=10_000)
    finally:
        shutil.rmtree(path.parent)


def test_the_digest_format_is_frozen(tmp_path: Path) -> None:
    """The attribute and the side array of docs/format.md's example sequences, in
    chunks of 2 tokens and shards of 4, byte for byte."""
    ftj.write_dataset(
        tmp_path / "ds",
        {"train": [[1, 2], [3, 4, 5], [6, 7, 8]], "validation": [[1]]},
        storage_format=ftj.StorageFormat(shard_tokens=4, chunk_tokens=2),
    )
    tokens = tmp_path / "ds" / "train" / "encoded_tokens"
    meta = json.loads((tokens / "zarr.json").read_text())
    assert meta["attributes"][DIGESTS] == {
        "algorithm": "crc32c",
        "chunk": 2,
        "shard": 4,
        "content": "c8e7efd7d3872d6b62ef9c7745cd19556a4453569d4481ba58843f4c5366ce3d",
        "shards": [0x23267C09, 0x9E8253BE],  # crc32c of each side chunk above
    }
    side = json.loads((tokens / DIGESTS / "zarr.json").read_text())
    assert side["shape"] == [4] and side["data_type"] == "uint32"
    assert side["chunk_grid"]["configuration"]["chunk_shape"] == [2]
    # encoded_tokens [3, 4, 7, 8, 10, 13, 14, 16] in chunks of 2, crc32c of their bytes.
    stored = np.asarray(zarr.open_array(str(tokens / DIGESTS), mode="r")[:])
    assert stored.tolist() == [0x2C4E0410, 0x8035D468, 0x0C48B4B3, 0x94127F4E]
    starts = tmp_path / "ds" / "train" / "seq_starts"
    meta = json.loads((starts / "zarr.json").read_text())
    assert meta["attributes"][DIGESTS] == {
        "algorithm": "crc32c",
        "chunk": 1,
        "shard": 2,
        "content": "b463fa50710ff611564be5099c2cf343e213ba3579db5b8cbf2df5cbe53bd41e",
        "shards": [0x4394CC10, 0x9B1D1214],
    }
    stored = np.asarray(zarr.open_array(str(starts / DIGESTS), mode="r")[:])
    # seq_starts [0, 2, 5, 8], one uint64 a chunk.
    assert stored.tolist() == [0x8C28B28A, 0x1E5048C4, 0xE4094DC0, 0xCE13B650]


def test_a_store_without_digests_reads_as_before(written: dict[str, Path], tmp_path: Path) -> None:
    """Another writer's store (no root attribute ``flat_tokens``, no digests'
    attribute, no side array) reads and validates as before."""
    path = tmp_path / "ds"
    shutil.copytree(written["v3"], path)
    root = json.loads((path / "zarr.json").read_text())
    root["attributes"].pop("flat_tokens")
    (path / "zarr.json").write_text(json.dumps(root))
    for array in ("encoded_tokens", "seq_starts"):
        folder = path / "train" / array
        meta = json.loads((folder / "zarr.json").read_text())
        del meta["attributes"][DIGESTS]
        (folder / "zarr.json").write_text(json.dumps(meta))
        shutil.rmtree(folder / DIGESTS)
    ft = ftj.open_dataset(path)["train"]
    assert ft.digests == {"encoded_tokens": None, "seq_starts": None}
    for a, b in zip(ft.sequences(np.arange(ft.num_sequences)), sequences(), strict=True):
        np.testing.assert_array_equal(a, b)
    ftj.validate(path)


@pytest.mark.parametrize(
    "fault, message",
    [
        ("missing", r"train/encoded_tokens/chunk_crc32c: the chunk digests .* are missing"),
        ("malformed", r"attribute 'chunk_crc32c' is malformed"),
    ],
)
def test_a_damaged_digest_record_is_named(
    written: dict[str, Path], tmp_path: Path, fault: str, message: str
) -> None:
    path = tmp_path / "ds"
    shutil.copytree(written["v3"], path)
    folder = path / "train" / "encoded_tokens"
    if fault == "missing":
        shutil.rmtree(folder / DIGESTS)
    else:
        meta = json.loads((folder / "zarr.json").read_text())
        meta["attributes"][DIGESTS]["chunk"] = True
        (folder / "zarr.json").write_text(json.dumps(meta))
    read: Callable[[], object] = lambda: ftj.open_dataset(path)["train"].tokens(0, 10)  # noqa: E731
    with pytest.raises(FormatError, match=message):
        read()
    with pytest.raises(FormatError, match=message):
        ftj.validate(path)


def test_concurrent_first_reads_check_each_chunk_once(written: dict[str, Path]) -> None:
    """Eight threads read every token in shuffled short ranges: each chunk is
    hashed once (the digests' reads total the array once), and all pass."""
    ft = ftj.open_dataset(written["v3-nocrc"])["train"]
    digests = ft.digests["encoded_tokens"]
    assert digests is not None
    starts = np.random.default_rng(0).permutation(np.arange(0, ft.num_tokens, 100)).tolist()
    with ThreadPoolExecutor(8) as pool:
        got = dict(pool.map(lambda a: (a, ft.tokens(a, min(a + 100, ft.num_tokens))), starts))
    together = np.concatenate([got[a] for a in sorted(got)])
    np.testing.assert_array_equal(together, np.concatenate(sequences()))
    assert digests.checked.all()
    assert digests.bytes_read == 4 * ft.num_tokens
    assert digests.side_bytes == 4 * digests.count


@pytest.mark.parametrize("name", ["v3-zstd", "v2", "v3-nocrc"])
@settings(max_examples=20, deadline=None, suppress_health_check=FIXTURES)
@given(data=st.data())
def test_first_reads_served_from_the_checked_chunks_equal_the_stored_values(
    written: dict[str, Path], name: str, data: st.DataObject
) -> None:
    """Reads through tensorstore take their first touch's ranges from the chunks
    the check read whole: any ranges, across chunks and shards, equal the values."""
    encoded = ftj.encode([s.tolist() for s in sequences()])[0]
    n = encoded.size
    starts = data.draw(st.lists(st.integers(0, n), min_size=1, max_size=12))
    stops = [min(a + data.draw(st.integers(0, 3 * SHARD)), n) for a in starts]
    ft = ftj.open_dataset(written[name])["train"]
    for a, b, got in zip(starts, stops, ft.encoded_ranges(starts, stops), strict=True):
        np.testing.assert_array_equal(got, encoded[a:b])


@given(
    size=st.integers(1, 300),
    chunk=st.integers(1, 40),
    data=st.data(),
)
def test_known_chunks_serve_exactly_the_ranges_they_cover(
    size: int, chunk: int, data: st.DataObject
) -> None:
    values = np.arange(size, dtype=np.uint32) * 7
    chunks = range(-(-size // chunk))
    have = set(data.draw(st.lists(st.sampled_from(list(chunks)), unique=True)))
    whole = {c: values[c * chunk : (c + 1) * chunk] for c in have}
    known = Known(chunk, frozenset(have), lambda: whole)
    a = data.draw(st.integers(0, size - 1))
    b = data.draw(st.integers(a + 1, size))
    covered = all(c in have for c in range(a // chunk, (b - 1) // chunk + 1))
    assert known.covers(a, b) == covered
    if covered:
        np.testing.assert_array_equal(from_chunks(whole, chunk, a, b), values[a:b])


def test_a_shard_swapped_in_with_its_digests_is_found_by_validate(tmp_path: Path) -> None:
    """A shard of another version copied in together with its side chunk of
    digests would pass every per-chunk check; the side chunk's crc32c recorded
    in the attribute at write tells (reads and ``validate``), and the loader's
    fingerprint holds the content digest, so a saved state of one version does
    not restore onto the other (issue 35, finding 2: ``tests/test_integrity.py``)."""
    storage_format = ftj.StorageFormat(shard_tokens=SHARD, chunk_tokens=256)
    seqs = [np.arange(i, i + 97) % 500 + 1 for i in range(100)]
    other = [s.copy() for s in seqs]
    other[40][50] = other[40][50] % 500 + 1  # token 3930: shard 1, past its probe
    for name, data in (("ours", seqs), ("theirs", other)):
        ftj.write_dataset(tmp_path / name, {"train": data}, storage_format=storage_format)
    ours = tmp_path / "ours" / "train" / "encoded_tokens"
    theirs = tmp_path / "theirs" / "train" / "encoded_tokens"
    cfg = ftj.LoaderConfig(batch_size=4, seq_len=64, seed=1)
    state = ftj.Loader(ftj.open_dataset(tmp_path / "ours")["train"], cfg).state()
    shutil.copyfile(theirs / "c" / "1", ours / "c" / "1")
    shutil.copyfile(theirs / DIGESTS / "c" / "1", ours / DIGESTS / "c" / "1")
    ft = ftj.open_dataset(tmp_path / "ours")["train"]
    side = r"train/encoded_tokens/chunk_crc32c: shard 1's chunk digests are not those"
    with pytest.raises(FormatError, match=side):
        ft.tokens(3930, 3931)
    with pytest.raises(FormatError, match=side):
        ftj.validate(tmp_path / "ours")
    ftj.validate(tmp_path / "theirs")
    # The attribute is what a state records: the same data rewritten restores,
    # the other version does not.
    again = ftj.open_dataset(tmp_path / "theirs")["train"]
    with pytest.raises(ftj.StateMismatch, match=r"fingerprint\.data\.content"):
        ftj.Loader(again, cfg).restore(state)
    ftj.write_dataset(tmp_path / "again", {"train": seqs}, storage_format=storage_format)
    assert ftj.Loader(ftj.open_dataset(tmp_path / "again")["train"], cfg).restore(state) == 0
