"""The ``flat-tokens`` command line run in this process, for the tests whose
point is what a command does rather than the process it runs in."""

from __future__ import annotations

import contextlib
import io

from flat_tokens_jax.cli import main


def run_main(*args: str) -> tuple[int, str, str]:
    """``flat-tokens ARGS``: its exit status, and what it printed to stdout and stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return code, out.getvalue(), err.getvalue()
