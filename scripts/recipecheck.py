"""The check each grain recipe (``scripts/recipe_*.py``) ends with, and its toy model.

A recipe is a trainer's data path and train loop; it hands :func:`main` its
``train(run)``, which trains ``run.steps`` steps from its newest checkpoint in
``run.ckpt`` (none: from step 0), saving one every ``run.every`` steps through
grain's own checkpointing of the iterator, and calls ``run.record`` after each
step. :func:`main` runs the script again as fresh processes in ``DIR``:

1. ``full``: every step, uninterrupted;
2. ``killed``: the same run, which SIGKILLs itself once step ``--kill-at`` is
   trained, then again in a fresh process, which restores its newest
   checkpoint and trains to the end (``resumed``);
3. ``other-seed``: a copy of those checkpoints restored by a run of seed 1.

It prints ``resume: identical`` when the resumed steps' losses and batches
equal the full run's bit for bit, and ``other seed: refused`` when the run of
seed 1 stopped on ``StateMismatch`` naming the seed, the last error it raised
(not the cause of another); exit 0 when both hold, else 1 (``--stale-iterator``
resumes wrongly, to see the check fail). Each process writes ``DIR/NAME.jsonl``:
a line a step, with its loss and the sha256 of its arrays (by sorted key).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import flat_tokens_jax as ftj


@dataclasses.dataclass(frozen=True)
class Run:
    """One process of a recipe: where it checkpoints, what it reads, when it dies."""

    ckpt: Path  # its orbax checkpoints
    data: Path  # a flat-tokens store with a "train" split
    log: Path
    seed: int
    steps: int
    every: int
    kill_at: int | None

    def record(self, step: int, loss: jax.Array, batch: Mapping[str, Any]) -> None:
        """Logs the step; SIGKILLs this process once step ``kill_at`` is trained."""
        digest = hashlib.sha256(b"".join(np.asarray(batch[k]).tobytes() for k in sorted(batch)))
        line = {"step": step, "loss": float(loss), "digest": digest.hexdigest()}
        with open(self.log, "a") as f:
            f.write(json.dumps(line) + "\n")
        print(f"step {step} loss {float(loss):.6f}", flush=True)
        if step == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)


def init_params(vocab: int, width: int = 16) -> dict[str, np.ndarray]:
    """An embedding ``[vocab, width]`` and a read-out ``[width, vocab]``, float32."""
    w = np.random.default_rng(0).normal(0, 0.1, (2, vocab, width)).astype("f4")
    return {"embed": w[0], "out": w[1].T}


@jax.jit
def sgd_step(
    params: dict[str, jax.Array], x: jax.Array, y: jax.Array, weights: jax.Array
) -> tuple[dict[str, jax.Array], jax.Array]:
    """One plain SGD step on the mean cross-entropy of ``y`` given ``x`` (each
    ``[batch, seq_len]``), weighted by ``weights``; the new params and the loss."""

    def loss_fn(params: dict[str, jax.Array]) -> jax.Array:
        logp = jax.nn.log_softmax(params["embed"][x] @ params["out"])  # [batch, seq_len, vocab]
        nll = -jnp.take_along_axis(logp, y[..., None], axis=-1)[..., 0]
        return (nll * weights).sum() / weights.sum()

    loss, grads = jax.value_and_grad(loss_fn)(params)
    return jax.tree.map(lambda w, dw: w - 10.0 * dw, params, grads), loss


def read_log(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def finalized(ckpt: Path) -> list[Path]:
    """The iterator states of the finalized checkpoints in ``ckpt`` (``STEP/ITEM/FILE``)."""
    saved = ckpt.glob("*/*/process_0-of-1.json")
    return [p for p in saved if p.parent.parent.name.isdigit()]


def step_of(saved: Path) -> int:
    """The step of a checkpoint's file ``STEP/ITEM/FILE``."""
    return int(saved.parent.parent.name)


def main(train: Callable[[Run], None], doc: str) -> None:
    """The recipe's command line: the whole check, or one of its processes (``--child``)."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("dir", type=Path, help="the runs' folder")
    parser.add_argument("--data", type=Path, help="a local store (default: DIR/data, made)")
    for flag, default in {"steps": 10, "every": 3, "kill-at": 6, "seed": 0}.items():
        parser.add_argument(f"--{flag}", type=int, default=default)
    wrong = (
        "before the resume, the newest checkpoint's iterator state is replaced by the one before"
    )
    parser.add_argument(
        "--stale-iterator", action="store_true", help=wrong + ": the check must fail"
    )
    parser.add_argument("--child", nargs=2, metavar=("RUN", "LOG"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.data = args.data or args.dir / "data"
    if args.child:
        name, log = args.child
        kill_at = args.kill_at if log == "killed" else None
        log_path, sizes = args.dir / f"{log}.jsonl", (args.steps, args.every)
        train(Run(args.dir / name, args.data, log_path, args.seed, *sizes, kill_at))
    else:
        sys.exit(0 if check(args) else 1)


def check(args: argparse.Namespace) -> bool:
    """Runs the processes of the check in ``args.dir``; whether both checks hold."""
    for name in ("full", "killed", "other-seed", "resumed"):  # an earlier check's
        shutil.rmtree(args.dir / name, ignore_errors=True)
        (args.dir / f"{name}.jsonl").unlink(missing_ok=True)
    if not args.data.exists():  # 400 sequences counting up from a random id, mod 64
        r = np.random.default_rng(0)
        seqs = [(r.integers(64) + np.arange(n)) % 64 for n in r.integers(8, 99, 400)]
        ftj.write_dataset(args.data, {"train": seqs})
    flags = [f"--{k}={getattr(args, k.replace('-', '_'))}" for k in ("steps", "every", "kill-at")]
    command = [sys.executable, sys.argv[0], str(args.dir), f"--data={args.data}", *flags]

    def child(run: str, log: str, expect: int, seed: int = 0) -> str | None:
        """Runs one process: its stderr; ``None``, printed, if it exits other than ``expect``."""
        out = subprocess.run(
            [*command, f"--seed={seed}", "--child", run, log], capture_output=True, text=True
        )
        print(f"{log}: exit {out.returncode}", flush=True)
        if out.returncode != expect:
            print(out.stderr[-4000:])
        return out.stderr if out.returncode == expect else None

    ran = [child("full", "full", 0), child("killed", "killed", -signal.SIGKILL)]
    if args.stale_iterator:
        saved = sorted(finalized(args.dir / "killed"), key=step_of)
        if len(saved) < 2:
            sys.exit(f"--stale-iterator needs 2 checkpoints before the kill, found {len(saved)}")
        shutil.copyfile(saved[-2], saved[-1])
    ran.append(child("killed", "resumed", 0))
    full, killed, resumed = (
        read_log(args.dir / f"{n}.jsonl") for n in ("full", "killed", "resumed")
    )
    first = resumed[0]["step"] if resumed else args.steps
    same = None not in ran and 0 < first <= args.kill_at + 1 and resumed == full[first:]
    same = same and killed == full[: args.kill_at + 1]
    print(f"resume: {'identical' if same else 'DIFFERENT'}, steps {first}-{args.steps - 1}")
    shutil.copytree(args.dir / "killed", args.dir / "other-seed")
    err = child("other-seed", "other-seed", 1, seed=1) or ""
    tail = err[err.rfind("StateMismatch: ") :]  # the error and the fields that differ
    last = "StateMismatch" in tail and "Traceback" not in tail  # no error raised after it
    why = " ".join(tail.split()) if last else "no StateMismatch as the last error"
    refused = "fingerprint.config.seed" in why and not read_log(args.dir / "other-seed.jsonl")
    print(f"other seed: {'refused' if refused else 'NOT REFUSED'}: {why}")
    return same and refused
