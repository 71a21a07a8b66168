"""flat_tokens_jax.convert.beam: the Beam pipeline writes the local converter's bytes.

Runners are always named: Beam's ``DirectRunner`` may start PrismRunner, a
binary it downloads. FnApiRunner runs worker processes ("multi_processing");
BundleBasedDirectRunner runs in this process and retries a failed bundle.
"""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from apache_beam.io.filesystem import CompressionTypes, FileMetadata, MatchResult
from apache_beam.io.localfilesystem import LocalFileSystem
from apache_beam.options.pipeline_options import DirectOptions, StandardOptions
from buckets import S3
from rawstore import stored
from textdata import corpus_texts, files, write_format, write_jsonl

import flat_tokens_jax as ftj
from flat_tokens_jax.cli import main
from flat_tokens_jax.convert.assemble import part_url
from flat_tokens_jax.convert.beam import convert_beam, pipeline_options
from flat_tokens_jax.convert.inputs import InputError
from flat_tokens_jax.convert.text import convert
from flat_tokens_jax.store.location import STAGING, claim_location
from flat_tokens_jax.store.store import Store

SMALL = ftj.StorageFormat(shard_tokens=64, chunk_tokens=16)
TWO_PROCESSES = [
    "--runner=FnApiRunner",
    "--direct_running_mode=multi_processing",
    "--direct_num_workers=2",
]
IN_PROCESS = ["--runner=FnApiRunner"]
RETRYING = ["--runner=BundleBasedDirectRunner"]
# Input files: documents per file (0: an empty file), and the format of each.
SIZES = [3, 1, 0, 7, 2, 1, 12, 4, 1, 5]
KINDS = ["jsonl", "gz", "jsonl", "parquet", "zst", "jsonl", "jsonl", "gz", "parquet", "jsonl"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Ten small input files of several formats, one of them empty, one document empty."""
    root = tmp_path_factory.mktemp("corpus")
    texts = iter(corpus_texts(sum(SIZES), 1200))
    for i, (size, kind) in enumerate(zip(SIZES, KINDS, strict=True)):
        documents: list[dict[str, Any]] = [{"text": next(texts), "i": i} for _ in range(size)]
        if i == 5:
            documents.append({"text": "", "i": i})
        if kind == "jsonl":
            write_jsonl(root / f"f{i:02d}.jsonl", documents)
        else:
            write_format(kind, root / f"f{i:02d}", documents)
    return root


def same_but_input_names(beam: dict[str, bytes], local: dict[str, bytes]) -> None:
    """The same bytes, but for the input names recorded in the root metadata:
    Beam read the inputs through URLs that name the local converter's files."""
    assert beam.keys() == local.keys()
    for key in local:
        if key != "zarr.json":
            assert beam[key] == local[key], key
    infos = [json.loads(f["zarr.json"])["attributes"]["flat_tokens"] for f in (beam, local)]
    assert infos[0]["inputs"]["names"] != infos[1]["inputs"]["names"]
    for info in infos:
        del info["inputs"]["names"]
    assert infos[0] == infos[1]


def local_and_beam(
    tmp_path: Path, inputs: list[Any], pipeline_args: list[str], **kwargs: Any
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Converts ``inputs`` with the local converter and with Beam; checks the bytes."""
    local = convert(inputs, tmp_path / "local", storage_format=SMALL, progress=False, **kwargs)
    beam = convert_beam(
        inputs, tmp_path / "beam", storage_format=SMALL, pipeline_args=pipeline_args, **kwargs
    )
    assert files(tmp_path / "beam") == files(tmp_path / "local")
    return local, beam


def test_two_worker_processes_write_the_local_converters_bytes(
    tmp_path: Path, tok_file: Path, corpus: Path
) -> None:
    local, beam = local_and_beam(
        tmp_path,
        [str(corpus / "f0[0-4]*"), str(corpus / "f0[5-9]*")],
        TWO_PROCESSES,
        tokenizer=tok_file,
        validation_fraction=0.3,
        append_eos=True,
        start_token_id="eos",
    )
    info = ftj.open_dataset(tmp_path / "beam").info
    assert info is not None and info.tokenizer is not None
    assert info.start_token_id == info.tokenizer.eos_id is not None
    assert info.inputs["count"] == len(SIZES) and info.inputs["sha256"].startswith("sha256:")
    for key in ("documents", "tokens", "splits", "skipped_empty", "input_files"):
        assert beam[key] == local[key], key
    assert beam["skipped_empty"] == 1 and beam["input_files"] == len(SIZES)
    assert beam["splits"]["validation"]["documents"] > 0
    ftj.validate(tmp_path / "beam")
    # What the inputs were chosen for: a document longer than a shard, and
    # input files (parts) whose boundaries fall inside output shards.
    ft = ftj.open_dataset(tmp_path / "beam")["train"]
    lo, hi = ft.sequence_bounds(np.arange(ft.num_sequences))
    assert (hi - lo).max() > SMALL.shard_tokens
    assert np.any(lo % SMALL.shard_tokens != 0)
    assert not any(k.startswith(STAGING) for k in stored(tmp_path / "beam"))
    assert not (tmp_path / "beam" / STAGING).exists()  # nor its empty folders


def test_command_line_pretokenized_with_validation_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rng = np.random.default_rng(0)
    for name, n in (("a", 5), ("b", 9), ("v", 4)):
        rows = [{"ids": rng.integers(0, 1000, rng.integers(1, 150)).tolist()} for _ in range(n)]
        write_jsonl(tmp_path / f"{name}.jsonl", rows)
    common = [str(tmp_path / "[ab].jsonl"), "--tokens-key", "ids"]
    common += ["--validation", str(tmp_path / "v.jsonl"), "--json"]
    assert main(["convert", *common[:1], str(tmp_path / "local"), *common[1:]]) == 0
    local = json.loads(capsys.readouterr().out)
    beam_args = ["convert", *common[:1], str(tmp_path / "beam"), *common[1:], "--runner", "beam"]
    assert main([*beam_args, "--", *IN_PROCESS]) == 0
    beam = json.loads(capsys.readouterr().out)
    assert files(tmp_path / "beam") == files(tmp_path / "local")
    assert beam["splits"] == local["splits"] and beam["splits"]["validation"]["documents"] == 4
    assert beam["runner"] == "FnApiRunner" and beam["tokenizer"] is None
    assert main([*beam_args, "--"]) == 1
    assert "already holds a flat-tokens dataset" in capsys.readouterr().err


class FlakyFileSystem(LocalFileSystem):
    """Local files under ``flaky://``. The first open of a file whose name has
    "flaky" in it breaks off, as a dropped connection would, after 90% of its
    bytes; a marker file beside it records that it broke."""

    @classmethod
    def scheme(cls) -> str:
        return "flaky"

    def match(self, patterns: list[str], limits: Any = None) -> list[MatchResult]:
        found = super().match([p.removeprefix("flaky://") for p in patterns], limits)
        return [
            MatchResult(
                r.pattern,
                [FileMetadata(f"flaky://{m.path}", m.size_in_bytes) for m in r.metadata_list],
            )
            for r in found
        ]

    def open(
        self,
        path: str,
        mime_type: str = "application/octet-stream",
        compression_type: str = CompressionTypes.AUTO,
    ) -> io.BufferedReader:
        local = Path(path.removeprefix("flaky://"))
        marker = local.with_name(local.name + ".broke")
        if "flaky" in local.name and not marker.exists():
            marker.touch()
            return io.BufferedReader(_Breaking(local, int(local.stat().st_size * 0.9)))
        return io.BufferedReader(io.FileIO(local))


class _Breaking(io.RawIOBase):
    def __init__(self, path: Path, after: int) -> None:
        self.file, self.left = io.FileIO(path), after

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        if self.left <= 0:
            raise ConnectionResetError("connection reset by peer (injected)")
        view = memoryview(buffer)[: self.left]
        n = self.file.readinto(view)
        self.left -= n
        return n

    def close(self) -> None:
        self.file.close()
        super().close()


def test_a_failed_bundle_is_retried_and_the_output_is_the_same(
    tmp_path: Path, tok_file: Path, corpus: Path
) -> None:
    inputs = tmp_path / "inputs"
    shutil.copytree(corpus, inputs)
    # Two batches of documents, so that the first is written to a part before the break.
    many = [{"text": f"line {i} " + "word " * (i % 7)} for i in range(1500)]
    write_jsonl(inputs / "f03_flaky.jsonl", many)
    local = convert(str(inputs / "*"), tmp_path / "local", tokenizer=tok_file, storage_format=SMALL)
    beam = convert_beam(
        f"flaky://{inputs}/*",
        tmp_path / "beam",
        tokenizer=tok_file,
        storage_format=SMALL,
        pipeline_args=RETRYING,
    )
    assert (inputs / "f03_flaky.jsonl.broke").exists()
    same_but_input_names(files(tmp_path / "beam"), files(tmp_path / "local"))
    assert beam["documents"] == local["documents"] == sum(SIZES) + len(many)


def test_a_failed_pipeline_leaves_nothing_and_a_rerun_starts_clean(
    tmp_path: Path, tok_file: Path, corpus: Path
) -> None:
    inputs = tmp_path / "inputs"
    shutil.copytree(corpus, inputs)
    good = (inputs / "f09.jsonl").read_text()
    (inputs / "f09.jsonl").write_text(good + '{"text": 3}\n')
    every, out = str(inputs / "*"), tmp_path / "beam"
    with pytest.raises(Exception, match=r"f09\.jsonl line 6: 'text' is int, not a string"):
        convert_beam(
            every, out, tokenizer=tok_file, storage_format=SMALL, pipeline_args=TWO_PROCESSES
        )
    assert stored(out) == {}
    (inputs / "f09.jsonl").write_text(good)
    convert(every, tmp_path / "local", tokenizer=tok_file, storage_format=SMALL)
    convert_beam(every, out, tokenizer=tok_file, storage_format=SMALL, pipeline_args=IN_PROCESS)
    assert files(out) == files(tmp_path / "local")


def test_leftovers_of_a_killed_run_need_overwrite_and_are_all_removed(
    tmp_path: Path, tok_file: Path, corpus: Path
) -> None:
    out, every = tmp_path / "beam", str(corpus / "*")
    # What a launcher killed mid-run leaves: its marker, a part, and output arrays.
    claim_location(Store(str(out)), overwrite=False)
    ftj.write_dataset(part_url(str(out), 0, "dead"), {"train": [[1, 2, 3]]})
    ftj.write_dataset(tmp_path / "partial", {"train": [[4, 5]]})
    shutil.copytree(tmp_path / "partial" / "train", out / "train")
    with pytest.raises(FileExistsError, match="leftover of an interrupted write"):
        convert_beam(every, out, tokenizer=tok_file, storage_format=SMALL, pipeline_args=IN_PROCESS)
    convert_beam(
        every,
        out,
        tokenizer=tok_file,
        storage_format=SMALL,
        overwrite=True,
        pipeline_args=IN_PROCESS,
    )
    convert(every, tmp_path / "local", tokenizer=tok_file, storage_format=SMALL)
    assert files(out) == files(tmp_path / "local")


def test_refusals(tmp_path: Path, tok_file: Path, corpus: Path) -> None:
    every = str(corpus / "*")
    with pytest.raises(ValueError, match="memory:// stores"):
        convert_beam(every, "memory://beam/out", tokenizer=tok_file)
    with pytest.raises(ValueError, match=r"DataflowRunner runs workers on other machines.*f00"):
        convert_beam(
            every, "gs://b/out", tokenizer=tok_file, pipeline_args=["--runner=DataflowRunner"]
        )
    notes = write_jsonl(tmp_path / "notes.txt", ["a"])
    with pytest.raises(InputError, match=r"notes\.txt: unknown input format"):
        convert_beam(every, tmp_path / "x", tokenizer=tok_file, validation_inputs=[notes])
    with pytest.raises(FileNotFoundError, match="no file matches"):
        convert_beam(str(corpus / "nothing*"), tmp_path / "x", tokenizer=tok_file)
    assert not (tmp_path / "x").exists() or stored(tmp_path / "x") == {}
    before = files(corpus)
    with pytest.raises(ValueError, match="contains the input"):
        convert_beam(every, corpus, tokenizer=tok_file, overwrite=True)
    assert files(corpus) == before


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--runner", "beam", "--workers", "2"], "--direct_num_workers=N"),
        (["--runner", "beam", "--max-tokens", "9"], "--max-tokens is for --runner local"),
        (["--", "--direct_num_workers=2"], "are Beam's: add --runner beam"),
    ],
)
def test_command_line_refusals(
    tmp_path: Path,
    tok_file: Path,
    corpus: Path,
    capsys: pytest.CaptureFixture[str],
    flags: list[str],
    message: str,
) -> None:
    args = ["convert", str(corpus / "*"), str(tmp_path / "out"), "--tokenizer", str(tok_file)]
    assert main([*args, *flags]) == 1
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("args", "runner", "workers", "mode"),
    [
        ([], "FnApiRunner", 0, "multi_processing"),
        (["--direct_num_workers=3"], "FnApiRunner", 3, "multi_processing"),
        (["--direct_running_mode=in_memory"], "FnApiRunner", 0, "in_memory"),
        (["--runner=DataflowRunner"], "DataflowRunner", 1, "in_memory"),
    ],
)
def test_default_runner_is_fnapi_with_a_process_per_cpu(
    args: list[str], runner: str, workers: int, mode: str
) -> None:
    direct = pipeline_options(args).view_as(DirectOptions)
    assert pipeline_options(args).view_as(StandardOptions).runner == runner
    assert (direct.direct_num_workers, direct.direct_running_mode) == (workers, mode)


@pytest.mark.remote
def test_inputs_and_output_on_s3(
    tmp_path: Path,
    tok_file: Path,
    corpus: Path,
    s3: S3,
) -> None:
    base, options = s3.base, s3.options
    bucket = Store("s3://bucket/in/", options)
    for path in sorted(corpus.iterdir()):
        bucket.wait(bucket.kv.write(path.name, path.read_bytes()))
    s3_flags = [
        f"--s3_endpoint_url={base}",
        "--s3_access_key_id=testing",
        "--s3_secret_access_key=testing",
        "--s3_region_name=us-east-1",
    ]
    out = "s3://bucket/beam-out"
    convert_beam(
        "s3://bucket/in/*",
        out,
        tokenizer=tok_file,
        validation_fraction=0.3,
        storage_format=SMALL,
        options=options,
        pipeline_args=[*TWO_PROCESSES, *s3_flags],
    )
    convert(
        str(corpus / "*"),
        tmp_path / "local",
        tokenizer=tok_file,
        validation_fraction=0.3,
        storage_format=SMALL,
    )
    same_but_input_names(stored(out, options), files(tmp_path / "local"))
