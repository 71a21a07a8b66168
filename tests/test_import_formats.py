"""import-datatrove, import-dolma and import-levanter, from files written as each
tool writes them: datatrove's own ``TokenizedFile`` (datatrove is in the test
extra); dolma's ``MemmapWriter`` layout (dolma 1.2, ``python/dolma/tokenizer/
memmap_writer.py``: dolma itself pins numpy 1) and Levanter's ``JaggedArrayStore``
layout (levanter ``src/levanter/store/jagged_array.py``, ``_get_spec`` and
``extend``; Levanter needs jax's whole training stack) written here with numpy,
csv and tensorstore exactly as those sources do."""

from __future__ import annotations

import csv
import gzip
import json
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tensorstore as ts
from buckets import S3
from datatrove.pipeline.tokens.tokenizer import TokenizedFile
from hypothesis import given, settings
from hypothesis import strategies as st
from servers import gcs_through
from textdata import files

import flat_tokens_jax as ftj
from flat_tokens_jax.cli import main as cli
from flat_tokens_jax.convert.corpora import import_datatrove, import_dolma, import_levanter
from flat_tokens_jax.convert.inputs import InputError
from flat_tokens_jax.loader.config import LoaderConfig
from flat_tokens_jax.store.store import Store

Doc = tuple[list[int], list[int] | None]  # tokens, and the loss mask where there is one


def documents(rng: np.random.Generator, n: int, top: int, loss: bool = False) -> list[Doc]:
    """``n`` documents of 0 to 40 ids below ``top`` (some empty)."""
    out: list[Doc] = []
    for _ in range(n):
        ids = rng.integers(0, top, int(rng.integers(0, 41))).tolist()
        out.append((ids, rng.integers(0, 2, len(ids)).tolist() if loss else None))
    return out


def stored(url: str | Path, split: str = "train", **options: Any) -> list[Doc]:
    """Every sequence of ``split``, with its loss mask if the split has one."""
    ft = ftj.open_dataset(url, ftj.StoreOptions(**options) if options else None)[split]
    out: list[Doc] = []
    for i in range(ft.num_sequences):
        a, b = ft.sequence_bounds(np.array([i]))
        ids = ftj.decode(ft.request_encoded(a, b).result()[0]).tolist()
        got = ft.request_loss_mask(a, b)
        out.append((ids, None if got is None else got.result()[0].astype(int).tolist()))
    return out


def nonempty(docs: list[Doc]) -> list[Doc]:
    return [d for d in docs if d[0]]


def write_datatrove(
    folder: Path,
    shards: list[list[Doc]],
    token_size: int = 2,
    tokenizer: str | None = "gpt2",
    loss: bool | None = None,
) -> None:
    """Each file's documents written by datatrove's own ``TokenizedFile``, with a
    loss file where ``loss`` (by default: where the documents have masks)."""
    for k, docs in enumerate(shards):
        with_loss = any(mask is not None for _, mask in docs) if loss is None else loss
        out = TokenizedFile(
            str(folder),
            f"{k:03d}_shuffled.ds",
            save_loss_metadata=with_loss,
            tokenizer_name_or_path=tokenizer,
            save_final_metadata=True,
            token_size=token_size,
        )
        for ids, mask in docs:
            out.write(ids, None if mask is None else np.array(mask, bool))
        out.close()


def write_dolma(base: Path, docs: list[Doc], dtype: str) -> None:
    """``base.npy`` and ``base.csv.gz`` as dolma's ``MemmapWriter`` leaves them:
    the tokens back to back (its memmap, resized to what was written), and one
    ``csv.writer`` row ``start,end,id,src,loc`` per document."""
    tokens = [t for ids, _ in docs for t in ids]
    np.asarray(tokens, dtype).tofile(base.with_suffix(".npy"))
    with gzip.open(base.with_suffix(".csv.gz"), "wt") as f:
        rows, at = csv.writer(f), 0
        for i, (ids, _) in enumerate(docs):
            rows.writerow((at, at + len(ids), f"doc-{i}", "s3://b/src, with comma.json.gz", i))
            at += len(ids)


def write_levanter(
    folder: Path, docs: list[Doc], dtype: str = "int32", ledger: dict[str, Any] | None = None
) -> None:
    """``input_ids/{offsets,data}`` as levanter's ``JaggedArrayStore`` writes them
    (``_get_spec``: zarr3, a regular grid of 256Ki * 512 elements sharded into
    chunks of 256Ki, blosc; shape ``[2**54]``; ``extend``: the data, the row ends
    at ``offsets[1:n + 1]``, then ``offsets[0] = n``), and ``shard_ledger.json``."""

    def array(name: str, dtype: str) -> Any:
        spec = {
            "driver": "zarr3",
            "kvstore": {"driver": "file", "path": str(folder / "input_ids" / name)},
            "metadata": {
                "chunk_grid": {
                    "name": "regular",
                    "configuration": {"chunk_shape": [256 * 1024 * 512]},
                },
                "codecs": [
                    {
                        "name": "sharding_indexed",
                        "configuration": {
                            "chunk_shape": [256 * 1024],
                            "codecs": [{"name": "blosc", "configuration": {"clevel": 5}}],
                        },
                    }
                ],
            },
        }
        return ts.open(spec, dtype=dtype, shape=[2**54], create=True).result()

    offsets, data = array("offsets", "int64"), array("data", dtype)
    lengths = [len(ids) for ids, _ in docs]
    tokens = [t for ids, _ in docs for t in ids]
    if tokens:
        data[: len(tokens)].write(np.asarray(tokens, dtype)).result()
    if docs:
        offsets[1 : len(docs) + 1].write(np.cumsum(lengths)).result()
    offsets[0].write(len(docs)).result()
    default = {
        "total_num_rows": len(docs),
        "shard_rows": {"": len(docs)},
        "is_finished": True,
        "finished_shards": [""],
        "field_counts": {},
        "metadata": {"preprocessor_metadata": {"tokenizer": "gpt2", "vocab_size": 50257}},
    }
    (folder / "shard_ledger.json").write_text(json.dumps(default if ledger is None else ledger))


@settings(max_examples=15)
@given(
    st.lists(st.lists(st.integers(0, 30), max_size=6), min_size=1, max_size=3),
    st.sampled_from([2, 4]),
    st.booleans(),
    st.sampled_from([1, 7, 1 << 20]),
)
def test_datatrove_gives_every_document_and_loss_mask_in_order(
    shape: list[list[int]], token_size: int, loss: bool, chunk_tokens: int
) -> None:
    rng = np.random.default_rng(len(shape))
    top = 2**16 if token_size == 2 else 2**31
    shards = [
        [
            (rng.integers(0, top, n).tolist(), rng.integers(0, 2, n).tolist() if loss else None)
            for n in lengths
        ]
        for lengths in shape
    ]
    with tempfile.TemporaryDirectory() as tmp:
        write_datatrove(Path(tmp) / "in", shards, token_size, loss=loss)
        out = Path(tmp) / "out"
        summary = import_datatrove(Path(tmp) / "in", out, chunk_tokens=chunk_tokens)
        docs = [d for f in shards for d in f]
        assert stored(out) == nonempty(docs)
        assert summary["skipped_empty"] == len(docs) - len(nonempty(docs))
        assert [f["documents"] for f in summary["files"]] == [len(f) for f in shards]
        info = ftj.open_dataset(out).info
        assert info is not None and info.flags["tokenizer"] == "gpt2"
        assert info.flags["loss_mask"] is loss
        assert info.inputs["count"] == len(shards)


def test_datatrove_refusals_name_the_file_and_both_values(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    docs = documents(rng, 6, 1000, loss=True)
    total = sum(len(d[0]) for d in docs)
    write_datatrove(tmp_path / "a", [docs])
    name = tmp_path / "a" / "000_shuffled.ds"

    def refused(match: str, path: Any = name) -> None:
        with pytest.raises(InputError, match=match):
            import_datatrove(path, tmp_path / "out", overwrite=True)
        assert not (tmp_path / "out" / "zarr.json").exists()

    meta = Path(f"{name}.metadata")
    good_meta = meta.read_text()
    meta.write_text(good_meta.replace(f"\n{total}\n", f"\n{total + 1}\n"))
    refused(rf"{name}.metadata counts {total + 1} tokens but {name}.index ends at {total}")
    meta.write_text(good_meta)
    raw = name.read_bytes()
    name.write_bytes(raw[:-2])
    refused(
        rf"{name} holds fewer than {2 * total:,} bytes, but {name}.index ends at token {total:,}"
    )
    name.write_bytes(raw + b"\0\0")
    refused(rf"{name} holds more than {2 * total:,} bytes")
    name.write_bytes(raw)
    loss = Path(f"{name}.loss")
    loss.write_bytes(loss.read_bytes()[:-1])
    refused(rf"{name}.loss holds fewer than {total:,} bytes")
    index = Path(f"{name}.index")
    ends = np.fromfile(index, "<u8")
    np.concatenate([ends, [ends[-1] - 1]]).astype("<u8").tofile(index)
    refused(rf"{name}.index: document {ends.size} ends at {ends[-1] - 1}, before {ends[-1]}")
    write_datatrove(tmp_path / "b", [docs[:2], [(d[0], None) for d in docs[2:]]])
    refused(r"_shuffled.ds.loss exists but .*001_shuffled.ds.loss does not", tmp_path / "b")
    write_datatrove(tmp_path / "c", [docs[:2]], tokenizer="gpt2")
    write_datatrove(tmp_path / "d", [docs[:2]], tokenizer="llama")
    both = [tmp_path / "c", tmp_path / "d"]
    refused(r"made by tokenizer 'gpt2' but .*d/000_shuffled.ds by 'llama'", both)
    write_datatrove(tmp_path / "e", [[([1, 2], None), ([3, 2**31, 4], None)]], token_size=4)
    big = tmp_path / "e" / "000_shuffled.ds"
    refused(rf"{big}: token 3 is {2**31}, outside \[0, {2**31 - 1}\]", big)


def test_datatrove_without_a_tokenizer_name_through_a_glob(tmp_path: Path) -> None:
    docs = documents(np.random.default_rng(2), 5, 300)
    write_datatrove(tmp_path / "in", [docs], tokenizer=None)  # "Unknown Tokenizer|2|2"
    assert "Unknown Tokenizer|2|2" in (tmp_path / "in" / "000_shuffled.ds.metadata").read_text()
    import_datatrove(str(tmp_path / "in" / "*.ds"), tmp_path / "out")
    info = ftj.open_dataset(tmp_path / "out").info
    assert info is not None and info.flags["tokenizer"] is None
    assert stored(tmp_path / "out") == nonempty(docs)


@settings(max_examples=15)
@given(st.lists(st.lists(st.integers(0, 25), max_size=8), min_size=1, max_size=3), st.booleans())
def test_dolma_gives_every_document_in_order(shape: list[list[int]], wide: bool) -> None:
    dtype = "uint32" if wide else "uint16"
    rng = np.random.default_rng(sum(map(len, shape)))
    top = 2**31 if wide else 2**16
    shards = [[(rng.integers(0, top, n).tolist(), None) for n in lengths] for lengths in shape]
    with tempfile.TemporaryDirectory() as tmp:
        for k, docs in enumerate(shards):
            write_dolma(Path(tmp) / f"part-{k:05d}-00000", docs, dtype)
        summary = import_dolma(tmp, Path(tmp) / "out", dtype=dtype, chunk_tokens=5)
        docs = [d for f in shards for d in f]
        assert stored(Path(tmp) / "out") == nonempty(docs)
        assert summary["sequences_written"] == len(nonempty(docs))
        info = ftj.open_dataset(Path(tmp) / "out").info
        assert info is not None and info.flags == {"converter": "import-dolma", "dtype": dtype}


def test_dolma_refusals_name_the_file_and_both_values(tmp_path: Path) -> None:
    docs = documents(np.random.default_rng(3), 6, 1000)
    base = tmp_path / "part-00000-00000"
    write_dolma(base, docs, "uint16")
    total = sum(len(d[0]) for d in docs)
    npy, table = base.with_suffix(".npy"), base.with_suffix(".csv.gz")

    def refused(match: str, dtype: str = "uint16") -> None:
        with pytest.raises(InputError, match=match):
            import_dolma(npy, tmp_path / "out", dtype=dtype, overwrite=True)
        assert not (tmp_path / "out" / "zarr.json").exists()

    refused(rf"{npy} holds fewer than {4 * total:,} bytes, but {table} ends at token", "uint32")
    raw = npy.read_bytes()
    npy.write_bytes(raw + b"\0")
    refused(rf"{npy} holds more than {2 * total:,} bytes")
    npy.write_bytes(raw)
    rows = gzip.decompress(table.read_bytes()).decode().splitlines()
    first = rows[1].split(",", 2)
    rows[1] = ",".join([str(int(first[0]) + 1), first[1], first[2]])
    table.write_bytes(gzip.compress(("\n".join(rows) + "\n").encode()))
    refused(rf"{table}: row 2 starts at {int(first[0]) + 1}, not at {int(first[0])}")
    table.write_bytes(gzip.compress(b"0,x,id,src,0\n"))
    refused(rf"{table}: row 1 is not start,end,id,src,loc")
    with pytest.raises(ValueError, match="dtype must be 'uint16' or 'uint32'"):
        import_dolma(npy, tmp_path / "out", dtype="int32")


@pytest.mark.parametrize("dtype", ["int32", "uint16", "int64"])
def test_levanter_gives_every_row_in_order(tmp_path: Path, dtype: str) -> None:
    docs = documents(np.random.default_rng(4), 40, 2**15)
    write_levanter(tmp_path / "cache", docs, dtype)
    summary = import_levanter(tmp_path / "cache", tmp_path / "out", chunk_tokens=50)
    assert stored(tmp_path / "out") == nonempty(docs)
    assert summary["caches"][0]["documents"] == len(docs)
    info = ftj.open_dataset(tmp_path / "out").info
    assert info is not None and info.flags["tokenizer"] == "gpt2"
    assert info.flags["vocab_size"] == 50257


def test_levanter_refusals(tmp_path: Path) -> None:
    docs = documents(np.random.default_rng(5), 4, 100)
    write_levanter(tmp_path / "a", docs, ledger={"total_num_rows": 4, "is_finished": False})
    with pytest.raises(InputError, match=r"a/shard_ledger.json: the cache is not finished"):
        import_levanter(tmp_path / "a", tmp_path / "out")
    write_levanter(tmp_path / "b", docs, ledger={"total_num_rows": 5, "is_finished": True})
    with pytest.raises(InputError, match=r"total_num_rows is 5 but .*b/input_ids/offsets holds 4"):
        import_levanter(tmp_path / "b", tmp_path / "out")
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "cache_ledger.json").write_text('{"chunks": []}')
    with pytest.raises(InputError, match=r"old/cache_ledger.json: a cache older than levanter#716"):
        import_levanter(tmp_path / "old", tmp_path / "out")
    write_levanter(tmp_path / "c", docs)
    where = {"driver": "file", "path": str(tmp_path / "c/input_ids/offsets")}
    offsets = ts.open({"driver": "zarr3", "kvstore": where}).result()
    offsets[4].write(600_000).result()  # the last row ends past the chunks written
    with pytest.raises(InputError, match=r"offsets: row 3 ends at 600000, past the data written"):
        import_levanter(tmp_path / "c", tmp_path / "out")
    assert not (tmp_path / "out" / "zarr.json").exists()


@pytest.mark.remote
def test_datatrove_from_gcs_dolma_and_levanter_from_s3(gcs: str, s3: S3, tmp_path: Path) -> None:
    rng = np.random.default_rng(6)
    shards = [documents(rng, 7, 5000, loss=True) for _ in range(2)]
    write_datatrove(tmp_path / "dt", shards)
    with gcs_through(gcs):
        bucket = Store("gs://bucket/dt/", ftj.StoreOptions())
        for path in sorted((tmp_path / "dt").iterdir()):
            bucket.wait(bucket.kv.write(path.name, path.read_bytes()))
        summary = import_datatrove("gs://bucket/dt/*.ds", tmp_path / "from_gcs")
        local = import_datatrove(tmp_path / "dt", tmp_path / "local")
    assert stored(tmp_path / "from_gcs") == nonempty([d for f in shards for d in f])
    assert [f["file"] for f in summary["files"]] == [
        f"gs://bucket/dt/{k:03d}_shuffled.ds" for k in range(2)
    ]
    gcs_info, local_info = (ftj.open_dataset(tmp_path / n).info for n in ("from_gcs", "local"))
    assert gcs_info is not None and local_info is not None
    assert gcs_info.inputs["sha256"] == local_info.inputs["sha256"]  # the same bytes hashed
    assert local["tokens"] == summary["tokens"]
    docs = documents(rng, 9, 60000)
    write_dolma(tmp_path / "part-0", docs, "uint16")
    bucket = Store("s3://bucket/dolma/", s3.options)
    for suffix in (".npy", ".csv.gz"):
        bucket.wait(bucket.kv.write("part-0" + suffix, (tmp_path / f"part-0{suffix}").read_bytes()))
    import_dolma("s3://bucket/dolma/", tmp_path / "from_s3", dtype="uint16", options=s3.options)
    assert stored(tmp_path / "from_s3") == nonempty(docs)
    beam = ["--runner=FnApiRunner"]  # its workers read s3 with the options given
    import_dolma(
        "s3://bucket/dolma/*.npy",
        tmp_path / "beam",
        dtype="uint16",
        options=s3.options,
        runner="beam",
        pipeline_args=beam,
    )
    assert files(tmp_path / "beam") == files(tmp_path / "from_s3")
    write_levanter(tmp_path / "lev", docs)
    bucket = Store("s3://bucket/lev/", s3.options)
    for path in sorted(p for p in (tmp_path / "lev").rglob("*") if p.is_file()):
        key = path.relative_to(tmp_path / "lev").as_posix()
        bucket.wait(bucket.kv.write(key, path.read_bytes()))
    import_levanter("s3://bucket/lev", tmp_path / "lev_from_s3", options=s3.options)
    assert stored(tmp_path / "lev_from_s3") == nonempty(docs)


@pytest.mark.parametrize("kind", ["datatrove", "dolma", "levanter"])
def test_an_imported_corpus_of_each_format_loads_through_the_loader(
    tmp_path: Path, kind: str
) -> None:
    docs = documents(np.random.default_rng(7), 60, 500, loss=kind == "datatrove")
    if kind == "datatrove":
        write_datatrove(tmp_path / "in", [docs])
        import_datatrove(tmp_path / "in", tmp_path / "out")
    elif kind == "dolma":
        write_dolma(tmp_path / "in", docs, "uint16")
        import_dolma(tmp_path / "in.npy", tmp_path / "out", dtype="uint16")
    else:
        write_levanter(tmp_path / "in", docs)
        import_levanter(tmp_path / "in", tmp_path / "out")
    ft = ftj.open_dataset(tmp_path / "out")["train"]
    loader = ftj.Loader(ft, LoaderConfig(batch_size=2, seq_len=8, shuffle=False))
    tokens = [t for ids, _ in nonempty(docs) for t in ids]
    masks = [m for _, mask in nonempty(docs) for m in mask or []]
    for step in range(3):
        batch = loader.host_batch(step)
        rows = [(2 * step + r) * 8 for r in range(2)]
        assert batch["targets"].tolist() == [tokens[r : r + 8] for r in rows]
        if masks:  # the loss mask of each target token
            assert batch["loss_mask"].astype(int).tolist() == [masks[r : r + 8] for r in rows]


def test_cli_imports_each_format_as_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    docs = documents(np.random.default_rng(8), 5, 300)
    write_datatrove(tmp_path / "dt", [docs])
    write_dolma(tmp_path / "part-0", docs, "uint32")
    write_levanter(tmp_path / "lev", docs)
    for argv in (
        ["import-datatrove", str(tmp_path / "dt"), str(tmp_path / "a")],
        ["import-dolma", str(tmp_path / "part-0.npy"), str(tmp_path / "b"), "--dtype", "uint32"],
        ["import-levanter", str(tmp_path / "lev"), str(tmp_path / "c"), "--split", "test"],
    ):
        assert cli([*argv, "--json"]) == 0
        summary = json.loads(capsys.readouterr().out)
        assert summary["sequences_written"] == len(nonempty(docs))
        assert summary["split"] == ("test" if "--split" in argv else "train")
    assert stored(tmp_path / "c", "test") == nonempty(docs)
    assert (
        cli(
            ["import-dolma", str(tmp_path / "part-0.npy"), str(tmp_path / "b"), "--dtype", "uint16"]
        )
        == 1
    )
    assert "already holds a flat-tokens dataset" in capsys.readouterr().err
    assert cli(["import-levanter", str(tmp_path / "lev"), str(tmp_path / "d")]) == 0
    assert "imported 1 Levanter cache into" in capsys.readouterr().out


def test_cli_names_the_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The file a user named when it is missing, else the one beside it the tool writes."""
    docs = documents(np.random.default_rng(9), 3, 300)
    write_datatrove(tmp_path / "dt", [docs])
    (tmp_path / "dt" / "000_shuffled.ds.index").unlink()
    write_dolma(tmp_path / "part-0", docs, "uint16")
    (tmp_path / "part-0.csv.gz").unlink()
    out = str(tmp_path / "out")
    for argv, said in (
        (["import-dolma", "nothere.npy", out, "--dtype", "uint16"], "nothere.npy: no such file"),
        (["import-datatrove", "nothere.ds", out], "nothere.ds: no such file"),
        (
            ["import-datatrove", str(tmp_path / "dt"), out],
            "000_shuffled.ds.index: no such file, which datatrove writes beside",
        ),
        (
            ["import-dolma", str(tmp_path / "part-0.npy"), out, "--dtype", "uint16"],
            "part-0.csv.gz: no such file, which dolma writes beside",
        ),
        (["import-levanter", str(tmp_path), out], "no Levanter cache (neither"),
    ):
        assert cli(argv) == 1
        err = capsys.readouterr().err
        assert said in err and "Traceback" not in err
        with pytest.raises(ftj.FormatError, match="no flat-tokens dataset here"):
            ftj.open_dataset(out)


SMALL = ftj.StorageFormat(shard_tokens=64, chunk_tokens=16)
TWO_PROCESSES = [
    "--runner=FnApiRunner",
    "--direct_running_mode=multi_processing",
    "--direct_num_workers=2",
]


def test_beam_writes_the_local_imports_bytes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each file a part, the parts assembled: the local import's bytes, loss masks,
    info and all (part boundaries fall inside output shards)."""
    rng = np.random.default_rng(9)
    shards = [documents(rng, n, 3000, loss=True) for n in (9, 0, 4, 13)]
    shards[2].append(([], []))
    write_datatrove(tmp_path / "dt", shards, loss=True)
    local = import_datatrove(tmp_path / "dt", tmp_path / "local", storage_format=SMALL)
    beam = import_datatrove(
        tmp_path / "dt",
        tmp_path / "beam",
        storage_format=SMALL,
        runner="beam",
        pipeline_args=TWO_PROCESSES,
    )
    assert files(tmp_path / "beam") == files(tmp_path / "local")
    for key in ("sequences_written", "tokens", "skipped_empty", "inputs"):
        assert beam[key] == local[key], key
    assert beam["skipped_empty"] > 0 and beam["runner"] == "FnApiRunner"
    for k in range(3):
        write_dolma(tmp_path / f"part-{k}", documents(rng, 6, 60000), "uint16")
    argv = ["import-dolma", str(tmp_path / "part-*.npy"), "--dtype", "uint16"]
    assert cli([*argv, str(tmp_path / "d_local")]) == 0
    assert cli([*argv, str(tmp_path / "d_beam"), "--runner", "beam", "--", *TWO_PROCESSES]) == 0
    assert "imported 3 dolma file(s) into" in capsys.readouterr().out
    assert files(tmp_path / "d_beam") == files(tmp_path / "d_local")
    assert cli([*argv, str(tmp_path / "d2"), "--", "--direct_num_workers=2"]) == 1
    assert "are Beam's: add runner beam" in capsys.readouterr().err
    inside = str(tmp_path / "part-0.npy" / "out")
    assert cli([*argv, inside, "--runner", "beam", "--", *TWO_PROCESSES]) == 1
    assert "lies inside the input" in capsys.readouterr().err
