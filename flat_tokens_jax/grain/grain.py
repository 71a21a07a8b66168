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
decoded in row blocks on several threads, the ``Loader``'s step for a split
or a ``Mixture``, with a batch-size schedule or one size; it stays plain grain::

    ds = grain.MapDataset.source(src.batches(256, seed=0, shard=(jax.process_index(),
                                                                  jax.process_count())))

A batch-size schedule (``[(start_step, size), ...]``, as
``LoaderConfig.batch_size`` takes) over an order of grain's making is what
``.batch(B)`` cannot express: :class:`ScheduledBatches` is a source whose
element ``step`` is that step's batch of records, cut from any random-access
order of record indices::

    order = grain.MapDataset.range(len(src)).shuffle(seed=0).repeat(3)
    batches = grain.MapDataset.source(ScheduledBatches(src, [(0, 8), (100, 16)], order))
"""

from __future__ import annotations

import os
import pickle
import threading
from collections.abc import Sequence
from typing import Any, SupportsIndex

import numpy as np

from flat_tokens_jax.core import fields
from flat_tokens_jax.core.fields import Packing
from flat_tokens_jax.core.values import integer
from flat_tokens_jax.data.dataset import FlatTokens
from flat_tokens_jax.data.records import Records, Windows, recorded_info
from flat_tokens_jax.decoding.hostdecode import (
    BlockDecoder,
    default_threads,
    join_parts,
    request_parts,
    row_sources,
)
from flat_tokens_jax.decoding.instancefilter import InstanceFilter, apply_filter
from flat_tokens_jax.decoding.layouts import BatchLayout
from flat_tokens_jax.grain.grainbatches import Batches, ScheduledBatches
from flat_tokens_jax.grain.grainprocess import prepare_grain
from flat_tokens_jax.grain.grainrecords import Keep, Remix, Reopen, as_components
from flat_tokens_jax.loader.config import LoaderConfig, resolve_start_token_id
from flat_tokens_jax.sampling.blocks import default_block, sampler
from flat_tokens_jax.sampling.mixture import Mixture
from flat_tokens_jax.sampling.schedule import BatchSizeSpec
from flat_tokens_jax.store.identity import DatasetInfo, TokenizerInfo
from flat_tokens_jax.store.options import StoreOptions, resolve_options

__all__ = ["FlatTokensSource", "ScheduledBatches"]


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
        source: a path or URL, a :class:`FlatTokens` split (or view),
            records (:class:`PackedRecords`, :class:`PaddedRecords`, or any
            :class:`Records`), or a ``Mixture``: its steps come from
            :meth:`batches`, blended as ``Loader`` blends them; it has no
            record index (``len``, ``[i]``).
        seq_len: tokens per record; required for a URL or a ``FlatTokens``,
            and if given for records it must be theirs.
        packing: True (the default for a URL or a ``FlatTokens``): consecutive
            windows of the concatenated tokens; False: one sequence per record,
            truncated and right-padded; ``"bins"``: whole sequences packed by
            the split's packing plan (see ``LoaderConfig.packing``); the plan
            travels with the pickled source. Records bring their own. Held
            as its :class:`~flat_tokens_jax.Packing` (attribute ``packing``).
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
        source_field: as ``LoaderConfig.source_field``: True adds ``source``
            (``int32``, one a record: the index in :attr:`source_names` of its
            component, ``-1`` for a padding row of :meth:`batches`).
        instance_filter: ``None`` (off), or an :class:`InstanceFilter` (or a
            mapping of its fields): rejected records get ``loss_mask`` False,
            as ``LoaderConfig.instance_filter`` does; it applies to every
            read (``[i]``, :meth:`read_batch`, :meth:`batches`).

    Raises:
        ValueError: a bad ``seq_len``, ``start_token_id``, ``pad_id`` or
            ``instance_filter``, records whose ``seq_len`` or packing differ
            from those asked for, or no records at all.
        TypeError: ``source`` is not a source of records.

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
        source: str | os.PathLike[str] | FlatTokens | Records | Mixture,
        seq_len: int | None = None,
        packing: Packing | bool | str | None = None,
        *,
        split: str = "train",
        plan_cache: str | os.PathLike[str] | None = None,
        options: StoreOptions | None = None,
        start_token_id: int | None = None,
        pad_id: int = 0,
        layout: str = "fields",
        max_segments: int | None = None,
        sequence_start: bool = False,
        source_field: bool = False,
        instance_filter: InstanceFilter | None = None,
        **option_fields: Any,
    ) -> None:
        start_token_id = fields.token_id(start_token_id, "start_token_id", optional=True)
        pad_id = fields.pad_id(pad_id, "pad_id")
        self.instance_filter = InstanceFilter.of(instance_filter)
        if option_fields or options is not None:
            options = resolve_options(options, option_fields, "FlatTokensSource")
        self.layout = BatchLayout(layout, max_segments, sequence_start, source_field)
        args = (seq_len, packing, split, options, plan_cache, max_segments)
        components, self._mixture = as_components(source, *args)
        self._remix: Remix | None = None
        first = components[0]
        if self.instance_filter is not None:
            self.instance_filter.check_seq_len(first.seq_len, "instance_filter")
        for records in components:
            if len(records) == 0:
                raise ValueError(
                    f"{records!r} has no records: the split holds fewer than "
                    f"seq_len={records.seq_len} tokens or no sequences"
                )
        self.seq_len, self.packing = first.seq_len, first.packing
        names = ("0",) if self.mixture is None else self.mixture.names
        self.infos = [(n, recorded_info(r)) for n, r in zip(names, components, strict=True)]
        # A Mixture's components may record different things: then none is the data's.
        same = all(i == self.infos[0][1] for _, i in self.infos)
        self.info: DatasetInfo | None = self.infos[0][1] if same else None
        config = LoaderConfig(1, self.seq_len, self.packing, start_token_id=start_token_id)
        self.start_token_id, self.pad_id = resolve_start_token_id(config, self.infos), pad_id
        self._components: tuple[Records, ...] | None = components
        self._decoder: BlockDecoder | None = None
        self._openers = [Reopen.of(r) or Keep(r) for r in components]
        self._sizes = [len(r) for r in components]
        self._pid = os.getpid()
        self._lock = threading.Lock()
        # Fixed here and carried through pickling: grain's DataLoader checks a
        # restored checkpoint against repr(source), in whichever process.
        rule = "" if self.instance_filter is None else f", instance_filter={self.instance_filter}"
        shape = "" if self.layout.plain else f", layout={layout!r}, max_segments={max_segments}"
        shape += ", sequence_start=True" if sequence_start else ""
        shape += ", source_field=True" if source_field else ""
        read = first if self.mixture is None else self.mixture
        self._repr = (
            f"FlatTokensSource({read!r}, start_token_id={self.start_token_id}, pad_id={pad_id}"
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
    def source_names(self) -> tuple[str, ...]:
        """The components' names, in order (``("0",)`` for one split): what
        ``source`` counts (``source_field``)."""
        return tuple(name for name, _ in self.infos)

    @property
    def max_token_id(self) -> int:
        """The largest id in the data (the split's ``max_token_id``; a
        Mixture's: the largest of its components')."""
        ids = []
        for records in self.components:
            ft = getattr(records, "ft", None)
            found = ft.max_token_id if isinstance(ft, FlatTokens) else None
            ids.append(int(records.fingerprint()["max_token_id"]) if found is None else found)
        return max(ids)

    @property
    def vocab_size(self) -> int:
        """The ids a model must embed: the recorded tokenizer's ``vocab_size``
        (the largest of a Mixture's), else ``max_token_id + 1``."""
        tokens = [i.tokenizer.vocab_size for _, i in self.infos if i and i.tokenizer]
        return max(tokens) if tokens else self.max_token_id + 1

    def __len__(self) -> int:
        return self._single_records_count()

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
            TypeError: a source of a ``Mixture`` (its records are drawn by
                step: :meth:`batches`).
            ValueError: a record of more runs than ``max_segments``.
        """
        idx = self._indices(indices)
        where = f"{self._repr} (rows by record index)"
        return self.read_rows(
            np.zeros(idx.size, np.int64), idx, np.ones(idx.size, bool), where, idx
        )

    def read_rows(
        self,
        comp: np.ndarray,
        records: np.ndarray,
        real: np.ndarray,
        where: str,
        rows: np.ndarray | None = None,
    ) -> dict[str, np.ndarray]:
        """The layout's fields ``[k, seq_len]`` of ``k`` rows: the real ones
        (``real`` ``[k] bool``) hold record ``records`` of component ``comp``
        (``[r] int64`` each), the others are padding (``loss_mask`` False),
        as a ``Loader`` makes them. ``where`` and ``rows`` name them in errors."""
        components = self.components
        decoder = self._block_decoder()
        parts = request_parts(components, comp, records, real)()

        def decode(c: int, windows: Windows) -> dict[str, np.ndarray]:
            return decoder.decode(
                windows,
                components[c].packing,
                self.seq_len,
                start_token_id=self.start_token_id,
                pad_id=self.pad_id,
            )

        packings = [r.packing for r in components]
        fields, starts = join_parts(real.size, parts, decode, packings, self.seq_len, self.pad_id)
        apply_filter(self.instance_filter, fields, decoder.run_blocks)
        if self.layout.plain:
            return fields
        sources = row_sources(comp, real)
        return self.layout.apply(fields, starts, where=where, rows=rows, sources=sources)

    def batches(
        self,
        batch_size: BatchSizeSpec,
        *,
        seed: int = 0,
        shuffle: fields.Shuffle = True,
        num_epochs: int | None = 1,
        shard: tuple[int, int] = (0, 1),
        shuffle_block: int | None = None,
        shuffle_window: int = 1,
    ) -> Batches:
        """A grain source of whole shuffled batches: element ``step`` is one step.

        ``grain.MapDataset.source(src.batches(256, seed=0))`` is the fast way to
        batch this source: one batched read per step, decoded on several threads.
        The order is ``Loader``'s: element ``step`` equals
        ``Loader(records, LoaderConfig(batch_size, seed=seed, shuffle=shuffle,
        num_epochs=num_epochs, ...)).host_batch(step)`` (rows of this shard),
        for a ``Mixture`` too (its blend, weight schedule and seeds).

        Args:
            batch_size: global rows per step, over all shards: an int, or a
                schedule ``[(start_step, size), ...]`` as ``LoaderConfig.batch_size``.
            seed: the shuffle's key (a fresh order each epoch).
            shuffle: False: records in order; ``"blocks"``: the block shuffle
                (see ``LoaderConfig.shuffle``), whose lanes are the batch
                size (the gcd of a schedule's sizes), as ``Loader``'s.
            num_epochs: passes over the records; the last step is completed
                with padding rows (``loss_mask`` False, ``segment_ids`` 0), as
                ``Loader`` pads it, so an evaluation pass (``num_epochs=1,
                shuffle=False``) reads every record once. ``None``: unbounded
                (as many steps as sample indices allow); a ``Mixture``'s
                components run without end, so it needs ``None``.
            shard: ``(index, count)``: this host's share of each batch, rows
                ``[index * B // count, (index + 1) * B // count)`` of a step of
                ``B`` rows, e.g. ``(jax.process_index(), jax.process_count())``;
                the hosts together read each global batch once.
            shuffle_block: as ``LoaderConfig.shuffle_block`` (``None``: sized
                from the store's chunking).
            shuffle_window: as ``LoaderConfig.shuffle_window``.

        Raises:
            ValueError: a bad ``batch_size``, ``seed``, ``shuffle``,
                ``num_epochs``, ``shuffle_block``, ``shuffle_window`` or
                ``shard``, a batch size that does not divide over the shards,
                or ``num_epochs`` with a ``Mixture``.
        """
        # The loader's checks of these fields, and its lanes.
        config = LoaderConfig(
            batch_size,
            self.seq_len,
            self.packing,
            shuffle=shuffle,
            seed=seed,
            num_epochs=num_epochs,
            shuffle_block=shuffle_block,
            shuffle_window=shuffle_window,
        )
        block = config.shuffle_block
        if config.shuffle == fields.BLOCKS and block is None:
            block = default_block(self.components, self.seq_len)
        if self.mixture is not None and num_epochs is not None:
            raise ValueError(
                f"num_epochs={num_epochs!r} does not apply to a Mixture: each component "
                "runs its own epochs, without end; pass num_epochs=None"
            )
        samplers = [
            sampler(
                size,
                config.shuffle,
                seed=seed if self.mixture is None else self.mixture.component_seed(seed, c),
                num_epochs=num_epochs,
                block=block or 1,
                window=config.shuffle_window,
                lane_count=config.lanes,
            )
            for c, size in enumerate(self._sizes)
        ]
        return Batches(self, batch_size, samplers, shard=shard)

    def _block_decoder(self) -> BlockDecoder:
        decoder = self._decoder
        if decoder is None:
            decoder = self._decoder = BlockDecoder(default_threads())
        return decoder

    @property
    def records(self) -> Records:
        """The records read from, opened in this process first if they need to
        be (a Mixture's: see :attr:`components`)."""
        if self.mixture is not None:
            raise TypeError(f"{self!r} reads a Mixture: its records are components[c]")
        return self.components[0]

    @property
    def components(self) -> tuple[Records, ...]:
        """The records of each component (one without a Mixture), opened in
        this process first if they need to be."""
        components = self._components
        if components is not None and self._pid == os.getpid():
            return components
        with self._lock:
            components = self._components
            if components is None or self._pid != os.getpid():
                components = tuple(opener.open() for opener in self._openers)
                for records, size in zip(components, self._sizes, strict=True):
                    if len(records) != size:
                        raise RuntimeError(
                            f"the data changed after {self!r} was made: it had "
                            f"{size} records, {records!r} has {len(records)}"
                        )
                self._components, self._pid = components, os.getpid()
            return components

    def __getstate__(self) -> dict[str, Any]:
        if any(opener.in_memory for opener in self._openers):
            raise pickle.PicklingError(
                f"{self!r} reads a memory:// store, which exists only in this process: "
                "write the dataset to a path or object store for grain worker processes, "
                "or use worker_count=0"
            )
        state = dict(self.__dict__)
        del state["_lock"]
        state["_components"], state["_decoder"] = None, None
        # The blend travels, not its open sources: see `mixture`.
        if self._mixture is not None:
            state["_remix"] = Remix.of(self._mixture)
        state["_mixture"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    @property
    def mixture(self) -> Mixture | None:
        """The ``Mixture`` read (``None``: one split or records), made again
        over this process's components in an unpickled copy."""
        if self._mixture is None and self._remix is not None:
            mixture = self._remix.open(self.components)
            with self._lock:
                if self._mixture is None:
                    self._mixture = mixture
        return self._mixture

    def _single_records_count(self) -> int:
        if self.mixture is not None:
            raise TypeError(
                f"{self!r} reads a Mixture, whose records are drawn by step, not by "
                "index: use its batches(batch_size, num_epochs=None, ...)"
            )
        return self._sizes[0]

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
        n = self._single_records_count()
        # Compared before any cast: a uint64 or a Python int past int64 would wrap.
        bad = np.flatnonzero((idx >= n) if idx.dtype.kind == "u" else (idx < -n) | (idx >= n))
        if bad.size:
            raise IndexError(
                f"{self!r}: record index {idx[bad[0]]} is outside [-{n}, {n}) ({n} records)"
            )
        idx = idx.astype(np.int64)
        return np.where(idx < 0, idx + n, idx)
