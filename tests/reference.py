"""Brute-force reference of the batch semantics, from a split decoded in memory.

Plain Python loops over tokens, written from "Semantics that tests pin down" in
the design brief (``shared/DESIGN.md`` beside the checkout), independent of the
package's vectorised code.
"""

from __future__ import annotations

import numpy as np

from flat_tokens_jax.sampling.sampling import permute


def packed_row(
    seqs: list[list[int]],
    record: int,
    seq_len: int,
    start_token_id: int = 0,
    masks: list[list[int]] | None = None,
) -> dict[str, list[int]]:
    """``masks``: the stored loss mask of each sequence, or ``None`` (all trained)."""
    tokens = [t for s in seqs for t in s]
    stored = [m for s in masks for m in s] if masks is not None else [1] * len(tokens)
    is_start = [j == 0 for s in seqs for j in range(len(s))]
    row: dict[str, list[int]] = {
        k: [] for k in ("inputs", "targets", "segment_ids", "positions", "loss_mask")
    }
    segment, position = 1, 0
    for t in range(seq_len):
        p = record * seq_len + t
        row["targets"].append(tokens[p])
        row["inputs"].append(start_token_id if is_start[p] else tokens[p - 1])
        if is_start[p] and t > 0:
            segment += 1
        position = 0 if is_start[p] or t == 0 else position + 1
        row["segment_ids"].append(segment)
        row["positions"].append(position)
        row["loss_mask"].append(stored[p])
    return row


def padded_row(
    seqs: list[list[int]],
    record: int,
    seq_len: int,
    start_token_id: int = 0,
    pad_id: int = 0,
    masks: list[list[int]] | None = None,
) -> dict[str, list[int]]:
    seq = seqs[record][:seq_len]
    pad = seq_len - len(seq)
    stored = masks[record][:seq_len] if masks is not None else [1] * len(seq)
    return {
        "inputs": [start_token_id, *seq[:-1]] + [pad_id] * pad,
        "targets": seq + [pad_id] * pad,
        "segment_ids": [1] * len(seq) + [0] * pad,
        "positions": list(range(len(seq))) + [0] * pad,
        "loss_mask": stored + [0] * pad,
    }


def padding_row(seq_len: int, pad_id: int) -> dict[str, list[int]]:
    return {
        "inputs": [pad_id] * seq_len,
        "targets": [pad_id] * seq_len,
        "segment_ids": [0] * seq_len,
        "positions": [0] * seq_len,
        "loss_mask": [0] * seq_len,
    }


def reference_batch(
    seqs: list[list[int]],
    step: int,
    batch_size: int,
    seq_len: int,
    *,
    packing: bool = True,
    shuffle: bool = True,
    seed: int = 0,
    num_epochs: int | None = None,
    start_token_id: int = 0,
    pad_id: int = 0,
    masks: list[list[int]] | None = None,
) -> dict[str, np.ndarray]:
    """The whole global batch at ``step``, one row at a time (``masks``: stored loss masks)."""
    n = sum(map(len, seqs)) // seq_len if packing else len(seqs)
    rows = []
    for row in range(batch_size):
        g = step * batch_size + row
        if num_epochs is not None and g >= n * num_epochs:
            rows.append(padding_row(seq_len, pad_id))
            continue
        epoch, pos = divmod(g, n)
        record = int(permute([pos], n, seed=seed, epoch=epoch)[0]) if shuffle else pos
        rows.append(
            packed_row(seqs, record, seq_len, start_token_id, masks)
            if packing
            else padded_row(seqs, record, seq_len, start_token_id, pad_id, masks)
        )
    return {k: np.array([r[k] for r in rows]) for k in rows[0]}


def bin_row(
    seqs: list[list[int]],
    members: list[int],
    seq_len: int,
    start_token_id: int = 0,
    pad_id: int = 0,
    masks: list[list[int]] | None = None,
) -> dict[str, list[int]]:
    """A bin holding sequences ``members`` in that order, each truncated to ``seq_len``."""
    row: dict[str, list[int]] = {
        k: [] for k in ("inputs", "targets", "segment_ids", "positions", "loss_mask")
    }
    for segment, i in enumerate(members, start=1):
        seq = seqs[i][:seq_len]
        stored = masks[i][:seq_len] if masks is not None else [1] * len(seq)
        row["inputs"] += [start_token_id, *seq[:-1]]
        row["targets"] += seq
        row["segment_ids"] += [segment] * len(seq)
        row["positions"] += list(range(len(seq)))
        row["loss_mask"] += stored
    pad = seq_len - len(row["targets"])
    assert pad >= 0, "the bin holds more than seq_len tokens"
    for key, fill in (("inputs", pad_id), ("targets", pad_id)):
        row[key] += [fill] * pad
    for key in ("segment_ids", "positions", "loss_mask"):
        row[key] += [0] * pad
    return row
