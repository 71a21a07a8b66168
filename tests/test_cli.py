import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from commands import run_main
from rawstore import SPEC_TOKENS, flat_split, write_raw

import flat_tokens_jax as ftj
from flat_tokens_jax.cli import build_parser, main
from flat_tokens_jax.convert.commands import store_options


def test_validate_exit_status_and_report(tmp_path: Path) -> None:
    ftj.write_dataset(tmp_path / "good", {"train": [[1, 2], [3]]})
    code, out, _ = run_main("validate", str(tmp_path / "good"))
    assert code == 0 and "valid" in out
    write_raw(
        tmp_path / "bad",
        {"train": flat_split(SPEC_TOKENS, [0, 3, 5, 8], 8), "validation": flat_split([], [0], 0)},
    )
    code, _, err = run_main("validate", str(tmp_path / "bad"))
    assert code == 1
    assert "INVALID" in err
    assert "train/encoded_tokens[3]: seq_starts marks a sequence start here" in err
    assert "train/encoded_tokens[2]: start bit set where" in err


def test_info_text_and_json(tmp_path: Path, capsys: object) -> None:
    ftj.write_dataset(
        tmp_path,
        {"train": [[1, 2], [3, 4, 5]], "validation": [[9]]},
        storage_format=ftj.StorageFormat(shard_tokens=1024, chunk_tokens=64, compression="zstd"),
    )
    code, out, err = run_main("info", str(tmp_path), "--json")
    assert code == 0, err
    info = json.loads(out)
    assert info["splits"]["train"]["num_tokens"] == 5
    assert info["splits"]["validation"]["max_token_id"] == 9
    _, text, _ = run_main("info", str(tmp_path))
    assert "train: 5 tokens, 2 sequences, max_token_id 5" in text
    assert "encoded_tokens: chunk 64, shard 1024, compression zstd" in text


def test_info_on_missing_dataset_fails_cleanly(tmp_path: Path) -> None:
    assert main(["info", str(tmp_path / "nothing")]) == 1
    assert main(["validate", str(tmp_path / "nothing")]) == 1


def test_show_prints_the_batch_and_its_provenance(tmp_path: Path) -> None:
    ftj.write_dataset(tmp_path, {"train": [[1, 2], [3, 4, 5], [6, 7, 8]]})
    code, out, err = run_main(
        "show",
        str(tmp_path),
        "--step",
        "0",
        "--batch-size",
        "2",
        "--seq-len",
        "4",
        "--no-shuffle",
        "--json",
    )
    assert code == 0, err
    rows = json.loads(out)["rows"]
    assert rows[1]["targets"] == [5, 6, 7, 8] and rows[1]["inputs"] == [4, 0, 6, 7]
    assert rows[1]["tokens"] == [4, 8] and rows[1]["record"] == 1
    _, text, _ = run_main(
        "show",
        str(tmp_path),
        "--step",
        "0",
        "--batch-size",
        "1",
        "--seq-len",
        "4",
        "--padded",
        "--no-shuffle",
    )
    assert text.startswith(f"step 0, batch_size 1, data {tmp_path}: {{'seq_len': 4,"), text
    assert "row 0: sample 0, epoch 0, record 0, tokens [0, 2)" in text
    assert "targets     [1, 2, 0, 0]" in text
    code, _, err = run_main(
        "show", str(tmp_path), "--step", "0", "--batch-size", "1", "--seq-len", "9"
    )
    assert code == 1 and "has no records" in err


STORE_FLAGS = [
    "--endpoint",
    "http://127.0.0.1:1",
    "--region",
    "r",
    "--credentials",
    "anonymous",
    "--concurrency",
    "3",
    "--retries",
    "2",
    "--retry-delay",
    "0.5",
    "--max-retry-delay",
    "4",
    "--timeout",
    "7",
]
COMMANDS = {
    "validate": ["U"],
    "info": ["U"],
    "show": ["U", "--step", "0", "--batch-size", "1", "--seq-len", "1"],
    "preview": ["RUN.yaml"],
    "convert": ["I", "U"],
    "convert-chat": ["I", "U", "--tokenizer", "T"],
    "merge": ["U", "U2"],
    "import-megatron": ["P", "U"],
    "export-megatron": ["U", "P"],
    "import-datatrove": ["P", "U"],
    "import-dolma": ["P", "U", "--dtype", "uint16"],
    "import-levanter": ["C", "U"],
    "pack": ["U", "--seq-len", "8"],
}


def test_every_command_that_takes_a_url_has_the_same_store_flags() -> None:
    parser = build_parser()
    expected = ftj.StoreOptions(
        endpoint="http://127.0.0.1:1",
        region="r",
        credentials="anonymous",
        concurrency=3,
        retries=2,
        retry_delay=0.5,
        max_retry_delay=4.0,
        timeout=7.0,
    )
    commands = parser._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    assert set(commands) == set(COMMANDS)
    for command, words in COMMANDS.items():
        assert store_options(parser.parse_args([command, *words, *STORE_FLAGS])) == expected
        assert store_options(parser.parse_args([command, *words])) == ftj.StoreOptions()


def test_every_option_of_every_command_says_what_it_does_in_plain_text() -> None:
    """Issue 35: ``flat-tokens --help`` showed "The ``flat-tokens`` command.", and
    ``show --help`` left ``--step``, ``--seq-len``, ``--seed``, ``--num-epochs``
    and ``--pad-id`` (and more) without a word."""
    parser = build_parser()
    commands = parser._subparsers._group_actions[0]  # type: ignore[union-attr]
    assert [c.dest for c in commands._choices_actions] == list(commands.choices)
    assert all(c.help for c in commands._choices_actions), "every command has its line"
    for name, command in [("flat-tokens", parser), *commands.choices.items()]:
        for action in command._actions:
            if action is not commands:
                assert action.help, f"{name} {'/'.join(action.option_strings) or action.dest}"
        text = command.format_help()
        assert "``" not in text and ":class:" not in text and ":meth:" not in text, name


def test_the_cli_guides_synopsis_lists_every_command() -> None:
    """Issue 35: docs/guide/cli.md's synopsis lacked three commands, ``pack`` among them."""
    guide = (Path(__file__).resolve().parents[1] / "docs" / "guide" / "cli.md").read_text()
    synopsis = guide.split("```text\n", 1)[1].split("```", 1)[0]
    listed = set(re.findall(r"^flat-tokens ([a-z][a-z-]*)", synopsis, re.M))
    commands = build_parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    assert listed == set(commands)


@pytest.mark.parametrize(
    ("words", "message"),
    [
        (["convert", "I", "U", "--workers", "0"], "argument --workers: must be at least 1, got 0"),
        (["info", "U", "--retries", "0"], "argument --retries: must be an int in [1, 100], got 0"),
        (["info", "U", "--retries", "1000000000"], "--retries: must be an int in [1, 100], got 1"),
        (["info", "U", "--timeout", "0"], "argument --timeout: must be above 0 seconds"),
        (["info", "U", "--timeout", "inf"], "argument --timeout: expected seconds, got 'inf'"),
        (["preview", "R", "--step-seconds", "0"], "--step-seconds: must be above 0 seconds"),
        (["info", "U", "--concurrency", "x"], "argument --concurrency: expected int, got 'x'"),
        (["info", "U", "--credentials", "static"], "argument --credentials: invalid choice"),
        (["show", "U", "--step", "-1", "--batch-size", "1", "--seq-len", "1"], "--step: must be"),
    ],
)
def test_bad_flag_values_are_refused_in_cli_terms(
    words: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as caught:
        main(words)
    assert caught.value.code == 2
    assert message in capsys.readouterr().err


def test_store_option_errors_speak_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info", str(tmp_path), "--retry-delay", "5", "--max-retry-delay", "1"]) == 1
    err = capsys.readouterr().err
    assert err == "info: --retry-delay (5.0) must be above 0 and at most --max-retry-delay (1.0)\n"


def test_info_into_a_closed_pipe_ends_quietly(tmp_path: Path) -> None:
    ftj.write_dataset(tmp_path, {"train": [[1, 2], [3]]})
    read, write = os.pipe()
    os.close(read)  # like `| head -c 10` that has exited
    try:
        done = subprocess.run(
            [sys.executable, "-m", "flat_tokens_jax.cli", "info", "--json", str(tmp_path)],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    finally:
        os.close(write)
    assert done.stderr == ""
    assert done.returncode == 128 + signal.SIGPIPE


def test_validate_names_a_location_in_every_line(tmp_path: Path) -> None:
    ftj.write_dataset(tmp_path, {"train": [[1, 2], [3]]})
    shutil.rmtree(tmp_path / "train")
    code, _, err = run_main("validate", str(tmp_path))
    assert code == 1
    header, *problems = err.splitlines()
    assert header == f"{tmp_path}: INVALID, 1 problem(s):"
    assert problems == [f"  {tmp_path}: split 'train' is missing (no zarr group train/)"]
    code, _, err = run_main("validate", "")
    assert code == 1
    assert err == "validate: the store's URL is empty: give a path or a URL\n"


def test_version_prints_the_installed_version() -> None:
    import importlib.metadata

    r = subprocess.run(
        [sys.executable, "-m", "flat_tokens_jax.cli", "--version"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"flat-tokens-jax {importlib.metadata.version('flat-tokens-jax')}"


def test_show_with_a_tokenizer_but_without_the_convert_extra_says_how_to_install_it(
    tmp_path: Path,
) -> None:
    ftj.write_dataset(tmp_path / "d", {"train": [[1, 2, 3, 4, 5]] * 20})
    blocked = (
        "import sys; sys.modules['tokenizers'] = sys.modules['transformers'] = None\n"
        "from flat_tokens_jax.cli import main\n"
        "sys.exit(main(sys.argv[1:]))"
    )
    args = ["show", str(tmp_path / "d"), "--step", "0", "--seq-len", "4", "--batch-size", "2"]
    r = subprocess.run(
        [sys.executable, "-c", blocked, *args, "--tokenizer", str(tmp_path / "t.json")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert "pip install 'flat-tokens-jax[convert]'" in r.stderr, r.stderr
    assert "in a checkout of the project: pip install -e '.[convert]'" in r.stderr, r.stderr
