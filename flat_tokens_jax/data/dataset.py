"""Opening flat-tokens datasets and reading their splits."""

from __future__ import annotations

import copy
import functools
import itertools
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from flat_tokens_jax.core import fields
from flat_tokens_jax.core.concurrently import at_once
from flat_tokens_jax.core.format import (
    ENCODED_DTYPE,
    LEGACY_TOKENS,
    LOSS_MASK,
    SEQ_STARTS,
    SPLITS,
    STARTS_DTYPE,
    TOKENS,
    FormatError,
    UnknownSplit,
    as_index,
    as_indices,
    decode,
)
from flat_tokens_jax.core.values import BadValue
from flat_tokens_jax.data.splitfractions import split_boundaries
from flat_tokens_jax.store.arrays import ArrayReader, Pending
from flat_tokens_jax.store.digests import DIGESTS, ChunkDigests
from flat_tokens_jax.store.identity import DatasetInfo, dataset_splits
from flat_tokens_jax.store.integrity import CheckedArray
from flat_tokens_jax.store.options import StoreOptions, resolve_options
from flat_tokens_jax.store.probes import ShardProbes
from flat_tokens_jax.store.store import (
    V2_ARRAY,
    V2_ATTRS,
    V2_GROUP,
    V3_META,
    Store,
    describe_storage_format,
)


class _Unread:
    """The :attr:`FlatTokens.info` of a split opened on its own, until opening reads it."""


class FlatTokens:
    """One split of a dataset: ``encoded_tokens``, ``seq_starts`` and ``max_token_id``.

    ``check_end=False`` skips reading the first and last ``seq_starts`` entries
    on open (:func:`validate` checks them while streaming). Reads check what is
    cheap to check: the ``seq_starts`` entries read lie in the split's tokens
    and strictly increase, else :class:`FormatError` names the entry. Reads are
    thread-safe; every method that takes many indices or ranges requests them
    all before waiting.
    ``info`` is the dataset's :class:`DatasetInfo` when the caller has read it
    (:class:`Dataset` does); otherwise opening reads it: a dataset that records
    what made it must record its arrays' shard probes and chunk digests
    (:meth:`~flat_tokens_jax.store.integrity.CheckedArray.open`).

    Attributes:
        encoded, starts, loss_mask: the split's arrays' readers (``loss_mask``
            ``None`` where none is stored); reads made through them directly
            are not checked.
        checked: each array's reads with its integrity checks
            (:class:`~flat_tokens_jax.store.integrity.CheckedArray`), by array
            name: every read of this class goes through them.
    """

    def __init__(
        self,
        store: Store,
        split: str,
        *,
        check_end: bool = True,
        info: DatasetInfo | type[_Unread] | None = _Unread,
    ) -> None:
        self._info = info
        found = store.group_attributes(split)
        if found is None:
            raise FormatError(f"{store.url}: split {split!r} is missing (no zarr group {split}/)")
        self.store, self.split_name = store, split
        self.zarr_format, attrs = found
        self.max_token_id = _max_token_id(attrs, f"{store.url}/{split}")
        self.tokens_name = TOKENS
        meta = store.array_metadata(f"{split}/{TOKENS}")
        if meta is None:
            meta = store.array_metadata(f"{split}/{LEGACY_TOKENS}")
            self.tokens_name = LEGACY_TOKENS
        starts_meta = store.array_metadata(f"{split}/{SEQ_STARTS}")
        if meta is None or starts_meta is None:
            missing = TOKENS if meta is None else SEQ_STARTS
            raise FormatError(f"{store.url}/{split}: array {missing!r} is missing")
        self.metadata = {self.tokens_name: meta, SEQ_STARTS: starts_meta}
        self.encoded: ArrayReader = store.open_array(f"{split}/{self.tokens_name}", *meta)
        self.starts: ArrayReader = store.open_array(f"{split}/{SEQ_STARTS}", *starts_meta)
        mask_meta = store.array_metadata(f"{split}/{LOSS_MASK}")
        self.loss_mask: ArrayReader | None = (
            None if mask_meta is None else store.open_array(f"{split}/{LOSS_MASK}", *mask_meta)
        )
        arrays = [(self.tokens_name, meta, self.encoded), (SEQ_STARTS, starts_meta, self.starts)]
        if mask_meta is not None and self.loss_mask is not None:
            arrays.append((LOSS_MASK, mask_meta, self.loss_mask))
        ours = self.info is not None
        self.checked = {
            name: CheckedArray.open(
                store, f"{split}/{name}", reader, found[1].get("attributes") or {}, ours=ours
            )
            for name, found, reader in arrays
        }
        self._check_shapes(check_end)
        self.seq_range = (0, self.starts.size - 1)
        self.token_range = (0, self.encoded.size)

    def _check_shapes(self, check_end: bool) -> None:
        where = f"{self.store.url}/{self.split_name}"
        for name, arr, dtype in (
            (self.tokens_name, self.encoded, ENCODED_DTYPE),
            (SEQ_STARTS, self.starts, STARTS_DTYPE),
        ):
            if arr.dtype != dtype:
                raise FormatError(f"{where}/{name}: dtype is {arr.dtype}, expected {dtype}")
        if self.starts.size < 1:
            raise FormatError(f"{where}/{SEQ_STARTS}: empty; it needs num_sequences + 1 entries")
        if check_end:
            ends = np.array([0, self.starts.size - 1])
            first, last = self.checked[SEQ_STARTS].read_points(ends).tolist()
            if first != 0:
                raise FormatError(f"{where}/{SEQ_STARTS}[0]: first entry is {first}, expected 0")
            if last != self.encoded.size:
                raise FormatError(
                    f"{where}/{SEQ_STARTS}[{self.starts.size - 1}]: last entry is {last}, "
                    f"expected the token count {self.encoded.size}"
                )
        if self.loss_mask is not None and self.loss_mask.size != self.encoded.size:
            raise FormatError(
                f"{where}/{LOSS_MASK}: {self.loss_mask.size} entries, expected "
                f"one per token ({self.encoded.size})"
            )

    def __repr__(self) -> str:
        view = (
            ""
            if self.seq_range == (0, self.starts.size - 1)
            else (f", sequences={list(self.seq_range)}")
        )
        return (
            f"FlatTokens({self.store.url!r}, split={self.split_name!r}{view}, "
            f"num_tokens={self.num_tokens}, num_sequences={self.num_sequences})"
        )

    @property
    def url(self) -> str:
        return self.store.url

    @property
    def info(self) -> DatasetInfo | None:
        """What made the dataset this split belongs to; ``None`` when it does not say."""
        if self._info is _Unread:
            self._info = read_info(self.store)
        return self._info  # type: ignore[return-value]

    @property
    def probes(self) -> dict[str, ShardProbes | None]:
        """Each array's shard probes, by array name; ``None`` where it records none."""
        return {name: c.probes for name, c in self.checked.items()}

    @property
    def digests(self) -> dict[str, ChunkDigests | None]:
        """Each array's chunk digests, by array name; ``None`` where it records none."""
        return {name: c.digests for name, c in self.checked.items()}

    @property
    def bytes_read(self) -> int:
        """Bytes requested so far from this split's arrays (tokens, starts, mask)
        for the data read; the checks' reads are :attr:`probe_bytes`."""
        return sum(c.data_bytes for c in self.checked.values())

    @property
    def probe_bytes(self) -> int:
        """Bytes read to check shard probes (one small read per shard, once) and
        chunk digests (the recorded digests of each shard touched, once; each
        chunk touched, whole, once, where it carries no crc32c)."""
        return sum(c.check_bytes for c in self.checked.values())

    @property
    def num_tokens(self) -> int:
        return self.token_range[1] - self.token_range[0]

    @property
    def num_sequences(self) -> int:
        return self.seq_range[1] - self.seq_range[0]

    def tokens(self, start: int, stop: int) -> np.ndarray:
        """Decoded token ids ``[stop - start] int32`` of tokens ``[start, stop)``."""
        return decode(self.encoded_ranges([start], [stop])[0])

    def encoded_ranges(
        self, starts: Sequence[int] | np.ndarray, stops: Sequence[int] | np.ndarray
    ) -> list[np.ndarray]:
        """Encoded tokens (``uint32``) of each range ``[starts[i], stops[i])``, read at once."""
        return self.request_encoded(starts, stops).result()

    def request_encoded(
        self, starts: Sequence[int] | np.ndarray, stops: Sequence[int] | np.ndarray
    ) -> Pending:
        """Starts reading the ranges of :meth:`encoded_ranges`; ``.result()`` waits."""
        lo, hi = as_indices(starts, "token range starts"), as_indices(stops, "token range stops")
        if lo.size != hi.size:
            raise ValueError(f"{lo.size} range starts but {hi.size} stops")
        bad = np.flatnonzero((lo < 0) | (hi < lo) | (hi > self.num_tokens))
        if bad.size:
            i = int(bad[0])
            raise IndexError(
                f"{self!r}: token range [{lo[i]}, {hi[i]}) is outside [0, {self.num_tokens})"
            )
        base = self.token_range[0]
        return self.checked[self.tokens_name].request_ranges(lo + base, hi + base)

    def request_loss_mask(self, starts: np.ndarray, stops: np.ndarray) -> Pending | None:
        """Starts reading the stored loss mask (``uint8``) of token ranges; ``None`` if none."""
        if self.loss_mask is None:
            return None
        base = self.token_range[0]
        lo, hi = np.asarray(starts, np.int64) + base, np.asarray(stops, np.int64) + base
        return self.checked[LOSS_MASK].request_ranges(lo, hi)

    def request_encoded_and_mask(
        self,
        starts: Sequence[int] | np.ndarray,
        stops: Sequence[int] | np.ndarray,
        mask_starts: np.ndarray,
        mask_stops: np.ndarray,
    ) -> tuple[Pending, Pending | None]:
        """:meth:`request_encoded` of ``[starts, stops)`` and
        :meth:`request_loss_mask` of ``[mask_starts, mask_stops)``: both return
        before any value arrives, so their reads, and those of the checks of
        their first touches (shard probes, chunk digests), share round trips."""
        return self.request_encoded(starts, stops), self.request_loss_mask(mask_starts, mask_stops)

    def sequence_bounds(self, indices: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(starts, stops)`` token offsets ``[k] int64`` of sequences ``indices``, one read."""
        idx = as_indices(indices, "sequence indices")
        bad = np.flatnonzero((idx < 0) | (idx >= self.num_sequences))
        if bad.size:
            raise IndexError(
                f"{self!r}: sequence index {idx[bad[0]]} is outside [0, {self.num_sequences})"
            )
        at = idx + self.seq_range[0]
        both = self.checked[SEQ_STARTS].read_points(np.concatenate([at, at + 1])).astype(np.int64)
        self.check_bounds(np.concatenate([at, at + 1]), both, idx.size)
        both -= self.token_range[0]
        return both[: idx.size], both[idx.size :]

    def check_bounds(self, at: np.ndarray, values: np.ndarray, k: int) -> None:
        """Raises :class:`FormatError` unless ``values`` (``seq_starts[at]``: ``k``
        starts, their ``k`` stops, then any others) lie in this view's tokens and
        each stop is above its start, so that corrupt bounds never read as rows."""
        lo, hi = self.token_range
        bad = np.flatnonzero((values < lo) | (values > hi))
        if bad.size:
            i = int(bad[0])
            raise FormatError(
                f"{self.store.url}/{self.split_name}/{SEQ_STARTS}[{at[i]}]: entry "
                f"{int(values[i])} is outside the tokens [{lo}, {hi}]: the store is corrupt"
            )
        back = np.flatnonzero(values[k : 2 * k] <= values[:k])
        if back.size:
            i = int(back[0])
            raise FormatError(
                f"{self.store.url}/{self.split_name}/{SEQ_STARTS}[{at[k + i]}]: entry "
                f"{int(values[k + i])} is not above the entry before it ({int(values[i])}); "
                "sequences are never empty: the store is corrupt"
            )

    def sequences(self, indices: Sequence[int] | np.ndarray) -> list[np.ndarray]:
        """Decoded token ids (``int32``) of each sequence in ``indices``.

        Two batched requests: the bounds of every sequence, then every token range.
        """
        lo, hi = self.sequence_bounds(indices)
        return [decode(e) for e in self.encoded_ranges(lo, hi)]

    def split(self, fractions: str | Sequence[float]) -> tuple[FlatTokens, ...]:
        """Contiguous sequence-range views, e.g. ``ft.split("949,50,1")`` -> (train, valid, test).

        Sizes follow Megatron's rule (also Nanoset's): weights are normalised,
        each boundary is the previous one plus ``round(weight * num_sequences)``,
        and every boundary after the first is shifted so the last equals
        ``num_sequences``. A view works wherever a ``FlatTokens`` does; packed
        records of a view never cross its ends.

        Raises:
            ValueError: a weight that is no finite non-negative number, or no
                positive sum, naming ``fractions`` and the form to write.
        """
        bounds = split_boundaries(fractions, self.num_sequences)
        return tuple(self.view(a, b) for a, b in itertools.pairwise(bounds))

    def view(self, first: int, stop: int) -> FlatTokens:
        """Sequences ``[first, stop)`` of this split (or view) as a ``FlatTokens``."""
        first, stop = as_index(first, "first"), as_index(stop, "stop")
        if not 0 <= first <= stop <= self.num_sequences:
            raise IndexError(
                f"{self!r}: sequence range [{first}, {stop}) is outside [0, {self.num_sequences}]"
            )
        at = np.array([first, stop], np.int64) + self.seq_range[0]
        both = self.checked[SEQ_STARTS].read_points(at).astype(np.int64)
        # An empty view reads one entry twice: only its range can be checked.
        self.check_bounds(at, both, 1 if stop > first else 0)
        lo, hi = both.tolist()
        out = copy.copy(self)
        out.seq_range = (int(at[0]), int(at[1]))
        out.token_range = (lo, hi)
        return out

    def storage_formats(self) -> dict[str, dict[str, Any]]:
        """Per array, its storage format: zarr version, chunk and shard sizes, compression."""
        return {
            name: describe_storage_format(fmt, meta) for name, (fmt, meta) in self.metadata.items()
        }


class Dataset(Mapping[str, FlatTokens]):
    """A flat-tokens dataset: a zarr group whose splits are :class:`FlatTokens`.

    ``dataset["train"]``; ``splits`` lists those present: ``train``, ``validation``,
    then the extra ones its root attributes record (``flat_tokens.splits``).
    """

    def __init__(self, store: Store) -> None:
        store.prefetch_json(_metadata_keys(3, SPLITS))
        if store.read_json(V3_META) is None:
            store.prefetch_json(_metadata_keys(2, SPLITS))
        found = store.group_attributes("")
        if found is None:
            raise FormatError(
                f"{store.url}: no flat-tokens dataset here (no zarr group metadata at its root); "
                "the bucket or path is wrong, or a write to it did not finish"
            )
        self.store = store
        self.zarr_format, self.attributes = found
        self.info = DatasetInfo.from_attributes(self.attributes, store.url)
        """What made the dataset (tokenizer, flags, inputs); ``None`` when it does not say."""
        names = dataset_splits(self.attributes, store.url)
        store.prefetch_json(_metadata_keys(self.zarr_format, names[len(SPLITS) :]))
        present = [s for s in names if store.group_attributes(s) is not None]
        opened = at_once([functools.partial(FlatTokens, store, s, info=self.info) for s in present])
        self._splits = dict(zip(present, opened, strict=True))
        if not self._splits:
            raise FormatError(
                f"{store.url}: the group holds none of its splits ({', '.join(names)})"
            )

    @property
    def url(self) -> str:
        return self.store.url

    @property
    def splits(self) -> tuple[str, ...]:
        return tuple(self._splits)

    def __getitem__(self, split: str) -> FlatTokens:
        try:
            return self._splits[split]
        except KeyError:
            hint = {"valid": "validation", "val": "validation"}.get(split)
            fix = f": use {hint!r}" if hint in self._splits else ""
            raise UnknownSplit(
                f"{self.url} has no split {split!r}; it has {', '.join(self.splits)}{fix}"
            ) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._splits)

    def __len__(self) -> int:
        return len(self._splits)

    def __repr__(self) -> str:
        return f"Dataset({self.url!r}, splits={self.splits})"


def _metadata_keys(zarr_format: int, splits: Sequence[str]) -> list[str]:
    """The metadata that opening ``splits`` of a dataset of ``zarr_format``
    reads: the root's, each split's, and those of each split's arrays and their
    side arrays of digests (zarr v3: and the v2 metadata looked for next where
    a split has no loss mask)."""
    group, array = (
        ([V3_META], [V3_META]) if zarr_format == 3 else ([V2_GROUP, V2_ATTRS], [V2_ARRAY, V2_ATTRS])
    )
    keys = list(group)
    for split in splits:
        keys += [f"{split}/{key}" for key in group]
        for name in (TOKENS, SEQ_STARTS, LOSS_MASK):
            for folder in (f"{split}/{name}", f"{split}/{name}/{DIGESTS}"):
                keys += [f"{folder}/{key}" for key in array]
        if zarr_format == 3:
            keys.append(f"{split}/{LOSS_MASK}/{V2_ARRAY}")
    return keys


def read_info(store: Store) -> DatasetInfo | None:
    """The :class:`DatasetInfo` in the root attributes at ``store``; ``None`` if none.

    Raises:
        FormatError: no root group, or a malformed ``"flat_tokens"`` attribute.
    """
    found = store.group_attributes("")
    if found is None:
        raise FormatError(f"{store.url}: no zarr group metadata at the root")
    return DatasetInfo.from_attributes(found[1], store.url)


def open_dataset(
    url: str | os.PathLike[str], options: StoreOptions | None = None, **option_fields: Any
) -> Dataset:
    """Opens the flat-tokens dataset at ``url`` for reading.

    Args:
        url: a local path, or a ``file://``, ``memory://``, ``gs://`` or ``s3://`` URL.
        options: how to reach the store (endpoint, region, credentials, context).
        **option_fields: the same fields as keywords, e.g. ``endpoint=...``.

    Raises:
        FormatError: nothing valid at ``url``, or an array that breaks the format.
    """
    return Dataset(Store(url, resolve_options(options, option_fields, "open_dataset")))


def _max_token_id(attrs: Mapping[str, Any], where: str) -> int:
    value = attrs.get("max_token_id")
    if value is None:
        raise FormatError(f"{where}: attribute 'max_token_id' is missing")
    try:
        out: int = fields.token_id(value, "attribute max_token_id")
    except BadValue as e:
        raise FormatError(f"{where}: {e}") from None
    return out
