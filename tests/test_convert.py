"""flat_tokens_jax.convert.text and .inputs: JSONL, Parquet and saved datasets to flat-tokens."""

from __future__ import annotations

import argparse
import fcntl
import json
import logging
import os
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from textdata import EOS, corpus_texts, files, write_format, write_jsonl
from tokenizers import Tokenizer, models

import flat_tokens_jax as ftj
from flat_tokens_jax.convert import tokenizer as convert_tokenizer
from flat_tokens_jax.convert.inputs import InputError, expand_inputs
from flat_tokens_jax.convert.text import add_commands, convert
from flat_tokens_jax.convert.tokenizer import validation_mask

SMALL = ftj.StorageFormat(shard_tokens=64, chunk_tokens=16)


@pytest.fixture(scope="module")
def tok(eos_tokenizer: Path) -> Tokenizer:
    return Tokenizer.from_file(str(eos_tokenizer))


@pytest.fixture(scope="module")
def docs() -> list[str]:
    return corpus_texts(40, 1500)


def _sequences(url: Path, split: str = "train") -> list[list[int]]:
    ft = ftj.open_dataset(url)[split]
    return [s.tolist() for s in ft.sequences(np.arange(ft.num_sequences))]


def _arrays(url: Path) -> dict[str, tuple[list[int], list[int]]]:
    """Per split: the stored encoded tokens and every sequence's start offset."""
    out = {}
    for name, ft in ftj.open_dataset(url).items():
        enc = ft.encoded_ranges([0], [ft.num_tokens])[0]
        starts, _ = ft.sequence_bounds(np.arange(ft.num_sequences))
        out[name] = (enc.tolist(), starts.tolist())
    return out


def _ids(tok: Tokenizer, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False).ids)


def test_sequences_are_the_tokenizers_ids_in_order(
    tmp_path: Path, eos_tokenizer: Path, tok: Tokenizer, docs: list[str]
) -> None:
    src = write_jsonl(tmp_path / "docs.jsonl", [{"text": d, "id": i} for i, d in enumerate(docs)])
    summary = convert(src, tmp_path / "out", tokenizer=eos_tokenizer)
    expected = [_ids(tok, d) for d in docs]
    assert _sequences(tmp_path / "out") == expected
    assert _sequences(tmp_path / "out", "validation") == []
    assert summary["documents"] == len(docs) and summary["skipped_empty"] == 0
    assert summary["tokens"] == sum(map(len, expected)) == summary["splits"]["train"]["tokens"]
    assert summary["tokens_per_s"] > 0 and not summary["stopped_early"]
    json.dumps(summary)
    ftj.validate(tmp_path / "out")


def test_append_eos_and_prepend_bos(
    tmp_path: Path, eos_tokenizer: Path, tok: Tokenizer, docs: list[str]
) -> None:
    src = write_jsonl(tmp_path / "docs.jsonl", [{"text": d} for d in docs[:5]])
    convert(src, tmp_path / "eos", tokenizer=eos_tokenizer, append_eos=True)
    eos = tok.token_to_id(EOS)
    assert _sequences(tmp_path / "eos") == [[*_ids(tok, d), eos] for d in docs[:5]]
    with pytest.raises(ValueError, match="prepend_bos: no beginning-of-sequence token"):
        convert(src, tmp_path / "bos", tokenizer=eos_tokenizer, prepend_bos=True)


def test_same_bytes_for_one_and_two_workers(
    tmp_path: Path, eos_tokenizer: Path, docs: list[str]
) -> None:
    src = write_jsonl(tmp_path / "docs.jsonl", [{"text": d} for d in docs])
    outs = []
    for workers in (1, 2):
        out = tmp_path / f"w{workers}"
        summary = convert(
            src,
            out,
            tokenizer=eos_tokenizer,
            workers=workers,
            append_eos=True,
            validation_fraction=0.3,
            storage_format=SMALL,
        )
        assert summary["splits"]["validation"]["documents"] > 0
        outs.append(out)
    assert _arrays(outs[0]) == _arrays(outs[1])
    assert files(outs[0]) == files(outs[1])


@pytest.mark.parametrize("kind", ["gz", "zst", "parquet", "hf"])
def test_other_formats_give_what_jsonl_gives(
    tmp_path: Path, eos_tokenizer: Path, docs: list[str], kind: str
) -> None:
    documents = [{"text": d, "n": i} for i, d in enumerate(docs)]
    plain = write_jsonl(tmp_path / "plain.jsonl", documents)
    other = write_format(kind, tmp_path / "other", documents)
    convert(plain, tmp_path / "a", tokenizer=eos_tokenizer, validation_fraction=0.2)
    convert(other, tmp_path / "b", tokenizer=eos_tokenizer, validation_fraction=0.2)
    assert _arrays(tmp_path / "a") == _arrays(tmp_path / "b")


@pytest.mark.parametrize("kind", ["parquet", "hf"])
def test_columnar_bad_rows_name_the_row(tmp_path: Path, eos_tokenizer: Path, kind: str) -> None:
    documents: list[dict[str, Any]] = [{"text": f"doc {i}"} for i in range(30)]
    documents[17] = {"text": None}
    src = write_format(kind, tmp_path / "in", documents)
    with pytest.raises(InputError, match=rf"{re.escape(str(src))} row 18: 'text' is null"):
        convert(src, tmp_path / "out", tokenizer=eos_tokenizer)
    summary = convert(src, tmp_path / "out", tokenizer=eos_tokenizer, skip_bad=True)
    assert (summary["documents"], summary["skipped_bad"]) == (29, 1)


def test_globs_sorted_per_pattern_pattern_order_kept(tmp_path: Path, eos_tokenizer: Path) -> None:
    for name in ("b", "a", "c", "z"):
        write_jsonl(tmp_path / f"{name}.jsonl", [{"text": f"file {name} doc {i}"} for i in (1, 2)])
    paths = expand_inputs([tmp_path / "z.jsonl", str(tmp_path / "[abc].jsonl")])
    assert [p.name for p in paths] == ["z.jsonl", "a.jsonl", "b.jsonl", "c.jsonl"]
    convert(paths, tmp_path / "out", tokenizer=eos_tokenizer)
    tok = Tokenizer.from_file(str(eos_tokenizer))
    got = [tok.decode(s) for s in _sequences(tmp_path / "out")]
    assert got == [f"file {n} doc {i}" for n in "zabc" for i in (1, 2)]
    with pytest.raises(FileNotFoundError, match="no file matches"):
        expand_inputs([str(tmp_path / "*.parquet")])
    (tmp_path / "notes.txt").write_text("hello\n")
    with pytest.raises(InputError, match="unknown input format"):
        expand_inputs([tmp_path / "notes.txt"])
    with pytest.raises(InputError, match="not a dataset saved with save_to_disk"):
        expand_inputs([tmp_path])


def test_pre_tokenized_input(tmp_path: Path, eos_tokenizer: Path, tok: Tokenizer) -> None:
    seqs = [[5, 6, 7], [9], [2**31 - 1, 0, 3]]
    src = write_jsonl(tmp_path / "ids.jsonl", [{"ids": s} for s in seqs])
    summary = convert(src, tmp_path / "a", tokens_key="ids")
    assert _sequences(tmp_path / "a") == seqs and summary["tokens"] == 7
    convert(src, tmp_path / "b", tokens_key="ids", tokenizer=eos_tokenizer, append_eos=True)
    eos = tok.token_to_id(EOS)
    assert _sequences(tmp_path / "b") == [[*s, eos] for s in seqs]
    with pytest.raises(ValueError, match="need tokenizer="):
        convert(src, tmp_path / "c", tokens_key="ids", append_eos=True)
    with pytest.raises(ValueError, match="pass tokenizer="):
        convert(src, tmp_path / "c")


def test_validation_fraction_is_a_deterministic_hash_split(
    tmp_path: Path, eos_tokenizer: Path
) -> None:
    texts = [f"document number {i}, some words" for i in range(600)]
    src = write_jsonl(tmp_path / "docs.jsonl", [{"text": t} for t in texts])
    mask = validation_mask(texts, 0.25)
    assert mask.tolist() == validation_mask(texts[::-1], 0.25).tolist()[::-1]
    assert abs(mask.mean() - 0.25) < 0.06
    s1 = convert(src, tmp_path / "a", tokenizer=eos_tokenizer, validation_fraction=0.25)
    convert(src, tmp_path / "b", tokenizer=eos_tokenizer, validation_fraction=0.25)
    assert _arrays(tmp_path / "a") == _arrays(tmp_path / "b")
    assert s1["splits"]["validation"]["documents"] == mask.sum()
    tok = Tokenizer.from_file(str(eos_tokenizer))
    valid = [tok.decode(s) for s in _sequences(tmp_path / "a", "validation")]
    train = [tok.decode(s) for s in _sequences(tmp_path / "a")]
    assert valid == [t for t, m in zip(texts, mask, strict=True) if m]
    assert train == [t for t, m in zip(texts, mask, strict=True) if not m]


def test_validation_inputs(tmp_path: Path, eos_tokenizer: Path, tok: Tokenizer) -> None:
    train = write_jsonl(tmp_path / "train.jsonl", [{"text": "to train on"}])
    valid = write_jsonl(tmp_path / "valid.jsonl", [{"text": "held out"}, {"text": "also"}])
    summary = convert(train, tmp_path / "out", tokenizer=eos_tokenizer, validation_inputs=[valid])
    assert _sequences(tmp_path / "out") == [_ids(tok, "to train on")]
    assert _sequences(tmp_path / "out", "validation") == [_ids(tok, "held out"), _ids(tok, "also")]
    assert summary["splits"]["validation"]["documents"] == 2
    with pytest.raises(ValueError, match="not both"):
        convert(
            train,
            tmp_path / "x",
            tokenizer=eos_tokenizer,
            validation_inputs=valid,
            validation_fraction=0.1,
        )


BAD_TEXT: list[tuple[str | bytes, str]] = [
    ('{"text": "unfinished', "not valid JSON"),
    ('{"other": "x"}', "no key 'text'"),
    ('{"text": 5}', "'text' is int, not a string"),
    ('{"text": null}', "'text' is NoneType, not a string"),
    ('["text"]', "not a JSON object"),
    (b'{"text": "\xff\xfe"}', "not valid JSON"),
    ('{"text": "lone \\ud800 surrogate"}', "'text' is not valid Unicode"),
]
BAD_TOKENS: list[tuple[str | bytes, str]] = [
    ('{"ids": "12"}', "'ids' is str, not a list of token ids"),
    ('{"ids": [1, -1]}', r"token id -1 is outside \[0, 2147483647\]"),
    ('{"ids": [1, 2147483648]}', "token id 2147483648 is outside"),
    ('{"ids": [1.5, 2]}', "'ids' must be a flat list of integers"),
    ('{"ids": [[1], [2]]}', "'ids' must be a flat list of integers"),
]
GOOD = 3000  # good documents before the bad one: whole batches are written, then deleted


@pytest.mark.parametrize(("bad", "message"), BAD_TEXT + BAD_TOKENS)
def test_bad_document_names_file_and_line_and_leaves_no_dataset(
    tmp_path: Path, eos_tokenizer: Path, bad: str | bytes, message: str
) -> None:
    key = "ids" if (bad, message) in BAD_TOKENS else "text"
    good = json.dumps({key: [3, 4] if key == "ids" else "a few words"}).encode()
    src = tmp_path / "in.jsonl"
    bad_line = bad if isinstance(bad, bytes) else bad.encode()
    src.write_bytes(b"\n".join([good] * GOOD + [bad_line, good, b""]))
    args: dict[str, Any] = {"tokens_key": "ids"} if key == "ids" else {"tokenizer": eos_tokenizer}
    out = tmp_path / "out"
    with pytest.raises(InputError, match=rf"{re.escape(str(src))} line {GOOD + 1}: {message}"):
        convert(src, out, storage_format=SMALL, **args)
    with pytest.raises(ftj.FormatError):
        ftj.open_dataset(out)
    summary = convert(src, out, storage_format=SMALL, skip_bad=True, **args)
    assert (summary["documents"], summary["skipped_bad"]) == (GOOD + 1, 1)
    assert ftj.open_dataset(out)["train"].num_sequences == GOOD + 1


def test_empty_documents_are_skipped_and_counted(tmp_path: Path, eos_tokenizer: Path) -> None:
    src = write_jsonl(
        tmp_path / "in.jsonl", [{"text": "x"}, {"text": ""}, {"text": "y"}, {"text": ""}, "  "]
    )
    summary = convert(src, tmp_path / "a", tokenizer=eos_tokenizer)
    assert (summary["documents"], summary["skipped_empty"]) == (2, 2)
    ids = write_jsonl(tmp_path / "ids.jsonl", [{"ids": []}, {"ids": [1]}])
    summary = convert(ids, tmp_path / "b", tokens_key="ids")
    assert (summary["documents"], summary["skipped_empty"]) == (1, 1)


def test_max_tokens_stops_before_the_document_that_passes_it(
    tmp_path: Path, eos_tokenizer: Path, tok: Tokenizer, docs: list[str]
) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": d} for d in docs])
    lengths = [len(_ids(tok, d)) for d in docs]
    budget = sum(lengths[:5]) + lengths[5] - 1
    summary = convert(src, tmp_path / "out", tokenizer=eos_tokenizer, max_tokens=budget)
    assert summary["stopped_early"] and summary["documents"] == 5
    assert summary["tokens"] == sum(lengths[:5]) <= budget
    assert _sequences(tmp_path / "out") == [_ids(tok, d) for d in docs[:5]]


def test_interrupt_leaves_no_dataset(
    tmp_path: Path, eos_tokenizer: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "words"}] * 3000)
    calls = []
    real = convert_tokenizer.BatchTokenizer.__call__

    def interrupted(*args: Any, **kwargs: Any) -> tuple[np.ndarray, np.ndarray]:
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(convert_tokenizer.BatchTokenizer, "__call__", interrupted)
    with pytest.raises(KeyboardInterrupt):
        convert(src, tmp_path / "out", tokenizer=eos_tokenizer, storage_format=SMALL)
    with pytest.raises(ftj.FormatError):
        ftj.open_dataset(tmp_path / "out")


def test_transformers_tokenizer_directory(
    tmp_path: Path, eos_tokenizer: Path, tok: Tokenizer, docs: list[str]
) -> None:
    import transformers

    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_file(str(eos_tokenizer)), eos_token="<|custom_eos|>"
    )
    hf.save_pretrained(tmp_path / "hf")
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": d} for d in docs[:6]])
    convert(src, tmp_path / "out", tokenizer=tmp_path / "hf", append_eos=True)
    eos = tok.token_to_id("<|custom_eos|>")  # the config's, not the first well-known name
    assert eos != tok.token_to_id(EOS)
    assert _sequences(tmp_path / "out") == [[*_ids(tok, d), eos] for d in docs[:6]]


def test_truncation_stored_in_the_tokenizer_is_off(
    tmp_path: Path, tok: Tokenizer, docs: list[str]
) -> None:
    truncating = Tokenizer.from_str(tok.to_str())
    truncating.enable_truncation(8)
    truncating.save(str(tmp_path / "trunc.json"))
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": docs[0]}])
    convert(src, tmp_path / "out", tokenizer=tmp_path / "trunc.json")
    assert _sequences(tmp_path / "out") == [_ids(tok, docs[0])]
    assert len(_ids(tok, docs[0])) > 8


def test_tokenizer_id_checks(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "a"}])
    plain = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    plain.save(str(tmp_path / "plain.json"))
    with caplog.at_level(logging.WARNING):
        convert(src, tmp_path / "out", tokenizer=tmp_path / "plain.json")
    assert "token id 0 ('a') is an ordinary token" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):  # a start id other than 0 recorded: no alarm
        convert(src, tmp_path / "out1", tokenizer=tmp_path / "plain.json", start_token_id=1)
        ftj.open_dataset(tmp_path / "out1")
    assert "ordinary token" not in caplog.text
    spec = json.loads(plain.to_str())  # (saving a tokenizer with a huge id takes long)
    spec["model"]["vocab"]["[UNK]"] = 2**31
    (tmp_path / "huge.json").write_text(json.dumps(spec))
    with pytest.raises(ValueError, match="has id 2147483648, above 2147483647"):
        convert(src, tmp_path / "out2", tokenizer=tmp_path / "huge.json")


def test_command_line(
    tmp_path: Path, eos_tokenizer: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = argparse.ArgumentParser(prog="flat-tokens")
    add_commands(parser.add_subparsers(dest="command", required=True))
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": f"doc {i}"} for i in range(20)])
    out = str(tmp_path / "out")
    args = parser.parse_args(
        ["convert", str(src), out, "--tokenizer", str(eos_tokenizer), "--append-eos", "--json"]
    )
    assert args.run(args) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["documents"] == 20 and summary["splits"]["train"]["documents"] == 20
    args = parser.parse_args(["convert", str(src), out, "--tokenizer", str(eos_tokenizer)])
    assert args.run(args) == 1
    assert "already holds" in capsys.readouterr().err
    args = parser.parse_args(
        [
            "convert",
            str(src),
            out,
            "--overwrite",
            "--tokenizer",
            str(eos_tokenizer),
            "--max-tokens",
            "9",
        ]
    )
    assert args.run(args) == 0
    assert "stopped at max_tokens 9" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        parser.parse_args(
            ["convert", str(src), out, "--validation-fraction", "0.1", "--validation", str(src)]
        )


def _processes() -> list[tuple[int, int, int]]:
    """``(pid, parent pid, process group)`` of every process (Linux /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process ended while we looked
            continue
        found.append((int(stat.parent.name), int(fields[1]), int(fields[2])))
    return found


def _group(pgid: int) -> list[int]:
    return [pid for pid, _, group in _processes() if group == pgid]


def _await_tokens(terminal: int, proc: subprocess.Popen[bytes]) -> None:
    """Reads the progress bar that ``proc`` draws on ``terminal`` until it
    counts tokens: the workers are up and tokenizing."""
    seen = b""
    deadline = time.monotonic() + 300  # a bound only for a run that never tokenizes
    while proc.poll() is None and time.monotonic() < deadline:
        if select.select([terminal], [], [], 0.5)[0]:
            seen += os.read(terminal, 1 << 16)
            counts = re.findall(rb"convert: *([0-9.]+)[kMG]?tok", seen)
            if any(float(c) > 0 for c in counts):
                return
    raise AssertionError(f"no tokens came back from the workers: {seen[-300:]!r}")


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)")
def test_sigkill_of_convert_with_workers_leaves_no_process(
    tmp_path: Path, eos_tokenizer: Path
) -> None:
    docs = corpus_texts(200, 2000) * 50
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": d} for d in docs])
    command = [sys.executable, "-m", "flat_tokens_jax.cli", "convert", str(src)]
    command += [str(tmp_path / "out"), "--tokenizer", str(eos_tokenizer), "--workers", "2"]
    # stderr on a terminal: the progress bar says when the workers' first tokens are back.
    terminal, its_end = pty.openpty()
    fcntl.ioctl(its_end, termios.TIOCSWINSZ, struct.pack("4H", 24, 120, 0, 0))  # a bar is drawn
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=its_end, start_new_session=True)
    os.close(its_end)
    try:
        _await_tokens(terminal, proc)
        assert proc.poll() is None, "the conversion ended before it could be killed"
        proc.kill()
        proc.wait()
        assert proc.stdout is not None
        read = threading.Thread(target=proc.stdout.read)
        read.start()
        # Each worker ends with its parent (at once on Linux, else within a
        # second): the bound is for a process that lives on, not a race.
        deadline = time.monotonic() + 120
        while _group(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _group(proc.pid) == [], "processes of the killed conversion live on"
        read.join(120)
        assert not read.is_alive(), "a reader of its output never sees the end"
    finally:
        for pid in _group(proc.pid):
            os.kill(pid, signal.SIGKILL)
        os.close(terminal)
