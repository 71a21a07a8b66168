"""What a run says: ``LoaderConfig``, each field's check (:data:`FIELDS`), and
the checks of a config against its data.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax

from flat_tokens_jax.core import fields
from flat_tokens_jax.core.values import BadValue, boolean, choice, integer, known_keys
from flat_tokens_jax.core.yamlfile import read_yaml
from flat_tokens_jax.data.records import Records
from flat_tokens_jax.decoding.instancefilter import InstanceFilter
from flat_tokens_jax.decoding.layouts import (
    LAYOUTS,
    BatchLayout,
    check_context_parallel,
    check_max_segments,
)
from flat_tokens_jax.sampling.blocks import lanes
from flat_tokens_jax.sampling.schedule import BatchSchedule, BatchSizeSpec
from flat_tokens_jax.store.identity import recorded_tokenizers


@dataclasses.dataclass(frozen=True)
class LoaderConfig:
    """What a batch is. Every field but ``prefetch``, ``read_ahead_bytes``,
    ``block_cache_bytes``, ``decode_threads``, ``decode``, ``vocab_size``,
    ``layout``, ``max_segments``, ``sequence_start`` and ``source_field`` changes
    the batches' values (the last four change their form).

    Attributes:
        batch_size: global rows per step, over all hosts: an int, or a schedule
            ``[(start_step, size), ...]`` (or ``{start_step: size}``), e.g.
            ``[(0, 256), (2000, 512)]`` (docs/guide/mixtures.md, "Batch-size schedules").
        seq_len: tokens per row.
        packing: what a row is. True: consecutive windows of the concatenated
            tokens (no padding, sequences cut at window edges). False: one
            sequence per row, truncated to ``seq_len`` and right-padded with
            ``pad_id``. ``"bins"``: whole sequences (each truncated to
            ``seq_len``) packed into a row by the split's packing plan, padded
            at the end; for fine-tuning (see :class:`~flat_tokens_jax.BinRecords`).
            Held as its :class:`~flat_tokens_jax.Packing` (``WINDOWS``,
            ``PADDED``, ``BINS``), which may also be given; saved states and
            fingerprints hold the value as written (``true``, ``false``, ``"bins"``).
        shuffle: visit records in a fresh pseudo-random order each epoch.
            False: in order (evaluation). ``"blocks"``: the block shuffle, one
            request a block of ``shuffle_block`` records instead of one a row
            (docs/guide/loading.md, "Block shuffle").
        seed: the shuffle's key. Recommended: one per training run.
        num_epochs: passes over the records; ``None``: unbounded. With a bound,
            the last batch is completed with padding rows (``loss_mask`` 0); a
            mixture ends where its first component would begin another pass.
        prefetch: steps prepared ahead on background threads. ``None``
            (recommended): automatic, ``ceil(1.5 * (fetch + decode) / step) + 1``
            steps as measured, at least 2, within ``read_ahead_bytes``. An int
            pins the depth; 0 reads nothing ahead.
        read_ahead_bytes: the memory the steps prepared ahead may hold on this
            host, with automatic ``prefetch`` (a step's bytes: see
            docs/guide/loading.md; at least one step is read ahead whatever its
            size). Recommended: the default 1 GiB, more for very slow stores.
        start_token_id: the input token where a sequence starts. ``None``: the
            id the dataset records (``DatasetInfo.start_token_id``, set by
            ``convert --start-token-id``), or the spec's 0 when it records none;
            at most ``2**31 - 1`` (inputs are ``int32``).
        pad_id: input and target id of padding, an ``int32``.
        vocab_size: if given, the dataset's ``max_token_id`` (and the vocabulary
            of the tokenizer it records) must fit below it.
        decode_threads: threads that decode one batch on the host, each a
            block of rows. ``None``: measured for steps read ahead (see
            docs/guide/loading.md, "Where the work runs, and read-ahead").
        decode: where the fields are decoded. ``"host"``: on this host, then
            copied to the devices (17 bytes a token). ``"device"``: the encoded
            tokens (4 bytes a token) are decoded on the devices, inside
            ``jax.jit``; for GPU and TPU hosts whose CPUs cannot keep up.
        layout: the arrays a batch holds: ``"fields"`` (``inputs``, ``targets``,
            ``segment_ids``, ``positions``, ``loss_mask``), ``"segments"`` (and
            ``sequence_start``), ``"tokens"`` (``tokens`` ``[B, L + 1] int32``
            for trainers that shift themselves) or ``"maxtext"`` (MaxText's six
            keys); see docs/guide/loading.md, "Batch layouts".
        max_segments: if set, every layout adds ``segment_lengths`` ``[B,
            max_segments] int32``, each row's run lengths then zeros, for
            varlen attention (``cu_seqlens``); a row of more runs is refused.
            With ``packing="bins"`` it also caps the sequences per bin (at
            least 2). Recommended for bins: the most your kernel takes per row.
        sequence_start: True adds ``sequence_start`` ``[B, L] bool`` (True where
            a sequence starts) to ``"fields"`` and ``"maxtext"``.
        instance_filter: ``None`` (off), or an :class:`InstanceFilter` (or a
            mapping of its fields, as YAML gives): OLMo's filter, see
            docs/guide/loading.md, "Load-time instance filter". Recommended
            for pretraining on web data: ``InstanceFilter()``.
        source_field: True adds ``source`` ``[B] int32`` to every layout: the
            index in ``Loader.source_names`` of each row's component, ``-1``
            for padding rows (for :func:`~flat_tokens_jax.per_source`).
        shuffle_block: with ``shuffle="blocks"``, the records of a block
            (read as one request). ``None`` (recommended): about ``2**18``
            tokens' worth, sized from the store.
        shuffle_window: with ``shuffle="blocks"``, the blocks whose records
            are shuffled together (default 1).
        block_cache_bytes: with ``shuffle="blocks"``, the memory the blocks
            held on this host may take, besides ``read_ahead_bytes``. ``None``
            (recommended): each of this host's lanes holds its current window
            and the next. The guide gives all three in full
            (docs/guide/loading.md, "Block shuffle").
        balance_groups: ``G``, the data-parallel groups of the batch axis. Above
            1, each step's rows are reordered so that its ``G`` contiguous row
            groups carry near-equal attention work (see docs/guide/multihost.md,
            "Long context"). Every batch size must divide by it; not with
            ``shuffle="blocks"``.
        context_parallel: ``C``, the context-parallel ranks a trainer splits the
            sequence axis over. Above 1, every ``[B, L]`` field is laid out in
            :func:`~flat_tokens_jax.zigzag_order`, each token keeping its own
            ``positions`` and ``segment_ids``. ``seq_len`` must be a multiple of
            ``2C``; not with ``layout="tokens"``.
    """

    batch_size: BatchSizeSpec
    seq_len: int
    packing: fields.Packing = fields.Packing.WINDOWS
    shuffle: fields.Shuffle = True
    seed: int = 0
    num_epochs: int | None = None
    prefetch: int | None = None
    start_token_id: int | None = None
    pad_id: int = 0
    vocab_size: int | None = None
    decode_threads: int | None = None
    decode: str = "host"
    read_ahead_bytes: int = 1 << 30
    layout: str = "fields"
    max_segments: int | None = None
    instance_filter: InstanceFilter | None = None
    sequence_start: bool = False
    source_field: bool = False
    shuffle_block: int | None = None
    shuffle_window: int = 1
    block_cache_bytes: int | None = None
    balance_groups: int = 1
    context_parallel: int = 1

    def __post_init__(self) -> None:
        path = "LoaderConfig."
        for f in dataclasses.fields(self):  # numpy ints become Python ints
            object.__setattr__(self, f.name, FIELDS[f.name](getattr(self, f.name), path + f.name))
        if self.shuffle != fields.BLOCKS and (
            self.shuffle_block is not None or self.shuffle_window != 1
        ):
            raise BadValue(
                path + "shuffle",
                f"is {self.shuffle!r}, but shuffle_block={self.shuffle_block!r} and "
                f"shuffle_window={self.shuffle_window!r} are set: they apply to "
                "shuffle='blocks' only; set shuffle='blocks', or leave shuffle_block "
                "None and shuffle_window 1",
            )
        if self.shuffle != fields.BLOCKS and self.block_cache_bytes is not None:
            raise BadValue(
                path + "block_cache_bytes",
                f"is {self.block_cache_bytes!r}, but shuffle is {self.shuffle!r}: the "
                "block cache holds the blocks of shuffle='blocks' only; set "
                "shuffle='blocks', or leave block_cache_bytes None",
            )
        if self.balance_groups > 1:
            self._check_balance(path + "balance_groups")
        if self.instance_filter is not None:
            self.instance_filter.check_seq_len(self.seq_len, path + "instance_filter")
        check_max_segments(self.max_segments, self.seq_len, self.packing, path + "max_segments")
        cp = path + "context_parallel"
        check_context_parallel(self.context_parallel, self.seq_len, self.layout, cp)
        if self.vocab_size is not None:
            for name in ("start_token_id", "pad_id"):
                value = getattr(self, name)
                if value is not None and not 0 <= value < self.vocab_size:
                    raise BadValue(
                        path + name, f"{value} is outside the vocabulary [0, {self.vocab_size})"
                    )

    def _check_balance(self, path: str) -> None:
        groups = self.balance_groups
        if self.shuffle == fields.BLOCKS:
            raise BadValue(
                path,
                f"is {groups}, but shuffle is 'blocks': a host of the block shuffle "
                "reads its own lanes' blocks, which balanced rows would mix; set "
                "shuffle=True, or balance_groups=1",
            )
        for step, size in self.schedule.entries:
            if size % groups:
                at = "" if self.schedule.constant is not None else f" (from step {step})"
                raise BadValue(
                    path,
                    f"is {groups}, but batch_size {size}{at} does not split into "
                    f"{groups} equal groups: choose sizes that {groups} divides",
                )

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], path: str = "LoaderConfig") -> LoaderConfig:
        """Builds a config from a mapping, refusing keys it does not know;
        ``path`` names the mapping in errors (``loader.seed must be ...``)."""
        if not isinstance(values, Mapping):
            raise BadValue(path, f"must be a mapping of LoaderConfig fields, got {values!r}")
        known_keys(values, path, (f.name for f in dataclasses.fields(cls)), "field")
        missing = [k for k in ("batch_size", "seq_len") if k not in values]
        if missing:
            raise ValueError(f"{path}: the field(s) {missing} are required")
        try:
            return cls(**values)
        except BadValue as e:
            raise e.moved("LoaderConfig", path) from None

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str], key: str | None = "loader") -> LoaderConfig:
        """Reads a config from section ``key`` of a YAML file (``None``: the whole
        file; needs the ``yaml`` extra). Errors name the file and the value."""
        doc = read_yaml(path)
        fields = doc.get(key) if key is not None and isinstance(doc, dict) else doc
        if not isinstance(fields, dict):
            where = f"section {key!r} of " if key else ""
            raise ValueError(f"{where}{os.fspath(path)} is not a mapping of LoaderConfig fields")
        try:
            return cls.from_dict(fields, key or "LoaderConfig")
        except ValueError as e:
            raise ValueError(f"{os.fspath(path)}: {e}") from None

    @functools.cached_property
    def schedule(self) -> BatchSchedule:
        return BatchSchedule.of(self.batch_size)

    @property
    def batch_layout(self) -> BatchLayout:
        return BatchLayout(
            self.layout,
            self.max_segments,
            self.sequence_start,
            self.source_field,
            self.context_parallel,
        )

    def batch_size_at(self, step: int) -> int:
        return self.schedule.size(step)

    @property
    def lanes(self) -> int:
        """``L`` of the block shuffle: the batch size, or the gcd of a schedule's sizes."""
        return lanes(self.schedule.entries)

    def batch_defining(self) -> dict[str, Any]:
        """The :data:`BATCH_DEFINING` fields, JSON-ready; ``instance_filter``
        left out when off, ``balance_groups`` and ``context_parallel`` when 1,
        the shuffle's block fields without ``shuffle="blocks"``."""
        values = {k: v for k, v in dataclasses.asdict(self).items() if k in BATCH_DEFINING}
        if self.instance_filter is None:
            del values["instance_filter"]
        for name in ("balance_groups", "context_parallel"):
            if getattr(self, name) == 1:
                del values[name]
        if self.shuffle != fields.BLOCKS:
            del values["shuffle_block"], values["shuffle_window"]
        return {**values, "batch_size": self.schedule.spec(), "packing": self.packing.value}


BATCH_DEFINING = (
    "batch_size",
    "seq_len",
    "packing",
    "shuffle",
    "seed",
    "num_epochs",
    "start_token_id",
    "pad_id",
    "instance_filter",
    "shuffle_block",
    "shuffle_window",
    "balance_groups",
    "context_parallel",
)
"""The fields that decide batch contents, which a saved state's fingerprint
holds (``max_segments``, which caps a bins plan, is in the data's fingerprint
through the plan)."""


def _batch_size(value: Any, path: str) -> BatchSizeSpec:
    try:
        schedule = BatchSchedule.of(value)
    except ValueError as e:
        raise BadValue(path, str(e).removeprefix("batch_size ")) from None
    spec = schedule.spec()
    return spec if isinstance(spec, int) else schedule.entries


_POSITIVE = functools.partial(integer, low=1, optional=True)

FIELDS: dict[str, Callable[[Any, str], Any]] = {
    "batch_size": _batch_size,
    "seq_len": fields.seq_len,
    "packing": fields.packing,
    "shuffle": fields.shuffle,
    "seed": fields.seed,
    "num_epochs": _POSITIVE,
    "prefetch": functools.partial(integer, low=0, optional=True),
    # Both ids are written into the int32 inputs and targets.
    "start_token_id": functools.partial(fields.token_id, optional=True),
    "pad_id": fields.pad_id,
    "vocab_size": _POSITIVE,
    "decode_threads": _POSITIVE,
    "decode": functools.partial(choice, choices=("host", "device")),
    "read_ahead_bytes": functools.partial(integer, low=1),
    "layout": functools.partial(choice, choices=LAYOUTS),
    "max_segments": _POSITIVE,
    "instance_filter": InstanceFilter.of,
    "sequence_start": boolean,
    "source_field": boolean,
    "shuffle_block": _POSITIVE,
    "shuffle_window": functools.partial(integer, low=1),
    "block_cache_bytes": _POSITIVE,
    "balance_groups": functools.partial(integer, low=1),
    "context_parallel": functools.partial(integer, low=1),
}
"""Each :class:`LoaderConfig` field's check alone: ``check(value, path)`` gives
the value in its one form or raises ``BadValue`` naming ``path``."""


def check_sharding(sharding: Any) -> None:
    """Refuses what is not a ``Sharding`` (a bare ``PartitionSpec`` names the fix)."""
    if sharding is None or isinstance(sharding, jax.sharding.Sharding):
        return
    if isinstance(sharding, jax.sharding.PartitionSpec):
        raise TypeError(
            f"sharding is a PartitionSpec ({sharding}); wrap it: NamedSharding(mesh, P(...))"
        )
    raise TypeError(f"sharding must be a jax.sharding.Sharding or None, got {sharding!r}")


def check_vocab(
    config: LoaderConfig, components: Sequence[Records], infos: Sequence[tuple[str, Any]]
) -> None:
    if config.vocab_size is None:
        return
    max_id = max(int(r.fingerprint()["max_token_id"]) for r in components)
    if config.vocab_size <= max_id:
        raise ValueError(
            f"dataset max_token_id is {max_id} but vocab_size is "
            f"{config.vocab_size}: set vocab_size >= {max_id + 1}"
        )
    for name, tok in recorded_tokenizers(infos):
        if tok.vocab_size > config.vocab_size:
            where = "the data" if len(infos) == 1 else f"component {name!r}"
            raise ValueError(
                f"{where} was tokenized with {tok.name} ({tok.vocab_size} ids) but "
                f"vocab_size is {config.vocab_size}: set vocab_size >= {tok.vocab_size}"
            )


def resolve_start_token_id(config: LoaderConfig, infos: Sequence[tuple[str, Any]]) -> int:
    """The config's ``start_token_id``, else the one the data records, else the spec's 0."""
    if config.start_token_id is not None:
        return config.start_token_id
    recorded = {
        name: info.start_token_id
        for name, info in infos
        if info is not None and info.start_token_id is not None
    }
    if len(set(recorded.values())) > 1:
        listed = ", ".join(f"{n!r}: {v}" for n, v in recorded.items())
        raise ValueError(
            f"the components record different start_token_id values ({listed}): "
            "set LoaderConfig.start_token_id to the one to feed at every sequence start"
        )
    return next(iter(recorded.values()), 0)
