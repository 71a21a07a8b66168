"""Rows ordered so that the data-parallel groups of a batch carry about the same
attention work: :func:`balanced_rows` of each row's cost, :func:`attention_costs`
(the cost model: docs/guide/multihost.md, "Long context").
"""

from __future__ import annotations

import numpy as np

TOLERANCE = 1e-3
"""How far over the mean group cost the costliest group may stay: closer is noise."""


def attention_costs(row: np.ndarray, length: np.ndarray, rows: int) -> np.ndarray:
    """``[rows] int64``: the sum of ``length ** 2`` of each row's segments
    (segment ``i`` of row ``row[i]`` is ``length[i]`` tokens long)."""
    out = np.zeros(rows, np.int64)
    np.add.at(out, np.asarray(row, np.int64), np.asarray(length, np.int64) ** 2)
    return out


def balanced_rows(costs: np.ndarray, groups: int) -> np.ndarray:
    """The order of a batch's rows, ``[n] int64`` (balanced row ``r`` holds row
    ``order[r]``), under which the ``groups`` contiguous groups of ``n / groups``
    rows have near-equal summed ``costs``; each group's rows ascending.

    Rows are dealt costliest first to the cheapest group with room (ties: the
    lower row, the lower group), then the costliest group swaps a row with
    another group while that lowers the larger of the two (until it is within
    :data:`TOLERANCE` of the mean); the rows' own order is kept where it is as
    good. A pure function of ``costs``: every host computes the same order."""
    costs = np.asarray(costs, np.int64)
    n = costs.size
    if groups < 1 or n % groups:
        raise ValueError(f"{n} rows do not split into {groups} equal groups")
    per = n // groups
    keep = np.arange(n, dtype=np.int64)
    if groups == 1 or per == 0:
        return keep
    members = np.zeros((groups, per), np.int64)
    load, count = np.zeros(groups, np.int64), np.zeros(groups, np.int64)
    full = np.iinfo(np.int64).max
    for r in np.argsort(-costs, kind="stable").tolist():
        g = int(np.argmin(np.where(count < per, load, full)))
        members[g, count[g]] = r
        load[g] += costs[r]
        count[g] += 1
    enough = float(load.sum()) / groups * (1 + TOLERANCE)
    for _ in range(n):
        a = int(np.argmax(load))
        if load[a] <= enough:
            break
        others = np.delete(np.arange(groups), a)
        # Moving row i of group a for row j of group b moves d = c_i - c_j.
        d = costs[members[a]][:, None, None] - costs[members[others]][None]
        after = np.maximum(load[a] - d, load[others][None, :, None] + d)
        i, b, j = np.unravel_index(int(np.argmin(after)), after.shape)
        if after[i, b, j] >= load[a]:
            break
        g = int(others[b])
        members[a, i], members[g, j] = members[g, j], members[a, i]
        load[a] -= d[i, b, j]
        load[g] += d[i, b, j]
    if load.max() >= costs.reshape(groups, per).sum(axis=1).max():
        return keep
    return np.sort(members, axis=1).reshape(-1)
