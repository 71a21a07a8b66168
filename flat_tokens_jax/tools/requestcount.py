"""What a run asks of an object store, before it runs: requests and bytes per step,
from a loader's sampler and each array's zarr chunking, reading no token. The rule
(measured by ``scripts/bench_requestcount.py``) is docs/guide/remote.md's."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from flat_tokens_jax.core.fields import BLOCKS, Packing
from flat_tokens_jax.core.format import LOSS_MASK, SEQ_STARTS
from flat_tokens_jax.core.values import integer, number
from flat_tokens_jax.data.bins import BinRecords
from flat_tokens_jax.data.dataset import FlatTokens
from flat_tokens_jax.data.records import PackedRecords, PaddedRecords
from flat_tokens_jax.loader.engine import StepEngine
from flat_tokens_jax.sampling.blocks import BlockSampler

# A fresh GCS bucket serves about 5,000 object reads/s; Google's guidelines
# ask to double the rate no faster than every 20 minutes while it scales
# (https://cloud.google.com/storage/docs/request-rate).
GCS_INITIAL_READS = 5000
GCS_DOUBLING_MINUTES = 20


def ramp_minutes(
    rate: float, initial: float = GCS_INITIAL_READS, doubling: float = GCS_DOUBLING_MINUTES
) -> float:
    """Minutes until a bucket serving ``initial`` reads/s, doubling every
    ``doubling`` minutes, serves ``rate`` reads/s (0 at or below ``initial``)."""
    return doubling * math.log2(rate / initial) if rate > initial else 0.0


@dataclasses.dataclass(frozen=True)
class Chunking:
    """How one array is stored, as far as requests go: values per inner chunk
    (or v2 chunk file), per shard (``None`` in v2), and bytes a request returns
    per chunk (uncompressed, plus 4 for a crc32c: an upper bound)."""

    chunk: int
    shard: int | None
    chunk_bytes: int

    @classmethod
    def of(cls, ft: FlatTokens, array: str) -> Chunking:
        described = ft.storage_formats()[array]
        reader = {ft.tokens_name: ft.encoded, SEQ_STARTS: ft.starts, LOSS_MASK: ft.loss_mask}
        itemsize = np.dtype(reader[array].dtype).itemsize  # type: ignore[union-attr]
        chunk = int(described["chunk"])
        shard = described["shard"]
        extra = 4 if described["checksum"] else 0
        return cls(chunk, None if shard is None else int(shard), chunk * itemsize + extra)

    def count(self, group: np.ndarray, lo: np.ndarray, hi: np.ndarray, groups: int) -> np.ndarray:
        """``[groups, 2] int64``: requests and bytes of each group's ranges
        ``[lo, hi)`` of this array, a group (``group`` ``[k]``) being one batch of reads."""
        keep = hi > lo
        group, lo, hi = group[keep], lo[keep], hi[keep]
        first, last = lo // self.chunk, (hi - 1) // self.chunk
        n = last - first + 1
        owner = np.repeat(group, n)
        offset = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
        chunks = np.repeat(first, n) + offset
        span = int(chunks.max()) + 1 if chunks.size else 1
        touched = np.unique(owner * span + chunks)
        owner, chunks = touched // span, touched % span
        starts = np.ones(touched.shape, bool)
        if self.shard is not None:
            per_shard = self.shard // self.chunk
            starts[1:] = (np.diff(touched) != 1) | (chunks[1:] % per_shard == 0)
        out = np.zeros((groups, 2), np.int64)
        out[:, 0] = np.bincount(owner[starts], minlength=groups)
        out[:, 1] = np.bincount(owner, minlength=groups) * self.chunk_bytes
        return out


@dataclasses.dataclass(frozen=True)
class HostSamples:
    """The records each host's rows read at each sampled step, flattened: the
    sampled ``steps`` ``[s]``, the ``hosts`` sharing them, and per real row
    (``[k] int64`` each) its index into ``steps`` (``at``), its ``host``, and
    the ``component``, ``record`` and ``epoch`` it reads."""

    steps: np.ndarray
    hosts: int
    at: np.ndarray
    host: np.ndarray
    component: np.ndarray
    record: np.ndarray
    epoch: np.ndarray


def host_samples(loader: StepEngine, hosts: int, steps: Sequence[int]) -> HostSamples:
    """The sampler's records for ``steps``, each step's rows split into
    ``hosts`` equal runs of consecutive rows (data sharding)."""
    hosts = integer(hosts, "hosts", low=1)
    parts: list[tuple[np.ndarray, ...]] = []
    for i, step in enumerate(steps):
        size = loader.steps.size(step)
        if size % hosts:
            raise ValueError(
                f"hosts: {hosts} hosts do not split step {step}'s batch of {size} rows "
                "evenly: give a host count that divides every batch size"
            )
        g, real = loader.steps.samples(step, np.arange(size, dtype=np.int64))
        comp, record, epoch = loader.steps.lookup(g[real])
        host = np.flatnonzero(real) // (size // hosts)
        parts.append((np.full(host.size, i, np.int64), host, comp, record, epoch))
    joined = [np.concatenate(p) for p in zip(*parts, strict=True)]
    return HostSamples(np.asarray(list(steps), np.int64), hosts, *joined)


def _split_of(records: Any, name: str) -> FlatTokens:
    if isinstance(records, PackedRecords | PaddedRecords | BinRecords):
        return records.ft
    raise ValueError(
        f"component {name!r}: {type(records).__name__} records name no store to count from: "
        "request counts take a split's records (packed, padded or bins)"
    )


def _targets(records: Any, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(row, start, stop)`` ``[m] int64``: the token ranges of the targets of
    records ``idx`` (a bin's: each sequence), ``row`` indexing ``idx``."""
    if isinstance(records, BinRecords):
        row, seqs = records.sequences(idx)
        start, stop = records.ft.sequence_bounds(seqs)
        return row, start, np.minimum(stop, start + records.seq_len)
    start, stop = records.token_ranges(idx)
    return np.arange(idx.size, dtype=np.int64), start, stop


def _ranges(records: Any, idx: np.ndarray) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Per array, the ranges ``(row, lo, hi)`` ``[m] int64`` that reading records
    ``idx`` takes, ``row`` indexing ``idx``, in the array's own coordinates."""
    ft: FlatTokens = records.ft
    base, seq_base = ft.token_range[0], ft.seq_range[0]
    row, start, stop = _targets(records, idx)
    out = {}
    lo = start
    if records.packing is Packing.WINDOWS:
        lo = np.maximum(start - 1, 0)  # a window's inputs begin one token before its targets
    elif isinstance(records, BinRecords):
        seqs = records.sequences(idx)[1] + seq_base
        out[SEQ_STARTS] = (row, seqs, seqs + 2)
    else:
        out[SEQ_STARTS] = (row, idx + seq_base, idx + seq_base + 2)
    out[ft.tokens_name] = (row, lo + base, stop + base)
    if ft.loss_mask is not None:
        out[LOSS_MASK] = (row, start + base, stop + base)
    return out


@dataclasses.dataclass(frozen=True)
class StepReads:
    """What each host reads at each sampled step, ``[steps, hosts] int64`` each
    (``useful``: bytes of the targets' tokens)."""

    requests: np.ndarray
    bytes: np.ndarray
    useful: np.ndarray


def _count(
    loader: StepEngine,
    samples: HostSamples,
    comp: np.ndarray,
    record: np.ndarray,
    group: np.ndarray,
    block: Sequence[int] | None,
) -> StepReads:
    """Requests and bytes of reading ``record`` of component ``comp``, each in
    batch ``group`` (``step index * hosts + host``); with ``block`` (records per
    block, per component), ``record`` are blocks, each read as one range. Without:
    each host reads its rows' ranges at their step, a component's in one batch per array."""
    groups = samples.steps.size * samples.hosts
    totals = np.zeros((groups, 2), np.int64)
    for c, records in enumerate(loader.components):
        ft = _split_of(records, loader.names[c])
        mine = comp == c
        idx, owner = record[mine], group[mine]
        if block is None:
            reads = _ranges(records, idx)
        elif isinstance(records, BinRecords):  # a bin's sequences lie anywhere: each is read
            size = min(block[c], len(records))  # a block larger than the data is the data
            first = np.repeat(idx * block[c], size) + np.tile(np.arange(size), idx.size)
            inside = first < len(records)
            reads = _ranges(records, first[inside])
            of_block = np.repeat(np.arange(idx.size), size)[inside]
            reads = {k: (of_block[row], lo, hi) for k, (row, lo, hi) in reads.items()}
        else:
            first = idx * block[c]
            last = np.minimum(first + block[c], len(records)) - 1
            ranges = _ranges(records, np.concatenate([first, last]))
            reads = {k: _block_span(v, idx.size) for k, v in ranges.items()}
        for array, (row, lo, hi) in reads.items():
            totals += Chunking.of(ft, array).count(owner[row], lo, hi, groups)
    shape = (samples.steps.size, samples.hosts)
    return StepReads(
        totals[:, 0].reshape(shape), totals[:, 1].reshape(shape), _useful(loader, samples)
    )


def _block_span(
    ranges: tuple[np.ndarray, np.ndarray, np.ndarray], blocks: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One range per block, from its first record's start to its last record's
    end (``ranges`` of the first records, then the last)."""
    row, lo, hi = ranges
    start = np.full(2 * blocks, np.iinfo(np.int64).max)
    stop = np.zeros(2 * blocks, np.int64)
    np.minimum.at(start, row, lo)
    np.maximum.at(stop, row, hi)
    return np.arange(blocks, dtype=np.int64), start[:blocks], stop[blocks:]


def _useful(loader: StepEngine, samples: HostSamples) -> np.ndarray:
    """``[steps, hosts]`` bytes of the tokens the rows' targets come from."""
    out = np.zeros(samples.steps.size * samples.hosts, np.int64)
    group = samples.at * samples.hosts + samples.host
    for c, records in enumerate(loader.components):
        ft = _split_of(records, loader.names[c])
        mine = samples.component == c
        row, start, stop = _targets(records, samples.record[mine])
        size = (stop - start) * ft.encoded.dtype.itemsize
        out += np.bincount(group[mine][row], weights=size, minlength=out.size).astype(np.int64)
    return out.reshape(samples.steps.size, samples.hosts)


def block_reads(loader: StepEngine, samples: HostSamples) -> StepReads:
    """Block shuffle: each host reads each block of the loader's block samplers
    that its rows need whole, once per epoch, at the first sampled step that
    needs it (so the first step is a cold start)."""
    samplers = _block_samplers(loader)
    blocks = np.empty_like(samples.record)
    for c, s in enumerate(samplers):
        mine = samples.component == c
        blocks[mine] = s.block_of(samples.record[mine])
    block = [s.block for s in samplers]
    key = np.stack([samples.host, samples.component, samples.epoch, blocks])
    # Rows come in step order, so each block's first row is its first need.
    _, first = np.unique(key, axis=1, return_index=True)
    group = samples.at[first] * samples.hosts + samples.host[first]
    return _count(loader, samples, samples.component[first], blocks[first], group, block)


def _block_samplers(loader: StepEngine) -> list[BlockSampler]:
    found = [s for s in loader.samplers if isinstance(s, BlockSampler)]
    assert len(found) == len(loader.samplers)  # shuffle="blocks"
    return found


@dataclasses.dataclass(frozen=True)
class RequestCounts:
    """A pod's reads at ``step_seconds`` a step, from :func:`count_requests`.
    ``shuffle``: ``"full"``, ``"none"`` or ``"blocks"``; ``block`` and ``window``
    only for blocks, whose rates leave out the first sampled step (its cold
    start, in ``first_step_requests``). Rates are the pod's."""

    shuffle: str
    block: tuple[int, ...] | None
    window: int | None
    hosts: int
    step_seconds: float
    steps: np.ndarray
    reads: StepReads
    requests_per_second: float
    bytes_per_second: float
    useful_bytes_per_second: float
    bytes_per_token: float
    first_step_requests: int
    ramp_minutes: float


def count_requests(
    loader: StepEngine,
    hosts: int,
    step_seconds: float,
    steps: Sequence[int] = range(8),
) -> RequestCounts:
    """Requests/s and bytes/s of ``hosts`` hosts running ``loader`` at
    ``step_seconds`` a step, from its sampler at ``steps`` (consecutive, for
    blocks) and its arrays' chunking."""
    step_seconds = number(step_seconds, "step_seconds")
    if not step_seconds > 0:
        raise ValueError(f"step_seconds must be > 0, got {step_seconds}")
    if not len(steps):
        raise ValueError("steps: give at least one step to sample")
    shuffle, window, block = loader.config.shuffle, None, None
    samples = host_samples(loader, hosts, steps)
    if shuffle == BLOCKS:
        block = [s.block for s in _block_samplers(loader)]
        reads = block_reads(loader, samples)
        window = loader.config.shuffle_window
    else:  # the full shuffle, or none
        group = samples.at * samples.hosts + samples.host
        reads = _count(loader, samples, samples.component, samples.record, group, None)
    counted = slice(1 if block is not None and len(steps) > 1 else 0, None)
    pod = {name: getattr(reads, name)[counted].sum(axis=1) for name in ("requests", "bytes")}
    useful = reads.useful[counted].sum(axis=1).mean()
    per_step = pod["requests"].mean()
    pairs = zip(loader.components, loader.names, strict=True)
    itemsize = max(_split_of(r, n).encoded.dtype.itemsize for r, n in pairs)
    return RequestCounts(
        shuffle=BLOCKS if block is not None else "full" if shuffle else "none",
        block=None if block is None else tuple(block),
        window=window,
        hosts=samples.hosts,
        step_seconds=step_seconds,
        steps=samples.steps,
        reads=reads,
        requests_per_second=float(per_step / step_seconds),
        bytes_per_second=float(pod["bytes"].mean() / step_seconds),
        useful_bytes_per_second=float(useful / step_seconds),
        bytes_per_token=float(pod["bytes"].mean() * itemsize / useful) if useful else math.nan,
        first_step_requests=int(reads.requests[0].sum()),
        ramp_minutes=ramp_minutes(per_step / step_seconds),
    )
