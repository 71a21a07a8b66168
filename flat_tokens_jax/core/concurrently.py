"""Calls run at once on threads, so that their round trips to a store overlap."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")

MAX_THREADS = 32  # more calls than this share the threads


def at_once(calls: Sequence[Callable[[], T]]) -> list[T]:
    """Each call's result, in order, the calls run concurrently and all ended;
    the first failing call's exception (in order) is raised."""
    if len(calls) <= 1:
        return [call() for call in calls]
    with ThreadPoolExecutor(max_workers=min(len(calls), MAX_THREADS)) as pool:
        futures = [pool.submit(call) for call in calls]
        return [future.result() for future in futures]
