"""Batches of a run: ``LoaderConfig``, ``Loader``, read-ahead, resume and
phases.

The names of :mod:`flat_tokens_jax.loader.loader` are this package's too
(``from flat_tokens_jax.loader import Loader``), imported on first use.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flat_tokens_jax.loader.loader import Loader, StateMismatch

__all__ = ["Loader", "StateMismatch"]


def __getattr__(name: str) -> Any:
    """A submodule, or a name of :mod:`flat_tokens_jax.loader.loader`, imported on first use."""
    if name.startswith("__") or not name.isidentifier():
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")
    value = getattr(importlib.import_module("flat_tokens_jax.loader.loader"), name)
    globals()[name] = value
    return value
