"""The compiled kernels' on-disk cache: a subfolder ``numba-<version>`` of the
folder numba chooses. numba names its cache files by function, line and Python
version only, so two environments of different numba versions over one source
tree would overwrite each other's kernels (``LLVM bitcode parsing error``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numba
from numba.core.caching import CompileResultCacheImpl, FunctionCache

FOLDER = f"numba-{numba.__version__}"


def _versioned(locator: Any) -> Any:
    """numba's cache ``locator`` class, its folder moved into :data:`FOLDER`."""

    class Versioned(locator):
        def get_cache_path(self) -> str:
            return os.path.join(super().get_cache_path(), FOLDER)

    return Versioned


class _VersionedImpl(CompileResultCacheImpl):
    # numba's own locators, in its order, each a folder deeper (one whose folder
    # cannot be written is passed over, as numba's own are). A list, as numba's.
    _locator_classes = [_versioned(c) for c in CompileResultCacheImpl._locator_classes]  # noqa: RUF012


class _VersionedCache(FunctionCache):
    _impl_class = _VersionedImpl


def compile_cached(fn: Callable[..., Any]) -> Any:
    """``fn`` compiled without the interpreter lock, cached on disk in the
    :data:`FOLDER` of numba's cache folder when one is writable."""
    kernel = numba.njit(nogil=True, boundscheck=False)(fn)
    try:
        cache = _VersionedCache(fn)
    except RuntimeError:  # numba's refusal when no locator has a writable folder
        return kernel
    # numba chooses a cache's folder only from process-wide settings
    # (NUMBA_CACHE_DIR, NUMBA_CACHE_LOCATOR_CLASSES); what njit(cache=True)
    # does, with this one kernel's cache instead.
    kernel._cache = cache  # type: ignore[attr-defined]
    return kernel
