"""flat_tokens_jax: feed JAX language-model training from flat-tokens stores.

The names below are imported on first use (``ftj.Loader``, ``from flat_tokens_jax
import Loader``), so ``import flat_tokens_jax`` costs almost nothing and a
program imports only the modules, and the libraries behind them (jax,
tensorstore), that it uses.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flat_tokens_jax.bins import BinRecords
    from flat_tokens_jax.config import LoaderConfig
    from flat_tokens_jax.dataset import Dataset, FlatTokens, open_dataset
    from flat_tokens_jax.format import FormatError, Problem, decode, encode
    from flat_tokens_jax.identity import DatasetInfo, TokenizerInfo
    from flat_tokens_jax.instancefilter import InstanceFilter

    __version__: str
    from flat_tokens_jax.layout import Layout
    from flat_tokens_jax.loader import Loader, StateMismatch
    from flat_tokens_jax.location import OverwriteNeeded
    from flat_tokens_jax.mixconfig import mixture_from_config
    from flat_tokens_jax.mixture import Mixture
    from flat_tokens_jax.options import StoreError, StoreOptions
    from flat_tokens_jax.phaseconfig import phases_from_config, phases_from_yaml
    from flat_tokens_jax.phasedloader import PhasedLoader
    from flat_tokens_jax.phases import Phase
    from flat_tokens_jax.plans import PackingPlan, pack_dataset
    from flat_tokens_jax.records import PackedRecords, PaddedRecords, Records
    from flat_tokens_jax.sampling import EpochsExhausted, IndexSampler, permute
    from flat_tokens_jax.schedule import BatchSchedule
    from flat_tokens_jax.validation import summary, validate
    from flat_tokens_jax.writer import DatasetWriter, write_dataset

# Public name: the module that defines it.
_HOMES = {
    "BatchSchedule": "schedule",
    "BinRecords": "bins",
    "Dataset": "dataset",
    "DatasetInfo": "identity",
    "DatasetWriter": "writer",
    "EpochsExhausted": "sampling",
    "FlatTokens": "dataset",
    "FormatError": "format",
    "IndexSampler": "sampling",
    "InstanceFilter": "instancefilter",
    "Layout": "layout",
    "Loader": "loader",
    "LoaderConfig": "config",
    "Mixture": "mixture",
    "OverwriteNeeded": "location",
    "PackedRecords": "records",
    "PackingPlan": "plans",
    "PaddedRecords": "records",
    "Phase": "phases",
    "PhasedLoader": "phasedloader",
    "Problem": "format",
    "Records": "records",
    "StateMismatch": "loader",
    "StoreError": "options",
    "StoreOptions": "options",
    "TokenizerInfo": "identity",
    "decode": "format",
    "encode": "format",
    "library_version": "identity",
    "mixture_from_config": "mixconfig",
    "open_dataset": "dataset",
    "pack_dataset": "plans",
    "permute": "sampling",
    "phases_from_config": "phaseconfig",
    "phases_from_yaml": "phaseconfig",
    "summary": "validation",
    "validate": "validation",
    "write_dataset": "writer",
}

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
    "Layout",
    "Loader",
    "LoaderConfig",
    "Mixture",
    "OverwriteNeeded",
    "PackedRecords",
    "PackingPlan",
    "PaddedRecords",
    "Phase",
    "PhasedLoader",
    "Problem",
    "Records",
    "StateMismatch",
    "StoreError",
    "StoreOptions",
    "TokenizerInfo",
    "decode",
    "encode",
    "mixture_from_config",
    "open_dataset",
    "pack_dataset",
    "permute",
    "phases_from_config",
    "phases_from_yaml",
    "summary",
    "validate",
    "write_dataset",
]


def __getattr__(name: str) -> Any:
    """A public name, ``__version__`` or a submodule, imported on first use."""
    home = _HOMES.get(name)
    if home is not None:
        value = getattr(importlib.import_module(f"flat_tokens_jax.{home}"), name)
    elif name == "__version__":
        value = importlib.import_module("flat_tokens_jax.identity").library_version()
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
