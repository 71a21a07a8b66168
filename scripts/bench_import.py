"""Import time of flat_tokens_jax beside jax's, in fresh processes.

Each statement runs ``--runs`` times, each in a new interpreter, alternating
statements so that a change in the machine's load touches them all alike; the
table gives the median wall time of the statement (the interpreter's own
start, ``python -c pass``, subtracted) and its ratio to ``import jax``; its last
row times the package's own share inside processes that imported jax first, so
that jax's variance under a loaded machine stays out of it. Then the
modules that ``python -X importtime`` says took longest (cumulative) under
``import flat_tokens_jax`` and under a trainer's first use of the library.

Every statement reads its modules' bytecode, as after ``pip install``: the
interpreters write and read it under a fresh ``PYTHONPYCACHEPREFIX`` (whatever
``PYTHONDONTWRITEBYTECODE`` says), filled by one untimed run of each statement.
Without it, a package whose source has no bytecode beside it (an editable
install under ``PYTHONDONTWRITEBYTECODE=1``) compiles every module in every
process, and the table would time the compiler, not the imports;
``--inherit-env`` times that case: the interpreters run in this process's
environment and read whatever bytecode it leaves them.

    python scripts/bench_import.py --runs 15
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

STATEMENTS = {
    "python -c pass": "pass",
    "import jax": "import jax",
    "import flat_tokens_jax": "import flat_tokens_jax",
    "... and ftj.Loader, ftj.open_dataset": (
        "import flat_tokens_jax as ftj; ftj.Loader; ftj.open_dataset"
    ),
}
# The package's own share: the same first use, timed inside a process that has
# imported jax already (jax's own time, which varies most, left out).
AFTER_JAX = (
    "import time, jax; begin = time.perf_counter(); "
    "import flat_tokens_jax as ftj; ftj.Loader; ftj.open_dataset; "
    "print(time.perf_counter() - begin)"
)


def bytecode_env(cache_dir: str) -> dict[str, str]:
    """This process's environment, with bytecode written to and read from ``cache_dir``."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPYCACHEPREFIX"] = cache_dir
    return env


def wall(statement: str, env: dict[str, str]) -> float:
    """Seconds a fresh interpreter takes to run ``statement`` and exit."""
    begin = time.perf_counter()
    subprocess.run([sys.executable, "-c", statement], check=True, env=env)
    return time.perf_counter() - begin


def after_jax(env: dict[str, str]) -> float:
    """Seconds of :data:`AFTER_JAX`'s timed part, in a fresh interpreter."""
    out = subprocess.run(
        [sys.executable, "-c", AFTER_JAX], capture_output=True, text=True, check=True, env=env
    )
    return float(out.stdout)


def importtime(statement: str, top: int, env: dict[str, str]) -> list[tuple[int, str]]:
    """The ``top`` slowest modules (cumulative microseconds, name) of ``statement``."""
    err = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", statement],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    ).stderr
    rows = []
    for line in err.splitlines():
        if not line.startswith("import time:") or "cumulative" in line:
            continue
        _, cumulative, name = line.split("|")
        rows.append((int(cumulative), name.rstrip()))
    return sorted(rows, reverse=True)[:top]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=15, help="processes per statement")
    parser.add_argument("--top", type=int, default=12, help="modules listed per importtime")
    parser.add_argument(
        "--inherit-env",
        action="store_true",
        help="run the interpreters in this environment, without a bytecode cache of their own",
    )
    args = parser.parse_args()
    if args.inherit_env:
        report(args.runs, args.top, dict(os.environ))
        return
    with tempfile.TemporaryDirectory(prefix="bench-import-pycache-") as cache_dir:
        env = bytecode_env(cache_dir)
        for statement in STATEMENTS.values():
            wall(statement, env)  # writes the bytecode the timed runs read
        report(args.runs, args.top, env)


def report(runs: int, top: int, env: dict[str, str]) -> None:
    """Times every statement ``runs`` times and prints the table and importtime lists."""
    times: dict[str, list[float]] = {name: [] for name in STATEMENTS}
    own = []
    for _ in range(runs):
        for name, statement in STATEMENTS.items():
            times[name].append(wall(statement, env))
        own.append(after_jax(env))
    median = {name: statistics.median(t) for name, t in times.items()}
    start = median["python -c pass"]
    jax = median["import jax"] - start
    print(f"python {sys.version.split()[0]}, median of {runs} fresh processes each\n")
    print("| statement | seconds (interpreter start subtracted) | / import jax |")
    print("| --- | ---: | ---: |")
    for name in STATEMENTS:
        if name != "python -c pass":
            seconds = median[name] - start
            print(f"| `{name}` | {seconds:.3f} | {seconds / jax:.2f} |")
    package = statistics.median(own)
    print(f"| the same, after `import jax`, timed in the process | {package:.3f} | ", end="")
    print(f"{package / jax:.2f} |")
    print(f"\n(interpreter start: {start:.3f} s)")
    for name in ("import flat_tokens_jax", "... and ftj.Loader, ftj.open_dataset"):
        print(f"\n`python -X importtime -c '{STATEMENTS[name]}'`, slowest (cumulative ms):")
        for micros, module in importtime(STATEMENTS[name], top, env):
            print(f"  {micros / 1000:8.1f}  {module.strip()}")


if __name__ == "__main__":
    main()
