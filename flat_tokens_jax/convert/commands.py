"""What every command shares: store flags, errors, summary, JSON."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

from flat_tokens_jax.location import OverwriteNeeded
from flat_tokens_jax.store import StoreOptions

_DEFAULTS = StoreOptions()


def add_store_flags(parser: argparse.ArgumentParser) -> None:
    """Adds the flags of :class:`StoreOptions` that reach remote stores."""
    group = parser.add_argument_group("remote stores")
    group.add_argument("--endpoint", help="s3:// only: S3-compatible endpoint URL")
    group.add_argument("--region", help="s3:// only: AWS region of the bucket")
    group.add_argument(
        "--credentials", help="s3:// only: default, anonymous, environment, imds or ecs"
    )
    group.add_argument(
        "--retries",
        type=int,
        default=_DEFAULTS.retries,
        help=f"attempts per gs:// or s3:// request (default {_DEFAULTS.retries})",
    )
    group.add_argument(
        "--timeout",
        type=float,
        default=_DEFAULTS.timeout,
        help=f"seconds any one read may wait, retries included (default {_DEFAULTS.timeout})",
    )


def add_converter_flags(parser: argparse.ArgumentParser) -> None:
    """Adds what every command that reads records into a new dataset takes:
    ``--skip-bad``, ``--overwrite``, ``--no-progress``, ``--json`` and the store flags."""
    parser.add_argument("--skip-bad", action="store_true", help="skip and count bad records")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing OUTPUT")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    add_store_flags(parser)


def store_options(args: argparse.Namespace) -> StoreOptions:
    """The :class:`StoreOptions` of the flags of :func:`add_store_flags`."""
    return StoreOptions(
        endpoint=args.endpoint,
        region=args.region,
        credentials=args.credentials,
        retries=args.retries,
        timeout=args.timeout,
    )


def run_command(
    name: str,
    work: Callable[[], dict[str, Any]],
    *,
    as_json: bool,
    describe: Callable[[dict[str, Any]], str],
    errors: tuple[type[BaseException], ...] = (ValueError, OSError),
) -> int:
    """Runs ``work``; prints its summary (one line, or JSON) or the error on stderr.

    Returns:
        The exit status: 0, or 1 when ``work`` raised one of ``errors``.
    """
    try:
        summary = work()
    except errors as e:
        text = e.cli_message() if isinstance(e, OverwriteNeeded) else str(e)
        print(f"{name}: {text}", file=sys.stderr)
        return 1
    print(json.dumps(summary) if as_json else describe(summary))
    return 0
