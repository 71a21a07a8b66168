"""The ``chat_template`` of a ``transformers`` tokenizer, rendered with
``apply_chat_template`` (messages only), and the renderer of either template kind."""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from flat_tokens_jax.convert.chat_template import (
    ROLE_ALIASES,
    TOKEN_LITERAL,
    ChatTemplate,
    Rendered,
    Renderer,
    Span,
    any_of,
    check_template_tokens,
    forbidden_tokens,
    parse_messages,
)
from flat_tokens_jax.convert.inputs import BadDocument, require
from flat_tokens_jax.convert.tokenizer import LoadedTokenizer

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
