"""The attribute lookup of a subpackage named like one of its modules
(``flat_tokens_jax.store`` and its ``store`` module): the module's names are the
package's too, imported on first use."""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from typing import Any


def namesake_getattr(package: str, namespace: dict[str, Any]) -> Callable[[str], Any]:
    """The module ``__getattr__`` of ``package``: a submodule, or a name of the
    module ``package.<last part of package>``, imported on first use and kept in
    ``namespace`` (the package's globals)."""
    module = f"{package}.{package.rsplit('.', 1)[-1]}"

    def lookup(name: str) -> Any:
        if name.startswith("__") or not name.isidentifier():
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        if importlib.util.find_spec(f"{package}.{name}") is not None:
            return importlib.import_module(f"{package}.{name}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    lookup.__doc__ = f"A submodule, or a name of :mod:`{module}`, imported on first use."
    return lookup
