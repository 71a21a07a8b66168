"""Which record each row reads: the stateless permutation, batch-size
schedules, mixtures and the samples of a step.

The names of :mod:`flat_tokens_jax.sampling.sampling` are this package's too
(``from flat_tokens_jax.sampling import EpochsExhausted``), imported on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from flat_tokens_jax.core.namesake import namesake_getattr

if TYPE_CHECKING:
    from flat_tokens_jax.sampling.sampling import EpochsExhausted, IndexSampler, permute

__all__ = ["EpochsExhausted", "IndexSampler", "permute"]


__getattr__ = namesake_getattr(__name__, globals())
