"""Runs in phases: ``Phase``, and the arithmetic of streams across phases: the
samples each stream drew before a boundary, counted without a loop over steps
(what a stream is and how it continues: docs/guide/mixtures.md, "Runs in phases").
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections.abc import Mapping, Sequence
from typing import Any

from flat_tokens_jax.core import fields
from flat_tokens_jax.core.limits import largest
from flat_tokens_jax.data.dataset import FlatTokens
from flat_tokens_jax.data.records import Records, check_source
from flat_tokens_jax.loader.config import LoaderConfig
from flat_tokens_jax.sampling.mixture import Mixture
from flat_tokens_jax.sampling.steering import Steering
from flat_tokens_jax.sampling.stepsamples import MAX_SAMPLE


@dataclasses.dataclass(frozen=True)
class Phase:
    """One phase of a run: from ``start_step`` on (the first phase's is 0),
    batches of ``source`` (a split, ``Records`` or a ``Mixture``) under ``config``,
    whose batch-size schedule counts steps from ``start_step``. ``name``: a
    label for messages and ``flat-tokens preview`` (default ``"phase K"``).
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
    increasing; with several, no phase bounds its epochs."""
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
    ``fingerprint`` holds, with the config's seed and shuffle (with
    ``shuffle="blocks"``, its ``shuffle_block``, ``shuffle_window`` and lanes).

    Records of another kind (a ``Records`` of one's own) are identified by
    their whole fingerprint but its ``name``: only they know what it holds.
    """
    if data.get("records") in _OWN_RECORDS:
        identity = {k: data[k] for k in STREAM_FIELDS if k in data}
    else:
        identity = {k: v for k, v in data.items() if k != "name"}
    order: Any = config.shuffle
    if order == fields.BLOCKS:
        # What orders a block-shuffled stream's samples: a phase that changes
        # them reads another stream (each epoch stays a permutation).
        order = [order, config.shuffle_block, config.shuffle_window, config.lanes]
    return json.dumps([identity, config.seed, order], sort_keys=True)


def drawn(steering: Steering, steps: int) -> list[int]:
    """``[K]`` samples of each component drawn in a phase's first ``steps`` data steps."""
    return steering.drawn(steering.schedule.samples_before(steps))


def steps_within(steering: Steering, offsets: Sequence[int], most: int) -> int:
    """How many of a phase's first data steps, up to ``most``, keep every sample
    index within ``2**63 - 1``: the phase's own and each stream's (``offsets[c]``
    drawn before the phase)."""

    def fits(steps: int) -> bool:
        if steering.schedule.samples_before(steps) - 1 > MAX_SAMPLE:
            return False
        counts = drawn(steering, steps)
        return all(o + n - 1 <= MAX_SAMPLE for o, n in zip(offsets, counts, strict=True))

    found = most if fits(most) else largest(fits, 0, most)
    assert found is not None  # no step draws no sample: fits(0)
    return found
