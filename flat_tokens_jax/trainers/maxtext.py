"""MaxText's grain iterators on a flat-tokens loader, with the signatures and config keys of
AI-Hypercomputer/maxtext e591f30 (``src/maxtext/input_pipeline/grain_data_processing.py``);
the keys read, ignored and refused: docs/guide/trainers.md, "MaxText"."""

from __future__ import annotations

import json
import logging
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from flat_tokens_jax.core.fields import Packing
from flat_tokens_jax.core.values import BadValue, choice, text
from flat_tokens_jax.data.dataset import open_dataset
from flat_tokens_jax.loader.config import LoaderConfig
from flat_tokens_jax.loader.loader import Loader
from flat_tokens_jax.sampling.mixture import Mixture

log = logging.getLogger(__name__)

# MaxText's settings of its own grain readers and workers; the loader reads ahead on threads.
_UNUSED = (
    "grain_file_type",
    "grain_worker_count",
    "grain_per_worker_buffer_size",
    "grain_num_threads",
    "grain_prefetch_buffer_size",
    "grain_shuffle_buffer_size",
    "grain_data_source_max_workers",
)
_REFUSED = ("colocated_python_data_input", "grain_use_elastic_iterator", "use_dpo", "use_sft")
_PACKING = {
    "first_fit": Packing.BINS,
    "best_fit": Packing.BINS,
    "concat_then_split": Packing.WINDOWS,
}


class MultiHostDataLoadIterator:
    """MaxText's iterator: ``local_iterator`` (the grain iterator orbax saves) and ``next()``,
    the next step as global ``jax.Array``\\ s, ``[global batch, max_target_length] int32``;
    past the end, with ``generate_padding_batch``, zeros. ``iter()`` starts again."""

    def __init__(self, loader: Loader, generate_padding_batch: bool) -> None:
        self.loader, self.dataset = loader, loader.to_grain()
        self.generate_padding_batch = generate_padding_batch
        self.reset()

    def reset(self) -> None:
        self.local_iterator = iter(self.dataset)
        self.last: dict[str, np.ndarray] | None = None

    def __iter__(self) -> MultiHostDataLoadIterator:
        self.reset()
        return self

    def __next__(self) -> dict[str, jax.Array]:
        try:
            local = next(self.local_iterator)  # {field: [this host's rows, max_target_length]}
        except StopIteration:
            if not self.generate_padding_batch or self.last is None:
                raise
            local = {k: np.zeros_like(v) for k, v in self.last.items()}
        self.last = local
        sharding = self.loader.sharding
        return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in local.items()}


def make_grain_train_iterator(
    config: Any, global_mesh: Mesh, process_indices: Any
) -> MultiHostDataLoadIterator:
    """``grain_train_files`` (or ``grain_train_mixture_config_path``), for ``num_epoch`` epochs."""
    source = _source(config, "grain_train_files", "train")
    shuffle = config.enable_data_shuffling
    return _iterator(config, global_mesh, source, shuffle, config.num_epoch, "")


def make_grain_eval_iterator(
    config: Any, global_mesh: Mesh, process_indices: Any
) -> MultiHostDataLoadIterator:
    """``grain_eval_files`` in order, once, the last batch padded (``targets_segmentation`` 0)."""
    source = _source(config, "grain_eval_files", "validation")
    return _iterator(config, global_mesh, source, False, 1, "_eval")


def _source(config: Any, key: str, split: str) -> Any:
    """The split of one store, or a Mixture of MaxText's ``"path,weight;path,weight"`` or JSON;
    first, the keys the adapter cannot honour are refused."""
    for name in _REFUSED:
        if getattr(config, name, False):
            raise BadValue(name, "must be False with flat_tokens_jax's MaxText iterators")
    if getattr(config, "expansion_factor_real_data", -1) not in (-1, 1):
        raise BadValue("expansion_factor_real_data", "must be -1: every host loads its rows")
    named = getattr(config, "grain_train_mixture_config_path", "") if split == "train" else ""
    if named:
        with open(named) as f:
            parts = [(n, c["path"], c["weight"]) for n, c in json.load(f).items()]
    elif ";" in getattr(config, key):
        parts = []
        for k, part in enumerate(getattr(config, key).split(";")):
            path, _, weight = part.rpartition(",")
            try:
                parts.append((text(path, key), path, float(weight)))
            except ValueError:
                form = "'path,weight;path,weight'"
                raise BadValue(key, f"must be {form}, got part {k} {part!r}") from None
    else:
        return open_dataset(getattr(config, key))[split]
    return Mixture({n: (open_dataset(path)[split], w) for n, path, w in parts})


def _iterator(
    config: Any, mesh: Mesh, source: Any, shuffle: bool, epochs: int | None, suffix: str
) -> MultiHostDataLoadIterator:
    keys = [u + suffix if hasattr(config, u + suffix) else u for u in _UNUSED]
    unused = [f"{k}={getattr(config, k)!r}" for k in keys if hasattr(config, k)]
    if unused:
        log.info("MaxText settings flat_tokens_jax does not use: %s", ", ".join(unused))
    packing = choice(
        getattr(config, "grain_packing_type", "first_fit"), "grain_packing_type", list(_PACKING)
    )
    loader_config = LoaderConfig(
        batch_size=getattr(config, "global_batch_size_to_load" + suffix),
        seq_len=config.max_target_length,
        packing=_PACKING[packing] if config.packing else Packing.PADDED,
        shuffle=shuffle,
        seed=config.data_shuffle_seed,
        num_epochs=epochs,
        vocab_size=getattr(config, "vocab_size", None),
        layout="maxtext",
    )
    spec = PartitionSpec(*getattr(config, "data_sharding", [mesh.axis_names]))
    loader = Loader(source, loader_config, NamedSharding(mesh, spec))
    padding = getattr(config, "generate_padding_batch" + (suffix or "_train"), False)
    return MultiHostDataLoadIterator(loader, padding)
