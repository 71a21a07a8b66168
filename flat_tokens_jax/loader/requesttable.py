"""``flat-tokens plan --requests``'s table: a run's reads under both shuffles.

For each phase of a run, :func:`run_table` plans the loader as configured
and its :func:`counterpart` under the other shuffle (a full or no shuffle
beside the block shuffle at the default block and window; a block shuffle
beside the full shuffle), with :func:`~.requestplan.plan_requests`, and
prints them one row each, side by side.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from flat_tokens_jax.core.fields import BLOCKS
from flat_tokens_jax.loader.loader import Loader
from flat_tokens_jax.loader.phasedloader import PhasedLoader
from flat_tokens_jax.loader.requestplan import (
    GCS_DOUBLING_MINUTES,
    GCS_INITIAL_READS,
    RequestPlan,
    plan_requests,
)

__all__ = ["counterpart", "request_table", "run_table"]


def counterpart(loader: Loader) -> Loader:
    """``loader``'s source and config under the other shuffle: a block
    shuffle's under the full shuffle; a full (or no) shuffle's under
    ``shuffle="blocks"`` at the default block (``shuffle_block=None``) and
    window (1)."""
    config = loader.config
    if config.shuffle == BLOCKS:
        other = dataclasses.replace(config, shuffle=True, shuffle_block=None, shuffle_window=1)
    else:
        other = dataclasses.replace(config, shuffle=BLOCKS)
    return Loader(loader.records, other)


def _si(value: float, unit: str) -> str:
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= scale:
            return f"{value / scale:,.3g} {prefix}{unit}"
    return f"{value:,.3g} {unit}"


def _label(plan: RequestPlan) -> str:
    if plan.block is None:
        return plan.shuffle
    sizes = ",".join(str(b) for b in sorted(set(plan.block)))
    return f"blocks B={sizes} w={plan.window or 1}"


def request_table(plans: Sequence[RequestPlan], labels: Sequence[str] | None = None) -> list[str]:
    """:func:`~.requestplan.plan_requests` results as text: a line each, in
    columns, each named by its shuffle (``blocks B=... w=...`` with its
    block and window) or by ``labels``."""
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
    names = [_label(p) for p in plans] if labels is None else list(labels)
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
        for name, p in zip(names, plans, strict=True)
    ]
    widths = [max(len(row[i]) for row in [head, *cells]) for i in range(len(head))]
    return [
        "  ".join(
            v.ljust(w) if i == 0 else v.rjust(w)
            for i, (v, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in [head, *cells]
    ]


def run_table(
    run: PhasedLoader, hosts: int, step_seconds: float, steps: Sequence[int], name: str
) -> list[str]:
    """``flat-tokens plan --requests``: :func:`request_table` of each phase of
    ``run`` (read from the file ``name``) at its ``steps``, as configured
    (marked ``*``) and under the other shuffle (:func:`counterpart`), rows
    full first, and what it assumed.

    Raises:
        ValueError: as :func:`~.requestplan.plan_requests`, naming the file,
            the phase and the ``--hosts`` flag where the host count is wrong.
    """
    lines = []
    for k, loader in enumerate(run.loaders):
        try:
            plans = [plan_requests(loader, hosts, step_seconds, steps)]
            plans.append(plan_requests(counterpart(loader), hosts, step_seconds, steps))
        except ValueError as e:
            told = str(e)
            told = f"--{told}" if told.startswith("hosts:") else told  # the flag that set it
            raise ValueError(f"{name}: {run.label(k)}: {told}") from None
        labels = [_label(plans[0]) + " *", _label(plans[1])]
        if plans[0].shuffle == BLOCKS:
            plans, labels = plans[::-1], labels[::-1]
        if len(run.loaders) > 1:
            lines.append(f"{run.label(k)}:")
        lines += request_table(plans, labels)
    return [
        *lines,
        f"{hosts:,} hosts, {step_seconds:g} s a step, from steps {steps[0]} to {steps[-1]} of "
        f"each phase; a fresh GCS bucket serves {GCS_INITIAL_READS:,} reads/s, doubling every "
        f"{GCS_DOUBLING_MINUTES} minutes at most",
        "* the run as configured; the other row is the same run under the other shuffle "
        "(shuffle='blocks' at the default block and window, or shuffle=True)",
        "blocks: each host reads a block whole, once per epoch; the first sampled step reads "
        "each lane's first block (first step requests), left out of the rates",
    ]
