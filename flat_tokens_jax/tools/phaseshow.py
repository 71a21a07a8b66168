"""A run in phases rebuilt for ``flat-tokens show``, and the step's phase in its output.

A YAML with a ``phases`` section (see :mod:`~flat_tokens_jax.loader.phaseconfig`)
or a saved :meth:`PhasedLoader.state` (one with ``phases``) gives a
:class:`~flat_tokens_jax.PhasedLoader`; each saved phase is rebuilt as
:func:`~flat_tokens_jax.tools.show.build_loader` rebuilds a single run's, and must
match its saved fingerprint.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

from flat_tokens_jax.convert.commands import above_zero, at_least, between
from flat_tokens_jax.core.values import child, close_match, mapping
from flat_tokens_jax.loader.config import LoaderConfig
from flat_tokens_jax.loader.loader import Loader
from flat_tokens_jax.loader.phaseconfig import phases_from_config
from flat_tokens_jax.loader.phasedloader import PhasedLoader
from flat_tokens_jax.loader.phases import Phase
from flat_tokens_jax.loader.state import SavedState
from flat_tokens_jax.loader.steered import apply_skips
from flat_tokens_jax.sampling.mixconfig import mixture_from_config
from flat_tokens_jax.store.options import StoreError, StoreOptions
from flat_tokens_jax.tools.requesttable import MAX_SAMPLE_STEPS, run_table
from flat_tokens_jax.tools.show import build_loader


def is_phased(config: Any, state: SavedState | None) -> bool:
    """Whether the run given as ``--config`` or ``--state`` is one in phases."""
    return (isinstance(config, Mapping) and "phases" in config) or bool(state and state.phased)


def build_run(
    *,
    config: Mapping[str, Any] | None,
    state: SavedState | None,
    split: str = "train",
    options: StoreOptions | None = None,
    fields: Mapping[str, Any] | None = None,
    config_name: str = "--config",
    state_name: str = "--state",
) -> PhasedLoader:
    """The phased run of a ``phases`` YAML document or a saved phased state.

    Raises:
        ValueError: the run is given twice, LoaderConfig flags are given (a
            phased run says them per phase), a value is bad, or a phase's data
            is not what the saved run read; the message names the file
            (``config_name`` or ``state_name``) and the phase.
    """
    if config is not None and state is not None:
        raise ValueError("give the run as --config or as --state, not both")
    given = sorted(k for k, v in (fields or {}).items() if v is not None)
    if given:
        raise ValueError(
            f"a run in phases says its LoaderConfig fields per phase: drop the flags for {given}"
        )
    if config is not None:
        try:
            return PhasedLoader(phases_from_config(config["phases"], split, options))
        except ValueError as e:
            raise ValueError(f"{config_name}: {e}") from None
        except StoreError as e:
            raise StoreError(f"{config_name}: {e}") from None
    if state is None or not state.phased:
        raise ValueError(f"{state_name}: not the state of a run in phases")
    phases = []
    for j, saved in enumerate(state.phases):
        start = saved.start_step
        try:
            loader = build_loader(
                state=state.phase(j), options=options, state_name=child("phases", j)
            )
        except ValueError as e:
            raise ValueError(f"{state_name}: phase {j} (from step {start}): {e}") from None
        except IndexError as e:  # the sequences it read are not there now
            raise ValueError(
                f"{state_name}: phase {j} (from step {start}): its data is not what the saved "
                f"run read: {e}"
            ) from None
        source = loader.mixture if loader.mixture is not None else loader.components[0]
        phases.append(Phase(start, source, loader.config))
    try:
        run = PhasedLoader(phases)
    except ValueError as e:
        raise ValueError(f"{state_name}: {e}") from None
    run.restore(state)  # its step, skips and weight changes
    return run


def plan_run(
    doc: Any, name: str, split: str = "train", options: StoreOptions | None = None
) -> PhasedLoader:
    """The run a YAML document (read from the file ``name``) describes, for
    ``flat-tokens plan``: its ``phases``, or its ``data`` and ``loader`` as one phase.

    Raises:
        ValueError: the document says neither; a bad value, named by ``name``,
            the phase and its path.
    """
    if isinstance(doc, Mapping) and "phases" in doc:
        return build_run(config=doc, state=None, split=split, options=options, config_name=name)
    if isinstance(doc, Mapping) and "data" in doc and "loader" in doc:
        try:
            config = LoaderConfig.from_dict(mapping(doc["loader"], "loader"), "loader")
            mixture = mixture_from_config(doc["data"], split, options)
            return PhasedLoader([Phase(0, mixture, config)])
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
        except StoreError as e:
            raise StoreError(f"{name}: {e}") from None
    wanted = "a 'phases' section, or 'data' and 'loader' sections (a run of one phase)"
    if not isinstance(doc, Mapping):
        found = "is empty" if doc is None else f"holds a {type(doc).__name__}, not a mapping"
        raise ValueError(f"{name} {found}: plan reads {wanted}")
    sections = ("phases", "data", "loader")
    half = [k for k in ("data", "loader") if k in doc]
    if half:
        other = "loader" if half[0] == "data" else "data"
        found = f"; it has {half[0]!r} but no {other!r}"
    else:
        named = ", ".join(f"{k!r}{close_match(k, sections)}" for k in doc)
        found = f"; found {named}" if named else ""
    raise ValueError(f"{name} has no run to plan: plan reads {wanted}{found}")


def mark(shown: dict[str, Any], run: PhasedLoader, step: int) -> dict[str, Any]:
    """``show``'s JSON of a run's step (its rows' ``sample`` run-wide and
    ``phase`` already) with the step's ``phase``: ``index``, ``name``,
    ``start_step`` and ``step`` inside it."""
    k = run.phase_at(step)
    phase = {
        "index": k,
        "name": run.phases[k].name,
        "start_step": run.starts[k],
        "step": step - run.firsts[k],
    }
    return {**shown, "step": step, "phase": phase}


REQUEST_FLAGS = ("hosts", "step_seconds", "sample_steps")
"""``plan``'s flags that only ``--requests`` reads."""

SAMPLE_STEPS = 8
"""``--sample-steps`` when not given."""


def add_request_flags(parser: argparse.ArgumentParser) -> None:
    """``plan``'s flags of :func:`request_lines`."""
    parser.add_argument(
        "--requests",
        action="store_true",
        help="print the requests/s and bytes/s the run asks of its store on --hosts hosts at "
        "--step-seconds a step, and how long a fresh GCS bucket would throttle them",
    )
    parser.add_argument("--hosts", type=at_least(1), help="hosts of the pod (with --requests)")
    parser.add_argument("--step-seconds", type=above_zero, help="seconds a step (with --requests)")
    parser.add_argument(
        "--sample-steps",
        type=between(1, MAX_SAMPLE_STEPS),
        help="steps of each phase the sampler is run for, at most "
        f"{MAX_SAMPLE_STEPS:,} and no more than the phase has (with --requests; default "
        f"{SAMPLE_STEPS})",
    )


def request_lines(
    run: PhasedLoader, args: argparse.Namespace, end_step: int | None = None
) -> list[str]:
    """``plan --requests``: each phase's requests and bytes per second
    (:func:`run_table`), sampled at most to ``end_step``, where the run ends."""
    missing = [f for f in ("hosts", "step_seconds") if getattr(args, f) is None]
    if missing:
        flags = " and ".join("--" + f.replace("_", "-") for f in missing)
        raise ValueError(f"plan --requests: give {flags} (the pod's hosts and its step time)")
    steps = SAMPLE_STEPS if args.sample_steps is None else args.sample_steps
    return run_table(run, args.hosts, args.step_seconds, steps, args.run_yaml, end_step)


def yaml_skips(run: Loader, section: Any, name: str) -> None:
    """Applies the ``skip`` list of the YAML ``name`` to ``run``, its errors
    naming the file and the entry (see :func:`~flat_tokens_jax.loader.steered.apply_skips`)."""
    try:
        apply_skips(run, section)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None
