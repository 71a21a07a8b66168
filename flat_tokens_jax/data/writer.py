"""Writing flat-tokens datasets: streaming appends, bounded memory, atomic finish
(the root group's metadata, which makes a dataset valid, is written last).
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any

import numpy as np

from flat_tokens_jax.core.format import (
    ENCODED_DTYPE,
    LOSS_MASK,
    MASK_DTYPE,
    SEQ_STARTS,
    SPLITS,
    STARTS_DTYPE,
    TOKENS,
    UnknownSplit,
    check_loss_mask,
    encode,
    split_names,
)
from flat_tokens_jax.core.values import sequence
from flat_tokens_jax.store.identity import ATTRIBUTE, DatasetInfo, identity_attribute
from flat_tokens_jax.store.location import claim_location
from flat_tokens_jax.store.options import StoreOptions, resolve_options
from flat_tokens_jax.store.storageformat import (
    PROVISIONAL_SIZE,
    StorageFormat,
    create_array,
    create_digests,
    record_probes,
    write_digests,
)
from flat_tokens_jax.store.store import Store

log = logging.getLogger(__name__)

_MAX_PENDING_WRITES = 4


class _ArrayAppender:
    """Appends to one 1-D array, writing whole shards from a bounded buffer."""

    def __init__(
        self, store: Store, split: str, array: str, dtype: np.dtype, storage_format: StorageFormat
    ) -> None:
        self.wait = store.wait
        self.where = (store, split, array, storage_format)
        self.array = create_array(store, split, array, dtype, storage_format)
        self.digests = create_digests(store, split, array, storage_format)
        self.buffer = np.empty(storage_format.elements(array)[0], dtype)
        self.filled = 0
        self.written = 0
        self.pending: list[Any] = []

    @property
    def size(self) -> int:
        return self.written + self.filled

    def append(self, values: np.ndarray) -> None:
        while values.size:
            take = min(values.size, self.buffer.size - self.filled)
            self.buffer[self.filled : self.filled + take] = values[:take]
            self.filled += take
            values = values[take:]
            if self.filled == self.buffer.size:
                self._flush()

    def _flush(self) -> None:
        if not self.filled:
            return
        end = self.written + self.filled
        if end > PROVISIONAL_SIZE:
            raise ValueError(f"a split may hold at most {PROVISIONAL_SIZE} elements")
        data, self.buffer = self.buffer[: self.filled], np.empty_like(self.buffer)
        self.pending.append(self.array[self.written : end].write(data))
        array, storage_format = self.where[2:]
        self.pending.append(write_digests(self.digests, self.written, data, storage_format, array))
        self.written, self.filled = end, 0
        while len(self.pending) > 2 * _MAX_PENDING_WRITES:  # a shard's and its digests' writes
            self.wait(self.pending.pop(0))

    def settle(self) -> None:
        """Waits for writes in flight, ignoring their outcome (before deleting them)."""
        for f in self.pending:
            try:
                f.result()
            except Exception as e:  # the write is being abandoned anyway
                log.debug("abandoned write failed: %s", e)
        self.pending.clear()

    def finish(self) -> None:
        self._flush()
        for f in self.pending:
            self.wait(f)
        self.pending.clear()
        self.array = self.wait(
            self.array.resize(exclusive_max=[self.written], resize_metadata_only=True)
        )
        count = -(-self.written // self.where[3].elements(self.where[2])[1])
        self.wait(self.digests.resize(exclusive_max=[count], resize_metadata_only=True))
        record_probes(*self.where, self.array)


class _SplitWriter:
    def __init__(self, store: Store, split: str, storage_format: StorageFormat) -> None:
        self.tokens = _ArrayAppender(store, split, TOKENS, ENCODED_DTYPE, storage_format)
        self.starts = _ArrayAppender(store, split, SEQ_STARTS, STARTS_DTYPE, storage_format)
        self.starts.append(np.zeros(1, STARTS_DTYPE))
        self.store, self.split, self.storage_format = store, split, storage_format
        # Made when the split's first sequences come with a loss mask; every
        # later one must agree.
        self.mask: _ArrayAppender | None = None
        self.max_token_id = 0
        self.num_sequences = 0

    @property
    def arrays(self) -> list[_ArrayAppender]:
        return [self.tokens, self.starts, *([self.mask] if self.mask else [])]

    def extend(self, sequences: Sequence[np.ndarray], masks: Sequence[Any] | None) -> None:
        where = f"split {self.split!r}, sequence"
        encoded, starts = encode(sequences, where, self.num_sequences)
        if not sequences:
            return
        offsets, lengths = starts[1:].astype(np.int64), np.diff(starts).astype(np.int64)
        mask = None
        if masks is not None:
            mask = np.concatenate(
                [
                    check_loss_mask(m, int(n), f"{where} {self.num_sequences + i}")
                    for i, (n, m) in enumerate(zip(lengths, masks, strict=True))
                ]
            )
        self._write(encoded, offsets, mask, int(encoded.max()) >> 1)

    def extend_encoded(self, encoded: np.ndarray, lengths: np.ndarray, mask: Any | None) -> None:
        enc = np.asarray(encoded)
        sizes = np.asarray(lengths, np.int64)
        where = f"split {self.split!r}, encoded block at sequence {self.num_sequences}"
        if enc.dtype != ENCODED_DTYPE or enc.ndim != 1:
            raise ValueError(
                f"{where}: expected 1-D uint32 encoded tokens, got {enc.dtype} {enc.shape}"
            )
        if (sizes <= 0).any() or int(sizes.sum()) != enc.size:
            raise ValueError(
                f"{where}: lengths must be positive and sum to the {enc.size} tokens given"
            )
        offsets = np.cumsum(sizes)
        flagged = np.flatnonzero(enc & np.uint32(1))
        if not np.array_equal(flagged, offsets - sizes):
            raise ValueError(f"{where}: start bits do not sit exactly at the sequence starts")
        if not sizes.size:
            return
        checked = None if mask is None else check_loss_mask(mask, enc.size, where)
        self._write(enc, offsets, checked, int(enc.max()) >> 1)

    def _write(
        self, encoded: np.ndarray, offsets: np.ndarray, mask: np.ndarray | None, max_id: int
    ) -> None:
        """Appends checked sequences: ``offsets`` ``[k]`` are their ends within ``encoded``."""
        if self.num_sequences == 0 and mask is not None:
            self.mask = _ArrayAppender(
                self.store, self.split, LOSS_MASK, MASK_DTYPE, self.storage_format
            )
        elif (mask is None) != (self.mask is None):
            given, earlier = ("no", "one") if mask is None else ("a", "none")
            raise ValueError(
                f"split {self.split!r}, sequence {self.num_sequences}: {given} loss mask "
                f"given, but the split's earlier sequences have {earlier}; a split has a "
                "loss mask for every sequence or for none"
            )
        self.tokens.append(encoded)
        if self.mask is not None and mask is not None:
            self.mask.append(mask)
        self.starts.append((offsets + self.tokens.size - encoded.size).astype(STARTS_DTYPE))
        self.max_token_id = max(self.max_token_id, max_id)
        self.num_sequences += offsets.size

    def finish(self) -> None:
        for array in self.arrays:
            array.finish()


def root_attributes(
    attributes: Mapping[str, Any] | None, info: DatasetInfo | None, splits: Sequence[str]
) -> dict[str, Any]:
    """The root group's attributes: ``attributes`` and, under ``"flat_tokens"``,
    ``info`` (an empty one when ``None``: every dataset says what wrote it) and
    the names of its ``splits``; ``ValueError`` if ``attributes`` has that key."""
    given = dict(attributes or {})
    if ATTRIBUTE in given:
        raise ValueError(
            f"attributes may not have the key {ATTRIBUTE!r}: the writer fills it in; "
            "pass info=DatasetInfo(...) instead"
        )
    return {**given, ATTRIBUTE: identity_attribute(info, splits)}


def write_groups(
    store: Store, zarr_format: int, max_token_ids: Mapping[str, int], attributes: Mapping[str, Any]
) -> None:
    """Writes each split's group (with its ``max_token_id``), then the root group,
    which makes the dataset valid: the last write, after every array."""
    for name, max_id in max_token_ids.items():
        store.write_group(name, zarr_format, {"max_token_id": max_id})
    store.write_group("", zarr_format, attributes)


class DatasetWriter:
    """Streams sequences into a new flat-tokens dataset, in about two shards of
    memory per array. The dataset becomes valid only when :meth:`close`
    completes (the ``with`` block ends without an error). A split may store a
    loss mask (``uint8``, one entry per token, 1 where the token is trained on
    as a target): pass one with every sequence of that split, or with none.

    Example:
        >>> with DatasetWriter("memory://doc/example", overwrite=True) as w:
        ...     w.append("train", [1, 2])
        ...     w.extend("validation", [[3, 4, 5]], loss_masks=[[0, 1, 1]])

    Args:
        url: where to write; a local path or a ``file://``, ``memory://``, ``gs://``
            or ``s3://`` URL.
        storage_format: chunking, sharding, compression and zarr version.
        overwrite: replace a flat-tokens dataset, or the leftover of an
            interrupted write, at ``url`` (without it: ``OverwriteNeeded``); a
            ``url`` holding anything else, or claimed by another writer, is
            refused either way (``FileExistsError``).
        options: how to reach the store, or its fields as keywords.
        splits: the splits to create (``train`` and ``validation`` always are),
            each written even if it stays empty.
        attributes: extra JSON attributes for the root group (any key but
            ``"flat_tokens"``).
        info: what made the data (tokenizer, flags, inputs), written under the
            root attribute ``"flat_tokens"``; :attr:`info` may be replaced until
            :meth:`close`.
    """

    def __init__(
        self,
        url: str | os.PathLike[str],
        *,
        storage_format: StorageFormat | None = None,
        overwrite: bool = False,
        options: StoreOptions | None = None,
        splits: Sequence[str] = SPLITS,
        attributes: Mapping[str, Any] | None = None,
        info: DatasetInfo | None = None,
        **option_fields: Any,
    ) -> None:
        self.storage_format = storage_format or StorageFormat()
        names = split_names(sequence(splits, "splits", "a list of split names"))
        root_attributes(attributes, info, names)  # refuses a bad key before anything is written
        self.attributes = dict(attributes or {})
        self.info = info
        self.store = Store(url, resolve_options(options, option_fields, "DatasetWriter"))
        self._claim = claim_location(self.store, overwrite, names)
        try:
            self._splits = {s: _SplitWriter(self.store, s, self.storage_format) for s in names}
        except BaseException:
            self._claim.discard()
            raise
        self._closed = False

    def __repr__(self) -> str:
        return f"DatasetWriter({self.store.url!r})"

    def _split(self, split: str) -> _SplitWriter:
        if self._closed:
            raise ValueError(f"{self!r} is closed")
        try:
            return self._splits[split]
        except KeyError:
            raise UnknownSplit(
                f"unknown split {split!r}; this writer has {tuple(self._splits)}: "
                "name every split it writes in DatasetWriter(splits=...)"
            ) from None

    def append(
        self,
        split: str,
        sequence: Sequence[int] | np.ndarray,
        loss_mask: Sequence[int] | np.ndarray | None = None,
    ) -> None:
        """Appends one sequence, ``[n]`` token ids of any integer dtype, to ``split``.

        ``loss_mask``: ``[n]`` bool or 0/1 integers, 1 where the token is trained
        on as a target; the split's first sequence decides whether it has one.

        Raises:
            ValueError: bad ids, an empty sequence, a bad mask, or a mask given
                to a split written without one (or the reverse).
        """
        masks = None if loss_mask is None else [loss_mask]
        self._split(split).extend([np.asarray(sequence)], masks)

    def extend(
        self,
        split: str,
        sequences: Iterable[Sequence[int] | np.ndarray],
        batch_tokens: int = 1 << 20,
        *,
        loss_masks: Iterable[Sequence[int] | np.ndarray] | None = None,
    ) -> None:
        """Appends many sequences to ``split``, encoding them in batches;
        ``loss_masks``, when given, yields one mask per sequence (see :meth:`append`)."""
        writer = self._split(split)
        batch: list[np.ndarray] = []
        masks: list[Any] = []
        size = 0
        for seq, mask in _paired(sequences, loss_masks, split):
            batch.append(np.asarray(seq))
            masks.append(mask)
            size += batch[-1].size
            if size >= batch_tokens:
                writer.extend(batch, None if loss_masks is None else masks)
                batch, masks, size = [], [], 0
        writer.extend(batch, None if loss_masks is None else masks)

    def extend_encoded(
        self,
        split: str,
        encoded: np.ndarray,
        lengths: np.ndarray,
        loss_mask: np.ndarray | None = None,
    ) -> None:
        """Appends whole sequences already encoded: ``encoded`` ``[n] uint32``
        (start bits set) of ``lengths`` ``[k]`` (positive, summing to ``n``), with
        their concatenated ``loss_mask`` ``[n]`` (see :meth:`append`).

        Raises:
            ValueError: wrong dtype, lengths that do not add up, start bits
                anywhere but at the sequence starts, or a bad or mixed-in mask.
        """
        self._split(split).extend_encoded(encoded, lengths, loss_mask)

    def close(self) -> None:
        """Finishes every split, then marks the dataset valid (the last write);
        on failure deletes what the write created, as :meth:`abort` does."""
        if self._closed:
            return
        self._closed = True
        try:
            for w in self._splits.values():
                w.finish()
            max_ids = {name: w.max_token_id for name, w in self._splits.items()}
            root = root_attributes(self.attributes, self.info, tuple(self._splits))
            write_groups(self.store, self.storage_format.zarr_format, max_ids, root)
        except BaseException:
            self._discard()
            raise
        self._claim.release()
        counts = (
            f"{n} {w.num_sequences} sequences / {w.tokens.size} tokens"
            for n, w in self._splits.items()
        )
        log.info("wrote %s: %s", self.store.url, ", ".join(counts))

    def abort(self) -> None:
        """Gives up: nothing is marked valid, and what was written is deleted."""
        if self._closed:
            return
        self._closed = True
        self._discard()

    def _discard(self) -> None:
        for w in self._splits.values():
            for array in w.arrays:
                array.settle()
        self._claim.discard()

    def __enter__(self) -> DatasetWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def write_dataset(
    url: str | os.PathLike[str],
    splits: Mapping[str, Iterable[Sequence[int] | np.ndarray]],
    *,
    loss_masks: Mapping[str, Iterable[Sequence[int] | np.ndarray]] | None = None,
    **writer_args: Any,
) -> None:
    """Writes a whole dataset: ``splits`` maps split names to iterables of sequences
    (``train`` and ``validation`` written empty when omitted). ``loss_masks``
    maps some of them to one loss mask per sequence. Other keyword arguments
    go to :class:`DatasetWriter`.

    Example:
        >>> write_dataset("memory://doc/masked", {"train": [[1, 2, 3]]},
        ...               loss_masks={"train": [[0, 1, 1]]}, overwrite=True)
    """
    masks = dict(loss_masks or {})
    unknown = sorted(set(masks) - set(splits))
    if unknown:
        raise UnknownSplit(f"loss_masks names splits {unknown} that splits does not have")
    with DatasetWriter(url, splits=tuple(splits), **writer_args) as w:
        for name, seqs in splits.items():
            w.extend(name, seqs, loss_masks=masks.get(name))


_END = object()


def _paired(
    sequences: Iterable[Any], masks: Iterable[Any] | None, split: str
) -> Iterator[tuple[Any, Any]]:
    """``(sequence, mask)`` pairs, the mask ``None`` when ``masks`` is; refuses unequal counts."""
    if masks is None:
        yield from ((seq, None) for seq in sequences)
        return
    for i, (seq, mask) in enumerate(itertools.zip_longest(sequences, masks, fillvalue=_END)):
        if seq is _END or mask is _END:
            more = "loss masks than sequences" if seq is _END else "sequences than loss masks"
            raise ValueError(f"split {split!r}: more {more} (the first unmatched is number {i})")
        yield seq, mask
