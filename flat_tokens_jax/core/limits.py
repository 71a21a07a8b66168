"""Bounds on what a request may cost: files that are not regular, sizes over memory.

Two checks that run before any work starts. A FIFO, device or socket where a
metadata, shard or cached file should be would block a read forever (opening a
FIFO waits for a writer), and a folder would fail deep inside a reader; both are
refused when the file is opened, naming the path. A size from the user (rows of
``seq_len`` tokens, a batch of them) whose arrays could not fit in this
machine's memory is refused before anything is allocated, with the number and
the largest size that fits. Pure code: ``os`` and ``stat`` only.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable

from flat_tokens_jax.core.format import FormatError, Problem

_KINDS = (
    (stat.S_ISDIR, "folder"),
    (stat.S_ISFIFO, "FIFO (named pipe)"),
    (stat.S_ISCHR, "character device"),
    (stat.S_ISBLK, "block device"),
    (stat.S_ISSOCK, "socket"),
)

READ_BYTES_PER_TOKEN = 8
"""Bytes a row's reading holds per token besides its batch's arrays: the
encoded window (4) and the read buffers (4)."""

ROW_BYTES_PER_TOKEN = 17 + READ_BYTES_PER_TOKEN
"""Bytes a row of the five fields holds per token, read and decoded: four
``int32`` fields (16), ``loss_mask`` (1) and its reading."""


def special_kind(path: str | os.PathLike[str]) -> str | None:
    """What ``path`` is when it exists and is not a regular file (``"FIFO (named
    pipe)"``, ``"folder"``, ...); ``None`` for a regular file or no file at all."""
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return None
    for test, kind in _KINDS:
        if test(mode):
            return kind
    return None if stat.S_ISREG(mode) else "special file"


def check_regular_file(path: str | os.PathLike[str], what: str) -> None:
    """Refuses ``path`` when it is a FIFO, device, socket or folder.

    Raises:
        FormatError: naming the path, what it is and what should be there.
    """
    kind = special_kind(path)
    if kind is not None:
        raise FormatError(
            Problem(
                os.fspath(path),
                f"is a {kind}, not a regular file: {what} should be here; "
                "replace it with the file or remove it",
            )
        )


def check_array_files(folder: str | os.PathLike[str]) -> None:
    """Refuses a zarr array folder holding a FIFO, device or socket anywhere
    below it, or a folder named as metadata (``zarr.json``, ``.zarray``,
    ``.zattrs``). One ``scandir`` per folder and a ``stat`` only for what is
    not a plain file or folder (file types come with the listing on Linux);
    linked folders are followed once."""
    seen: set[tuple[int, int]] = set()
    todo = [os.fspath(folder)]
    while todo:
        try:
            entries = list(os.scandir(todo.pop()))
        except (FileNotFoundError, NotADirectoryError):
            continue
        for entry in entries:
            if entry.is_dir():
                if entry.name in ("zarr.json", ".zarray", ".zattrs"):
                    check_regular_file(entry.path, "zarr metadata (JSON)")
                st = entry.stat()
                if (st.st_dev, st.st_ino) not in seen:
                    seen.add((st.st_dev, st.st_ino))
                    todo.append(entry.path)
            elif not entry.is_file():
                check_regular_file(entry.path, "a chunk, shard or metadata file")


def check_chunk_files(folder: str | os.PathLike[str]) -> None:
    """Refuses a folder where a 1-D array keeps a chunk or shard file
    (``<n>`` or ``c/<n>`` under ``folder``): readers fail deep inside on one."""
    for sub in (folder, os.path.join(folder, "c")):
        try:
            entries = list(os.scandir(sub))
        except (FileNotFoundError, NotADirectoryError):
            continue
        for entry in entries:
            if entry.name.isdigit() and entry.is_dir():
                check_regular_file(entry.path, "a chunk or shard file")


_CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def memory_bytes() -> int:
    """The memory this process may use, in bytes: the machine's physical memory
    (``os.sysconf``), or the container's limit (cgroup v2 or v1) where lower;
    0 where unknown."""
    try:
        physical = int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        physical = 0
    for path in _CGROUP_LIMITS:
        try:
            with open(path, encoding="ascii") as f:
                text = f.read(64).strip()
        except OSError:
            continue
        if text.isdigit() and (not physical or 0 < int(text) < physical):
            return int(text)
    return physical


def check_memory(need: int, what: str, fix: str) -> None:
    """Refuses a request whose arrays would need more than this machine's memory.

    Args:
        need: the estimated bytes.
        what: names the request, e.g. ``"--batch-size 100000000 at seq_len 2048"``.
        fix: what to change instead, with the largest value that fits.

    Raises:
        ValueError: ``need`` exceeds this machine's physical memory.
    """
    memory = memory_bytes()
    if memory and need > memory:
        raise ValueError(
            f"{what} needs about {need / 2**30:,.1f} GiB, more than this machine's "
            f"{memory / 2**30:,.1f} GiB of memory: {fix}"
        )


def check_seq_len(seq_len: int, what: str) -> None:
    """Refuses a ``seq_len`` whose single row would not fit in memory (a row of
    :data:`ROW_BYTES_PER_TOKEN` bytes per token)."""
    most = memory_bytes() // ROW_BYTES_PER_TOKEN
    check_memory(
        seq_len * ROW_BYTES_PER_TOKEN,
        f"{what} seq_len={seq_len:,} (one row)",
        f"use a seq_len of at most {most:,} on this machine",
    )


STEP_BYTES = 4096
"""Bytes a step in flight holds besides its rows: futures, index arrays, dicts."""

ROW_BYTES = 64
"""Bytes a row holds besides its tokens: sample, record and position indices."""


def largest(fits: Callable[[int], bool], low: int, high: int) -> int | None:
    """The largest ``v`` in ``[low, high]`` with ``fits(v)``, by bisection
    (``fits`` true up to some value, false after it); ``None`` when
    ``fits(low)`` is false. The value returned was tested."""
    if high < low or not fits(low):
        return None
    while low < high:
        mid = (low + high + 1) // 2
        if fits(mid):
            low = mid
        else:
            high = mid - 1
    return low


def check_loader_memory(
    batch_size: int,
    seq_len: int,
    prefetch: int | None,
    processes: int,
    read_ahead_bytes: int = 0,
    *,
    row_bytes: Callable[[int], int],
    block_cache_bytes: int = 0,
    cache_fixes: Callable[[int], list[str]] | None = None,
) -> None:
    """Refuses a loader whose steps in flight cannot fit in this host's memory.

    Each of ``processes`` hosts holds at least ``batch_size / processes`` rows
    of the largest step, for the step being read and ``prefetch`` steps ahead;
    with ``prefetch=None`` (automatic depth) the steps ahead hold up to
    ``read_ahead_bytes``, and at least one step. A row holds
    ``row_bytes(seq_len)`` (its batch's arrays, every field of the layout),
    its reading (:data:`READ_BYTES_PER_TOKEN` a token) and :data:`ROW_BYTES`;
    the block shuffle's cache holds ``block_cache_bytes`` besides.
    ``cache_fixes`` marks a cache sized by default (``block_cache_bytes``
    left ``None``): given the bytes the cache may take, it says which of
    the fields that size it would bring it within them.

    Raises:
        ValueError: naming the fields and the estimate, and each field whose
            change alone would fit, with the value that does; a field no
            value of which fits is not named.
    """
    memory = memory_bytes()
    hosts = max(processes, 1)
    rows = -(-batch_size // hosts)

    def per_row(seq_len: int) -> int:
        return row_bytes(seq_len) + seq_len * READ_BYTES_PER_TOKEN + ROW_BYTES

    def need(rows: int, seq_len: int, read_ahead: int, cache: int) -> int:
        step = rows * per_row(seq_len) + STEP_BYTES
        ahead = max(read_ahead, step) if prefetch is None else prefetch * step
        return step + ahead + cache

    cache = block_cache_bytes
    total = need(rows, seq_len, read_ahead_bytes, cache)
    if not memory or total <= memory:
        return
    step = rows * per_row(seq_len) + STEP_BYTES
    depth = "read_ahead_bytes" if prefetch is None else "prefetch"

    def fixes_at(read_ahead: int) -> list[str]:
        """Each field whose change alone fits, the read-ahead at ``read_ahead``."""
        fixes = []
        most_rows = largest(lambda r: need(r, seq_len, read_ahead, cache) <= memory, 1, rows)
        if most_rows is not None:
            most = most_rows * hosts
            fixes.append(f"lower batch_size (at most {most:,} at this seq_len and {depth})")
        if prefetch is not None and prefetch > 0 and step + cache <= memory:
            most = (memory - cache) // step - 1
            fixes.append(
                f"lower prefetch (at most {most:,} at this batch_size and seq_len)"
                if most
                else "set prefetch 0"
            )
        room = memory - need(rows, seq_len, read_ahead, 0)  # what the block cache may take
        if cache and room > 0:
            if cache_fixes is None:
                fixes.append(f"lower block_cache_bytes (at most {room:,})")
            else:
                fixes += [*cache_fixes(room), f"set block_cache_bytes (at most {room:,})"]
        if most_rows is None:
            longest = largest(lambda n: need(rows, n, read_ahead, cache) <= memory, 1, seq_len)
            if longest is not None:
                fixes.append(f"lower seq_len (at most {longest:,} at this batch_size)")
        return fixes

    fixes = fixes_at(read_ahead_bytes)
    if prefetch is None and 2 * step + cache <= memory:
        fixes.insert(0, f"lower read_ahead_bytes (at most {memory - step - cache:,})")
    fix = " or ".join(fixes)
    if not fixes and prefetch is None and read_ahead_bytes > 1:
        # Read ahead no more than the one step always read ahead, and change one more field.
        then = fixes_at(1)
        fix = "set read_ahead_bytes 1 (one step ahead), then " + " or ".join(then) if then else ""
    if not fix:
        fix = "no one field fits it: lower seq_len and batch_size"
    if cache_fixes is not None:
        said = f" and a block cache of {cache:,} bytes (block_cache_bytes None: sized by default)"
    else:
        said = f" and block_cache_bytes {cache:,}" if cache else ""
    ahead = (
        f"read_ahead_bytes {read_ahead_bytes:,}" if prefetch is None else f"prefetch {prefetch:,}"
    )
    flight = "automatic prefetch" if prefetch is None else f"{1 + prefetch:,} steps in flight"
    check_memory(
        total,
        f"LoaderConfig batch_size {batch_size:,} at seq_len {seq_len:,} with {ahead}{said} "
        f"({rows:,} rows per host of {per_row(seq_len):,} bytes, {flight})",
        fix,
    )
