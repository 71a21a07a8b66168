"""``Loader.to_grain`` and ``PhasedLoader.to_grain`` against ``host_batch``: every
source kind, resumes through ``get_state``/``set_state`` and grain's checkpoint
handler, refusals of other data and of ``mp_prefetch``; the steps handed out
advance the loader's ``next_step``, so steering behind them is refused."""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import pickle
from pathlib import Path
from typing import Any

import grain
import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from memurls import memory_url

import flat_tokens_jax as ftj
from flat_tokens_jax.loader.grainprocess import prepare_grain
from flat_tokens_jax.loader.phasedloader import PhasedLoader
from flat_tokens_jax.loader.phases import Phase
from flat_tokens_jax.sampling.mixture import Mixture


@functools.cache
def split(name: str, count: int = 40, seed: int = 3) -> ftj.FlatTokens:
    """A small split of ``count`` sequences whose tokens tell rows apart."""
    rng = np.random.default_rng(seed)
    seqs = [rng.integers(1, 900, int(rng.integers(1, 30))).tolist() for _ in range(count)]
    url = memory_url(f"tograin-{name}")
    ftj.write_dataset(url, {"train": seqs})
    return ftj.open_dataset(url)["train"]


def config(**kw: Any) -> ftj.LoaderConfig:
    return ftj.LoaderConfig(**{"batch_size": 4, "seq_len": 16, "seed": 1, **kw})


def assert_steps(batches: list[dict[str, np.ndarray]], loader: Any, first: int = 0) -> None:
    """``batches`` are the loader's ``host_batch`` of consecutive steps from ``first``."""
    for k, batch in enumerate(batches):
        want = loader.host_batch(first + k)
        assert sorted(batch) == sorted(want), first + k
        for key in want:
            assert batch[key].dtype == want[key].dtype, (first + k, key)
            np.testing.assert_array_equal(batch[key], want[key], err_msg=f"{first + k} {key}")


@pytest.mark.parametrize("layout", ["fields", "segments", "tokens", "maxtext"])
@pytest.mark.parametrize("packing", [True, False, "bins"])
def test_a_split_to_its_end_is_host_batch(layout: str, packing: bool | str) -> None:
    cfg = config(num_epochs=2, layout=layout, packing=packing)
    loader = ftj.Loader(split("a"), cfg)
    batches = list(loader.to_grain())
    assert loader.num_batches is not None and len(batches) == loader.num_batches
    assert_steps(batches, loader)


def test_a_mixture_a_schedule_and_an_instance_filter_are_host_batch() -> None:
    mixture = Mixture({"a": (split("a"), 2.0), "b": (split("b", 25, 4), 1.0)}, seed=5)
    cfg = config(
        batch_size=[(0, 2), (3, 6), (7, 3)],
        instance_filter=ftj.InstanceFilter(max_period=2, max_count=2),
    )
    loader = ftj.Loader(mixture, cfg)
    batches = list(itertools.islice(loader.to_grain(), 12))
    assert [len(b["inputs"]) for b in batches] == [2, 2, 2, 6, 6, 6, 6, 3, 3, 3, 3, 3]
    assert_steps(batches, loader)


@pytest.mark.parametrize("decode", ["host", "device"])
@pytest.mark.parametrize("spec", [P("data"), P("data", "seq")])
def test_a_sharded_loader_yields_host_batch_whatever_decodes_its_batches(
    spec: P, decode: str
) -> None:
    """On 8 devices of one process, rows split or sequences split too, and
    ``decode="device"``: the elements are this host's rows, all of them, decoded."""
    mesh = jax.make_mesh((2, 4), ("data", "seq"))
    loader = ftj.Loader(split("a"), config(batch_size=8, decode=decode), NamedSharding(mesh, spec))
    batches = list(itertools.islice(loader.to_grain(), 4))
    assert all(b["inputs"].shape == (8, 16) for b in batches)
    assert_steps(batches, loader)


def test_it_starts_at_the_restored_step_and_maps_downstream() -> None:
    loader = ftj.Loader(split("a"), config(num_epochs=3))
    other = ftj.Loader(split("a"), config(num_epochs=3))
    other.restore(loader.state(7))
    sums = list(other.to_grain().map(lambda b: int(b["inputs"].sum())))
    assert sums == [int(loader.host_batch(s)["inputs"].sum()) for s in range(7, 30)]


def phased(seed: int = 1) -> PhasedLoader:
    """Three phases: another batch size at step 5, a mixture from step 9."""
    a, b = split("a"), split("b", 25, 4)
    mixture = Mixture({"a": (a, 1.0), "b": (b, 1.0)}, seed=2)
    return PhasedLoader(
        [
            Phase(0, a, config(seed=seed)),
            Phase(5, a, config(batch_size=6, seed=seed)),
            Phase(9, mixture, config(batch_size=2, seed=seed)),
        ]
    )


def test_phases_across_their_boundaries_are_host_batch() -> None:
    run = phased()
    batches = list(itertools.islice(run.to_grain(), 14))
    assert [len(b["inputs"]) for b in batches] == [4] * 5 + [6] * 4 + [2] * 5
    assert_steps(batches, run)


def test_one_phase_with_epochs_ends_where_its_loader_does() -> None:
    run = PhasedLoader([Phase(0, split("a"), config(num_epochs=1))])
    batches = list(run.to_grain())
    assert run.num_batches is not None and len(batches) == run.num_batches
    assert_steps(batches, run)


def test_an_error_of_a_phases_step_names_the_run_step_and_the_phase() -> None:
    a = split("a")
    segments = config(layout="segments", max_segments=1)
    run = PhasedLoader([Phase(0, a, config()), Phase(3, a, segments)])
    it = iter(run.to_grain())
    next(it), next(it), next(it)
    with pytest.raises(ValueError) as e:
        next(it)
    assert str(e.value).startswith("step 3 (in phase 1 (from step 3), its step 0): step 0: row ")
    assert "set LoaderConfig.max_segments >= " in str(e.value)


@settings(max_examples=6, deadline=None)
@given(st.integers(0, 13), st.integers(1, 4))
def test_get_state_then_set_state_continues_alike(step: int, more: int) -> None:
    run = phased()
    it = iter(run.to_grain())
    for _ in range(step):
        next(it)
    state = json.loads(json.dumps(it.get_state()))
    assert state == run.state(step)
    fresh = phased()
    again = iter(fresh.to_grain())
    again.set_state(state)
    assert_steps([next(again) for _ in range(more)], run, step)
    assert again.get_state() == run.state(step + more)


def test_a_loader_state_is_the_iterators_state() -> None:
    loader = ftj.Loader(split("a"), config(batch_size=[(0, 4), (2, 8)]))
    it = iter(loader.to_grain())
    next(it), next(it), next(it)
    assert it.get_state() == loader.state(3)
    assert it.get_state()["samples"] == 4 + 4 + 8


@pytest.mark.parametrize(
    ("other", "field"),
    [
        (lambda: ftj.Loader(split("a"), config(seed=2)), "fingerprint.config.seed"),
        (lambda: ftj.Loader(split("c", 40, 9), config()), "fingerprint.data"),
    ],
)
def test_set_state_of_another_seed_or_dataset_is_refused(other: Any, field: str) -> None:
    saved = ftj.Loader(split("a"), config()).state(3)
    it = iter(other().to_grain())
    with pytest.raises(ftj.StateMismatch, match=field.replace(".", r"\.")):
        it.set_state(saved)


def test_grains_checkpoint_handler_saves_and_restores_it(tmp_path: Path) -> None:
    from etils import epath

    run = phased()
    it = iter(run.to_grain())
    for _ in range(4):
        next(it)
    handler = grain.checkpoint.CheckpointHandler()
    handler.save(epath.Path(tmp_path), item=it)
    restored = handler.restore(epath.Path(tmp_path), item=iter(phased().to_grain()))
    assert_steps([next(restored) for _ in range(7)], run, 4)
    with pytest.raises(ftj.StateMismatch, match=r"phase 0.*fingerprint\.config\.seed"):
        handler.restore(epath.Path(tmp_path), item=iter(phased(seed=9).to_grain()))


def test_an_orbax_checkpoint_manager_saves_and_restores_it(tmp_path: Path) -> None:
    ocp = pytest.importorskip("orbax.checkpoint")
    loader = ftj.Loader(split("a"), config(batch_size=[(0, 4), (3, 8)]))
    it = iter(loader.to_grain())
    for _ in range(5):
        next(it)
    with ocp.CheckpointManager(tmp_path / "ckpt") as manager:
        manager.save(5, args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(it)))
        manager.wait_until_finished()
    resumed = iter(ftj.Loader(split("a"), config(batch_size=[(0, 4), (3, 8)])).to_grain())
    with ocp.CheckpointManager(tmp_path / "ckpt") as manager:
        args = ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(resumed))
        manager.restore(5, args=args)
    assert_steps([next(resumed) for _ in range(3)], loader, 5)


def test_an_orbax_v1_restore_of_another_seed_raises_state_mismatch_itself(tmp_path: Path) -> None:
    """orbax v1 (``load_checkpointables``, grain's ``StatefulCheckpointable``
    hooks) continues a saved iterator exactly; another seed's restore raises
    ``StateMismatch`` out of the call, not orbax's ``NoEntryError`` around it."""
    v1 = pytest.importorskip("orbax.checkpoint.experimental.v1")
    loader = ftj.Loader(split("a"), config())
    it = iter(loader.to_grain())
    for _ in range(3):
        next(it)
    v1.save_checkpointables(tmp_path / "ckpt", {"iter": it})
    resumed = iter(ftj.Loader(split("a"), config()).to_grain())
    v1.load_checkpointables(tmp_path / "ckpt", {"iter": resumed})
    assert_steps([next(resumed) for _ in range(2)], loader, 3)
    other = iter(ftj.Loader(split("a"), config(seed=2)).to_grain())
    with pytest.raises(Exception) as raised:
        v1.load_checkpointables(tmp_path / "ckpt", {"iter": other})
    assert type(raised.value) is ftj.StateMismatch, repr(raised.value)
    assert "fingerprint.config.seed: saved 1, now 2" in str(raised.value)


def test_it_has_no_parent_and_says_so_without_an_assertion() -> None:
    """``hasattr(it, "_parent")`` (code that walks a pipeline asks it) is
    False: grain's ``_parent`` asserts exactly one parent, and this iterator has none."""
    it = iter(ftj.Loader(split("a"), config()).to_grain())
    next(it)
    assert not hasattr(it, "_parent")
    it.close()


def on_disk(path: Path, count: int = 40, seed: int = 3) -> ftj.FlatTokens:
    """A split as ``split`` makes it, in a store on disk, which worker processes reopen."""
    rng = np.random.default_rng(seed)
    seqs = [rng.integers(1, 900, int(rng.integers(1, 30))).tolist() for _ in range(count)]
    ftj.write_dataset(str(path), {"train": seqs})
    return ftj.open_dataset(str(path))["train"]


def test_mp_prefetch_hands_out_host_batch_in_step_order_and_resumes_exactly(
    tmp_path: Path,
) -> None:
    """Two worker processes, a mixture with a batch-size schedule, a skip made
    before iterating: the elements are ``host_batch`` of steps 0, 1, 2, ...;
    grain's state after 5 of them restores in a fresh loader (without the skip,
    which the state carries) to the same elements as the uninterrupted run."""
    prepare_grain()
    mixture = Mixture(
        {"a": (on_disk(tmp_path / "a"), 2.0), "b": (on_disk(tmp_path / "b", 25, 4), 1.0)}, seed=5
    )
    cfg = config(batch_size=[(0, 2), (3, 6)], num_epochs=None)
    loader = ftj.Loader(mixture, cfg)
    loader.skip(2, 3)
    options = grain.MultiprocessingOptions(num_workers=2)
    with contextlib.closing(iter(loader.to_grain().mp_prefetch(options))) as it:
        first = [next(it) for _ in range(5)]
        state = json.loads(json.dumps(it.get_state()))
        rest = [next(it) for _ in range(6)]
    assert_steps(first + rest, loader)
    fresh = ftj.Loader(mixture, cfg)
    with contextlib.closing(iter(fresh.to_grain().mp_prefetch(options))) as again:
        again.set_state(state)
        assert_steps([next(again) for _ in range(6)], loader, 5)


def test_a_loader_sent_to_workers_refuses_steering_and_memory_stores_do_not_go(
    tmp_path: Path,
) -> None:
    prepare_grain()
    loader = ftj.Loader(on_disk(tmp_path / "a"), config(num_epochs=1))
    options = grain.MultiprocessingOptions(num_workers=2)
    batches = list(loader.to_grain().mp_prefetch(options))
    assert_steps(batches, loader)
    assert len(batches) == loader.num_batches
    with pytest.raises(ValueError, match=r"grain's worker processes .*Steer it before iterating"):
        loader.skip(30, 1)
    in_memory = iter(ftj.Loader(split("a"), config()).to_grain().mp_prefetch(options))
    with pytest.raises(pickle.PicklingError, match=r"memory:// store.*leave mp_prefetch out"):
        next(in_memory)


def test_mp_prefetch_of_phases_is_refused_naming_what_works() -> None:
    prepare_grain()
    phased = two_streams("phased")
    it = iter(phased.to_grain().mp_prefetch(grain.MultiprocessingOptions(num_workers=2)))
    with pytest.raises(TypeError, match=r"without mp_prefetch.*each phase's Loader"):
        next(it)


@functools.cache
def labelled(name: str, first: int, count: int = 30) -> ftj.FlatTokens:
    """``count`` records of 3 tokens, record ``i`` all ``first + i``: a row tells its record."""
    url = memory_url(f"tograin-labelled-{name}")
    ftj.write_dataset(url, {"train": [[first + i] * 3 for i in range(count)]})
    return ftj.open_dataset(url)["train"]


def two_streams(kind: str) -> Any:
    """A mixture of two components of 30 records each, one record a row: as a
    ``Loader``, or as a ``PhasedLoader`` whose second phase continues both streams."""
    mixture = Mixture({"a": (labelled("a", 100), 1.0), "b": (labelled("b", 200), 1.0)}, seed=3)
    cfg = config(seq_len=4, packing=False)
    if kind == "loader":
        return ftj.Loader(mixture, cfg)
    return PhasedLoader(
        [Phase(0, mixture, cfg), Phase(9, mixture, config(seq_len=4, packing=False, batch_size=2))]
    )


@pytest.mark.parametrize("kind", ["loader", "phased"])
def test_steps_handed_out_advance_the_loader_and_a_change_behind_them_is_refused(
    kind: str,
) -> None:
    """Issue 46: after the iterator handed out steps 0 to 5 the loader's
    ``next_step`` stayed 0, ``state()`` saved step 0 and a skip or weight change
    at step 2 was taken, so state and provenance told of batches never trained."""
    run = two_streams(kind)
    it = iter(run.to_grain())
    for _ in range(6):
        next(it)
    assert run.next_step == 6
    assert run.state()["step"] == 6 == it.get_state()["step"]
    for change in (lambda: run.skip(2, 2), lambda: run.set_weights(2, [1, 3])):
        with pytest.raises(ValueError, match=r"step 2 is before the loader's next step 6 "):
            change()
    assert run.state() == two_streams(kind).state(6), "nothing of the refused changes was kept"
    again = iter(run.to_grain())  # another iterator: the loader follows the one that yielded last
    again.set_state(run.state(3))
    assert run.next_step == 3
    next(again), next(again)
    assert run.next_step == 5
    next(it)
    assert run.next_step == 7


@pytest.mark.parametrize("kind", ["loader", "phased"])
def test_a_weight_change_while_the_iterator_runs_hands_out_no_record_twice_in_an_epoch(
    kind: str,
) -> None:
    """Issue 46: a change at a step the iterator had handed out was taken, and
    the steps after it handed out 4 records of one component a second time
    within its first epoch. Brute force over the rows handed out: each
    component's first 30 records (its first epoch) are 30 different ones."""
    run = two_streams(kind)
    it = iter(run.to_grain())
    batches = [next(it) for _ in range(6)]
    with contextlib.suppress(ValueError):  # a trainer's change behind the iterator
        run.set_weights(2, [1, 3])
    run.set_weights(run.next_step, [1, 3])
    batches += [next(it) for _ in range(20)]
    drawn: dict[int, list[int]] = {100: [], 200: []}
    for batch in batches:
        for targets, mask in zip(batch["targets"], batch["loss_mask"], strict=True):
            (record,) = set(targets[mask].tolist())
            drawn[record // 100 * 100].append(record)
    for first, records in drawn.items():
        assert len(records) > 30, (first, len(records))
        assert sorted(records[:30]) == list(range(first, first + 30)), first
