"""The grain adapter: ``FlatTokensSource``, also
importable from here (``from flat_tokens_jax.grain import FlatTokensSource``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flat_tokens_jax.grain.grain import FlatTokensSource

__all__ = ["FlatTokensSource"]


def __getattr__(name: str) -> Any:
    # On first use (docs/design.md): importing one module of this package, which
    # runs this file first, then imports no other.
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module("flat_tokens_jax.grain.grain"), name)
