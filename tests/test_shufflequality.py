"""``scripts/shuffle_quality.py``: its total-variation arithmetic on hand-computed
cases, its single-window reference order, and on a small store sorted by source
the full shuffle's batches nearer the global mix than the single window's."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

import flat_tokens_jax as ftj

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "shuffle_quality.py"


def script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("shuffle_quality", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


sq = script()


def test_tv_of_hand_computed_histograms() -> None:
    # [3, 1, 0] / 4 against [1/2, 1/4, 1/4]: |0.75 - 0.5| + 0 + |0 - 0.25|, halved.
    assert sq.tv(np.array([3, 1, 0]), np.array([0.5, 0.25, 0.25])) == pytest.approx(0.25)
    assert sq.tv(np.array([[1, 1], [0, 5]]), np.array([0.5, 0.5])).tolist() == [0.0, 0.5]
    # Steps of one source each, alternating: each batch is 0.5 away, each run of 2 is exact.
    hist = np.array([[2, 0], [0, 2], [2, 0], [0, 2], [2, 0]])
    assert sq.tv_means(hist, np.array([0.5, 0.5]), 2) == pytest.approx((0.5, 0.0))
    assert sq.tv_means(hist, np.array([0.5, 0.5]), 1) == pytest.approx((0.5, 0.5))


def test_labels_and_histograms() -> None:
    bounds = np.array([0, 10, 30, 35])
    assert sq.labels(bounds, np.array([0, 9, 10, 29, 34])).tolist() == [0, 0, 1, 1, 2]
    rows = np.array([[0, 0, 2], [1, 2, 2]])
    assert sq.histograms(rows, 3).tolist() == [[2, 0, 1], [0, 1, 2]]


def test_single_window_takes_each_batch_from_one_window() -> None:
    n, block, window, batch = 105, 7, 3, 21  # a window: 21 records, a batch
    picked = sq.single_window(n, block, window, seed=5, count=63)
    assert len(set(picked.tolist())) == 63 and picked.min() >= 0 and picked.max() < n
    for step in picked.reshape(-1, batch):
        assert len(set((step // block).tolist())) == window
    # A partial last block (100 records): still every record once.
    assert sorted(sq.single_window(100, block, window, seed=5, count=100).tolist()) == list(
        range(100)
    )


def test_full_shuffle_batches_are_nearer_the_global_mix(tmp_path: Path) -> None:
    """4 sources sorted in 2**16 tokens, 16 windows of 64 a batch: a full
    shuffle's batch is about 0.2 from the global mix (0.14 to 0.19 over seeds
    0 to 7); one drawn from a window of 2 blocks of 16 windows holds 1 to 3
    sources, about 0.5 away (0.44 to 0.55)."""
    store = sq.write_sorted(tmp_path / "sorted", 1 << 16, 4)
    p = sq.global_p(store, 64)
    assert p.tolist() == pytest.approx([0.1, 0.2, 0.3, 0.4], abs=0.01)
    cfg = ftj.LoaderConfig(batch_size=16, seq_len=64, seed=3, prefetch=0)
    loader = ftj.Loader(store.ft, cfg)
    full = sq.histograms(sq.labels(store.bounds, sq.loader_starts(loader, 20)), 4)
    records = loader.components[0]
    picked = sq.single_window(len(records), 16, 2, seed=3, count=20 * 16)
    starts = records.token_ranges(picked)[0].reshape(20, 16)
    window = sq.histograms(sq.labels(store.bounds, starts), 4)
    assert full.sum() == window.sum() == 20 * 16
    full_tv, window_tv = sq.tv_means(full, p, 1)[0], sq.tv_means(window, p, 1)[0]
    assert full_tv < 0.25 and window_tv > 0.4 and window_tv > 2 * full_tv
