"""Bad input on the command line ends in one line on stderr and exit status 1, never a traceback."""

from pathlib import Path

import pytest
from commands import run_main


def one_line_failure(code: int, err: str, *expected: str) -> None:
    assert code == 1, err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    for text in expected:
        assert text in err, err


def bad_tokenizers(tmp_path: Path, good: Path) -> dict[str, Path]:
    files = {
        "junk": b"this is not json\n",
        "empty": b"",
        "truncated": good.read_bytes()[:1000],
        "jsonl": b'{"text": "a"}\n{"text": "b"}\n',
    }
    for name, data in files.items():
        (tmp_path / f"{name}.json").write_bytes(data)
    return {name: tmp_path / f"{name}.json" for name in files}


@pytest.mark.parametrize("kind", ["junk", "empty", "truncated", "jsonl"])
@pytest.mark.parametrize("command", ["convert", "convert-chat"])
def test_a_tokenizer_file_that_is_not_one(
    tmp_path: Path, kind: str, command: str, eos_tokenizer: Path
) -> None:
    inputs = tmp_path / "in.jsonl"
    inputs.write_text('{"text": "hello", "messages": [{"role": "user", "content": "hi"}]}\n')
    tok = bad_tokenizers(tmp_path, eos_tokenizer)[kind]
    code, _, err = run_main(command, str(inputs), str(tmp_path / "out"), "--tokenizer", str(tok))
    one_line_failure(code, err, f"{command}: {tok}: not a tokenizers JSON file")
    assert not (tmp_path / "out").exists()


def test_a_chat_template_that_does_not_parse(tmp_path: Path, eos_tokenizer: Path) -> None:
    inputs = tmp_path / "in.jsonl"
    inputs.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    template = tmp_path / "bad.yaml"
    template.write_text("chat: [unclosed\n")
    code, _, err = run_main(
        "convert-chat",
        str(inputs),
        str(tmp_path / "out"),
        "--tokenizer",
        str(eos_tokenizer),
        "--template",
        str(template),
    )
    one_line_failure(code, err, f"convert-chat: {template}: line 2: not valid YAML")


@pytest.mark.parametrize("command", ["validate", "info"])
@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("http://example.com/data", "unsupported URL scheme 'http'"),
        ("s3:///x", "names no bucket"),
    ],
)
def test_an_unsupported_or_incomplete_url(command: str, url: str, message: str) -> None:
    code, _, err = run_main(command, url)
    one_line_failure(code, err, f"{command}: ", message)
