"""Concatenating flat-tokens datasets into one, split by split, without decoding."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from flat_tokens_jax.convert.commands import add_output_flags, run_command, store_options
from flat_tokens_jax.core.format import split_names
from flat_tokens_jax.data.dataset import Dataset, FlatTokens, open_dataset
from flat_tokens_jax.data.writer import DatasetWriter, StorageFormat
from flat_tokens_jax.store.identity import (
    DatasetInfo,
    check_tokenizers,
    common_tokenizer,
    inputs_field,
)
from flat_tokens_jax.store.location import refuse_overlap
from flat_tokens_jax.store.options import StoreOptions, resolve_options

BLOCK_TOKENS = 1 << 22


def merge(
    inputs: Sequence[str | os.PathLike[str]],
    output: str | os.PathLike[str],
    *,
    storage_format: StorageFormat | None = None,
    overwrite: bool = False,
    block_tokens: int = BLOCK_TOKENS,
    options: StoreOptions | None = None,
    allow_mixed_tokenizers: bool = False,
    **option_fields: Any,
) -> dict[str, Any]:
    """Writes every split of ``inputs``, in order, into one new dataset at ``output``.

    The output has every split any input has. Data moves still encoded, in blocks
    of whole sequences of about ``block_tokens`` tokens. Loss masks are carried
    over when every input of a split has one. ``options`` reach the inputs and the
    output alike. An output that is, contains or lies inside an input is refused.

    Inputs that record different tokenizers (:attr:`Dataset.info`) are refused
    unless ``allow_mixed_tokenizers``; inputs that record none merge with any. The
    output records what the inputs share (docs/guide/data.md, ``merge``).

    Returns:
        A JSON-ready summary: inputs, and sequences and tokens per split.

    Raises:
        ValueError: inputs of different tokenizers, or loss masks in some
            inputs of a split only.
    """
    options = resolve_options(options, option_fields, "merge")
    began = time.perf_counter()
    refuse_overlap(inputs, [output])
    datasets = [open_dataset(url, options) for url in inputs]
    check_tokenizers(
        [(ds.url, ds.info) for ds in datasets],
        allow_mixed=allow_mixed_tokenizers,
        fix="pass --allow-mixed-tokenizers (allow_mixed_tokenizers=True in Python)",
    )
    names = split_names(s for ds in datasets for s in ds.splits)
    for split in names:
        masked = {ds[split].loss_mask is not None for ds in datasets if split in ds}
        if len(masked) > 1:
            listed = ", ".join(
                f"{ds.url} ({'with' if ds[split].loss_mask is not None else 'without'})"
                for ds in datasets
                if split in ds
            )
            raise ValueError(
                f"split {split!r}: some inputs have a loss_mask and some do not: {listed}"
            )
    summary: dict[str, Any] = {"inputs": [ds.url for ds in datasets], "splits": {}}
    with DatasetWriter(
        output,
        storage_format=storage_format,
        overwrite=overwrite,
        options=options,
        splits=names,
        info=merged_info(datasets),
    ) as writer:
        for split in names:
            sequences = tokens = 0
            for ds in datasets:
                if split not in ds:
                    continue
                for encoded, lengths, mask in _blocks(ds[split], block_tokens):
                    writer.extend_encoded(split, encoded, lengths, mask)
                    sequences += lengths.size
                    tokens += encoded.size
            summary["splits"][split] = {"sequences": sequences, "tokens": tokens}
    summary["seconds"] = round(time.perf_counter() - began, 3)
    return summary


def merged_info(datasets: Sequence[Dataset]) -> DatasetInfo:
    """The info of the concatenation of ``datasets``: what they all share."""
    infos = [ds.info for ds in datasets]
    starts = {None if i is None else i.start_token_id for i in infos}
    flags = [None if i is None else json.dumps(i.flags, sort_keys=True) for i in infos]
    common = infos[0] is not None and len(set(flags)) == 1
    return DatasetInfo(
        tokenizer=common_tokenizer(infos),
        start_token_id=starts.pop() if len(starts) == 1 else None,
        flags=dict(infos[0].flags) if common and infos[0] is not None else {},
        inputs=inputs_field([ds.url for ds in datasets], [_fingerprint(ds) for ds in datasets]),
    )


def _fingerprint(ds: Dataset) -> str:
    """SHA-256 of an input's info and per-split counts, as canonical JSON."""
    content = {
        "info": None if ds.info is None else ds.info.to_attributes(),
        "splits": {n: [ft.num_sequences, ft.num_tokens, ft.max_token_id] for n, ft in ds.items()},
    }
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode("utf-8")).hexdigest()


def _blocks(
    ft: FlatTokens, block_tokens: int
) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray | None]]:
    """``(encoded, lengths, loss mask or None)`` of consecutive runs of whole sequences."""
    first = 0
    per_read = 1 << 16
    while first < ft.num_sequences:
        stop = min(first + per_read, ft.num_sequences)
        lo, hi = ft.sequence_bounds(np.arange(first, stop))
        # Take sequences while the run stays within the block (always at least one).
        cut = max(1, int(np.searchsorted(hi - lo[0], block_tokens, side="right")))
        span = (np.array([lo[0]]), np.array([hi[cut - 1]]))
        pending = ft.request_encoded(*span)
        masks = ft.request_loss_mask(*span)
        mask = None if masks is None else masks.result()[0]
        yield np.asarray(pending.result()[0], np.uint32), hi[:cut] - lo[:cut], mask
        first += cut


def add_commands(subparsers: Any) -> None:
    """Registers ``flat-tokens merge``."""
    p = subparsers.add_parser("merge", help="concatenate flat-tokens datasets into one")
    p.add_argument("inputs", nargs="+", metavar="INPUT", help="datasets, in order")
    p.add_argument("output", metavar="OUTPUT", help="the new dataset")
    p.add_argument(
        "--allow-mixed-tokenizers", action="store_true", help="merge inputs of different tokenizers"
    )
    add_output_flags(p)
    p.set_defaults(run=_cmd_merge)


def _cmd_merge(args: argparse.Namespace) -> int:
    def describe(summary: dict[str, Any]) -> str:
        parts = ", ".join(
            f"{s}: {v['sequences']:,} sequences, {v['tokens']:,} tokens"
            for s, v in summary["splits"].items()
        )
        return (
            f"merged {len(args.inputs)} datasets into {args.output} ({parts}) "
            f"in {summary['seconds']:.1f}s"
        )

    return run_command(
        args,
        lambda: merge(
            args.inputs,
            args.output,
            overwrite=args.overwrite,
            options=store_options(args),
            allow_mixed_tokenizers=args.allow_mixed_tokenizers,
        ),
        describe,
    )
