"""grain worker processes from a plain script: no absl set-up, a quiet exit.

Two things of grain's own get in the way of worker processes outside
``absl.app.run`` (google/grain#1355 and #398): grain reads its absl flags when
it starts workers, which absl refuses before it parsed the command line
(``UnparsedFlagAccessError``); and grain's iterators and shared-memory batches
still alive at exit are deleted after the modules they use are torn down, each
``__del__`` printing a traceback and leaking the batch's shared memory.
:func:`prepare_grain` gives grain's flags their defaults and registers
:func:`close_grain`, which closes those first. Nothing here imports grain
until a source asks for it.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import gc
import importlib
import logging
import mmap
import sys
from collections.abc import Callable

_log = logging.getLogger(__name__)


def prepare_grain() -> None:
    """Makes grain's flags readable outside ``absl.app.run`` and registers the
    exit hook (once per process). Does nothing where grain is not installed."""
    try:
        importlib.import_module("grain")  # defines grain's flags
        flags = importlib.import_module("absl.flags")
    except ImportError:
        return
    if not flags.FLAGS.is_parsed():
        for name in list(flags.FLAGS):
            if name.startswith("grain_") and not flags.FLAGS[name].present:
                flags.FLAGS[name].present = 1
    _register_exit_hook()


@functools.cache
def _register_exit_hook() -> None:
    atexit.register(close_grain)


def close_grain() -> None:
    """Closes grain's iterators still open in this process and unlinks the
    shared memory of grain's batches still alive (their values stay mapped),
    while grain's modules still stand; then drops the reports of the
    ``__del__`` of those types in the interpreter's tear-down, and only those.
    """
    grain = sys.modules.get("grain")
    if grain is None:
        return
    iterator_type, array_type = grain.DatasetIterator, grain.multiprocessing.SharedMemoryArray
    iterators, arrays = [], []
    for obj in gc.get_objects():
        kind = type(obj)  # not isinstance: it would run a __class__ property
        if issubclass(kind, iterator_type):
            iterators.append(obj)
        elif issubclass(kind, array_type) and isinstance(obj.base, mmap.mmap):
            arrays.append(obj)  # over a whole mapping, not a view
    for it in iterators:
        try:
            it.close()
        except Exception as e:  # one that fails must not stop the others
            _log.debug("close of %r at exit: %s", it, e)
    for array in arrays:
        with contextlib.suppress(FileNotFoundError):  # unlinked already
            array.metadata.close_and_unlink_shm()
    sys.unraisablehook = _quiet_teardown(
        sys.unraisablehook, (iterator_type.__del__, array_type.__del__), sys.is_finalizing
    )


def _quiet_teardown(
    report: Callable[[sys.UnraisableHookArgs], object],
    deletes: tuple[Callable[..., object], ...],
    finalizing: Callable[[], bool],
) -> Callable[[sys.UnraisableHookArgs], None]:
    """``report``, but for the exceptions that ``deletes`` raise in the
    interpreter's tear-down. All it uses is bound here: it runs after this
    module's globals are gone."""

    def hook(unraisable: sys.UnraisableHookArgs) -> None:
        if not (finalizing() and unraisable.object in deletes):
            report(unraisable)

    return hook
