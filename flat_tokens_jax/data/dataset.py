"""Opening flat-tokens datasets, reading their splits and cutting them by fractions."""

from __future__ import annotations

import copy
import functools
import itertools
import math
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
    indices_below,
)
from flat_tokens_jax.core.values import BadValue, number
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


class FlatTokens:
    """One split of a dataset: ``encoded_tokens``, ``seq_starts`` and ``max_token_id``.

    Reads are thread-safe, request all their ranges before waiting, and go
    through ``checked`` (each array's :class:`CheckedArray`, by name); reads
    through the readers ``encoded``, ``starts``, ``loss_mask`` (``None``: no
    mask stored) are not checked. ``check_end=False`` skips reading the first
    and last ``seq_starts`` entries on open (:func:`validate` checks them).
    ``info`` is the dataset's :class:`DatasetInfo` (``None``: it records none);
    a dataset that records it must record its arrays' probes and digests.
    """

    def __init__(
        self,
        store: Store,
        split: str,
        *,
        check_end: bool = True,
        info: DatasetInfo | None,
    ) -> None:
        self.info = info
        found = store.group_attributes(split)
        if found is None:
            raise FormatError(f"{store.url}: split {split!r} is missing (no zarr group {split}/)")
        self.store, self.split_name = store, split
        self.zarr_format, attrs = found
        value = attrs.get("max_token_id")
        if value is None:
            raise FormatError(f"{store.url}/{split}: attribute 'max_token_id' is missing")
        try:
            self.max_token_id: int = fields.token_id(value, "attribute max_token_id")
        except BadValue as e:
            raise FormatError(f"{store.url}/{split}: {e}") from None
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
        whole = self.seq_range == (0, self.starts.size - 1)
        view = "" if whole else f", sequences={list(self.seq_range)}"
        return (
            f"FlatTokens({self.store.url!r}, split={self.split_name!r}{view}, "
            f"num_tokens={self.num_tokens}, num_sequences={self.num_sequences})"
        )

    @property
    def url(self) -> str:
        return self.store.url

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
        """Bytes of data requested so far from this split's arrays (not the checks')."""
        return sum(c.data_bytes for c in self.checked.values())

    @property
    def probe_bytes(self) -> int:
        """Bytes read to check shard probes and chunk digests."""
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
        """Starts reading the stored loss mask (``uint8``) of token ranges; ``None`` if none.

        Requested with :meth:`request_encoded` before waiting on either, their
        reads (and those of their first touches' checks) share round trips."""
        if self.loss_mask is None:
            return None
        base = self.token_range[0]
        lo, hi = np.asarray(starts, np.int64) + base, np.asarray(stops, np.int64) + base
        return self.checked[LOSS_MASK].request_ranges(lo, hi)

    def sequence_bounds(self, indices: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(starts, stops)`` token offsets ``[k] int64`` of sequences ``indices``, one read."""
        idx = indices_below(indices, self.num_sequences, "sequence", self)
        at = idx + self.seq_range[0]
        both = self.checked[SEQ_STARTS].read_points(np.concatenate([at, at + 1])).astype(np.int64)
        self.check_bounds(np.concatenate([at, at + 1]), both, idx.size)
        both -= self.token_range[0]
        return both[: idx.size], both[idx.size :]

    def starts_inside(self, lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The sequence starts strictly inside token ranges ``(lo[i], hi[i])``, as
        ``(range, offset)`` ``[m] int64``, ascending: from ``seq_starts`` alone,
        a search of a few batched point reads, then one read of the entries found."""
        lo, hi = np.asarray(lo, np.int64), np.asarray(hi, np.int64)
        first, stop = np.split(self._entries_above(np.concatenate([lo, hi - 1])), 2)
        found = self.checked[SEQ_STARTS].request_ranges(first, np.maximum(first, stop)).result()
        counts = np.maximum(stop - first, 0)
        row = np.repeat(np.arange(lo.size, dtype=np.int64), counts)
        offset = np.concatenate([np.zeros(0, np.int64), *found]).astype(np.int64)
        offset -= self.token_range[0]
        bad = np.flatnonzero((offset <= lo[row]) | (offset >= hi[row]))
        if bad.size:
            raise FormatError(
                f"{self.store.url}/{self.split_name}/{SEQ_STARTS}: entries are not "
                "ascending (a search for token offsets found one outside its range): "
                "the store is corrupt"
            )
        return row, offset

    def _entries_above(self, tokens: np.ndarray) -> np.ndarray:
        """The first ``seq_starts`` index of this view whose entry is above each
        of ``tokens`` (view offsets; past the view's last entry when none is):
        each round reads 16 entries a token, cutting its interval 16-fold."""
        a, b = self.seq_range
        t = tokens + self.token_range[0]
        lo, hi = np.full(t.size, a, np.int64), np.full(t.size, b + 1, np.int64)
        probes = np.arange(16, dtype=np.int64)
        while (open_ := np.flatnonzero(hi > lo)).size:
            at = lo[open_, None] + (hi - lo)[open_, None] * probes // probes.size
            unique, inverse = np.unique(at, return_inverse=True)
            values = self.checked[SEQ_STARTS].read_points(unique).astype(np.int64)
            below = (values[inverse.reshape(at.shape)] <= t[open_, None]).sum(axis=1)
            rows = np.arange(open_.size)
            lo[open_] = np.where(below > 0, at[rows, below - 1] + 1, lo[open_])
            hi[open_] = np.where(below < probes.size, at[rows, np.minimum(below, 15)], hi[open_])
        return lo

    def check_bounds(self, at: np.ndarray, values: np.ndarray, k: int) -> None:
        """Raises :class:`FormatError` unless ``values`` (``seq_starts[at]``: ``k``
        starts, their ``k`` stops, then any others) lie in this view's tokens and
        each stop is above its start."""
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
        """Decoded token ids (``int32``) of each sequence in ``indices``, two batched requests."""
        lo, hi = self.sequence_bounds(indices)
        return [decode(e) for e in self.encoded_ranges(lo, hi)]

    def split(self, fractions: str | Sequence[float]) -> tuple[FlatTokens, ...]:
        """Contiguous views cut by Megatron's rule (:func:`split_boundaries`),
        e.g. ``ft.split("949,50,1")`` -> (train, valid, test); packed records of
        a view never cross its ends."""
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
    """A flat-tokens dataset: a zarr group whose splits are :class:`FlatTokens`,
    ``dataset["train"]``: ``train``, ``validation``, then the extra ones its root
    attributes record (``flat_tokens.splits``)."""

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
    """The metadata keys that opening ``splits`` reads (v3: with the v2 key
    looked for where a split has no loss mask)."""
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


def open_dataset(
    url: str | os.PathLike[str], options: StoreOptions | None = None, **option_fields: Any
) -> Dataset:
    """Opens the flat-tokens dataset at ``url`` for reading.

    Args:
        url: a local path, or a ``file://``, ``memory://``, ``gs://`` or ``s3://`` URL.
        options: how to reach the store (endpoint, region, credentials, context),
            or its fields as keywords, e.g. ``endpoint=...``.

    Raises:
        FormatError: nothing valid at ``url``, or an array that breaks the format.
    """
    return Dataset(Store(url, resolve_options(options, option_fields, "open_dataset")))


_FORM = "write non-negative numbers with a positive sum, such as '949,50,1'"


def split_boundaries(fractions: str | Sequence[float], n: int) -> list[int]:
    """Boundaries ``[0, ..., n]`` of a Megatron-style split of ``n`` items.

    ``fractions`` are weights: a string of numbers separated by ``,`` or ``/``,
    or a sequence of numbers. Sizes follow Megatron's rule (also Nanoset's):
    weights are normalised, each boundary is the previous one plus
    ``round(weight * n)``, and every boundary after the first is shifted so the
    last equals ``n``.

    Example:
        >>> split_boundaries("949,50,1", 1000)
        [0, 949, 999, 1000]

    Raises:
        ValueError: naming ``fractions``, the weight at fault and the form to
            write: no number, negative, infinite or NaN, or no positive sum.
    """
    where = f"split fractions {fractions!r}"
    if isinstance(fractions, str):
        pieces: list[Any] = [p for p in fractions.replace("/", ",").split(",") if p.strip()]
    else:
        try:
            pieces = list(fractions)
        except TypeError:
            raise ValueError(f"{where}: expected a string or a list of numbers; {_FORM}") from None
    weights = []
    for i, piece in enumerate(pieces):
        try:
            weights.append(number(float(piece) if isinstance(piece, str) else piece, "", low=0))
        except ValueError:
            raise ValueError(
                f"{where}: weight {i} ({piece!r}) is not a finite non-negative number; {_FORM}"
            ) from None
    total = sum(weights)  # Megatron's sum, so that rounding matches it
    if not weights or not 0 < total < math.inf:
        raise ValueError(f"{where}: the weights sum to {total:g}; {_FORM}")
    bounds = [0]
    for w in weights:
        bounds.append(bounds[-1] + round(w / total * float(n)))
    excess = bounds[-1] - n
    return [bounds[0], *(b - excess for b in bounds[1:])]
