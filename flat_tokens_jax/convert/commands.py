"""What every converter command does around its work: errors, summary, JSON."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any


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
        print(f"{name}: {e}", file=sys.stderr)
        return 1
    print(json.dumps(summary) if as_json else describe(summary))
    return 0
