"""Shared test settings: hypothesis profiles and small dataset helpers."""

from __future__ import annotations

import os
import uuid

import hypothesis

hypothesis.settings.register_profile("default", deadline=None, max_examples=60)
hypothesis.settings.register_profile("ci", deadline=None, max_examples=60, derandomize=True)
hypothesis.settings.load_profile("ci" if os.environ.get("CI") else "default")


def memory_url(name: str = "ds") -> str:
    """A fresh ``memory://`` URL that no other test uses."""
    return f"memory://{name}-{uuid.uuid4().hex}"
