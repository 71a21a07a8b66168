"""A run its trainer steers: weight changes and skipped batches checked, merged on
restore (:func:`merged`) and read from a YAML ``skip`` list (the arithmetic:
:mod:`~flat_tokens_jax.sampling.steering`; what users see: docs/guide/steering.md)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from flat_tokens_jax.core import fields
from flat_tokens_jax.core.values import BadValue, child, known_keys, mapping, sequence
from flat_tokens_jax.core.yamlfile import read_yaml
from flat_tokens_jax.loader.state import SavedState, StateMismatch
from flat_tokens_jax.loader.statefields import SKIP_COUNT
from flat_tokens_jax.sampling.mixture import Mixture
from flat_tokens_jax.sampling.skips import Skips
from flat_tokens_jax.sampling.steering import Change


def check_step(step: Any, next_step: int, call: str) -> int:
    """``step`` if a change may start there: an int at or after ``next_step``."""
    step = fields.step(step, f"{call}: step")
    if step < next_step:
        raise ValueError(
            f"{call}: step {step} is before the loader's next step {next_step} (the step its "
            f"state() saves): the steps before it were handed out; pass a step >= {next_step}"
        )
    return step


def skip_count(count: Any, where: str, skips: Skips, step: int, last: int) -> int:
    """``count``, the batches a skip at ``step`` passes over, checked: an int
    >= 1 that leaves every step with a skip reading a data step at most
    ``last`` (the last whose sample indices fit in ``2**63 - 1``); ``BadValue``
    names ``where``, the count and the largest one that fits."""
    count = SKIP_COUNT(count, where)
    at = max(step, skips.latest)
    reads = skips.data_step(at)
    if count > last - reads:
        fix = f"pass a count of at most {last - reads}" if last > reads else "no count fits"
        raise BadValue(
            where,
            f"{count} would make step {at} read data step {reads + count}, past data step "
            f"{last}, the last whose samples have indices within 2**63 - 1: {fix}",
        )
    out: int = count
    return out


def restated(restored: dict[int, int], step: Any, count: Any, next_step: int, call: str) -> bool:
    """Whether ``skip(step, count)`` restates a skip that the last restore
    continued with and that no call restated yet: then it changes nothing, and
    leaves ``restored``. So the set-up code a trainer runs again after a restart
    is harmless before the restore or after it. Another count is refused."""
    if not restored:
        return False
    step = fields.step(step, f"{call}: step")
    if step not in restored:
        return False
    count = SKIP_COUNT(count, f"{call}: count")
    held = restored[step]
    if count != held:
        after = "; a skip there after it adds to it" if step >= next_step else ""
        raise ValueError(
            f"{call}: the restored run skips {held} batches at step {step}, this call {count}: "
            f"after a restore, the first skip at such a step restates it: pass count {held} "
            f"(no change){after}"
        )
    del restored[step]
    return True


def weight_counts(mixture: Mixture | None, weights: Any, step: int, call: str) -> tuple[int, ...]:
    """``weights`` from ``step`` on as the samples of each component per
    period they round to, checked by the mixture (a single source has none)."""
    if mixture is None:
        raise ValueError(
            f"{call}: this loader reads a single source, which has no weights: "
            "set_weights changes the weights of a Mixture's components"
        )
    _, counts = mixture.weight_counts(weights, step)
    return tuple(int(n) for n in counts)


def merged(
    saved: SavedState, skips: Skips, changes: Sequence[Change]
) -> tuple[Skips, tuple[Change, ...]]:
    """The changes a restore of ``saved`` continues with: the saved ones
    (what the run did) and this loader's (``skips``, ``changes``). Before the
    saved step they must agree; from it on they join, a step in both with one
    value (else ``StateMismatch``, naming both values)."""
    out: list[str] = []
    joined_skips = _joined("skips", dict(saved.skips), dict(skips.entries), saved.step, out)
    joined = _joined("weights", dict(saved.weights), dict(changes), saved.step, out)
    if out:
        raise StateMismatch.of("the saved state's changes and this loader's disagree", out)
    return Skips(tuple(sorted(joined_skips.items()))), tuple(sorted(joined.items()))


def _joined(
    name: str, saved: dict[int, Any], now: dict[int, Any], step: int, out: list[str]
) -> dict[int, Any]:
    """``saved`` and ``now``'s entries from ``step`` on; a line in ``out``
    for each entry of ``now`` that disagrees."""
    joined = dict(saved)
    what = "count" if name == "skips" else "samples per period"
    for t, value in sorted(now.items()):
        if t in saved and saved[t] != value:
            out.append(
                f"{name} at step {t}: the saved state has {what} {_listed(saved[t])}, this "
                f"loader {_listed(value)}: give one value (the saved state holds what the run did)"
            )
        elif t not in saved and t < step:
            out.append(
                f"{name} at step {t}: this loader has {what} {_listed(value)}, but the run "
                f"saved at step {step} had none there: drop it, or restore a state saved "
                f"before step {t}"
            )
        else:
            joined[t] = value
    return joined


def _listed(value: Any) -> str:
    return str(list(value)) if isinstance(value, tuple) else str(value)


def skips_from_config(value: Any, path: str = "skip") -> list[tuple[int, int]]:
    """The ``(step, count)`` pairs of a YAML ``skip`` list of ``{step, count}``
    mappings (from trainer ``step`` on, skip ``count`` batches), by step; a bad
    entry is named by its path (``skip[1].count``). Apply them with :func:`apply_skips`.
    """
    return [(step, count) for step, count, _ in _skip_entries(value, path)]


def _skip_entries(value: Any, path: str) -> list[tuple[int, int, str]]:
    pairs: dict[int, tuple[int, str]] = {}
    for i, entry in enumerate(sequence(value, path, "a list of {step, count}")):
        where = child(path, i)
        entry = mapping(entry, where, "a mapping {step, count}")
        known_keys(entry, where, ("step", "count"))
        for key in ("step", "count"):
            if key not in entry:
                raise BadValue(where, f"must say {key!r}: skip: [{{step: 5, count: 3}}]")
        step = fields.step(entry["step"], child(where, "step"))
        count = SKIP_COUNT(entry["count"], child(where, "count"))
        if step in pairs:
            raise BadValue(
                child(where, "step"), f"repeats step {step} of {pairs[step][1]}: list a step once"
            )
        pairs[step] = (count, where)
    return [(step, count, where) for step, (count, where) in sorted(pairs.items())]


def apply_skips(run: Any, value: Any, path: str = "skip") -> None:
    """Applies a YAML ``skip`` list (see :func:`skips_from_config`) to ``run``
    (a ``Loader``) by its ``skip``, by step: before or after a restore (see
    :meth:`~flat_tokens_jax.Loader.skip`, which restates a restored skip).

    Raises:
        ValueError: as :func:`skips_from_config`, or an entry ``run.skip``
            refuses, named by its path (``skip[0].count``).
    """
    told = f"{type(run).__name__}.skip: count"
    for step, count, where in _skip_entries(value, path):
        try:
            run.skip(step, count)
        except ValueError as e:
            if isinstance(e, BadValue) and e.path == told:
                raise BadValue(child(where, "count"), e.problem) from None
            raise ValueError(f"{where}: {e}") from None


def skips_from_yaml(path: str | os.PathLike[str]) -> list[tuple[int, int]]:
    """The top-level ``skip`` list of a run YAML (none without one): see
    :func:`skips_from_config` (needs the ``yaml`` extra)."""
    doc = read_yaml(path)
    if not isinstance(doc, Mapping) or "skip" not in doc:
        return []
    try:
        return skips_from_config(doc["skip"])
    except ValueError as e:
        raise ValueError(f"{os.fspath(path)}: {e}") from None
