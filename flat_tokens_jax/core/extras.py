"""How to install an optional extra, in the words every error uses."""

from __future__ import annotations


def install_hint(extra: str) -> str:
    """The commands that install ``extra``: from a wheel or an index, and in a checkout.

    Example:
        >>> print(install_hint("yaml"))  # doctest: +NORMALIZE_WHITESPACE
        pip install 'flat-tokens-jax[yaml]'
        (in a checkout of the project: pip install -e '.[yaml]')
    """
    return (
        f"pip install 'flat-tokens-jax[{extra}]' "
        f"(in a checkout of the project: pip install -e '.[{extra}]')"
    )
