"""zarr-python, for the arrays whose codecs tensorstore cannot decode (numcodecs
filters such as ``Delta``).

zarr-python is the ``zarr`` extra, imported here only when such an array is
opened, so a process that never meets one never imports it (it costs ~0.15 s).
zarr 2 (``>=2.18``) opens zarr v2 arrays; zarr 3 opens v2 and v3 arrays.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import Any, Literal

from flat_tokens_jax.core.extras import install_hint
from flat_tokens_jax.core.format import FormatError
from flat_tokens_jax.core.urls import parse_url
from flat_tokens_jax.store.options import StoreOptions

_EXTRA = f"{install_hint('zarr')}, or any zarr>=2.18"


def _zarr(where: str) -> ModuleType:
    """The ``zarr`` module, or a :class:`FormatError` naming the extra to install."""
    try:
        return importlib.import_module("zarr")
    except ImportError as e:
        raise FormatError(
            f"{where}: this array's codecs are not supported by tensorstore, so reading it "
            f"needs zarr-python, which is not installed ({e}): {_EXTRA}"
        ) from e


def zarr_major(zarr: ModuleType) -> int:
    """The major version of an imported ``zarr`` module (``2`` or ``3``)."""
    return int(str(zarr.__version__).split(".", 1)[0])


def zarr_python_store(url: str | os.PathLike[str], options: StoreOptions) -> Any:
    """A read-only zarr-python store for the same URL (zarr 2 or 3)."""
    text = os.fspath(url)
    where = parse_url(text)
    zarr = _zarr(text)
    v2 = zarr_major(zarr) < 3
    if where.scheme == "file":
        if v2:
            return zarr.storage.DirectoryStore(where.path)
        return zarr.storage.LocalStore(where.path, read_only=True)
    if where.scheme == "memory":
        raise FormatError(
            f"{text}: this array needs zarr-python (its codecs are not "
            "supported by tensorstore), which cannot reach memory:// stores"
        )
    storage: dict[str, Any] = {}
    if where.scheme == "s3" and options.endpoint:
        storage["endpoint_url"] = options.endpoint
    remote = f"{where.scheme}://{where.bucket}/{where.path}"
    try:
        if v2:
            return zarr.storage.FSStore(remote, mode="r", **storage)
        return zarr.storage.FsspecStore.from_url(remote, storage_options=storage, read_only=True)
    except ImportError as e:
        raise FormatError(
            f"{text}: this array needs zarr-python with fsspec "
            f"(pip install fsspec {'gcsfs' if where.scheme == 'gs' else 's3fs'}): {e}"
        ) from e


def open_zarr_python(
    url: str | os.PathLike[str], options: StoreOptions, key: str, zarr_format: Literal[2, 3]
) -> Any:
    """The zarr-python array at ``key`` of the store at ``url``, opened read-only.

    Raises:
        FormatError: zarr-python is not installed, or is zarr 2 and the array
            is zarr v3 (which zarr 2 cannot read).
    """
    where = f"{os.fspath(url)}/{key}"
    zarr = _zarr(where)
    if zarr_major(zarr) < 3:
        if zarr_format == 3:
            raise FormatError(
                f"{where}: this zarr v3 array's codecs are not supported by tensorstore, "
                f"and zarr-python {zarr.__version__} reads only zarr v2: "
                "pip install 'zarr>=3' to read it"
            )
        return zarr.open_array(zarr_python_store(url, options), path=key, mode="r")
    store = zarr_python_store(url, options)
    return zarr.open_array(store, path=key, mode="r", zarr_format=zarr_format)
