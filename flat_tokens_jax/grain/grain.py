"""Flat-tokens records as a grain random-access data source: ``FlatTokensSource``.
Batch indices and map :meth:`~FlatTokensSource.read_batch` for one read a batch
(grain's ``.batch`` reads each record alone: docs/guide/trainers.md, "What a batch costs").
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
from flat_tokens_jax.data.bins import make_records
from flat_tokens_jax.data.dataset import Dataset, FlatTokens, open_dataset
from flat_tokens_jax.data.records import Records, check_packing, recorded_info
from flat_tokens_jax.decoding.hostdecode import (
    BlockDecoder,
    RowDecode,
    default_threads,
    request_parts,
    row_sources,
)
from flat_tokens_jax.decoding.instancefilter import FilteredRows, InstanceFilter
from flat_tokens_jax.decoding.layouts import (
    BatchLayout,
    check_context_parallel,
    check_max_segments,
)
from flat_tokens_jax.loader.config import LoaderConfig, resolve_start_token_id
from flat_tokens_jax.loader.grainprocess import prepare_grain
from flat_tokens_jax.loader.reopen import Keep, Reopen
from flat_tokens_jax.sampling.mixture import Mixture, config_records
from flat_tokens_jax.store.identity import DatasetInfo, TokenizerInfo, recorded_vocab_size
from flat_tokens_jax.store.options import StoreOptions, resolve_options


class FlatTokensSource:
    """A grain random-access source whose element ``i`` is the five fields
    (``[seq_len]`` each) of row ``i`` of ``Loader(..., LoaderConfig(shuffle=False,
    ...))`` over the same records, ``start_token_id`` and ``pad_id``.

    Contract: thread-safe, deterministic, and picklable. A pickled source holds
    no tensorstore handle (tensorstore is not fork-safe): it reopens the store
    on first use in each process. Sources over ``memory://`` stores refuse to pickle.

    Args:
        source: a path or URL, a :class:`FlatTokens` split (or view), or
            records (a ``Mixture``'s steps come from ``Loader.to_grain()``).
        seq_len: tokens per record; required for a URL or a ``FlatTokens``,
            and if given for records it must be theirs.
        packing: as ``LoaderConfig.packing`` (default True for a URL or a
            ``FlatTokens``; records bring their own); a ``"bins"`` plan travels
            with the pickled source.
        split: the split to read from a URL.
        plan_cache: where a packing plan built for ``packing="bins"`` is
            cached (``None``: built, not cached).
        options: how to reach the store at a URL (unpickled copies open their
            own ``context``); or its fields as keywords (``**option_fields``).
        start_token_id, pad_id, layout, max_segments, sequence_start,
            source_field, instance_filter, context_parallel: as ``LoaderConfig``'s, for each
            element and :meth:`read_batch` alike (``source`` is 0, the index in
            :attr:`source_names`).

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
        context_parallel: int = 1,
        **option_fields: Any,
    ) -> None:
        start_token_id = fields.token_id(start_token_id, "start_token_id", optional=True)
        pad_id = fields.pad_id(pad_id, "pad_id")
        self.instance_filter = InstanceFilter.of(instance_filter)
        if option_fields or options is not None:
            options = resolve_options(options, option_fields, "FlatTokensSource")
        self.layout = BatchLayout(
            layout, max_segments, sequence_start, source_field, context_parallel
        )
        args = (seq_len, packing, split, options, plan_cache, max_segments)
        records = as_records(source, *args)
        if self.instance_filter is not None:
            self.instance_filter.check_seq_len(records.seq_len, "instance_filter")
        cp = self.layout.context_parallel
        check_context_parallel(cp, records.seq_len, layout, "context_parallel")
        if len(records) == 0:
            raise ValueError(
                f"{records!r} has no records: the split holds fewer than "
                f"seq_len={records.seq_len} tokens or no sequences"
            )
        self.seq_len, self.packing = records.seq_len, records.packing
        self.info: DatasetInfo | None = recorded_info(records)
        config = LoaderConfig(1, self.seq_len, self.packing, start_token_id=start_token_id)
        infos = [("0", self.info)]
        self.start_token_id, self.pad_id = resolve_start_token_id(config, infos), pad_id
        self._records: Records | None = records
        self._decode: tuple[BlockDecoder, RowDecode] | None = None
        self._opener = Reopen.of(records) or Keep(records)
        self._size = len(records)
        self._pid = os.getpid()
        self._lock = threading.Lock()
        # Fixed here and carried through pickling: grain's DataLoader checks a
        # restored checkpoint against repr(source), in whichever process.
        rule = "" if self.instance_filter is None else f", instance_filter={self.instance_filter}"
        shape = "" if self.layout.plain else f", layout={layout!r}, max_segments={max_segments}"
        shape += ", sequence_start=True" if sequence_start else ""
        shape += ", source_field=True" if source_field else ""
        shape += f", context_parallel={cp}" if cp > 1 else ""
        self._repr = (
            f"FlatTokensSource({records!r}, start_token_id={self.start_token_id}, pad_id={pad_id}"
            f"{rule}{shape})"
        )
        prepare_grain()

    def __repr__(self) -> str:
        return self._repr

    @property
    def tokenizer(self) -> TokenizerInfo | None:
        """The tokenizer the data records, ``None`` when it records none."""
        return None if self.info is None else self.info.tokenizer

    @property
    def source_names(self) -> tuple[str, ...]:
        """``("0",)``, as a ``Loader`` of one split names its source."""
        return ("0",)

    @property
    def max_token_id(self) -> int:
        """The largest id in the data (the split's ``max_token_id``)."""
        records = self.records
        ft = getattr(records, "ft", None)
        found = ft.max_token_id if isinstance(ft, FlatTokens) else None
        return int(records.fingerprint()["max_token_id"]) if found is None else found

    @property
    def vocab_size(self) -> int | None:
        """As ``Loader.vocab_size``: the recorded tokenizer's, ``None`` when none is recorded."""
        return recorded_vocab_size([("the source", self.info)])

    def __len__(self) -> int:
        return self._size

    def __getitem__(self, index: SupportsIndex) -> dict[str, np.ndarray]:
        """Record ``index`` (negative counts from the end): five ``[seq_len]`` fields."""
        rows = self.read_batch([integer(index, "FlatTokensSource index")])
        return {key: value[0] for key, value in rows.items()}

    def _getitems(self, indices: Sequence[int]) -> list[dict[str, np.ndarray]]:
        """grain's batched-read hook."""
        rows = self.read_batch(indices)
        return [dict(zip(rows, row, strict=True)) for row in zip(*rows.values(), strict=True)]

    def read_batch(self, indices: Sequence[int] | np.ndarray) -> dict[str, np.ndarray]:
        """Records ``indices`` (``[k]`` ints, negative from the end), stacked, in
        one read: the fields of this source's ``layout``, each ``[k, ...]``."""
        idx = self._indices(indices)
        comp, real = np.zeros(idx.size, np.int64), np.ones(idx.size, bool)
        parts = request_parts([self.records], comp, idx, real)()
        decoder, decode = self._decoding()
        where = f"{self._repr} (rows by record index)"
        sources = row_sources(comp, real)
        return decode.fields(decoder, idx.size, parts, sources, where=where, rows=idx)

    def _decoding(self) -> tuple[BlockDecoder, RowDecode]:
        made = self._decode
        if made is None:
            decoder = BlockDecoder(default_threads())
            filtered = FilteredRows(self.instance_filter, decoder.run_blocks)
            decode = RowDecode(
                (self.packing,),
                self.seq_len,
                self.start_token_id,
                self.pad_id,
                self.layout,
                filtered,
            )
            made = self._decode = (decoder, decode)
        return made

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
                if len(records) != self._size:
                    raise RuntimeError(
                        f"the data changed after {self!r} was made: it had "
                        f"{self._size} records, {records!r} has {len(records)}"
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
        state["_records"], state["_decode"] = None, None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def _indices(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        idx = np.asarray(indices)
        if idx.ndim != 1:
            raise ValueError(f"record indices must be 1-D [k], got shape {idx.shape}")
        if idx.dtype == object:  # ints past 64 bits, or values of mixed kinds
            for i, value in enumerate(idx.tolist()):
                integer(value, f"record indices[{i}]")
        elif idx.size and idx.dtype.kind not in "iu":
            raise TypeError(f"record indices must be integers, got dtype {idx.dtype}")
        n = self._size
        # Compared before any cast: a uint64 or a Python int past int64 would wrap.
        bad = np.flatnonzero((idx >= n) if idx.dtype.kind == "u" else (idx < -n) | (idx >= n))
        if bad.size:
            raise IndexError(
                f"{self!r}: record index {idx[bad[0]]} is outside [-{n}, {n}) ({n} records)"
            )
        idx = idx.astype(np.int64)
        return np.where(idx < 0, idx + n, idx)


def as_records(
    source: str | os.PathLike[str] | FlatTokens | Records,
    seq_len: int | None,
    packing: fields.Packing | bool | str | None,
    split: str,
    options: StoreOptions | None,
    plan_cache: str | os.PathLike[str] | None,
    max_segments: int | None = None,
) -> Records:
    """The records a :class:`FlatTokensSource` reads, checked against what was asked."""
    if isinstance(source, Mixture):
        raise TypeError(
            f"{source!r} is a Mixture, whose records are drawn by step, not by index: "
            "read its steps with Loader(mixture, LoaderConfig(...)).to_grain()"
        )
    asked = None if packing is None else fields.packing(packing, "packing")
    seq_len = fields.seq_len(seq_len, "seq_len", optional=True)
    if isinstance(source, str | os.PathLike):
        source = open_dataset(source, options)[split]
    elif options is not None:
        raise ValueError(f"options apply to a URL only; {source!r} is open already")
    if isinstance(source, FlatTokens):
        if seq_len is None:
            raise ValueError(f"seq_len is required to make records of {source!r}")
        rows = fields.Packing.WINDOWS if asked is None else asked
        check_max_segments(max_segments, seq_len, rows, "max_segments")
        return make_records(source, seq_len, rows, plan_cache, max_segments)
    if isinstance(source, Dataset):
        raise TypeError(
            f"{source!r} is a whole dataset; pick a split: ds[{source.splits[0]!r}] "
            "(or pass the URL with split=...)"
        )
    if not all(hasattr(source, a) for a in ("read", "seq_len", "packing", "__len__")):
        raise TypeError(
            f"expected a path or URL, a FlatTokens or Records, got {type(source).__name__}"
        )
    check_packing(source, "the source")
    records = config_records(
        source,
        source.seq_len if seq_len is None else seq_len,
        source.packing if asked is None else asked,
        plan_cache,
        max_segments,
        "the source",
        "leave seq_len and packing out to use the records' own",
    )
    check_max_segments(max_segments, records.seq_len, records.packing, "max_segments")
    return records
