"""Weighted blending of record sources, O(1) per sample from any step.

Weights count records (samples). They are turned into exact per-period counts:
over a period of ``P`` samples component ``c`` gets ``n_c`` samples, the
weights times ``P`` rounded by largest remainder. Within a period the samples
are laid out by ideal time: component ``c``'s ``k``-th sample sits at
``(k + 1/2) / n_c`` of the period (ties to the lower component index), which
spreads every component evenly. Global sample ``g`` in period ``p`` at offset
``r`` is then component ``comp[r]``'s sample ``offset_c + p * n_c + rank[r]``:
two table lookups of size ``P``, whatever ``g``.

A weight schedule changes the weights at given steps; each component's
consumption before a change is counted arithmetically (whole periods plus a
prefix count), so any step is still O(1).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from flat_tokens_jax.dataset import FlatTokens, open_dataset
from flat_tokens_jax.records import PackedRecords, PaddedRecords, Records

MAX_DEFAULT_PERIOD = 1 << 20


@dataclasses.dataclass(frozen=True)
class Period:
    """The layout of one period of ``period`` samples for fixed weights.

    Attributes:
        counts: ``[K] int64`` samples of each component per period.
        component: ``[period] int32`` component of each offset in the period.
        rank: ``[period] int32`` how many samples of that component precede it.
    """

    counts: np.ndarray
    component: np.ndarray
    rank: np.ndarray

    @property
    def period(self) -> int:
        return int(self.component.size)

    @classmethod
    def layout(cls, weights: Sequence[float] | np.ndarray, period: int) -> Period:
        w = np.asarray(weights, np.float64)
        # Rounded so that weights meant as exact ratios split as their decimal
        # values do, whatever the float error: 0.5 and 0.1 over 3 slots are a
        # tie (2.5 and 0.5), not 2.5 and 0.49999999999999994.
        share = np.round(w / w.sum() * period, 9)
        counts = np.floor(share).astype(np.int64)
        short = period - int(counts.sum())
        if short:  # largest remainder; ties to the lower index
            order = np.lexsort((np.arange(w.size), -np.round(share - counts, 9)))
            counts[order[:short]] += 1
        component = np.repeat(np.arange(w.size, dtype=np.int32), counts)
        rank = np.concatenate([np.arange(n, dtype=np.int32) for n in counts])
        when = (2.0 * rank + 1.0) / (2.0 * counts[component])
        order = np.lexsort((component, when))
        return cls(counts, component[order], rank[order])

    def consumed(self, num_samples: int) -> np.ndarray:
        """``[K] int64`` samples each component gets in the first ``num_samples``."""
        whole, rest = divmod(num_samples, self.period)
        prefix = np.bincount(self.component[:rest], minlength=self.counts.size)
        return whole * self.counts + prefix


class Mixture:
    """Blends record sources by weight; each component keeps its own epochs.

    Args:
        components: ``(source, weight)`` pairs. A source is a
            :class:`~flat_tokens_jax.records.Records` (its own packing) or a
            ``FlatTokens`` split or view (records made with ``seq_len`` and
            ``packing``). Weights count records; 0 leaves a component unused.
        seed: mixed with the loader's seed into each component's shuffle key,
            so each component reshuffles every one of its own epochs.
        seq_len: tokens per record; required for ``FlatTokens`` sources.
        packing: packing of records made from ``FlatTokens`` sources.
        period: samples per period; ``None``: ``max(1000, 100 / smallest
            positive weight share)``, at most ``2**20``. Proportions are exact
            over every whole period.
        schedule: ``[(step, weights), ...]``: from ``step`` on, use ``weights``
            (one per component); steps strictly increasing and > 0.

    Raises:
        ValueError: negative or all-zero weights, or a positive weight that
            rounds to no sample per period.
    """

    def __init__(
        self,
        components: Sequence[tuple[Records | FlatTokens, float]],
        seed: int = 0,
        *,
        seq_len: int | None = None,
        packing: bool = True,
        period: int | None = None,
        schedule: Sequence[tuple[int, Sequence[float]]] = (),
    ) -> None:
        if not components:
            raise ValueError("a Mixture needs at least one component")
        self.components: tuple[Records, ...] = tuple(
            _as_records(src, seq_len, packing, i) for i, (src, _) in enumerate(components)
        )
        lengths = {r.seq_len for r in self.components}
        if len(lengths) > 1:
            raise ValueError(f"every component needs the same seq_len, got {sorted(lengths)}")
        self.seq_len = lengths.pop()
        packs = {r.packed for r in self.components}
        self.packed: bool | None = packs.pop() if len(packs) == 1 else None
        self.seed = seed
        steps = [0] + [int(s) for s, _ in schedule]
        if any(b <= a for a, b in itertools.pairwise(steps)):
            raise ValueError(f"schedule steps must be > 0 and strictly increasing, got {steps[1:]}")
        weights = [[w for _, w in components], *[list(w) for _, w in schedule]]
        self.steps = np.array(steps, np.int64)
        self.weights = [
            _check_weights(w, len(self.components), s) for s, w in zip(steps, weights, strict=True)
        ]
        self.periods = [Period.layout(w, period or _default_period(w)) for w in self.weights]
        for s, w, p in zip(steps, self.weights, self.periods, strict=True):
            lost = [i for i, x in enumerate(w) if x > 0 and p.counts[i] == 0]
            if lost:
                raise ValueError(
                    f"weights from step {s}: component(s) {lost} get no sample "
                    f"in a period of {p.period}; pass a larger period"
                )
        self._offsets: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return sum(len(r) for r in self.components)

    def __repr__(self) -> str:
        parts = ", ".join(
            f"({r!r}, {w:g})" for r, w in zip(self.components, self.weights[0], strict=True)
        )
        return f"Mixture([{parts}], seed={self.seed}, period={self.periods[0].period})"

    def _segment_offsets(self, batch_size: int) -> np.ndarray:
        """``[segments, K]`` samples of each component drawn before each segment."""
        if batch_size not in self._offsets:
            offsets = np.zeros((len(self.periods), len(self.components)), np.int64)
            starts = self.steps * batch_size
            for j in range(1, len(self.periods)):
                drawn = self.periods[j - 1].consumed(int(starts[j] - starts[j - 1]))
                offsets[j] = offsets[j - 1] + drawn
            self._offsets[batch_size] = offsets
        return self._offsets[batch_size]

    def route(self, samples: np.ndarray, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
        """Maps global samples to ``(component [k] int64, component sample [k] int64)``.

        ``batch_size`` turns the schedule's steps into samples.
        """
        g = np.asarray(samples, np.int64)
        offsets = self._segment_offsets(batch_size)
        starts = self.steps * batch_size
        segment = np.searchsorted(starts, g, side="right") - 1
        comp = np.empty(g.shape, np.int64)
        sample = np.empty(g.shape, np.int64)
        for j in np.unique(segment).tolist():
            here = segment == j
            p = self.periods[j]
            whole, rest = np.divmod(g[here] - starts[j], p.period)
            c = p.component[rest].astype(np.int64)
            comp[here] = c
            sample[here] = offsets[j, c] + whole * p.counts[c] + p.rank[rest]
        return comp, sample

    def fingerprint(self) -> dict[str, Any]:
        """The components' data and the blending (weights, periods, schedule)."""
        return {
            "components": [r.fingerprint() for r in self.components],
            "weights": [list(map(float, w)) for w in self.weights],
            "steps": self.steps.tolist(),
            "periods": [p.period for p in self.periods],
            "seed": self.seed,
        }

    @property
    def max_token_id(self) -> int:
        return max(int(r.fingerprint()["max_token_id"]) for r in self.components)


def _as_records(
    source: Records | FlatTokens, seq_len: int | None, packing: bool, index: int
) -> Records:
    if isinstance(source, FlatTokens):
        if seq_len is None:
            raise ValueError(
                f"component {index} is a FlatTokens split: pass seq_len= so the "
                "Mixture can make its records"
            )
        return PackedRecords(source, seq_len) if packing else PaddedRecords(source, seq_len)
    return source


def _check_weights(weights: Sequence[float], k: int, step: int) -> np.ndarray:
    w = np.asarray(weights, np.float64)
    where = "weights" if step == 0 else f"weights from step {step}"
    if w.shape != (k,):
        raise ValueError(f"{where}: expected {k} weights, one per component, got {w.shape}")
    if not np.isfinite(w).all() or (w < 0).any():
        raise ValueError(f"{where} must be finite and non-negative, got {w.tolist()}")
    if w.sum() <= 0:
        raise ValueError(f"{where} are all zero: at least one component needs weight > 0")
    return w


def _default_period(weights: np.ndarray) -> int:
    smallest = float((weights[weights > 0] / weights.sum()).min())
    return int(min(MAX_DEFAULT_PERIOD, max(1000, math.ceil(100 / smallest))))


def mixture_from_config(config: Mapping[str, Any], split: str = "train") -> Mixture:
    """Builds a mixture from a Nanoset-style mapping (e.g. a YAML ``data`` section).

    ``config`` holds ``datasets`` (URL -> weight), ``seq_len``, and optionally
    ``split`` (e.g. ``"949,50,1"``: each dataset's ``train`` split is cut into
    train/valid/test views and ``split`` picks one of ``"train"``,
    ``"valid"``, ``"test"``), ``packing`` (default true), ``seed``, ``period``.
    Without ``split`` the dataset split named ``split`` is used.
    """
    known = {"datasets", "seq_len", "split", "packing", "seed", "period"}
    unknown = sorted(set(config) - known)
    if unknown:
        raise ValueError(f"unknown mixture config key(s) {unknown}; known: {sorted(known)}")
    datasets = config.get("datasets")
    if not isinstance(datasets, Mapping) or not datasets:
        raise ValueError("mixture config needs 'datasets': a mapping of URL to weight")
    parts: list[tuple[Records | FlatTokens, float]] = []
    for url, weight in datasets.items():
        ds = open_dataset(url)
        if "split" in config:
            views = dict(
                zip(("train", "valid", "test"), ds["train"].split(config["split"]), strict=False)
            )
            if split not in views:
                raise ValueError(
                    f"split must be one of {sorted(views)} with a 'split' config, got {split!r}"
                )
            parts.append((views[split], float(weight)))
        else:
            parts.append((ds[split], float(weight)))
    return Mixture(
        parts,
        seed=int(config.get("seed", 0)),
        seq_len=int(config["seq_len"]),
        packing=bool(config.get("packing", True)),
        period=config.get("period"),
    )
