"""Chat conversations into a flat-tokens dataset with a loss mask: ``flat-tokens convert-chat``.

Each document holds one conversation (``conversations: [{from, value}]`` or
``messages: [{role, content}]``), rendered by a chat template
(:mod:`~flat_tokens_jax.convert.chat_template`) and tokenized whole, once.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import hashlib
import itertools
import json
import logging
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np

from flat_tokens_jax.convert.chat_template import (
    ChatTemplate,
    Rendered,
    make_renderer,
    trained_tokens,
)
from flat_tokens_jax.convert.commands import (
    add_converter_flags,
    progress_bar,
    run_command,
    store_options,
)
from flat_tokens_jax.convert.inputs import (
    BadDocument,
    DocumentReader,
    Where,
    check_splits,
    expand_inputs,
    hash_inputs,
)
from flat_tokens_jax.convert.parts import Totals
from flat_tokens_jax.convert.tokenizer import (
    LoadedTokenizer,
    Packed,
    identity,
    load_tokenizer,
    resolve_start_token_id,
    validation_mask,
)
from flat_tokens_jax.data.writer import DatasetWriter, StorageFormat
from flat_tokens_jax.store.identity import DatasetInfo, inputs_field
from flat_tokens_jax.store.location import refuse_overlap
from flat_tokens_jax.store.options import StoreOptions, resolve_options

log = logging.getLogger(__name__)

# Conversations per encode_batch call: enough work for the tokenizer's thread pool.
BATCH_DOCS = 256


_Doc = tuple[Rendered, Where]


def convert_chat(
    inputs: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    output: str | os.PathLike[str],
    *,
    tokenizer: str | os.PathLike[str],
    template: str | os.PathLike[str] | ChatTemplate | None = None,
    train_on: Sequence[str] | None = None,
    end_of_turn: str | None = None,
    validation_fraction: float = 0.0,
    validation_inputs: str | os.PathLike[str] | Sequence[str | os.PathLike[str]] = (),
    skip_bad: bool = False,
    strict: bool = False,
    storage_format: StorageFormat | None = None,
    overwrite: bool = False,
    options: StoreOptions | None = None,
    progress: bool | None = None,
    start_token_id: int | str | None = None,
    **option_fields: Any,
) -> dict[str, Any]:
    """Writes one sequence per conversation, with a loss mask on the trained turns.

    Args:
        inputs: files or globs, as for :func:`~flat_tokens_jax.convert.text.convert`;
            each document holds ``conversations`` or ``messages``.
        output: the new dataset's path or URL.
        tokenizer: a ``tokenizers`` JSON file or ``transformers`` tokenizer directory.
        template: a YAML chat template (path or :class:`ChatTemplate`); ``None``:
            the tokenizer directory's own ``chat_template``.
        train_on: with the tokenizer's template: the roles trained on (default assistant).
        end_of_turn: with the tokenizer's template: the token trained after each
            trained turn; ``None``: the added token that follows it, if any; ``""``: none.
        validation_fraction: send about this fraction of conversations, chosen by a
            hash of the rendered text, to "validation".
        strict: a conversation with a message that the template renders to
            nothing is a bad document (stops the run, or with ``skip_bad`` is
            skipped and counted there); otherwise it is written without that
            message, and counted in ``dropped_messages``.

    ``validation_inputs``, ``skip_bad``, ``storage_format``, ``overwrite``,
    ``options``, ``progress``, ``start_token_id`` and ``**option_fields`` are as
    for ``convert``.

    The output records what made it (:class:`DatasetInfo`), the template's SHA-256 among it.

    Returns:
        A JSON-ready summary: ``conversations``, ``tokens``, ``trained_tokens``,
        ``skipped_bad``, ``splits`` (the same per split), ``seconds`` and more;
        ``dropped_messages`` maps each input file with messages the template
        rendered to nothing, in conversations that were written, to
        ``{"messages", "conversations", "roles": {role: messages}, "first"}``
        (``first``: the first such document, ``"FILE line N"``).

    Raises:
        InputError: a bad document, named by file and line or row (unless ``skip_bad``).
        ValueError: bad arguments, or a template that does not fit the tokenizer.
    """
    options = resolve_options(options, option_fields, "convert_chat")
    started = time.perf_counter()
    train_paths, valid_paths = expand_inputs(inputs), expand_inputs(validation_inputs)
    check_splits(train_paths, valid_paths, validation_fraction)
    refuse_overlap([*train_paths, *valid_paths], [output])
    loaded = load_tokenizer(tokenizer)
    start = resolve_start_token_id(start_token_id, loaded)
    render = make_renderer(loaded, template, train_on, end_of_turn)
    # A copy without the post-processor, whose ids are the same: one such as
    # ByteLevel(trim_offsets=True) trims spaces off the offsets, which the mask needs whole.
    tok = type(loaded.tokenizer).from_str(loaded.tokenizer.to_str())
    tok.post_processor = None

    def check(document: Mapping[str, Any], where: Where) -> _Doc:
        rendered = render(document)
        if not any(a < b for a, b in rendered.spans):
            raise BadDocument("no trained turn: nothing in the conversation is trained on")
        if strict and rendered.dropped:
            raise BadDocument(
                f"{_dropped_text(rendered)}, which strict refuses: remove such messages or "
                "use a template that renders their role"
            )
        return rendered, where

    passes = [(train_paths, validation_fraction, False), (valid_paths, 0.0, True)]
    totals = Totals()
    dropped: dict[str, dict[str, Any]] = {}
    bar = progress_bar(progress, "convert-chat")
    try:
        with (
            DatasetWriter(
                output, storage_format=storage_format, overwrite=overwrite, options=options
            ) as writer,
            hash_inputs([*train_paths, *valid_paths]) as digests,
        ):
            for paths, fraction, all_validation in passes:
                reader = DocumentReader(paths, None, skip_bad=skip_bad, check=check)
                read = cast(Iterator[_Doc], iter(reader))
                while docs := list(itertools.islice(read, BATCH_DOCS)):
                    texts, packed, mask = _tokenize(tok, docs, reader, dropped)
                    valid = validation_mask(texts, fraction) | all_validation
                    written = totals.write(writer, packed, valid, mask)
                    if bar is not None:
                        bar.update(written)
                totals.skipped_bad += reader.skipped_bad
            writer.info = DatasetInfo(
                tokenizer=identity(loaded),
                start_token_id=start,
                flags=_flags(loaded, template, train_on, end_of_turn, validation_fraction),
                inputs=inputs_field([str(p) for p in [*train_paths, *valid_paths]], digests()),
            )
    finally:
        if bar is not None:
            bar.close()
    seconds = time.perf_counter() - started
    tokens = sum(totals.tokens.values())
    splits = {
        s: {
            "conversations": n,
            "tokens": totals.tokens[s],
            "trained_tokens": totals.trained[s],
        }
        for s, n in totals.documents.items()
    }
    return {
        "output": os.fspath(output),
        "input_files": len(train_paths),
        "validation_files": len(valid_paths),
        "tokenizer": loaded.name,
        "template": "tokenizer" if template is None else str(template),
        "conversations": sum(totals.documents.values()),
        "tokens": tokens,
        "trained_tokens": sum(totals.trained.values()),
        "skipped_bad": totals.skipped_bad,
        "dropped_messages": dropped,
        "splits": splits,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens / seconds, 1),
    }


def _flags(
    loaded: LoadedTokenizer,
    template: str | os.PathLike[str] | ChatTemplate | None,
    train_on: Sequence[str] | None,
    end_of_turn: str | None,
    validation_fraction: float,
) -> dict[str, Any]:
    """What shaped the tokens and the mask: the template's identity and options."""
    if template is None:
        source = getattr(loaded.hf, "chat_template", "")
        tpl: dict[str, Any] = {"name": "tokenizer"}
    elif isinstance(template, ChatTemplate):
        source = json.dumps(dataclasses.asdict(template), sort_keys=True, default=list)
        tpl = {"name": "ChatTemplate"}
    else:
        source = Path(template).read_text(encoding="utf-8")
        tpl = {"name": os.fspath(template)}
    tpl["sha256"] = hashlib.sha256(source.encode("utf-8")).hexdigest()
    return {
        "converter": "convert-chat",
        "template": tpl,
        "train_on": None if train_on is None else list(train_on),
        "end_of_turn": end_of_turn,
        "validation_fraction": validation_fraction,
    }


def _tokenize(
    tokenizer: Any, docs: list[_Doc], reader: DocumentReader, dropped: dict[str, dict[str, Any]]
) -> tuple[list[str], Packed, np.ndarray]:
    """Texts, ids and ``[num_tokens] uint8`` loss mask of the documents with a trained
    token, whose lost messages are counted in ``dropped``.

    Each text is tokenized whole, as ``tokenizer(text, add_special_tokens=False)``
    and ``apply_chat_template(messages, tokenize=True)`` do, so training sees
    the ids inference sees.
    """
    encodings = tokenizer.encode_batch([r.text for r, _ in docs], add_special_tokens=False)
    texts, ids, masks = [], [], []
    for (rendered, where), enc in zip(docs, encodings, strict=True):
        text, spans = rendered.text, rendered.spans
        mask = trained_tokens(text, np.array(enc.offsets, np.int64), spans)
        if not mask.any():
            reader.reject(where, "no token is trained: the trained turns tokenize to nothing")
            continue
        _count_dropped(dropped, rendered, where)
        texts.append(text)
        ids.append(np.array(enc.ids, np.int32))
        masks.append(mask)
    lengths = np.array([a.size for a in ids], np.int64)
    packed = (np.concatenate([np.zeros(0, np.int32), *ids]), lengths)
    return texts, packed, np.concatenate([np.zeros(0, np.uint8), *masks])


def _dropped_text(rendered: Rendered) -> str:
    """What a document lost, e.g. "message 2 (tool) renders to nothing with the chat template"."""
    listed = ", ".join(f"{i} ({role})" for i, role in rendered.dropped)
    verb = "message {} renders" if len(rendered.dropped) == 1 else "messages {} render"
    return f"{verb.format(listed)} to nothing with the chat template"


def _count_dropped(files: dict[str, dict[str, Any]], rendered: Rendered, where: Where) -> None:
    """Counts, per input file, the messages a written conversation lost to the template."""
    if not rendered.dropped:
        return
    path, unit, number = where
    name = os.fspath(path)
    entry = files.get(name)
    if entry is None:
        first = f"{name} {unit} {number}"
        entry = files[name] = {"messages": 0, "conversations": 0, "roles": {}, "first": first}
        log.warning(
            "%s: %s, left out of the written conversation (strict refuses such "
            "conversations); the others in this file are counted in dropped_messages",
            first,
            _dropped_text(rendered),
        )
    entry["conversations"] += 1
    entry["messages"] += len(rendered.dropped)
    for _, role in rendered.dropped:
        entry["roles"][role] = entry["roles"].get(role, 0) + 1


def add_commands(subparsers: Any) -> None:
    """Registers ``flat-tokens convert-chat``."""
    p = subparsers.add_parser("convert-chat", help="tokenize conversations, with a loss mask")
    p.add_argument("inputs", nargs="+", metavar="INPUT", help="files or globs, as for convert")
    p.add_argument("output", metavar="OUTPUT", help="the new dataset")
    p.add_argument("--tokenizer", required=True, help="tokenizers JSON or transformers directory")
    p.add_argument("--template", help="YAML template (configs/chat.yaml); default: the tokenizer's")
    p.add_argument(
        "--train-on", nargs="+", metavar="ROLE", help="tokenizer's template: trained roles"
    )
    p.add_argument(
        "--end-of-turn",
        metavar="TOKEN",
        help="tokenizer's template: the token trained after each trained turn (default: the "
        "added token that follows it, if any; 'none': none)",
    )
    p.add_argument(
        "--strict",
        action="store_true",
        help="a conversation with a message the template renders to nothing (e.g. a tool "
        "message) is a bad document: stop, or with --skip-bad skip it (default: leave the "
        "message out and count it in the summary)",
    )
    add_converter_flags(p)
    p.set_defaults(run=_cmd_convert_chat)


def _describe(s: dict[str, Any]) -> str:
    parts = ", ".join(
        f"{name} {v['conversations']:,} conversations / {v['tokens']:,} tokens "
        f"({v['trained_tokens']:,} trained)"
        for name, v in s["splits"].items()
    )
    dropped = s["dropped_messages"]
    lost = ""
    if dropped:
        roles: collections.Counter[str] = collections.Counter()
        for entry in dropped.values():
            roles.update(entry["roles"])
        where = next(iter(dropped)) if len(dropped) == 1 else f"{len(dropped)} files"
        by_role = ", ".join(f"{role}: {n:,}" for role, n in sorted(roles.items()))
        first = next(iter(dropped.values()))["first"]
        lost = (
            f"; {sum(roles.values()):,} messages the template renders to nothing ({by_role}) "
            f"in {where}, first at {first}, left out (--strict refuses them)"
        )
    return (
        f"wrote {s['output']}: {parts}; skipped {s['skipped_bad']:,} bad{lost}; {s['seconds']:.1f}s"
    )


def _cmd_convert_chat(args: argparse.Namespace) -> int:
    end_of_turn = "" if args.end_of_turn == "none" else args.end_of_turn

    def work() -> dict[str, Any]:
        return convert_chat(
            args.inputs,
            args.output,
            tokenizer=args.tokenizer,
            template=args.template,
            train_on=args.train_on,
            end_of_turn=end_of_turn,
            validation_fraction=args.validation_fraction,
            validation_inputs=args.validation,
            skip_bad=args.skip_bad,
            strict=args.strict,
            overwrite=args.overwrite,
            options=store_options(args),
            progress=False if args.no_progress else None,
            start_token_id=args.start_token_id,
        )

    return run_command(args, work, _describe, output=args.output)
