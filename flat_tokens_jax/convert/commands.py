"""What every command shares: store flags, errors, summary, JSON."""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
from collections.abc import Callable
from typing import Any

from flat_tokens_jax.convert.inputs import require
from flat_tokens_jax.core.urls import redact, redact_text, scheme_of
from flat_tokens_jax.core.values import number
from flat_tokens_jax.store.location import OverwriteNeeded
from flat_tokens_jax.store.options import (
    CONCURRENCY_CEILING,
    CREDENTIAL_TYPES,
    MAX_RETRIES,
    StoreOptions,
)

log = logging.getLogger(__name__)

_DEFAULTS = StoreOptions()


def at_least(minimum: int) -> Callable[[str], int]:
    """An argparse ``type``: an integer of at least ``minimum``."""

    def parse(text: str) -> int:
        value = _int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {text}")
        return value

    return parse


def between(low: int, high: int) -> Callable[[str], int]:
    """An argparse ``type``: an integer in ``[low, high]``."""

    def parse(text: str) -> int:
        value = at_least(low)(text)
        if value > high:
            raise argparse.ArgumentTypeError(f"must be at most {high:,}, got {text}")
        return value

    return parse


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected int, got {text!r}") from None


def store_count(field: str) -> Callable[[str], int]:
    """An argparse ``type``: an int that :class:`StoreOptions` takes as ``field``."""

    def parse(text: str) -> int:
        value = _int(text)
        given: dict[str, Any] = {field: value}
        try:
            StoreOptions(**given)
        except ValueError as e:
            raise argparse.ArgumentTypeError(
                str(e).removeprefix(f"StoreOptions.{field} ")
            ) from None
        return value

    return parse


def positive_seconds(text: str) -> float:
    """An argparse ``type``: a finite number of seconds above 0."""
    try:
        value = number(float(text), "")
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be above 0 seconds, got {text}")
    return value


def credentials_type(text: str) -> str:
    """An argparse ``type`` for ``--credentials``: one of the credentials types.
    A bad value is not repeated (argparse's ``choices`` would echo it), as it
    may be a secret pasted in the wrong place."""
    if text not in CREDENTIAL_TYPES:
        raise argparse.ArgumentTypeError(
            f"invalid choice (not repeated here, in case it is a secret): choose from "
            f"{', '.join(CREDENTIAL_TYPES)}; keys and profiles come from the environment "
            "(AWS_ACCESS_KEY_ID, AWS_PROFILE) or the AWS config files"
        )
    return text


def add_store_flags(parser: argparse.ArgumentParser) -> None:
    """Adds the flags of :class:`StoreOptions` that reach remote stores."""
    group = parser.add_argument_group("remote stores")
    group.add_argument("--endpoint", help="s3:// only: S3-compatible endpoint URL")
    group.add_argument("--region", help="s3:// only: AWS region of the bucket")
    group.add_argument(
        "--credentials",
        type=credentials_type,
        metavar="{" + ",".join(CREDENTIAL_TYPES) + "}",
        help="s3:// only: where the credentials come from (default: tensorstore's chain)",
    )
    group.add_argument(
        "--concurrency",
        type=at_least(1),
        default=_DEFAULTS.concurrency,
        help="most gs:// or s3:// requests in flight (default: as many as the reads in "
        f"flight ask for, up to {CONCURRENCY_CEILING})",
    )
    group.add_argument(
        "--retries",
        type=store_count("retries"),
        default=_DEFAULTS.retries,
        help=f"attempts per gs:// or s3:// request, at most {MAX_RETRIES} (default "
        f"{_DEFAULTS.retries})",
    )
    group.add_argument(
        "--retry-delay",
        type=positive_seconds,
        default=_DEFAULTS.retry_delay,
        help=f"seconds before the first retry, doubling (default {_DEFAULTS.retry_delay})",
    )
    group.add_argument(
        "--max-retry-delay",
        type=positive_seconds,
        default=_DEFAULTS.max_retry_delay,
        help=f"longest wait between attempts (default {_DEFAULTS.max_retry_delay})",
    )
    group.add_argument(
        "--timeout",
        type=positive_seconds,
        default=_DEFAULTS.timeout,
        help=f"seconds any one read may wait, retries included (default {_DEFAULTS.timeout})",
    )


def add_output_flags(parser: argparse.ArgumentParser, *, overwrite: bool = True) -> None:
    """Adds ``--overwrite`` (unless ``overwrite`` is false), ``--json`` and the store flags."""
    if overwrite:
        parser.add_argument("--overwrite", action="store_true", help="replace an existing OUTPUT")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    add_store_flags(parser)


def _start_token_id(text: str) -> int | str:
    if text in ("bos", "eos"):
        return text
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a token id >= 0, bos or eos, got {text!r}")
    return value


def add_converter_flags(parser: argparse.ArgumentParser) -> None:
    """Adds what every command that reads documents into a new dataset takes: the
    validation split, ``--start-token-id``, ``--skip-bad``, ``--no-progress`` and
    :func:`add_output_flags`."""
    g = parser.add_mutually_exclusive_group()
    g.add_argument(
        "--validation-fraction",
        type=float,
        default=0.0,
        help="send about this fraction of documents, chosen by a hash of each, to validation",
    )
    g.add_argument("--validation", nargs="+", default=[], metavar="INPUT", help="validation inputs")
    parser.add_argument(
        "--start-token-id",
        type=_start_token_id,
        metavar="ID",
        help="record the input id that training feeds at sequence starts (a number, or bos "
        "or eos: the tokenizer's); a LoaderConfig without start_token_id uses it",
    )
    parser.add_argument("--skip-bad", action="store_true", help="skip and count bad documents")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_output_flags(parser)


def store_options(args: argparse.Namespace) -> StoreOptions:
    """The :class:`StoreOptions` of the flags of :func:`add_store_flags`."""
    return StoreOptions(
        endpoint=args.endpoint,
        region=args.region,
        credentials=args.credentials,
        concurrency=args.concurrency,
        retries=args.retries,
        retry_delay=args.retry_delay,
        max_retry_delay=args.max_retry_delay,
        timeout=args.timeout,
    )


def refuse_memory_output(command: str, output: str | None) -> int | None:
    """Exit status 1, with the reason on stderr, for a ``memory://`` OUTPUT: its
    data would die with this process; ``None`` for any other output."""
    if output is None or scheme_of(output) != "memory":
        return None
    print(
        f"{command}: {redact(output)} lives in this command's memory and would be gone "
        "when it exits: write to a path (or a file://, gs:// or s3:// URL)",
        file=sys.stderr,
    )
    return 1


def path_error(name: str, path: str, error: OSError, wanted: str) -> ValueError:
    """``error``, met opening ``path`` (given as ``name``, a flag such as
    ``--state``), as one line that names ``name`` and ``path``, not a bare
    ``[Errno 2]``, and what to give instead (``wanted``: "a .png file")."""
    where = f"{name} {path}"
    if isinstance(error, IsADirectoryError):
        return ValueError(f"{where} is a folder: name {wanted}")
    if isinstance(error, FileNotFoundError):
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            return ValueError(
                f"{where}: the folder {folder} does not exist: create it, or name "
                f"{wanted} in a folder that exists"
            )
        return ValueError(f"{where}: no such file: name {wanted}")
    return ValueError(f"{where}: {error.strerror or error}: name {wanted}")


def fail(name: str, error: BaseException) -> int:
    """Prints ``name: error`` on stderr, in CLI terms (``StoreOptions.retry_delay``
    becomes ``--retry-delay``, ``LoaderConfig.seq_len`` ``--seq-len``); returns 1."""
    text = error.cli_message() if isinstance(error, OverwriteNeeded) else str(error)
    # The last guard: a URL in another library's message (a file name in an OSError).
    text = re.sub(
        r"(?:StoreOptions|LoaderConfig)\.(\w+)",
        lambda m: "--" + m.group(1).replace("_", "-"),
        redact_text(text),
    )
    print(f"{name}: {text}", file=sys.stderr)
    return 1


def progress_bar(progress: bool | None, desc: str) -> Any:
    """A tqdm bar of tokens on stderr (``None``: when stderr is a terminal), or ``None``."""
    if progress is False or (progress is None and not sys.stderr.isatty()):
        return None
    try:
        tqdm = require("tqdm", "convert")
    except ImportError:
        if progress:
            log.warning("no progress bar: tqdm is not installed")
        return None
    return tqdm.tqdm(desc=desc, unit="tok", unit_scale=True, file=sys.stderr)


def run_command(
    args: argparse.Namespace,
    work: Callable[[], dict[str, Any]],
    describe: Callable[[dict[str, Any]], str],
    *,
    errors: tuple[type[BaseException], ...] = (ValueError, OSError, ImportError),
    output: str | None = None,
) -> int:
    """Runs ``work`` for ``args.command``; prints its summary (one line, or JSON with
    ``args.json``) or the error on stderr.

    Returns:
        The exit status: 0; 1 when ``work`` raised one of ``errors``; 130 when
        interrupted while writing ``output`` (when given).
    """
    try:
        summary = work()
    except errors as e:
        return fail(args.command, e)
    except KeyboardInterrupt:
        if output is None:
            raise
        print(f"{args.command}: interrupted; {output} was not written", file=sys.stderr)
        return 130
    print(json.dumps(summary) if args.json else describe(summary))
    return 0
