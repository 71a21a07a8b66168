"""What one steady-state step of a plain loader costs (issue 47): with no
batch-size schedule, no weight changes and no skips, a step enters at most 20
of the package's modules and 16 of its classes, makes at most 200 calls of
package functions, and never passes through the steering, skips or schedule
machinery.

Traced as the issue traced it: ``sys.setprofile`` in the caller's thread and
``threading.setprofile`` for the threads started after it (the loader is made
after both, so its read-ahead threads are traced too), counting the calls of
functions whose code lies in the package, the modules they lie in and the
classes of their ``self`` or ``cls``. Counted over :data:`STEPS` steps after
:data:`WARM` steps, so that the read-ahead's depth (the steps it prepares past
the last one counted) is small next to the steps counted; no timing is
asserted. The warm-up reads every chunk of the data, so that the store's
checks of a chunk's first read (once per process) are behind it.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import sys
import threading
from collections.abc import Callable, Generator
from pathlib import Path
from types import FrameType
from typing import Any, cast

import numpy as np

import flat_tokens_jax as ftj
from flat_tokens_jax.core.fields import Packing
from flat_tokens_jax.loader.config import LoaderConfig

PACKAGE = os.path.dirname(ftj.__file__) + os.sep
WARM = 30
STEPS = 60
MAX_MODULES, MAX_CLASSES, MAX_CALLS = 20, 16, 200
STEERING = ("sampling/steering.py", "sampling/skips.py", "sampling/schedule.py")


@dataclasses.dataclass
class Trace:
    """What the steps traced entered: modules (paths in the package), classes
    (qualified names) and the calls of each function (``module:qualname``)."""

    steps: int
    modules: set[str] = dataclasses.field(default_factory=set)
    classes: set[str] = dataclasses.field(default_factory=set)
    calls: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)

    @property
    def per_step(self) -> float:
        return sum(self.calls.values()) / self.steps

    def __str__(self) -> str:
        top = "\n".join(f"  {n / self.steps:6.2f} {f}" for f, n in self.calls.most_common(40))
        return (
            f"{len(self.modules)} modules {sorted(self.modules)}\n"
            f"{len(self.classes)} classes {sorted(self.classes)}\n"
            f"{self.per_step:.1f} calls a step, the most called (calls a step):\n{top}"
        )


def traced_steps(make: Callable[[], ftj.Loader], warm: int = WARM, steps: int = STEPS) -> Trace:
    """The package's calls while ``make()``'s ``iterate(0)`` hands out
    ``steps`` steps after ``warm``, in every thread the loader starts. The
    profile function leaves each thread once the count is done."""
    trace = Trace(steps)
    lock = threading.Lock()
    state = {"on": False, "done": False}

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if state["done"]:
            sys.setprofile(None)
            return
        code = frame.f_code
        if event != "call" or not state["on"] or not code.co_filename.startswith(PACKAGE):
            return
        module = code.co_filename[len(PACKAGE) :].replace(os.sep, "/")
        me = frame.f_locals.get("self", frame.f_locals.get("cls"))
        kind = None if me is None else me if isinstance(me, type) else type(me)
        with lock:
            trace.modules.add(module)
            trace.calls[f"{module}:{code.co_qualname}"] += 1
            if kind is not None and kind.__module__.startswith("flat_tokens_jax"):
                trace.classes.add(f"{kind.__module__}.{kind.__qualname__}")

    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        steps_of = cast(Generator[Any, None, None], make().iterate(0))
        try:
            for _ in range(warm):
                next(steps_of)
            state["on"] = True
            for _ in range(steps):
                next(steps_of)
            state["on"] = False
        finally:
            steps_of.close()
    finally:
        state["done"] = True
        sys.setprofile(None)
        threading.setprofile(None)
    return trace


def plain_loader(tmp_path: Path) -> Callable[[], ftj.Loader]:
    """A plain loader as the issue traced it: one local split, packed,
    shuffled, batch 8 x 128, every other field its default. Its ~85,000
    tokens (ten chunks) are all touched by the warm-up's 240 rows."""
    rng = np.random.default_rng(0)
    docs = [rng.integers(1, 1000, n) for n in rng.integers(20, 400, 400)]
    ftj.write_dataset(str(tmp_path / "ds"), {"train": docs})
    split = ftj.open_dataset(str(tmp_path / "ds"))["train"]
    config = LoaderConfig(batch_size=8, seq_len=128, packing=Packing.WINDOWS, shuffle=True, seed=0)
    return lambda: ftj.Loader(split, config)


def test_a_plain_step_enters_few_modules_and_classes_and_makes_few_calls(
    tmp_path: Path,
) -> None:
    trace = traced_steps(plain_loader(tmp_path))
    assert len(trace.modules) <= MAX_MODULES, str(trace)
    assert len(trace.classes) <= MAX_CLASSES, str(trace)
    assert trace.per_step <= MAX_CALLS, str(trace)


def test_a_plain_step_never_passes_through_the_steering(tmp_path: Path) -> None:
    trace = traced_steps(plain_loader(tmp_path))
    assert not trace.modules & set(STEERING), str(trace)
