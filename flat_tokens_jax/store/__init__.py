"""Storage: store options, tensorstore and memory-mapped reads, integrity checks,
the dataset's identity and storage format, claims on a location; and the counts
of requests and bytes read from object stores (``remote_reads()``, ...).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flat_tokens_jax.store.store import remote_bytes, remote_reads, throttled_requests

__all__ = ["remote_bytes", "remote_reads", "throttled_requests"]


def __getattr__(name: str) -> Any:
    # On first use (docs/design.md): importing one module of this package, which
    # runs this file first, then imports no other.
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module("flat_tokens_jax.store.store"), name)
