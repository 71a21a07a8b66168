"""Batches of a run: ``LoaderConfig``, ``Loader``, read-ahead, resume and
phases.

The names of :mod:`flat_tokens_jax.loader.loader` are this package's too
(``from flat_tokens_jax.loader import Loader``), imported on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from flat_tokens_jax.core.namesake import namesake_getattr

if TYPE_CHECKING:
    from flat_tokens_jax.loader.loader import Loader

__all__ = ["Loader"]


__getattr__ = namesake_getattr(__name__, globals())
