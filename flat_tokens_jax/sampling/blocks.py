"""The block shuffle (``LoaderConfig(shuffle="blocks")``): each epoch a keyed
permutation that reads records in blocks of ``B`` consecutive ones, one request
each, while a batch still draws from many blocks, one a lane (docs/guide/loading.md,
"Block shuffle", gives the order, ``R_e``, windows and lanes). Every quantity is
O(1) per index, as :class:`~.sampling.IndexSampler`'s.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Iterable, Sequence
from typing import Literal

import numpy as np
import numpy.typing as npt

from flat_tokens_jax.core import fields
from flat_tokens_jax.core.values import integer
from flat_tokens_jax.data.dataset import FlatTokens
from flat_tokens_jax.data.records import Records
from flat_tokens_jax.sampling.sampling import MAX_N, IndexSampler, permute

NEVER = np.iinfo(np.int64).max
"""What :meth:`BlockSampler.next_use` gives for a window its lanes are past."""

BLOCK_TOKENS = 1 << 18
"""Tokens a block spans when ``shuffle_block`` is ``None`` (at least an inner chunk)."""

Int64Array = npt.NDArray[np.int64]


def _domain_seed(seed: int, domain: str) -> int:
    """A key for one use of ``seed``, unrelated to the full shuffle's and to other uses'."""
    text = f"flat-tokens/{domain}/{seed}".encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "little")


@dataclasses.dataclass(frozen=True)
class BlockSampler:
    """:class:`~.sampling.IndexSampler`'s contract in block-shuffled order.

    Example:
        >>> s = BlockSampler(10, block=4, window=1, lanes=2, seed=0)
        >>> sorted(s.records(range(10)).tolist())
        [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
        >>> s.lane(range(4)).tolist()
        [0, 1, 0, 1]
    """

    num_records: int  # n: 1 <= n <= 2**63 - 1.
    block: int  # B: consecutive records read as one request, >= 1.
    window: int = 1  # w: blocks whose records are shuffled together, >= 1.
    lanes: int = 1  # L: the batch size, or the gcd of a schedule's sizes.
    seed: int = 0
    num_epochs: int | None = None
    offset: int = 0
    shuffle: Literal["blocks"] = dataclasses.field(default=fields.BLOCKS, init=False)
    _epochs: IndexSampler = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        integer(self.block, "shuffle_block", low=1, high=MAX_N)
        integer(self.window, "shuffle_window", low=1, high=MAX_N)
        integer(self.lanes, "lanes", low=1, high=MAX_N)
        # Checks num_records, seed, num_epochs and offset, and splits samples into epochs.
        unshuffled = IndexSampler(
            self.num_records, self.seed, False, self.num_epochs, offset=self.offset
        )
        object.__setattr__(self, "_epochs", unshuffled)

    @property
    def num_samples(self) -> int | None:
        return self._epochs.num_samples

    def epochs(self, g: npt.ArrayLike) -> Int64Array:
        return self._epochs.epochs(g)

    def lane(self, g: npt.ArrayLike) -> Int64Array:
        """Lane of each global sample index, ``(offset + g) mod lanes``: ``[k] int64``."""
        epoch, position = self._epochs.epochs(g), self._epochs.records(g)
        return (epoch * np.int64(self.num_records) + position) % np.int64(self.lanes)

    def positions(self, g: npt.ArrayLike) -> tuple[Int64Array, Int64Array]:
        """``(epoch, j)``, each ``[k] int64``: sample ``g`` reads ``R_epoch[j]``,
        ``j`` past the samples of lanes ``< l`` in the epoch (:meth:`stretch`)."""
        epoch, position = self._epochs.epochs(g), self._epochs.records(g)
        n, big_l = np.int64(self.num_records), np.int64(self.lanes)
        s = epoch * n + position  # the stream sample: offset + g <= 2**63 - 1
        lane = s % big_l
        off, _ = self.stretch(epoch, lane)
        return epoch, off + self._lane_samples(epoch, lane, position)

    def stretch(self, epoch: npt.ArrayLike, lane: npt.ArrayLike) -> tuple[Int64Array, Int64Array]:
        """``(off(e, l), K(e, l))``, each ``[k] int64``: lane ``l`` reads
        ``R_e[off : off + K]`` in epoch ``e``; closed forms in ``a mod L``,
        ``a = e * n`` the epoch's first stream sample, so nothing overflows int64."""
        e, lane = np.asarray(epoch, np.int64), np.asarray(lane, np.int64)
        n, big_l = np.int64(self.num_records), np.int64(self.lanes)
        ra = (e % big_l) * (n % big_l) % big_l  # (e * n) mod L, without overflow
        # Samples of lanes < l in [a, a + n): (a + n) // L * l + min((a + n) % L, l),
        # less the same count in [0, a); a // L cancels out.
        carry, rest = np.divmod(ra + n % big_l, big_l)
        whole = n // big_l + carry
        off = whole * lane + np.minimum(rest, lane) - np.minimum(ra, lane)
        return off, self._lane_samples(e, lane, np.full(e.shape, n))

    def _lane_samples(self, epoch: Int64Array, lane: Int64Array, d: Int64Array) -> Int64Array:
        """Samples of lane ``l`` among the first ``d`` (``0 <= d <= n``) of
        epoch ``e``: those below ``a + d`` less those below ``a = e * n``."""
        n, big_l = np.int64(self.num_records), np.int64(self.lanes)
        ra = (epoch % big_l) * (n % big_l) % big_l
        d = np.asarray(d, np.int64)
        up = (ra + d % big_l + big_l - 1 - lane) // big_l
        return d // big_l + up - (ra + big_l - 1 - lane) // big_l

    def records(self, g: npt.ArrayLike) -> Int64Array:
        """As :meth:`IndexSampler.records`."""
        epoch, j = self.positions(g)
        return self.record_at(epoch, j)

    def record_at(self, epoch: Int64Array, j: Int64Array) -> Int64Array:
        """``R_epoch[j]``: ``epoch`` and ``j`` ``[k] int64`` (``0 <= j < n``)."""
        n, size, w = self.num_records, self.block, self.window
        full = n // size  # full blocks; a partial one (n % size records) comes last
        span = min(w * size, n)  # records of a window (the last may hold fewer)
        count = -(-n // span)  # windows of the epoch
        win, pos = np.divmod(j, np.int64(span))
        held = np.minimum(np.int64(span), np.int64(n) - win * np.int64(span))
        # Keyed by (epoch, window): distinct pairs give distinct keys, all below 2**64.
        key = epoch.astype(np.uint64) * np.uint64(count) + win.astype(np.uint64)
        q = permute(pos, held, seed=_domain_seed(self.seed, "window"), epoch=key)
        where, within = np.divmod(q, np.int64(size))
        at = win * np.int64(w) + where  # the block's place in the epoch's block order
        out = np.int64(full) * np.int64(size) + within  # the partial block's records
        mine = np.flatnonzero(at < full)
        if mine.size:
            blocks = permute(
                at[mine], full, seed=_domain_seed(self.seed, "blocks"), epoch=epoch[mine]
            )
            out[mine] = blocks * np.int64(size) + within[mine]
        return out

    def window_of(self, j: npt.ArrayLike) -> Int64Array:
        """The window of each position ``j`` of ``R_e`` (``[k] int64``)."""
        span = min(self.window * self.block, self.num_records)
        return np.asarray(j, np.int64) // np.int64(span)

    def next_use(
        self, epoch: npt.ArrayLike, window: npt.ArrayLike, lanes: tuple[int, int], now: int
    ) -> Int64Array:
        """How soon lanes ``[l0, l1)`` read window ``window`` of epoch
        ``epoch`` again (``[k]`` each), from stream sample ``now`` on: ``[k]
        int64`` samples of a lane until the first such read (0: a lane is
        reading it), or :data:`NEVER` when they are past it.

        Each lane is weighed against each window, not the range as one: a lane
        one sample behind may be the only one still to read a window.
        """
        e = np.asarray(epoch, np.int64).reshape(-1)
        win = np.asarray(window, np.int64).reshape(-1)
        n = self.num_records
        span = min(self.window * self.block, n)
        w0 = win * np.int64(span)
        w1 = np.minimum(w0 + span, n)
        out = np.full(e.shape, NEVER, np.int64)
        l0, l1 = lanes
        for epoch_now in np.unique(e).tolist():
            mine = np.flatnonzero(e == epoch_now)
            every = np.arange(l0, l1, dtype=np.int64)
            off, count = self.stretch(np.full(every.shape, epoch_now), every)
            ahead = min(max(now - epoch_now * n, 0), n)  # samples of the epoch before `now`
            done = self._lane_samples(np.full(every.shape, epoch_now), every, ahead)
            # Each lane against each window: [windows, lanes].
            p0 = np.maximum(w0[mine][:, None], off[None, :])
            p1 = np.minimum(w1[mine][:, None], (off + count)[None, :])
            q = (off + done)[None, :]
            soon = np.where((p0 < p1) & (q < p1), np.maximum(p0 - q, 0), NEVER)
            out[mine] = soon.min(axis=1)
        return out

    def block_of(self, records: npt.ArrayLike) -> Int64Array:
        """The block of each record, ``record // block``: ``[k] int64``."""
        return np.asarray(records, np.int64) // np.int64(self.block)


Sampler = IndexSampler | BlockSampler
"""What orders a component's records: a full (or no) shuffle, or the block shuffle."""


def sampler(
    num_records: int,
    shuffle: fields.Shuffle,
    *,
    seed: int,
    num_epochs: int | None,
    offset: int = 0,
    block: int = 1,
    window: int = 1,
    lane_count: int = 1,
) -> Sampler:
    if shuffle == fields.BLOCKS:
        return BlockSampler(
            num_records, block, window, lane_count, seed, num_epochs=num_epochs, offset=offset
        )
    on = shuffle is True
    return IndexSampler(num_records, seed=seed, shuffle=on, num_epochs=num_epochs, offset=offset)


def lanes(entries: Iterable[tuple[int, int]]) -> int:
    """``L``: the gcd of the sizes of a batch-size schedule's ``(start_step,
    size)`` entries (the size, when constant)."""
    return math.gcd(*(size for _, size in entries))


def sample_of_row(rows: npt.ArrayLike, size: int, lane_count: int) -> Int64Array:
    """``[k] int64``: which of a step's samples each of ``rows`` (``[k]`` in
    ``[0, size)``) holds under the block shuffle of ``lane_count`` lanes ``L``.

    Sample ``j`` goes to row ``(j mod L) * (size / L) + j // L``: the rows of
    each lane are contiguous, so a host holding rows ``[h * size / H, (h + 1) *
    size / H)`` holds lanes ``[h * L / H, (h + 1) * L / H)`` for every ``H``
    dividing ``L``.
    """
    per_lane = np.int64(size // lane_count)
    lane, k = np.divmod(np.asarray(rows, np.int64), per_lane)
    return k * np.int64(lane_count) + lane


def default_block(components: Sequence[Records], seq_len: int) -> int:
    """``shuffle_block`` when left ``None``: records that span about
    :data:`BLOCK_TOKENS` tokens and at least one inner chunk of the store (a
    split's records span its tokens over their count on average, custom
    records ``seq_len`` each); of a mixture, the largest of its components'."""
    out = 1
    for records in components:
        ft = getattr(records, "ft", None)
        tokens, chunk = seq_len, 0
        if isinstance(ft, FlatTokens):
            tokens = max(1, ft.num_tokens // max(1, len(records)))
            chunk = int(ft.storage_formats()[ft.tokens_name]["chunk"] or 0)
        out = max(out, -(-max(BLOCK_TOKENS, chunk) // tokens))
    return out
