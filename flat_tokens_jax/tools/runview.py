"""What a run will read, before it runs (``flat-tokens preview``): per phase and
component, steps, samples, tokens and epochs by the loader's own arithmetic
(:func:`run_rows`), a picture of each component's share (:func:`draw_shares`), and
with ``--requests`` each phase's reads beside its :func:`counterpart` under the other
shuffle (:func:`preview_requests`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from flat_tokens_jax.core.extras import install_hint
from flat_tokens_jax.core.fields import BLOCKS
from flat_tokens_jax.core.values import integer
from flat_tokens_jax.loader.engine import StepEngine
from flat_tokens_jax.loader.loader import Loader
from flat_tokens_jax.loader.phasedloader import PhasedLoader
from flat_tokens_jax.loader.phases import drawn
from flat_tokens_jax.loader.state import sample_shares
from flat_tokens_jax.tools.requestcount import (
    GCS_DOUBLING_MINUTES,
    GCS_INITIAL_READS,
    RequestCounts,
    count_requests,
)

# A stream read more epochs than this shows its model each record that many
# times: fine for a small high-quality source, a mistake for most.
REPEAT_WARNING_EPOCHS = 100

_NO_ROWS = np.zeros(0, np.int64)


def run_rows(run: PhasedLoader, end_step: int) -> list[dict[str, Any]]:
    """One dict per phase and component, for the trainer steps before ``end_step``.
    ``epochs``: this phase's samples over the records; ``stream_epochs``: the
    stream's samples by the phase's end over the records."""
    rows: list[dict[str, Any]] = []
    for k, loader in enumerate(run.engines):
        start = run.firsts[k]
        if start >= end_step:
            break
        stop = min(end_step, run.firsts[k + 1] if k + 1 < len(run.firsts) else end_step)
        if stop == start:
            continue  # a phase whose every step was skipped
        last = stop - start - 1
        try:
            # The loader's own check of a step, on the phase's last one shown.
            loader.steps.samples(last, _NO_ROWS)
        except (ValueError, IndexError) as e:
            raise ValueError(
                f"the run's step {stop - 1} is step {last} of {run.label(k)}, and its "
                f"loader refuses it: {e}"
            ) from None
        counts = drawn(loader.steps.steering, loader.steps.steering.data_step(last) + 1)
        for c, name in enumerate(loader.names):
            records, offset = len(loader.components[c]), run.offsets[k][c]
            rows.append(
                {
                    "phase": k,
                    "phase_name": run.phases[k].name,
                    "start_step": start,
                    "end_step": stop,
                    "steps": stop - start,
                    "component": name,
                    "seq_len": loader.config.seq_len,
                    "packing": loader.config.packing.value,
                    "records": records,
                    "stream": "continued" if offset else "new",
                    "samples": counts[c],
                    "tokens": counts[c] * loader.config.seq_len,
                    "epochs": counts[c] / records,
                    "stream_epochs": (offset + counts[c]) / records,
                }
            )
    return rows


_COLUMNS = ("component", "stream", "samples", "tokens", "epochs", "stream epochs")


def run_table(rows: list[dict[str, Any]]) -> list[str]:
    """:func:`run_rows` as text: a line per phase, then its components, in columns."""
    cells = [
        [
            str(r["component"]),
            r["stream"],
            f"{r['samples']:,}",
            f"{r['tokens']:,}",
            f"{r['epochs']:,.3f}",
            f"{r['stream_epochs']:,.3f}",
        ]
        for r in rows
    ]
    head, *body = aligned([_COLUMNS, *cells], left=2)
    lines = []
    for k in dict.fromkeys(r["phase"] for r in rows):
        mine = [i for i, r in enumerate(rows) if r["phase"] == k]
        first = rows[mine[0]]
        name = "" if first["phase_name"] is None else f" {first['phase_name']!r}"
        lines.append(
            f"phase {k}{name}: steps [{first['start_step']}, {first['end_step']}) "
            f"({first['steps']:,} steps), seq_len {first['seq_len']}, packing {first['packing']}"
        )
        lines += ["  " + head, *("  " + body[i] for i in mine)]
    return lines


def repeat_warnings(
    run: PhasedLoader, rows: list[dict[str, Any]], most: float = REPEAT_WARNING_EPOCHS
) -> list[str]:
    """A line for each stream of :func:`run_rows` read more than ``most`` epochs by their end."""
    last: dict[str, dict[str, Any]] = {}
    for r in rows:
        names = run.engines[r["phase"]].names
        last[run.streams[r["phase"]][names.index(r["component"])]] = r
    return [
        f"component {r['component']!r} ({r['records']:,} records) is read "
        f"{r['stream_epochs']:,.1f} epochs by step {r['end_step']}, in {run.label(r['phase'])}: "
        f"more than {most:g}, so each record repeats that often; give it more data or less weight"
        for r in last.values()
        if r["stream_epochs"] > most
    ]


def steering_rows(run: PhasedLoader) -> list[dict[str, Any]]:
    """One dict per skip and weight change of a steered run, by step: ``step``,
    ``data_step``, ``skipped`` (0 for a weight change), ``phase`` and
    ``weights`` (``{component: share of the samples}`` from there; ``None`` for one source)."""
    saved = run.saved_state()
    skipped = dict(saved.skips)
    out = []
    for step in sorted(set(skipped) | {t for t, _ in saved.weights}):
        at = saved.steering_at(step)
        out.append(
            {
                "step": step,
                "data_step": at.data_step,
                "skipped": skipped.get(step, 0),
                "phase": at.phase,
                "weights": at.shares,
            }
        )
    return out


def steering_table(rows: list[dict[str, Any]]) -> list[str]:
    """:func:`steering_rows` as text, a line each."""
    lines = []
    for r in rows:
        told = f"step {r['step']} reads the data of step {r['data_step']}"
        if r["skipped"]:
            told += f" ({r['skipped']:,} batches skipped there)"
        if r["weights"] is not None:
            shares = ", ".join(f"{n} {w:.4g}" for n, w in r["weights"].items())
            told += f"; weights from it: {shares}"
        lines.append(told)
    return lines


def share_segments(run: PhasedLoader, end_step: int) -> list[tuple[int, int, dict[str, float]]]:
    """``(first step, end step, {component: share of the tokens})`` of each
    stretch of steps ``[0, end_step)`` with fixed weights (a phase, or a weight
    segment in one; none whose steps were all skipped)."""
    saved = run.saved_state()
    out = []
    for k, found in saved.stretches(end_step):
        assert found.stop is not None  # stretches() cuts each at end_step
        names = saved.phases[k].names
        out.append((found.first, found.stop, sample_shares(names, found.counts) or {names[0]: 1.0}))
    return out


def draw_shares(run: PhasedLoader, end_step: int, path: str | os.PathLike[str]) -> None:
    """Writes ``path`` (``.png`` or ``.svg``): each component's share of the
    tokens over steps ``[0, end_step)``, stacked, with phase boundaries, weight
    changes and skipped batches marked."""
    suffix = os.fspath(path).rsplit(".", 1)[-1].lower()
    if suffix not in ("png", "svg"):
        raise ValueError(f"--picture {os.fspath(path)!r}: name a .png or .svg file")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError(f"the picture needs matplotlib: {install_hint('plot')}") from None
    segments = share_segments(run, end_step)
    names = list(dict.fromkeys(n for _, _, shares in segments for n in shares))
    xs: list[int] = []
    ys: dict[str, list[float]] = {n: [] for n in names}
    for a, b, shares in segments:
        xs += [a, b]
        for n in names:
            ys[n] += [shares.get(n, 0.0)] * 2
    fig, ax = plt.subplots(figsize=(10, 4))
    ax.stackplot(xs, *[ys[n] for n in names], labels=names)
    for k, first in enumerate(run.firsts):
        if first < end_step:
            ax.axvline(first, color="black", linewidth=0.8)
            label = run.phases[k].name or f"phase {k}"
            ax.text(first, 1.01, label, fontsize=8, va="bottom")
    state = run.saved_state()
    changes = [t for t, _ in state.weights if t < end_step]
    for i, t in enumerate(changes):  # one legend entry for them all ("_": none)
        label = "weight change" if i == 0 else "_weight change"
        ax.axvline(t, color="black", linestyle="--", linewidth=0.8, label=label)
    skips = [(s, count) for s, count in state.skips if s < end_step]
    for i, (s, count) in enumerate(skips):
        label = "skipped batches" if i == 0 else "_skipped batches"
        ax.axvline(s, color="red", linestyle=":", linewidth=1.2, label=label)
        ax.text(s, 0.02, f" skip {count}", color="red", fontsize=8, rotation=90)
    ax.set_xlim(0, end_step)
    ax.set_ylim(0, 1)
    ax.set_xlabel("step (a skip: the data jumps ahead there)" if skips else "step")
    ax.set_ylabel("share of tokens")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def counterpart(loader: StepEngine) -> StepEngine:
    """``loader``'s source and config under the other shuffle: blocks become the
    full shuffle; full (or none) become blocks at the default block and window."""
    config = loader.config
    if config.shuffle == BLOCKS:
        other = dataclasses.replace(config, shuffle=True, shuffle_block=None, shuffle_window=1)
    else:
        other = dataclasses.replace(config, shuffle=BLOCKS)
    return Loader(loader.records, other).engine


def _si(value: float, unit: str) -> str:
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= scale:
            return f"{value / scale:,.3g} {prefix}{unit}"
    return f"{value:,.3g} {unit}"


def _label(counts: RequestCounts) -> str:
    if counts.block is None:
        return counts.shuffle
    sizes = ",".join(str(b) for b in sorted(set(counts.block)))
    return f"blocks B={sizes} w={counts.window or 1}"


def aligned(rows: Sequence[Sequence[str]], left: int) -> list[str]:
    """``rows`` of cells as lines in columns, the first ``left`` flush left."""
    widths = [max(map(len, column)) for column in zip(*rows, strict=True)]
    return [
        "  ".join(
            v.ljust(w) if i < left else v.rjust(w)
            for i, (v, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in rows
    ]


def request_table(counts: Sequence[RequestCounts], labels: Sequence[str]) -> list[str]:
    """:func:`~.requestcount.count_requests` results as text: a line each, in columns."""
    head = (
        "shuffle",
        "requests/step",
        "requests/s",
        "bytes/s",
        "useful bytes/s",
        "bytes/useful token",
        "first step requests",
        "fresh GCS bucket throttles",
    )
    cells = [
        (
            name,
            f"{p.requests_per_second * p.step_seconds:,.0f}",
            f"{p.requests_per_second:,.0f}",
            _si(p.bytes_per_second, "B"),
            _si(p.useful_bytes_per_second, "B"),
            f"{p.bytes_per_token:.1f}",
            f"{p.first_step_requests:,}",
            f"{p.ramp_minutes:.0f} min",
        )
        for name, p in zip(labels, counts, strict=True)
    ]
    return aligned([head, *cells], left=1)


MAX_SAMPLE_STEPS = 4096  # most --sample-steps: the sampler runs once a step
MAX_SAMPLED_ROWS = 1 << 22  # most rows of a phase's sampled steps: a few int64 each


def sampled_steps(
    run: PhasedLoader, sample_steps: int, end_step: int | None = None
) -> tuple[list[int], list[str]]:
    """How many steps of each phase of ``run`` a preview samples: ``sample_steps``,
    or fewer where the phase ends before, and a note for each phase cut."""
    sample_steps = integer(sample_steps, "--sample-steps", low=1, high=MAX_SAMPLE_STEPS)
    counts, notes = [], []
    assert run.end_step is not None  # a PhasedLoader's
    for k, loader in enumerate(run.engines):
        start = run.firsts[k]
        ends = [(run.end_step, "the run can read no step from there")]
        if k + 1 < len(run.firsts):
            ends.append((run.firsts[k + 1], f"{run.label(k + 1)} starts there"))
        if end_step is not None:
            ends.append((end_step, "the run ends there"))
        if loader.num_batches is not None:
            ends.append((start + loader.num_batches, "its epochs end there"))
        stop, why = min(ends)
        count = min(sample_steps, max(stop - start, 0))
        if count < sample_steps:
            sampled = f"its steps 0 to {count - 1}" if count else "none of its steps"
            notes.append(
                f"--sample-steps {sample_steps} is past the end of {run.label(k)}: sampled "
                f"{sampled} ({why}, at step {stop})"
            )
        counts.append(count)
    pairs = zip(run.engines, counts, strict=True)
    over = [(m, k) for k, (loader, n) in enumerate(pairs) if (m := _most_steps(loader, n)) < n]
    if over:
        most, k = min(over)
        fix = f"give --sample-steps {most} or fewer" if most else "its first step alone does"
        raise ValueError(
            f"--sample-steps {sample_steps}: the steps sampled of {run.label(k)} would hold "
            f"more than {MAX_SAMPLED_ROWS:,} rows, the most a preview reads: {fix}"
        )
    return counts, notes


def _most_steps(loader: StepEngine, steps: int) -> int:
    """How many of the first ``steps`` steps fit in :data:`MAX_SAMPLED_ROWS` rows."""
    rows = 0
    for step in range(steps):
        rows += loader.steps.size(step)
        if rows > MAX_SAMPLED_ROWS:
            return step
    return steps


def preview_requests(
    run: PhasedLoader,
    hosts: int,
    step_seconds: float,
    sample_steps: int,
    name: str,
    end_step: int | None = None,
) -> list[str]:
    """``flat-tokens preview --requests``: :func:`request_table` of each phase of
    ``run`` (from the file ``name``) at its first steps, as configured (marked
    ``*``) and under the other shuffle, full first, then what it assumed."""
    try:
        counts, notes = sampled_steps(run, sample_steps, end_step)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None
    lines = []
    for k, loader in enumerate(run.engines):
        if not counts[k]:
            continue
        steps = range(counts[k])
        try:
            both = [count_requests(loader, hosts, step_seconds, steps)]
            both.append(count_requests(counterpart(loader), hosts, step_seconds, steps))
        except ValueError as e:
            told = str(e)
            told = f"--{told}" if told.startswith("hosts:") else told  # the flag that set it
            raise ValueError(f"{name}: {run.label(k)}: {told}") from None
        labels = [_label(both[0]) + " *", _label(both[1])]
        if both[0].shuffle == BLOCKS:
            both, labels = both[::-1], labels[::-1]
        if len(run.engines) > 1:
            lines.append(f"{run.label(k)}:")
        lines += request_table(both, labels)
    fewer = " (fewer where noted below)" if notes else ""
    return [
        *lines,
        f"{hosts:,} hosts, {step_seconds:g} s a step, from steps 0 to {sample_steps - 1} of "
        f"each phase{fewer}; a fresh GCS bucket serves {GCS_INITIAL_READS:,} reads/s, "
        f"doubling every {GCS_DOUBLING_MINUTES} minutes at most",
        "* the run as configured; the other row is the same run under the other shuffle "
        "(shuffle='blocks' at the default block and window, or shuffle=True)",
        "blocks: each host reads a block whole, once per epoch; the first sampled step reads "
        "each lane's first block (first step requests), left out of the rates",
        *notes,
    ]
