"""The grain adapter: ``FlatTokensSource`` and ``ScheduledBatches``.

The names of :mod:`flat_tokens_jax.grain.grain` are this package's too
(``from flat_tokens_jax.grain import FlatTokensSource``), imported on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from flat_tokens_jax.core.namesake import namesake_getattr

if TYPE_CHECKING:
    from flat_tokens_jax.grain.grain import FlatTokensSource, ScheduledBatches

__all__ = ["FlatTokensSource", "ScheduledBatches"]


__getattr__ = namesake_getattr(__name__, globals())
