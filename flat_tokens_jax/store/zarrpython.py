"""zarr-python, for the arrays whose codecs tensorstore cannot decode (numcodecs
filters such as ``Delta``): the ``zarr`` extra, imported only when such an array
is opened (it costs ~0.15 s). zarr 2 (``>=2.18``) opens zarr v2 arrays; zarr 3
opens v2 and v3 arrays.
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


def _zarr(where: str) -> ModuleType:
    """The ``zarr`` module, or a :class:`FormatError` naming the extra to install."""
    try:
        return importlib.import_module("zarr")
    except ImportError as e:
        raise FormatError(
            f"{where}: this array's codecs are not supported by tensorstore, so reading it "
            f"needs zarr-python, which is not installed ({e}): "
            f"{install_hint('zarr')}, or any zarr>=2.18"
        ) from e


def open_zarr_python(
    url: str | os.PathLike[str], options: StoreOptions, key: str, zarr_format: Literal[2, 3]
) -> Any:
    """The zarr-python array at ``key`` of the store at ``url``, opened read-only;
    ``FormatError`` where the installed zarr-python (if any) cannot open it."""
    text = os.fspath(url)
    zarr = _zarr(f"{text}/{key}")
    v2 = int(str(zarr.__version__).split(".", 1)[0]) < 3
    if v2 and zarr_format == 3:
        raise FormatError(
            f"{text}/{key}: this zarr v3 array's codecs are not supported by tensorstore, "
            f"and zarr-python {zarr.__version__} reads only zarr v2: "
            "pip install 'zarr>=3' to read it"
        )
    where = parse_url(text)
    if where.scheme == "memory":
        raise FormatError(
            f"{text}: this array needs zarr-python (its codecs are not "
            "supported by tensorstore), which cannot reach memory:// stores"
        )
    if where.scheme == "file":
        if v2:
            store = zarr.storage.DirectoryStore(where.path)
        else:
            store = zarr.storage.LocalStore(where.path, read_only=True)
    else:
        storage: dict[str, Any] = {}
        if where.scheme == "s3" and options.endpoint:
            storage["endpoint_url"] = options.endpoint
        remote = f"{where.scheme}://{where.bucket}/{where.path}"
        try:
            if v2:
                store = zarr.storage.FSStore(remote, mode="r", **storage)
            else:
                store = zarr.storage.FsspecStore.from_url(
                    remote, storage_options=storage, read_only=True
                )
        except ImportError as e:
            raise FormatError(
                f"{text}: this array needs zarr-python with fsspec "
                f"(pip install fsspec {'gcsfs' if where.scheme == 'gs' else 's3fs'}): {e}"
            ) from e
    if v2:
        return zarr.open_array(store, path=key, mode="r")
    return zarr.open_array(store, path=key, mode="r", zarr_format=zarr_format)
