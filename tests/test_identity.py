"""flat_tokens_jax.store.identity: a dataset records what made it; converters, merge and
info use it."""

from __future__ import annotations

import hashlib
import importlib.metadata
import itertools
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from memurls import memory_url
from textdata import EOS, write_jsonl

import flat_tokens_jax as ftj
from flat_tokens_jax.cli import main
from flat_tokens_jax.convert.chat import convert_chat
from flat_tokens_jax.convert.megatron import import_megatron
from flat_tokens_jax.convert.merge import merge
from flat_tokens_jax.convert.text import convert
from flat_tokens_jax.store.identity import check_tokenizers, tokenizer_info

CHAT_YAML = Path(__file__).resolve().parents[1] / "configs" / "chat.yaml"


def expected_vocab_hash(tokenizer_json: Path) -> str:
    """The vocabulary hash computed from the tokenizer file itself: the model's
    vocabulary and the added tokens, as sorted compact JSON."""
    spec = json.loads(tokenizer_json.read_text(encoding="utf-8"))
    vocab = dict(spec["model"]["vocab"])
    vocab.update({t["content"]: t["id"] for t in spec["added_tokens"]})
    text = json.dumps(vocab, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def expected_inputs_sha256(files: list[Path]) -> str:
    """SHA-256 over each file's SHA-256 hex digest and a newline, in order."""
    lines = b"".join(hashlib.sha256(f.read_bytes()).hexdigest().encode() + b"\n" for f in files)
    return "sha256:" + hashlib.sha256(lines).hexdigest()


def root_meta(path: Path) -> dict[str, Any]:
    meta: dict[str, Any] = json.loads((path / "zarr.json").read_text())
    return meta


def set_root_attributes(path: Path, change: Any) -> None:
    """Rewrites the root group's attributes of the (zarr v3) dataset at ``path``."""
    meta = root_meta(path)
    change(meta["attributes"])
    (path / "zarr.json").write_text(json.dumps(meta))


INFO = ftj.DatasetInfo(
    tokenizer=ftj.TokenizerInfo("tok.json", "sha256:0123456789abcdef", 500, bos_id=1, eos_id=0),
    start_token_id=0,
    flags={"append_eos": True, "template": {"name": "chat.yaml", "sha256": "ab"}},
    inputs={"count": 2, "names": ["a.jsonl", "b.jsonl"], "sha256": "sha256:00"},
)


# -- DatasetInfo in the root attributes. ---------------------------------------------


@pytest.mark.parametrize("where", ["local", "memory"])
def test_info_round_trips_through_write_and_open(tmp_path: Path, where: str) -> None:
    url = str(tmp_path / "ds") if where == "local" else memory_url()
    ftj.write_dataset(url, {"train": [[1, 2, 3], [4, 5]]}, info=INFO, attributes={"mine": 7})
    ds = ftj.open_dataset(url)
    version = importlib.metadata.version("flat-tokens-jax")
    assert ds.info == ftj.DatasetInfo(
        INFO.tokenizer, INFO.start_token_id, INFO.flags, INFO.inputs, version
    )
    assert ds["train"].info == ds.info
    assert ds["train"].split("1,1")[1].info == ds.info
    assert ds.attributes["mine"] == 7
    assert ds.attributes["flat_tokens"]["dataset"] == "flat-tokens"
    assert ds.attributes["flat_tokens"]["tokenizer"]["vocab_hash"] == "sha256:0123456789abcdef"


def test_every_dataset_written_says_it_is_flat_tokens_and_the_version(tmp_path: Path) -> None:
    ftj.write_dataset(tmp_path / "ds", {"train": [[1]]})
    version = importlib.metadata.version("flat-tokens-jax")
    assert ftj.__version__ == version
    assert root_meta(tmp_path / "ds")["attributes"] == {
        "flat_tokens": {
            "dataset": "flat-tokens",
            "library_version": version,
            "flags": {},
            "inputs": {},
            "splits": ["train", "validation"],
        }
    }
    info = ftj.open_dataset(tmp_path / "ds").info
    assert info is not None and info.tokenizer is None and info.start_token_id is None


def test_a_user_attribute_named_flat_tokens_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"may not have the key 'flat_tokens'.*info=DatasetInfo"):
        ftj.DatasetWriter(tmp_path / "ds", attributes={"flat_tokens": {}})
    assert not (tmp_path / "ds").exists() or not any((tmp_path / "ds").iterdir())


def test_datasets_without_the_attribute_open_with_info_none(tmp_path: Path) -> None:
    ftj.write_dataset(tmp_path / "old", {"train": [[1, 2]]}, attributes={"megatron": {"x": 1}})
    set_root_attributes(tmp_path / "old", lambda a: a.pop("flat_tokens"))
    ds = ftj.open_dataset(tmp_path / "old")
    assert ds.info is None and ds["train"].info is None
    assert ds.attributes == {"megatron": {"x": 1}}
    ftj.validate(tmp_path / "old")
    assert ftj.summary(tmp_path / "old")["info"] is None


@pytest.mark.parametrize(
    ("key", "value", "named"),
    [
        ("flat_tokens", "yes", "'flat_tokens' must be an object"),
        ("start_token_id", -1, "start_token_id must be >= 0"),
        ("start_token_id", "0", "flat_tokens.start_token_id must be an int"),
        ("flags", [1], "flat_tokens.flags must be an object"),
        ("inputs", 3, "flat_tokens.inputs must be an object"),
        ("tokenizer", {"name": "t", "vocab_hash": "sha256:1"}, "tokenizer.vocab_size must be"),
        (
            "tokenizer",
            {"name": "t", "vocab_hash": "sha256:1", "vocab_size": 5, "bos_id": 9},
            "bos_id 9 is outside",
        ),
        ("library_version", 1, "flat_tokens.library_version must be a str"),
    ],
)
def test_malformed_attributes_raise_format_error_naming_the_key(
    tmp_path: Path, key: str, value: Any, named: str
) -> None:
    ftj.write_dataset(tmp_path / "ds", {"train": [[1]]})

    def change(attrs: dict[str, Any]) -> None:
        if key == "flat_tokens":
            attrs[key] = value
        else:
            attrs["flat_tokens"][key] = value

    set_root_attributes(tmp_path / "ds", change)
    with pytest.raises(ftj.FormatError, match=named):
        ftj.open_dataset(tmp_path / "ds")
    with pytest.raises(ftj.FormatError, match=named):
        ftj.validate(tmp_path / "ds")


def test_check_tokenizers_names_both_and_skips_unrecorded() -> None:
    a = ftj.DatasetInfo(tokenizer=ftj.TokenizerInfo("gpt2.json", "sha256:aaaa", 10))
    b = ftj.DatasetInfo(tokenizer=ftj.TokenizerInfo("llama", "sha256:bbbb", 10))
    same = ftj.DatasetInfo(tokenizer=ftj.TokenizerInfo("copy-of-gpt2", "sha256:aaaa", 10))
    check_tokenizers(
        [("x", a), ("old", None), ("bare", ftj.DatasetInfo()), ("y", same)],
        allow_mixed=False,
        fix="FIX",
    )
    with pytest.raises(ValueError) as e:
        check_tokenizers([("x", a), ("old", None), ("z", b)], allow_mixed=False, fix="pass FIX")
    for part in ("x", "gpt2.json (sha256:aaaa)", "z", "llama (sha256:bbbb)", "pass FIX"):
        assert part in str(e.value)
    check_tokenizers([("x", a), ("z", b)], allow_mixed=True, fix="FIX")


def test_tokenizer_info_of_tokenizers_and_of_anything_with_get_vocab(
    eos_tokenizer: Path,
) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(eos_tokenizer))
    eos = tok.token_to_id("<|endoftext|>")
    info = tokenizer_info(tok, "eos-only", eos_id=eos)
    assert info.vocab_hash == expected_vocab_hash(eos_tokenizer)
    assert info.vocab_size == 500 and info.eos_id == eos

    class Plain:  # a transformers-style tokenizer: get_vocab() takes no arguments
        def get_vocab(self) -> dict[str, int]:
            return tok.get_vocab(with_added_tokens=True)

    assert tokenizer_info(Plain(), "plain").vocab_hash == info.vocab_hash


# -- Converters record what made the data. ------------------------------------------


def inputs(tmp_path: Path) -> list[Path]:
    rng = np.random.default_rng(1)
    words = ["alpha", "beta", "gamma", "delta"]
    out = []
    for name, n in (("a", 20), ("b", 13)):
        docs = [{"text": " ".join(rng.choice(words, rng.integers(1, 40)))} for _ in range(n)]
        out.append(write_jsonl(tmp_path / f"{name}.jsonl", docs))
    return out


def test_convert_records_tokenizer_flags_start_id_and_inputs(
    tmp_path: Path, tok_file: Path
) -> None:
    files = inputs(tmp_path)
    convert(
        str(tmp_path / "*.jsonl"),
        tmp_path / "out",
        tokenizer=tok_file,
        append_eos=True,
        prepend_bos=True,
        start_token_id="bos",
        progress=False,
    )
    info = ftj.open_dataset(tmp_path / "out").info
    assert info is not None and info.tokenizer is not None
    vocab = json.loads(tok_file.read_text())
    ids = {t["content"]: t["id"] for t in vocab["added_tokens"]}
    assert info.tokenizer.vocab_hash == expected_vocab_hash(tok_file)
    assert info.tokenizer.name == str(tok_file)
    assert info.tokenizer.vocab_size == 1 + max(vocab["model"]["vocab"].values())
    assert (info.tokenizer.bos_id, info.tokenizer.eos_id) == (ids["<s>"], ids[EOS])
    assert info.start_token_id == ids["<s>"]
    assert info.flags["append_eos"] is True and info.flags["prepend_bos"] is True
    assert info.flags["add_special_tokens"] is False and info.flags["text_key"] == "text"
    assert info.inputs == {
        "count": 2,
        "names": [str(f) for f in files],
        "sha256": expected_inputs_sha256(files),
    }


def test_convert_with_max_tokens_records_no_input_hash(tmp_path: Path, tok_file: Path) -> None:
    inputs(tmp_path)
    convert(str(tmp_path / "*.jsonl"), tmp_path / "out", tokenizer=tok_file, max_tokens=50)
    info = ftj.open_dataset(tmp_path / "out").info
    assert info is not None and info.inputs["count"] == 2 and "sha256" not in info.inputs
    assert info.flags["max_tokens"] == 50


def test_start_token_id_needs_the_tokenizers_id(tmp_path: Path, eos_tokenizer: Path) -> None:
    files = inputs(tmp_path)
    with pytest.raises(
        ValueError, match=r"start_token_id bos: tokenizer .*eos-only\.json has none"
    ):
        convert(files, tmp_path / "out", tokenizer=eos_tokenizer, start_token_id="bos")
    with pytest.raises(ValueError, match="needs tokenizer="):
        convert(files, tmp_path / "out", tokens_key="ids", start_token_id="eos")
    with pytest.raises(ValueError, match="a token id >= 0, bos or eos, got 'pad'"):
        convert(files, tmp_path / "out", tokenizer=eos_tokenizer, start_token_id="pad")


def test_command_line_start_token_id(
    tmp_path: Path, tok_file: Path, eos_tokenizer: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    files = [str(f) for f in inputs(tmp_path)]
    out = str(tmp_path / "out")
    assert (
        main(["convert", *files, out, "--tokenizer", str(tok_file), "--start-token-id", "bos"]) == 0
    )
    bos = json.loads(tok_file.read_text())["model"]["vocab"].get("<s>")
    info = ftj.open_dataset(out).info
    assert info is not None and info.start_token_id == bos is not None
    capsys.readouterr()
    args = ["convert", *files, out, "--overwrite", "--tokenizer", str(eos_tokenizer)]
    assert main([*args, "--start-token-id", "bos"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "start_token_id bos" in err and "has none" in err
    assert main([*args, "--start-token-id", "7"]) == 0
    info = ftj.open_dataset(out).info
    assert info is not None and info.start_token_id == 7
    with pytest.raises(SystemExit):
        main([*args, "--start-token-id", "first"])
    assert "expected a token id >= 0, bos or eos" in capsys.readouterr().err


def test_convert_chat_records_template_and_options(tmp_path: Path, tok_file: Path) -> None:
    convs = [
        {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}]}
        for i in range(5)
    ]
    src = write_jsonl(tmp_path / "c.jsonl", convs)
    convert_chat(src, tmp_path / "out", tokenizer=tok_file, template=CHAT_YAML, start_token_id=3)
    info = ftj.open_dataset(tmp_path / "out").info
    assert info is not None and info.tokenizer is not None
    assert info.tokenizer.vocab_hash == expected_vocab_hash(tok_file)
    assert info.start_token_id == 3
    assert info.flags["template"] == {
        "name": str(CHAT_YAML),
        "sha256": hashlib.sha256(CHAT_YAML.read_bytes()).hexdigest(),
    }
    assert info.flags["converter"] == "convert-chat"
    assert info.flags["train_on"] is None and info.flags["end_of_turn"] is None
    assert info.inputs == {"count": 1, "names": [str(src)], "sha256": expected_inputs_sha256([src])}


def test_import_megatron_records_tokenizer_flags_and_both_files(
    tmp_path: Path, tok_file: Path
) -> None:
    ftj.write_dataset(tmp_path / "src", {"train": [[5, 6, 7], [8]]})
    from flat_tokens_jax.convert.megatron import export_megatron

    export_megatron(tmp_path / "src", tmp_path / "m", dtype_code=8)
    import_megatron([tmp_path / "m"], tmp_path / "out", tokenizer=tok_file, per_sequence=True)
    info = ftj.open_dataset(tmp_path / "out").info
    assert info is not None and info.tokenizer is not None
    assert info.tokenizer.vocab_hash == expected_vocab_hash(tok_file)
    assert info.flags == {"converter": "import-megatron", "per_sequence": True, "dtype_code": 8}
    pair = [tmp_path / "m.idx", tmp_path / "m.bin"]
    assert info.inputs == {
        "count": 1,
        "names": [str(tmp_path / "m")],
        "sha256": expected_inputs_sha256(pair),
    }
    import_megatron([tmp_path / "m"], tmp_path / "bare")
    bare = ftj.open_dataset(tmp_path / "bare").info
    assert bare is not None and bare.tokenizer is None


# -- merge. ---------------------------------------------------------------------------


def with_tokenizer(path: Path, name: str, hashed: str, seqs: list[list[int]]) -> str:
    info = ftj.DatasetInfo(
        tokenizer=ftj.TokenizerInfo(name, hashed, 100), flags={"append_eos": True}
    )
    ftj.write_dataset(path, {"train": seqs}, info=info)
    return str(path)


def test_merge_refuses_mixed_tokenizers_naming_both(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a = with_tokenizer(tmp_path / "a", "gpt2", "sha256:aaaa", [[1, 2]])
    b = with_tokenizer(tmp_path / "b", "llama", "sha256:bbbb", [[3]])
    with pytest.raises(ValueError, match="allow_mixed_tokenizers=True") as e:
        merge([a, b], tmp_path / "out")
    assert "gpt2 (sha256:aaaa)" in str(e.value) and "llama (sha256:bbbb)" in str(e.value)
    assert a in str(e.value) and b in str(e.value)
    assert not (tmp_path / "out").exists()
    assert main(["merge", a, b, str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "--allow-mixed-tokenizers" in err and err.count("\n") == 1
    assert main(["merge", a, b, str(tmp_path / "out"), "--allow-mixed-tokenizers"]) == 0
    info = ftj.open_dataset(tmp_path / "out").info
    assert info is not None and info.tokenizer is None and info.flags == {"append_eos": True}
    assert info.inputs["names"] == [a, b] and info.inputs["sha256"].startswith("sha256:")


def test_merge_carries_a_common_tokenizer_and_mixes_old_datasets(tmp_path: Path) -> None:
    a = with_tokenizer(tmp_path / "a", "gpt2", "sha256:aaaa", [[1, 2]])
    b = with_tokenizer(tmp_path / "b", "gpt2-copy", "sha256:aaaa", [[3]])
    merge([a, b], tmp_path / "same")
    info = ftj.open_dataset(tmp_path / "same").info
    assert info is not None and info.tokenizer is not None and info.tokenizer.name == "gpt2"
    ftj.write_dataset(tmp_path / "old", {"train": [[4]]})
    set_root_attributes(tmp_path / "old", lambda attrs: attrs.pop("flat_tokens"))
    merge([a, str(tmp_path / "old")], tmp_path / "mixed")
    mixed = ftj.open_dataset(tmp_path / "mixed")
    assert mixed.info is not None and mixed.info.tokenizer is None and mixed.info.flags == {}
    assert mixed["train"].num_sequences == 2
    shutil.rmtree(tmp_path / "same")
    merge([a, b], tmp_path / "same")
    again = ftj.open_dataset(tmp_path / "same").info
    assert again is not None and again.inputs == info.inputs  # the hash is deterministic


# -- info. ----------------------------------------------------------------------------


def test_info_prints_what_made_it_and_a_length_histogram(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rng = np.random.default_rng(3)
    lengths = rng.integers(1, 700, 500)
    lengths[:3] = [1, 512, 511]
    seqs = [np.ones(n, np.int32) for n in lengths]
    url = str(tmp_path / "ds")
    ftj.write_dataset(url, {"train": seqs}, info=INFO)
    assert main(["info", url, "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["info"]["tokenizer"]["name"] == "tok.json"
    hist = got["splits"]["train"]["histogram"]
    edges = [2**k for k in range(11)]  # 1 .. 1024: the shortest is 1, the longest < 1024
    assert hist["edges"] == edges
    assert hist["counts"] == np.histogram(lengths, edges)[0].tolist()
    assert "histogram" not in got["splits"]["validation"]  # empty split
    assert main(["info", url]) == 0
    out = capsys.readouterr().out
    for text in (
        "tokenizer: tok.json (sha256:0123456789abcdef), vocab_size 500, bos 1, eos 0, pad -",
        "start_token_id: 0",
        "append_eos=true",
        "inputs: 2 (a.jsonl, b.jsonl), sha256:00",
        f"made by: flat_tokens_jax {ftj.__version__}",
    ):
        assert text in out, text
    rows = [line.split() for line in out.splitlines() if " | " in line]
    assert [r[0] for r in rows] == [
        f"{a}-{b - 1}" if b - 1 > a else f"{a}" for a, b in itertools.pairwise(edges)
    ]
    assert [int(r[-1].replace(",", "")) for r in rows] == hist["counts"]
    biggest = int(np.argmax(hist["counts"]))
    assert rows[biggest][2] == "█" * 40
    set_root_attributes(tmp_path / "ds", lambda attrs: attrs.pop("flat_tokens"))
    assert main(["info", url]) == 0
    assert "made by: not recorded" in capsys.readouterr().out
