"""Import time of flat_tokens_jax beside jax's, in fresh processes.

Each statement runs ``--runs`` times, each in a new interpreter, alternating
statements so that a change in the machine's load touches them all alike; the
table gives the median wall time of the statement (the interpreter's own
start, ``python -c pass``, subtracted) and its ratio to ``import jax``. Then the
modules that ``python -X importtime`` says took longest (cumulative) under
``import flat_tokens_jax`` and under a trainer's first use of the library.

    python scripts/bench_import.py --runs 15
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

STATEMENTS = {
    "python -c pass": "pass",
    "import jax": "import jax",
    "import flat_tokens_jax": "import flat_tokens_jax",
    "... and ftj.Loader, ftj.open_dataset": (
        "import flat_tokens_jax as ftj; ftj.Loader; ftj.open_dataset"
    ),
}


def wall(statement: str) -> float:
    """Seconds a fresh interpreter takes to run ``statement`` and exit."""
    begin = time.perf_counter()
    subprocess.run([sys.executable, "-c", statement], check=True)
    return time.perf_counter() - begin


def importtime(statement: str, top: int) -> list[tuple[int, str]]:
    """The ``top`` slowest modules (cumulative microseconds, name) of ``statement``."""
    err = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", statement],
        capture_output=True,
        text=True,
        check=True,
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
    args = parser.parse_args()
    times: dict[str, list[float]] = {name: [] for name in STATEMENTS}
    for _ in range(args.runs):
        for name, statement in STATEMENTS.items():
            times[name].append(wall(statement))
    median = {name: statistics.median(t) for name, t in times.items()}
    start = median["python -c pass"]
    jax = median["import jax"] - start
    print(f"python {sys.version.split()[0]}, median of {args.runs} fresh processes each\n")
    print("| statement | seconds (interpreter start subtracted) | / import jax |")
    print("| --- | ---: | ---: |")
    for name in STATEMENTS:
        if name != "python -c pass":
            own = median[name] - start
            print(f"| `{name}` | {own:.3f} | {own / jax:.2f} |")
    print(f"\n(interpreter start: {start:.3f} s)")
    for name in ("import flat_tokens_jax", "... and ftj.Loader, ftj.open_dataset"):
        print(f"\n`python -X importtime -c '{STATEMENTS[name]}'`, slowest (cumulative ms):")
        for micros, module in importtime(STATEMENTS[name], args.top):
            print(f"  {micros / 1000:8.1f}  {module.strip()}")


if __name__ == "__main__":
    main()
