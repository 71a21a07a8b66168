"""flat_tokens_jax: feed JAX language-model training from flat-tokens stores.

Each public name is imported on first use (``ftj.Loader``), so ``import
flat_tokens_jax`` costs almost nothing and a program imports only the modules
(and jax, tensorstore) that it uses.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flat_tokens_jax.core.fields import Packing
    from flat_tokens_jax.core.format import FormatError, Problem, decode, encode
    from flat_tokens_jax.data.bins import BinRecords
    from flat_tokens_jax.data.dataset import Dataset, FlatTokens, open_dataset
    from flat_tokens_jax.decoding.instancefilter import InstanceFilter
    from flat_tokens_jax.decoding.layouts import zigzag_order
    from flat_tokens_jax.decoding.persource import per_source
    from flat_tokens_jax.loader.config import LoaderConfig
    from flat_tokens_jax.store.identity import DatasetInfo, TokenizerInfo

    __version__: str
    from flat_tokens_jax.data.plans import PackingPlan, pack_dataset
    from flat_tokens_jax.data.records import PackedRecords, PaddedRecords, Records
    from flat_tokens_jax.data.validation import summary, validate
    from flat_tokens_jax.data.writer import DatasetWriter, write_dataset
    from flat_tokens_jax.loader.loader import Loader
    from flat_tokens_jax.loader.phaseconfig import phases_from_config, phases_from_yaml
    from flat_tokens_jax.loader.phasedloader import PhasedLoader, steering_at
    from flat_tokens_jax.loader.phases import Phase
    from flat_tokens_jax.loader.state import StateMismatch
    from flat_tokens_jax.loader.steered import (
        apply_skips,
        skips_from_config,
        skips_from_yaml,
    )
    from flat_tokens_jax.sampling.mixconfig import mixture_from_config
    from flat_tokens_jax.sampling.mixture import Mixture
    from flat_tokens_jax.sampling.sampling import EpochsExhausted, IndexSampler, permute
    from flat_tokens_jax.sampling.schedule import BatchSchedule
    from flat_tokens_jax.store.location import OverwriteNeeded
    from flat_tokens_jax.store.options import StoreError, StoreOptions
    from flat_tokens_jax.store.storageformat import StorageFormat

# The module that defines each public name.
_HOMES = {
    "core.fields": ("Packing",),
    "core.format": ("FormatError", "Problem", "decode", "encode"),
    "data.bins": ("BinRecords",),
    "data.dataset": ("Dataset", "FlatTokens", "open_dataset"),
    "data.plans": ("PackingPlan", "pack_dataset"),
    "data.records": ("PackedRecords", "PaddedRecords", "Records"),
    "data.validation": ("summary", "validate"),
    "data.writer": ("DatasetWriter", "write_dataset"),
    "decoding.instancefilter": ("InstanceFilter",),
    "decoding.layouts": ("zigzag_order",),
    "decoding.persource": ("per_source",),
    "loader.config": ("LoaderConfig",),
    "loader.loader": ("Loader",),
    "loader.phaseconfig": ("phases_from_config", "phases_from_yaml"),
    "loader.phasedloader": ("PhasedLoader", "steering_at"),
    "loader.phases": ("Phase",),
    "loader.state": ("StateMismatch",),
    "loader.steered": ("apply_skips", "skips_from_config", "skips_from_yaml"),
    "sampling.mixconfig": ("mixture_from_config",),
    "sampling.mixture": ("Mixture",),
    "sampling.sampling": ("EpochsExhausted", "IndexSampler", "permute"),
    "sampling.schedule": ("BatchSchedule",),
    "store.identity": ("DatasetInfo", "TokenizerInfo", "library_version"),
    "store.location": ("OverwriteNeeded",),
    "store.options": ("StoreError", "StoreOptions"),
    "store.storageformat": ("StorageFormat",),
}
_HOME_OF = {name: home for home, names in _HOMES.items() for name in names}

__all__ = [
    "BatchSchedule",
    "BinRecords",
    "Dataset",
    "DatasetInfo",
    "DatasetWriter",
    "EpochsExhausted",
    "FlatTokens",
    "FormatError",
    "IndexSampler",
    "InstanceFilter",
    "Loader",
    "LoaderConfig",
    "Mixture",
    "OverwriteNeeded",
    "PackedRecords",
    "Packing",
    "PackingPlan",
    "PaddedRecords",
    "Phase",
    "PhasedLoader",
    "Problem",
    "Records",
    "StateMismatch",
    "StorageFormat",
    "StoreError",
    "StoreOptions",
    "TokenizerInfo",
    "apply_skips",
    "decode",
    "encode",
    "mixture_from_config",
    "open_dataset",
    "pack_dataset",
    "per_source",
    "permute",
    "phases_from_config",
    "phases_from_yaml",
    "skips_from_config",
    "skips_from_yaml",
    "steering_at",
    "summary",
    "validate",
    "write_dataset",
    "zigzag_order",
]


def __getattr__(name: str) -> Any:
    """A public name, ``__version__`` or a submodule, imported on first use."""
    home = _HOME_OF.get(name)
    if home is not None:
        value = getattr(importlib.import_module(f"flat_tokens_jax.{home}"), name)
    elif name == "__version__":
        value = importlib.import_module("flat_tokens_jax.store.identity").library_version()
    elif name.isidentifier() and not name.startswith("_") and _is_submodule(name):
        value = importlib.import_module(f"flat_tokens_jax.{name}")
    else:
        raise AttributeError(f"module 'flat_tokens_jax' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__, "__version__"})


def _is_submodule(name: str) -> bool:
    return importlib.util.find_spec(f"flat_tokens_jax.{name}") is not None
