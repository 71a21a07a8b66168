"""flat_tokens_jax.core.urls: what a path or URL names, and the URLs that are refused."""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import flat_tokens_jax as ftj
from flat_tokens_jax import cli
from flat_tokens_jax.core.urls import Location, parse_url


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("file:///a/b", Location("file", "", "/a/b")),
        ("file:///a/b/", Location("file", "", "/a/b")),
        ("file://localhost/a/b", Location("file", "", "/a/b")),
        ("file://LocalHost/a", Location("file", "", "/a")),
        ("file:/a/b", Location("file", "", "/a/b")),
        ("file:///", Location("file", "", "/")),
        ("file:///a/../b", Location("file", "", "/b")),
        ("file:///my%20data/100%25", Location("file", "", "/my data/100%")),
        ("FILE:///a", Location("file", "", "/a")),
        ("gs://bkt/p/q/", Location("gs", "bkt", "p/q")),
        ("gs://bkt", Location("gs", "bkt", "")),
        ("s3://bkt/a%20b/user@x", Location("s3", "bkt", "a b/user@x")),
        ("memory://name/x", Location("memory", "name", "x")),
        ("memory://", Location("memory", "", "")),
    ],
)
def test_urls_that_name_a_location(url: str, expected: Location) -> None:
    assert parse_url(url) == expected


def test_plain_paths_are_taken_literally(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert parse_url("data/my%20x") == Location("file", "", f"{tmp_path}/data/my%20x")
    assert parse_url("../x") == Location("file", "", f"{tmp_path.parent}/x")
    assert parse_url("/abs/a b") == Location("file", "", "/abs/a b")
    assert parse_url("~/x") == Location("file", "", f"{tmp_path}/home/x")
    assert parse_url(tmp_path / "p") == Location("file", "", f"{tmp_path}/p")


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("file://mydataset", "file:///ABSOLUTE/PATH .*file:///mydataset .*plain path 'mydataset'"),
        ("file://../../x", "host is '..'.* plain path '../../x' for a path relative"),
        ("file://host/p", "host is 'host'.*file:///host/p for /host/p"),
        ("file:rel/x", "absolute path, as file:///ABSOLUTE/PATH.*plain path 'rel/x'"),
        ("file://", "names no path: write file:///ABSOLUTE/PATH"),
        ("file://localhost", "names no path"),
        ("s3://b/a?x", "query or fragment.*%3F"),
        ("gs://b/a#x", "query or fragment.*%23"),
        ("s3://b/100%", "write a '%' in a URL as %25"),
        ("file:///a%zz", "does not start a percent-escape"),
        ("", "empty"),
        ("ftp://host/x", "unsupported URL scheme 'ftp'"),
        ("gs:///x", "names no bucket: expected gs://BUCKET/PATH"),
        ("memory:x", "expected memory://NAME/PATH"),
    ],
)
def test_urls_that_are_refused_name_the_spelling_that_works(url: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_url(url)


def test_a_file_url_with_a_host_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before: file://mydataset wrote ./ (the host was dropped), file://a/b wrote /b.
    monkeypatch.chdir(tmp_path)
    for url in ("file://mydataset", "file://mydataset/x", "file://../x"):
        with pytest.raises(ValueError, match="file:///ABSOLUTE/PATH"):
            ftj.write_dataset(url, {"train": [[1, 2]]})
    assert list(tmp_path.iterdir()) == []


def test_file_urls_and_plain_paths_name_the_same_files(tmp_path: Path) -> None:
    ftj.write_dataset(f"file://{tmp_path}/my%20data", {"train": [[5, 6]]})
    assert (tmp_path / "my data" / "zarr.json").is_file()
    for url in (tmp_path / "my data", f"file://localhost{tmp_path}/my%20data"):
        assert ftj.open_dataset(url)["train"].tokens(0, 2).tolist() == [5, 6]


SECRETS = [
    ("s3://AKIAEXAMPLEKEY:s3cr3tPart/sl4sh@bucket/ds", ["s3cr3tPart", "sl4sh", "AKIAEXAMPLEKEY"]),
    ("s3://AKIAEXAMPLEKEY:wJalrXUtnFEMI@bucket/ds", ["wJalrXUtnFEMI", "AKIAEXAMPLEKEY"]),
    ("s3://AKIAEXAMPLEKEY:se#cr3tHash@bucket/ds", ["cr3tHash", "AKIAEXAMPLEKEY"]),
    ("gs://ya29tok3n@bucket/ds", ["ya29tok3n"]),
    ("gs://user:pa55word@bucket/ds", ["pa55word"]),
    ("memory://user:pa55word@name/ds", ["pa55word"]),
    ("file://user:pa55word@localhost/ds", ["pa55word"]),
]


def _everything_about(error: BaseException) -> str:
    return "".join([str(error), repr(error), repr(error.args), *traceback.format_exception(error)])


@pytest.mark.parametrize(("url", "secrets"), SECRETS)
def test_credentials_in_urls_are_refused_without_repeating_them(
    url: str, secrets: list[str]
) -> None:
    calls: list[Callable[[str], Any]] = [
        parse_url,
        ftj.open_dataset,
        ftj.validate,
        ftj.summary,
        ftj.DatasetWriter,
        lambda u: ftj.write_dataset(u, {"train": [[1]]}),
    ]
    for call in calls:
        with pytest.raises(ValueError, match="must not carry credentials") as caught:
            call(url)
        told = _everything_about(caught.value)
        assert not [s for s in secrets if s in told]
        assert "://BUCKET/PATH" in told or "://NAME/PATH" in told or "file://" in told


def test_the_commands_refuse_credentials_in_urls_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url, secrets = SECRETS[0]
    src = tmp_path / "in.jsonl"
    src.write_text('{"tokens": [1, 2]}\n')
    commands = [
        ["validate", url],
        ["info", url, "--json"],
        ["show", url, "--step", "0", "--batch-size", "1", "--seq-len", "2"],
        ["convert", str(src), url, "--tokens-key", "tokens", "--no-progress"],
        ["merge", url, str(tmp_path / "merged")],
        ["export-megatron", url, str(tmp_path / "prefix")],
    ]
    for command in commands:
        assert cli.main(command) == 1
        out = capsys.readouterr()
        assert not [s for s in secrets if s in out.out + out.err]
        lines = out.err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"{command[0]}: ")
        assert "--credentials" in lines[0]
    assert os.listdir(tmp_path) == ["in.jsonl"]
