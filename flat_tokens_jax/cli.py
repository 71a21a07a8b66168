"""The ``flat-tokens`` command."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

from flat_tokens_jax.convert import chat, megatron, merge, text
from flat_tokens_jax.convert.commands import add_store_flags, at_least, fail, store_options
from flat_tokens_jax.dataset import open_dataset
from flat_tokens_jax.format import FormatError
from flat_tokens_jax.loader import Loader, LoaderConfig
from flat_tokens_jax.store import StoreError
from flat_tokens_jax.validation import summary, validate


def _store_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("url", help="dataset path or URL (file://, memory://, gs://, s3://)")
    add_store_flags(parser)


def _cmd_validate(args: argparse.Namespace) -> int:
    try:
        validate(args.url, store_options(args))
    except FormatError as e:
        print(f"{args.url}: INVALID, {len(e.problems)} problem(s):", file=sys.stderr)
        for p in e.problems:
            print(f"  {p}", file=sys.stderr)
        return 1
    except (StoreError, ValueError) as e:
        return fail("validate", e)
    print(f"{args.url}: valid")
    return 0


def _format_info(info: dict[str, Any]) -> str:
    lines = [f"{info['url']} (zarr v{info['zarr_format']})"]
    for name, s in info["splits"].items():
        lines.append(
            f"  {name}: {s['num_tokens']:,} tokens, {s['num_sequences']:,} sequences, "
            f"max_token_id {s['max_token_id']}" + (", with loss_mask" if s["loss_mask"] else "")
        )
        if "lengths" in s:
            ln = s["lengths"]
            approx = " (sampled)" if s["lengths_sampled"] else ""
            lines.append(
                f"    lengths{approx}: mean {ln['mean']:.1f}, min {ln['min']}, "
                f"median {ln['median']:g}, p90 {ln['p90']:g}, p99 {ln['p99']:g}, "
                f"max {ln['max']}"
            )
        for array, lay in s["layout"].items():
            shard = f", shard {lay['shard']}" if lay["shard"] else ""
            filters = f", filters {lay['filters']}" if lay["filters"] else ""
            lines.append(
                f"    {array}: chunk {lay['chunk']}{shard}, "
                f"compression {lay['compression'] or 'none'}{filters}"
            )
    return "\n".join(lines)


def _cmd_info(args: argparse.Namespace) -> int:
    try:
        info = summary(args.url, store_options(args))
    except (StoreError, ValueError) as e:
        return fail("info", e)
    print(json.dumps(info, indent=2) if args.json else _format_info(info))
    return 0


def _cmd_show(args: argparse.Namespace) -> int:
    config = LoaderConfig(
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        packing=not args.padded,
        shuffle=not args.no_shuffle,
        seed=args.seed,
        num_epochs=args.num_epochs,
        prefetch=0,
    )
    try:
        loader = Loader(open_dataset(args.url, store_options(args))[args.split], config)
        batch = loader.host_batch(args.step)
        provenance = loader.provenance(args.step)
    except (StoreError, IndexError, KeyError, ValueError) as e:
        return fail("show", e)
    rows = [
        {**prov, **{k: v[i].astype(int).tolist() for k, v in batch.items()}}
        for i, prov in enumerate(provenance)
    ]
    if args.json:
        print(json.dumps({"step": args.step, "config": config.batch_defining(), "rows": rows}))
        return 0
    print(f"step {args.step} of {args.url} [{args.split}], {config}")
    for row in rows:
        where = (
            "padding"
            if row.get("padding")
            else f"sample {row['sample']}, epoch {row['epoch']}, record {row['record']}, "
            f"tokens [{row['tokens'][0]}, {row['tokens'][1]})"
        )
        print(f"row {row['row']}: {where}")
        for key in ("inputs", "targets", "segment_ids", "positions", "loss_mask"):
            print(f"  {key:<12}{row[key]}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flat-tokens", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("validate", help="check every invariant of a dataset")
    _store_args(p)
    p.set_defaults(run=_cmd_validate)
    p = sub.add_parser("info", help="counts, length statistics and layout per split")
    _store_args(p)
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(run=_cmd_info)
    p = sub.add_parser("show", help="print the batch of a step and where each row came from")
    _store_args(p)
    p.add_argument("--step", type=at_least(0), required=True)
    p.add_argument("--batch-size", type=at_least(1), required=True, help="global batch size")
    p.add_argument("--seq-len", type=at_least(1), required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--split", default="train")
    p.add_argument("--padded", action="store_true", help="one sequence per row, padded")
    p.add_argument("--no-shuffle", action="store_true", help="records in order")
    p.add_argument("--num-epochs", type=at_least(1), default=None)
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(run=_cmd_show)
    text.add_commands(sub)
    chat.add_commands(sub)
    merge.add_commands(sub)
    megatron.add_commands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    # Words after "--" are options of another program (Beam's, for convert --runner beam).
    cut = words.index("--") if "--" in words else len(words)
    parser = build_parser()
    args = parser.parse_args(words[:cut])
    args.pipeline_args = words[cut + 1 :]
    if args.pipeline_args and not getattr(args, "takes_pipeline_args", False):
        parser.error(f"{args.command} takes no options after '--'")
    try:
        code: int = args.run(args)
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader of our output went away (`flat-tokens info --json | head`): stop
        # quietly, as Unix tools do. Python's recipe: point stdout at devnull so
        # the flush at exit does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    return code


if __name__ == "__main__":
    sys.exit(main())
