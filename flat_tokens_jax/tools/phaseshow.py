"""A run in phases rebuilt for ``flat-tokens show`` and ``preview``, from a
``phases`` YAML or a saved phased state (each phase rebuilt as
:func:`~flat_tokens_jax.tools.show.build_loader` rebuilds a single run's)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flat_tokens_jax.core.values import child, close_match, mapping
from flat_tokens_jax.loader.config import LoaderConfig
from flat_tokens_jax.loader.phaseconfig import phases_from_config
from flat_tokens_jax.loader.phasedloader import PhasedLoader
from flat_tokens_jax.loader.phases import Phase
from flat_tokens_jax.loader.state import SavedState
from flat_tokens_jax.sampling.mixconfig import mixture_from_config
from flat_tokens_jax.store.options import StoreError, StoreOptions
from flat_tokens_jax.tools.show import build_loader


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
    """The phased run of a ``phases`` YAML document or a saved phased state."""
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


def run_from_yaml(
    doc: Any, name: str, split: str = "train", options: StoreOptions | None = None
) -> PhasedLoader:
    """The run of a YAML document from the file ``name``: its ``phases``, or its
    ``data`` and ``loader`` as one phase (a ValueError names the file and path)."""
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
        raise ValueError(f"{name} {found}: preview reads {wanted}")
    sections = ("phases", "data", "loader")
    half = [k for k in ("data", "loader") if k in doc]
    if half:
        other = "loader" if half[0] == "data" else "data"
        found = f"; it has {half[0]!r} but no {other!r}"
    else:
        named = ", ".join(f"{k!r}{close_match(k, sections)}" for k in doc)
        found = f"; found {named}" if named else ""
    raise ValueError(f"{name} has no run to preview: preview reads {wanted}{found}")
