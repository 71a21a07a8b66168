"""Decoding a batch on the host in row blocks, each on a thread, straight into
its rows of the five fields. A numba kernel (:mod:`~flat_tokens_jax.core.kernels`)
never holds the interpreter lock; numpy releases it only inside its large passes.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import os
import threading
from collections.abc import Callable, Sequence

import numpy as np

from flat_tokens_jax.core.buffers import Buffers
from flat_tokens_jax.core.fields import Packing
from flat_tokens_jax.core.values import integer
from flat_tokens_jax.data.records import Records, Windows, request_windows
from flat_tokens_jax.decoding import batch as fields
from flat_tokens_jax.decoding.instancefilter import FilteredRows, kernel_module
from flat_tokens_jax.decoding.layouts import BatchLayout, row_starts

# Fewer rows than this per block cost more in thread hand-offs than they save.
MIN_BLOCK_ROWS = 16


def default_threads() -> int:
    """The cores this process may run on, at most 8 (more measured no faster)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(cores, 8))


class BlockDecoder:
    """Decodes records in row blocks on up to ``threads`` threads (the
    caller's among them), blocks of at least ``min_block_rows`` rows.
    Thread-safe; the pool starts on first use. Every ``kernel``
    (:func:`~.instancefilter.kernel_module`) gives the same fields.
    """

    def __init__(
        self, threads: int, min_block_rows: int = MIN_BLOCK_ROWS, kernel: str = "auto"
    ) -> None:
        threads = integer(threads, "BlockDecoder.threads", low=1)
        self.threads, self.min_block_rows = threads, max(1, min_block_rows)
        self._kernels = kernel_module(kernel)
        self.kernel = "numpy" if self._kernels is None else "numba"
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self.buffers = Buffers()
        self._slots = threading.BoundedSemaphore(threads)

    def __repr__(self) -> str:
        return f"BlockDecoder(threads={self.threads}, kernel={self.kernel!r})"

    def blocks(self, rows: int, threads: int | None = None) -> list[tuple[int, int]]:
        """``[(start, stop), ...]`` row blocks of a ``rows``-row batch, one per
        thread of at most ``threads``."""
        most = self.threads if threads is None else max(1, min(threads, self.threads))
        count = max(1, min(most, rows // self.min_block_rows))
        cuts = np.linspace(0, rows, count + 1).astype(int).tolist()
        return list(itertools.pairwise(cuts))

    def decode(
        self,
        windows: Windows,
        packing: Packing,
        seq_len: int,
        *,
        start_token_id: int,
        pad_id: int,
        threads: int | None = None,
    ) -> dict[str, np.ndarray]:
        """``window_fields(windows, packing, ...)`` on at most ``threads`` threads."""
        rows = windows.encoded.shape[0]
        out = fields.empty_fields(rows, seq_len, self.buffers)
        kernels = self._kernels
        if kernels is not None:
            windows = fields.checked_windows(
                windows, packing, seq_len, start_token_id=start_token_id, pad_id=pad_id
            )

        def work(a: int, b: int) -> None:
            if kernels is not None:
                kernels.decode_rows(
                    windows.encoded,
                    windows.lengths,
                    windows.stored_mask,
                    packing,
                    (a, b),
                    start_token_id=start_token_id,
                    pad_id=pad_id,
                    out=out,
                )
                return
            lengths, mask = windows.lengths, windows.stored_mask
            fields.window_fields(
                Windows(
                    windows.encoded[a:b],
                    lengths=None if lengths is None else lengths[a:b],
                    stored_mask=None if mask is None else mask[a:b],
                ),
                packing,
                start_token_id=start_token_id,
                pad_id=pad_id,
                out={k: v[a:b] for k, v in out.items()},
            )

        self.run_blocks(rows, work, threads)
        return out

    def run_blocks(
        self, rows: int, work: Callable[[int, int], None], threads: int | None = None
    ) -> None:
        """Calls ``work(a, b)`` for each row block ``a .. b`` of a ``rows``-row
        batch, on at most ``threads`` threads, within the ``threads`` slots that
        all batches in flight share."""

        def run(block: tuple[int, int]) -> None:
            with self._slots:
                work(*block)

        blocks = self.blocks(rows, threads)
        if len(blocks) == 1:
            run(blocks[0])
            return
        with self._lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    self.threads - 1, thread_name_prefix="ftj-decode"
                )
            pool = self._pool
        futures = [pool.submit(run, block) for block in blocks[1:]]
        run(blocks[0])  # the caller runs one block itself: one hand-off fewer
        for f in futures:
            f.result()

    def close(self) -> None:
        """Stops the threads (a later ``decode`` starts them again)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)


Part = tuple[int, np.ndarray | None, Windows]
"""Rows read from one component: ``(component, at, windows)``, ``at`` the
rows they fill (``[k] int64``; ``None``: every row)."""


def request_parts(
    components: Sequence[Records], comp: np.ndarray, records: np.ndarray, real: np.ndarray
) -> Callable[[], list[Part]]:
    """Starts reading a step's rows, every component's at once, and returns what
    waits for them: ``comp`` and ``records`` ``[r] int64`` of each real row,
    ``real`` ``[k] bool`` which of the step's rows are real (the rest padding)."""
    present = np.unique(comp).tolist()
    if real.all() and len(present) == 1:
        only = request_windows(components[present[0]], records)
        return lambda: [(present[0], None, only())]
    at = np.flatnonzero(real)
    waiting = [
        (c, at[comp == c], request_windows(components[c], records[comp == c])) for c in present
    ]
    return lambda: [(c, rows, windows()) for c, rows, windows in waiting]


def row_sources(comp: np.ndarray, real: np.ndarray, ids: np.ndarray | None = None) -> np.ndarray:
    """``[k] int32``: the source of each of a step's rows (``comp`` and ``real``
    as :func:`request_parts` takes them), ``-1`` for padding; ``ids`` ``[K]``
    each component's run-wide index (``None``: its own)."""
    out = np.full(real.shape, -1, np.int32)
    out[real] = comp if ids is None else ids[comp]
    return out


@dataclasses.dataclass(frozen=True)
class RowDecode:
    """Rows read by :func:`request_parts` to the layout's fields: the one host
    decode, of a ``Loader``'s steps and of ``FlatTokensSource``'s records.
    ``packings``: each component's; ``filtered``: the instance filter."""

    packings: tuple[Packing, ...]
    seq_len: int
    start_token_id: int
    pad_id: int
    layout: BatchLayout
    filtered: FilteredRows

    def fields(
        self,
        decoder: BlockDecoder,
        num_rows: int,
        parts: Sequence[Part],
        sources: np.ndarray,
        *,
        where: str,
        rows: np.ndarray | None,
        step: int | None = None,
        threads: int | None = None,
    ) -> dict[str, np.ndarray]:
        """The layout's fields ``[num_rows, seq_len]`` of ``parts``, decoded by
        ``decoder`` on at most ``threads`` threads, after the instance filter
        (its rejections noted for ``step``). Rows of no part are padding;
        ``where`` and ``rows`` (global indices) name rows in errors."""

        def decode(c: int, windows: Windows) -> dict[str, np.ndarray]:
            return decoder.decode(
                windows,
                self.packings[c],
                self.seq_len,
                start_token_id=self.start_token_id,
                pad_id=self.pad_id,
                threads=threads,
            )

        if len(parts) == 1 and parts[0][1] is None:
            c, _, windows = parts[0]
            out, starts = decode(c, windows), row_starts(windows, self.packings[c])
        else:
            out = fields.padding_fields(num_rows, self.seq_len, self.pad_id)
            starts = np.zeros(num_rows, bool)
            for c, at, windows in parts:
                for key, value in decode(c, windows).items():
                    out[key][at] = value
                starts[at] = row_starts(windows, self.packings[c])
        if self.filtered.rule is not None:
            out = self.filtered.apply(out, step, threads)
        if self.layout.plain:
            return out
        return self.layout.apply(out, starts, where=where, rows=rows, sources=sources)
