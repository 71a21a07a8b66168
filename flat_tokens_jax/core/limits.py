"""Checks run before any work starts: a FIFO, device, socket or folder where a
file should be (a FIFO would block a read forever) and sizes over this
machine's memory are refused, naming the path or the largest size that fits.
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
    """What ``path`` is when it exists and is not a regular file (``"folder"``,
    ...); ``None`` for a regular file or no file at all."""
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return None
    for test, kind in _KINDS:
        if test(mode):
            return kind
    return None if stat.S_ISREG(mode) else "special file"


def check_regular_file(path: str | os.PathLike[str], what: str) -> None:
    """Raises :class:`FormatError` when ``path`` is a FIFO, device, socket or folder."""
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
    below it, or a folder named as metadata; one ``scandir`` per folder, linked
    folders followed once."""
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
    """Refuses a folder where a 1-D array keeps a chunk or shard file (``<n>`` or ``c/<n>``)."""
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
    """Bytes this process may use: physical memory, or the cgroup's limit where
    lower; 0 where unknown."""
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
    """Raises ``ValueError`` naming ``what`` and ``fix`` when ``need`` bytes exceed
    this machine's memory."""
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
    """The largest ``v`` in ``[low, high]`` with ``fits(v)`` (true up to some
    value, false after it), by bisection; ``None`` when ``fits(low)`` is false."""
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

    Each host holds ``batch_size / processes`` rows of the step being read and
    of ``prefetch`` steps ahead (``None``: up to ``read_ahead_bytes``, at least
    one step); a row ``row_bytes(seq_len)``, its reading and :data:`ROW_BYTES`;
    the block cache ``block_cache_bytes`` besides. ``cache_fixes`` marks a cache
    sized by default: given the bytes it may take, it names the fields that fit.

    Raises:
        ValueError: naming the estimate and each field whose change alone would
            fit, with the value that does.
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
