"""``flat-tokens preview --requests``'s table: each phase's reads as configured
beside its :func:`counterpart` under the other shuffle."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from flat_tokens_jax.core.fields import BLOCKS
from flat_tokens_jax.core.values import integer
from flat_tokens_jax.loader.engine import StepEngine
from flat_tokens_jax.loader.loader import Loader
from flat_tokens_jax.loader.phasedloader import PhasedLoader
from flat_tokens_jax.tools.requestcount import (
    GCS_DOUBLING_MINUTES,
    GCS_INITIAL_READS,
    RequestCounts,
    count_requests,
)


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
