"""Packing plans stored in a dataset (group ``<split>/bins_<seq_len>``): written
by ``flat-tokens pack`` (:func:`pack_dataset`), listed and checked for ``validate``.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorstore as ts

from flat_tokens_jax.core import fields
from flat_tokens_jax.core.format import FormatError, Problem
from flat_tokens_jax.core.limits import check_seq_len
from flat_tokens_jax.data.dataset import Dataset, FlatTokens, open_dataset
from flat_tokens_jax.data.plans import (
    PLAN_ARRAYS,
    PLAN_ATTRIBUTE,
    PackingPlan,
    check_plan_source,
    make_plan,
    plan_data_problems,
    plan_group,
    read_stored_plan,
    split_starts,
)
from flat_tokens_jax.store.claim import Claim, describe_marker
from flat_tokens_jax.store.options import StoreOptions, resolve_options
from flat_tokens_jax.store.storageformat import StorageFormat, create_array
from flat_tokens_jax.store.store import V2_ATTRS, V2_GROUP, V3_META, Store

log = logging.getLogger(__name__)

_PLAN_DTYPE = np.dtype("<i8")


def pack_dataset(
    url: str | os.PathLike[str],
    seq_len: int,
    *,
    splits: Sequence[str] | None = None,
    options: StoreOptions | None = None,
    **option_fields: Any,
) -> dict[str, PackingPlan]:
    """Builds and stores the packing plan of each split (default: all) for
    ``seq_len``, replacing one stored before: arrays ``bin_starts`` and
    ``seq_order`` (``int64``) and the attribute ``flat_tokens_packing_plan``.
    ``options``: how to reach the store, or its fields as keywords.

    Raises:
        FileExistsError: another write to the dataset (a pack, a conversion)
            is in progress: packs of one dataset run one at a time.
    """
    seq_len = fields.seq_len(seq_len, "seq_len")
    check_seq_len(seq_len, "pack_dataset")
    ds = open_dataset(url, resolve_options(options, option_fields, "pack_dataset"))
    names = list(ds.splits if splits is None else splits)
    claim = _claim(ds)
    out = {}
    try:
        for name in names:
            out[name] = write_plan(ds.store, ds[name], seq_len, ds.zarr_format)
            log.info("%s: packed %s into %d bins", ds.url, name, out[name].num_bins)
    except BaseException:
        with contextlib.suppress(FileExistsError):  # lost to another writer: theirs now
            claim.release()
        raise
    claim.release()
    return out


def _claim(ds: Dataset) -> Claim:
    """The dataset's write marker, ours while a pack writes its plans: two packs
    at once would delete and write the same plan's files under each other."""
    claim = Claim(ds.store, ds.splits)
    if not claim.create():
        try:
            claim.take_over()  # the marker of a write that died is ours to replace
        except FileExistsError:
            raise FileExistsError(
                f"{ds.url}: another write to it is in progress ({describe_marker(ds.store)}): "
                "run pack again when it has finished; packs of one dataset run one at a time"
            ) from None
    return claim


def write_plan(store: Store, ft: FlatTokens, seq_len: int, zarr_format: int) -> PackingPlan:
    """Builds and stores the plan of the split ``ft`` under ``<split>/bins_<seq_len>``."""
    plan = make_plan(ft, seq_len)
    group = plan_group(ft.split_name, seq_len)
    # The metadata is deleted first and written last: a plan half deleted or
    # half written never opens.
    for key in (V3_META, V2_GROUP, V2_ATTRS):
        store.delete(f"{group}/{key}")
    store.delete_prefix(group)
    storage_format = StorageFormat(zarr_format=zarr_format)
    for name, values in zip(PLAN_ARRAYS, (plan.bin_starts, plan.seq_order), strict=True):
        array = create_array(store, group, name, _PLAN_DTYPE, storage_format, size=values.size)
        if values.size:
            store.wait(array[: values.size].write(values.astype(_PLAN_DTYPE)))
    store.write_group(group, zarr_format, {PLAN_ATTRIBUTE: plan.attributes()})
    return plan


def stored_seq_lens(ft: FlatTokens) -> list[int]:
    """The ``seq_len`` of every plan stored for the split of ``ft``, ascending."""
    prefix = f"{ft.split_name}/bins_"
    keys = ft.store.wait(ft.store.kv.list(ts.KvStore.KeyRange(prefix, prefix[:-1] + "`")))
    found = set()
    for key in (k.decode() for k in keys):
        name, _, rest = key[len(prefix) :].partition("/")
        if name.isdigit() and rest in (V3_META, V2_GROUP):
            found.add(int(name))
    return sorted(found)


def check_stored_plans(ft: FlatTokens) -> list[Problem]:
    """Every problem of the plans stored for ``ft``'s split."""
    problems: list[Problem] = []
    starts = split_starts(ft)
    for seq_len in stored_seq_lens(ft):
        where = f"{ft.url}/{plan_group(ft.split_name, seq_len)}"
        fix = f"rebuild it: flat-tokens pack {ft.url} --seq-len {seq_len}"
        try:
            plan = read_stored_plan(ft, seq_len)
            if plan is None:  # removed while we looked
                continue
            check_plan_source(plan, ft, seq_len, where, fix)
        except FormatError as e:
            problems += e.problems
            continue
        problems += plan_data_problems(plan, ft, starts, where, fix)
        stored = ft.store.group_attributes(plan_group(ft.split_name, seq_len))
        digest = None if stored is None else stored[1][PLAN_ATTRIBUTE].get("digest")
        if digest != plan.digest:
            problems.append(
                Problem(where, f"arrays digest {plan.digest}, attribute says {digest}: {fix}")
            )
    return problems


def plans_summary(ft: FlatTokens) -> dict[str, Any]:
    """``{seq_len: attributes}`` of the plans stored for ``ft``'s split (JSON-ready)."""
    out = {}
    for seq_len in stored_seq_lens(ft):
        found = ft.store.group_attributes(plan_group(ft.split_name, seq_len))
        if found is not None:
            out[str(seq_len)] = found[1].get(PLAN_ATTRIBUTE)
    return out
