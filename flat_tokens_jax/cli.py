"""The ``flat-tokens`` command."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from flat_tokens_jax.format import FormatError
from flat_tokens_jax.store import StoreOptions
from flat_tokens_jax.validation import summary, validate


def _store_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("url", help="dataset path or URL (file://, memory://, gs://, s3://)")
    parser.add_argument("--endpoint", help="s3:// only: S3-compatible endpoint URL")
    parser.add_argument("--region", help="s3:// only: AWS region of the bucket")
    parser.add_argument(
        "--credentials", help="s3:// only: default, anonymous, environment, imds or ecs"
    )


def _options(args: argparse.Namespace) -> StoreOptions:
    return StoreOptions(endpoint=args.endpoint, region=args.region, credentials=args.credentials)


def _cmd_validate(args: argparse.Namespace) -> int:
    try:
        validate(args.url, _options(args))
    except FormatError as e:
        print(f"{args.url}: INVALID, {len(e.problems)} problem(s):", file=sys.stderr)
        for p in e.problems:
            print(f"  {p}", file=sys.stderr)
        return 1
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
        info = summary(args.url, _options(args))
    except FormatError as e:
        print(f"{args.url}: {e}", file=sys.stderr)
        return 1
    print(json.dumps(info, indent=2) if args.json else _format_info(info))
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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    code: int = args.run(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
