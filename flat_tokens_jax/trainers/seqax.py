"""seqax's data entry on a flat-tokens loader: :func:`get_loader` with seqax's signature
(MatX-inc/seqax 42cf9af, ``input_loader.py``), whose ``load(step)`` is a pure function
of the step, and the loader's state to save beside the model. docs/guide/trainers.md,
"seqax".
"""

from __future__ import annotations

import logging
from typing import Any

import jax

from flat_tokens_jax.data.dataset import open_dataset
from flat_tokens_jax.loader.config import LoaderConfig
from flat_tokens_jax.loader.loader import Loader

log = logging.getLogger(__name__)


class StepLoader:
    """seqax's loader: ``load(step)``, ``max_token_id``; and the loader's ``state(step)``
    and ``restore(state)`` (the step to resume at), saved and restored with the model."""

    def __init__(self, loader: Loader, max_token_id: int) -> None:
        self.loader, self.max_token_id = loader, max_token_id
        self.state, self.restore = loader.state, loader.restore

    def load(self, step: int) -> dict[str, jax.Array]:
        """The global batch at ``step``: ``targets`` (seqax's), ``sequence_start``
        (seqax's ``is_seq_start``), ``inputs``, ``segment_ids``, ``positions`` and
        ``loss_mask``, each ``[batch, len]``."""
        return self.loader.batch(step)


def get_loader(
    split: str,
    config: Any,
    token_batch_params: Any,
    sharding: jax.sharding.Sharding | None = None,
) -> StepLoader:
    """``split`` of the store ``config.filespec`` (seqax's ``FlatTokensParams``) in
    batches of ``token_batch_params.batch`` rows of ``.len`` tokens, block-shuffled
    by ``seed``: a read block of ``sequences_per_read_block`` records, a shuffle
    buffer of ``read_blocks_per_shuffle_buffer`` blocks. seqax shards its batch
    over the mesh's ``"d"`` axis: pass that ``sharding``. ``streams`` is not used
    (one log line): each host reads its own rows."""
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
