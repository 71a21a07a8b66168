"""flat_tokens_jax: feed JAX language-model training from flat-tokens stores."""

from flat_tokens_jax.bins import BinRecords
from flat_tokens_jax.config import LoaderConfig
from flat_tokens_jax.dataset import Dataset, FlatTokens, open_dataset
from flat_tokens_jax.format import FormatError, Problem, decode, encode
from flat_tokens_jax.identity import DatasetInfo, TokenizerInfo, library_version
from flat_tokens_jax.layout import Layout
from flat_tokens_jax.loader import Loader, StateMismatch
from flat_tokens_jax.location import OverwriteNeeded
from flat_tokens_jax.mixconfig import mixture_from_config
from flat_tokens_jax.mixture import Mixture
from flat_tokens_jax.options import StoreOptions
from flat_tokens_jax.phaseconfig import phases_from_config, phases_from_yaml
from flat_tokens_jax.phasedloader import PhasedLoader
from flat_tokens_jax.phases import Phase
from flat_tokens_jax.plans import PackingPlan, pack_dataset
from flat_tokens_jax.records import PackedRecords, PaddedRecords, Records
from flat_tokens_jax.sampling import EpochsExhausted, IndexSampler, permute
from flat_tokens_jax.schedule import BatchSchedule
from flat_tokens_jax.validation import summary, validate
from flat_tokens_jax.writer import DatasetWriter, write_dataset

__version__ = library_version()

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
