"""Runs in phases: ``Phase``, and the arithmetic of streams across phases.

A run is a list of phases; phase ``k`` starts at step ``start_step`` and has
its own source (a split or a ``Mixture``) and ``LoaderConfig``. Inside a
phase, steps count from the phase's start: its batch-size schedule and its
mixture's weight schedule see the phase's first step as step 0.

A *stream* is one sequence of records: a split's records of one kind
(packing, ``seq_len``) read under one seed and shuffle. A stream that appears
in several phases, or comes back after an absence, continues where the
earlier phases left it: its samples drawn in earlier phases are counted at
each boundary (whole weight periods plus a prefix, as a weight schedule
counts), so the count costs O(weight segments) per phase, once, and a step
costs the same at step 10**12 as at step 1. A stream keeps the shuffle key of
the phase it first appears in. Pure arithmetic, no I/O.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from flat_tokens_jax.core import fields
from flat_tokens_jax.data.dataset import FlatTokens
from flat_tokens_jax.data.records import Records, check_source
from flat_tokens_jax.loader.config import LoaderConfig
from flat_tokens_jax.sampling.mixture import Mixture
from flat_tokens_jax.sampling.schedule import BatchSchedule
from flat_tokens_jax.sampling.stepsamples import MAX_SAMPLE

__all__ = [
    "STREAM_FIELDS",
    "Phase",
    "check_phases",
    "drawn",
    "largest",
    "steps_within",
    "stream_key",
]


@dataclasses.dataclass(frozen=True)
class Phase:
    """One phase of a run: from ``start_step`` on, batches of ``source`` under ``config``.

    Attributes:
        start_step: the run's step where the phase begins (the first phase's is 0).
        source: a ``FlatTokens`` split, :class:`~flat_tokens_jax.data.records.Records`
            or a :class:`~flat_tokens_jax.Mixture`.
        config: the phase's batches; its batch-size schedule counts steps from
            ``start_step``.
        name: a label for messages and ``flat-tokens plan`` (default ``"phase K"``).
    """

    start_step: int
    source: FlatTokens | Records | Mixture
    config: LoaderConfig
    name: str | None = None

    def __post_init__(self) -> None:
        start = fields.step(self.start_step, "Phase.start_step")
        object.__setattr__(self, "start_step", start)  # numpy ints become Python ints
        if not isinstance(self.config, LoaderConfig):
            raise TypeError(
                f"Phase.config must be a LoaderConfig, got {type(self.config).__name__}: "
                "ftj.LoaderConfig(batch_size=..., seq_len=...)"
            )
        if not isinstance(self.source, Mixture):
            check_source(self.source, "Phase.source")
        if self.name is not None and (not isinstance(self.name, str) or not self.name):
            raise ValueError(f"Phase.name must be a non-empty string or None, got {self.name!r}")


def check_phases(phases: Sequence[Phase]) -> tuple[Phase, ...]:
    """The phases, checked: at least one, the first at step 0, starts strictly
    increasing; with several, no phase bounds its epochs.

    Raises:
        ValueError: naming the phase and the fix.
    """
    if isinstance(phases, Phase) or not isinstance(phases, Sequence) or not phases:
        raise ValueError(f"phases must be a non-empty list of Phase, got {phases!r}")
    for k, phase in enumerate(phases):
        if not isinstance(phase, Phase):
            raise TypeError(f"phases[{k}] must be a Phase, got {type(phase).__name__}")
    if phases[0].start_step != 0:
        raise ValueError(
            f"phases[0] starts at step {phases[0].start_step}: the first phase must start at 0"
        )
    for k, (a, b) in enumerate(itertools.pairwise(phases), start=1):
        if b.start_step <= a.start_step:
            raise ValueError(
                f"phases[{k}] starts at step {b.start_step}, not after phases[{k - 1}]'s "
                f"{a.start_step}: list phases by strictly increasing start_step"
            )
    if len(phases) > 1:
        for k, phase in enumerate(phases):
            if phase.config.num_epochs is not None:
                raise ValueError(
                    f"phases[{k}].config.num_epochs is {phase.config.num_epochs}: streams in "
                    "a run of several phases have no last epoch; set num_epochs=None"
                )
    return tuple(phases)


# The fields of a component's fingerprint that make its stream: the records
# cut from the data (kind, length, packing plan) and the data itself (counts,
# sampled digest, stored loss mask, tokenizer, content digest). Named one by one
# so that a field added to fingerprints for another purpose leaves every
# stream, and so where a phased run continues, as it was.
STREAM_FIELDS = (
    "records",
    "seq_len",
    "plan",
    "num_tokens",
    "num_sequences",
    "max_token_id",
    "loss_mask",
    "sample_digest",
    "tokenizer",
    "content",
)
# The ``records`` kinds whose fingerprints this library writes.
_OWN_RECORDS = ("packed", "padded", "bins")


def stream_key(data: Mapping[str, Any], config: LoaderConfig) -> str:
    """The identity of a stream: the :data:`STREAM_FIELDS` a component's
    ``fingerprint`` holds, with the config's seed and shuffle.

    Records of another kind (a ``Records`` of one's own) are identified by
    their whole fingerprint but its ``name``: only they know what it holds.
    """
    if data.get("records") in _OWN_RECORDS:
        identity = {k: data[k] for k in STREAM_FIELDS if k in data}
    else:
        identity = {k: v for k, v in data.items() if k != "name"}
    return json.dumps([identity, config.seed, config.shuffle], sort_keys=True)


def drawn(mixture: Mixture | None, schedule: BatchSchedule, steps: int) -> list[int]:
    """Samples of each component drawn in a phase's first ``steps`` steps.

    ``[K]`` Python ints (one without a mixture): whole weight periods plus the
    prefix of the last one, per weight segment.
    """
    total = schedule.samples_before(steps)
    if mixture is None:
        return [total]
    starts = [schedule.samples_before(int(s)) for s in mixture.steps]
    counts = np.zeros(len(mixture.names), dtype=object)
    for j, period in enumerate(mixture.periods):
        if starts[j] >= total:
            break
        end = total if j + 1 == len(starts) else min(total, starts[j + 1])
        whole, rest = divmod(end - starts[j], period.period)
        prefix = np.bincount(period.component[:rest], minlength=len(mixture.names))
        counts += [whole * int(n) + int(p) for n, p in zip(period.counts, prefix, strict=True)]
    return [int(n) for n in counts]


def steps_within(
    mixture: Mixture | None, schedule: BatchSchedule, offsets: Sequence[int], most: int
) -> int:
    """How many of a phase's first steps, up to ``most``, keep every sample
    index within ``2**63 - 1``: the phase's own (``schedule``'s samples) and
    each stream's (``offsets[c]``, its samples drawn before the phase, plus
    the phase's draws of component ``c``). A bisection over :func:`drawn`.
    """

    def fits(steps: int) -> bool:
        if schedule.samples_before(steps) - 1 > MAX_SAMPLE:
            return False
        counts = drawn(mixture, schedule, steps)
        return all(o + n - 1 <= MAX_SAMPLE for o, n in zip(offsets, counts, strict=True))

    return largest(fits, 0, most)


def largest(fits: Callable[[int], bool], low: int, high: int) -> int:
    """The largest ``x`` in ``[low, high]`` with ``fits(x)``, for a ``fits``
    true up to some point and false after it, and true at ``low``."""
    if fits(high):
        return high
    while high - low > 1:  # fits(low), not fits(high)
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low
