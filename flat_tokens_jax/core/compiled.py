"""The compiled kernels (:mod:`~flat_tokens_jax.core.kernels`), where numba is installed.

They are optional (the ``fast`` extra): every caller has a numpy path that
gives the same results, and takes it when :func:`kernels` returns ``None``.
"""

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
def filter_kernel() -> ModuleType | None:
    """:mod:`~flat_tokens_jax.core.filterkernel` (the instance filter's kernel)
    when numba imports, else ``None``."""
    if kernels() is None:
        return None
    return importlib.import_module("flat_tokens_jax.core.filterkernel")


@functools.cache
def warm() -> None:
    """Sets the compiled kernels up once a process (see
    :func:`~flat_tokens_jax.core.kernels.warm`); nothing without numba."""
    fast = kernels()
    if fast is not None:
        fast.warm()
