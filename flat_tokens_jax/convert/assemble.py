"""Joining the parts of a distributed conversion into one dataset: :func:`place_parts`
once, :func:`assemble_shard` once per output shard (each shard written whole by one
task, so a retry writes the same bytes), then :func:`finish`. The result is, byte
for byte, what :class:`DatasetWriter` writes from the parts' sequences in order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import numpy as np

from flat_tokens_jax.core.format import (
    ENCODED_DTYPE,
    LOSS_MASK,
    MASK_DTYPE,
    SEQ_STARTS,
    STARTS_DTYPE,
    TOKENS,
)
from flat_tokens_jax.data.dataset import Dataset, open_dataset
from flat_tokens_jax.data.writer import root_attributes, write_groups
from flat_tokens_jax.store.arrays import Pending
from flat_tokens_jax.store.identity import DatasetInfo
from flat_tokens_jax.store.location import MARKER, STAGING
from flat_tokens_jax.store.options import StoreOptions
from flat_tokens_jax.store.storageformat import (
    StorageFormat,
    create_array,
    create_digests,
    open_digests,
    open_for_writing,
    record_probes,
    write_digests,
)
from flat_tokens_jax.store.store import Store

DTYPES: dict[str, np.dtype[Any]] = {
    TOKENS: ENCODED_DTYPE,
    SEQ_STARTS: STARTS_DTYPE,
    LOSS_MASK: MASK_DTYPE,
}


def part_url(output: str, index: int, attempt: str) -> str:
    """Where the part of input ``index`` goes; ``attempt`` keeps retries apart."""
    return f"{output.rstrip('/')}/{STAGING}/parts/{index:08d}-{attempt}"


class SplitCounts(NamedTuple):
    """What one split of a part holds."""

    sequences: int
    tokens: int
    max_token_id: int
    loss_mask: bool


@dataclasses.dataclass(frozen=True)
class PartInfo:
    """One part: its input's position (parts join in this order), its dataset, its
    counts, its input's skipped records and the SHA-256 digests of its files (if
    computed), in the order the output's info combines them."""

    index: int
    url: str
    splits: Mapping[str, SplitCounts]
    skipped_empty: int = 0
    skipped_bad: int = 0
    digests: tuple[str, ...] | None = None

    @classmethod
    def read(
        cls, index: int, url: str, options: StoreOptions | None = None, **rest: Any
    ) -> PartInfo:
        """The part written at ``url``, with ``rest`` of its fields (skipped counts, digests)."""
        ds = open_dataset(url, options)
        splits = {
            name: SplitCounts(
                ft.num_sequences, ft.num_tokens, ft.max_token_id, ft.loss_mask is not None
            )
            for name, ft in ds.items()
        }
        return cls(index, url, splits, **rest)


class Task(NamedTuple):
    """One output shard: shard number ``shard`` of array ``array`` of ``split``."""

    split: str
    array: str
    shard: int


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where each part's tokens and sequences go in the output. Picklable.

    ``token_offsets``: per split, ``[len(parts) + 1] int64``: part ``p``'s tokens
    are output tokens ``[token_offsets[p], token_offsets[p + 1])``;
    ``sequence_offsets`` the same for sequences.
    """

    output: str
    storage_format: StorageFormat
    parts: tuple[PartInfo, ...]
    token_offsets: Mapping[str, np.ndarray]
    sequence_offsets: Mapping[str, np.ndarray]

    @property
    def splits(self) -> tuple[str, ...]:
        return tuple(self.token_offsets)

    def num_tokens(self, split: str) -> int:
        return int(self.token_offsets[split][-1])

    def num_sequences(self, split: str) -> int:
        return int(self.sequence_offsets[split][-1])

    def arrays(self, split: str) -> dict[str, int]:
        """The output arrays of ``split`` and their sizes."""
        sizes = {TOKENS: self.num_tokens(split), SEQ_STARTS: self.num_sequences(split) + 1}
        if any(p.splits[split].loss_mask for p in self.parts):
            sizes[LOSS_MASK] = self.num_tokens(split)
        return sizes

    def max_token_ids(self) -> dict[str, int]:
        return {s: max(p.splits[s].max_token_id for p in self.parts) for s in self.splits}

    def tasks(self) -> list[Task]:
        """One task per shard of every output array."""
        out: list[Task] = []
        for split in self.splits:
            for array, size in self.arrays(split).items():
                per_shard = self.storage_format.elements(array)[0]
                out.extend(Task(split, array, k) for k in range(-(-size // per_shard)))
        return out


def place_parts(output: str, storage_format: StorageFormat, parts: list[PartInfo]) -> Placement:
    """The :class:`Placement` of ``parts`` (in any order; they are sorted by index)."""
    ordered = tuple(sorted(parts, key=lambda p: p.index))
    if not ordered:
        raise ValueError("no parts to assemble")
    indexes = [p.index for p in ordered]
    if len(set(indexes)) != len(indexes):
        raise ValueError(f"parts repeat an index: {indexes}")
    names = tuple(ordered[0].splits)
    for p in ordered:
        if tuple(p.splits) != names:
            raise ValueError(f"part {p.url} has splits {tuple(p.splits)}, not {names}")
    token_offsets, sequence_offsets = {}, {}
    for split in names:
        counts = [p.splits[split] for p in ordered]
        masked = {c.loss_mask for c in counts if c.sequences}
        if len(masked) > 1:
            raise ValueError(f"split {split!r}: some parts have a loss mask and some do not")
        token_offsets[split] = np.cumsum([0] + [c.tokens for c in counts], dtype=np.int64)
        sequence_offsets[split] = np.cumsum([0] + [c.sequences for c in counts], dtype=np.int64)
    return Placement(output, storage_format, ordered, token_offsets, sequence_offsets)


def create_arrays(placement: Placement, store: Store) -> None:
    """Creates every output array at its final size, replacing any left from a failed try."""
    for split in placement.splits:
        for array, size in placement.arrays(split).items():
            create_array(store, split, array, DTYPES[array], placement.storage_format, size)
            create_digests(store, split, array, placement.storage_format, size)


def _overlaps(offsets: np.ndarray, lo: int, hi: int) -> list[tuple[int, int, int]]:
    """``(part, start, stop)`` of the non-empty parts whose range meets ``[lo, hi)``,
    with ``[start, stop)`` the overlap in the part's own positions."""
    first = int(np.searchsorted(offsets, lo, side="right")) - 1
    last = int(np.searchsorted(offsets, hi, side="left"))
    out = []
    for p in range(max(first, 0), min(last, offsets.size - 1)):
        a, b = max(lo, int(offsets[p])), min(hi, int(offsets[p + 1]))
        if a < b:
            out.append((p, a - int(offsets[p]), b - int(offsets[p])))
    return out


def _request(
    placement: Placement,
    split: str,
    array: str,
    lo: int,
    hi: int,
    open_part: Callable[[str], Dataset],
) -> tuple[list[Pending], list[int]]:
    """Reads in flight for output elements ``[lo, hi)`` (``hi`` at most the part
    data's end), and what to add to each read's values."""
    pending, add = [], []
    offsets = (
        placement.sequence_offsets[split] if array == SEQ_STARTS else placement.token_offsets[split]
    )
    for p, a, b in _overlaps(offsets, lo, hi):
        ft = open_part(placement.parts[p].url)[split]
        span = (np.array([a]), np.array([b]))
        if array == SEQ_STARTS:
            pending.append(ft.starts.request_ranges(*span))
            add.append(int(placement.token_offsets[split][p]))
        elif array == LOSS_MASK:
            got = ft.request_loss_mask(*span)
            if got is None:
                raise ValueError(f"part {ft.url}, split {split!r}: no loss mask")
            pending.append(got)
            add.append(0)
        else:
            pending.append(ft.request_encoded(*span))
            add.append(0)
    return pending, add


def assemble_shard(
    placement: Placement, task: Task, store: Store, open_part: Callable[[str], Dataset]
) -> int:
    """Writes the output shard of ``task`` whole, from the parts (opened by
    ``open_part``, which may cache); returns its elements.

    Raises IndexError or ValueError when a part holds other data than its
    :class:`PartInfo` says."""
    split, array, shard = task
    size = placement.arrays(split)[array]
    per_shard = placement.storage_format.elements(array)[0]
    lo, hi = shard * per_shard, min((shard + 1) * per_shard, size)
    # seq_starts has one entry past the parts' own: the token count.
    data_end = placement.num_sequences(split) if array == SEQ_STARTS else size
    pending, add = _request(placement, split, array, lo, min(hi, data_end), open_part)
    dtype = DTYPES[array]
    pieces = [
        np.asarray(p.result()[0], dtype) + np.asarray(a, dtype)
        for p, a in zip(pending, add, strict=True)
    ]
    if hi > data_end:
        pieces.append(np.array([placement.num_tokens(split)], dtype))
    values = np.concatenate(pieces) if pieces else np.zeros(0, dtype)
    if values.size != hi - lo:
        raise ValueError(
            f"{placement.output}: {split}/{array} shard {shard} needs {hi - lo} entries but the "
            f"parts gave {values.size}: a part holds other data than it reported"
        )
    handle = open_for_writing(store, split, array, placement.storage_format)
    side = open_digests(store, split, array, placement.storage_format)
    store.wait(handle[lo:hi].write(values))
    store.wait(write_digests(side, lo, values, placement.storage_format, array))
    return hi - lo


def finish(placement: Placement, store: Store, info: DatasetInfo | None = None) -> None:
    """Records the shard probes, deletes the staging prefix, writes the groups (root
    last, with ``info``), then drops the write's marker."""
    root = root_attributes(None, info, placement.splits)
    for split in placement.splits:
        for array in placement.arrays(split):
            handle = open_for_writing(store, split, array, placement.storage_format)
            record_probes(store, split, array, placement.storage_format, handle)
    store.delete_prefix(STAGING)
    write_groups(store, placement.storage_format.zarr_format, placement.max_token_ids(), root)
    store.delete(MARKER)
