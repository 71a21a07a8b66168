"""Packing plans of a split (which sequences share each bin; the algorithm is
:mod:`~flat_tokens_jax.data.binpack`'s): stored in the dataset (``flat-tokens pack``,
:func:`pack_dataset`; whole splits only), else in the local cache, else built (about
1 s per million sequences) and cached; refused, naming what differs, when made for
another ``seq_len`` or from other data.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import os
import tempfile
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import tensorstore as ts

from flat_tokens_jax.core import fields
from flat_tokens_jax.core.format import FormatError, Problem, listed_problems
from flat_tokens_jax.core.limits import check_seq_len, special_kind
from flat_tokens_jax.data.binpack import ALGORITHM, build_plan, plan_digest
from flat_tokens_jax.data.dataset import Dataset, FlatTokens, open_dataset
from flat_tokens_jax.store.claim import Claim, describe_marker
from flat_tokens_jax.store.options import StoreOptions, resolve_options
from flat_tokens_jax.store.storageformat import StorageFormat, create_array
from flat_tokens_jax.store.store import V2_ATTRS, V2_GROUP, V3_META, Store

log = logging.getLogger(__name__)

PLAN_ATTRIBUTE = "flat_tokens_packing_plan"
PLAN_ARRAYS = ("bin_starts", "seq_order")
_PROBES = 64


def plan_group(split: str, seq_len: int) -> str:
    """The group of a stored plan: ``<split>/bins_<seq_len>``."""
    return f"{split}/bins_{seq_len}"


@dataclasses.dataclass(frozen=True, eq=False)
class PackingPlan:
    """Which sequences of a split share each bin.

    Attributes:
        algorithm: how the plan was made (:data:`~flat_tokens_jax.data.binpack.ALGORITHM`).
        bin_starts: ``[num_bins + 1] int64`` offsets into ``seq_order``.
        seq_order: ``[num_sequences] int64``: bin ``b`` holds sequences
            ``seq_order[bin_starts[b]:bin_starts[b + 1]]``, ascending.
        source: what it was made from (:func:`plan_source`, plus
            ``starts_digest`` over all ``seq_starts`` entries and ``split``).
        tokens: tokens the bins hold, when known (plans built here).
    """

    seq_len: int
    algorithm: str
    bin_starts: np.ndarray
    seq_order: np.ndarray
    source: dict[str, Any]
    tokens: int | None = None

    @property
    def num_bins(self) -> int:
        return int(self.bin_starts.size - 1)

    @functools.cached_property
    def digest(self) -> str:
        """16 hex digits of SHA-256 over both arrays."""
        return plan_digest(self.bin_starts, self.seq_order)

    def attributes(self) -> dict[str, Any]:
        """What a stored plan records beside its arrays (JSON-ready)."""
        tokens = {} if self.tokens is None else {"tokens": self.tokens}
        return {
            "algorithm": self.algorithm,
            "seq_len": self.seq_len,
            "num_bins": self.num_bins,
            "digest": self.digest,
            "source": dict(self.source),
            **tokens,
        }

    def check_shape(self, where: str) -> None:
        """Refuses arrays that are no plan of ``source["num_sequences"]`` sequences."""
        n = int(self.source.get("num_sequences", -1))
        s, o = self.bin_starts, self.seq_order
        problem = None
        if s.ndim != 1 or s.size < 1 or o.ndim != 1 or o.size != n:
            problem = f"{s.size} bin starts and {o.size} sequences, expected {n} sequences"
        elif s[0] != 0 or s[-1] != n or np.any(np.diff(s) < 0):
            problem = f"bin_starts must rise from 0 to {n}"
        elif n and np.any(np.diff(s) == 0):
            problem = f"bin {int(np.argmin(np.diff(s)))} is empty (no plan we build has one)"
        elif n and (o.min() < 0 or o.max() >= n or np.any(np.bincount(o, minlength=n) != 1)):
            problem = "seq_order is not a permutation of the sequences"
        if problem:
            raise FormatError(Problem(where, f"not a packing plan: {problem}"))


def split_starts(ft: FlatTokens) -> np.ndarray:
    """``[num_sequences + 1] int64`` sequence bounds of ``ft``, from 0 (one read)."""
    lo, hi = ft.seq_range
    starts = ft.starts.read_ranges(np.array([lo]), np.array([hi + 1]))[0]
    return starts.astype(np.int64) - ft.token_range[0]


def _digest(values: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(values, "<i8").tobytes()).hexdigest()[:16]


def plan_source(ft: FlatTokens) -> dict[str, Any]:
    """What a plan of ``ft`` depends on, cheaply: counts and sampled sequence bounds."""
    n = ft.num_sequences
    probes = np.unique(np.linspace(0, n, _PROBES).astype(np.int64))
    sample = ft.starts.read_points(probes + ft.seq_range[0]).astype(np.int64)
    return {
        "num_tokens": ft.num_tokens,
        "num_sequences": n,
        "starts_sample": _digest(sample - ft.token_range[0]),
    }


def _algorithm(max_segments: int | None) -> str:
    return ALGORITHM if max_segments is None else f"{ALGORITHM}/max-segments-{max_segments}"


def make_plan(ft: FlatTokens, seq_len: int, max_segments: int | None = None) -> PackingPlan:
    """Builds the plan of ``ft`` for ``seq_len`` (reads every sequence bound),
    with at most ``max_segments`` runs per bin if given."""
    log.info("building the packing plan of %r for seq_len %d", ft, seq_len)
    starts = split_starts(ft)
    lengths = np.diff(starts)
    bin_starts, seq_order = build_plan(lengths, seq_len, max_segments)
    source = {**plan_source(ft), "starts_digest": _digest(starts), "split": ft.split_name}
    tokens = int(np.minimum(lengths, min(seq_len, np.iinfo(np.int64).max)).sum())
    algorithm = _algorithm(max_segments)
    return PackingPlan(seq_len, algorithm, bin_starts, seq_order, source, tokens)


def check_plan_source(
    plan: PackingPlan, ft: FlatTokens, seq_len: int, where: str, fix: str
) -> None:
    """Refuses a plan whose recorded ``seq_len``, counts or sampled bounds differ."""
    now = {"seq_len": seq_len, **plan_source(ft)}
    saved = {"seq_len": plan.seq_len, **plan.source}
    diffs = [f"{k}: plan {saved.get(k)!r}, data {v!r}" for k, v in now.items() if saved.get(k) != v]
    if diffs:
        raise FormatError(
            Problem(where, f"packing plan does not match ({'; '.join(diffs)}): {fix}")
        )


def plan_data_problems(
    plan: PackingPlan, ft: FlatTokens, starts: np.ndarray, where: str, fix: str
) -> list[Problem]:
    """Why ``plan`` (of a valid shape) is no plan of ``ft``'s sequences ``starts``
    (:func:`split_starts`): no digest of its sequence bounds, a digest of other
    bounds, or a bin over ``seq_len`` of these tokens."""
    here = _digest(starts)
    recorded = plan.source.get("starts_digest")
    if recorded is None:
        why = "the packing plan records no digest of the sequence bounds it was made from "
        why += f"(source.starts_digest), so it cannot be checked against {ft!r}"
        return [Problem(where, f"{why}: {fix}")]
    split = plan.source.get("split")
    made = f"split {split!r}" if isinstance(split, str) else "other data"
    if recorded != here:
        why = f"the packing plan was made from {made} (sequence bounds digest {recorded})"
        return [Problem(where, f"{why}, not from {ft!r} (digest {here}): {fix}")]
    sizes = np.minimum(np.diff(starts)[plan.seq_order], min(plan.seq_len, np.iinfo(np.int64).max))
    total = np.concatenate(([0], np.cumsum(sizes, dtype=np.int64)))
    per_bin = total[plan.bin_starts[1:]] - total[plan.bin_starts[:-1]]
    over = np.flatnonzero(per_bin > plan.seq_len)
    message = (
        f"the packing plan was made from {made}, not from {ft!r}: its bin holds more "
        f"than seq_len={plan.seq_len} of these tokens: {fix}"
    )
    return listed_problems(where, message, over, per_bin)


def check_plan(plan: PackingPlan, ft: FlatTokens, seq_len: int, where: str, fix: str) -> None:
    """Refuses a plan made for another ``seq_len`` or from other data, naming what
    differs; the cheap checks first, then every bin against ``ft``'s sequences."""
    check_plan_source(plan, ft, seq_len, where, fix)
    plan.check_shape(where)
    problems = plan_data_problems(plan, ft, split_starts(ft), where, fix)
    if problems:
        raise FormatError(problems)


def read_stored_plan(ft: FlatTokens, seq_len: int) -> PackingPlan | None:
    """The plan stored for the split of ``ft`` and ``seq_len``, unchecked; ``None`` if none."""
    group = plan_group(ft.split_name, seq_len)
    found = ft.store.group_attributes(group)
    if found is None:
        return None
    where = f"{ft.url}/{group}"
    attrs = found[1].get(PLAN_ATTRIBUTE)
    if not isinstance(attrs, dict) or not isinstance(attrs.get("source"), dict):
        raise FormatError(Problem(where, f"attribute {PLAN_ATTRIBUTE!r} is missing or malformed"))
    arrays = []
    for name in PLAN_ARRAYS:
        meta = ft.store.array_metadata(f"{group}/{name}")
        if meta is None:
            raise FormatError(Problem(f"{where}/{name}", "array is missing"))
        reader = ft.store.open_array(f"{group}/{name}", *meta)
        values = reader.read_ranges(np.array([0]), np.array([reader.size]))[0]
        arrays.append(np.asarray(values, np.int64))
    plan = PackingPlan(
        seq_len=int(attrs.get("seq_len", -1)),
        algorithm=str(attrs.get("algorithm")),
        bin_starts=arrays[0],
        seq_order=arrays[1],
        source=dict(attrs["source"]),
    )
    plan.check_shape(where)
    return plan


def _stored_where(ft: FlatTokens, seq_len: int) -> tuple[str, str]:
    """Where the stored plan of ``seq_len`` is, and how to rebuild it."""
    where = f"{ft.url}/{plan_group(ft.split_name, seq_len)}"
    return where, f"rebuild it: flat-tokens pack {ft.url} --seq-len {seq_len}"


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/flat_tokens_jax/plans`` (``~/.cache`` when unset)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "flat_tokens_jax" / "plans"


def _cache_key(ft: FlatTokens, seq_len: int, max_segments: int | None) -> dict[str, Any]:
    spec = ft.store.spec
    url = spec["path"] if spec["driver"] == "file" else ft.url
    return {
        "url": url,
        "split": ft.split_name,
        "sequences": list(ft.seq_range),
        "seq_len": seq_len,
        "algorithm": _algorithm(max_segments),
        "source": plan_source(ft),
    }


def cached_plan(
    ft: FlatTokens,
    seq_len: int,
    cache_dir: str | os.PathLike[str],
    max_segments: int | None = None,
) -> PackingPlan:
    """The plan of ``ft`` from ``cache_dir``, or built and saved there.

    An entry is used only when its whole key matches and it holds a plan of
    ``ft``; one that cannot be read is logged and built again in its place.
    """
    key = _cache_key(ft, seq_len, max_segments)
    text = json.dumps(key, sort_keys=True)
    path = Path(cache_dir) / (hashlib.sha256(text.encode()).hexdigest()[:32] + ".npz")
    kind = special_kind(path)
    if kind is not None:  # np.load would wait on a FIFO forever
        log.warning("ignoring the cached packing plan %s: it is a %s, not a file", path, kind)
    elif path.exists():
        try:
            with np.load(path) as f:
                if str(f["key"]) == text:
                    source = json.loads(str(f["source"]))
                    if not isinstance(source, dict):
                        raise ValueError(f"its source is {source!r}, not a mapping")
                    plan = PackingPlan(
                        seq_len, key["algorithm"], f["bin_starts"], f["seq_order"], source
                    )
                    check_plan(plan, ft, seq_len, os.fspath(path), "built again")
                    return plan
        except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as e:
            log.warning("ignoring the unreadable cached packing plan %s: %s", path, e)
    plan = make_plan(ft, seq_len, max_segments)
    tmp_name = None
    try:  # a cache that cannot be written costs a rebuild next time, nothing else
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".tmp", delete=False) as tmp:
            tmp_name = tmp.name
            np.savez(
                tmp,
                key=np.array(text),
                source=np.array(json.dumps(plan.source, sort_keys=True)),
                bin_starts=plan.bin_starts,
                seq_order=plan.seq_order,
            )
        os.replace(tmp_name, path)
    except OSError as e:
        log.warning("could not cache the packing plan at %s: %s", path, e)
        if tmp_name is not None and os.path.exists(tmp_name):
            os.unlink(tmp_name)
    return plan


def find_plan(
    ft: FlatTokens,
    seq_len: int,
    cache_dir: str | os.PathLike[str] | None,
    max_segments: int | None = None,
) -> PackingPlan:
    """The stored plan (whole splits), else the cached one, else a new one.

    ``cache_dir=None`` builds without caching. With ``max_segments`` stored
    plans, which have no cap, are passed over.

    Raises:
        FormatError: the stored plan was made for another ``seq_len`` or from other data.
    """
    if max_segments is None and ft.seq_range == (0, ft.starts.size - 1):
        stored = read_stored_plan(ft, seq_len)
        if stored is not None:
            check_plan(stored, ft, seq_len, *_stored_where(ft, seq_len))
            return stored
    if cache_dir is None:
        return make_plan(ft, seq_len, max_segments)
    if not os.fspath(cache_dir):
        raise ValueError(
            "plan_cache is '' (it would put packing plans in the working directory): "
            "give a folder, or None to build plans without caching them"
        )
    return cached_plan(ft, seq_len, cache_dir, max_segments)


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
        where, fix = _stored_where(ft, seq_len)
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
