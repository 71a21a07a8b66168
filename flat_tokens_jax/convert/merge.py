"""Concatenating flat-tokens datasets into one, split by split, without decoding."""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from flat_tokens_jax.convert.commands import add_store_flags, run_command, store_options
from flat_tokens_jax.dataset import FlatTokens, open_dataset
from flat_tokens_jax.format import SPLITS
from flat_tokens_jax.location import refuse_overlap
from flat_tokens_jax.store import StoreOptions
from flat_tokens_jax.writer import DatasetWriter, Layout

BLOCK_TOKENS = 1 << 22


def merge(
    inputs: Sequence[str | os.PathLike[str]],
    output: str | os.PathLike[str],
    *,
    layout: Layout | None = None,
    overwrite: bool = False,
    block_tokens: int = BLOCK_TOKENS,
    options: StoreOptions | None = None,
) -> dict[str, Any]:
    """Writes every split of ``inputs``, in order, into one new dataset at ``output``.

    Sequence offsets are rebased and ``max_token_id`` is the largest of the
    inputs'. Data moves in blocks of whole sequences of about ``block_tokens``
    tokens, still encoded: memory stays bounded and no token passes through a
    Python list. Loss masks are carried over when every input of a split has
    one. ``options`` reach the inputs and the output alike. An output that
    is, contains or lies inside an input is refused before anything is written.

    Returns:
        A JSON-ready summary: inputs, and sequences and tokens per split.
    """
    began = time.perf_counter()
    refuse_overlap(inputs, [output])
    datasets = [open_dataset(url, options) for url in inputs]
    for split in SPLITS:
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
    with DatasetWriter(output, layout=layout, overwrite=overwrite, options=options) as writer:
        for split in SPLITS:
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
    p.add_argument("--overwrite", action="store_true", help="replace an existing OUTPUT")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    add_store_flags(p)
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
        "merge",
        lambda: merge(
            args.inputs, args.output, overwrite=args.overwrite, options=store_options(args)
        ),
        as_json=args.json,
        describe=describe,
    )
