"""A corrupt store never reads as data: each read gives the pristine rows or fails naming the place.

The corruption matrix plants one fault in a small store (zarr v3 with its
default crc32c checksums, and zarr v2) and reads every record, packed and
padded. Flipped bits are caught by the checksums of zarr v3 (zarr v2 has
none); truncated, emptied or missing shard or chunk files in both; logical
faults written with valid checksums (``seq_starts`` entries, cleared start
bits) by the checks of padded reads, which read ``seq_starts``; packed
records read tokens as stored, and only ``validate`` compares their start bits
with ``seq_starts``.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tensorstore as ts
from hypothesis import given, settings
from hypothesis import strategies as st

import flat_tokens_jax as ftj
from flat_tokens_jax.cli import main
from flat_tokens_jax.core.format import FormatError
from flat_tokens_jax.data.records import PackedRecords, PaddedRecords
from flat_tokens_jax.store.digests import DIGESTS
from flat_tokens_jax.store.options import StoreError
from flat_tokens_jax.store.probes import ATTRIBUTE as PROBES

SEQ_LEN = 8
STORAGE_FORMATS = {
    "v3": ftj.StorageFormat(shard_tokens=64, chunk_tokens=8),
    "v2": ftj.StorageFormat(zarr_format=2, shard_tokens=64),
}


def sequences() -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    return [rng.integers(0, 1000, int(n)) for n in rng.integers(1, 13, 40)]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = {}
    for name, storage_format in STORAGE_FORMATS.items():
        path = tmp_path_factory.mktemp(name) / "ds"
        ftj.write_dataset(path, {"train": sequences()}, storage_format=storage_format)
        out[name] = path
    return out


def read_all(path: Path) -> list[Any]:
    """Every packed and every padded record of train."""
    ft = ftj.open_dataset(path)["train"]
    packed = PackedRecords(ft, SEQ_LEN)
    padded = PaddedRecords(ft, SEQ_LEN)
    rows = padded.read(np.arange(len(padded)))
    return [packed.read(np.arange(len(packed))).encoded, rows.encoded, rows.lengths]


def outcome(path: Path) -> list[Any] | str:
    """The rows read, or the message of the error that stopped the read."""
    try:
        return read_all(path)
    except (FormatError, StoreError) as e:
        return str(e)


def assert_pristine_or_named(got: list[Any] | str, pristine: list[Any], *places: str) -> None:
    if isinstance(got, str):
        assert any(p in got for p in places), got
        return
    for a, b in zip(got, pristine, strict=True):
        np.testing.assert_array_equal(a, b)


def shard_files(path: Path) -> list[Path]:
    """The data files of train's arrays: v3 shards under ``c/``, v2 chunks."""
    return sorted(
        p for p in (path / "train").rglob("*") if p.is_file() and not p.name.startswith((".", "z"))
    )


def copy(path: Path) -> Path:
    target = Path(tempfile.mkdtemp()) / "ds"
    shutil.copytree(path, target)
    return target


def write_element(path: Path, array: str, index: int, value: int, probes: bool = False) -> None:
    """Writes one element as a buggy tool would: through zarr, checksums valid.

    The array's shard probes and chunk digests are dropped too (unless
    ``probes``), as a tool that rewrites the array would, and with them the
    root attribute that says our writer made the dataset (which would refuse
    arrays without them): the checks under test are then those of every read,
    which stores without them (other writers') get.
    """
    folder = path / "train" / array
    driver = "zarr3" if (folder / "zarr.json").exists() else "zarr"
    kvstore = {"driver": "file", "path": f"{folder}/"}
    spec = {"driver": driver, "kvstore": kvstore, "open": True}
    # As our writer does: chunks that hold fill values stay stored.
    handle = ts.open({**spec, "store_data_equal_to_fill_value": True}).result()
    handle[index].write(value).result()
    if not probes:
        meta_file = folder / ("zarr.json" if driver == "zarr3" else ".zattrs")
        meta = json.loads(meta_file.read_text())
        attributes = meta["attributes"] if driver == "zarr3" else meta
        attributes.pop(PROBES)
        attributes.pop(DIGESTS)
        meta_file.write_text(json.dumps(meta))
        drop_identity(path)


def drop_identity(path: Path) -> None:
    """Removes the root attribute ``flat_tokens`` (v3 or v2): the store of another writer."""
    meta_file = path / "zarr.json" if (path / "zarr.json").exists() else path / ".zattrs"
    meta = json.loads(meta_file.read_text())
    (meta["attributes"] if meta_file.name == "zarr.json" else meta).pop("flat_tokens", None)
    meta_file.write_text(json.dumps(meta))


@settings(max_examples=40)
@given(file=st.integers(0, 1000), position=st.integers(0, 1 << 20), bit=st.integers(0, 7))
def test_a_flipped_bit_in_a_v3_store_fails_or_reads_the_same(
    pristine: dict[str, Path], file: int, position: int, bit: int
) -> None:
    expected = read_all(pristine["v3"])
    path = copy(pristine["v3"])
    files = shard_files(path)
    target = files[file % len(files)]
    data = bytearray(target.read_bytes())
    data[position % len(data)] ^= 1 << bit
    target.write_bytes(bytes(data))
    got = outcome(path)
    shutil.rmtree(path.parent)
    assert_pristine_or_named(got, expected, f"{target.parent.parent.name}", "corrupt")


@pytest.mark.parametrize("fmt", ["v3", "v2"])
@pytest.mark.parametrize("fault", ["truncate", "delete", "empty"])
def test_a_damaged_shard_file_fails_the_read(
    pristine: dict[str, Path], fmt: str, fault: str
) -> None:
    for index in range(len(shard_files(pristine[fmt]))):
        path = copy(pristine[fmt])
        target = shard_files(path)[index]
        if fault == "delete":
            target.unlink()
        else:
            size = target.stat().st_size
            target.write_bytes(target.read_bytes()[: size // 2 if fault == "truncate" else 0])
        got = outcome(path)
        shutil.rmtree(path.parent)
        assert isinstance(got, str), (fault, target)
        assert target.parent.parent.name in got, got


@pytest.mark.parametrize("fmt", ["v3", "v2"])
@settings(max_examples=30)
@given(data=st.data())
def test_a_wrong_seq_starts_entry_fails_padded_reads(
    pristine: dict[str, Path], fmt: str, data: st.DataObject
) -> None:
    expected = read_all(pristine[fmt])
    num_tokens = int(expected[2].sum())
    index = data.draw(st.integers(0, len(expected[2])), label="index")
    value = data.draw(
        st.one_of(st.integers(0, num_tokens + 5), st.just(2**64 - 1), st.just(2**63)),
        label="value",
    )
    path = copy(pristine[fmt])
    write_element(path, "seq_starts", index, value)
    got = outcome(path)
    shutil.rmtree(path.parent)
    assert_pristine_or_named(got, expected, "train/seq_starts[", "train/encoded_tokens[")


@pytest.mark.parametrize("fmt", ["v3", "v2"])
@pytest.mark.parametrize("case", ["empty first", "empty second", "backwards", "beyond", "huge"])
def test_named_seq_starts_faults_fail_padded_reads(
    pristine: dict[str, Path], fmt: str, case: str
) -> None:
    ft = ftj.open_dataset(pristine[fmt])["train"]
    starts = ft.starts.read_points(np.arange(ft.num_sequences + 1)).astype(int)
    index, value, message = {
        "empty first": (1, 0, r"seq_starts\[1\]: entry 0 is not above the entry before it"),
        "empty second": (1, starts[2], r"seq_starts\[2\]: entry \d+ is not above"),
        "backwards": (3, starts[2] - 1, r"seq_starts\[3\]: entry \d+ is not above"),
        "beyond": (3, ft.num_tokens + 1, r"seq_starts\[3\]: entry \d+ is outside the tokens"),
        "huge": (3, 2**64 - 1, r"seq_starts\[3\]: entry -1 is outside the tokens"),
    }[case]
    path = copy(pristine[fmt])
    write_element(path, "seq_starts", index, value)
    with pytest.raises(FormatError, match=message):
        read_all(path)
    shutil.rmtree(path.parent)


@pytest.mark.parametrize("fmt", ["v3", "v2"])
def test_a_cleared_start_bit_fails_padded_reads(pristine: dict[str, Path], fmt: str) -> None:
    ft = ftj.open_dataset(pristine[fmt])["train"]
    starts = ft.starts.read_points(np.arange(ft.num_sequences)).astype(int)
    for seq in (0, 17, ft.num_sequences - 1):
        path = copy(pristine[fmt])
        at = int(starts[seq])
        write_element(
            path, "encoded_tokens", at, int(ft.encoded.read_points(np.array([at]))[0]) - 1
        )
        with pytest.raises(FormatError, match=rf"train/encoded_tokens\[{at}\]: start bit clear"):
            read_all(path)
        shutil.rmtree(path.parent)


def test_seq_starts_ends_are_checked_at_open(pristine: dict[str, Path]) -> None:
    n = ftj.open_dataset(pristine["v3"])["train"].num_sequences
    for index, value, message in (
        (0, 1, r"seq_starts\[0\]: first entry is 1, expected 0"),
        (n, 5, rf"seq_starts\[{n}\]: last entry is 5"),
    ):
        path = copy(pristine["v3"])
        write_element(path, "seq_starts", index, value)
        with pytest.raises(FormatError, match=message):
            ftj.open_dataset(path)
        shutil.rmtree(path.parent)


@pytest.mark.parametrize("fmt", ["v3", "v2"])
@pytest.mark.parametrize("array", ["encoded_tokens", "seq_starts", "loss_mask"])
@pytest.mark.parametrize("how", ["copied", "linked"])
def test_a_shard_of_another_store_fails_every_read(
    tmp_path: Path, fmt: str, array: str, how: str
) -> None:
    """A shard file replaced by a valid shard of another store: its checksums
    pass, its probe does not; packed and padded reads both fail, naming it."""
    rng = np.random.default_rng(3)
    other = [rng.integers(0, 1000, int(n)) for n in rng.integers(1, 13, 40)]
    masks = {"train": [np.ones(len(q), np.uint8) for q in sequences()]}
    other_masks = {"train": [(rng.random(len(q)) < 0.5).astype(np.uint8) for q in other]}
    storage_format = STORAGE_FORMATS[fmt]
    ftj.write_dataset(
        tmp_path / "a", {"train": sequences()}, loss_masks=masks, storage_format=storage_format
    )
    ftj.write_dataset(
        tmp_path / "b", {"train": other}, loss_masks=other_masks, storage_format=storage_format
    )
    name = (
        ("c/1" if fmt == "v3" else "1")
        if array != "seq_starts"
        else ("c/0" if fmt == "v3" else "0")
    )
    mine, theirs = tmp_path / "a" / "train" / array / name, tmp_path / "b" / "train" / array / name
    mine.unlink()
    if how == "linked":
        mine.symlink_to(theirs)
    else:
        shutil.copyfile(theirs, mine)
    shard = name.rsplit("/", 1)[-1]
    message = rf"train/{array}: shard {shard} \(values \[\d+, \d+\)\) is not the one written here"
    ft = ftj.open_dataset(tmp_path / "a")["train"] if array != "seq_starts" else None
    if ft is not None:
        packed = PackedRecords(ft, SEQ_LEN)
        with pytest.raises(FormatError, match=message):
            packed.read(np.arange(len(packed)))
    with pytest.raises(FormatError, match=message):
        read_all(tmp_path / "a")
    with pytest.raises(ftj.FormatError, match=message):
        ftj.validate(tmp_path / "a", quick=True)


def test_a_store_without_probes_reads_as_before(tmp_path: Path) -> None:
    ftj.write_dataset(tmp_path / "a", {"train": sequences()}, storage_format=STORAGE_FORMATS["v3"])
    expected = read_all(tmp_path / "a")
    for array in ("encoded_tokens", "seq_starts"):
        meta_file = tmp_path / "a" / "train" / array / "zarr.json"
        meta = json.loads(meta_file.read_text())
        assert PROBES in meta["attributes"]
        del meta["attributes"][PROBES]
        meta_file.write_text(json.dumps(meta))
    drop_identity(tmp_path / "a")
    assert ftj.open_dataset(tmp_path / "a")["train"].probes == {
        "encoded_tokens": None,
        "seq_starts": None,
    }
    assert_pristine_or_named(read_all(tmp_path / "a"), expected)


@pytest.mark.parametrize("fmt", ["v3", "v2"])
def test_quick_validate_finds_planted_faults_in_what_it_samples(
    pristine: dict[str, Path], fmt: str
) -> None:
    ftj.validate(pristine[fmt], quick=True)
    ft = ftj.open_dataset(pristine[fmt])["train"]
    starts = ft.starts.read_points(np.arange(ft.num_sequences + 1)).astype(int)
    at = int(starts[5])
    value = int(ft.encoded.read_points(np.array([at]))[0])
    cases = [
        ("seq_starts", 0, 3, r"train/seq_starts\[0\]: first entry must be 0"),
        ("seq_starts", 7, int(starts[9]), r"train/seq_starts\[8\]: not strictly increasing"),
        ("seq_starts", ft.num_sequences, 3, r"last entry must equal the token count"),
        ("encoded_tokens", at, value - 1, rf"encoded_tokens\[{at}\]: seq_starts marks"),
        ("encoded_tokens", at + 1, 1, rf"encoded_tokens\[{at + 1}\]: start bit set"),
        ("encoded_tokens", at, 2**32 - 1, rf"encoded_tokens\[{at}\]: .*max_token_id"),
    ]
    for array, index, new, message in cases:
        path = copy(pristine[fmt])
        write_element(path, array, index, new)
        with pytest.raises(FormatError, match=message):
            ftj.validate(path, quick=True, samples=ft.num_sequences)
        shutil.rmtree(path.parent)


def test_quick_validate_reports_a_chunk_that_fails_its_checksum(pristine: dict[str, Path]) -> None:
    path = copy(pristine["v3"])
    target = path / "train" / "encoded_tokens" / "c" / "0"
    data = bytearray(target.read_bytes())
    data[0] ^= 1
    target.write_bytes(bytes(data))
    for quick in (True, False):
        with pytest.raises(FormatError, match=r"train/encoded_tokens: stored bytes fail"):
            ftj.validate(path, quick=quick)
    shutil.rmtree(path.parent)


def test_cli_validate_quick(pristine: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", "--quick", str(pristine["v3"])]) == 0
    assert capsys.readouterr().out == f"{pristine['v3']}: valid (sampled: --quick)\n"
    path = copy(pristine["v3"])
    write_element(path, "seq_starts", 3, 0)
    assert main(["validate", "--quick", str(path)]) == 1
    assert "train/seq_starts[3]: not strictly increasing" in capsys.readouterr().err
    shutil.rmtree(path.parent)


def test_info_shows_the_checksums(
    pristine: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["info", str(pristine["v3"])]) == 0
    text = capsys.readouterr().out
    assert "encoded_tokens: chunk 8, shard 64, compression none, crc32c checksums" in text
    assert main(["info", "--json", str(pristine["v2"])]) == 0
    storage_format = json.loads(capsys.readouterr().out)["splits"]["train"]["layout"][
        "encoded_tokens"
    ]
    assert (storage_format["compression"], storage_format["checksum"], storage_format["chunk"]) == (
        "blosc",
        False,
        64,
    )


# Issue 35, finding 2: two versions A and B of a dataset, equal sequence
# lengths, one token apart in shard 1 past its probe; B's shard 1 and its side
# chunk of digests copied into A.
SWAP_FORMATS = {
    "v3": ftj.StorageFormat(shard_tokens=4096, chunk_tokens=512),
    "v2": ftj.StorageFormat(zarr_format=2, shard_tokens=4096),
}
SWAPPED = 4096 + 2000  # in shard 1, past its 1,024-value probe
SIDE = r"train/encoded_tokens/chunk_crc32c: .*chunk digests are not those recorded"
SWAP_CONFIG = ftj.LoaderConfig(batch_size=4, seq_len=64, shuffle=False)


def two_versions(root: Path, fmt: str) -> tuple[Path, int]:
    """Versions ``root/a`` and ``root/b`` (19,400 tokens, 5 shards); B's token
    at :data:`SWAPPED`, which A's differs from."""
    seqs = [np.arange(i, i + 97) % 500 + 1 for i in range(200)]
    other = [s.copy() for s in seqs]
    other[SWAPPED // 97][SWAPPED % 97] = seqs[SWAPPED // 97][SWAPPED % 97] % 500 + 1
    for name, data in (("a", seqs), ("b", other)):
        ftj.write_dataset(root / name, {"train": data}, storage_format=SWAP_FORMATS[fmt])
    return root / "a", int(other[SWAPPED // 97][SWAPPED % 97])


def copy_shard_with_digests(root: Path, fmt: str) -> None:
    """B's ``train/encoded_tokens`` shard 1 and its side chunk, copied into A."""
    name = "c/1" if fmt == "v3" else "1"
    for folder in ("train/encoded_tokens", f"train/encoded_tokens/{DIGESTS}"):
        mine, theirs = root / "a" / folder / name, root / "b" / folder / name
        assert mine.read_bytes() != theirs.read_bytes()
        shutil.copyfile(theirs, mine)


def array_attributes(path: Path, array: str, change: Any) -> None:
    """Applies ``change`` to the attributes of ``train/array`` (v3 or v2)."""
    folder = path / "train" / array
    meta_file = folder / ("zarr.json" if (folder / "zarr.json").exists() else ".zattrs")
    meta = json.loads(meta_file.read_text())
    change(meta["attributes"] if meta_file.name == "zarr.json" else meta)
    meta_file.write_text(json.dumps(meta))


def swapped_step() -> int:
    """The step of :data:`SWAP_CONFIG` (packed, unshuffled) whose rows hold :data:`SWAPPED`."""
    return SWAPPED // SWAP_CONFIG.seq_len // 4


@pytest.mark.parametrize("fmt", ["v3", "v2"])
def test_a_shard_copied_in_with_its_side_chunk_fails_reads_quick_validate_and_restore(
    tmp_path: Path, fmt: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path, theirs = two_versions(tmp_path, fmt)
    ft = ftj.open_dataset(path)["train"]
    assert ft.tokens(SWAPPED, SWAPPED + 1)[0] != theirs
    before = ftj.Loader(ft, SWAP_CONFIG)
    state = before.state()
    step = swapped_step()
    assert ftj.Loader(ftj.open_dataset(tmp_path / "b")["train"], SWAP_CONFIG).host_batch(step)
    copy_shard_with_digests(tmp_path, fmt)
    with pytest.raises(FormatError, match=SIDE):
        ftj.Loader(ftj.open_dataset(path)["train"], SWAP_CONFIG).host_batch(step)
    with pytest.raises(FormatError, match=SIDE):
        ftj.open_dataset(path)["train"].tokens(SWAPPED, SWAPPED + 1)
    with pytest.raises(FormatError, match=SIDE):
        ftj.Loader(ftj.open_dataset(path)["train"], SWAP_CONFIG).restore(state)
    capsys.readouterr()
    assert main(["validate", "--quick", str(path)]) == 1
    err = capsys.readouterr().err
    assert "train/encoded_tokens/chunk_crc32c: shard 1's chunk digests are not those" in err, err
    assert "restore" in err and "rewrite the dataset" in err
    with pytest.raises(FormatError, match=r"shard 1's chunk digests are not those"):
        ftj.validate(path)


@pytest.mark.parametrize("fmt", ["v3", "v2"])
def test_a_store_that_records_no_side_chunk_digests_checks_the_side_array_whole(
    tmp_path: Path, fmt: str
) -> None:
    """A store written before each shard's side chunk had its crc32c in the
    attribute (``content`` only): the first check reads the side array whole
    and compares it with ``content``."""
    path, _ = two_versions(tmp_path, fmt)
    for array in ("encoded_tokens", "seq_starts"):
        array_attributes(path, array, lambda a: a[DIGESTS].pop("shards", None))
    ft = ftj.open_dataset(path)["train"]
    np.testing.assert_array_equal(ft.tokens(0, 10), np.arange(1, 11))
    digests = ft.digests["encoded_tokens"]
    assert digests is not None and digests.side_bytes == 4 * digests.count
    ftj.validate(path, quick=True)
    copy_shard_with_digests(tmp_path, fmt)
    with pytest.raises(FormatError, match=SIDE):
        ftj.open_dataset(path)["train"].tokens(0, 10)
    with pytest.raises(FormatError, match=SIDE):
        ftj.validate(path, quick=True)


@pytest.mark.parametrize("fmt", ["v3", "v2"])
@pytest.mark.parametrize("attribute", [DIGESTS, PROBES, "content"])
def test_a_deleted_attribute_of_a_dataset_we_wrote_is_refused_at_open(
    tmp_path: Path, fmt: str, attribute: str
) -> None:
    """Our writers record both attributes, ``content`` included, on every array of
    a dataset that records what made it: one deleted is no longer a store
    without checks (the copied shard would read as ours)."""
    path, _ = two_versions(tmp_path, fmt)
    copy_shard_with_digests(tmp_path, fmt)
    if attribute == "content":
        array_attributes(path, "encoded_tokens", lambda a: a[DIGESTS].pop("content"))
    else:
        array_attributes(path, "encoded_tokens", lambda a: a.pop(attribute))
    message = (
        rf"train/encoded_tokens: attribute '{DIGESTS}' has no 'content'"
        if attribute == "content"
        else rf"train/encoded_tokens: attribute '{attribute}' is missing"
    )
    with pytest.raises(FormatError, match=message + r".*deleted\?.* rewrite the dataset"):
        ftj.open_dataset(path)
    with pytest.raises(FormatError, match=message):
        ftj.validate(path, quick=True)


def test_a_state_does_not_restore_onto_data_that_records_other_or_no_contents(
    tmp_path: Path,
) -> None:
    path, _ = two_versions(tmp_path, "v3")
    state = ftj.Loader(ftj.open_dataset(path)["train"], SWAP_CONFIG).state()
    other = ftj.open_dataset(tmp_path / "b")["train"]
    what = r"fingerprint\.data\.content: the data is not what the saved run read"
    with pytest.raises(
        ftj.StateMismatch, match=what + r": .* was '[0-9a-f]{32}', now '[0-9a-f]{32}';"
    ):
        ftj.Loader(other, SWAP_CONFIG).restore(state)
    # Another writer's store (no root identity) whose arrays record no digests.
    drop_identity(path)
    array_attributes(path, "encoded_tokens", lambda a: a.pop(DIGESTS))
    bare = ftj.open_dataset(path)["train"]
    with pytest.raises(ftj.StateMismatch, match=what + r".*now none is recorded"):
        ftj.Loader(bare, SWAP_CONFIG).restore(state)


def test_a_read_of_blocks_that_passed_their_checks_asks_no_check_again(
    pristine: dict[str, Path],
) -> None:
    """Once the chunks a read touches have passed their probes and digests, a
    read of them starts no check (a run's steady state); a read that touches
    one chunk more still asks for that chunk's checks."""
    ft = ftj.open_dataset(pristine["v3"])["train"]
    checked = ft.checked[ft.tokens_name]
    assert checked.probes is not None and checked.digests is not None
    chunk = checked.digests.chunk
    starts, stops = np.array([0, 3 * chunk]), np.array([chunk, 4 * chunk])
    first = checked.request_ranges(starts, stops).result()
    asked: list[str] = []

    def refuse(name: str) -> Any:
        def ask(*args: Any) -> Any:
            asked.append(name)
            raise AssertionError(f"{name} asked again")

        return ask

    checked.probes.start_check = refuse("probes")  # type: ignore[method-assign]
    checked.digests.start_check = refuse("digests")  # type: ignore[method-assign]
    again = checked.request_ranges(starts[::-1], stops[::-1]).result()
    assert [a.tolist() for a in again] == [b.tolist() for b in first[::-1]]
    assert asked == []
    with pytest.raises(AssertionError, match="asked again"):
        checked.request_ranges(np.array([chunk]), np.array([chunk + 1]))
    assert asked == ["probes"]
