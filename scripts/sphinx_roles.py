"""A griffe extension for the API reference: Sphinx roles in docstrings become code links.

The package's docstrings cross-reference with Sphinx roles (``:class:`Loader```,
``:func:`~flat_tokens_jax.x.y```), which mkdocstrings' google style would print as raw
text. Once the package is loaded, each role becomes an optional autoref: a link where the
name resolves to an object the reference documents, plain code where it does not (a
private helper, ``jax.Array``), and never a build warning. mkdocs.yml loads it.
"""

import contextlib
import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:class|func|meth|data|attr|mod|obj|exc|const):`(~?)(\.*)([^`]+)`")


def target(
    obj: griffe.Object, name: str, relative: bool, loader: griffe.GriffeLoader
) -> str | None:
    """The full path ``name`` names from ``obj``'s scope, or ``None`` if nothing there has it."""
    head, _, rest = name.partition(".")
    candidates = []
    if relative:
        scope: griffe.Object | None = obj.module
        while scope is not None:
            candidates.append(f"{scope.path}.{name}")
            scope = scope.parent
    else:
        candidates.append(name)
        with contextlib.suppress(griffe.NameResolutionError):
            candidates.append(obj.resolve(head) + (f".{rest}" if rest else ""))
    for path in candidates:
        try:
            loader.modules_collection[path]
        except (KeyError, griffe.AliasResolutionError, griffe.CyclicAliasError):
            continue
        return path
    return None


def rewrite(obj: griffe.Object, text: str, loader: griffe.GriffeLoader) -> str:
    """``text`` with each Sphinx role replaced by ``<code>`` in an optional autoref."""

    def one(match: re.Match[str]) -> str:
        short, dots, name = match.groups()
        shown = name.rpartition(".")[2] if short else name
        path = target(obj, name, bool(dots), loader)
        code = f"<code>{shown}</code>"
        return f'<autoref identifier="{path}" optional>{code}</autoref>' if path else code

    return ROLE.sub(one, text)


def walk(obj: griffe.Object) -> list[griffe.Object]:
    """``obj`` and every object defined under it (aliases left out: their targets are walked)."""
    found = [obj]
    for member in obj.members.values():
        if not member.is_alias:
            found += walk(member)  # type: ignore[arg-type]
    return found


class SphinxRoles(griffe.Extension):
    """Rewrites every docstring's Sphinx roles once the whole package is loaded."""

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        for obj in walk(pkg):
            if obj.docstring is not None:
                obj.docstring.value = rewrite(obj, obj.docstring.value, loader)
