"""Weighted blending of record sources, O(1) per sample from any step: a period's
layout (docs/guide/mixtures.md) makes global sample ``g`` two table lookups of size
``P``; a weight schedule's segments are routed by :mod:`~flat_tokens_jax.sampling.steering`.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from flat_tokens_jax.core import fields
from flat_tokens_jax.core.concurrently import at_once
from flat_tokens_jax.core.fields import Packing
from flat_tokens_jax.core.values import BadValue, boolean, integer, number, sequence
from flat_tokens_jax.data.bins import make_records
from flat_tokens_jax.data.dataset import FlatTokens
from flat_tokens_jax.data.records import Records, check_source, recorded_info
from flat_tokens_jax.sampling.schedule import MAX_SAMPLE
from flat_tokens_jax.store.identity import DatasetInfo, check_tokenizers

MAX_DEFAULT_PERIOD = 1 << 20
# A period's tables take 8 bytes a sample (and a few times more while it is
# made): 2**24 samples stay well under a gigabyte.
MAX_PERIOD = 1 << 24


@dataclasses.dataclass(frozen=True)
class Period:
    """Which component each sample of a period of ``period`` samples reads (fixed weights).

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
    def of_counts(cls, counts: Sequence[int] | np.ndarray) -> Period:
        """The layout of ``counts[c]`` samples of each component ``c`` over a
        period of ``sum(counts)`` samples."""
        counts = np.array(counts, np.int64)
        component = np.repeat(np.arange(counts.size, dtype=np.int32), counts)
        rank = np.concatenate([np.arange(n, dtype=np.int32) for n in counts])
        when = (2.0 * rank + 1.0) / (2.0 * counts[component])
        order = np.lexsort((component, when))
        return cls(counts, component[order], rank[order])


def period_counts(weights: Sequence[float] | np.ndarray, period: int) -> np.ndarray:
    """``[K] int64`` samples of each component per period of ``period``
    samples: ``weights`` times ``period``, rounded by largest remainder."""
    w = np.asarray(weights, np.float64)
    # Rounded so that weights meant as exact ratios split as their decimal
    # values do, whatever the float error: 0.5 and 0.1 over 3 slots are a
    # tie (2.5 and 0.5), not 2.5 and 0.49999999999999994.
    share = np.round(_shares(w) * period, 9)
    counts = np.floor(share).astype(np.int64)
    short = period - int(counts.sum())
    if short:  # largest remainder; ties to the lower index
        order = np.lexsort((np.arange(w.size), -np.round(share - counts, 9)))
        counts[order[:short]] += 1
    return counts


def prefix_counts(counts: Sequence[int] | np.ndarray, rest: int) -> np.ndarray:
    """``[K] int64`` samples of each component among the first ``rest``
    offsets of the period laid out from ``counts`` (``Period.of_counts``),
    found without its tables.

    Component ``c``'s ``k``-th sample sits at ``(2k + 1) / (2 n_c)`` of the
    period, ties to the lower component, so the first ``rest`` offsets are a
    prefix of that order. The samples at or before ``rest / period`` are such
    a prefix, within ``K / 2`` of ``rest`` long (each component's count is
    within 1/2 of its share): the last ones are taken off, or the next ones
    added, one at a time. O(K^2) exact integer arithmetic.
    """
    n = [int(x) for x in counts]
    period = sum(n)
    if rest >= period:
        return np.array(n, np.int64)
    rest = max(rest, 0)
    # Component c's samples at positions <= rest / period: (2k + 1) / (2 n_c) <= rest / period.
    m = [min(c, (2 * rest * c + period) // (2 * period)) for c in n]
    total = sum(m)
    while total > rest:  # drop the last taken: the latest position, ties the higher component
        last = -1
        for c in range(len(n)):
            if m[c] and (last < 0 or (2 * m[c] - 1) * n[last] >= (2 * m[last] - 1) * n[c]):
                last = c
        m[last] -= 1
        total -= 1
    while total < rest:  # take the next: the earliest position, ties the lower component
        first = -1
        for c in range(len(n)):
            if m[c] < n[c] and (first < 0 or (2 * m[c] + 1) * n[first] < (2 * m[first] + 1) * n[c]):
                first = c
        m[first] += 1
        total += 1
    return np.array(m, np.int64)


def consumed(counts: Sequence[int] | np.ndarray, num_samples: int) -> list[int]:
    """Samples of each component in the first ``num_samples`` of a run of
    periods laid out from ``counts``, as Python ints."""
    n = np.asarray(counts, np.int64)
    whole, rest = divmod(int(num_samples), int(n.sum()))
    prefix = prefix_counts(n, rest)
    return [whole * int(a) + int(b) for a, b in zip(n.tolist(), prefix.tolist(), strict=True)]


Source = Records | FlatTokens
# What a Mixture takes: {name: (source, weight)}, [(name, source, weight)] or [(source, weight)].
Components = Mapping[str, tuple[Source, float]] | Sequence[tuple[Any, ...]]


class Mixture:
    """Blends record sources by weight; each component keeps its own epochs
    (the guide: ``docs/guide/mixtures.md``). The ``LoaderConfig`` decides what a
    record is; a Mixture says only which data, named how, in what proportions.

    Examples:
        >>> import flat_tokens_jax as ftj
        >>> ftj.write_dataset("memory://doc/web", {"train": [[1, 2, 3]] * 8}, overwrite=True)
        >>> ftj.write_dataset("memory://doc/code", {"train": [[7, 8]] * 8}, overwrite=True)
        >>> web = ftj.open_dataset("memory://doc/web")["train"]
        >>> code = ftj.open_dataset("memory://doc/code")["train"]
        >>> mix = ftj.Mixture({"web": (web, 3), "code": (code, 1)}, period=4)
        >>> [mix.names[c] for c in mix.periods[0].component]
        ['web', 'web', 'code', 'web']

    Args:
        components: ``{name: (source, weight)}``, ``[(name, source, weight), ...]``
            or ``[(source, weight), ...]`` (named ``"0"``, ``"1"``, ...). A source
            is a ``FlatTokens`` split or view, or records of the config's
            ``seq_len`` and packing. Weights count records; 0 leaves a component unused.
        seed: an int in ``[0, 2**64)``, mixed with the loader's seed into each
            component's shuffle key.
        period: samples per period, an int in ``[1, 2**24]``; ``None``:
            ``max(1000, 100 / smallest positive weight share)``, at most ``2**20``.
        schedule: ``[(step, weights), ...]``: from ``step`` on (steps strictly
            increasing and > 0), ``weights``, one per component or ``{name: weight}``.
        allow_mixed_tokenizers: mix datasets whose recorded tokenizers differ.

    Raises:
        ValueError: a bad value, all-zero weights, a positive weight that rounds
            to no sample per period, duplicate names, or mixed tokenizers.
        TypeError: a component that is not a split or records, with the fix.
    """

    def __init__(
        self,
        components: Components,
        seed: int = 0,
        *,
        period: int | None = None,
        schedule: Sequence[tuple[int, Sequence[float] | Mapping[str, float]]] = (),
        allow_mixed_tokenizers: bool = False,
    ) -> None:
        named = _named_components(components)
        self.names: tuple[str, ...] = tuple(n for n, _, _ in named)
        self.sources: tuple[Source, ...] = tuple(s for _, s, _ in named)
        _check_records_agree(self.sources, self.names)
        self.seed: int = fields.seed(seed, "Mixture.seed")
        period = integer(period, "Mixture.period", low=1, high=MAX_PERIOD, optional=True)
        changes = [
            sequence(change, f"Mixture.schedule[{i}]", "a pair (step, weights)")
            for i, change in enumerate(sequence(schedule, "Mixture.schedule"))
        ]
        for i, change in enumerate(changes):
            if len(change) != 2:
                raise BadValue(f"Mixture.schedule[{i}]", f"must be (step, weights), got {change!r}")
        steps = [0] + [
            integer(s, f"Mixture.schedule[{i}] step", low=1, high=MAX_SAMPLE)
            for i, (s, _) in enumerate(changes)
        ]
        if any(b <= a for a, b in itertools.pairwise(steps)):
            raise ValueError(f"schedule steps must be > 0 and strictly increasing, got {steps[1:]}")
        self.period: int | None = period
        weights = [[w for _, _, w in named], *[w for _, w in changes]]
        self.steps = np.array(steps, np.int64)
        checked = [self.weight_counts(w, s) for s, w in zip(steps, weights, strict=True)]
        self.weights = [w for w, _ in checked]
        self.periods = [Period.of_counts(counts) for _, counts in checked]
        self.allow_mixed_tokenizers = boolean(
            allow_mixed_tokenizers, "Mixture.allow_mixed_tokenizers"
        )
        check_tokenizers(
            [(repr(n), self.info(i)) for i, n in enumerate(self.names)],
            allow_mixed=self.allow_mixed_tokenizers,
            fix="pass Mixture(..., allow_mixed_tokenizers=True)",
        )

    def info(self, component: int) -> DatasetInfo | None:
        """What made component ``component``'s dataset, ``None`` if it records nothing."""
        src = self.sources[component]
        return src.info if isinstance(src, FlatTokens) else recorded_info(src)

    def weight_counts(
        self, weights: Sequence[float] | Mapping[str, float], step: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """``weights`` from ``step`` on, checked: ``([K] float64 weights, [K]
        int64 samples of each component per period)``; a positive weight with
        no sample per period is refused, naming the period it needs."""
        w = _check_weights(self._by_name(weights, step), self.names, step)
        period = self.period
        if period is None:  # 100 samples of the smallest share, at least 1000
            shares = _shares(w)
            smallest = float(shares[shares > 0].min())
            fits = smallest * MAX_DEFAULT_PERIOD > 100
            period = max(1000, math.ceil(100 / smallest)) if fits else MAX_DEFAULT_PERIOD
        counts = period_counts(w, period)
        lost = [i for i, x in enumerate(w) if x > 0 and counts[i] == 0]
        if lost:
            smallest = float(_shares(w)[lost].min())  # 0 where it underflows
            need = 1 / smallest if smallest > 0 else math.inf
            fix = (
                f"pass a period of at least {math.ceil(need)}"
                if need <= MAX_PERIOD
                else f"raise their weights (a period holds at most {MAX_PERIOD} samples)"
            )
            raise ValueError(
                f"weights from step {step}: component(s) {[self.names[i] for i in lost]} get "
                f"no sample in a period of {period}: {fix}, or set their weights to 0"
            )
        return w, counts

    def _by_name(self, weights: Sequence[float] | Mapping[str, float], step: int) -> list[Any]:
        if not isinstance(weights, Mapping):
            return list(sequence(weights, f"weights from step {step}", "a list of numbers"))
        unknown = sorted(set(weights) - set(self.names))
        missing = [n for n in self.names if n not in weights]
        if unknown or missing:
            raise ValueError(
                f"weights from step {step} must name every component {list(self.names)}: "
                f"unknown {unknown}, missing {missing}"
            )
        return [weights[n] for n in self.names]

    def __repr__(self) -> str:
        parts = ", ".join(
            f"{n!r}: ({s!r}, {w:g})"
            for n, s, w in zip(self.names, self.sources, self.weights[0], strict=True)
        )
        return f"Mixture({{{parts}}}, seed={self.seed}, period={self.periods[0].period})"

    def component_seed(self, seed: int, component: int) -> int:
        """The shuffle key of ``component`` under a config's ``seed`` (and this mixture's)."""
        text = f"{seed}/{self.seed}/{component}".encode()
        return int.from_bytes(hashlib.sha256(text).digest()[:8], "little")

    def records(
        self,
        seq_len: int,
        packing: Packing | bool | str,
        plan_cache: str | os.PathLike[str] | None = None,
        max_segments: int | None = None,
    ) -> tuple[Records, ...]:
        """Each component's records for a config of ``seq_len`` and ``packing``
        (:func:`config_records`), their reads (bounds, packing plans) at once."""
        packing = fields.packing(packing, "packing")
        calls = [
            functools.partial(
                config_records, s, seq_len, packing, plan_cache, max_segments, f"component {n!r}"
            )
            for n, s in zip(self.names, self.sources, strict=True)
        ]
        return tuple(at_once(calls))

    def fingerprint(self, records: Sequence[Records]) -> dict[str, Any]:
        """The components' names and data (their ``records``) and the blending."""
        found = at_once([r.fingerprint for r in records])  # their reads at once
        return {
            "components": [{"name": n, **f} for n, f in zip(self.names, found, strict=True)],
            "weights": [list(map(float, w)) for w in self.weights],
            "steps": self.steps.tolist(),
            "periods": [p.period for p in self.periods],
            "seed": self.seed,
        }


def route_segments(
    samples: np.ndarray,
    starts: np.ndarray,
    offsets: np.ndarray,
    period_of: Callable[[int], Period],
) -> tuple[np.ndarray, np.ndarray]:
    """Global samples to ``(component [k] int64, component sample [k] int64)``
    over weight segments: ``starts`` ``[S] int64`` each one's first global
    sample, ``offsets`` ``[S, K] int64`` the samples of each component drawn
    before it, ``period_of(j)`` segment ``j``'s layout."""
    g = np.asarray(samples, np.int64)
    segment = np.searchsorted(starts, g, side="right") - 1
    comp = np.empty(g.shape, np.int64)
    sample = np.empty(g.shape, np.int64)
    for j in np.unique(segment).tolist():
        here = segment == j
        p = period_of(j)
        whole, rest = np.divmod(g[here] - starts[j], p.period)
        c = p.component[rest].astype(np.int64)
        comp[here] = c
        sample[here] = offsets[j, c] + whole * p.counts[c] + p.rank[rest]
    return comp, sample


def config_records(
    source: FlatTokens | Records,
    seq_len: int,
    packing: Packing,
    plan_cache: str | os.PathLike[str] | None,
    max_segments: int | None,
    who: str,
    fix: str = "pass the FlatTokens split and let the LoaderConfig make its records",
) -> Records:
    """The records of ``source`` for ``seq_len`` and ``packing``: a split's are
    made; ready-made records must be of them (else refused naming ``who``)."""
    if isinstance(source, FlatTokens):
        return make_records(source, seq_len, packing, plan_cache, max_segments)
    if source.seq_len != seq_len or source.packing is not packing:
        raise ValueError(
            f"{who} is {source!r} with seq_len {source.seq_len} and packing "
            f"{source.packing.value}, but seq_len {seq_len} and packing {packing.value} "
            f"were asked for: {fix}"
        )
    return source


def _named_components(components: Components) -> list[tuple[str, Source, float]]:
    if isinstance(components, Mixture):
        raise TypeError(_NESTED)
    if isinstance(components, Mapping):
        entries = []
        for name, value in components.items():
            if not isinstance(value, tuple | list) or len(value) != 2:
                raise TypeError(
                    f"component {name!r}: expected (source, weight), got {type(value).__name__}"
                )
            entries.append((name, *value))
    elif isinstance(components, Sequence) and not isinstance(components, str):
        entries = [_entry(c, i) for i, c in enumerate(components)]
    else:
        raise TypeError(
            "Mixture components must be {name: (source, weight)}, [(name, source, weight)] "
            f"or [(source, weight)], got {type(components).__name__}"
        )
    if not entries:
        raise ValueError("a Mixture needs at least one component")
    names = [name for name, _, _ in entries]
    for name in names:
        if not isinstance(name, str) or not name:
            raise ValueError(f"component names must be non-empty strings, got {name!r}")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"component names must be unique, {twice} appear more than once")
    for name, source, _ in entries:
        if isinstance(source, Mixture):
            raise TypeError(f"component {name!r}: {_NESTED}")
        check_source(source, f"component {name!r}")
    return entries


def _entry(component: Any, index: int) -> tuple[Any, Any, Any]:
    if not isinstance(component, tuple | list) or len(component) not in (2, 3):
        raise TypeError(
            f"component {index}: expected (source, weight) or (name, source, weight), "
            f"got {component!r}"
        )
    if len(component) == 2:
        return (str(index), *component)
    return tuple(component)


_NESTED = (
    "a Mixture cannot hold a Mixture: list the inner Mixture's components in the outer "
    "one, each with its weight times the inner Mixture's share"
)


def _check_records_agree(sources: Sequence[Source], names: Sequence[str]) -> None:
    """Refuses components of records whose ``seq_len`` or packing differ."""
    records = {n: s for n, s in zip(names, sources, strict=True) if not isinstance(s, FlatTokens)}
    seq_lens = {n: r.seq_len for n, r in records.items()}
    packings = {n: r.packing.value for n, r in records.items()}  # as a config writes it
    for what, found in (("seq_len", seq_lens), ("packing", packings)):
        if len(set(found.values())) > 1:
            listed = ", ".join(f"{n!r}: {v!r}" for n, v in found.items())
            raise ValueError(f"the components' records disagree on {what}: {listed}")


def _check_weights(weights: Sequence[Any], names: Sequence[str], step: int) -> np.ndarray:
    where = "weights" if step == 0 else f"weights from step {step}"
    if len(weights) != len(names):
        raise ValueError(
            f"{where}: expected {len(names)} weights, one per component, got {len(weights)}"
        )
    w = np.array(
        [
            number(
                x, f"Mixture weight of {n!r}" + ("" if step == 0 else f" from step {step}"), low=0
            )
            for n, x in zip(names, weights, strict=True)
        ],
        np.float64,
    )
    if not (w > 0).any():
        raise ValueError(f"{where} are all zero: at least one component needs weight > 0")
    return w


def _shares(weights: np.ndarray) -> np.ndarray:
    """``weights`` as fractions of their sum, for any finite weights (1e308 and
    1e-320 too): scaled by the largest first, so the sum cannot overflow."""
    scaled = weights / weights.max()
    return scaled / scaled.sum()
