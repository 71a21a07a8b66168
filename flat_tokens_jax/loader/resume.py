"""A saved fingerprint compared field by field with a loader's: each field the
same, of the same JSON type, none missing or added; the batch size may change
from the saved step on.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from flat_tokens_jax.core.fields import BLOCKS
from flat_tokens_jax.loader.statefields import json_type, shown
from flat_tokens_jax.sampling.blocks import lanes
from flat_tokens_jax.sampling.schedule import BatchSchedule, resume_differences, resumed

# The digests of the data's recorded contents: a saved one that differs now
# (or is gone) means other data, said as such.
CONTENTS = ("fingerprint.data.content", "fingerprint.data.components[].content")


def differences(
    fp: Mapping[str, Any],
    fingerprint: Mapping[str, Any],
    schedule: BatchSchedule,
    *,
    step: int,
    samples: int,
    data_step: int,
) -> list[str]:
    """``path: saved X, now Y`` lines, one per field of the saved fingerprint
    ``fp`` (of one phase, saved at ``step``) that keeps it from resuming with
    this ``fingerprint`` and ``schedule`` (none: it resumes)."""
    out: list[str] = []
    # A fingerprint holds instance_filter, balance_groups and context_parallel
    # only when on (LoaderConfig.batch_defining): absent on either side, off.
    off = {"instance_filter": None, "balance_groups": 1, "context_parallel": 1}
    was = {k: v for k, v in fp.items() if k != "batch_size"}
    was["config"] = {**off, **fp["config"]}
    now = {k: v for k, v in fingerprint.items() if k != "batch_size"}
    now["config"] = {**off, **fingerprint["config"]}
    kind = _kind_difference(was["data"], now["data"])
    if kind:
        out.append(kind)
        del was["data"], now["data"]
    _compare(was, now, "fingerprint", out)
    blocks = fp["config"].get("shuffle") == BLOCKS
    try:
        was_lanes = lanes(BatchSchedule.of(fp["batch_size"]).entries) if blocks else None
    except ValueError:  # no valid saved batch size: resume_differences says so
        was_lanes = None
    found = resume_differences(fp["batch_size"], schedule, step, samples, data_step, was_lanes)
    for line in found:
        out.append("fingerprint." + line if line.startswith("batch_size") else line)
    if not found and was_lanes is not None:
        now_lanes = lanes(schedule.entries)
        kept = resumed(BatchSchedule.of(fp["batch_size"]), data_step, schedule, was_lanes)
        if was_lanes != now_lanes:
            out.append(
                f"fingerprint.batch_size: with shuffle='blocks' the lanes (the gcd of the "
                f"batch sizes) order every sample: saved {was_lanes}, now {now_lanes}; "
                f"keep the gcd of the batch sizes at {was_lanes}: batch_size {kept}"
            )
    return out


def _kind_difference(saved: Any, now: Any) -> str | None:
    """A line when one side is a Mixture and the other a single source."""
    if not isinstance(saved, Mapping) or not isinstance(now, Mapping):
        return None
    kinds = [
        "mixture" if "components" in d else "split" if "records" in d else None
        for d in (saved, now)
    ]
    if None in kinds or kinds[0] == kinds[1]:
        return None  # the same kind, or fields missing that the comparison names
    return f"fingerprint.data: saved {_describe(saved)}, now {_describe(now)}"


def _describe(data: Mapping[str, Any]) -> str:
    parts = data.get("components")
    if parts is None:
        return f"a single split ({data.get('records', 'custom')} records)"
    if not isinstance(parts, list):
        return f"a Mixture of components {shown(parts)}"
    names = [p.get("name") if isinstance(p, Mapping) else None for p in parts]
    return f"a Mixture of components {names}"


def _compare(saved: Any, now: Any, path: str, out: list[str]) -> None:
    if isinstance(now, Mapping):
        if not isinstance(saved, Mapping):
            out.append(f"{path}: saved {shown(saved)}, now {shown(now)}")
            return
        for key in now:
            here = f"{path}.{key}"
            if key in saved:
                _compare(saved[key], now[key], here, out)
            else:
                out.append(f"{here}: missing from the saved state, now {shown(now[key])}")
        for key in saved:
            if key not in now:
                here = f"{path}.{key}"
                out.append(f"{here}: saved {shown(saved[key])}, which this loader does not have")
        return
    if isinstance(now, list | tuple):
        if not isinstance(saved, list | tuple):
            out.append(f"{path}: saved {shown(saved)}, now {shown(now)}")
        elif len(saved) != len(now):
            out.append(
                f"{path}: saved {len(saved)} entries {shown(saved)}, now {len(now)} {shown(now)}"
            )
        else:
            for i, (a, b) in enumerate(zip(saved, now, strict=True)):
                _compare(a, b, f"{path}[{i}]", out)
        return
    if isinstance(saved, str) and saved != now and re.sub(r"\[\d+\]", "[]", path) in CONTENTS:
        out.append(_other_data(path, saved, now))
    elif json_type(saved) != json_type(now):
        out.append(f"{path}: saved {shown(saved)}, now {shown(now)}")
    elif saved != now:
        out.append(f"{path}: saved {shown(saved, typed=False)}, now {shown(now, typed=False)}")


def _other_data(path: str, saved: str, now: Any) -> str:
    found = (
        "none is recorded (an array's attribute chunk_crc32c is gone)"
        if now is None
        else shown(now, typed=False)
    )
    return (
        f"{path}: the data is not what the saved run read: the digest of its recorded "
        f"contents was {shown(saved, typed=False)}, now {found}; point the loader at the "
        "data the run read, or start without the saved state"
    )
