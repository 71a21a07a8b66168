"""A run in phases rebuilt for ``flat-tokens show``, and the step's phase in its output.

A YAML with a ``phases`` section (see :mod:`~flat_tokens_jax.loader.phaseconfig`)
or a saved :meth:`PhasedLoader.state` (one with ``phases``) gives a
:class:`~flat_tokens_jax.PhasedLoader`; each saved phase is rebuilt as
:func:`~flat_tokens_jax.tools.show.build_loader` rebuilds a single run's, and must
match its saved fingerprint.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

from flat_tokens_jax.loader.phaseconfig import phases_from_config
from flat_tokens_jax.loader.phasedloader import PhasedLoader
from flat_tokens_jax.loader.phases import Phase
from flat_tokens_jax.sampling.schedule import BatchSchedule
from flat_tokens_jax.store.options import StoreOptions
from flat_tokens_jax.tools.show import build_loader


def is_phased(config: Any, state: Any) -> bool:
    """Whether the run given as ``--config`` or ``--state`` is one in phases."""
    return any(isinstance(doc, Mapping) and "phases" in doc for doc in (config, state))


def build_run(
    *,
    config: Mapping[str, Any] | None,
    state: Mapping[str, Any] | None,
    split: str = "train",
    options: StoreOptions | None = None,
    fields: Mapping[str, Any] | None = None,
    state_name: str = "--state",
) -> PhasedLoader:
    """The phased run of a ``phases`` YAML document or a saved phased state.

    Raises:
        ValueError: the run is given twice, LoaderConfig flags are given (a
            phased run says them per phase), or a phase's data is not what the
            saved run read (the message names the phase).
    """
    if config is not None and state is not None:
        raise ValueError("give the run as --config or as --state, not both")
    given = sorted(k for k, v in (fields or {}).items() if v is not None)
    if given:
        raise ValueError(
            f"a run in phases says its LoaderConfig fields per phase: drop the flags for {given}"
        )
    if config is not None:
        return PhasedLoader(phases_from_config(config["phases"], split, options))
    if state is None or not isinstance(state.get("phases"), list):
        raise ValueError(f"{state_name}: not the state of a run in phases")
    saved, step = state["phases"], state.get("step", 0)
    phases = []
    for j, entry in enumerate(saved):
        if not isinstance(entry, Mapping):
            raise ValueError(f"{state_name}: phases[{j}] is not a mapping")
        start = entry.get("start_step", 0)
        end = saved[j + 1].get("start_step", step) if j + 1 < len(saved) else step
        local = max(0, min(end, step) - start) if isinstance(start, int) else 0
        fingerprint = entry.get("fingerprint")
        sub = {"step": local, "fingerprint": fingerprint, "sources": entry.get("sources")}
        if isinstance(fingerprint, Mapping):
            with contextlib.suppress(KeyError, ValueError):  # build_loader names them
                sub["samples"] = BatchSchedule.of(fingerprint["batch_size"]).samples_before(local)
        try:
            loader = build_loader(state=sub, options=options, state_name=state_name)
        except ValueError as e:
            raise ValueError(f"phases[{j}] (from step {start}): {e}") from None
        except IndexError as e:  # the sequences it read are not there now
            raise ValueError(
                f"phases[{j}] (from step {start}): its data is not what the saved run read: {e}"
            ) from None
        source = loader.mixture if loader.mixture is not None else loader.components[0]
        phases.append(Phase(start, source, loader.config))
    run = PhasedLoader(phases)
    run.restore(state)
    return run


def mark(shown: dict[str, Any], run: PhasedLoader, step: int) -> dict[str, Any]:
    """``show``'s JSON of a phase's step, told as the run's: ``step``, ``phase``
    (``index``, ``name``, ``start_step``, ``step`` inside it) and each row's
    run-wide ``sample`` and ``phase``."""
    k = run.phase_at(step)
    before = run.samples_before(run.starts[k])
    for row in shown["rows"]:
        row["phase"] = k
        if "sample" in row:
            row["sample"] += before
    phase = {
        "index": k,
        "name": run.phases[k].name,
        "start_step": run.starts[k],
        "step": step - run.starts[k],
    }
    return {**shown, "step": step, "phase": phase}
