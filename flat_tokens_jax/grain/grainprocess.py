"""grain worker processes from a plain script: no absl set-up, a quiet exit.

Two things get in the way of ``worker_count > 0`` (``grain.DataLoader``) or
``mp_prefetch`` outside ``absl.app.run``, both grain's own (google/grain#1355
and #398):

- grain reads its absl flags (``--grain_enable_multiprocess_worker_profiling``)
  when it starts worker processes, and absl refuses any read before it has
  parsed the command line: ``UnparsedFlagAccessError``. :func:`prepare_grain`
  gives grain's flags (``grain_*``, and only those) their defaults, as grain
  itself does for its debug flags in each worker; a later parse of the command
  line (``absl.app.run``) still sets them.
- grain's iterators and its batches in shared memory, when still alive as the
  interpreter shuts down, are deleted after the modules they use are torn
  down: each prints an "Exception ignored" traceback, and the shared memory of
  every batch still queued leaks. The exit hook that :func:`prepare_grain`
  registers runs before that tear-down (:func:`close_grain`): it does what
  those deletions would do (workers stop, queued batches are unlinked) and
  releases the shared memory of batches the program still holds.

Nothing here imports grain until a source asks for it.
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
import types
from typing import Any

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
    """Shuts down what grain still runs in this process, while grain's modules
    still stand: closes its generators (their ``with`` blocks stop worker
    pools) and iterators, runs the ``__del__`` of every other live object of
    a grain class that has one (worker pools), and releases the shared memory
    of grain's batches still alive.

    Each of those objects is then of a subclass of its own class whose
    ``__del__`` does nothing: its deletion in the interpreter's tear-down, with
    nothing left to do, prints nothing. A released batch keeps its values (its
    memory stays mapped until the process ends); only its name is removed from
    the system's shared memory.
    """
    grain = sys.modules.get("grain")
    if grain is None:
        return
    shared_type = grain.multiprocessing.SharedMemoryArray
    generators, finalized, arrays = [], [], []
    for obj in gc.get_objects():
        if isinstance(obj, types.GeneratorType):
            frame = obj.gi_frame
            if frame is not None and _of_grain(frame.f_globals.get("__name__")):
                generators.append(obj)
        elif isinstance(obj, shared_type):
            arrays.append(obj)
        elif _of_grain(type(obj).__module__) and hasattr(type(obj), "__del__"):
            finalized.append(obj)
    for step, objects in (("close", generators), ("__del__", finalized)):
        for obj in objects:
            try:
                getattr(obj, step)()
            except Exception as e:  # one that fails must not stop the others
                _log.debug("%s of %r at exit: %s", step, obj, e)
    for array in arrays:
        shm = getattr(array, "shm", None)
        # As the array's __del__ would: only the array over the whole mapping,
        # not a view, and only where this process owns the memory. Closing the
        # mapping would fail while the array uses it.
        owner = getattr(array, "_unlink_on_del", False)
        if shm is not None and owner and isinstance(array.base, mmap.mmap):
            with contextlib.suppress(FileNotFoundError):
                shm.unlink()
    quiet: dict[type, type] = {}
    for obj in finalized + arrays:
        cls = type(obj)
        if cls not in quiet:
            quiet[cls] = type(cls.__name__, (cls,), {"__del__": _nothing})
        obj.__class__ = quiet[cls]


def _of_grain(module: object) -> bool:
    return isinstance(module, str) and (module == "grain" or module.startswith("grain."))


def _nothing(self: Any) -> None:
    """A ``__del__`` with nothing left to do."""
