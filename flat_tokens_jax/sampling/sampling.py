"""Stateless keyed shuffling: the record read is a pure function of (seed, global sample index).

The permutation of ``[0, n)`` is a balanced Feistel network with cycle-walking: O(1) memory per
index and no per-``n`` table, so ``n`` may reach ``2**63 - 1`` and a resume needs no state.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import numpy.typing as npt

from flat_tokens_jax.core import fields
from flat_tokens_jax.core.values import boolean, integer

MAX_N = 2**63 - 1  # Largest n or num_records: every index must fit in int64.
_MAX_U64 = 2**64 - 1
_NUM_ROUNDS = 6
_GOLDEN_INT = 0x9E3779B97F4A7C15  # 2**64 / golden ratio: the splitmix64 increment.
_GOLDEN = np.uint64(_GOLDEN_INT)
# Built from Python ints: a product of numpy uint64 *scalars* warns on the intended wrap-around.
_ROUND_STEPS = [np.uint64(_GOLDEN_INT * (r + 1) % 2**64) for r in range(_NUM_ROUNDS)]
_MUL1_INT, _MUL2_INT = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_MUL1, _MUL2 = np.uint64(_MUL1_INT), np.uint64(_MUL2_INT)
# Cycle-walking finishes on Python ints once this few elements are left.
_SCALAR_WALK = 8
_ONE, _S27, _S30, _S31 = np.uint64(1), np.uint64(27), np.uint64(30), np.uint64(31)
# The Feistel half width for n is the smallest h >= 1 with 4**h >= n, found by binary search.
_POWERS_OF_4 = np.array([4**h for h in range(1, 32)], dtype=np.uint64)

U64Array = npt.NDArray[np.uint64]


def _mix64(x: U64Array) -> U64Array:
    """The splitmix64 finalizer, a bijective 64-bit mixer; ``x`` is ``[k] uint64`` and wraps."""
    x = (x ^ (x >> _S30)) * _MUL1
    x = (x ^ (x >> _S27)) * _MUL2
    return x ^ (x >> _S31)


def _take(values: U64Array, rows: npt.NDArray[np.intp]) -> U64Array:
    """``values[rows]``, except that a ``[1]`` array broadcasts and is returned whole."""
    return values if values.size == 1 else values[rows]


def _feistel(x: U64Array, keys: list[U64Array], half_bits: U64Array) -> U64Array:
    """One pass of the network, a bijection on ``[0, 4**half_bits)``; all arrays ``uint64``."""
    mask = (_ONE << half_bits) - _ONE
    left, right = x >> half_bits, x & mask
    for key in keys:
        left, right = right, left ^ (_mix64(right ^ key) & mask)
    return (left << half_bits) | right


def _permute_u64(x: U64Array, n: U64Array, seed: int, epoch: U64Array) -> U64Array:
    """Permutes ``x`` ``[k]`` (each below its ``n``); ``n`` and ``epoch`` are ``[k]`` or ``[1]``."""
    # Chain seed and epoch through the mixer rather than adding them, so that for example
    # (seed=1, epoch=0) and (seed=0, epoch=1) give unrelated permutations.
    state = _mix64(_mix64(np.array([seed], dtype=np.uint64) + _GOLDEN) ^ epoch)
    keys = [_mix64(state + step) for step in _ROUND_STEPS]
    half_bits = np.searchsorted(_POWERS_OF_4, n).astype(np.uint64) + _ONE
    out = _feistel(x, keys, half_bits)
    # Cycle-walking: re-encrypt what lands in [n, 4**half_bits) until it comes back below n.
    # That range is under 3/4 of the domain, so the set to walk shrinks geometrically.
    rows = np.flatnonzero(out >= n)
    while rows.size > _SCALAR_WALK:
        walked = _feistel(out[rows], [_take(k, rows) for k in keys], _take(half_bits, rows))
        out[rows] = walked
        rows = rows[walked >= _take(n, rows)]
    # The last few walk on Python ints: a numpy pass costs ~40 µs however few
    # elements it holds, a walk step on ints ~6 µs, and the same values.
    for row in rows.tolist():
        at = 0 if n.size == 1 else row
        out[row] = _walk_int(
            int(out[row]),
            int(n[at]),
            [int(k[0 if k.size == 1 else row]) for k in keys],
            int(half_bits[0 if half_bits.size == 1 else row]),
        )
    return out


def _walk_int(x: int, n: int, keys: list[int], half_bits: int) -> int:
    """Re-encrypts ``x`` until it is below ``n``: ``_feistel`` and cycle-walking on ints."""
    mask = (1 << half_bits) - 1
    while x >= n:
        left, right = x >> half_bits, x & mask
        for key in keys:
            m = right ^ key  # `_mix64` on ints, written out: a call each round adds a third
            m = ((m ^ (m >> 30)) * _MUL1_INT) & _MAX_U64
            m = ((m ^ (m >> 27)) * _MUL2_INT) & _MAX_U64
            left, right = right, left ^ ((m ^ (m >> 31)) & mask)
        x = (left << half_bits) | right
    return x


def _as_u64(values: npt.ArrayLike, name: str, high: int, bounds: str = "") -> U64Array:
    """Checks ``values`` are integers in ``[0, high]``; returns them as uint64, same shape."""
    array = np.asarray(values)
    if array.size and array.dtype.kind not in "iu":
        raise ValueError(f"{name} must be integers that fit in 64 bits, got dtype {array.dtype}")
    if array.size and (array.min() < 0 or int(array.max()) > high):
        at = int(np.argmin(array) if array.min() < 0 else np.argmax(array))
        value, bounds = array.reshape(-1)[at], bounds or f"[0, {high}]"
        raise ValueError(f"{name} must be in {bounds}, got {value} at flat position {at}")
    return array.astype(np.uint64)


def _flat(values: U64Array, shape: tuple[int, ...], squeeze: bool = False) -> U64Array:
    """``values`` broadcast to ``shape``, flat ``[k]``; ``[1]`` if ``squeeze`` and all equal,
    as a shared value lets mixing and cycle-walking skip per-element arrays."""
    flat = np.broadcast_to(values, shape).reshape(-1)
    return flat[:1] if squeeze and flat.size and (flat == flat[0]).all() else flat


def permute(
    indices: npt.ArrayLike, n: npt.ArrayLike, *, seed: int, epoch: npt.ArrayLike
) -> npt.NDArray[np.int64]:
    """Maps each index through the permutation of ``[0, n)`` keyed by ``(seed, epoch)``.

    Args:
      indices: integers in ``[0, n)``, shape ``[k]`` (any shape works and is kept).
      n: the size of the range, ``0 <= n <= 2**63 - 1``: an int, or an int array broadcasting
        against ``indices`` to permute each element within its own range.
      seed: an int, ``0 <= seed < 2**64``.
      epoch: ``0 <= epoch < 2**64``, an int or an int array broadcasting like ``n``. Each epoch
        gives an unrelated order.

    Returns:
      ``[k] int64`` (the arguments' broadcast shape), the permuted indices.

    Example:
      >>> sorted(permute([0, 1, 2, 3, 4], 5, seed=0, epoch=0).tolist())
      [0, 1, 2, 3, 4]
    """
    seed = fields.seed(seed, "seed")
    shape = np.broadcast_shapes(np.shape(indices), np.shape(n), np.shape(epoch))
    x = _flat(_as_u64(indices, "indices", MAX_N, "[0, n)"), shape)
    sizes = _flat(_as_u64(n, "n", MAX_N), shape, squeeze=True)
    epochs = _flat(_as_u64(epoch, "epoch", _MAX_U64), shape, squeeze=True)
    if (too_big := x >= sizes).any():
        at = int(np.argmax(too_big))
        n_at = sizes[min(at, sizes.size - 1)]  # sizes is [k], or [1] when n is shared.
        raise ValueError(f"indices must be in [0, n), got {x[at]} at flat position {at}: n={n_at}")
    return _permute_u64(x, sizes, seed, epochs).astype(np.int64).reshape(shape)


class EpochsExhausted(IndexError):
    """A global sample index lies past the last epoch of a bounded ``IndexSampler``."""


@dataclasses.dataclass(frozen=True)
class IndexSampler:
    """Maps global sample indices to record indices, epoch after epoch.

    Sample ``g`` is in epoch ``g // num_records`` at position ``g % num_records``, and reads
    record ``permute(position, num_records, seed=seed, epoch=epoch)``, or ``position`` if not
    shuffling. Each epoch reads every record exactly once, in its own order.
    """

    num_records: int  # Records to draw from: 1 <= num_records <= 2**63 - 1.
    seed: int = 0  # 0 <= seed < 2**64. Changing it changes every shuffled order.
    shuffle: bool = True  # False reads records in order: sample g reads g % num_records.
    num_epochs: int | None = None  # Passes over the records; None for an endless stream.
    # Samples of the stream drawn before this sampler's sample 0 (a run in phases
    # continues a stream where earlier phases left it): sample g reads the
    # stream's sample offset + g. 0 <= offset <= 2**63 - 1.
    offset: int = 0

    def __post_init__(self) -> None:
        integer(self.num_records, "num_records", low=1, high=MAX_N)
        fields.seed(self.seed, "seed")
        boolean(self.shuffle, "shuffle")
        integer(self.num_epochs, "num_epochs", low=1, high=MAX_N, optional=True)
        integer(self.offset, "offset", low=0, high=MAX_N)
        if self.offset and self.num_epochs is not None:
            raise ValueError(
                f"offset {self.offset} needs an endless stream: set num_epochs=None "
                "(a stream continued across phases has no last epoch)"
            )

    @property
    def num_samples(self) -> int | None:
        """Total number of samples, ``num_records * num_epochs``; None if unbounded."""
        return None if self.num_epochs is None else self.num_records * self.num_epochs

    def _split(self, g: npt.ArrayLike) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """Checks ``g`` and returns ``(epoch, position)``, each ``int64`` shaped like ``g``."""
        samples = _as_u64(g, "global sample index", MAX_N - self.offset).astype(np.int64)
        if self.offset:
            samples = samples + np.int64(self.offset)
        total, n = self.num_samples, self.num_records
        if total is not None and samples.size and int(samples.max()) >= total:
            raise EpochsExhausted(
                f"global sample index {samples.max()} is past the end: {n} records x "
                f"{self.num_epochs} epochs = {total} samples; raise num_epochs, or set it to None"
            )
        epoch, position = np.divmod(samples, np.int64(n))
        return np.asarray(epoch), np.asarray(position)  # 0-d arrays, not scalars, for a scalar g

    def epochs(self, g: npt.ArrayLike) -> npt.NDArray[np.int64]:
        """Epoch of each global sample index: ``g`` ``[k]`` int, returns ``[k] int64``."""
        return self._split(g)[0]

    def records(self, g: npt.ArrayLike) -> npt.NDArray[np.int64]:
        """Record read by each global sample index: ``g`` ``[k]`` int, returns ``[k] int64``
        (:class:`EpochsExhausted` past the last epoch)."""
        epoch, position = self._split(g)
        if not self.shuffle:
            return position
        # `permute` without its checks: `_split` and the sampler's own made them.
        epochs = _flat(epoch.astype(np.uint64), epoch.shape, squeeze=True)
        n = np.array([self.num_records], np.uint64)
        out = _permute_u64(position.reshape(-1).astype(np.uint64), n, self.seed, epochs)
        return out.astype(np.int64).reshape(position.shape)
