"""Which record each row reads: the stateless permutation, batch-size
schedules, mixtures and the samples of a step.

The names of :mod:`flat_tokens_jax.sampling.sampling` are this package's too
(``from flat_tokens_jax.sampling import EpochsExhausted``), imported on first use.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flat_tokens_jax.sampling.sampling import EpochsExhausted, IndexSampler, permute

__all__ = ["EpochsExhausted", "IndexSampler", "permute"]


def __getattr__(name: str) -> Any:
    """A submodule, or a name of :mod:`flat_tokens_jax.sampling.sampling`, imported on first use."""
    if name.startswith("__") or not name.isidentifier():
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")
    value = getattr(importlib.import_module("flat_tokens_jax.sampling.sampling"), name)
    globals()[name] = value
    return value
