"""Packing whole sequences into bins of ``seq_len`` tokens: the packing plan, best fit
decreasing per block of :data:`BLOCK` sequences (docs/guide/finetuning.md, "The packing
plan"). The build loops over (bin, run of equal lengths) pairs, never tokens, and
its memory follows the sequences and bins, never ``seq_len``."""

from __future__ import annotations

import bisect
import collections
import hashlib
from collections.abc import Sequence

import numpy as np

from flat_tokens_jax.core import fields
from flat_tokens_jax.core.values import integer

ALGORITHM = "best-fit-decreasing/blocks-of-262144"
"""The name of the packing algorithm, recorded with every plan."""

BLOCK = 1 << 18
"""Sequences packed together (the last block may be shorter)."""


def build_plan(
    lengths: np.ndarray, seq_len: int, max_segments: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Packs sequences of ``lengths`` into bins of ``seq_len`` tokens (:data:`ALGORITHM`).

    Args:
        lengths: ``[num_sequences]`` integer tokens of each sequence, ``>= 0``.
        max_segments: if given (``>= 2``), no bin holds more runs than this:
            its non-empty sequences, plus one for its padding when not full.
            The same best fit, one sequence at a time, where a bin one short of
            the cap takes only a sequence that fills it.

    Returns:
        ``(bin_starts [num_bins + 1] int64, seq_order [num_sequences] int64)``:
        bin ``b`` holds sequences ``seq_order[bin_starts[b]:bin_starts[b + 1]]``,
        ascending.

    Example:
        >>> starts, order = build_plan(np.array([5, 3, 2, 6]), 8)
        >>> [order[a:b].tolist() for a, b in zip(starts[:-1], starts[1:])]
        [[2, 3], [0, 1]]
    """
    seq_len = fields.seq_len(seq_len, "seq_len")
    lens = np.asarray(lengths)
    if lens.ndim != 1 or (lens.size and lens.dtype.kind not in "iu"):
        raise ValueError(f"lengths must be 1-D integers, got {lens.dtype} {lens.shape}")
    if lens.size and lens.min() < 0:
        raise ValueError(f"lengths must be >= 0, got {lens.min()}")
    max_segments = m = integer(max_segments, "max_segments", optional=True)
    if m is not None and m < 2:
        raise ValueError(
            f"max_segments must be an int >= 2 for bins (a bin not full is a sequence "
            f"and its padding: 2 runs), got {m!r}"
        )
    # Block by block, into the output arrays: memory beyond the plan stays O(BLOCK).
    seq_order = np.empty(lens.size, np.int64)
    counts = []
    cap = min(int(seq_len), np.iinfo(np.int64).max)  # lengths fit int64: a larger cap cuts none
    for lo in range(0, lens.size, BLOCK):
        sizes = np.minimum(lens[lo : lo + BLOCK], cap).astype(np.int64)
        if max_segments is None:
            bin_of, num_bins = _pack_block(sizes, int(seq_len))
        else:
            bin_of, num_bins = _pack_block_capped(sizes, int(seq_len), int(max_segments))
        seq_order[lo : lo + sizes.size] = np.argsort(bin_of, kind="stable") + lo
        counts.append(np.bincount(bin_of, minlength=num_bins))
    bin_starts = np.zeros(sum(c.size for c in counts) + 1, np.int64)
    if counts:
        np.cumsum(np.concatenate(counts), out=bin_starts[1:])
    return bin_starts, seq_order


def _pack_block(sizes: np.ndarray, seq_len: int) -> tuple[np.ndarray, int]:
    """Best-fit decreasing of one block: ``(bin of each sequence [n] int64, bins)``."""
    n = sizes.size
    order = np.argsort(-sizes, kind="stable")
    ordered = sizes[order]
    edges = np.flatnonzero(np.diff(ordered)) + 1
    run_lo = np.concatenate(([0], edges)).tolist() if n else []
    run_hi = np.concatenate((edges, [n])).tolist() if n else []
    # stacks[c]: bins with exactly c free tokens, the most recently filled on
    # top; free: the sorted c whose stack is not empty. A dict: memory follows
    # the bins, not seq_len.
    stacks: collections.defaultdict[int, list[int]] = collections.defaultdict(list)
    free: list[int] = []
    seg_bin: list[int] = []
    seg_count: list[int] = []
    num_bins = 0

    def push(bins: Sequence[int], c: int) -> None:
        if c and bins:
            if not stacks[c]:
                bisect.insort(free, c)
            stacks[c].extend(bins)

    for lo, hi in zip(run_lo, run_hi, strict=True):
        size = int(ordered[lo])
        left = hi - lo
        if size == 0:  # takes no space: joins the first bin (or opens one)
            seg_bin.append(0)
            seg_count.append(left)
            num_bins = max(num_bins, 1)
            continue
        while left:
            i = bisect.bisect_left(free, size)
            if i == len(free):
                # Nothing holds it: new bins of `per` sequences each, the last partial.
                per = seq_len // size
                full, rest = divmod(left, per)
                seg_bin.extend(range(num_bins, num_bins + full))
                seg_count.extend([per] * full)
                push(range(num_bins, num_bins + full), seq_len - per * size)
                num_bins += full
                if rest:
                    seg_bin.append(num_bins)
                    seg_count.append(rest)
                    push([num_bins], seq_len - rest * size)
                    num_bins += 1
                break
            c = free[i]
            b = stacks[c].pop()
            if not stacks[c]:
                del free[i], stacks[c]
            # The bin stays the best fit while it holds another one of this size.
            take = min(left, c // size)
            seg_bin.append(b)
            seg_count.append(take)
            left -= take
            push([b], c - take * size)
    bin_of = np.empty(n, np.int64)
    bin_of[order] = np.repeat(np.asarray(seg_bin, np.int64), np.asarray(seg_count, np.int64))
    return bin_of, num_bins


def _pack_block_capped(sizes: np.ndarray, seq_len: int, cap: int) -> tuple[np.ndarray, int]:
    """Best-fit decreasing of one block with at most ``cap`` runs per bin:
    ``(bin of each sequence [n] int64, bins)``."""
    order = np.argsort(-sizes, kind="stable")
    ordered = sizes[order].tolist()
    # open_[c]: bins with c free tokens that may take any sequence that fits,
    # the most recently filled on top; free: their sorted c. last[c]: bins
    # one sequence short of the cap, which only a sequence of c tokens fills.
    open_: collections.defaultdict[int, list[int]] = collections.defaultdict(list)
    last: collections.defaultdict[int, list[int]] = collections.defaultdict(list)
    free: list[int] = []
    members: list[int] = []
    placed = np.empty(len(ordered), np.int64)
    for i, size in enumerate(ordered):
        if size == 0:  # takes no space and makes no run: joins the first bin
            members.extend([0] * (not members))
            placed[i] = 0
            continue
        if last.get(size):
            c, b = size, last[size].pop()
        else:
            j = bisect.bisect_left(free, size)
            if j < len(free):
                c = free[j]
                b = open_[c].pop()
                if not open_[c]:
                    del free[j], open_[c]
            else:
                c, b = seq_len, len(members)
                members.append(0)
        members[b] += 1
        placed[i] = b
        rest = c - size
        if rest == 0 or members[b] >= cap:
            continue
        if members[b] == cap - 1:
            last[rest].append(b)
            continue
        if not open_[rest]:
            bisect.insort(free, rest)
        open_[rest].append(b)
    bin_of = np.empty(len(ordered), np.int64)
    bin_of[order] = placed
    return bin_of, len(members)


def plan_digest(bin_starts: np.ndarray, seq_order: np.ndarray) -> str:
    """16 hex digits of SHA-256 over both plan arrays (little-endian ``int64``)."""
    digest = hashlib.sha256()
    for a in (bin_starts, seq_order):
        digest.update(np.ascontiguousarray(a, "<i8").tobytes())
    return digest.hexdigest()[:16]
