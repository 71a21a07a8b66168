"""Flat-tokens records as a grain data source: ``FlatTokensSource``.

A grain pipeline reads elements by index from a random-access source.
``FlatTokensSource`` is one: element ``i`` is record ``i`` (a packed window, a
padded sequence or a bin of whole sequences, exactly the row
:class:`~flat_tokens_jax.Loader` makes of it) as a dict of the five batch
fields, each ``[seq_len]``. The source only has to satisfy grain's protocol;
making one imports grain only to prepare its worker processes for a plain
script (:mod:`~flat_tokens_jax.grain.grainprocess`).

What a read costs: ``__getitem__`` is one read of one record. ``_getitems`` is
grain's batched-read hook (``SupportsBatchedReadRandomAccessDataSource``): one
batched read for many records. grain 0.2's ``MapDataset.source(...)`` forwards
``_getitems`` to it, but ``MapDataset.batch`` calls it only behind an
experiment flag that grain leaves off, so ``.batch(B)`` still costs ``B``
single-record reads. Batching the indices and mapping :meth:`read_batch` over
them costs one batched read per batch::

    grain.MapDataset.range(len(src)).shuffle(seed=0).batch(B).map(src.read_batch)

Simplest and fastest: :meth:`FlatTokensSource.batches` is a source whose
element ``step`` is a whole shuffled batch (this host's share of it), read and
decoded in row blocks on several threads; it stays plain grain::

    ds = grain.MapDataset.source(src.batches(256, seed=0, shard=(jax.process_index(),
                                                                  jax.process_count())))

A batch-size schedule (``[(start_step, size), ...]``, as
``LoaderConfig.batch_size`` takes) is what ``.batch(B)`` cannot express:
:class:`ScheduledBatches` is a source whose element ``step`` is that step's
batch of records, cut from any random-access order of record indices::

    order = grain.MapDataset.range(len(src)).shuffle(seed=0).repeat(3)
    batches = grain.MapDataset.source(ScheduledBatches(src, [(0, 8), (100, 16)], order))
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import threading
from collections.abc import Sequence
from typing import Any, SupportsIndex

import numpy as np

from flat_tokens_jax.core.limits import check_loader_memory
from flat_tokens_jax.core.values import integer
from flat_tokens_jax.data.bins import BinRecords, PackingPlan, check_packing, make_records
from flat_tokens_jax.data.dataset import Dataset, FlatTokens, open_dataset
from flat_tokens_jax.data.records import PackedRecords, PaddedRecords, Records, recorded_info
from flat_tokens_jax.decoding.hostdecode import BlockDecoder, default_threads
from flat_tokens_jax.decoding.instancefilter import InstanceFilter, apply_filter
from flat_tokens_jax.decoding.layouts import BatchLayout, check_max_segments, row_starts
from flat_tokens_jax.grain.grainbatches import Batches, ScheduledBatches
from flat_tokens_jax.grain.grainprocess import prepare_grain
from flat_tokens_jax.loader.config import LoaderConfig, resolve_start_token_id
from flat_tokens_jax.sampling.mixture import Mixture
from flat_tokens_jax.store.identity import DatasetInfo, TokenizerInfo
from flat_tokens_jax.store.options import StoreOptions, resolve_options

__all__ = ["FlatTokensSource", "ScheduledBatches"]


@dataclasses.dataclass(frozen=True)
class _Reopen:
    """What opens the same records again, in another process."""

    url: str
    split: str
    sequences: tuple[int, int]
    options: StoreOptions
    packed: bool | str
    seq_len: int
    in_memory: bool
    plan: PackingPlan | None = None

    @classmethod
    def of(cls, records: Records) -> _Reopen | None:
        """How to reopen ``records``; ``None`` for records of another type than ours."""
        kinds = (PackedRecords, PaddedRecords, BinRecords)
        # A subclass may read differently from the class it would reopen as.
        if type(records) not in kinds or not isinstance(records, kinds):
            return None
        ft = records.ft
        spec = ft.store.spec
        # The resolved path, not the one given: a later chdir must not move the data.
        url = spec["path"] if spec["driver"] == "file" else ft.url
        return cls(
            url=url,
            split=ft.split_name,
            sequences=ft.seq_range,
            # A tensorstore Context cannot cross processes: each opens its own.
            options=dataclasses.replace(ft.store.options, context=None),
            packed=records.packed,
            seq_len=records.seq_len,
            in_memory=spec["driver"] == "memory",
            plan=records.plan if isinstance(records, BinRecords) else None,
        )

    def open(self) -> Records:
        ft = open_dataset(self.url, self.options)[self.split]
        if ft.seq_range != self.sequences:
            ft = ft.view(*self.sequences)
        if self.plan is not None:
            return BinRecords(ft, self.seq_len, plan=self.plan)
        return make_records(ft, self.seq_len, self.packed)


@dataclasses.dataclass(frozen=True)
class _Keep:
    """Records of a type that cannot be reopened from a URL: pickled as they are."""

    records: Records
    in_memory = False

    def open(self) -> Records:
        return self.records


class FlatTokensSource:
    """A grain random-access source whose elements are the batch fields of one record.

    Element ``i`` is a dict of ``inputs``, ``targets``, ``segment_ids``,
    ``positions`` (``[seq_len] int32``) and ``loss_mask`` (``[seq_len] bool``):
    row ``i`` of ``Loader(..., LoaderConfig(shuffle=False, ...))`` run over the
    same records with the same ``start_token_id`` and ``pad_id``.

    What the data is: :attr:`info` (the ``DatasetInfo`` the dataset records,
    or ``None``), :attr:`tokenizer` (its ``TokenizerInfo``: ``vocab_size``,
    ``bos_id``, ``eos_id``, ``pad_id``), :attr:`max_token_id` and
    :attr:`vocab_size` (the tokenizer's, else ``max_token_id + 1``), so a
    trainer sizes its embedding without opening the dataset again.

    Contract: thread-safe, deterministic, and picklable. A pickled source holds
    no tensorstore handle (tensorstore is not fork-safe, and grain sends its
    worker processes pickled sources); it reopens the store on first use in
    each process. Sources over ``memory://`` stores refuse to pickle, since
    another process would find the store empty. Records of a custom type are
    pickled as they are.

    Args:
        source: a path or URL, a :class:`FlatTokens` split (or view), or
            records (:class:`PackedRecords`, :class:`PaddedRecords`, or any
            :class:`Records`). A ``Mixture`` is refused: mix one source per
            component with grain instead.
        seq_len: tokens per record; required for a URL or a ``FlatTokens``,
            and if given for records it must be theirs.
        packing: True (the default for a URL or a ``FlatTokens``): consecutive
            windows of the concatenated tokens; False: one sequence per record,
            truncated and right-padded; ``"bins"``: whole sequences packed by
            the split's packing plan (see ``LoaderConfig.packing``); the plan
            travels with the pickled source. Records bring their own.
        split: the split to read from a URL.
        plan_cache: where a packing plan built for ``packing="bins"`` is
            cached (``None``: built, not cached).
        options: how to reach the store at a URL. Its ``context`` stays in
            this process: unpickled copies open their own.
        **option_fields: or the fields of ``options`` as keywords, e.g.
            ``endpoint=...``.
        start_token_id: the input token where a sequence starts; ``None``: the
            one the dataset records, else 0 (as ``LoaderConfig``).
        pad_id: input and target id of padding.
        layout: the arrays of an element, as ``LoaderConfig.layout``
            (``"fields"``, ``"segments"``, ``"tokens"``, ``"maxtext"``; see
            docs/guide/loading.md, "Batch layouts"); :meth:`read_batch` and the batch sources
            made from this one hold the same.
        max_segments: as ``LoaderConfig.max_segments``: adds
            ``segment_lengths`` ``[max_segments] int32`` to each element, and
            with ``packing="bins"`` caps the runs per bin.
        sequence_start: as ``LoaderConfig.sequence_start``: True adds
            ``sequence_start`` ``[seq_len] bool`` to each element of a layout
            that lacks it (``"fields"``, ``"maxtext"``).
        instance_filter: ``None`` (off), or an :class:`InstanceFilter` (or a
            mapping of its fields): rejected records get ``loss_mask`` False,
            as ``LoaderConfig.instance_filter`` does; it applies to every
            read (``[i]``, :meth:`read_batch`, :meth:`batches`).

    Raises:
        ValueError: a bad ``seq_len``, ``start_token_id``, ``pad_id`` or
            ``instance_filter``, records whose ``seq_len`` or packing differ
            from those asked for, or no records at all.
        TypeError: ``source`` is a ``Mixture`` or not a source of records.

    Example:
        >>> import grain
        >>> import flat_tokens_jax as ftj
        >>> from flat_tokens_jax.grain.grain import FlatTokensSource
        >>> url = "memory://doc/grain"
        >>> ftj.write_dataset(url, {"train": [[1, 2], [3, 4, 5], [6, 7, 8]]}, overwrite=True)
        >>> src = FlatTokensSource(url, seq_len=4)
        >>> len(src), src[1]["targets"].tolist(), src[1]["segment_ids"].tolist()
        (2, [5, 6, 7, 8], [1, 2, 2, 2])
        >>> batch = next(iter(grain.MapDataset.source(src).batch(2)))
        >>> batch["inputs"].tolist()
        [[0, 1, 0, 3], [4, 0, 6, 7]]
    """

    def __init__(
        self,
        source: str | os.PathLike[str] | FlatTokens | Records,
        seq_len: int | None = None,
        packing: bool | str | None = None,
        *,
        split: str = "train",
        plan_cache: str | os.PathLike[str] | None = None,
        options: StoreOptions | None = None,
        start_token_id: int | None = None,
        pad_id: int = 0,
        layout: str = "fields",
        max_segments: int | None = None,
        sequence_start: bool = False,
        instance_filter: InstanceFilter | None = None,
        **option_fields: Any,
    ) -> None:
        if start_token_id is not None and (
            isinstance(start_token_id, bool)
            or not isinstance(start_token_id, int)
            or start_token_id < 0
        ):
            raise ValueError(f"start_token_id must be an int >= 0, got {start_token_id!r}")
        if isinstance(pad_id, bool) or not isinstance(pad_id, int):
            raise ValueError(f"pad_id must be an int, got {pad_id!r}")
        self.instance_filter = InstanceFilter.of(instance_filter)
        if option_fields or options is not None:
            options = resolve_options(options, option_fields, "FlatTokensSource")
        self.layout = BatchLayout(layout, max_segments, sequence_start)
        records = _as_records(source, seq_len, packing, split, options, plan_cache, max_segments)
        if self.instance_filter is not None:
            self.instance_filter.check_seq_len(records.seq_len, "instance_filter")
        if len(records) == 0:
            raise ValueError(
                f"{records!r} has no records: the split holds fewer than "
                f"seq_len={records.seq_len} tokens or no sequences"
            )
        self.seq_len, self.packed = records.seq_len, records.packed
        self.info: DatasetInfo | None = recorded_info(records)
        if start_token_id is None:
            config = LoaderConfig(1, records.seq_len, records.packed)
            start_token_id = resolve_start_token_id(config, [("0", self.info)])
        self.start_token_id, self.pad_id = start_token_id, pad_id
        self._records: Records | None = records
        self._decoder: BlockDecoder | None = None
        self._opener: _Reopen | _Keep = _Reopen.of(records) or _Keep(records)
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._length = len(records)
        # Fixed here and carried through pickling: grain's DataLoader checks a
        # restored checkpoint against repr(source), in whichever process.
        rule = "" if self.instance_filter is None else f", instance_filter={self.instance_filter}"
        shape = "" if self.layout.plain else f", layout={layout!r}, max_segments={max_segments}"
        shape += ", sequence_start=True" if sequence_start else ""
        self._repr = (
            f"FlatTokensSource({records!r}, start_token_id={start_token_id}, pad_id={pad_id}"
            f"{rule}{shape})"
        )
        prepare_grain()

    def __repr__(self) -> str:
        return self._repr

    @property
    def tokenizer(self) -> TokenizerInfo | None:
        """The tokenizer the data records (name, ``vocab_size``, ``bos_id``,
        ``eos_id``, ``pad_id``); ``None`` when it records none."""
        return None if self.info is None else self.info.tokenizer

    @property
    def max_token_id(self) -> int:
        """The largest id in the data (the split's ``max_token_id``)."""
        ft = getattr(self.records, "ft", None)
        if isinstance(ft, FlatTokens):
            return ft.max_token_id
        return int(self.records.fingerprint()["max_token_id"])

    @property
    def vocab_size(self) -> int:
        """The ids a model must embed: the recorded tokenizer's ``vocab_size``,
        else ``max_token_id + 1``."""
        tok = self.tokenizer
        return self.max_token_id + 1 if tok is None else tok.vocab_size

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: SupportsIndex) -> dict[str, np.ndarray]:
        """Record ``index`` (negative counts from the end): five ``[seq_len]`` fields."""
        rows = self.read_batch([integer(index, "FlatTokensSource index")])
        return {key: value[0] for key, value in rows.items()}

    def _getitems(self, indices: Sequence[int]) -> list[dict[str, np.ndarray]]:
        """grain's batched-read hook: the elements of ``indices``, from one batched read."""
        rows = self.read_batch(indices)
        return [dict(zip(rows, row, strict=True)) for row in zip(*rows.values(), strict=True)]

    def read_batch(self, indices: Sequence[int] | np.ndarray) -> dict[str, np.ndarray]:
        """Records ``indices`` (``[k]`` ints, negative from the end), stacked, in one read.

        Returns:
            The five fields, each ``[k, seq_len]``: ``inputs``, ``targets``,
            ``segment_ids``, ``positions`` (``int32``) and ``loss_mask``
            (``bool``); or the fields of this source's ``layout``.

        Raises:
            IndexError: an index outside ``[-len(self), len(self))``.
            ValueError: a record of more runs than ``max_segments``.
        """
        idx = self._indices(indices)
        records = self.records
        decoder = self._block_decoder()
        windows = records.read(idx)
        fields = decoder.decode(
            windows,
            records.packed,
            self.seq_len,
            start_token_id=self.start_token_id,
            pad_id=self.pad_id,
        )
        apply_filter(self.instance_filter, fields, decoder.run_blocks)
        if self.layout.plain:
            return fields
        where = f"{self._repr} (rows by record index)"
        starts = row_starts(windows, records.packed)
        return self.layout.apply(fields, starts, where=where, rows=idx)

    def batches(
        self,
        batch_size: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        num_epochs: int | None = 1,
        shard: tuple[int, int] = (0, 1),
    ) -> Batches:
        """A grain source of whole shuffled batches: element ``step`` is one step.

        ``grain.MapDataset.source(src.batches(256, seed=0))`` is the fast way to
        batch this source: one batched read per step, decoded on several threads.
        The order is ``Loader``'s: element ``step`` equals
        ``Loader(records, LoaderConfig(batch_size, seed=seed, shuffle=shuffle,
        num_epochs=num_epochs, ...)).host_batch(step)`` (rows of this shard).

        Args:
            batch_size: global rows per step, over all shards.
            seed: the shuffle's key (a fresh order each epoch).
            shuffle: False: records in order.
            num_epochs: passes over the records; the last partial batch is
                dropped. ``None``: unbounded (as many steps as sample indices
                allow).
            shard: ``(index, count)``: this host's share of each batch, rows
                ``[index * batch_size // count, (index + 1) * batch_size // count)``,
                e.g. ``(jax.process_index(), jax.process_count())``; the hosts
                together read each global batch once.

        Raises:
            ValueError: a bad ``batch_size``, ``seed``, ``num_epochs`` or
                ``shard``, or ``batch_size`` that does not divide over the shards.
        """
        count = shard[1] if isinstance(shard, tuple) and len(shard) == 2 else 1
        if type(batch_size) is int and type(count) is int and batch_size > 0 and count > 0:
            row_bytes = self.layout.row_bytes(self.seq_len)
            check_loader_memory(batch_size, self.seq_len, 0, count, row_bytes=row_bytes)
        return Batches(
            self, batch_size, seed=seed, shuffle=shuffle, num_epochs=num_epochs, shard=shard
        )

    def _block_decoder(self) -> BlockDecoder:
        decoder = self._decoder
        if decoder is None:
            decoder = self._decoder = BlockDecoder(default_threads())
        return decoder

    @property
    def records(self) -> Records:
        """The records read from, opened in this process first if they need to be."""
        records = self._records
        if records is not None and self._pid == os.getpid():
            return records
        with self._lock:
            records = self._records
            if records is None or self._pid != os.getpid():
                records = self._opener.open()
                if len(records) != self._length:
                    raise RuntimeError(
                        f"the data changed after {self!r} was made: it had "
                        f"{self._length} records, {records!r} has {len(records)}"
                    )
                self._records, self._pid = records, os.getpid()
            return records

    def __getstate__(self) -> dict[str, Any]:
        if self._opener.in_memory:
            raise pickle.PicklingError(
                f"{self!r} reads a memory:// store, which exists only in this process: "
                "write the dataset to a path or object store for grain worker processes, "
                "or use worker_count=0"
            )
        state = dict(self.__dict__)
        del state["_lock"]
        state["_records"], state["_decoder"] = None, None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def _indices(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        """``indices`` as ``[k] int64`` in ``[0, len)``, after counting negatives from the end."""
        idx = np.asarray(indices)
        if idx.ndim != 1:
            raise ValueError(f"record indices must be 1-D [k], got shape {idx.shape}")
        if idx.dtype == object:  # ints past 64 bits, or values of mixed kinds
            for i, value in enumerate(idx.tolist()):
                integer(value, f"record indices[{i}]")
        elif idx.size and idx.dtype.kind not in "iu":
            raise TypeError(f"record indices must be integers, got dtype {idx.dtype}")
        n = self._length
        # Compared before any cast: a uint64 or a Python int past int64 would wrap.
        bad = np.flatnonzero((idx >= n) if idx.dtype.kind == "u" else (idx < -n) | (idx >= n))
        if bad.size:
            raise IndexError(
                f"{self!r}: record index {idx[bad[0]]} is outside [-{n}, {n}) ({n} records)"
            )
        idx = idx.astype(np.int64)
        return np.where(idx < 0, idx + n, idx)


def _as_records(
    source: str | os.PathLike[str] | FlatTokens | Records,
    seq_len: int | None,
    packing: bool | str | None,
    split: str,
    options: StoreOptions | None,
    plan_cache: str | os.PathLike[str] | None,
    max_segments: int | None = None,
) -> Records:
    """The records a :class:`FlatTokensSource` reads, checked against what was asked."""
    if isinstance(source, Mixture):
        raise TypeError(
            f"{source!r} is a Mixture, which grain cannot index as one source: make a "
            "FlatTokensSource per component and blend them with grain.MapDataset.mix"
        )
    if packing is not None:
        check_packing(packing, "packing")
    if seq_len is not None and (
        isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1
    ):
        raise ValueError(f"seq_len must be an int >= 1, got {seq_len!r}")
    if isinstance(source, str | os.PathLike):
        source = open_dataset(source, options)[split]
    elif options is not None:
        raise ValueError(f"options apply to a URL only; {source!r} is open already")
    if isinstance(source, FlatTokens):
        if seq_len is None:
            raise ValueError(f"seq_len is required to make records of {source!r}")
        packing = True if packing is None else packing
        check_max_segments(max_segments, seq_len, packing, "max_segments")
        return make_records(source, seq_len, packing, plan_cache, max_segments)
    if isinstance(source, Dataset):
        raise TypeError(
            f"{source!r} is a whole dataset; pick a split: ds[{source.splits[0]!r}] "
            "(or pass the URL with split=...)"
        )
    if not all(hasattr(source, a) for a in ("read", "seq_len", "packed", "__len__")):
        raise TypeError(
            f"expected a path or URL, a FlatTokens or Records, got {type(source).__name__}"
        )
    asked = {"seq_len": seq_len, "packing": packing}
    have = {"seq_len": source.seq_len, "packing": source.packed}
    wrong = [f"{k} {asked[k]!r}" for k in asked if asked[k] is not None and asked[k] != have[k]]
    if wrong:
        raise ValueError(
            f"{source!r} has seq_len {source.seq_len} and packing {source.packed}, but "
            f"{' and '.join(wrong)} was asked for: leave them out to use the records' own"
        )
    check_max_segments(max_segments, source.seq_len, source.packed, "max_segments")
    return source
