"""A run's phases from a YAML ``phases`` section: :func:`phases_from_config`.

Each phase is a mapping of ``start_step``, an optional ``name``, ``data`` (a
mixture section) and ``loader`` (``LoaderConfig`` fields). A later phase says
what changes: its ``loader`` fields replace the previous phase's of those
names, its ``data`` the previous one whole (an example: ``configs/phases.yaml``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from flat_tokens_jax.core import fields
from flat_tokens_jax.core.values import BadValue, child, known_keys, mapping, sequence, text
from flat_tokens_jax.core.yamlfile import read_yaml
from flat_tokens_jax.loader.config import LoaderConfig
from flat_tokens_jax.loader.phases import Phase
from flat_tokens_jax.sampling.mixconfig import mixture_from_config
from flat_tokens_jax.sampling.mixture import Mixture
from flat_tokens_jax.store.options import StoreError, StoreOptions

_KEYS = ("name", "start_step", "data", "loader")


def phases_from_config(
    phases: Any,
    split: str = "train",
    options: StoreOptions | None = None,
    *,
    path: str = "phases",
) -> list[Phase]:
    """The :class:`~flat_tokens_jax.loader.phases.Phase` list of a ``phases``
    section, every ``data`` read from ``split``. An error names the phase
    (``phase 1 'anneal' (from step 900)``) and the value's path
    (``phases[1].loader.seq_len``)."""
    listed = sequence(phases, path, "a list of {start_step, name, data, loader}")
    if not listed:
        raise BadValue(path, "must list at least one phase")
    out: list[Phase] = []
    given: dict[str, Any] = {}
    data: Mapping[str, Any] = {}  # the first phase states it
    opened: dict[str, Mixture] = {}
    for k, entry in enumerate(listed):
        where, label = child(path, k), f"phase {k}"
        try:
            entry = mapping(entry, where, "a mapping of start_step, name, data, loader")
            name = None if entry.get("name") is None else text(entry["name"], child(where, "name"))
            label += "" if name is None else f" {name!r}"
            if "start_step" in entry:
                start = fields.step(entry["start_step"], child(where, "start_step"))
                label += f" (from step {start})"
            known_keys(entry, where, _KEYS)
            if "start_step" not in entry:
                raise BadValue(where, "must say start_step (the first phase's is 0)")
            for key in ("data", "loader"):
                if k == 0 and key not in entry:
                    raise BadValue(where, f"must say {key!r}: the first phase states the whole run")
            given.update(mapping(entry.get("loader", {}), child(where, "loader")))
            if "data" in entry:
                data = mapping(entry["data"], child(where, "data"), "a mixture section")
            key = json.dumps(data, sort_keys=True, default=str)
            if key not in opened:
                opened[key] = mixture_from_config(data, split, options, path=child(where, "data"))
            config = LoaderConfig.from_dict(given, child(where, "loader"))
        except ValueError as e:
            raise ValueError(f"{label}: {e}") from None
        except StoreError as e:
            raise StoreError(f"{label}: {e}") from None
        out.append(Phase(start, opened[key], config, name))
    return out


def phases_from_yaml(
    path: str | os.PathLike[str], split: str = "train", options: StoreOptions | None = None
) -> list[Phase]:
    """The phases of a run YAML's ``phases`` section (needs the ``yaml`` extra)."""
    doc = read_yaml(path)
    if not isinstance(doc, Mapping) or "phases" not in doc:
        raise ValueError(f"{os.fspath(path)} has no 'phases' section")
    try:
        return phases_from_config(doc["phases"], split, options)
    except ValueError as e:
        raise ValueError(f"{os.fspath(path)}: {e}") from None
