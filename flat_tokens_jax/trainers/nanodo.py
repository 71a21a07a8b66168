"""nanodo's data entry points (google-deepmind/nanodo 8fd56f3, ``nanodo/data.py``) on a
flat-tokens loader: docs/guide/trainers.md, "nanodo"."""

from __future__ import annotations

import enum
import logging
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from flat_tokens_jax.core.fields import Packing
from flat_tokens_jax.core.values import BadValue, choice
from flat_tokens_jax.data.dataset import open_dataset
from flat_tokens_jax.loader.config import LoaderConfig
from flat_tokens_jax.loader.loader import Loader

log = logging.getLogger(__name__)


class Preprocess(enum.Enum):
    """nanodo's: a row is a window of the concatenated sequences, or one sequence, padded."""

    NOAM_PACKED = Packing.WINDOWS
    PADDED = Packing.PADDED


def py_batched_tfds(
    *,
    tfds_name: str,
    split: str,
    context_size: int,
    worker_count: int,
    vocab_path: str,
    batch_size: int,
    seed: int = 1234,
    num_epochs: int | None = None,
    num_records: int | None = None,
    preprocessing: Any = Preprocess.NOAM_PACKED,
    worker_buffer_size: int = 2,
    shuffle: bool = True,
    sharding: jax.sharding.Sharding | None = None,
) -> Any:
    """The steps of ``split`` of the store ``tfds_name``, a grain dataset of ``tokens``
    ``[batch_size, context_size + 1] int32`` and ``loss_mask`` ``[batch_size, context_size]
    bool``; every host gets every row, as nanodo's (with ``sharding``: its own rows)."""
    if num_records is not None:
        raise BadValue("num_records", f"must be None (the whole split), got {num_records!r}")
    log.info(
        "nanodo settings flat_tokens_jax does not use: worker_count=%r, "
        "worker_buffer_size=%r, vocab_path=%r (the data is tokenized)",
        *(worker_count, worker_buffer_size, vocab_path),
    )
    name = getattr(preprocessing, "name", preprocessing)
    kind = Preprocess[choice(name, "preprocessing", list(Preprocess.__members__))]
    config = LoaderConfig(
        batch_size,
        context_size,
        packing=kind.value,
        shuffle=shuffle,
        seed=seed,
        num_epochs=num_epochs,
        layout="tokens",
    )
    return Loader(open_dataset(tfds_name)[split], config, sharding).to_grain()


def get_in_out(in_BxL: Mapping[str, jax.Array]) -> tuple[jax.Array, jax.Array, jax.Array]:
    """nanodo's inputs, targets ``[batch, context_size]`` int32 and weights, float32 from
    ``loss_mask`` (not ``targets != pad_id``: id 0 is a real token)."""
    tokens = in_BxL["tokens"]
    return tokens[:, :-1], tokens[:, 1:], jnp.asarray(in_BxL["loss_mask"], jnp.float32)
