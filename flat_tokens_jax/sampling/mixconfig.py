"""A :class:`~flat_tokens_jax.Mixture` from a Nanoset-style mapping (a YAML ``data``
section), a bad value named by its path (``data.datasets.web.weight``)."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from flat_tokens_jax.core import fields
from flat_tokens_jax.core.concurrently import at_once
from flat_tokens_jax.core.values import (
    BadValue,
    boolean,
    child,
    integer,
    known_keys,
    mapping,
    number,
    sequence,
    text,
)
from flat_tokens_jax.data.dataset import Dataset, open_dataset
from flat_tokens_jax.sampling.mixture import MAX_PERIOD, Mixture, Source
from flat_tokens_jax.store.options import StoreOptions

_CONFIG_KEYS = {
    "datasets",
    "split",
    "seed",
    "period",
    "schedule",
    "allow_mixed_tokenizers",
}
_SPLIT_PARTS = ("train", "valid", "test")
_USAGE = (
    "{url: weight}, {name: {url: ..., weight: ...}} or a list of {name: ..., url: ..., weight: ...}"
)


def mixture_from_config(
    config: Mapping[str, Any],
    split: str = "train",
    options: StoreOptions | None = None,
    *,
    path: str = "data",
    **option_fields: Any,
) -> Mixture:
    """Builds a mixture from a Nanoset-style mapping ``config`` (e.g. a YAML ``data``
    section; its keys: docs/guide/mixtures.md and ``configs/mixture.yaml``): everything
    :class:`Mixture` takes, ``seq_len`` and ``packing`` left to the loader config.
    ``split``: which split (or part of a ``split`` cut) the components read;
    ``options``: how to reach the datasets, or its fields as keywords; ``path``: the
    mapping's name in errors (``data.seed must be ...``).
    """
    config = mapping(config, path, "a mapping with 'datasets'")
    known_keys(config, path, _CONFIG_KEYS)
    cut = config.get("split")
    if cut is not None:
        where = child(path, "split")
        if isinstance(cut, list | tuple):
            cut = [number(x, child(where, i), low=0) for i, x in enumerate(cut)]
        elif not isinstance(cut, str):
            raise BadValue(where, f"must be text such as '949,50,1' or a list, got {cut!r}")
        if split not in _SPLIT_PARTS:
            hint = (
                " (a split cut names its parts train, valid, test)" if split == "validation" else ""
            )
            raise ValueError(
                f"with 'split: {cut}' the parts are {list(_SPLIT_PARTS)}; got {split!r}{hint}: "
                f"use {'valid' if split == 'validation' else 'one of them'}"
            )
    entries = _dataset_entries(config.get("datasets"), child(path, "datasets"))
    schedule = _schedule(config.get("schedule"), child(path, "schedule"))
    seed = fields.seed(config.get("seed", 0), child(path, "seed"))
    period = integer(
        config.get("period"), child(path, "period"), low=1, high=MAX_PERIOD, optional=True
    )
    allow_mixed = boolean(
        config.get("allow_mixed_tokenizers", False), child(path, "allow_mixed_tokenizers")
    )
    urls = list(dict.fromkeys(url for _, _, url, _, _ in entries))
    opens = [functools.partial(open_dataset, url, options, **option_fields) for url in urls]
    opened: dict[str, Dataset] = dict(zip(urls, at_once(opens), strict=True))

    def part(
        where: str, name: str, url: str, weight: float, dataset_split: str | None
    ) -> tuple[str, Source, float]:
        ds = opened[url]
        try:
            found = ds[dataset_split or (split if cut is None else "train")]
        except KeyError as e:
            named = child(where, "split") if dataset_split else where
            raise BadValue(named, f"reads a split its dataset lacks: {e.args[0]}") from None
        if cut is None:
            return name, found, weight
        views = dict(zip(_SPLIT_PARTS, found.split(cut), strict=False))
        if split not in views:
            raise BadValue(child(path, "split"), f"{cut!r} has {len(views)} parts, so no {split!r}")
        return name, views[split], weight

    try:
        # Datasets open, and views read their bounds, at once: N components cost
        # the round trips of one.
        parts = at_once([functools.partial(part, *entry) for entry in entries])
        return Mixture(
            parts,
            seed=seed,
            period=period,
            schedule=schedule,
            allow_mixed_tokenizers=allow_mixed,
        )
    except BadValue:
        raise
    except ValueError as e:  # weights the blend cannot use, records that disagree
        raise BadValue(path, f"does not make a mixture: {e}") from None


def _schedule(changes: Any, path: str) -> list[tuple[int, Any]]:
    """``(step, weights)`` of each entry of a ``schedule`` list, checked."""
    out: list[tuple[int, Any]] = []
    for i, change in enumerate(sequence(changes or (), path, "a list of {step: N, weights: ...}")):
        where = child(path, i)
        mapping(change, where, "{step: N, weights: ...}")
        known_keys(change, where, ("step", "weights"))
        if set(change) != {"step", "weights"}:
            raise BadValue(where, f"must be {{step: N, weights: ...}}, got {change!r}")
        weights = change["weights"]
        if isinstance(weights, Mapping):
            checked: Any = {
                k: number(w, child(child(where, "weights"), k), low=0) for k, w in weights.items()
            }
        else:
            listed = sequence(
                weights, child(where, "weights"), "a list of numbers or {name: weight}"
            )
            checked = [
                number(w, child(child(where, "weights"), j), low=0) for j, w in enumerate(listed)
            ]
        step = integer(change["step"], child(where, "step"), low=1, high=2**63 - 1)  # int64
        out.append((step, checked))
    return out


def _dataset_entries(datasets: Any, path: str) -> list[tuple[str, str, str, float, str | None]]:
    """``(path, name, url, weight, split or None)`` of a config's ``datasets``."""
    # (where, the entry as written, its name when the key gives it, where its weight is)
    items: list[tuple[str, Any, str | None, str]] = []
    if isinstance(datasets, Mapping):
        for key, value in datasets.items():
            where = child(path, key)
            if isinstance(value, Mapping):
                items.append((where, value, key, child(where, "weight")))
            else:  # {url: weight}
                items.append((where, {"url": key, "weight": value}, key, where))
    elif isinstance(datasets, list | tuple):
        items = [
            (child(path, i), item, None, child(child(path, i), "weight"))
            for i, item in enumerate(datasets)
        ]
    else:
        raise BadValue(path, f"must be {_USAGE}, got {datasets!r}")
    if not items:
        raise BadValue(path, f"must name at least one dataset: {_USAGE}")
    out = []
    for where, item, key_name, weight_path in items:
        mapping(item, where, f"{{url: ..., weight: ...}} ({_USAGE})")
        known_keys(item, where, ("name", "url", "weight", "split"))
        missing = [k for k in ("url", "weight") if k not in item]
        if missing:
            raise BadValue(where, f"must say {' and '.join(missing)} ({_USAGE}), got {item!r}")
        if "name" in item:
            name = text(item["name"], child(where, "name"))
        else:
            name = text(item["url"] if key_name is None else key_name, where)
        url = text(item["url"], child(where, "url"))
        weight = number(item["weight"], weight_path, low=0)
        dataset_split = item.get("split")
        if dataset_split is not None:
            dataset_split = text(dataset_split, child(where, "split"))
        out.append((where, name, url, weight, dataset_split))
    return out
