"""The compiled kernels where numba is installed (the ``fast`` extra); every
caller has a numpy path, taken when they are ``None``."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
from types import ModuleType

_log = logging.getLogger(__name__)


@functools.cache
def kernels() -> ModuleType | None:
    """:mod:`~flat_tokens_jax.core.kernels` when numba imports, else ``None`` (with a
    warning logged when numba is installed but fails to import)."""
    if importlib.util.find_spec("numba") is None:
        return None
    try:
        return importlib.import_module("flat_tokens_jax.core.kernels")
    except ImportError as e:
        _log.warning("numba is installed but does not import (%s): using numpy instead", e)
        return None


@functools.cache
def warm() -> None:
    """:func:`~flat_tokens_jax.core.kernels.warm`, once a process, where numba is."""
    fast = kernels()
    if fast is not None:
        fast.warm()
