"""Train on a mixture whose weights follow each source's loss, and resume it exactly after a crash.

The model, its optimizer, the mesh and the config are ``scripts/train_example.py``'s
(imported), on a mixture (``data`` with ``datasets``, as in ``configs/mixture.yaml``)
read with ``source_field: true``. Each step logs its loss and each source's mean
loss (``ftj.per_source`` inside the jitted step). Every ``--reweight-every`` steps
the trainer changes the weights from the next step on (``loader.set_weights``):
each source's weight is its mean loss over those steps, so the sources the model
predicts worst are read more.

Every ``checkpoint_every`` steps it saves the model, the optimizer state, the
per-source sums since the last change and ``loader.state()`` (which holds every
weight change) as ``CHECKPOINT_DIR/STEP/`` (``state.npz`` and ``loader.json``),
written under another name and renamed: a crash leaves each checkpoint whole or
absent. On start it restores the newest: the loader replays the weight changes, so
a resumed run reads, trains and reweights as the uninterrupted run does, bit for
bit. Usage::

    python scripts/train_steered.py --config configs/train_steered.yaml \\
        --checkpoint-dir /tmp/ckpt --steps 40 --log-jsonl log.jsonl

``flat-tokens preview configs/train_steered.yaml --state /tmp/ckpt/40/loader.json
--picture shares.png`` then draws the share of each source the run read. Needs the
``example`` extra: ``pip install -e '.[example]'``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from collections.abc import Mapping
from contextlib import ExitStack
from itertools import islice
from pathlib import Path
from typing import Any

import jax
import numpy as np
import train_example as example

import flat_tokens_jax as ftj

Window = dict[str, np.ndarray]  # {"sums": [K] float64, "counts": [K] int64} since the last change


class SteeredTrainer(example.Trainer):
    """The example's trainer, whose step also returns each source's loss sums
    and trained tokens (``[K]`` each, ``K`` the mixture's components)."""

    def __init__(
        self, cfg: example.TrainConfig, mesh: jax.sharding.Mesh, vocab: int, seq_len: int
    ) -> None:
        if not isinstance(cfg.data, Mapping) or not cfg.data.get("datasets"):
            raise ValueError(
                "data must be a mixture, a mapping with 'datasets' (see "
                f"configs/train_steered.yaml), got {cfg.data!r}"
            )
        self.num_sources = len(cfg.data["datasets"])
        super().__init__(cfg, mesh, vocab, seq_len)

    def _step(self, state: example.State, batch: dict[str, jax.Array]) -> tuple[Any, Any]:
        grad_fn = jax.value_and_grad(example.loss_fn, has_aux=True)
        (loss, losses), grads = grad_fn(state["params"], batch)
        sums, counts = ftj.per_source(losses, batch, self.num_sources)
        return self.apply(state, grads), (loss, sums, counts)


def parse_args(argv: list[str] | None) -> tuple[example.TrainConfig, int]:
    """The example's config (its flags too) and the steps between weight changes."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/train_steered.yaml", help="YAML file")
    parser.add_argument(
        "--reweight-every", type=int, default=4, help="change the weights every this many steps"
    )
    ours, rest = parser.parse_known_args(argv)
    if ours.reweight_every < 1:
        raise ValueError(f"--reweight-every must be an int >= 1, got {ours.reweight_every}")
    cfg = example.parse_args(["--config", ours.config, *rest])
    if cfg.loader is None or not cfg.loader.source_field:
        raise ValueError(
            f"{ours.config}: set loader.source_field: true (the batches' source, which the "
            "loss per source sums by)"
        )
    return cfg, ours.reweight_every


def new_weights(window: Window, names: tuple[str, ...]) -> dict[str, float]:
    """Each source's mean loss over the window, as its weight (a source that
    had no token there gets the mean of the others')."""
    seen = window["counts"] > 0
    means = window["sums"] / np.maximum(window["counts"], 1)
    means = np.where(seen, means, means[seen].mean() if seen.any() else 1.0)
    return {n: float(m) for n, m in zip(names, means, strict=True)}


def empty_window(k: int) -> Window:
    return {"sums": np.zeros(k, np.float64), "counts": np.zeros(k, np.int64)}


def save(
    directory: Path, step: int, state: example.State, loader: ftj.Loader, window: Window, keep: int
) -> None:
    """Checkpoint ``step``: the state's arrays and the window in ``state.npz``,
    ``loader.state(step)`` in ``loader.json``; the newest ``keep`` are kept."""
    directory.mkdir(parents=True, exist_ok=True)
    part = directory / f".{step}.tmp"  # a crash's leftover is written over
    shutil.rmtree(part, ignore_errors=True)
    part.mkdir()
    arrays = {f"state_{i}": np.asarray(leaf) for i, leaf in enumerate(jax.tree.leaves(state))}
    arrays.update(window_sums=window["sums"], window_counts=window["counts"])
    np.savez(part / "state.npz", **arrays)
    (part / "loader.json").write_text(json.dumps(loader.state(step)))
    os.rename(part, directory / str(step))  # whole, or not there
    for old in checkpoints(directory)[:-keep]:
        shutil.rmtree(directory / str(old))


def checkpoints(directory: Path) -> list[int]:
    """The steps of the whole checkpoints in ``directory``, oldest first."""
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())


def restore(
    directory: Path, loader: ftj.Loader, trainer: SteeredTrainer
) -> tuple[int, example.State, Window]:
    """The step to start at, the state and the window: the newest checkpoint's, or fresh.

    Raises:
        ftj.StateMismatch: the checkpoint's data or loader config is not this run's.
    """
    found = checkpoints(directory)
    if not found:
        return 0, trainer.init(), empty_window(trainer.num_sources)
    newest = directory / str(found[-1])
    start = loader.restore(json.loads((newest / "loader.json").read_text()))  # weight changes too
    treedef = jax.tree.structure(trainer.abstract)
    with np.load(newest / "state.npz") as saved:
        leaves = [saved[f"state_{i}"] for i in range(treedef.num_leaves)]
        window = {"sums": saved["window_sums"], "counts": saved["window_counts"]}
    state = jax.device_put(jax.tree.unflatten(treedef, leaves), trainer.shardings)
    return start, state, window


def train(cfg: example.TrainConfig, every: int, trainer: SteeredTrainer, loader: ftj.Loader) -> int:
    """Runs (or resumes) training up to ``cfg.steps``; returns the exit status."""
    directory = Path(cfg.checkpoint_dir)
    names = loader.source_names
    try:
        start, state, window = restore(directory, loader, trainer)
    except ftj.StateMismatch as e:
        print(f"error: cannot resume from {directory}: {e}", file=sys.stderr)
        return 2
    print(f"{'resuming' if start else 'starting'} at step {start} of {cfg.steps}", flush=True)
    with ExitStack() as stack:
        log = None
        if cfg.log_jsonl:
            log = stack.enter_context(open(cfg.log_jsonl, "a", encoding="utf-8"))
        for step, batch in islice(loader.iterate(start), max(cfg.steps - start, 0)):
            state, (loss, sums, counts) = trainer.step(state, batch)
            sums, counts = np.asarray(sums, np.float64), np.asarray(counts, np.int64)
            window = {"sums": window["sums"] + sums, "counts": window["counts"] + counts}
            per = zip(names, sums, counts, strict=True)
            means = {n: float(s / c) if c else None for n, s, c in per}
            record: dict[str, Any] = {"step": step, "loss": float(loss), "source_loss": means}
            record["source_tokens"] = dict(zip(names, counts.tolist(), strict=True))
            if (step + 1) % every == 0:
                record["weights"] = new_weights(window, names)  # from the next step on
                loader.set_weights(step + 1, record["weights"])
                window = empty_window(len(names))
            shown = ", ".join(f"{n} {m:.4f}" for n, m in means.items() if m is not None)
            print(f"step {step}: loss {float(loss):.4f} ({shown})", flush=True)
            if log is not None:
                log.write(json.dumps(record) + "\n")
                log.flush()
            if (step + 1) % cfg.checkpoint_every == 0 or step + 1 == cfg.steps:
                save(directory, step + 1, state, loader, window, cfg.keep_checkpoints)
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        cfg, every = parse_args(argv)
        trainer, loader = example.build(cfg, SteeredTrainer)
    except ValueError as e:  # bad config, mesh or data, with what to change
        print(f"error: {e}", file=sys.stderr)
        return 2
    assert isinstance(trainer, SteeredTrainer) and isinstance(loader, ftj.Loader)
    return train(cfg, every, trainer, loader)


if __name__ == "__main__":
    sys.exit(main())
