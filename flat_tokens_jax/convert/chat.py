"""Chat conversations into a flat-tokens dataset with a loss mask: ``flat-tokens convert-chat``.

A record holds one conversation in either common layout: ``conversations: [{from,
value}]`` (FastChat/ShareGPT: ``human``, ``gpt``, ``system``) or ``messages: [{role,
content}]`` (``user``, ``assistant``, ``system``). It becomes one sequence: the
conversation rendered to text by a chat template and tokenized whole, once, with
a loss mask that is 1 on the tokens of the trained turns (by default the
assistant's, with the end-of-turn token that closes each).

The template is either a :class:`ChatTemplate` (a YAML config such as
``configs/chat.yaml``: per-role prefix and suffix, bos/eos, trained roles, and
top-level fields placed before the turns), or the ``chat_template`` of a
``transformers`` tokenizer directory, rendered with ``apply_chat_template``
(messages only), where each content is located by rendering again with markers
in place of the contents.

Trained characters become trained tokens through the tokenizer's offsets: a
token is trained when one of its non-space characters is trained (a token of
spaces only: when one of its characters is). So ``" Hello"``, which merges a
template's separating space with the answer, is trained, and a special token
that absorbs the spaces after it (Phi-3's ``"<|assistant|>\\n "``) is not.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import sys
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, cast

import numpy as np

from flat_tokens_jax.convert.chat_template import (
    ChatTemplate,
    Span,
    make_renderer,
    trained_tokens,
)
from flat_tokens_jax.convert.commands import add_converter_flags, run_command, store_options
from flat_tokens_jax.convert.inputs import (
    BadRecord,
    RecordReader,
    Where,
    as_patterns,
    expand_inputs,
    require,
)
from flat_tokens_jax.convert.tokenizer import load_tokenizer, validation_mask
from flat_tokens_jax.format import SPLITS, encode_concatenated
from flat_tokens_jax.location import refuse_overlap
from flat_tokens_jax.store import StoreOptions
from flat_tokens_jax.writer import DatasetWriter, Layout

# Conversations per encode_batch call: enough work for the tokenizer's thread pool.
BATCH_DOCS = 256


@dataclasses.dataclass(frozen=True)
class _Doc:
    text: str
    spans: list[Span]
    where: Where


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
    layout: Layout | None = None,
    overwrite: bool = False,
    options: StoreOptions | None = None,
    progress: bool | None = None,
) -> dict[str, Any]:
    """Writes one sequence per conversation, with a loss mask on the trained turns.

    Args:
        inputs: files or globs, as for :func:`~flat_tokens_jax.convert.text.convert`;
            each record holds ``conversations`` or ``messages``.
        output: the new dataset's path or URL.
        tokenizer: a ``tokenizers`` JSON file or ``transformers`` tokenizer directory.
        template: a YAML chat template (path or :class:`ChatTemplate`); ``None``:
            the tokenizer directory's own ``chat_template``.
        train_on: with the tokenizer's template: the roles trained on (default assistant).
        end_of_turn: with the tokenizer's template: the token trained after each
            trained turn; ``None``: the added token that follows it, if any; ``""``: none.
        validation_fraction: send about this fraction of conversations, chosen by a
            hash of the rendered text, to "validation".
        validation_inputs: or read "validation" from these files.
        skip_bad: count and skip bad records instead of stopping at the first.
        layout: chunking and compression of the output.
        overwrite: replace a flat-tokens dataset, or the leftover of an
            interrupted write, at ``output`` (never other files: see
            :class:`~flat_tokens_jax.writer.DatasetWriter`). An ``output`` that
            is, contains or lies inside an input is refused (``ValueError``).
        options: how to reach ``output`` (e.g. an S3 endpoint and credentials).
        progress: a tqdm bar on stderr; ``None``: when stderr is a terminal.

    Returns:
        A JSON-ready summary: ``conversations``, ``tokens``, ``trained_tokens``,
        ``skipped_bad``, ``splits`` (the same per split), ``seconds`` and more.

    Raises:
        InputError: a bad record, named by file and line or row (unless ``skip_bad``).
        ValueError: bad arguments, or a template that does not fit the tokenizer.
    """
    started = time.perf_counter()
    if not 0.0 <= validation_fraction < 1.0:
        raise ValueError(f"validation_fraction must be in [0, 1), got {validation_fraction}")
    train_paths = expand_inputs(as_patterns(inputs))
    valid_paths = expand_inputs(as_patterns(validation_inputs))
    if not train_paths:
        raise ValueError("no inputs given")
    if valid_paths and validation_fraction:
        raise ValueError("pass validation_fraction or validation_inputs, not both")
    refuse_overlap([*train_paths, *valid_paths], [output])
    loaded = load_tokenizer(tokenizer)
    render = make_renderer(loaded, template, train_on, end_of_turn)
    tok = _whole_offsets(loaded.tokenizer)

    def check(record: Mapping[str, Any], where: Where) -> _Doc:
        text, spans = render(record)
        if not any(a < b for a, b in spans):
            raise BadRecord("no trained turn: nothing in the conversation is trained on")
        return _Doc(text, spans, where)

    splits = {s: {"conversations": 0, "tokens": 0, "trained_tokens": 0} for s in SPLITS}
    passes = [(train_paths, validation_fraction, False), (valid_paths, 0.0, True)]
    skipped = 0
    bar = _progress_bar(progress)
    try:
        with DatasetWriter(output, layout=layout, overwrite=overwrite, options=options) as writer:
            for paths, fraction, all_validation in passes:
                reader = RecordReader(paths, None, skip_bad=skip_bad, check=check)
                for docs in _batches(cast(Iterable[_Doc], reader)):
                    texts, ids, masks = _tokenize(tok, docs, reader)
                    valid = validation_mask(texts, fraction) | all_validation
                    for split, chosen in (("train", ~valid), ("validation", valid)):
                        picked = np.flatnonzero(chosen).tolist()
                        _write(writer, split, [ids[i] for i in picked], [masks[i] for i in picked])
                        counts = splits[split]
                        counts["conversations"] += len(picked)
                        counts["tokens"] += sum(ids[i].size for i in picked)
                        counts["trained_tokens"] += sum(int(masks[i].sum()) for i in picked)
                    if bar is not None:
                        bar.update(sum(a.size for a in ids))
                skipped += reader.skipped_bad
    finally:
        if bar is not None:
            bar.close()
    seconds = time.perf_counter() - started
    tokens = sum(s["tokens"] for s in splits.values())
    return {
        "output": os.fspath(output),
        "input_files": len(train_paths),
        "validation_files": len(valid_paths),
        "tokenizer": loaded.name,
        "template": "tokenizer" if template is None else str(template),
        "conversations": sum(s["conversations"] for s in splits.values()),
        "tokens": tokens,
        "trained_tokens": sum(s["trained_tokens"] for s in splits.values()),
        "skipped_bad": skipped,
        "splits": splits,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens / seconds, 1),
    }


def _whole_offsets(tokenizer: Any) -> Any:
    """A copy without the post-processor, whose ids are the same.

    A post-processor such as ``ByteLevel(trim_offsets=True)`` trims spaces off
    the offsets, which the mask needs whole; with ``add_special_tokens=False``
    post-processors add no tokens.
    """
    copy = type(tokenizer).from_str(tokenizer.to_str())
    copy.post_processor = None
    return copy


def _batches(docs: Iterable[_Doc]) -> Iterator[list[_Doc]]:
    it = iter(docs)
    return iter(lambda: list(itertools.islice(it, BATCH_DOCS)), [])


def _tokenize(
    tokenizer: Any, docs: list[_Doc], reader: RecordReader
) -> tuple[list[str], list[np.ndarray], list[np.ndarray]]:
    """Texts, ids ``[n_i]`` and masks ``[n_i] uint8`` of the documents with a trained token."""
    encodings = tokenizer.encode_batch([d.text for d in docs], add_special_tokens=False)
    texts, ids, masks = [], [], []
    for doc, enc in zip(docs, encodings, strict=True):
        mask = trained_tokens(doc.text, np.array(enc.offsets, np.int64), doc.spans)
        if not mask.any():
            reader.reject(doc.where, "no token is trained: the trained turns tokenize to nothing")
            continue
        texts.append(doc.text)
        ids.append(np.array(enc.ids, np.int64))
        masks.append(mask)
    return texts, ids, masks


def _write(
    writer: DatasetWriter, split: str, ids: list[np.ndarray], masks: list[np.ndarray]
) -> None:
    if not ids:
        return
    lengths = np.array([a.size for a in ids], np.int64)
    encoded = encode_concatenated(np.concatenate(ids), np.cumsum(lengths) - lengths)
    writer.extend_encoded(split, encoded, lengths, loss_mask=np.concatenate(masks))


def _progress_bar(progress: bool | None) -> Any:
    if progress is False or (progress is None and not sys.stderr.isatty()):
        return None
    tqdm = require("tqdm", "convert")
    return tqdm.tqdm(desc="convert-chat", unit="tok", unit_scale=True, file=sys.stderr)


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
    g = p.add_mutually_exclusive_group()
    g.add_argument("--validation-fraction", type=float, default=0.0, help="hash split fraction")
    g.add_argument("--validation", nargs="+", default=[], metavar="INPUT", help="validation inputs")
    add_converter_flags(p)
    p.set_defaults(run=_cmd_convert_chat)


def _describe(s: dict[str, Any]) -> str:
    parts = ", ".join(
        f"{name} {v['conversations']:,} conversations / {v['tokens']:,} tokens "
        f"({v['trained_tokens']:,} trained)"
        for name, v in s["splits"].items()
    )
    return f"wrote {s['output']}: {parts}; skipped {s['skipped_bad']:,} bad; {s['seconds']:.1f}s"


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
            overwrite=args.overwrite,
            options=store_options(args),
            progress=False if args.no_progress else None,
        )

    try:
        return run_command(
            "convert-chat",
            work,
            as_json=args.json,
            describe=_describe,
            errors=(ValueError, OSError, ImportError),
        )
    except KeyboardInterrupt:
        print(f"convert-chat: interrupted; {args.output} was not written", file=sys.stderr)
        return 130
