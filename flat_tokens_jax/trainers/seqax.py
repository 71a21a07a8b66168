"""seqax's :func:`get_loader` (MatX-inc/seqax 42cf9af, ``input_loader.py``) on a flat-tokens
loader: docs/guide/trainers.md, "A step-indexed trainer"."""

from __future__ import annotations

import logging
from typing import Any

import jax

from flat_tokens_jax.data.dataset import open_dataset
from flat_tokens_jax.loader.config import LoaderConfig
from flat_tokens_jax.loader.loader import Loader

log = logging.getLogger(__name__)


class StepLoader:
    """seqax's loader (``load(step)``, ``max_token_id``) with the loader's ``state(step)``
    and ``restore(state)``, saved and restored with the model."""

    def __init__(self, loader: Loader, max_token_id: int) -> None:
        self.loader, self.max_token_id = loader, max_token_id
        self.state, self.restore = loader.state, loader.restore

    def load(self, step: int) -> dict[str, jax.Array]:
        """The global batch at ``step``, ``sequence_start`` seqax's ``is_seq_start``."""
        return self.loader.batch(step)


def get_loader(
    split: str,
    config: Any,
    token_batch_params: Any,
    sharding: jax.sharding.Sharding | None = None,
) -> StepLoader:
    """``split`` of the store ``config.filespec`` (seqax's ``FlatTokensParams``), block-shuffled;
    seqax shards its batch over the mesh's ``"d"`` axis: pass that ``sharding``."""
    log.info("seqax settings flat_tokens_jax does not use: streams=%r", config.streams)
    ft = open_dataset(config.filespec)[split]
    loader_config = LoaderConfig(
        token_batch_params.batch,
        token_batch_params.len,
        packing=config.sequence_packing,
        shuffle="blocks",
        seed=config.seed,
        shuffle_block=config.sequences_per_read_block,
        shuffle_window=config.read_blocks_per_shuffle_buffer,
        sequence_start=True,
    )
    return StepLoader(Loader(ft, loader_config, sharding), ft.max_token_id)
