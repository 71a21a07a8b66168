"""Chat templates: the YAML :class:`ChatTemplate`, a ``transformers`` tokenizer's own
``chat_template`` (rendered with ``apply_chat_template``), what both share (reading
messages, checking template tokens, the loss mask) and the renderer of either."""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from flat_tokens_jax.convert.inputs import BadDocument, require
from flat_tokens_jax.convert.tokenizer import LoadedTokenizer
from flat_tokens_jax.core.yamlfile import read_yaml

# A conversation's (list, role, text) keys, in either of the two common forms.
CONVERSATION_KEYS = (("conversations", "from", "value"), ("messages", "role", "content"))
ROLE_ALIASES = {"human": "user", "gpt": "assistant"}
# The code points for which str.isspace() is true (none is above U+3000).
SPACE_CODES = np.array([c for c in range(0x3001) if chr(c).isspace()], np.uint32)
TOKEN_LITERAL = re.compile(r"<\|[^|<>\s]{1,64}\|>")
Span = tuple[int, int]


@dataclasses.dataclass(frozen=True)
class Rendered:
    """A conversation as ``text``, its trained character ``spans`` ``[start, end)``
    (sorted), and ``dropped``: ``(index, role)`` of each message whose content the
    template left out of ``text`` (a role it has no branch for, such as ``tool``
    in many templates; a YAML template drops nothing)."""

    text: str
    spans: list[Span]
    dropped: tuple[tuple[int, str], ...] = ()


Renderer = Callable[[Mapping[str, Any]], Rendered]


@dataclasses.dataclass(frozen=True)
class Affix:
    """What goes around a role's turn or a field: ``prefix + content + suffix``."""

    prefix: str = ""
    suffix: str = ""


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """A chat template from a YAML config; see ``configs/chat.yaml``.

    Attributes:
        roles: each role's prefix and suffix; a message of any other role is a bad document.
        train_on: roles (and fields) whose content is trained on.
        end_of_turn: trained with each trained turn: the turn's suffix up to and
            including this token (it must be in those suffixes); ``None``: only the content.
        bos: placed once before everything, never trained.
        eos: placed once after everything, trained when the last turn is.
        special_tokens: every other special token the strings use; each must be a
            single token of the tokenizer, and no content may contain one.
        fields: top-level document fields rendered, in this order, before the turns
            (``system``, ``instruction``, ...); a document without one leaves it out.
        role_aliases: other names of roles (``human`` -> ``user``, ``gpt`` -> ``assistant``).
    """

    roles: Mapping[str, Affix]
    train_on: tuple[str, ...] = ("assistant",)
    end_of_turn: str | None = None
    bos: str | None = None
    eos: str | None = None
    special_tokens: tuple[str, ...] = ()
    fields: tuple[tuple[str, Affix], ...] = ()
    role_aliases: Mapping[str, str] = dataclasses.field(default_factory=lambda: dict(ROLE_ALIASES))

    def __post_init__(self) -> None:
        if not self.roles:
            raise ValueError("ChatTemplate.roles is empty: give at least the assistant's role")
        fields = [name for name, _ in self.fields]
        for name in self.train_on:
            if name not in self.roles and name not in fields:
                raise ValueError(
                    f"ChatTemplate.train_on names {name!r}, which is neither a role "
                    f"{sorted(self.roles)} nor a field {fields}"
                )
        eot = self.end_of_turn
        for name, affix in [*self.roles.items(), *self.fields]:
            if eot is not None and name in self.train_on and eot not in affix.suffix:
                raise ValueError(
                    f"ChatTemplate.end_of_turn {eot!r} is not in the suffix {affix.suffix!r} "
                    f"of {name!r}, which is trained on: add it there or set end_of_turn: null"
                )

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> ChatTemplate:
        """From the mapping under ``chat:`` in a YAML config; unknown keys are refused."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(config) - known)
        if unknown:
            raise ValueError(f"unknown ChatTemplate field(s) {unknown}; known: {sorted(known)}")
        args = dict(config)
        try:
            args["roles"] = {role: Affix(**a) for role, a in config.get("roles", {}).items()}
            args["fields"] = tuple(
                (f["name"], Affix(f.get("prefix", ""), f.get("suffix", "")))
                for f in config.get("fields") or ()
            )
        except (TypeError, KeyError, AttributeError) as e:
            raise ValueError(
                "ChatTemplate.roles must map role names to {prefix, suffix} and fields be a "
                f"list of {{name, prefix, suffix}} ({e})"
            ) from None
        for key in ("train_on", "special_tokens"):
            if key in args:
                args[key] = tuple(args[key])
        return cls(**args)

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str]) -> ChatTemplate:
        """Reads the ``chat:`` mapping of a YAML file (needs the ``yaml`` extra)."""
        loaded = read_yaml(path)
        if not isinstance(loaded, dict) or not isinstance(loaded.get("chat"), dict):
            raise ValueError(f"{path}: expected a mapping under a top-level 'chat:' key")
        return cls.from_dict(loaded["chat"])

    def tokens(self) -> list[str]:
        """Every special token the template writes, declared or seen as ``<|...|>``."""
        declared = [self.bos, self.eos, self.end_of_turn, *self.special_tokens]
        affixes = [*self.roles.values(), *(a for _, a in self.fields)]
        seen = [t for a in affixes for t in TOKEN_LITERAL.findall(a.prefix + a.suffix)]
        return list(dict.fromkeys(t for t in [*declared, *seen] if t))

    def render(
        self, document: Mapping[str, Any], forbidden: re.Pattern[str] | None = None
    ) -> tuple[str, list[Span]]:
        """The conversation's text and its trained character spans; BadDocument
        for a document it cannot render."""
        pieces: list[tuple[str, bool]] = [(self.bos, False)] if self.bos else []
        for name, affix in self.fields:
            value = document.get(name)
            if value is None or value == "":
                continue
            if not isinstance(value, str):
                raise BadDocument(f"field {name!r} is {type(value).__name__}, not a string")
            _check_content(value, f"field {name!r}", forbidden)
            pieces += self._turn(affix, value, name in self.train_on)
        trained = False
        for role, content in parse_messages(document, self.roles, self.role_aliases, forbidden):
            trained = role in self.train_on
            pieces += self._turn(self.roles[role], content, trained)
        if self.eos:
            pieces.append((self.eos, trained))
        return _join(pieces)

    def _turn(self, affix: Affix, content: str, trained: bool) -> list[tuple[str, bool]]:
        if not trained:
            return [(affix.prefix + content + affix.suffix, False)]
        cut = 0
        if self.end_of_turn is not None:
            cut = affix.suffix.index(self.end_of_turn) + len(self.end_of_turn)
        return [
            (affix.prefix, False),
            (content + affix.suffix[:cut], True),
            (affix.suffix[cut:], False),
        ]


def _join(pieces: Sequence[tuple[str, bool]]) -> tuple[str, list[Span]]:
    """Concatenated text and the merged character spans of the trained pieces."""
    spans: list[Span] = []
    at = 0
    for text, trained in pieces:
        if trained and text:
            if spans and spans[-1][1] == at:
                spans[-1] = (spans[-1][0], at + len(text))
            else:
                spans.append((at, at + len(text)))
        at += len(text)
    return "".join(t for t, _ in pieces), spans


def parse_messages(
    document: Mapping[str, Any],
    roles: Collection[str],
    aliases: Mapping[str, str],
    forbidden: re.Pattern[str] | None = None,
) -> list[tuple[str, str]]:
    """``(role, content)`` of each message, roles renamed by ``aliases``; BadDocument
    for a malformed conversation, a role not in ``roles``, or content that
    ``forbidden`` matches."""
    found = next((keys for keys in CONVERSATION_KEYS if keys[0] in document), None)
    if found is None:
        raise BadDocument(f"no 'conversations' or 'messages' list (keys: {sorted(document)[:10]})")
    key, role_key, text_key = found
    turns = document[key]
    if not isinstance(turns, list):
        raise BadDocument(f"{key!r} is {type(turns).__name__}, not a list of messages")
    if not turns:
        raise BadDocument(f"{key!r} is empty: a conversation needs at least one message")
    out = []
    for i, m in enumerate(turns):
        if not (
            isinstance(m, dict)
            and isinstance(m.get(role_key), str)
            and isinstance(m.get(text_key), str)
        ):
            raise BadDocument(
                f"{key}[{i}] must be an object with strings {role_key!r} and {text_key!r}, "
                f"got {m!r:.80}"
            )
        role = aliases.get(m[role_key], m[role_key])
        if role not in roles:
            known = sorted({*roles, *aliases})
            raise BadDocument(f"message {i} has unknown role {role!r} (known: {known})")
        _check_content(m[text_key], f"{key}[{i}]", forbidden)
        out.append((role, m[text_key]))
    return out


def _check_content(text: str, what: str, forbidden: re.Pattern[str] | None) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise BadDocument(f"{what} is not valid Unicode ({e})") from None
    hit = None if forbidden is None else forbidden.search(text)
    if hit is not None:
        raise BadDocument(f"{what} holds the special token {hit.group()!r}")


def check_template_tokens(tokenizer: Any, tokens: Iterable[str], where: str) -> None:
    """Checks that each template token is one token of the vocabulary."""
    for token in tokens:
        token_id = tokenizer.token_to_id(token)
        if token_id is None:
            raise ValueError(
                f"{where}: template token {token!r} is not in the tokenizer's vocabulary: "
                "use the tokenizer the template was written for, or change the template"
            )
        ids = tokenizer.encode(token, add_special_tokens=False).ids
        if list(ids) != [token_id]:
            raise ValueError(
                f"{where}: template token {token!r} (id {token_id}) is tokenized as {list(ids)}: "
                "it must be an added (special) token of the tokenizer"
            )


def trained_tokens(text: str, offsets: np.ndarray, spans: Sequence[Span]) -> np.ndarray:
    """``[n] uint8`` loss mask of tokens with character ``offsets`` ``[n, 2]`` in ``text``.

    A token is trained when one of its non-space characters is in a trained
    span, or, for a token of spaces only, when one of its characters is. So
    ``" Hello"``, which merges a template's separating space with the answer, is
    trained, and a special token that absorbs the spaces after it (Phi-3's
    ``"<|assistant|>\\n "``) is not.
    """
    off = np.asarray(offsets, np.int64).reshape(-1, 2)
    codes = np.frombuffer(text.encode("utf-32-le"), np.uint32)
    change = np.zeros(codes.size + 1, np.int64)
    bounds = np.asarray(spans, np.int64).reshape(-1, 2)
    np.add.at(change, bounds[:, 0], 1)
    np.add.at(change, bounds[:, 1], -1)
    trained = np.cumsum(change[:-1]) > 0
    solid = ~np.isin(codes, SPACE_CODES)

    def count(flags: np.ndarray) -> np.ndarray:
        total = np.concatenate([[0], np.cumsum(flags)])
        return total[off[:, 1]] - total[off[:, 0]]

    hit = (count(trained & solid) > 0) | ((count(solid) == 0) & (count(trained) > 0))
    return hit.astype(np.uint8)


def forbidden_tokens(tokenizer: Any, template_tokens: Sequence[str]) -> re.Pattern[str] | None:
    """The special tokens no content may hold: a ``<|im_end|>`` typed in a message
    would be read as the token and end the turn early."""
    added = tokenizer.get_added_tokens_decoder().values()
    return any_of([*(t.content for t in added if t.special), *template_tokens])


def any_of(tokens: Iterable[str]) -> re.Pattern[str] | None:
    """A pattern matching any of ``tokens``, the longest first; ``None`` if none."""
    ordered = sorted(set(tokens) - {""}, key=len, reverse=True)
    return re.compile("|".join(map(re.escape, ordered))) if ordered else None


# Roles a tokenizer's chat template may be given: the common ones, and the tool
# results of Qwen/Mistral (tool), Llama 3.1 (ipython) and older OpenAI-style data
# (function). A template that ignores one renders it to nothing: counted, see Rendered.
CHAT_TEMPLATE_ROLES = ("system", "user", "assistant", "tool", "ipython", "function")

_SPACES = re.compile(r"\s*")
# Private-use characters around a message's index stand in for its content.
_MARK_OPEN, _MARK_CLOSE = "\ue000", "\ue001"
_MARK = re.compile(f"{_MARK_OPEN}(\\d+){_MARK_CLOSE}")


@dataclasses.dataclass(frozen=True)
class _TokenizerTemplate:
    """Renders with a ``transformers`` tokenizer's chat template, then finds the turns.

    The template renders the conversation twice: as it is, and with each content
    replaced by a marker. Putting the contents (or the trimmed contents) in place
    of the markers must give the first text; the markers' places are then the
    contents'. A message whose marker is not in the text was rendered to nothing:
    a bad document if its role is trained, else listed in :attr:`Rendered.dropped`.
    ``end_of_turn``: ``None`` trains the added token that follows a trained turn's
    content (after any spaces), if one does; ``""`` trains none.
    """

    hf: Any
    train_on: tuple[str, ...]
    end_of_turn: str | None
    added: re.Pattern[str] | None
    forbidden: re.Pattern[str] | None
    template_error: type[Exception]

    def render(self, document: Mapping[str, Any]) -> Rendered:
        messages = parse_messages(document, CHAT_TEMPLATE_ROLES, ROLE_ALIASES, self.forbidden)
        roles = [role for role, _ in messages]
        contents = [content for _, content in messages]
        text = self._apply(roles, contents)
        found = self._find(roles, contents, text, range(len(roles)))
        if found is None and not all(contents):
            found = self._find_without_empty(roles, contents, text)
        if found is None:
            raise BadDocument(
                "the chat template changes message contents (beyond trimming spaces), so the "
                "trained turns cannot be found in its text; use a YAML template (--template)"
            )
        spans: list[Span] = []
        dropped = []
        for i, role in enumerate(roles):
            if i not in found:
                if role in self.train_on:
                    raise BadDocument(
                        f"message {i} ({role}) is trained on, but the chat template renders it "
                        "to nothing; use a YAML template (--template) that renders that role"
                    )
                dropped.append((i, role))
            elif role in self.train_on:
                a, b = found[i]
                spans.append((a, self._turn_end(text, b, i)))
        return Rendered(text, sorted(spans), tuple(dropped))

    def _find(
        self, roles: list[str], contents: list[str], text: str, marked: Iterable[int]
    ) -> dict[int, Span] | None:
        """Where in ``text`` the contents of the ``marked`` messages are, found by
        rendering markers in their place; ``None`` if they cannot be found."""
        chosen = set(marked)
        marks = [
            f"{_MARK_OPEN}{i}{_MARK_CLOSE}" if i in chosen else c for i, c in enumerate(contents)
        ]
        rendered = self._apply(roles, marks)
        for given in (contents, [c.strip() for c in contents]):
            found = _unmark(rendered, given)
            if found is not None and found[0] == text:
                return found[1]
        return None

    def _find_without_empty(
        self, roles: list[str], contents: list[str], text: str
    ) -> dict[int, Span] | None:
        """For a template that leaves out messages with empty content: the places of
        the others, when the text without the empty messages is ``text``."""
        full = [i for i, c in enumerate(contents) if c]
        if not full:
            return None
        try:
            without = self._apply([roles[i] for i in full], [contents[i] for i in full])
        except BadDocument:
            return None
        return self._find(roles, contents, text, full) if without == text else None

    def _apply(self, roles: list[str], contents: list[str]) -> str:
        chat = [{"role": r, "content": c} for r, c in zip(roles, contents, strict=True)]
        try:
            text: str = self.hf.apply_chat_template(chat, tokenize=False)
        except (self.template_error, ValueError, TypeError) as e:
            raise BadDocument(f"the chat template refused the conversation: {e}") from None
        return text

    def _turn_end(self, text: str, end: int, i: int) -> int:
        after = _SPACES.match(text, end)
        start = end if after is None else after.end()
        if self.end_of_turn:
            if not text.startswith(self.end_of_turn, start):
                raise BadDocument(
                    f"message {i} is not followed by the end-of-turn {self.end_of_turn!r} in the "
                    f"chat template's text (found {text[end : end + 24]!r})"
                )
            return start + len(self.end_of_turn)
        found = self.added.match(text, start) if self.added and self.end_of_turn is None else None
        return end if found is None else found.end()


def _unmark(marked: str, contents: Sequence[str]) -> tuple[str, dict[int, Span]] | None:
    """``marked`` with each marker replaced by its content, and where each content went.

    ``None`` when a marker appears twice (its content's place is then unclear).
    """
    pieces: list[str] = []
    places: dict[int, Span] = {}
    size = done = 0
    for m in _MARK.finditer(marked):
        i = int(m.group(1))
        if i in places or i >= len(contents):
            return None
        pieces += [marked[done : m.start()], contents[i]]
        size += m.start() - done
        places[i] = (size, size + len(contents[i]))
        size += len(contents[i])
        done = m.end()
    pieces.append(marked[done:])
    return "".join(pieces), places


def make_renderer(
    loaded: LoadedTokenizer,
    template: str | os.PathLike[str] | ChatTemplate | None,
    train_on: Sequence[str] | None,
    end_of_turn: str | None,
) -> Renderer:
    """The renderer of a YAML template, or else of the tokenizer's own chat template."""
    tok = loaded.tokenizer
    if template is not None:
        if train_on is not None or end_of_turn is not None:
            raise ValueError(
                "train_on and end_of_turn are set in the YAML template; leave them unset here"
            )
        tpl = template if isinstance(template, ChatTemplate) else ChatTemplate.from_yaml(template)
        check_template_tokens(tok, tpl.tokens(), f"template {template}")
        forbidden = forbidden_tokens(tok, tpl.tokens())
        return lambda document: Rendered(*tpl.render(document, forbidden))
    source = getattr(loaded.hf, "chat_template", None)
    if not isinstance(source, str):
        raise ValueError(
            f"{loaded.name} has no chat template (only a transformers tokenizer directory with "
            "a single chat_template has one): pass a YAML template, e.g. configs/chat.yaml"
        )
    jinja2 = require("jinja2", "hf")
    check_template_tokens(tok, dict.fromkeys(TOKEN_LITERAL.findall(source)), loaded.name)
    if end_of_turn:
        check_template_tokens(tok, [end_of_turn], loaded.name)
    added = any_of(t.content for t in tok.get_added_tokens_decoder().values())
    renderer = _TokenizerTemplate(
        loaded.hf,
        tuple(train_on or ("assistant",)),
        end_of_turn,
        added,
        forbidden_tokens(tok, []),
        jinja2.TemplateError,
    )
    return renderer.render
