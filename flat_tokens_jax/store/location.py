"""Claiming a location for a new dataset: what may be replaced, and by whom
(docs/format.md, "Claiming the output"). ``overwrite`` replaces only what is
ours (a flat-tokens dataset, or our own interrupted write's leftover, with the
plans ``pack`` stored); anything else is refused before anything is deleted.
"""

from __future__ import annotations

import logging
import os
import posixpath
import re
import urllib.parse
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from flat_tokens_jax.core.format import LOSS_MASK, SEQ_STARTS, SPLITS, TOKENS, FormatError
from flat_tokens_jax.core.urls import parse_url, redact
from flat_tokens_jax.store.claim import (
    GROUP_META,
    MARKER,
    STAGING,
    Claim,
    delete_ours,
    describe_marker,
    read_marker,
)
from flat_tokens_jax.store.identity import ATTRIBUTE, dataset_splits
from flat_tokens_jax.store.identity import MARKER as DATASET_MARKER
from flat_tokens_jax.store.store import V3_META, Store

log = logging.getLogger(__name__)

_ARRAYS = (TOKENS, SEQ_STARTS, LOSS_MASK)
# A split's stored packing plans, <split>/bins_<seq_len>, and their arrays
# (plans.plan_group and plans.PLAN_ARRAYS; plans sits above this module).
_PLAN_GROUP = re.compile(r"bins_[1-9][0-9]*")
_PLAN_ARRAYS = ("bin_starts", "seq_order")
_NAMED = 5  # foreign keys or folders named in a refusal


class OverwriteNeeded(FileExistsError):
    """The location holds a dataset or the leftover of a write, which only
    ``overwrite`` may replace.

    ``str(error)`` tells Python callers to pass ``overwrite=True``;
    :meth:`cli_message` tells command-line users to pass ``--overwrite``.
    """

    def __init__(self, url: str, what: str, when: str = "") -> None:
        self.url, self.what, self.when = url, what, when
        super().__init__(self._message("overwrite=True"))

    def __reduce__(self) -> tuple[type[OverwriteNeeded], tuple[str, str, str]]:
        return OverwriteNeeded, (self.url, self.what, self.when)  # picklable, for Beam

    def _message(self, flag: str) -> str:
        return f"{self.url} {self.what}; {self.when}pass {flag} to replace it"

    def cli_message(self) -> str:
        """The message for command-line users."""
        return self._message("--overwrite")


def claim_location(store: Store, overwrite: bool, splits: Sequence[str] = SPLITS) -> Claim:
    """Makes ``store`` ours and empty for a new dataset (of ``splits`` besides
    :data:`SPLITS`), or refuses: a dataset or a dead write's leftover is deleted
    with ``overwrite`` (else ``OverwriteNeeded``); anything else, or a write in
    progress, raises ``FileExistsError`` before anything is deleted. Call the
    claim's ``release()`` after the root metadata is written, ``discard()`` on failure.
    """
    claim = Claim(store, splits)
    keys = store.keys()
    _check(store, keys, claim.splits, overwrite)
    if MARKER in keys:  # with overwrite: replaced only if its write is dead
        claim.take_over()
    elif not claim.create():
        raise FileExistsError(
            f"another write to {store.url} started just now ({describe_marker(store)}); "
            "wait for it to finish, or choose another location"
        )
    try:
        # Listed again now that no other writer can start: a writer that
        # finished between the first listing and our marker left its dataset.
        listed = store.keys()
        keys = [k for k in listed if k != MARKER]
        known = _check(store, keys, claim.splits, overwrite)
        if keys:
            delete_ours(store, known)
    except BaseException:
        claim._end()
        claim._drop_marker()
        raise
    return claim


def _check(store: Store, keys: Sequence[str], splits: tuple[str, ...], overwrite: bool) -> set[str]:
    """Refuses unless every key is ours and, without ``overwrite``, there is
    none; the split groups that may be deleted."""
    if not keys:
        return set(splits)
    marker = read_marker(store) if MARKER in keys else None
    marked = marker.get("splits") if marker else None
    known = {*splits, *(s for s in marked or () if isinstance(s, str))}
    group, says_dataset, recorded = _root(store)
    if says_dataset:
        pairs = [k.split("/") for k in keys if k.count("/") == 1]
        known |= {folder for folder, name in pairs if name in GROUP_META} | set(recorded)
    foreign = sorted(k for k in keys if not _is_ours(k, known))
    if not group:
        foreign.insert(0, V3_META)
    if foreign:
        # A folder that is not ours at all is named once, as "folder/".
        names = list(dict.fromkeys(_foreign_name(k, known) for k in foreign))
        named = ", ".join(names[:_NAMED]) + (", ..." if len(names) > _NAMED else "")
        count = f"{len(foreign)} file{'' if len(foreign) == 1 else 's'} in all"
        raise FileExistsError(
            f"{store.url} holds files that are not part of a flat-tokens dataset "
            f"({named}: {count}); refusing to delete them: choose an empty location, "
            "or move them away"
        )
    if overwrite:
        return known
    if MARKER in keys:
        raise OverwriteNeeded(
            store.url,
            "holds the leftover of an interrupted write, or another write to it is in "
            f"progress ({describe_marker(store)})",
            "if that write is dead, ",
        )
    if any(k in keys for k in GROUP_META):
        raise OverwriteNeeded(store.url, "already holds a flat-tokens dataset")
    raise OverwriteNeeded(store.url, "holds the leftover of an interrupted write")


def _foreign_name(key: str, splits: Iterable[str]) -> str:
    top = key.split("/")[0]
    return key if top == key or top in (*splits, STAGING) else top + "/"


def _is_ours(key: str, splits: Iterable[str]) -> bool:
    parts = key.split("/")
    if len(parts) == 1:
        return key in (MARKER, *GROUP_META)
    if parts[0] == STAGING:
        return True
    if parts[0] not in splits:
        return False
    if len(parts) >= 3 and _PLAN_GROUP.fullmatch(parts[1]):  # what `pack` stores
        return parts[2] in GROUP_META if len(parts) == 3 else parts[2] in _PLAN_ARRAYS
    return parts[1] in GROUP_META if len(parts) == 2 else parts[1] in _ARRAYS


def _root(store: Store) -> tuple[bool, bool, tuple[str, ...]]:
    """``(root is a group or absent, its attributes say it is a flat-tokens
    dataset, the splits they name)``."""
    try:
        found = store.group_attributes("")
    except FormatError:
        return False, False, ()  # an array, or metadata that is not ours to read
    if found is None:
        return True, False, ()
    mark = found[1].get(ATTRIBUTE)
    if not (isinstance(mark, Mapping) and mark.get("dataset") == DATASET_MARKER):
        return True, False, ()
    try:
        return True, True, dataset_splits(found[1])
    except FormatError:
        return True, True, SPLITS  # a damaged attribute: its splits' group metadata still says


def _where(url: str | os.PathLike[str]) -> tuple[str, ...]:
    """A location as comparable path parts: ``("file", *real path parts)`` on
    local disk, ``(scheme, bucket, *path parts)`` elsewhere."""
    try:
        loc = parse_url(url)
    except ValueError:  # an input pattern of a scheme only Beam reads
        parsed = urllib.parse.urlparse(os.fspath(url))
        scheme, bucket, path = parsed.scheme, parsed.netloc, parsed.path
    else:
        if loc.scheme == "file":
            return ("file", *Path(os.path.realpath(loc.path)).parts)
        scheme, bucket, path = loc.scheme, loc.bucket, loc.path
    return (scheme, bucket, *[p for p in posixpath.normpath("/" + path).split("/") if p])


def refuse_overlap(
    inputs: Iterable[str | os.PathLike[str]], outputs: Iterable[str | os.PathLike[str]]
) -> None:
    """Raises ``ValueError`` for an output that is, contains or lies inside an
    input (local paths compared after resolving links, URLs by scheme, bucket
    and normalised path), before anything is written or deleted."""
    ins = [(i, _where(i)) for i in inputs]
    for output in outputs:
        out = _where(output)
        for given, src in ins:
            n = min(len(src), len(out))
            if src[:n] != out[:n]:
                continue
            how = "is" if len(src) == len(out) else "lies inside" if n == len(src) else "contains"
            raise ValueError(
                f"the output {redact(output)} {how} the input {redact(given)}: "
                "writing it would destroy or mix with what is being read; choose "
                "an output outside every input"
            )
