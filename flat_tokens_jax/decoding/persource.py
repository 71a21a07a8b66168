"""Per-token values (a loss) summed by each row's data source, inside ``jax.jit``,
with no gather or scatter, so a batch sharded over its rows reduces as any sum does."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from flat_tokens_jax.core.values import integer


def per_source(
    values: Any, batch: Mapping[str, Any], num_sources: int, weights: Any = None
) -> tuple[jax.Array, jax.Array]:
    """Sums of per-token ``values`` and their counts, by the source of each row.

    Args:
        values: ``[B, L]`` one value a token, aligned with the batch's targets
            (e.g. each token's cross-entropy).
        batch: the batch, with ``source`` ``[B] int32`` and ``loss_mask``
            ``[B, L] bool`` (the ``"maxtext"`` layout: ``targets_segmentation``,
            a token counted where it is not 0).
        num_sources: ``len(loader.source_names)``; a Python int (static under
            ``jax.jit``).
        weights: ``[B, L]`` the tokens' weights, instead of the batch's loss mask.

    Returns:
        ``(sums, counts)``, each ``[num_sources]``: ``sums[s]`` the sum of
        ``values * weights`` over the rows of source ``s`` (at least
        ``float32``), ``counts[s]`` the sum of their weights (``int32`` for a
        mask). Padding rows (source ``-1``) count nowhere. Under ``jax.jit`` a
        source id out of range makes every sum NaN (docs/guide/trainers.md).

    Raises:
        ValueError: the batch lacks a field, the shapes disagree, or a concrete
            ``source`` holds an id no source has.

    Example:
        >>> batch = {
        ...     "source": jnp.array([1, 0, -1]),
        ...     "loss_mask": jnp.array([[True, True], [True, False], [False, False]]),
        ... }
        >>> sums, counts = per_source(jnp.array([[1.0, 2.0], [4.0, 8.0], [0.0, 0.0]]), batch, 2)
        >>> sums.tolist(), counts.tolist()
        ([4.0, 3.0], [1, 2])
        >>> values = jnp.ones((3, 2))
        >>> try:
        ...     per_source(values, batch, 1)
        ... except ValueError as e:
        ...     print(str(e).split(":")[0])
        batch['source'] holds source 1, but num_sources is 1
        >>> sums, counts = jax.jit(per_source, static_argnums=2)(values, batch, 1)
        >>> sums.tolist(), counts.tolist()
        ([nan], [1])
    """
    num_sources = integer(num_sources, "num_sources", low=1)
    if "source" not in batch:
        raise ValueError(
            f"the batch holds no source (its keys: {sorted(batch)}): "
            "load it with LoaderConfig(source_field=True)"
        )
    source = jnp.asarray(batch["source"])
    tokens = jnp.asarray(values)
    w = jnp.asarray(_weights(batch) if weights is None else weights)
    if tokens.ndim != 2 or w.shape != tokens.shape or source.shape != tokens.shape[:1]:
        raise ValueError(
            f"values must be [B, L] with weights of the same shape and source [B]: got "
            f"values {tokens.shape}, weights {w.shape}, source {source.shape}"
        )
    if not isinstance(source, jax.core.Tracer):
        _check_ids(source, num_sources)
    dtype = jnp.result_type(tokens.dtype, w.dtype, jnp.float32)
    count_dtype = jnp.int32 if w.dtype == jnp.bool_ else jnp.result_type(w.dtype, jnp.float32)
    row_sums = jnp.sum(tokens.astype(dtype) * w.astype(dtype), axis=1)
    row_counts = jnp.sum(w, axis=1, dtype=count_dtype)
    ids = jnp.arange(num_sources, dtype=source.dtype)
    of = source[:, None] == ids[None, :]  # [B, num_sources]; -1 matches no source
    sums = jnp.sum(jnp.where(of, row_sums[:, None], 0), axis=0, dtype=dtype)
    counts = jnp.sum(jnp.where(of, row_counts[:, None], 0), axis=0, dtype=count_dtype)
    # Traced ids are checked only when the step runs: NaN rather than short sums.
    stray = jnp.any((source < -1) | (source >= num_sources))
    return jnp.where(stray, jnp.nan, sums), counts


def _check_ids(source: jax.Array, num_sources: int) -> None:
    """Refuses a concrete ``source`` with an id no bucket of ``num_sources`` holds."""
    if source.size == 0:
        return
    high, low = int(jnp.max(source)), int(jnp.min(source))
    if high >= num_sources:
        raise ValueError(
            f"batch['source'] holds source {high}, but num_sources is {num_sources}: its "
            f"rows would count nowhere; pass num_sources=len(loader.source_names) (at "
            f"least {high + 1})"
        )
    if low < -1:
        raise ValueError(
            f"batch['source'] holds {low}, which is no source: a source is an index in "
            "loader.source_names, or -1 for a padding row (the batch's source of "
            "LoaderConfig(source_field=True))"
        )


def _weights(batch: Mapping[str, Any]) -> Any:
    """The batch's weight of each token: ``loss_mask``, else ``targets_segmentation != 0``."""
    if "loss_mask" in batch:
        return batch["loss_mask"]
    if "targets_segmentation" in batch:
        return jnp.asarray(batch["targets_segmentation"]) != 0
    raise ValueError(
        f"the batch holds neither loss_mask nor targets_segmentation (its keys: "
        f"{sorted(batch)}): pass weights=[B, L]"
    )
