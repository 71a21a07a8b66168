"""Batch layouts: the five decoded fields in the form a trainer takes (``LoaderConfig.layout``,
see docs/guide/loading.md, "Batch layouts"), in numpy on the host or in jax ops inside
``jax.jit``, with the same values either way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np

from flat_tokens_jax.core.fields import Packing
from flat_tokens_jax.core.values import BadValue, boolean, choice, integer
from flat_tokens_jax.data.records import Windows

LAYOUTS = ("fields", "segments", "tokens", "maxtext")
"""The values of ``LoaderConfig.layout``."""

WHOLE_ROWS = ("tokens", "segment_lengths", "source")
"""Fields not ``[B, L]``: laid out over a sharding's batch axis only, whatever
their width (``max_segments`` may equal ``L``; ``source`` is ``[B]``)."""

_FIVE = ("inputs", "targets", "segment_ids", "positions", "loss_mask")

FLAGS = ("loss_mask", "sequence_start")
"""The ``bool`` fields (1 byte a column); every other field is ``int32`` (4)."""


@dataclasses.dataclass(frozen=True)
class BatchLayout:
    """What a batch holds (the fields of each: docs/guide/loading.md): ``name``
    one of :data:`LAYOUTS`, ``max_segments`` (the width of ``segment_lengths``,
    each row's run lengths), ``sequence_start``, ``source``, ``context_parallel``
    (``[B, L]`` fields in :func:`zigzag_order` when above 1); ``plain``: the five
    fields as decoded. A run is a maximal stretch of one segment id, and a new
    one begins at every sequence start (padding is a run of its own).

    Example:
        >>> five = {
        ...     "inputs": np.array([[0, 5, 0, 7]]),
        ...     "targets": np.array([[5, 6, 7, 8]]),
        ...     "segment_ids": np.array([[1, 1, 2, 2]]),
        ...     "positions": np.array([[0, 1, 0, 1]]),
        ...     "loss_mask": np.ones((1, 4), bool),
        ... }
        >>> out = BatchLayout("tokens", max_segments=3).apply(five, np.array([True]))
        >>> out["tokens"].tolist(), out["segment_lengths"].tolist()
        ([[0, 5, 6, 7, 8]], [[2, 2, 0]])
        >>> out["sequence_start"].tolist()
        [[True, False, True, False]]
    """

    name: str = "fields"
    max_segments: int | None = None
    sequence_start: bool = False
    source: bool = False
    context_parallel: int = 1
    plain: bool = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        choice(self.name, "layout", LAYOUTS)
        m = integer(self.max_segments, "max_segments", low=1, optional=True)
        object.__setattr__(self, "max_segments", m)
        object.__setattr__(self, "sequence_start", boolean(self.sequence_start, "sequence_start"))
        object.__setattr__(self, "source", boolean(self.source, "source_field"))
        c = integer(self.context_parallel, "context_parallel", low=1)
        object.__setattr__(self, "context_parallel", c)
        extra = m is not None or self.sequence_start or self.source or c > 1
        object.__setattr__(self, "plain", self.name == "fields" and not extra)

    def widths(self, seq_len: int) -> dict[str, int]:
        """Every key of the layout's batch and its width (1 for ``source``)."""
        keys = {
            "fields": _FIVE,
            "segments": (*_FIVE, "sequence_start"),
            "tokens": ("tokens", "loss_mask", "segment_ids", "positions", "sequence_start"),
            "maxtext": (
                "inputs",
                "inputs_segmentation",
                "inputs_position",
                "targets",
                "targets_segmentation",
                "targets_position",
            ),
        }[self.name]
        out = {k: seq_len + 1 if k == "tokens" else seq_len for k in keys}
        if self.sequence_start:
            out["sequence_start"] = seq_len
        if self.max_segments is not None:
            out["segment_lengths"] = self.max_segments
        if self.source:
            out["source"] = 1
        return out

    def row_bytes(self, seq_len: int) -> int:
        """Bytes one row of the layout's batch holds (``"fields"``: 17 a token)."""
        return sum(w * (1 if k in FLAGS else 4) for k, w in self.widths(seq_len).items())

    def apply(
        self,
        fields: Mapping[str, Any],
        row_starts: Any,
        *,
        xp: Any = np,
        where: str = "the batch",
        rows: np.ndarray | None = None,
        sources: Any = None,
    ) -> dict[str, Any]:
        """The layout's arrays from the five fields ``[B, L]`` and ``row_starts`` ``[B] bool``.

        ``xp``: ``np`` on the host, ``jnp`` inside ``jax.jit``, where a row of
        more runs than ``max_segments`` is not refused (its lengths past it are
        dropped: check on the host with :func:`check_runs`). ``where`` and
        ``rows`` (each row's global index) name a row in errors; ``sources``
        ``[B]`` is the batch's ``source`` (needed with ``source``).
        """
        if self.plain:
            return dict(fields)
        seg, pos = fields["segment_ids"], fields["positions"]
        start = sequence_starts(seg, pos, row_starts, xp)
        out: dict[str, Any]
        if self.name == "fields":
            out = dict(fields)
        elif self.name == "segments":
            out = {**fields, "sequence_start": start}
        elif self.name == "tokens":
            out = {
                "tokens": xp.concatenate([fields["inputs"][:, :1], fields["targets"]], axis=1),
                "loss_mask": fields["loss_mask"],
                "segment_ids": seg,
                "positions": pos,
                "sequence_start": start,
            }
        else:
            out = {
                "inputs": fields["inputs"],
                "inputs_segmentation": seg,
                "inputs_position": pos,
                "targets": fields["targets"],
                "targets_segmentation": seg * fields["loss_mask"],
                "targets_position": pos,
            }
        if self.sequence_start:
            out["sequence_start"] = start
        if self.max_segments is not None:
            bounds = run_bounds(seg, start, xp)
            if xp is np:
                out["segment_lengths"] = _lengths_np(bounds, self.max_segments, where, rows)
            else:
                out["segment_lengths"] = _lengths_jnp(bounds, self.max_segments)
        if self.source:
            if sources is None:
                raise ValueError("a layout with source needs each row's source (sources=)")
            out["source"] = xp.asarray(sources, dtype=xp.int32)
        if self.context_parallel > 1:
            c = self.context_parallel
            out = {k: v if k in WHOLE_ROWS else _zigzag(v, c, xp) for k, v in out.items()}
        return out

    def check_blocks(
        self, data: Mapping[Any, Any], seq_len: int, packing: Packing, where: str
    ) -> None:
        """Refuses rows of more runs than ``max_segments`` in blocks read for
        decoding on the devices (``data``: ``Block`` to ``BlockData``, see
        :mod:`~flat_tokens_jax.decoding.sharding`), counted over the columns read: the
        decode inside ``jax.jit`` cannot raise."""
        if self.max_segments is None:
            return
        runs: dict[tuple[int, int], np.ndarray] = {}
        for block, d in data.items():
            counted = block_runs(d.encoded, d.lengths, block.cols[0], seq_len, packing)
            runs[block.rows] = runs.get(block.rows, 0) + counted
        for (first, _), counts in sorted(runs.items()):
            rows = np.arange(first, first + counts.size)
            check_runs(counts, self.max_segments, where, rows)


PLAIN = BatchLayout()
"""The five fields as decoded (``layout="fields"``, no ``max_segments``)."""


def check_max_segments(max_segments: int | None, seq_len: int, packing: Packing, path: str) -> None:
    """Refuses a ``max_segments`` (at ``path``) that no row of ``seq_len``
    columns can use: above ``seq_len``, or below 2 with ``packing="bins"``."""
    if max_segments is None:
        return
    if packing is Packing.BINS and max_segments < 2:
        raise BadValue(
            path,
            f"must be >= 2 with packing='bins' (a bin not full is a sequence and "
            f"its padding: 2 runs), got {max_segments}",
        )
    if max_segments > seq_len:
        raise BadValue(
            path,
            f"must be <= seq_len ({seq_len:,}): a row of {seq_len:,} columns holds at most "
            f"{seq_len:,} runs, got {max_segments:,}; set max_segments <= {seq_len:,}",
        )


def check_context_parallel(context_parallel: int, seq_len: int, layout: str, path: str) -> None:
    """Refuses a ``context_parallel`` (at ``path``) above 1 that does not cut
    ``seq_len`` into ``2 * context_parallel`` equal chunks, or with ``layout="tokens"``."""
    c = context_parallel
    if c > 1 and layout == "tokens":
        raise BadValue(
            path,
            f"is {c}, but layout is 'tokens': a [B, L + 1] row the trainer shifts "
            "itself has no zigzag order; use layout='fields', or context_parallel 1",
        )
    if c > 1 and seq_len % (2 * c):
        raise BadValue(
            path,
            f"is {c}: it splits a row into {2 * c} equal chunks, but seq_len {seq_len} "
            f"is not a multiple of {2 * c}; set seq_len to a multiple of {2 * c}",
        )


def zigzag_order(seq_len: int, context_parallel: int) -> np.ndarray:
    """``[seq_len] int64``: the columns of a batch in the order ``context_parallel``
    lays them out (``batch_cp[:, j] == batch[:, order[j]]``): ``2C`` equal chunks in
    the order ``0, 2C-1, 1, 2C-2, ..., C-1, C`` (why: docs/guide/loading.md,
    "Context parallelism: the zigzag order").

    Example:
        >>> zigzag_order(8, 2).tolist()
        [0, 1, 6, 7, 2, 3, 4, 5]
    """
    seq_len = integer(seq_len, "seq_len", low=1)
    c = integer(context_parallel, "context_parallel", low=1)
    check_context_parallel(c, seq_len, "fields", "context_parallel")
    return np.asarray(_zigzag(np.arange(seq_len, dtype=np.int64)[None], c, np)[0])


def _zigzag(values: Any, c: int, xp: Any) -> Any:
    """``values`` ``[B, L]`` in :func:`zigzag_order`, with no gather (a reverse,
    so it keeps any sharding of the batch axis inside ``jax.jit``); one rank's is the identity."""
    if c == 1:
        return values
    b, length = values.shape
    halves = values.reshape(b, 2, c, length // (2 * c))
    return xp.stack([halves[:, 0], halves[:, 1, ::-1]], axis=2).reshape(b, length)


def sequence_starts(segment_ids: Any, positions: Any, row_starts: Any, xp: Any = np) -> Any:
    """``[B, L] bool``: True where a sequence starts at that column.

    Past column 0 a sequence starts where a real token has position 0; at
    column 0 where ``row_starts`` says so (and the column is not padding).
    """
    start = (positions == 0) & (segment_ids != 0)
    first = start[:, :1] & xp.asarray(row_starts, bool)[:, None]
    return xp.concatenate([first, start[:, 1:]], axis=1)


def run_bounds(segment_ids: Any, sequence_start: Any, xp: Any = np) -> Any:
    """``[B, L] bool``: True at the first column of each run (column 0 always)."""
    change = (segment_ids[:, 1:] != segment_ids[:, :-1]) | sequence_start[:, 1:]
    first = xp.ones((segment_ids.shape[0], 1), bool)
    return xp.concatenate([first, change], axis=1)


def check_runs(
    runs: np.ndarray, max_segments: int, where: str, rows: np.ndarray | None = None
) -> None:
    """Refuses a row of more than ``max_segments`` runs (``runs`` ``[B]``)."""
    over = np.flatnonzero(np.asarray(runs) > max_segments)
    if over.size == 0:
        return
    r = int(over[0])
    row = r if rows is None else int(rows[r])
    most = int(np.max(runs))
    raise ValueError(
        f"{where}: row {row} has {int(runs[r])} runs (sequences, fragments and padding) "
        f"but max_segments is {max_segments} ({over.size} row(s) over; the most: {most}): "
        f"set LoaderConfig.max_segments >= {most}, or with packing='bins' let it cap "
        "the sequences per bin"
    )


def row_starts(windows: Windows, packing: Packing) -> np.ndarray:
    """``[k] bool``: whether column 0 of each row read as ``windows`` starts a sequence."""
    if packing is Packing.WINDOWS:
        return (windows.encoded[:, 1] & 1) == 1
    assert windows.lengths is not None
    return np.asarray(windows.lengths) > 0


def _lengths_np(
    bounds: np.ndarray, max_segments: int, where: str, rows: np.ndarray | None
) -> np.ndarray:
    """``[B, max_segments] int32`` run lengths from :func:`run_bounds`; refuses
    a row of more runs (see :func:`check_runs`)."""
    b, length = bounds.shape
    at = np.flatnonzero(bounds)  # far faster than a 2-D nonzero
    rr = at // length
    cc = at - rr * length
    runs = np.bincount(rr, minlength=b)
    check_runs(runs, max_segments, where, rows)
    stop = np.append(cc[1:], length)
    stop[np.append(rr[1:] != rr[:-1], True)] = length
    first = np.cumsum(runs) - runs
    k = np.arange(rr.size) - np.repeat(first, runs)
    out = np.zeros((b, max_segments), np.int32)
    out[rr, k] = stop - cc
    return out


def _lengths_jnp(bounds: Any, max_segments: int) -> Any:
    """The jax twin of :func:`_lengths_np`; runs past ``max_segments`` are dropped.

    A row's run index never decreases along it, so run ``k`` begins after the
    columns whose run is below ``k`` (``L`` for runs the row lacks): counted
    by comparison, ``O(B * L * max_segments)``, with no gather or scatter, so
    the batch axis stays sharded as it is under explicit mesh axes.
    """
    run = jnp.cumsum(bounds.astype(jnp.int32), axis=1) - 1
    ks = jnp.arange(max_segments + 1, dtype=jnp.int32)
    firsts = jnp.sum(run[:, None, :] < ks[None, :, None], axis=2, dtype=jnp.int32)
    return jnp.diff(firsts, axis=1)


def block_runs(
    encoded: np.ndarray, lengths: np.ndarray, first_column: int, seq_len: int, packing: Packing
) -> np.ndarray:
    """``[n] int64``: the runs that begin in a block of encoded rows.

    ``encoded`` ``[n, w]`` holds columns ``[first_column, first_column + w)``
    of ``n`` rows (zeros past a row's tokens); ``lengths`` ``[n]`` the tokens
    of padded rows and bins (0 for padding rows). Summed over a row's blocks
    it is the row's run count, as :meth:`BatchLayout.apply` counts it.
    """
    width = encoded.shape[1]
    starts = (encoded & 1).astype(np.int64)
    if first_column == 0:
        starts[:, :1] = 0
    runs = starts.sum(axis=1) + (1 if first_column == 0 else 0)
    if packing is not Packing.WINDOWS:
        eff = np.asarray(lengths, np.int64)
        into_padding = (eff > 0) & (eff < seq_len)
        into_padding &= (eff >= first_column) & (eff < first_column + width)
        runs += into_padding
    return runs
