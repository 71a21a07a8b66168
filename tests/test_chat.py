"""flat_tokens_jax.convert.chat: conversations to flat-tokens with loss masks.

The references here never call the code under test: conversations are rendered
by hand from the template, and which tokens are trained is worked out byte by
byte from the tokens' own strings (GPT-2 byte-level pieces), not from offsets.
"""

from __future__ import annotations

import json
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from textdata import SPECIALS
from tokenizers import Tokenizer

import flat_tokens_jax as ftj
from flat_tokens_jax.cli import main
from flat_tokens_jax.convert import chat_template
from flat_tokens_jax.convert.chat import ChatTemplate, convert_chat
from flat_tokens_jax.convert.inputs import InputError

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
CHAT_YAML = Path(__file__).resolve().parents[1] / "configs" / "chat.yaml"
CHATML_JINJA = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
)
FROM = {"user": "human", "assistant": "gpt", "system": "system"}


@pytest.fixture(scope="module")
def tok(tok_file: Path) -> Tokenizer:
    return Tokenizer.from_file(str(tok_file))


@pytest.fixture(scope="module")
def hf_dir(tok_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A transformers tokenizer directory with a small ChatML chat template."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_file(str(tok_file)), eos_token="<|endoftext|>"
    )
    hf.chat_template = CHATML_JINJA
    path = tmp_path_factory.mktemp("hf")
    hf.save_pretrained(str(path))
    return path


# -- References. -------------------------------------------------------------------


def _byte_of_char() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the byte each printable stand-in encodes."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    stand_ins = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            stand_ins.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, stand_ins, strict=True)}


BYTE_OF = _byte_of_char()


def reference_mask(
    tok: Tokenizer, ids: list[int], text: str, spans: list[tuple[int, int]]
) -> list[int]:
    """Trained tokens, token by token from the bytes each token stands for.

    A token is trained when one of its non-space characters is in ``spans``
    (a token of spaces only: when one of its characters is).
    """
    special = {tok.token_to_id(s): s for s in SPECIALS}
    data = text.encode()
    char_of_byte = [i for i, ch in enumerate(text) for _ in ch.encode()]
    trained = [any(a <= i < b for a, b in spans) for i in range(len(text))]
    out, pos = [], 0
    for t in ids:
        piece = (
            special[t].encode() if t in special else bytes(BYTE_OF[c] for c in tok.id_to_token(t))
        )
        assert data[pos : pos + len(piece)] == piece
        chars = sorted({char_of_byte[k] for k in range(pos, pos + len(piece))})
        solid = [c for c in chars if not text[c].isspace()]
        out.append(int(any(trained[c] for c in (solid or chars))))
        pos += len(piece)
    assert pos == len(data)
    return out


def chatml(
    messages: list[tuple[str, str]], system: str | None = None
) -> tuple[str, list[tuple[int, int]]]:
    """ChatML text and the trained spans (assistant content + ``<|im_end|>``), by hand."""
    text, spans = "", []
    turns = ([("system", system)] if system else []) + messages
    for role, content in turns:
        text += f"<|im_start|>{role}\n"
        if role == "assistant":
            spans.append((len(text), len(text) + len(content) + len("<|im_end|>")))
        text += f"{content}<|im_end|>\n"
    return text, spans


PLAIN = {
    "eos": "<|endoftext|>",
    "roles": {
        "system": {"prefix": "System:", "suffix": "\n"},
        "user": {"prefix": "User:", "suffix": "\n"},
        "assistant": {"prefix": "Assistant:", "suffix": "and\n"},
    },
}


def plain(messages: list[tuple[str, str]]) -> tuple[str, list[tuple[int, int]]]:
    """``PLAIN``'s text and trained spans (assistant contents, eos after a last one), by hand."""
    text, spans = "", []
    for role, content in messages:
        text += f"{role.capitalize()}:"
        if role == "assistant":
            spans.append((len(text), len(text) + len(content)))
        text += content + ("and\n" if role == "assistant" else "\n")
    if messages[-1][0] == "assistant":
        spans.append((len(text), len(text) + len("<|endoftext|>")))
    return text + "<|endoftext|>", spans


def stored(url: Path, split: str = "train") -> list[tuple[list[int], list[int]]]:
    """``(ids, loss mask)`` of every sequence of a split."""
    ft = ftj.open_dataset(url)[split]
    lo, hi = ft.sequence_bounds(np.arange(ft.num_sequences))
    pending = ft.request_loss_mask(lo, hi)
    if pending is None:  # a split with no sequences has no mask either
        assert ft.num_sequences == 0
        return []
    masks = pending.result()
    return [
        (s.tolist(), m.tolist())
        for s, m in zip(ft.sequences(np.arange(ft.num_sequences)), masks, strict=True)
    ]


def document(messages: list[tuple[str, str]], form: str, **extra: Any) -> dict[str, Any]:
    if form == "conversations":
        return {"conversations": [{"from": FROM[r], "value": c} for r, c in messages], **extra}
    return {"messages": [{"role": r, "content": c} for r, c in messages], **extra}


def write_jsonl(path: Path, documents: list[Any]) -> Path:
    lines = [r if isinstance(r, str) else json.dumps(r) for r in documents]
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


# -- Masks against the references. ------------------------------------------------

chars = st.one_of(
    st.sampled_from([" ", "\n", "\t", "\u00a0", "\u3000"]),
    st.characters(codec="utf-8", exclude_characters="<", exclude_categories=("Cc", "Cs", "Co")),
)
contents = st.text(chars, max_size=12)
turn_lists = st.lists(
    st.tuples(st.sampled_from(["user", "assistant", "system"]), contents), min_size=1, max_size=6
).map(
    lambda turns: (
        turns if any(r == "assistant" for r, _ in turns) else [*turns, ("assistant", "ok")]
    )
)
conversations = st.lists(
    st.tuples(turn_lists, st.sampled_from(["conversations", "messages"]), st.none() | contents),
    min_size=1,
    max_size=5,
)


@settings(max_examples=20)
@given(convs=conversations)
@example(convs=[([("user", "q"), ("assistant", "so ")], "messages", None)])
def test_masks_equal_the_byte_level_reference(
    convs: list[tuple[list[tuple[str, str]], str, str | None]],
    tok: Tokenizer,
    tok_file: Path,
    hf_dir: Path,
) -> None:
    """Both forms, both template sources: ids are the whole text's, masks the reference's."""
    documents = [
        document(m, form, **({"system": s} if s is not None else {})) for m, form, s in convs
    ]
    with tempfile.TemporaryDirectory() as tmp:
        src = write_jsonl(Path(tmp) / "chats.jsonl", documents)
        convert_chat(src, Path(tmp) / "yaml", tokenizer=tok_file, template=CHAT_YAML)
        convert_chat(src, Path(tmp) / "jinja", tokenizer=hf_dir)
        plain_template = ChatTemplate.from_dict(PLAIN)
        out = Path(tmp) / "plain"
        summary = convert_chat(src, out, tokenizer=tok_file, template=plain_template, skip_bad=True)
        got = {name: stored(Path(tmp) / name) for name in ("yaml", "jinja", "plain")}
    # Without an end-of-turn token, a conversation whose trained text is empty,
    # or only spaces that merge into an untrained token, trains nothing: skipped.
    want = []
    for messages, _, _ in convs:
        text, spans = plain(messages)
        ids = tok.encode(text, add_special_tokens=False).ids
        mask = reference_mask(tok, ids, text, spans)
        if any(mask):
            want.append((ids, mask))
    assert got["plain"] == want
    assert summary["skipped_bad"] == len(convs) - len(want)
    for name, system_field in (("yaml", True), ("jinja", False)):
        assert len(got[name]) == len(convs)
        for (ids, mask), (messages, _, system) in zip(got[name], convs, strict=True):
            text, spans = chatml(messages, system if system_field else None)
            assert ids == tok.encode(text, add_special_tokens=False).ids
            assert mask == reference_mask(tok, ids, text, spans), (name, text)
            if all(c[:1].strip() or not c for r, c in messages if r == "assistant"):
                # No trained turn starts with a space: the masked-in tokens spell
                # exactly the assistant contents and their end-of-turn tokens.
                trained = [t for t, m in zip(ids, mask, strict=True) if m]
                want = "".join(c + "<|im_end|>" for r, c in messages if r == "assistant")
                assert tok.decode(trained, skip_special_tokens=False) == want


def test_space_codes_are_those_of_str_isspace() -> None:
    expected = [c for c in range(sys.maxunicode + 1) if chr(c).isspace()]
    assert chat_template.SPACE_CODES.tolist() == expected


def test_yaml_bos_eos_and_fields_before_the_conversation(
    tmp_path: Path, tok: Tokenizer, tok_file: Path
) -> None:
    """The reference's example: role and instruction fields, then a Vicuna-style conversation."""
    template = ChatTemplate.from_dict(
        {
            "bos": "<s>",
            "eos": "<|endoftext|>",
            "end_of_turn": "</s>",
            "fields": [
                {"name": "role", "prefix": "Role: ", "suffix": "\n"},
                {"name": "instruction", "prefix": "Instruction: ", "suffix": "\n"},
            ],
            "roles": {
                "user": {"prefix": "USER: ", "suffix": " "},
                "assistant": {"prefix": "ASSISTANT: ", "suffix": "</s>"},
            },
        }
    )
    conv = [
        ("user", "What is up?"),
        ("assistant", "Hello!"),
        ("user", "Bye"),
        ("assistant", "Goodbye."),
    ]
    src = write_jsonl(
        tmp_path / "c.jsonl",
        [
            document(conv, "conversations", instruction="Be brief.", role="Vicuna", id=0),
            document(conv[:2], "messages"),
        ],
    )
    summary = convert_chat(src, tmp_path / "out", tokenizer=tok_file, template=template)
    first = (
        "<s>Role: Vicuna\nInstruction: Be brief.\nUSER: What is up? ASSISTANT: Hello!</s>"
        "USER: Bye ASSISTANT: Goodbye.</s><|endoftext|>"
    )
    second = "<s>USER: What is up? ASSISTANT: Hello!</s><|endoftext|>"
    (ids1, mask1), (ids2, mask2) = stored(tmp_path / "out")
    for ids, mask, text in ((ids1, mask1, first), (ids2, mask2, second)):
        spans = [(m.start(1), m.end()) for m in re.finditer(r"ASSISTANT: (.*?)</s>", text)] + [
            (len(text) - len("<|endoftext|>"), len(text))
        ]
        assert ids == tok.encode(text, add_special_tokens=False).ids
        assert mask == reference_mask(tok, ids, text, spans)
        assert mask[0] == 0 and mask[-1] == 1  # bos never, eos after a trained last turn
    assert summary["trained_tokens"] == sum(mask1) + sum(mask2)


def test_phi3_tokenizer_and_its_own_chat_template(tmp_path: Path) -> None:
    """A real tokenizer whose special tokens swallow the spaces after them."""
    if not (DATA / "tokenizer-phi3-mini.json").is_file():
        pytest.skip("shared Phi-3 tokenizer not found")
    hf = tmp_path / "phi3"
    hf.mkdir()
    (hf / "tokenizer.json").write_bytes((DATA / "tokenizer-phi3-mini.json").read_bytes())
    (hf / "tokenizer_config.json").write_bytes(
        (DATA / "tokenizer-phi3-mini-config.json").read_bytes()
    )
    conv = [
        ("system", "Be kind."),
        ("user", "What is up?"),
        ("assistant", "Hello! How can I help?"),
    ]
    conv += [("user", "Who are you?"), ("assistant", "  A model, trained by people.")]
    src = write_jsonl(tmp_path / "c.jsonl", [document(conv, "conversations")])
    convert_chat(src, tmp_path / "out", tokenizer=hf)
    ((ids, mask),) = stored(tmp_path / "out")
    from transformers import AutoTokenizer

    phi = AutoTokenizer.from_pretrained(str(hf), local_files_only=True)
    text = "".join(f"<|{r}|>\n{c}<|end|>\n" for r, c in conv) + "<|endoftext|>"
    chat_ids = phi.apply_chat_template([{"role": r, "content": c} for r, c in conv])["input_ids"]
    assert ids == chat_ids == phi(text, add_special_tokens=False)["input_ids"]
    trained = [t for t, m in zip(ids, mask, strict=True) if m]
    assert phi.decode(trained, skip_special_tokens=False) == (
        "Hello! How can I help?<|end|>A model, trained by people.<|end|>"
    )
    assert phi.convert_tokens_to_ids("<|assistant|>") not in trained


# -- Padded and packed batches of a converted dataset. ----------------------------


def test_batches_carry_the_mask_aligned_with_targets(
    tmp_path: Path, tok: Tokenizer, tok_file: Path
) -> None:
    convs = [
        [("user", f"question {i}"), ("assistant", f"answer {i}!" * (i % 3 + 1))] for i in range(12)
    ]
    src = write_jsonl(tmp_path / "c.jsonl", [document(c, "messages") for c in convs])
    convert_chat(src, tmp_path / "out", tokenizer=tok_file, template=CHAT_YAML)
    ft = ftj.open_dataset(tmp_path / "out")["train"]
    seqs = stored(tmp_path / "out")
    padded = ftj.Loader(
        ft, ftj.LoaderConfig(batch_size=12, seq_len=64, packing=False, shuffle=False)
    )
    batch = padded.host_batch(0)
    for row, ((ids, _), conv) in enumerate(zip(seqs, convs, strict=True)):
        n = len(ids)
        assert batch["targets"][row, :n].tolist() == ids
        trained = batch["targets"][row][batch["loss_mask"][row]].tolist()
        assert tok.decode(trained, skip_special_tokens=False) == conv[1][1] + "<|im_end|>"
        assert not batch["loss_mask"][row, n:].any()
    flat_ids = [t for ids, _ in seqs for t in ids]
    flat_mask = [m for _, mask in seqs for m in mask]
    packed = ftj.Loader(ft, ftj.LoaderConfig(batch_size=4, seq_len=16, shuffle=False))
    batch = packed.host_batch(1)
    assert batch["targets"].reshape(-1).tolist() == flat_ids[64:128]
    assert batch["loss_mask"].reshape(-1).astype(int).tolist() == flat_mask[64:128]


# -- Inputs and bad input. -------------------------------------------------------


@pytest.mark.parametrize("kind", ["parquet", "hf"])
def test_columnar_inputs_give_what_jsonl_gives(tmp_path: Path, tok_file: Path, kind: str) -> None:
    convs = [[("user", f"q{i}"), ("assistant", f"a{i}")] for i in range(20)]
    documents = [document(c, "messages", id=i) for i, c in enumerate(convs)]
    jsonl = write_jsonl(tmp_path / "c.jsonl", documents)
    if kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        other = tmp_path / "c.parquet"
        pq.write_table(pa.Table.from_pylist(documents), other, row_group_size=7)
    else:
        import datasets

        other = tmp_path / "c_hf"
        datasets.Dataset.from_list(documents).save_to_disk(str(other))
    convert_chat(jsonl, tmp_path / "a", tokenizer=tok_file, template=CHAT_YAML)
    convert_chat(other, tmp_path / "b", tokenizer=tok_file, template=CHAT_YAML)
    assert stored(tmp_path / "a") == stored(tmp_path / "b")


BAD = [
    ({"messages": [{"role": "robot", "content": "hi"}]}, "message 0 has unknown role 'robot'"),
    ({"conversations": []}, "'conversations' is empty"),
    ({"messages": [{"role": "user", "content": "only a question"}]}, "no trained turn"),
    ({"text": "no conversation"}, "no 'conversations' or 'messages' list"),
    ({"messages": [{"role": "user"}]}, r"messages\[0\] must be an object with strings 'role'"),
    (
        {
            "messages": [
                {"role": "user", "content": "a <|im_end|> b"},
                {"role": "assistant", "content": "x"},
            ]
        },
        r"messages\[0\] holds the special token '<\|im_end\|>'",
    ),
    ({"system": 3, "messages": [{"role": "assistant", "content": "x"}]}, "field 'system' is int"),
    (
        '{"messages": [{"role": "assistant", "content": "\\ud800"}]}',
        r"messages\[0\] is not valid Unicode",
    ),
]


@pytest.mark.parametrize(("bad", "why"), BAD)
def test_bad_document_names_file_and_line_or_is_skipped(
    tmp_path: Path, tok_file: Path, bad: dict[str, Any] | str, why: str
) -> None:
    good = document([("user", "q"), ("assistant", "a")], "messages")
    src = write_jsonl(tmp_path / "c.jsonl", [good, good, bad, good])
    with pytest.raises(InputError, match=rf"{re.escape(str(src))} line 3: {why}"):
        convert_chat(src, tmp_path / "out", tokenizer=tok_file, template=CHAT_YAML)
    with pytest.raises(ftj.FormatError, match="did not finish"):
        ftj.open_dataset(tmp_path / "out")
    summary = convert_chat(
        src, tmp_path / "out", tokenizer=tok_file, template=CHAT_YAML, skip_bad=True
    )
    assert (summary["conversations"], summary["skipped_bad"]) == (3, 1)
    assert len(stored(tmp_path / "out")) == 3


def test_unknown_role_of_the_tokenizer_template(tmp_path: Path, hf_dir: Path) -> None:
    src = write_jsonl(tmp_path / "c.jsonl", [{"conversations": [{"from": "bing", "value": "x"}]}])
    with pytest.raises(InputError, match=r"line 1: message 0 has unknown role 'bing'"):
        convert_chat(src, tmp_path / "out", tokenizer=hf_dir)


def test_template_tokens_must_be_single_tokens_of_the_vocabulary(
    tmp_path: Path, tok: Tokenizer, tok_file: Path, hf_dir: Path
) -> None:
    src = write_jsonl(tmp_path / "c.jsonl", [document([("assistant", "a")], "messages")])
    base = {"roles": {"assistant": {"prefix": "<|assistant|>", "suffix": "<|im_end|>"}}}
    with pytest.raises(
        ValueError, match=r"template token '<\|assistant\|>' is not in the tokenizer's vocab"
    ):
        convert_chat(src, tmp_path / "o", tokenizer=tok_file, template=ChatTemplate.from_dict(base))
    ordinary = next(  # a merged word (a space and letters): in the vocab, not an added token
        t
        for t, _ in sorted(tok.get_vocab().items(), key=lambda kv: -kv[1])
        if t.startswith("Ġ") and len(t) > 2 and t[1:].isascii() and t[1:].isalpha()
    )
    plain = {**base, "roles": {"assistant": {}}, "bos": ordinary}
    with pytest.raises(ValueError, match="must be an added \\(special\\) token"):
        convert_chat(
            src, tmp_path / "o", tokenizer=tok_file, template=ChatTemplate.from_dict(plain)
        )
    with pytest.raises(ValueError, match=r"template token '<\|eot\|>' is not in"):
        convert_chat(src, tmp_path / "o", tokenizer=hf_dir, end_of_turn="<|eot|>")
    with pytest.raises(ValueError, match="has no chat template"):
        convert_chat(src, tmp_path / "o", tokenizer=tok_file)


def test_template_config_errors_name_the_field() -> None:
    roles = {"user": {}, "assistant": {"suffix": "<|im_end|>\n"}}
    with pytest.raises(ValueError, match="train_on names 'bot', which is neither a role"):
        ChatTemplate.from_dict({"roles": roles, "train_on": ["bot"]})
    with pytest.raises(
        ValueError, match=r"end_of_turn '</s>' is not in the suffix '<\|im_end\|>\\n'"
    ):
        ChatTemplate.from_dict({"roles": roles, "end_of_turn": "</s>"})
    with pytest.raises(ValueError, match=r"unknown ChatTemplate field\(s\) \['role'\]"):
        ChatTemplate.from_dict({"roles": roles, "role": {}})
    repo = ChatTemplate.from_yaml(CHAT_YAML)
    assert repo.end_of_turn == "<|im_end|>" and repo.train_on == ("assistant",)
    assert set(repo.roles) == {"system", "user", "assistant"}


def test_end_of_turn_options_of_the_tokenizer_template(
    tmp_path: Path, tok: Tokenizer, hf_dir: Path
) -> None:
    src = write_jsonl(
        tmp_path / "c.jsonl", [document([("user", "q"), ("assistant", "answer")], "messages")]
    )
    for end_of_turn, want in (
        (None, "answer<|im_end|>"),
        ("", "answer"),
        ("<|im_end|>", "answer<|im_end|>"),
    ):
        out = tmp_path / f"o{end_of_turn!r}"
        convert_chat(src, out, tokenizer=hf_dir, end_of_turn=end_of_turn)
        ((ids, mask),) = stored(out)
        trained = [t for t, m in zip(ids, mask, strict=True) if m]
        assert tok.decode(trained, skip_special_tokens=False) == want
    convert_chat(src, tmp_path / "users", tokenizer=hf_dir, train_on=["user", "assistant"])
    ((ids, mask),) = stored(tmp_path / "users")
    trained = [t for t, m in zip(ids, mask, strict=True) if m]
    assert tok.decode(trained, skip_special_tokens=False) == "q<|im_end|>answer<|im_end|>"
    with pytest.raises(InputError, match="not followed by the end-of-turn '<s>'"):
        convert_chat(src, tmp_path / "x", tokenizer=hf_dir, end_of_turn="<s>")


def test_command_line(tmp_path: Path, tok_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    convs = [document([("user", f"q{i}"), ("assistant", f"a{i}")], "messages") for i in range(30)]
    src = write_jsonl(tmp_path / "c.jsonl", [*convs, {"messages": []}])
    args = ["convert-chat", str(src), str(tmp_path / "out"), "--tokenizer", str(tok_file)]
    args += ["--template", str(CHAT_YAML), "--validation-fraction", "0.3"]
    assert main(args) == 1
    assert f"{src} line 31: 'messages' is empty" in capsys.readouterr().err
    assert main([*args, "--skip-bad", "--json", "--no-progress"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["skipped_bad"] == 1 and summary["conversations"] == 30
    assert summary["splits"]["validation"]["conversations"] > 0
    info = ftj.summary(tmp_path / "out")
    assert info["splits"]["train"]["loss_mask"] and info["splits"]["validation"]["loss_mask"]
    ftj.validate(tmp_path / "out")
    with pytest.raises(SystemExit):
        main(["convert-chat", "--help"])
    assert "--end-of-turn" in capsys.readouterr().out


# -- Messages a template renders to nothing. ---------------------------------------

# ChatML with no branch for tool roles, as many published templates are.
CHATML_NO_TOOLS = (
    "{% for m in messages %}{% if m['role'] in ['system', 'user', 'assistant'] %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
)


@pytest.fixture(scope="module")
def hf_no_tools(tok_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_file(str(tok_file)), eos_token="<|endoftext|>"
    )
    hf.chat_template = CHATML_NO_TOOLS
    path = tmp_path_factory.mktemp("hf_no_tools")
    hf.save_pretrained(str(path))
    return path


TOOL_CONVS = [
    [("user", "q"), ("assistant", "a")],
    [("user", "q"), ("tool", "42"), ("assistant", "a"), ("ipython", "")],
    [("user", ""), ("assistant", "")],  # empty contents of rendered turns: nothing lost
    [("function", "f()"), ("assistant", "b")],
]


def _tool_files(tmp_path: Path) -> tuple[Path, Path]:
    a = write_jsonl(tmp_path / "a.jsonl", [document(m, "messages") for m in TOOL_CONVS])
    b = write_jsonl(tmp_path / "b.jsonl", [document(m, "messages") for m in TOOL_CONVS[:1] * 2])
    return a, b


def test_messages_rendered_to_nothing_are_counted_per_file(
    tmp_path: Path,
    tok: Tokenizer,
    hf_no_tools: Path,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
) -> None:
    a, b = _tool_files(tmp_path)
    with caplog.at_level("WARNING", logger="flat_tokens_jax.convert.chat"):
        summary = convert_chat([a, b], tmp_path / "out", tokenizer=hf_no_tools)
    assert summary["dropped_messages"] == {
        str(a): {
            "messages": 3,
            "conversations": 2,
            "roles": {"tool": 1, "ipython": 1, "function": 1},
            "first": f"{a} line 2",
        }
    }
    assert summary["skipped_bad"] == 0
    warned = [r.getMessage() for r in caplog.records]
    assert warned == [
        f"{a} line 2: messages 1 (tool), 3 (ipython) render to nothing with the chat template, "
        "left out of the written conversation (strict refuses such conversations); the others "
        "in this file are counted in dropped_messages"
    ]
    # The conversations are written without the lost messages.
    want = [chatml([(r, c) for r, c in m if r in FROM]) for m in TOOL_CONVS + TOOL_CONVS[:1] * 2]
    got = stored(tmp_path / "out")
    assert [ids for ids, _ in got] == [tok.encode(t, add_special_tokens=False).ids for t, _ in want]
    args = ["convert-chat", str(a), str(b), str(tmp_path / "cli"), "--tokenizer", str(hf_no_tools)]
    assert main([*args, "--no-progress"]) == 0
    line = capsys.readouterr().out
    assert (
        "; 3 messages the template renders to nothing (function: 1, ipython: 1, tool: 1) in "
        f"{a}, first at {a} line 2, left out (--strict refuses them); "
    ) in line


def test_strict_refuses_a_conversation_that_loses_a_message(
    tmp_path: Path, hf_no_tools: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = _tool_files(tmp_path)
    why = r"line 2: messages 1 \(tool\), 3 \(ipython\) render to nothing with the chat template"
    with pytest.raises(InputError, match=rf"{re.escape(str(a))} {why}, which strict refuses"):
        convert_chat([a, b], tmp_path / "out", tokenizer=hf_no_tools, strict=True)
    summary = convert_chat(
        [a, b], tmp_path / "out", tokenizer=hf_no_tools, strict=True, skip_bad=True
    )
    assert (summary["conversations"], summary["skipped_bad"]) == (4, 2)
    assert summary["dropped_messages"] == {}
    args = ["convert-chat", str(a), str(tmp_path / "cli"), "--tokenizer", str(hf_no_tools)]
    assert main([*args, "--strict"]) == 1
    assert re.search(rf"^convert-chat: {re.escape(str(a))} {why}", capsys.readouterr().err)
    assert main([*args, "--strict", "--skip-bad", "--json", "--no-progress"]) == 0
    assert json.loads(capsys.readouterr().out)["skipped_bad"] == 2


def test_a_trained_role_rendered_to_nothing_is_a_bad_document(
    tmp_path: Path, hf_no_tools: Path
) -> None:
    src = write_jsonl(tmp_path / "c.jsonl", [document(TOOL_CONVS[1], "messages")])
    with pytest.raises(
        InputError, match=r"line 1: message 1 \(tool\) is trained on, but the chat template"
    ):
        convert_chat(src, tmp_path / "o", tokenizer=hf_no_tools, train_on=["assistant", "tool"])


def test_yaml_templates_drop_nothing(tmp_path: Path, tok: Tokenizer, tok_file: Path) -> None:
    """Every listed role renders, empty contents included, so strict refuses nothing."""
    template = ChatTemplate.from_dict(
        {"roles": {"user": {}, "assistant": {"suffix": "<|im_end|>"}}, "end_of_turn": "<|im_end|>"}
    )
    src = write_jsonl(
        tmp_path / "c.jsonl", [document([("user", ""), ("assistant", "")], "messages")]
    )
    summary = convert_chat(src, tmp_path / "o", tokenizer=tok_file, template=template, strict=True)
    assert (summary["conversations"], summary["dropped_messages"]) == (1, {})
    assert stored(tmp_path / "o") == [([tok.token_to_id("<|im_end|>")], [1])]


def test_a_template_that_leaves_out_empty_messages_drops_them(
    tmp_path: Path, tok: Tokenizer, tok_file: Path
) -> None:
    """Such a template renders a message with empty content to nothing, its header too."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_file(str(tok_file)))
    hf.chat_template = CHATML_JINJA.replace(
        "{% for m in messages %}", "{% for m in messages %}{% if m['content'] %}"
    ).replace("{% endfor %}", "{% endif %}{% endfor %}")
    hf.save_pretrained(str(tmp_path / "hf"))
    convs = [
        [("system", ""), ("user", "q"), ("user", ""), ("assistant", "a")],
        [("user", "q"), ("assistant", "a")],
    ]
    src = write_jsonl(tmp_path / "c.jsonl", [document(m, "messages") for m in convs])
    summary = convert_chat(src, tmp_path / "o", tokenizer=tmp_path / "hf")
    assert summary["dropped_messages"] == {
        str(src): {
            "messages": 2,
            "conversations": 1,
            "roles": {"system": 1, "user": 1},
            "first": f"{src} line 1",
        }
    }
    want = [chatml([(r, c) for r, c in m if c]) for m in convs]
    assert stored(tmp_path / "o") == [
        (ids := tok.encode(t, add_special_tokens=False).ids, reference_mask(tok, ids, t, spans))
        for t, spans in want
    ]
    trained_empty = write_jsonl(
        tmp_path / "e.jsonl", [document([("user", "q"), ("assistant", "")], "messages")]
    )
    with pytest.raises(InputError, match=r"line 1: message 1 \(assistant\) is trained on, but"):
        convert_chat(trained_empty, tmp_path / "e", tokenizer=tmp_path / "hf")
