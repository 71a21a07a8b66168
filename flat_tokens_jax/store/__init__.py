"""Storage: store options, tensorstore and memory-mapped reads, probes, digests,
the dataset's identity and layout, claims on a location.

The names of :mod:`flat_tokens_jax.store.store` are this package's too
(``from flat_tokens_jax.store import Store``), imported on first use.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flat_tokens_jax.store.store import Store, remote_bytes, remote_reads

__all__ = ["Store", "remote_bytes", "remote_reads"]


def __getattr__(name: str) -> Any:
    """A submodule, or a name of :mod:`flat_tokens_jax.store.store`, imported on first use."""
    if name.startswith("__") or not name.isidentifier():
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")
    value = getattr(importlib.import_module("flat_tokens_jax.store.store"), name)
    globals()[name] = value
    return value
