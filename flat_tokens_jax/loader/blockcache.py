"""The block cache: under the block shuffle, this host's rows taken from whole
blocks (a step's fetch reads those not held through a :class:`StepReader`, in one
batch), held within ``block_cache_bytes`` as docs/guide/loading.md, "Block shuffle",
says (Belady's choice: :meth:`~flat_tokens_jax.sampling.blocks.BlockSampler.next_use`)."""

from __future__ import annotations

import collections
import dataclasses
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from flat_tokens_jax.core.fields import Packing
from flat_tokens_jax.data.blockreads import (
    BlockTokens,
    SplitRecords,
    block_ranges,
    block_rows,
    reads_blocks,
)
from flat_tokens_jax.data.records import Records, Windows
from flat_tokens_jax.sampling.blocks import NEVER, BlockSampler, Sampler
from flat_tokens_jax.sampling.stepsamples import StepSamples
from flat_tokens_jax.store.checks import Once


class _Entry:
    """One block: read (or being read), with the steps in flight that need it."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes, self.pins, self.kept = nbytes, 1, False
        self.epoch, self.window = 0, 0
        self._ready = threading.Event()
        self._read: Once[list[BlockTokens]] | None = None  # the batch of reads it is in
        self._at = 0
        self._error: BaseException | None = None

    def started(
        self, read: Once[list[BlockTokens]] | None, at: int, error: BaseException | None
    ) -> None:
        self._read, self._at, self._error = read, at, error
        self._ready.set()

    def tokens(self) -> BlockTokens:
        """The block, read once whoever asks first."""
        self._ready.wait()
        if self._error is not None:
            raise self._error
        assert self._read is not None
        return self._read.result()[self._at]


@dataclasses.dataclass(frozen=True)
class _Step:
    """What a step tells the cache: each component's least stream sample and
    samples in the step, this host's lanes, each block's (epoch, window)."""

    now: dict[int, int]
    rate: dict[int, int]
    lanes: tuple[int, int]
    windows: dict[tuple[int, int], tuple[int, int]]


class BlockCache:
    """This host's blocks: see the module's docstring. ``samplers`` is the
    engine's list, renewed when a phase continues streams; ``block``: records
    per block; ``budget``: bytes the held blocks may hold."""

    def __init__(
        self, components: Sequence[Records], samplers: list[Sampler], block: int, budget: int
    ) -> None:
        self.components, self.samplers, self.block = components, samplers, block
        self.budget = budget
        self._held: dict[tuple[int, int], _Entry] = {}
        self._bytes = 0
        self._lock = threading.Lock()
        # Each component's stream position in the steps in flight, and in the
        # last one: steps read ahead on threads start in any order, and a step
        # not started yet must find the blocks it shares with those around it.
        self._flying: dict[int, collections.Counter[int]] = {}
        self._last: dict[int, int] = {}
        self._rate: dict[int, int] = {}
        self._lanes = (0, 1)
        self.reads = 0  # blocks read (again, after a drop)
        self.drops = 0  # blocks dropped to make room
        self.passed = 0  # blocks read for their step alone: no room beside those in flight
        self.peak = 0

    def readers(self, steps: StepSamples, step: int, rows: np.ndarray) -> list[Any]:
        """What reads each component's records (``read``, ``request``) for the
        fetch of ``rows`` at ``step``: its records, or a :class:`StepReader`."""
        g, real = steps.samples(step, rows)
        g = g[real]
        if steps.mixture is None:
            comp, sample = np.zeros(g.shape, np.int64), g
            size = steps.size(step)
            per_lane = max(size // self.samplers[0].lanes, 1)  # type: ignore[union-attr]
            lanes = (int(rows.min()) // per_lane, int(rows.max()) // per_lane + 1)
        else:  # each host's rows reach into every lane of every component
            comp, sample = steps.steering.route(g)
            lanes = (0, self.samplers[0].lanes)  # type: ignore[union-attr]
        now, rate, windows = {}, {}, {}
        for c in np.unique(comp).tolist():
            sampler = self.samplers[c]
            if not (isinstance(sampler, BlockSampler) and reads_blocks(self.components[c])):
                continue
            mine = sample[comp == c]
            epoch, j = sampler.positions(mine)
            blocks = sampler.block_of(sampler.record_at(epoch, j))
            win = sampler.window_of(j)
            stream = mine + sampler.offset
            now[c], rate[c] = int(stream.min()), int(stream.max() - stream.min() + 1)
            for b, e, w in zip(blocks.tolist(), epoch.tolist(), win.tolist(), strict=True):
                windows[(c, b)] = (e, w)
        told = _Step(now, rate, lanes, windows)
        return [
            StepReader(self, c, r, told) if c in now else r for c, r in enumerate(self.components)
        ]

    def acquire(self, c: int, blocks: np.ndarray, told: _Step) -> list[_Entry]:
        """The entries of ``blocks`` of component ``c``, pinned; those not held
        are read, in one batch."""
        records = self.components[c]
        assert isinstance(records, SplitRecords)
        fresh: list[int] = []
        out: list[_Entry] = []
        with self._lock:
            for component, at in told.now.items():
                self._flying.setdefault(component, collections.Counter())[at] += 1
            self._last.update(told.now)
            self._rate.update(told.rate)
            self._lanes = told.lanes
            for b in blocks.tolist():
                entry = self._held.get((c, b))
                if entry is None:
                    entry = _Entry(0)
                    self._held[(c, b)] = entry  # reading: steps that need it wait for it
                    fresh.append(len(out))
                else:
                    entry.pins += 1
                entry.epoch, entry.window = told.windows.get((c, b), (entry.epoch, entry.window))
                out.append(entry)
        if not fresh:
            return out
        missing = blocks[fresh]
        try:
            ranges = block_ranges(records, missing, self.block)
            shared = Once(ranges.request())
        except BaseException as e:
            with self._lock:
                for i, b in zip(fresh, missing.tolist(), strict=True):
                    self._held.pop((c, b), None)
                    out[i].started(None, 0, e)
            self.release(out, told)
            raise
        with self._lock:
            self.reads += len(fresh)
            for k, (i, b) in enumerate(zip(fresh, missing.tolist(), strict=True)):
                entry = out[i]
                entry.nbytes = int(ranges.nbytes[k])
                entry.kept = self._make_room(entry.nbytes)
                if entry.kept:
                    self._bytes += entry.nbytes
                    self.peak = max(self.peak, self._bytes)
                else:
                    self.passed += 1
                    self._held.pop((c, b), None)
                entry.started(shared, k, None)
        return out

    def release(self, entries: Sequence[_Entry], told: _Step) -> None:
        """The step that pinned ``entries`` (and told ``told``) has its rows."""
        with self._lock:
            for entry in entries:
                entry.pins -= 1
            for component, at in told.now.items():
                flying = self._flying[component]
                flying[at] -= 1
                if not flying[at]:
                    del flying[at]

    def _make_room(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more fit after dropping blocks no step in flight
        needs, the one read again furthest ahead first (the lock held)."""
        if self._bytes + nbytes <= self.budget:
            return True
        free = [
            (key, e) for key, e in self._held.items() if e.pins == 0 and e.kept and e.nbytes > 0
        ]
        if sum(e.nbytes for _, e in free) + self.budget < self._bytes + nbytes:
            return False
        order = np.argsort(-self._distances(free), kind="stable")
        for at in order.tolist():
            key, entry = free[at]
            del self._held[key]
            self._bytes -= entry.nbytes
            self.drops += 1
            if self._bytes + nbytes <= self.budget:
                break
        return True

    def _distances(self, entries: list[tuple[tuple[int, int], _Entry]]) -> np.ndarray:
        """``[k]`` steps until this host's lanes read each block again (``inf``: never)."""
        out = np.full(len(entries), np.inf)
        comps = np.array([c for (c, _), _ in entries], np.int64)
        for c in np.unique(comps).tolist():
            sampler = self.samplers[c]
            assert isinstance(sampler, BlockSampler)
            mine = np.flatnonzero(comps == c)
            epoch = np.array([entries[i][1].epoch for i in mine], np.int64)
            window = np.array([entries[i][1].window for i in mine], np.int64)
            now = min(self._flying.get(c) or [self._last.get(c, 0)])
            ahead = sampler.next_use(epoch, window, self._lanes, now)
            steps = ahead.astype(float) * sampler.lanes / max(self._rate.get(c, 1), 1)
            out[mine] = np.where(ahead == NEVER, np.inf, steps)
        return out

    def stats(self) -> dict[str, Any]:
        return {
            "block_reads": self.reads,
            "block_drops": self.drops,
            "block_passed": self.passed,
            "block_cache_bytes": self._bytes,
            "block_cache_peak": self.peak,
            "block_cache_budget": self.budget,
        }


class StepReader:
    """One component's records for one step's fetch, taken from whole blocks."""

    def __init__(self, cache: BlockCache, component: int, records: Records, told: _Step) -> None:
        self.cache, self.component, self.told = cache, component, told
        self.records = records

    def __repr__(self) -> str:
        return f"StepReader({self.records!r})"

    def read(self, indices: np.ndarray, columns: tuple[int, int] | None = None) -> Windows:
        return self.request(indices, columns)()

    def request(
        self, indices: np.ndarray, columns: tuple[int, int] | None = None
    ) -> Callable[[], Windows]:
        """Starts reading the blocks of ``indices`` not held; the function
        returned gives the records' rows."""
        records = self.records
        assert isinstance(records, SplitRecords)
        idx = np.asarray(indices, np.int64)
        size = self.cache.block
        blocks = np.unique(idx // np.int64(size))
        entries = self.cache.acquire(self.component, blocks, self.told)

        def windows() -> Windows:
            try:
                held = {b: e.tokens() for b, e in zip(blocks.tolist(), entries, strict=True)}
                return block_rows(records, held, idx, size, columns)
            finally:
                self.cache.release(entries, self.told)

        return windows


def default_budget(
    components: Sequence[Records], block: int, window: int, lanes_here: int, seq_len: int
) -> int:
    """``block_cache_bytes`` when left ``None``: each of this host's lanes
    (``lanes_here``) holds its current window of ``window`` blocks and the
    next, of the components' average size (4 bytes a token, 1 more with a
    stored loss mask); a component's share is at most all its blocks."""
    total = 0
    for records in components:
        if not reads_blocks(records):
            continue
        ft = records.ft  # type: ignore[attr-defined]
        per_token = 4 + (ft.loss_mask is not None)
        n = max(len(records), 1)
        held = min(block, n)  # a block's records: the last block may hold fewer
        if records.packing is Packing.WINDOWS:
            nbytes = (held * seq_len + 1) * per_token
        else:  # the sequences' tokens on average, and their bounds
            nbytes = -(-held * ft.num_tokens // n) * per_token + 16 * held
        total += min(lanes_here * 2 * window, -(-n // block)) * nbytes
    return total
