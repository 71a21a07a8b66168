"""Model fields from encoded tokens in jax ops, to decode on the accelerator.

The ``_jax`` twins of :mod:`~flat_tokens_jax.decoding.batch`'s numpy decoders: the same
five fields with the same values, computed inside ``jax.jit`` with static
shapes (see that module for what the fields are).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.typing import ArrayLike


def packed_fields_jax(
    windows: ArrayLike,
    *,
    start_token_id: ArrayLike = 0,
    stored_mask: ArrayLike | None = None,
) -> dict[str, jax.Array]:
    """``packed_fields`` in jax ops, to decode on the accelerator inside ``jax.jit``.

    Static shapes throughout. Segment ids and positions come from ``lax.cumsum``
    and ``lax.cummax`` along each row, so shard the batch axis only, not the
    sequence axis. On the CPU backend these scans are slow (~10x
    ``packed_fields``); use it where the batch is decoded on a GPU or TPU.

    Args:
        windows: ``[batch, seq_len + 1] uint32`` encoded tokens, as for
            ``packed_fields``.
        start_token_id: the input where a sequence starts (may be traced).
        stored_mask: optional ``[batch, seq_len]`` stored loss mask.

    Returns:
        The same five fields with the same values as ``packed_fields``.
    """
    w = _encoded_jax(windows, "windows", min_cols=2)
    encoded = w[:, 1:]
    shape = encoded.shape
    starts = (encoded & 1) == 1
    targets = (encoded >> 1).astype(jnp.int32)
    before = (w[:, :-1] >> 1).astype(jnp.int32)
    inputs = jnp.where(starts, jnp.asarray(start_token_id, jnp.int32), before)
    counts = starts.astype(jnp.int32)
    # The first segment is 1 whether or not the row opens with a sequence start.
    segment_ids = lax.cumsum(counts, axis=1) + (1 - counts[:, :1])
    col = lax.broadcasted_iota(jnp.int32, shape, 1)
    positions = col - lax.cummax(jnp.where(starts, col, 0), axis=1)
    return {
        "inputs": inputs,
        "targets": targets,
        "segment_ids": segment_ids,
        "positions": positions,
        "loss_mask": _loss_mask_jax(stored_mask, shape),
    }


def padded_fields_jax(
    tokens: ArrayLike,
    lengths: ArrayLike,
    *,
    start_token_id: ArrayLike = 0,
    pad_id: ArrayLike = 0,
    stored_mask: ArrayLike | None = None,
) -> dict[str, jax.Array]:
    """``padded_fields`` in jax ops, to decode on the accelerator inside ``jax.jit``.

    Args:
        tokens: ``[batch, seq_len] uint32`` encoded tokens, as for ``padded_fields``.
        lengths: ``[batch]`` integer tokens kept per row; unlike ``padded_fields``
            they are not checked (they may be traced): keep them in ``[0, seq_len]``.
        start_token_id: the input at each row's first token.
        pad_id: the input and target at padding.
        stored_mask: optional ``[batch, seq_len]`` stored loss mask.

    Returns:
        The same five fields with the same values as ``padded_fields``.
    """
    tok = _encoded_jax(tokens, "tokens", min_cols=1)
    shape = tok.shape
    lens = jnp.asarray(lengths)
    if lens.shape != shape[:1]:
        raise ValueError(f"lengths must have shape {shape[:1]}, got {lens.shape}")
    col = lax.broadcasted_iota(jnp.int32, shape, 1)
    valid = col < lens[:, None].astype(jnp.int32)
    pad = jnp.asarray(pad_id, jnp.int32)
    targets = (tok >> 1).astype(jnp.int32)
    first = jnp.full((shape[0], 1), start_token_id, jnp.int32)
    inputs = jnp.concatenate([first, targets[:, :-1]], axis=1)
    return {
        "inputs": jnp.where(valid, inputs, pad),
        "targets": jnp.where(valid, targets, pad),
        "segment_ids": valid.astype(jnp.int32),
        "positions": jnp.where(valid, col, 0),
        "loss_mask": valid & _loss_mask_jax(stored_mask, shape),
    }


def bin_fields_jax(
    windows: ArrayLike,
    lengths: ArrayLike,
    *,
    start_token_id: ArrayLike = 0,
    pad_id: ArrayLike = 0,
    stored_mask: ArrayLike | None = None,
) -> dict[str, jax.Array]:
    """``bin_fields`` in jax ops (``lengths`` unchecked, may be traced)."""
    out = packed_fields_jax(windows, start_token_id=start_token_id, stored_mask=stored_mask)
    shape = out["targets"].shape
    valid = lax.broadcasted_iota(jnp.int32, shape, 1) < jnp.asarray(lengths)[:, None]
    fills = {"inputs": pad_id, "targets": pad_id}
    return {k: jnp.where(valid, v, jnp.asarray(fills.get(k, 0), v.dtype)) for k, v in out.items()}


def _encoded_jax(x: ArrayLike, name: str, min_cols: int) -> jax.Array:
    a = jnp.asarray(x)
    if a.ndim != 2 or a.shape[1] < min_cols:
        raise ValueError(f"{name} must be 2-D with at least {min_cols} column(s), got {a.shape}")
    if a.dtype != jnp.uint32:
        raise ValueError(f"{name} must hold uint32 encoded tokens, got dtype {a.dtype}")
    return a


def _loss_mask_jax(stored_mask: ArrayLike | None, shape: tuple[int, ...]) -> jax.Array:
    if stored_mask is None:
        return jnp.ones(shape, jnp.bool_)
    mask = jnp.asarray(stored_mask)
    if mask.shape != shape:
        raise ValueError(f"stored_mask must have shape {shape}, got {mask.shape}")
    return mask != 0
