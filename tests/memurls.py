"""Fresh ``memory://`` store URLs for tests (a module of its own: the repository's
root conftest.py, which runs the docs' code blocks, shadows ``conftest`` in
processes started from the root)."""

from __future__ import annotations

import uuid


def memory_url(name: str = "ds") -> str:
    """A fresh ``memory://`` URL that no other test uses."""
    return f"memory://{name}-{uuid.uuid4().hex}"
