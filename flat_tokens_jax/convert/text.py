"""``flat-tokens convert``: text corpora (JSONL, Parquet, saved datasets) tokenized
into a flat-tokens dataset, here (:func:`convert`) or on Apache Beam
(:mod:`~flat_tokens_jax.convert.beam`)."""

from __future__ import annotations

import argparse
import importlib
import os
import time
from collections.abc import Sequence
from typing import Any

from flat_tokens_jax.convert.commands import (
    add_converter_flags,
    at_least,
    progress_bar,
    run_command,
    store_options,
)
from flat_tokens_jax.convert.inputs import require
from flat_tokens_jax.convert.parts import Conversion, ConvertOptions, Totals, write_documents
from flat_tokens_jax.data.writer import DatasetWriter, StorageFormat
from flat_tokens_jax.store.options import StoreOptions, resolve_options


def convert(
    inputs: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    output: str | os.PathLike[str],
    *,
    tokenizer: str | os.PathLike[str] | None = None,
    text_key: str = "text",
    tokens_key: str | None = None,
    validation_fraction: float = 0.0,
    validation_inputs: str | os.PathLike[str] | Sequence[str | os.PathLike[str]] = (),
    workers: int = 1,
    append_eos: bool = False,
    prepend_bos: bool = False,
    add_special_tokens: bool = False,
    max_tokens: int | None = None,
    skip_bad: bool = False,
    storage_format: StorageFormat | None = None,
    overwrite: bool = False,
    progress: bool | None = None,
    options: StoreOptions | None = None,
    start_token_id: int | str | None = None,
    **option_fields: Any,
) -> dict[str, Any]:
    """Tokenizes documents into a new flat-tokens dataset, one sequence per document.

    Documents keep their input order within each split, and the output is the
    same, byte for byte, whatever ``workers``. The dataset becomes valid only at
    the end: an error or Ctrl-C leaves nothing that :func:`open_dataset` accepts.

    Args:
        inputs: files or globs (each expanded and sorted; pattern order kept):
            ``.jsonl``/``.json`` (optionally ``.gz``/``.zst``), ``.parquet``, or
            directories written by ``datasets``' ``save_to_disk``.
        output: the new dataset's path or URL.
        tokenizer: a ``tokenizers`` JSON file or ``transformers`` tokenizer directory.
        text_key: the field holding each document's text.
        tokens_key: read token ids (a list of ints per document) from this field
            instead of tokenizing text; ``tokenizer`` is then only needed for
            ``append_eos``/``prepend_bos``.
        validation_fraction: send about this fraction of documents to
            "validation", chosen by a hash of each one (:func:`validation_mask`).
        validation_inputs: or read "validation" from these files (after "train").
        workers: tokenize in this many processes (1: in this one, on the
            tokenizer's own thread pool).
        append_eos, prepend_bos: end (start) every document with the tokenizer's eos (bos).
        add_special_tokens: let the tokenizer's post-processor add its tokens.
        max_tokens: stop before the first document that would take the total
            (both splits) past this; documents are never cut.
        skip_bad: count and skip bad documents instead of stopping at the first.
        storage_format, options: as for :class:`DatasetWriter`.
        overwrite: replace a flat-tokens dataset, or the leftover of an
            interrupted write, at ``output`` (never other files). An ``output`` that
            is, contains or lies inside an input is refused (``ValueError``).
        progress: a tqdm bar on stderr; ``None``: when stderr is a terminal.
        start_token_id: record this input id for sequence starts in the
            output's info (``LoaderConfig`` uses it when it sets none): an id,
            or ``"bos"``/``"eos"`` for the tokenizer's.
        **option_fields: or the fields of ``options`` as keywords, e.g. ``endpoint=...``.

    The output records what made it (:class:`DatasetInfo`; docs/guide/data.md); no
    inputs' SHA-256 with ``max_tokens``, which may read only a prefix of them.

    Returns:
        A JSON-ready summary: ``documents``, ``tokens``, ``skipped_empty``,
        ``skipped_bad``, ``splits`` (``documents`` and ``tokens`` of each),
        ``stopped_early``, ``seconds``, ``tokens_per_s`` and the settings.

    Raises:
        InputError: a bad document (naming its file and line or row) or input file.
        ValueError: bad arguments, or a tokenizer that cannot be used.
        FileExistsError: ``output`` exists and ``overwrite`` is off, or holds
            files that are not a flat-tokens dataset.
    """
    options = resolve_options(options, option_fields, "convert")
    opts = ConvertOptions(
        tokenizer=None if tokenizer is None else os.fspath(tokenizer),
        text_key=text_key,
        tokens_key=tokens_key,
        validation_fraction=validation_fraction,
        workers=workers,
        append_eos=append_eos,
        prepend_bos=prepend_bos,
        add_special_tokens=add_special_tokens,
        max_tokens=max_tokens,
        skip_bad=skip_bad,
        start_token_id=start_token_id,
    )
    started = time.perf_counter()
    conv = Conversion.start(opts, inputs, validation_inputs, output)
    totals = Totals(opts.max_tokens)
    with DatasetWriter(
        output, storage_format=storage_format, overwrite=overwrite, options=options
    ) as writer:
        write_documents(
            writer, conv.passes, conv.tokenize, opts, totals, progress_bar(progress, "convert")
        )
        writer.info = conv.info(totals.digests)
    return conv.summary(
        os.fspath(output), totals, time.perf_counter() - started, workers=opts.workers
    )


def add_commands(subparsers: Any) -> None:
    """Registers ``flat-tokens convert``."""
    p = subparsers.add_parser(
        "convert", help="tokenize JSONL, Parquet or saved datasets into a new dataset"
    )
    p.add_argument(
        "inputs",
        nargs="+",
        metavar="INPUT",
        help="files or globs: .jsonl/.json (.gz, .zst), .parquet, save_to_disk directories",
    )
    p.add_argument("output", metavar="OUTPUT", help="the new dataset")
    p.add_argument("--tokenizer", help="tokenizers JSON file or transformers tokenizer directory")
    p.add_argument("--text-key", default="text", help="field with the text (default: text)")
    p.add_argument("--tokens-key", help="field with token ids, for input already tokenized")
    p.add_argument(
        "--workers", type=at_least(1), help="tokenizer processes (default 1; local only)"
    )
    p.add_argument("--append-eos", action="store_true", help="end each document with eos")
    p.add_argument("--prepend-bos", action="store_true", help="start each document with bos")
    p.add_argument(
        "--add-special-tokens", action="store_true", help="let the tokenizer add its own"
    )
    p.add_argument("--max-tokens", type=at_least(1), help="stop before passing this many tokens")
    p.add_argument(
        "--runner",
        choices=("local", "beam"),
        default="local",
        help="local: this process and its --workers; beam: an Apache Beam pipeline, "
        "whose options follow '--' (e.g. -- --runner=DataflowRunner --project=P ...)",
    )
    add_converter_flags(p)
    p.set_defaults(run=_cmd_convert, takes_pipeline_args=True, pipeline_args=[])


def _format_summary(s: dict[str, Any]) -> str:
    parts = ", ".join(
        f"{name} {v['documents']:,} documents / {v['tokens']:,} tokens"
        for name, v in s["splits"].items()
    )
    early = f"; stopped at max_tokens {s['max_tokens']:,}" if s["stopped_early"] else ""
    return (
        f"wrote {s['output']}: {parts}; skipped {s['skipped_empty']:,} empty, "
        f"{s['skipped_bad']:,} bad{early}; {s['seconds']:.1f}s, "
        f"{s['tokens_per_s'] / 1e6:.2f}M tokens/s"
    )


# The arguments of convert that convert_beam takes too, named as their flags.
_SHARED = (
    "tokenizer",
    "text_key",
    "tokens_key",
    "validation_fraction",
    "append_eos",
    "prepend_bos",
    "add_special_tokens",
    "skip_bad",
    "start_token_id",
    "overwrite",
)


def _cmd_convert(args: argparse.Namespace) -> int:
    def work() -> dict[str, Any]:
        shared = {name: getattr(args, name) for name in _SHARED}
        shared.update(validation_inputs=args.validation, options=store_options(args))
        if args.runner == "local":
            if args.pipeline_args:
                raise ValueError(
                    f"options after '--' ({' '.join(args.pipeline_args)}) are Beam's: add "
                    "--runner beam"
                )
            return convert(
                args.inputs,
                args.output,
                workers=1 if args.workers is None else args.workers,
                max_tokens=args.max_tokens,
                progress=False if args.no_progress else None,
                **shared,
            )
        if args.workers is not None:
            raise ValueError(
                "--workers is for --runner local; with --runner beam, set the parallelism with "
                "Beam's options after '--' (--direct_num_workers=N here, --max_num_workers=N "
                "on Dataflow)"
            )
        if args.max_tokens is not None:
            raise ValueError(
                "--max-tokens is for --runner local: a Beam conversion converts it all"
            )
        require("apache_beam", "beam")
        # Imported only now: it imports apache_beam, an optional dependency.
        beam = importlib.import_module("flat_tokens_jax.convert.beam")
        summary: dict[str, Any] = beam.convert_beam(
            args.inputs, args.output, pipeline_args=args.pipeline_args, **shared
        )
        return summary

    return run_command(
        args,
        work,
        _format_summary,
        errors=(ValueError, OSError, ImportError, RuntimeError),  # BrokenExecutor too
        output=args.output,
    )
