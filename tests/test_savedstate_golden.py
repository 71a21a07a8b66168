"""Saved states of the current format, frozen: each restores to the same step
and the same batches, and is saved again as the same text.

``golden_states.json`` holds, for six runs (packed, padded and bin rows, the
block shuffle, a steered mixture with skips and a weight change, a phased run
with a skip), the text ``json.dumps(loader.state(5))`` saved, and the
``targets`` and ``inputs`` (and ``source``) of steps 5, 6 and 9 that the run
read, as the version that froze them wrote them (the stores' URLs replaced by
``URL_A`` and ``URL_B``). A change that alters either is a change of the saved
state's format or of the batches: a breaking change.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from memurls import memory_url

import flat_tokens_jax as ftj
from flat_tokens_jax.loader.phasedloader import PhasedLoader
from flat_tokens_jax.loader.phases import Phase

GOLDEN = json.loads((Path(__file__).parent / "golden_states.json").read_text())
SEQS = [[i % 7 + 1] * (i % 5 + 1) + [i % 11 + 20] for i in range(90)]
OTHER = [[40 + i % 9] * (i % 4 + 2) for i in range(50)]


@functools.cache
def stores() -> tuple[str, str]:
    a, b = memory_url("golden-a"), memory_url("golden-b")
    ftj.write_dataset(a, {"train": SEQS})
    ftj.write_dataset(b, {"train": OTHER})
    return a, b


def build(case: str, plans: Path) -> Any:
    """The run of ``case`` as configured, before any steering."""
    url_a, url_b = stores()
    a, b = ftj.open_dataset(url_a)["train"], ftj.open_dataset(url_b)["train"]

    def cfg(**kw: Any) -> ftj.LoaderConfig:
        return ftj.LoaderConfig(batch_size=4, seq_len=8, seed=3, **kw)

    if case == "packed":
        return ftj.Loader(a, cfg())
    if case == "padded":
        return ftj.Loader(a, cfg(packing=False))
    if case == "bins":
        return ftj.Loader(a, cfg(packing="bins"), plan_cache=plans)
    if case == "blocks":
        return ftj.Loader(a, cfg(shuffle="blocks", shuffle_block=4, shuffle_window=2))
    if case == "steered":
        mix = ftj.Mixture({"a": (a, 2), "b": (b, 1)}, seed=5, period=3)
        return ftj.Loader(mix, cfg(source_field=True))
    assert case == "phased"
    mix = ftj.Mixture({"a": (a, 1), "b": (b, 1)}, seed=5, period=2)
    return PhasedLoader([Phase(0, a, cfg()), Phase(4, mix, cfg(packing=False))])


def saved(case: str) -> str:
    url_a, url_b = stores()
    return (
        GOLDEN[case]["state"]
        .replace('"URL_A"', json.dumps(url_a))
        .replace('"URL_B"', json.dumps(url_b))
    )


@pytest.mark.parametrize("case", sorted(GOLDEN))
def test_a_saved_state_restores_to_the_same_batches_and_saves_the_same_text(
    case: str, tmp_path: Path
) -> None:
    run = build(case, tmp_path)
    text = saved(case)
    assert run.restore(json.loads(text)) == 5
    assert json.dumps(run.state(5)) == text
    for step, fields in GOLDEN[case]["rows"].items():
        batch = run.host_batch(int(step))
        for key, rows in fields.items():
            assert np.asarray(batch[key]).tolist() == rows, (case, step, key)


@pytest.mark.parametrize("case", ["steered", "phased"])
def test_the_same_steering_applied_live_saves_the_golden_text(case: str, tmp_path: Path) -> None:
    """The steered runs' states are what their calls save: the golden texts are
    not hand-made."""
    run = build(case, tmp_path)
    if case == "steered":
        run.skip(2, 3)
        run.set_weights(4, {"a": 1, "b": 3})
        run.skip(6, 1)
    else:
        run.skip(2, 1)
    assert json.dumps(run.state(5)) == saved(case)
