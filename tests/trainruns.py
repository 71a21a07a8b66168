"""Running the example trainers in scripts/ as a user does: the command line,
and a run SIGKILLed once it reached a point (the crash the resume tests recover from)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

# Long enough for a trainer's first compile and steps on a loaded 2-core machine.
KILL_WITHIN_S = 300


def script_command(script: Path, **flags: object) -> list[str]:
    """``python SCRIPT --flag=value ...``, each flag's underscores written as dashes."""
    return [sys.executable, str(script)] + [
        f"--{name.replace('_', '-')}={value}" for name, value in flags.items()
    ]


def kill_when(
    command: list[str], env: Mapping[str, str], out: Path, ready: Callable[[], bool], what: str
) -> str:
    """Runs ``command`` (its output written to ``out``), SIGKILLs it as soon as
    ``ready()`` holds, and returns its output; fails if it exits first, or if
    ``what`` (the point awaited, for the message) takes over ``KILL_WITHIN_S``."""
    with open(out, "w") as sink:
        proc = subprocess.Popen(command, env=dict(env), stdout=sink, stderr=sink)
        try:
            deadline = time.monotonic() + KILL_WITHIN_S
            while not ready():
                assert proc.poll() is None, out.read_text()[-3000:]
                assert time.monotonic() < deadline, f"{what} not within {KILL_WITHIN_S} s"
                time.sleep(0.01)
            os.kill(proc.pid, signal.SIGKILL)
        finally:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL, out.read_text()[-3000:]
    return out.read_text()
