"""Megatron MMIDIDX import and export, against a reference writer built from the layout."""

from __future__ import annotations

import argparse
import json
import logging
import struct
import tempfile
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from memurls import memory_url

import flat_tokens_jax as ftj
from flat_tokens_jax.convert import megatron, mmidx
from flat_tokens_jax.convert.megatron import export_megatron, import_megatron
from flat_tokens_jax.convert.mmidx import MegatronFormatError, read_index

# Megatron-core's dtype codes as struct formats, and the largest id each holds exactly.
FORMATS = {1: "B", 2: "b", 3: "h", 4: "i", 5: "q", 6: "d", 7: "f", 8: "H"}
LARGEST = {1: 255, 2: 127, 3: 2**15 - 1, 4: 2**31 - 1, 5: 2**31 - 1, 6: 2**31 - 1}
LARGEST |= {7: 2**24, 8: 2**16 - 1}  # float32 holds every integer up to 2**24
Documents = list[list[list[int]]]


def pack_index(
    code: int,
    sizes: list[int],
    pointers: list[int],
    doc_idx: list[int],
    *,
    magic: bytes = b"MMIDIDX\x00\x00",
    version: int = 1,
) -> bytes:
    """The .idx bytes exactly as the documented layout lays them out."""
    header = magic + struct.pack("<QBQQ", version, code, len(sizes), len(doc_idx))
    return (
        header
        + struct.pack(f"<{len(sizes)}i", *sizes)
        + struct.pack(f"<{len(pointers)}q", *pointers)
        + struct.pack(f"<{len(doc_idx)}q", *doc_idx)
    )


def write_reference(prefix: Path, documents: Documents, code: int) -> None:
    """Writes ``prefix.idx``/``prefix.bin`` the way Megatron's builder does."""
    data, sizes, pointers, doc_idx = b"", [], [], [0]
    for doc in documents:
        for seq in doc:
            pointers.append(len(data))
            sizes.append(len(seq))
            data += struct.pack(f"<{len(seq)}{FORMATS[code]}", *seq)
        doc_idx.append(len(sizes))
    Path(f"{prefix}.bin").write_bytes(data)
    Path(f"{prefix}.idx").write_bytes(pack_index(code, sizes, pointers, doc_idx))


def stored(url: str, split: str = "train") -> list[list[int]]:
    ft = ftj.open_dataset(url)[split]
    return [s.tolist() for s in ft.sequences(np.arange(ft.num_sequences))]


def expected(documents: Documents, per_sequence: bool) -> list[list[int]]:
    if per_sequence:
        return [seq for doc in documents for seq in doc if seq]
    return [joined for doc in documents if (joined := [t for seq in doc for t in seq])]


@st.composite
def megatron_data(draw: st.DrawFn, max_sequences: int = 4) -> tuple[int, Documents]:
    code = draw(st.integers(1, 8))
    seq = st.lists(st.integers(0, LARGEST[code]), max_size=6)
    return code, draw(st.lists(st.lists(seq, max_size=max_sequences), max_size=6))


@settings(max_examples=80)
@given(
    parts=st.lists(megatron_data(), min_size=1, max_size=3),
    per_sequence=st.booleans(),
    chunk_tokens=st.sampled_from([1, 3, 1 << 20]),
    block=st.sampled_from([1, 2, 1 << 20]),
)
def test_import_gives_one_sequence_per_document_or_per_sequence(
    parts: list[tuple[int, Documents]], per_sequence: bool, chunk_tokens: int, block: int
) -> None:
    out = memory_url("megatron")
    done: list[tuple[int, int]] = []
    # A small _BLOCK walks the index in many blocks, as a huge index would.
    with (
        tempfile.TemporaryDirectory() as tmp,
        mock.patch.object(megatron, "_BLOCK", block),
        mock.patch.object(mmidx, "_BLOCK", block),
    ):
        prefixes = [Path(tmp, f"part{i}") for i in range(len(parts))]
        for prefix, (code, documents) in zip(prefixes, parts, strict=True):
            write_reference(prefix, documents, code)
        summary = import_megatron(
            prefixes,
            out,
            per_sequence=per_sequence,
            chunk_tokens=chunk_tokens,
            progress=lambda a, b: done.append((a, b)),
            storage_format=ftj.StorageFormat(shard_tokens=16, chunk_tokens=4),
        )
    want = [s for _, documents in parts for s in expected(documents, per_sequence)]
    assert stored(out) == want
    assert stored(out, "validation") == []
    units = [len(d) if not per_sequence else sum(map(len, d)) for _, d in parts]
    assert summary["sequences_written"] == len(want)
    assert summary["skipped_empty"] == sum(units) - len(want)
    assert summary["tokens"] == sum(map(len, want))
    for stat, (code, documents) in zip(summary["prefixes"], parts, strict=True):
        assert stat["dtype_code"] == code
        assert stat["documents"] == len(documents)
        assert stat["sequences"] == sum(map(len, documents))
    codes = {code for code, _ in parts}
    attrs = ftj.open_dataset(out).attributes
    if len(codes) == 1:
        assert attrs["megatron"] == {"dtype_code": codes.pop()}
    else:
        assert "megatron" not in attrs
    assert done == [] or done[-1] == (summary["tokens"], summary["tokens"])


@pytest.mark.parametrize("code", range(1, 9))
def test_documents_of_several_sequences_with_empties(tmp_path: Path, code: int) -> None:
    docs: Documents = [[[1, 2], [], [3]], [], [[]], [[4], [5, 6, 7]]]
    write_reference(tmp_path / "a", docs, code)
    write_reference(tmp_path / "b", [[[9]], [[]]], code)
    prefixes = [tmp_path / "a", tmp_path / "b"]
    by_doc = import_megatron(prefixes, tmp_path / "docs")
    assert stored(str(tmp_path / "docs")) == [[1, 2, 3], [4, 5, 6, 7], [9]]
    assert [p["skipped_empty"] for p in by_doc["prefixes"]] == [2, 1]
    by_seq = import_megatron(prefixes, tmp_path / "seqs", per_sequence=True)
    assert stored(str(tmp_path / "seqs")) == [[1, 2], [3], [4], [5, 6, 7], [9]]
    assert by_seq["skipped_empty"] == 3
    assert by_seq["prefixes"][0] | {"prefix": None} == {
        "prefix": None,
        "dtype": np.dtype(FORMATS[code]).name,
        "dtype_code": code,
        "documents": 4,
        "sequences": 6,
        "tokens": 7,
        "skipped_empty": 2,
    }


def test_sequences_stored_out_of_order_in_bin(tmp_path: Path) -> None:
    # Pointers need not follow the sequence order: the .bin holds [5 6][1 2 3], and
    # sequence 2 shares sequence 0's bytes.
    data = struct.pack("<5H", 5, 6, 1, 2, 3)
    (tmp_path / "p.bin").write_bytes(data)
    (tmp_path / "p.idx").write_bytes(pack_index(8, [3, 2, 3], [4, 0, 4], [0, 1, 2, 3]))
    import_megatron([tmp_path / "p"], tmp_path / "out", chunk_tokens=1 << 20)
    assert stored(str(tmp_path / "out")) == [[1, 2, 3], [5, 6], [1, 2, 3]]


def test_idx_trailing_bytes_are_ignored_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    write_reference(tmp_path / "p", [[[1, 2]]], 4)
    with open(tmp_path / "p.idx", "ab") as f:
        f.write(b"\x00" * 3)  # e.g. multimodal sequence modes
    with caplog.at_level(logging.WARNING):
        import_megatron([tmp_path / "p"], tmp_path / "out")
    assert stored(str(tmp_path / "out")) == [[1, 2]]
    assert "3 bytes after doc_idx ignored" in caplog.text


@settings(max_examples=60)
@given(
    data=megatron_data(max_sequences=1).filter(lambda d: all(s for doc in d[1] for s in doc)),
    chunk_tokens=st.sampled_from([1, 2, 1 << 20]),
)
def test_round_trip_is_byte_for_byte(data: tuple[int, Documents], chunk_tokens: int) -> None:
    code, documents = data
    documents = [doc for doc in documents if doc]  # one sequence per document
    out = memory_url("roundtrip")
    with tempfile.TemporaryDirectory() as tmp:
        write_reference(Path(tmp, "orig"), documents, code)
        import_megatron([Path(tmp, "orig")], out, chunk_tokens=chunk_tokens)
        summary = export_megatron(out, Path(tmp, "copy"), chunk_tokens=chunk_tokens)
        for ext in (".idx", ".bin"):
            assert Path(tmp, "copy" + ext).read_bytes() == Path(tmp, "orig" + ext).read_bytes()
        assert sorted(p.name for p in Path(tmp).iterdir()) == [
            "copy.bin",
            "copy.idx",
            "orig.bin",
            "orig.idx",
        ]
    assert summary["dtype_code"] == code
    assert summary["sequences"] == len(documents)


@pytest.mark.parametrize(
    ("max_id", "dtype_code", "code"),
    [(65499, None, 8), (65500, None, 4), (2**31 - 1, None, 4), (300, 3, 3), (7, 6, 6)],
)
def test_export_dtype_choice(
    tmp_path: Path, max_id: int, dtype_code: int | None, code: int
) -> None:
    ftj.write_dataset(tmp_path / "ds", {"train": [[max_id, 0], [1]]})
    summary = export_megatron(tmp_path / "ds", tmp_path / "out", dtype_code=dtype_code)
    assert summary["dtype_code"] == code
    idx = (tmp_path / "out.idx").read_bytes()
    assert idx[17] == code
    tokens = struct.unpack(f"<3{FORMATS[code]}", (tmp_path / "out.bin").read_bytes())
    assert list(tokens) == [max_id, 0, 1]
    sizes_pointers_docs = struct.unpack("<2i2q3q", idx[34:])
    item = struct.calcsize(FORMATS[code])
    assert sizes_pointers_docs == (2, 1, 0, 2 * item, 0, 1, 2)


@pytest.mark.parametrize(("max_id", "code"), [(256, 1), (128, 2), (2**15, 3), (2**24 + 1, 7)])
def test_export_refuses_a_dtype_too_small(tmp_path: Path, max_id: int, code: int) -> None:
    ftj.write_dataset(tmp_path / "ds", {"train": [[max_id]]})
    with pytest.raises(ValueError, match=f"dtype code {code} .* has max_token_id {max_id}"):
        export_megatron(tmp_path / "ds", tmp_path / "out", dtype_code=code)
    assert list(tmp_path.glob("out*")) == []


def test_export_refuses_a_recorded_dtype_too_small_naming_the_attribute(tmp_path: Path) -> None:
    ftj.write_dataset(
        tmp_path / "ds", {"train": [[300]]}, attributes={"megatron": {"dtype_code": 1}}
    )
    with pytest.raises(ValueError, match=r"\(uint8, from the megatron.dtype_code attribute\)"):
        export_megatron(tmp_path / "ds", tmp_path / "out")
    assert export_megatron(tmp_path / "ds", tmp_path / "out", dtype_code=3)["dtype"] == "int16"


def test_export_of_an_empty_split_and_back(tmp_path: Path) -> None:
    ftj.write_dataset(tmp_path / "ds", {"train": [[1]]})
    summary = export_megatron(tmp_path / "ds", tmp_path / "val", split="validation")
    assert summary["sequences"] == 0
    assert (tmp_path / "val.idx").read_bytes() == pack_index(8, [], [], [0])
    assert (tmp_path / "val.bin").read_bytes() == b""
    import_megatron([tmp_path / "val"], tmp_path / "back")
    assert stored(str(tmp_path / "back")) == []


def test_failed_export_keeps_no_partial_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ftj.write_dataset(tmp_path / "ds", {"train": [[1, 2], [3, 4]]})
    export_megatron(tmp_path / "ds", tmp_path / "out")
    before = {p.name: p.read_bytes() for p in tmp_path.glob("out*")}
    calls = []

    def failing_decode(encoded: np.ndarray) -> np.ndarray:
        calls.append(1)
        if len(calls) == 2:
            raise OSError("disk full")
        return ftj.decode(encoded)

    monkeypatch.setattr(megatron, "decode", failing_decode)
    with pytest.raises(OSError, match="disk full"):
        export_megatron(tmp_path / "ds", tmp_path / "out", chunk_tokens=1)
    assert {p.name: p.read_bytes() for p in tmp_path.glob("out*")} == before


def bad_files(tmp: Path, case: str) -> tuple[Path, str]:
    """Writes a broken pair for ``case``; returns its prefix and the expected message."""
    p = tmp / "bad"
    ok: dict[str, Any] = {"code": 8, "sizes": [2, 1], "pointers": [0, 4], "doc_idx": [0, 1, 2]}
    data = struct.pack("<3H", 1, 2, 3)
    args: dict[str, Any] = {}
    cut: int | None = None  # keep only the first ``cut`` bytes of the .idx
    if case == "magic":
        args, want = {"magic": b"MMIDIDY\x00\x00"}, r"bytes 0-8 are b'MMIDIDY.*expected the magic"
    elif case == "version":
        args, want = {"version": 2}, r"version \(byte 9\) is 2, expected 1"
    elif case == "dtype":
        args, want = {"code": 9}, r"dtype code \(byte 17\) is 9, expected one of \[1, 2, 3"
    elif case == "header":
        cut, want = 20, "20 bytes, shorter than the 34-byte header"
    elif case == "truncated":
        cut = -1
        want = (
            r"doc_idx \(3 entries from byte 58\) would end at byte 82, beyond the file's 81 bytes"
        )
    elif case == "pointer":
        args, want = {"pointers": [0, 6]}, r"sequence 1 \(pointers\[1\] = 6, sizes\[1\] = 1\) spans"
        want += r" bytes \[6, 8\), expected within the 6 bytes of .*bad.bin"
    elif case == "negative_pointer":
        args, want = {"pointers": [-2, 4]}, r"sequence 0 \(pointers\[0\] = -2"
    elif case == "negative_size":
        args, want = {"sizes": [2, -1]}, r"sizes\[1\] is -1, expected >= 0"
    elif case == "doc_start":
        args, want = {"doc_idx": [1, 2]}, r"doc_idx is \[1, ..., 2\], expected to start at 0"
    elif case == "doc_end":
        args, want = {"doc_idx": [0, 1]}, r"doc_idx is \[0, ..., 1\].* end at num_sequences 2"
    elif case == "doc_empty":
        args, want = {"doc_idx": []}, r"doc_idx is empty"
    elif case == "doc_order":
        args = {"sizes": [2, 1, 0], "pointers": [0, 4, 6], "doc_idx": [0, 2, 1, 3]}
        want = r"doc_idx\[2\] is 1, below doc_idx\[1\] = 2: expected non-decreasing"
    elif case == "fraction":
        args, data = {"code": 6}, struct.pack("<3d", 1, 2, 2.5)
        args["pointers"] = [0, 16]
        want = r"bad.bin: sequence 1, token 0 \(byte 16\) is 2.5, expected a whole number"
    elif case == "float32_overflow":
        args, data = {"code": 7, "pointers": [0, 8]}, struct.pack("<3f", 1, 2**31, 3)
        want = r"sequence 0, token 1 \(byte 4\) is 2147483648.0"
    elif case == "nan":
        args, data = {"code": 7, "pointers": [0, 8]}, struct.pack("<3f", 1, 2, float("nan"))
        want = r"sequence 1, token 0 \(byte 8\) is nan"
    elif case == "negative_id":
        args, data = {"code": 3}, struct.pack("<3h", 1, 2, -3)
        want = r"sequence 1, token 0 \(byte 4\) is -3, expected a whole number in \[0, 2147483647\]"
    elif case == "large_id":
        args, data = {"code": 5, "pointers": [0, 16]}, struct.pack("<3q", 2**31, 2, 3)
        want = r"sequence 0, token 0 \(byte 0\) is 2147483648"
    else:
        raise AssertionError(case)
    Path(f"{p}.idx").write_bytes(pack_index(**(ok | args))[:cut])
    Path(f"{p}.bin").write_bytes(data)
    return p, want


BAD_CASES = [
    "magic",
    "version",
    "dtype",
    "header",
    "truncated",
    "pointer",
    "negative_pointer",
    "negative_size",
    "doc_start",
    "doc_end",
    "doc_empty",
    "doc_order",
    "fraction",
    "float32_overflow",
    "nan",
    "negative_id",
    "large_id",
]


@pytest.mark.parametrize("block", [1, 1 << 20])
@pytest.mark.parametrize("case", BAD_CASES)
def test_bad_input_is_refused_precisely_and_leaves_no_dataset(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str, block: int
) -> None:
    prefix, want = bad_files(tmp_path, case)
    good = tmp_path / "good"
    write_reference(good, [[[7, 8]]], 8)
    out = tmp_path / "out"
    monkeypatch.setattr(megatron, "_BLOCK", block)
    monkeypatch.setattr(mmidx, "_BLOCK", block)
    with pytest.raises(MegatronFormatError, match=want):
        # chunk_tokens=1: a bad token is met after earlier chunks were written.
        import_megatron([good, prefix], out, chunk_tokens=1)
    with pytest.raises(ftj.FormatError):
        ftj.open_dataset(out)


def test_bin_shorter_than_its_index_says(tmp_path: Path) -> None:
    write_reference(tmp_path / "p", [[[1, 2]], [[3, 4, 5]]], 4)
    with open(tmp_path / "p.bin", "r+b") as f:
        f.truncate(19)
    with pytest.raises(MegatronFormatError, match=r"sequence 1 .* spans bytes \[8, 20\)"):
        read_index(tmp_path / "p")


def cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    megatron.add_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    code: int = args.run(args)
    return code


def test_cli_import_and_export(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_reference(tmp_path / "a", [[[1, 2], [3]], [[]]], 3)
    write_reference(tmp_path / "b", [[[4]]], 3)
    out = str(tmp_path / "ds")
    assert cli(["import-megatron", str(tmp_path / "a"), str(tmp_path / "b"), out]) == 0
    line = capsys.readouterr().out
    assert "imported 2 Megatron dataset(s) into" in line
    assert "[train]: 2 sequences, 4 tokens, 1 empty skipped" in line
    assert stored(out) == [[1, 2, 3], [4]]

    argv = ["import-megatron", str(tmp_path / "a"), out, "--per-sequence", "--json"]
    assert cli(argv) == 1
    assert "already holds a flat-tokens dataset" in capsys.readouterr().err
    assert cli([*argv, "--overwrite", "--split", "validation"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["sequences_written"] == 2 and summary["split"] == "validation"
    assert stored(out, "validation") == [[1, 2], [3]] and stored(out) == []

    assert cli(["export-megatron", out, str(tmp_path / "e"), "--split", "validation"]) == 0
    assert "2 sequences, 3 tokens as int16 (code 3)" in capsys.readouterr().out
    assert cli(["export-megatron", out, str(tmp_path / "f"), "--dtype-code", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["dtype"] == "uint8"
    assert (tmp_path / "f.bin").read_bytes() == b""


def test_cli_errors_go_to_stderr_with_status_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "x.idx").write_bytes(b"NOTANIDX" * 8)
    (tmp_path / "x.bin").write_bytes(b"")
    assert cli(["import-megatron", str(tmp_path / "x"), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("import-megatron: ") and "expected the magic" in err
    assert cli(["import-megatron", str(tmp_path / "missing"), str(tmp_path / "out")]) == 1
    assert "missing.idx" in capsys.readouterr().err
    assert cli(["export-megatron", str(tmp_path / "nothing"), str(tmp_path / "e")]) == 1
    assert "no flat-tokens dataset here" in capsys.readouterr().err
    ftj.write_dataset(tmp_path / "ds", {"train": [[300]]})
    assert cli(["export-megatron", str(tmp_path / "ds"), str(tmp_path / "e"), "--dtype-code", "1"])
    assert "holds token ids up to 255" in capsys.readouterr().err


def test_cli_imports_into_an_extra_split_and_exports_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before: --split allowed only train and validation (argparse's exit 2).
    write_reference(tmp_path / "a", [[[1, 2]], [[3, 4, 5]]], 8)
    out = str(tmp_path / "ds")
    assert cli(["import-megatron", str(tmp_path / "a"), out, "--split", "test"]) == 0
    assert "[test]: 2 sequences, 5 tokens" in capsys.readouterr().out
    assert ftj.open_dataset(out).splits == ("train", "validation", "test")
    assert stored(out, "test") == [[1, 2], [3, 4, 5]] and stored(out) == []
    assert cli(["export-megatron", out, str(tmp_path / "e"), "--split", "test"]) == 0
    for ext in (".idx", ".bin"):
        assert (tmp_path / f"e{ext}").read_bytes() == (tmp_path / f"a{ext}").read_bytes()
    assert cli(["export-megatron", out, str(tmp_path / "f"), "--split", "dev"]) == 1
    assert capsys.readouterr().err.endswith("has no split 'dev'; it has train, validation, test\n")
    bad = str(tmp_path / "bad")
    assert cli(["import-megatron", str(tmp_path / "a"), bad, "--split", "Test"]) == 1
    err = capsys.readouterr().err
    assert (
        err.startswith("import-megatron: split name 'Test' is not allowed")
        and "write 'test'" in err
    )
    assert not Path(bad).exists()
