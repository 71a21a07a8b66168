"""Storage: store options, tensorstore and memory-mapped reads, probes, digests,
the dataset's identity and layout, claims on a location.

The names of :mod:`flat_tokens_jax.store.store` are this package's too
(``from flat_tokens_jax.store import Store``), imported on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from flat_tokens_jax.core.namesake import namesake_getattr

if TYPE_CHECKING:
    from flat_tokens_jax.store.store import Store, remote_bytes, remote_reads

__all__ = ["Store", "remote_bytes", "remote_reads"]


__getattr__ = namesake_getattr(__name__, globals())
