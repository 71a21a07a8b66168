"""What the shared storage fixtures of ``tests/conftest.py`` give: a server's
address and the options that reach it (a module of its own: tests import it,
and the name ``conftest`` may be the repository's root one)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from pathlib import Path

from proxies import DelayProxy

import flat_tokens_jax as ftj


@dataclasses.dataclass(frozen=True)
class S3:
    """moto's S3 server with the bucket ``bucket``: ``base`` is its URL, and
    ``options`` reach it with moto's test keys (a credentials profile)."""

    base: str
    options: ftj.StoreOptions

    @property
    def port(self) -> int:
        return int(self.base.rsplit(":", 1)[1])


@dataclasses.dataclass(frozen=True)
class Served:
    """One dataset on local disk (``local``) that a read-only S3 stand-in
    serves as ``url`` (``servers.s3_files``, on ``port``), and ``options``
    that reach it."""

    url: str
    local: Path
    port: int
    options: ftj.StoreOptions

    @contextlib.contextmanager
    def proxied(
        self, delay: float = 0.0, rate: float | None = None, **changes: object
    ) -> Iterator[tuple[DelayProxy, ftj.StoreOptions]]:
        """A fresh :class:`DelayProxy` in front of the server, and options
        (``changes`` applied) that reach the server through it."""
        proxy = DelayProxy(self.port, delay, rate)
        endpoint = f"http://127.0.0.1:{proxy.port}"
        try:
            yield proxy, dataclasses.replace(self.options, endpoint=endpoint, **changes)  # type: ignore[arg-type]
        finally:
            proxy.close()
