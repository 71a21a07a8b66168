"""The load-time instance filter (after OLMo's): rows that repeat a short n-gram
many times back to back lose their loss.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from flat_tokens_jax.core import compiled
from flat_tokens_jax.core.extras import install_hint
from flat_tokens_jax.core.values import BadValue, integer, known_keys, mapping

MAX_ROW_TOKENS = 2**31 - 1
"""The longest row a filter is checked against: ``positions`` are ``int32``."""

# Probes in a row that a run must cover before the columns around them are
# compared: with one, a common token pair sends every fourth row or so to
# the full check; with four, almost none.
_PROBES = 4

KERNELS = ("auto", "numba", "numpy")

# Decoded steps whose counts wait for their hand-out, at most: steps read
# ahead and then dropped (a jump) are forgotten oldest first.
_PENDING = 1024


def kernel_module(kernel: str) -> ModuleType | None:
    """The compiled kernels for ``kernel``: ``"numba"`` (the ``fast`` extra),
    ``"numpy"`` (``None``), or ``"auto"`` (numba when it imports)."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    fast = None if kernel == "numpy" else compiled.kernels()
    if kernel == "numba" and fast is None:
        raise ValueError(
            f"kernel='numba' needs numba: {install_hint('fast')} "
            "(or kernel='auto' to run numpy without it)"
        )
    return fast


@dataclasses.dataclass(frozen=True)
class InstanceFilter:
    """Rejects rows with ``max_count`` back-to-back copies of an n-gram of
    length ``p`` in ``[min_period, max_period]``: for some column ``i``,
    ``targets[j] == targets[j + p]`` for the ``(max_count - 1) * p`` columns
    ``j`` from ``i`` on. A rejected row gets ``loss_mask`` False on every column.
    What counts (the row's real targets alone): docs/guide/loading.md.

    Attributes:
        max_period: longest n-gram checked. Recommended: 13 (OLMo's).
        min_period: shortest n-gram checked (1: one token repeated).
        max_count: copies that reject a row, at least 2. Recommended: 32 (OLMo's).

    Each, and ``max_count * min_period``, is at most :data:`MAX_ROW_TOKENS`, so
    every count fits in ``int64`` on the host and ``int32`` on the devices.
    """

    max_period: int = 13
    min_period: int = 1
    max_count: int = 32

    def __post_init__(self) -> None:
        path = "InstanceFilter."
        row = f"a row holds at most {MAX_ROW_TOKENS:,} tokens"
        for name, low in (("min_period", 1), ("max_period", 1), ("max_count", 2)):
            value = integer(getattr(self, name), path + name, low=low)
            most, why = MAX_ROW_TOKENS, row
            if name == "max_count":
                most = MAX_ROW_TOKENS // self.min_period
                why += f", so no more copies of an n-gram of min_period {self.min_period}"
            if value > most:
                raise BadValue(path + name, f"must be at most {most:,} ({why}), got {value}")
            object.__setattr__(self, name, value)
        if self.max_period < self.min_period:
            raise BadValue(
                path + "max_period",
                f"must be >= min_period ({self.min_period}), got {self.max_period}",
            )

    @classmethod
    def of(cls, value: Any, path: str = "instance_filter") -> InstanceFilter | None:
        """``value`` as a filter: ``None`` (off), an ``InstanceFilter``, or a
        mapping of its fields (YAML, a saved state)."""
        if value is None or isinstance(value, InstanceFilter):
            return value
        fields = mapping(value, path, "None or a mapping of InstanceFilter fields")
        known_keys(fields, path, (f.name for f in dataclasses.fields(cls)), "field")
        try:
            return cls(**fields)
        except BadValue as e:
            raise e.moved("InstanceFilter", path) from None

    def check_seq_len(self, seq_len: int, path: str) -> None:
        """Refuses a filter that can reject no row of ``seq_len`` tokens."""
        need = self.max_count * self.min_period
        if need > seq_len:
            raise BadValue(
                path + ".max_count",
                f"is {self.max_count}: {self.max_count} copies of an n-gram of min_period "
                f"{self.min_period} take {need:,} tokens, more than a row of seq_len "
                f"{seq_len:,} holds, so the filter could reject no row; set max_count <= "
                f"{max(seq_len // self.min_period, 1):,} or seq_len >= {need:,}",
            )

    def last_period(self, seq_len: int) -> int:
        """The longest period whose ``max_count`` copies fit in a row of
        ``seq_len`` tokens (below ``min_period``: none does)."""
        return min(self.max_period, seq_len // self.max_count)

    def rejected(
        self, targets: np.ndarray, segment_ids: np.ndarray, kernel: str = "auto"
    ) -> np.ndarray:
        """``[rows] bool``: which rows of ``targets`` (``[rows, seq_len]``) the
        filter rejects; columns whose ``segment_ids`` are 0 are padding. Every
        ``kernel`` (:func:`kernel_module`) gives the same rows.

        The numpy path is vectorised over the batch: for each period, a run of ``reach`` equal
        pairs covers 4 consecutive multiples of ``reach // 4``, so only those
        columns are compared first; where 4 consecutive ones match, the
        ``2 * reach - 1`` columns around them are checked.
        """
        fast = kernel_module(kernel)
        if fast is not None:
            return fast.rejected(
                np.ascontiguousarray(targets, np.int32),
                np.ascontiguousarray(segment_ids, np.int32),
                self.min_period,
                self.max_period,
                self.max_count,
            )
        rows, width = targets.shape
        out = np.zeros(rows, bool)
        for p in range(self.min_period, self.last_period(width) + 1):
            reach = (self.max_count - 1) * p  # equal pairs that reject a row
            pairs = width - p  # columns j with a j + p
            need = min(_PROBES, reach)
            stride = reach // need  # any `reach` consecutive columns hold `need` probes
            probes = np.arange(0, pairs, stride)
            # Candidates only (j itself may be padding): the check around them is exact.
            ahead = slice(p, pairs + p, stride)
            hit = targets[:, :pairs:stride] == targets[:, ahead]
            hit &= segment_ids[:, ahead] != 0
            runs = hit[:, : hit.shape[1] - need + 1].copy()
            for k in range(1, need):
                runs &= hit[:, k : hit.shape[1] - need + 1 + k]
            runs &= ~out[:, None]
            if not runs.any():
                continue
            r, q = np.nonzero(runs)
            cols = probes[q][:, None] + np.arange(-reach + 1, reach)[None, :]
            inside = (cols >= 0) & (cols < pairs)
            cols = np.clip(cols, 0, pairs - 1)
            near = targets[r[:, None], cols] == targets[r[:, None], cols + p]
            near &= inside & (segment_ids[r[:, None], cols] != 0)
            near &= segment_ids[r[:, None], cols + p] != 0
            sums = np.pad(np.cumsum(near, axis=1, dtype=np.int32), ((0, 0), (1, 0)))
            full = (sums[:, reach:] - sums[:, :-reach] == reach).any(axis=1)
            out[r[full]] = True
        return out

    def rejected_jax(self, targets: jax.Array, segment_ids: jax.Array) -> jax.Array:
        """``[rows] bool``, as :meth:`rejected`, with jax ops (inside ``jax.jit``).

        One loop over the periods, so the program (and its compile time) is the
        same for any ``max_period``. For each period ``p``, the run of equal
        pairs ending at each column is measured from the last unequal column
        before it (a running maximum).
        """
        rows, width = targets.shape
        last = self.last_period(width)
        if last < self.min_period:
            return jnp.zeros(rows, bool)
        real = segment_ids != 0
        cols = jnp.arange(width, dtype=jnp.int32)[None, :]
        # Column j + p of a row is column j of these at offset p; the wrapped
        # columns (j + p >= width) are masked out below.
        twice = jnp.concatenate([targets, targets], axis=1)
        twice_real = jnp.concatenate([real, real], axis=1)

        def period(p: jax.Array, out: jax.Array) -> jax.Array:
            ahead = jax.lax.dynamic_slice_in_dim(twice, p, width, axis=1)
            ahead_real = jax.lax.dynamic_slice_in_dim(twice_real, p, width, axis=1)
            pairs = (targets == ahead) & real & ahead_real & (cols < width - p)
            unequal = jax.lax.cummax(jnp.where(pairs, -1, cols), axis=1)
            reach = (self.max_count - 1) * p
            return out | jnp.any(cols - unequal >= reach, axis=1)

        return jax.lax.fori_loop(self.min_period, last + 1, period, jnp.zeros(rows, bool))


def apply_filter_jax(
    rule: InstanceFilter | None, fields: dict[str, jax.Array]
) -> dict[str, jax.Array]:
    """``fields`` with ``loss_mask`` False on the rows ``rule`` rejects (jax ops)."""
    if rule is None:
        return fields
    rejected = rule.rejected_jax(fields["targets"], fields["segment_ids"])
    return {**fields, "loss_mask": fields["loss_mask"] & ~rejected[:, None]}


class FilteredRows:
    """A loader's filter (``rule``, ``None``: off), and the rows it rejected in
    the steps handed out. Thread-safe. A step's count is noted when it is
    decoded (:meth:`apply`, perhaps ahead of time) and added when it is handed out."""

    def __init__(
        self,
        rule: InstanceFilter | None,
        run_blocks: Callable[[int, Callable[[int, int], None], int | None], None],
    ) -> None:
        self.rule, self._run_blocks = rule, run_blocks
        self._lock = threading.Lock()
        self._pending: dict[int, int] = {}
        self.total = 0
        self.last = 0

    def apply(
        self, fields: dict[str, np.ndarray], step: int | None = None, threads: int | None = None
    ) -> dict[str, np.ndarray]:
        """``fields`` after the filter (in place, in row blocks on at most
        ``threads`` threads); the rows it rejected are noted for ``step``."""
        assert self.rule is not None
        rule, targets, segment_ids = self.rule, fields["targets"], fields["segment_ids"]
        rejected = np.zeros(targets.shape[0], bool)

        def work(a: int, b: int) -> None:
            rejected[a:b] = rule.rejected(targets[a:b], segment_ids[a:b])

        self._run_blocks(targets.shape[0], work, threads)  # the kernel releases the GIL
        fields["loss_mask"][rejected] = False
        if step is not None:
            with self._lock:
                self._pending[step] = int(rejected.sum())
                while len(self._pending) > _PENDING:
                    del self._pending[min(self._pending)]
        return fields

    def handed(self, step: int) -> None:
        """Counts the rows noted for ``step`` (0 if none were), now handed out."""
        with self._lock:
            self.last = self._pending.pop(step, 0)
            self.total += self.last

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"filtered_rows": self.total, "filtered_rows_last": self.last}
