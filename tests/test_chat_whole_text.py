"""convert-chat writes the ids of the whole rendered text, the ids inference sees.

With real tokenizers (GPT-2's byte-level BPE, Phi-3's SentencePiece-style BPE
whose special tokens swallow the spaces after them) and both template kinds, on
random conversations: the text is rendered by hand here, the ids are the
tokenizer's own for that whole text (``transformers``: ``tokenizer(text,
add_special_tokens=False)`` and ``apply_chat_template(..., tokenize=True)``;
``tokenizers``: ``Tokenizer.encode(text, add_special_tokens=False)``), and the
mask is worked out token by token from the tokenizer's offsets.
"""

from __future__ import annotations

import json
import tempfile
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

import flat_tokens_jax as ftj
from flat_tokens_jax.convert.chat import ChatTemplate, convert_chat

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
PHI3 = DATA / "tokenizer-phi3-mini.json"
GPT2 = DATA / "tokenizer-gpt2.json"
ROLES = ["system", "user", "assistant", "tool", "ipython", "function"]
# The GPT-2 directory's template writes its bos first and has no branch for system or tool.
GPT2_JINJA = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}User: {{ m['content'] }}\n"
    "{% elif m['role'] == 'assistant' %}Assistant: {{ m['content'] }}<|endoftext|>\n"
    "{% endif %}{% endfor %}"
)

Messages = list[tuple[str, str]]
Spans = list[tuple[int, int]]

pytestmark = pytest.mark.skipif(
    not (PHI3.is_file() and GPT2.is_file()), reason="shared tokenizers not found"
)


# -- By-hand renderings: (text, trained spans, roles left out). ----------------------


def phi3_own(messages: Messages, bos: str = "") -> tuple[str, Spans, set[str]]:
    """Phi-3's chat template: no branch for tool roles; eos last, untrained."""
    text, spans = bos, []
    for role, content in messages:
        if role in ("system", "user", "assistant"):
            text += f"<|{role}|>\n"
            if role == "assistant":
                spans.append((len(text), len(text) + len(content) + len("<|end|>")))
            text += f"{content}<|end|>\n"
    return text + "<|endoftext|>", spans, {"tool", "ipython", "function"}


def gpt2_own(messages: Messages) -> tuple[str, Spans, set[str]]:
    text, spans = "<|endoftext|>", []
    for role, content in messages:
        if role == "user":
            text += f"User: {content}\n"
        elif role == "assistant":
            text += "Assistant: "
            spans.append((len(text), len(text) + len(content) + len("<|endoftext|>")))
            text += f"{content}<|endoftext|>\n"
    return text, spans, {"system", "tool", "ipython", "function"}


PHI3_YAML = {
    "bos": "<s>",
    "eos": "<|endoftext|>",
    "end_of_turn": "<|end|>",
    "roles": {
        r: {"prefix": f"<|{r}|>\n", "suffix": "<|end|>\n"} for r in ("system", "user", "assistant")
    }
    | {"tool": {"prefix": "Tool: ", "suffix": "\n"}},
}
GPT2_YAML = {
    "eos": "<|endoftext|>",
    "end_of_turn": "<|endoftext|>",
    "roles": {
        "system": {"prefix": "", "suffix": "\n\n"},
        "user": {"prefix": "Q: ", "suffix": "\n"},
        "assistant": {"prefix": "A: ", "suffix": " <|endoftext|>\n"},
    },
}


def by_yaml(config: dict[str, Any]) -> Callable[[Messages], tuple[str, Spans, set[str]]]:
    """A YAML template's text: bos, each turn's prefix + content + suffix, eos;
    trained: assistant content and suffix up to end_of_turn, eos after a last one."""

    def render(messages: Messages) -> tuple[str, Spans, set[str]]:
        text, spans = config.get("bos") or "", []
        eot = config["end_of_turn"]
        for role, content in messages:
            affix = config["roles"][role]
            text += affix["prefix"]
            if role == "assistant":
                cut = affix["suffix"].index(eot) + len(eot)
                spans.append((len(text), len(text) + len(content) + cut))
            text += content + affix["suffix"]
        if messages[-1][0] == "assistant":
            spans.append((len(text), len(text) + len(config["eos"])))
        return text + config["eos"], spans, set()

    return render


def reference_mask(text: str, offsets: list[tuple[int, int]], spans: Spans) -> list[int]:
    """Token by token: trained when a non-space character of it is in a span (a
    token of spaces only: when any of its characters is)."""
    out = []
    for start, end in offsets:
        chars = range(start, end)
        solid = [c for c in chars if not text[c].isspace()]
        out.append(int(any(a <= c < b for c in (solid or chars) for a, b in spans)))
    return out


# -- Tokenizers. --------------------------------------------------------------------


def _hf_dir(path: Path, tokenizer_json: Path, config: dict[str, Any]) -> Path:
    path.mkdir()
    (path / "tokenizer.json").write_bytes(tokenizer_json.read_bytes())
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """transformers directories: Phi-3 as published, Phi-3 whose template writes
    bos first, and GPT-2 with ``GPT2_JINJA``."""
    root = tmp_path_factory.mktemp("hf")
    phi3 = json.loads((DATA / "tokenizer-phi3-mini-config.json").read_text())
    gpt2 = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|endoftext|>",
        "eos_token": "<|endoftext|>",
        "chat_template": GPT2_JINJA,
    }
    return {
        "phi3": _hf_dir(root / "phi3", PHI3, phi3),
        "phi3-bos": _hf_dir(
            root / "phi3-bos",
            PHI3,
            {**phi3, "chat_template": "{{ bos_token }}" + phi3["chat_template"]},
        ),
        "gpt2": _hf_dir(root / "gpt2", GPT2, gpt2),
    }


@pytest.fixture(scope="module")
def hf(dirs: dict[str, Path]) -> dict[str, Any]:
    from transformers import AutoTokenizer

    return {
        k: AutoTokenizer.from_pretrained(str(p), local_files_only=True) for k, p in dirs.items()
    }


def stored(url: Path) -> list[tuple[list[int], list[int]]]:
    ft = ftj.open_dataset(url)["train"]
    lo, hi = ft.sequence_bounds(np.arange(ft.num_sequences))
    pending = ft.request_loss_mask(lo, hi)
    assert pending is not None  # every conversation trains a token, so the mask is there
    masks = pending.result()
    seqs = ft.sequences(np.arange(ft.num_sequences))
    return [(s.tolist(), m.tolist()) for s, m in zip(seqs, masks, strict=True)]


def dropped_report(path: Path, convs: list[Messages], left_out: set[str]) -> dict[str, Any]:
    """The summary's ``dropped_messages`` for ``convs`` read from ``path``, by hand."""
    lost = [[r for r, _ in m if r in left_out] for m in convs]
    if not any(lost):
        return {}
    roles = Counter(r for roles in lost for r in roles)
    first = next(i for i, roles in enumerate(lost) if roles) + 1
    return {
        str(path): {
            "messages": sum(roles.values()),
            "conversations": sum(1 for roles in lost if roles),
            "roles": dict(roles),
            "first": f"{path} line {first}",
        }
    }


# -- The property. -------------------------------------------------------------------

chars = st.one_of(
    st.sampled_from([" ", "\n", "\t", "\u00a0", "\u3000"]),
    st.characters(codec="utf-8", exclude_characters="<", exclude_categories=("Cc", "Cs", "Co")),
)
contents = st.text(chars, max_size=10)


def conversations(roles: list[str]) -> st.SearchStrategy[list[Messages]]:
    turns = st.lists(st.tuples(st.sampled_from(roles), contents), min_size=1, max_size=6)
    with_answer = turns.map(
        lambda t: t if any(r == "assistant" for r, _ in t) else [*t, ("assistant", "ok")]
    )
    return st.lists(with_answer, min_size=1, max_size=4)


def convert(convs: list[Messages], tokenizer: Path, **kwargs: Any) -> tuple[list[Any], Any]:
    """Converts ``convs`` (one JSONL file): the stored sequences and the summary."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "c.jsonl"
        lines = [json.dumps({"messages": [{"role": r, "content": c} for r, c in m]}) for m in convs]
        src.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
        summary = convert_chat(src, Path(tmp) / "out", tokenizer=tokenizer, **kwargs)
        summary["dropped_messages"] = {
            k.replace(str(src), "SRC"): {**v, "first": v["first"].replace(str(src), "SRC")}
            for k, v in summary["dropped_messages"].items()
        }
        return stored(Path(tmp) / "out"), summary


SETTINGS = settings(max_examples=6, deadline=None)


@SETTINGS
@given(convs=conversations(ROLES))
@example(
    convs=[
        [
            ("system", "  Be\nkind "),
            ("user", "Hi  there"),
            ("tool", "42"),
            ("assistant", " Yes.\n"),
        ],
        [("ipython", ""), ("assistant", ""), ("function", "f"), ("user", "")],
    ]
)
def test_tokenizer_template_ids_are_those_inference_sees(
    convs: list[Messages], dirs: dict[str, Path], hf: dict[str, Any]
) -> None:
    """Own template: ids == apply_chat_template(tokenize=True) == hf(text); mask by offsets."""
    cases = (
        ("phi3", phi3_own),
        ("phi3-bos", lambda m: phi3_own(m, bos="<s>")),
        ("gpt2", gpt2_own),
    )
    for name, render in cases:
        tok = hf[name]
        got, summary = convert(convs, dirs[name])
        assert len(got) == len(convs), name
        left_out: set[str] = set()
        for (ids, mask), messages in zip(got, convs, strict=True):
            text, spans, left_out = render(messages)
            chat = [{"role": r, "content": c} for r, c in messages]
            assert tok.apply_chat_template(chat, tokenize=False) == text, name
            enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
            assert ids == enc["input_ids"], (name, text)
            assert ids == tok.apply_chat_template(chat, tokenize=True)["input_ids"], name
            assert mask == reference_mask(text, enc["offset_mapping"], spans), (name, text)
        assert summary["dropped_messages"] == dropped_report(Path("SRC"), convs, left_out), name


@SETTINGS
@given(convs=conversations(["system", "user", "assistant", "tool"]))
def test_yaml_template_ids_are_the_whole_texts(
    convs: list[Messages], dirs: dict[str, Path], hf: dict[str, Any]
) -> None:
    """YAML template: ids == Tokenizer.encode(text) for a tokenizers JSON, and
    hf(text) for a transformers directory; mask by offsets."""

    def by_json(path: Path) -> Callable[[str], tuple[list[int], list[tuple[int, int]]]]:
        tok = Tokenizer.from_file(str(path))

        def encode(text: str) -> tuple[list[int], list[tuple[int, int]]]:
            enc = tok.encode(text, add_special_tokens=False)
            return enc.ids, enc.offsets

        return encode

    def by_hf(tok: Any) -> Callable[[str], tuple[list[int], list[tuple[int, int]]]]:
        def encode(text: str) -> tuple[list[int], list[tuple[int, int]]]:
            enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
            return enc["input_ids"], enc["offset_mapping"]

        return encode

    cases = (
        (PHI3, PHI3_YAML, by_json(PHI3)),
        (GPT2, GPT2_YAML, by_json(GPT2)),
        (dirs["phi3"], PHI3_YAML, by_hf(hf["phi3"])),
    )
    for path, config, encode in cases:
        usable = [m for m in convs if all(r in config["roles"] for r, _ in m)]
        if not usable:
            continue
        got, summary = convert(usable, path, template=ChatTemplate.from_dict(config))
        assert summary["dropped_messages"] == {}
        for (ids, mask), messages in zip(got, usable, strict=True):
            text, spans, _ = by_yaml(config)(messages)
            want, offsets = encode(text)
            assert ids == want, (path, text)
            assert mask == reference_mask(text, offsets, spans), (path, text)
            if config.get("bos"):
                assert mask[0] == 0 and ids[0] == want[0] == 1  # Phi-3's <s>, untrained


def test_a_tokenizer_directory_and_its_json_file_may_tokenize_differently(
    hf: dict[str, Any],
) -> None:
    """Why docs/guide/finetuning.md says to pass the directory: transformers rebuilds Phi-3's
    pipeline (a prefix space only at the very start), so the JSON file alone
    gives other ids after special tokens than inference with transformers."""
    text = "<|user|>\nHi there<|end|>\n"
    raw = Tokenizer.from_file(str(PHI3)).encode(text, add_special_tokens=False).tokens
    assert raw == ["<|user|>\n", "▁Hi", "▁there", "<|end|>\n"]
    tok = hf["phi3"]
    assert tok.convert_ids_to_tokens(tok(text, add_special_tokens=False)["input_ids"]) == [
        "<|user|>",
        "Hi",
        "▁there",
        "<|end|>",
    ]
