"""The ``source`` field and per-source sums (issue 38, items 1 and 2).

Each row's expected source is read from ``provenance()``, which names the
component a row came from (padding rows: ``-1``), and looked up by name in
names written out here; the field must equal it on every path (``host_batch``,
``batch``/``iterate`` decoded on the host and on the devices, ``to_grain``,
``FlatTokensSource``), in a split, a ``Mixture`` and a run in phases.
:func:`~flat_tokens_jax.per_source` is checked against a loop over rows and
tokens, and ``stats()["source_tokens"]`` against rows counted by hand.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from memurls import memory_url
from test_sharding import CASES, mesh

import flat_tokens_jax as ftj
from flat_tokens_jax.grain.grain import FlatTokensSource

LAYOUTS = ("fields", "segments", "tokens", "maxtext")
L = 8
RULE = ftj.InstanceFilter(max_period=3, max_count=4)


@functools.cache
def splits() -> dict[str, ftj.FlatTokens]:
    """Three small splits of distinct token ranges, and ``rep``, whose
    sequences repeat one token (rows the instance filter rejects)."""
    rng = np.random.default_rng(38)
    data = {
        name: [
            rng.integers(100 * k + 1, 100 * k + 99, int(rng.integers(1, 20))).tolist()
            for _ in range(12 + 3 * k)
        ]
        for k, name in enumerate("abc")
    }
    data["rep"] = [[7] * 30, [9] * 25, rng.integers(1, 99, 30).tolist()]
    out = {}
    for name, seqs in data.items():
        url = memory_url(f"source-{name}")
        ftj.write_dataset(
            url, {"train": seqs}, storage_format=ftj.StorageFormat(shard_tokens=64, chunk_tokens=8)
        )
        out[name] = ftj.open_dataset(url)["train"]
    return out


def mixture(weights: dict[str, float]) -> ftj.Mixture:
    return ftj.Mixture({n: (splits()[n], w) for n, w in weights.items()})


def wanted(rows: list[dict[str, Any]], names: Sequence[str]) -> np.ndarray:
    """``[k] int32`` each row's source: ``-1`` for padding, else the index in
    ``names`` of the component ``provenance`` names (``"0"``: a plain split)."""
    return np.array(
        [-1 if r.get("padding") else list(names).index(r.get("component_name", "0")) for r in rows],
        np.int32,
    )


def check_source(got: Any, want: np.ndarray) -> None:
    value = np.asarray(got)
    assert value.dtype == np.int32 and value.shape == want.shape
    np.testing.assert_array_equal(value, want)


KINDS = {
    # A split read once, in order: its last step is completed with padding rows.
    "split": (lambda: splits()["a"], {"num_epochs": 1, "shuffle": False}, ("0",)),
    "bins": (lambda: splits()["b"], {"num_epochs": 1, "shuffle": False, "packing": "bins"}, ("0",)),
    "mixture": (lambda: mixture({"a": 1, "b": 2, "c": 1}), {}, ("a", "b", "c")),
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", list(KINDS))
def test_source_is_each_rows_component_on_every_path(kind: str, layout: str) -> None:
    make, extra, names = KINDS[kind]
    source = make()
    cfg = ftj.LoaderConfig(8, L, layout=layout, max_segments=L, source_field=True, **extra)
    host = ftj.Loader(source, cfg)
    assert host.source_names == names
    steps = range(host.num_batches or 4)
    want = {s: wanted(host.provenance(s), names) for s in steps}
    seen = np.concatenate(list(want.values()))
    if kind == "mixture":
        assert set(seen.tolist()) == {0, 1, 2}
    else:  # an evaluation pass's padded last step
        assert (want[steps[-1]] == -1).any() and (seen == 0).any()
    for s in steps:
        check_source(host.host_batch(s)["source"], want[s])
    for s, local in zip(steps, host.to_grain(), strict=kind != "mixture"):
        check_source(local["source"], want[s])
    sharding = NamedSharding(mesh("data4_fsdp2"), P("data"))
    by_rows = NamedSharding(sharding.mesh, P("data"))
    for decode in ("host", "device"):
        loader = ftj.Loader(source, dataclasses.replace(cfg, decode=decode), sharding)
        for s, batch in loader.iterate(0, len(steps)):
            assert batch["source"].sharding.is_equivalent_to(by_rows, 1), decode
            check_source(batch["source"], want[s])
        if decode == "device":  # a trainer's own jitted decode holds it too
            decoded = jax.jit(loader.decoder(0))(loader.encoded_batch(0))
            check_source(decoded["source"], want[0])


@pytest.mark.parametrize("decode", ["host", "device"])
@pytest.mark.parametrize(("mesh_name", "spec"), CASES)
def test_every_sharding_lays_source_out_over_its_batch_axis(
    mesh_name: str, spec: P, decode: str
) -> None:
    sharding = NamedSharding(mesh(mesh_name), spec)
    cfg = ftj.LoaderConfig(8, L, source_field=True, decode=decode, layout="tokens")
    loader = ftj.Loader(mixture({"a": 1, "c": 1}), cfg, sharding)
    by_rows = NamedSharding(sharding.mesh, P((*tuple(spec), None)[0]))
    for s in range(3):
        batch = loader.batch(s)
        assert batch["source"].sharding.is_equivalent_to(by_rows, 1)
        check_source(batch["source"], wanted(loader.provenance(s), ("a", "c")))


@pytest.mark.parametrize("decode", ["host", "device"])
def test_rows_the_instance_filter_rejects_keep_their_source(decode: str) -> None:
    """The filter clears a row's loss mask and nothing else: the row was
    still read from its component, so its source stays (``per_source`` counts
    none of its tokens, through the mask)."""
    cfg = ftj.LoaderConfig(
        8, L, source_field=True, instance_filter=RULE, decode=decode, seed=1, prefetch=0
    )
    loader = ftj.Loader(mixture({"rep": 3, "a": 1}), cfg)
    rejected = 0
    for s in range(4):
        batch = {k: np.asarray(v) for k, v in loader.batch(s).items()}
        want = wanted(loader.provenance(s), ("rep", "a"))
        check_source(batch["source"], want)
        cleared = ~batch["loss_mask"].any(axis=1)
        assert (want[cleared] == 0).all()  # only rep's rows repeat a token
        rejected += int(cleared.sum())
        _, counts = ftj.per_source(np.ones((8, L)), batch, 2)
        assert counts.tolist() == [int(batch["loss_mask"][want == c].sum()) for c in (0, 1)]
    assert rejected > 0


def phases(decode: str = "host", field: bool = True) -> list[ftj.Phase]:
    """Three phases: b and a; then c (new), a and b (another order); then a alone."""
    s = splits()
    cfg = ftj.LoaderConfig(8, L, seed=3, source_field=field, decode=decode, prefetch=2)
    return [
        ftj.Phase(0, ftj.Mixture({"b": (s["b"], 1), "a": (s["a"], 1)}), cfg),
        ftj.Phase(3, ftj.Mixture({"c": (s["c"], 1), "a": (s["a"], 2), "b": (s["b"], 1)}), cfg),
        ftj.Phase(6, ftj.Mixture({"a": (s["a"], 1)}), cfg),
    ]


def test_a_run_in_phases_numbers_its_sources_by_name_on_every_path() -> None:
    names = ("b", "a", "c")  # in the order they first appear
    run = ftj.PhasedLoader(phases())
    assert run.source_names == names
    assert all(loader.source_names == names for loader in run.engines)
    want = {s: wanted(run.provenance(s), names) for s in range(8)}
    # a keeps its id 1 in every phase; c, new in phase 1, gets the next one.
    assert {int(x) for s in (0, 1, 2) for x in want[s]} == {0, 1}
    assert {int(x) for s in (3, 4, 5) for x in want[s]} == {0, 1, 2}
    assert {int(x) for s in (6, 7) for x in want[s]} == {1}
    for s in range(8):
        check_source(run.host_batch(s)["source"], want[s])
        check_source(run.batch(s)["source"], want[s])
    for s, local in zip(range(8), run.to_grain(), strict=False):
        check_source(local["source"], want[s])
    device = ftj.PhasedLoader(phases("device"))
    for s, batch in device.iterate(0):
        check_source(batch["source"], want[s])
        if s == 7:
            break
    tokens = device.stats()["source_tokens"]  # the run's steps handed out: 0 to 7
    rows = np.concatenate([want[s] for s in range(8)])
    assert tokens == {n: int((rows == c).sum()) * L for c, n in enumerate(names)}


@settings(max_examples=15)
@given(
    chosen=st.lists(st.sampled_from("abc"), min_size=1, max_size=3, unique=True),
    weights=st.lists(st.integers(1, 5), min_size=3, max_size=3),
    batch=st.integers(1, 6),
    seq_len=st.integers(2, 10),
    packing=st.sampled_from([True, False, "bins"]),
    seed=st.integers(0, 2**32 - 1),
)
def test_small_mixtures_on_host_and_grain(
    chosen: list[str],
    weights: list[int],
    batch: int,
    seq_len: int,
    packing: bool | str,
    seed: int,
) -> None:
    mix = mixture(dict(zip(chosen, weights, strict=False)))
    cfg = ftj.LoaderConfig(batch, seq_len, packing, seed=seed, source_field=True, prefetch=0)
    loader = ftj.Loader(mix, cfg)
    assert loader.source_names == tuple(chosen)
    steps = list(itertools.islice(loader.to_grain(), 4))
    want = [wanted(loader.provenance(s), chosen) for s in range(4)]
    for s in range(4):
        check_source(loader.host_batch(s)["source"], want[s])
        check_source(steps[s]["source"], want[s])
    for _ in loader.iterate(0, 4):
        pass
    rows = np.concatenate(want)
    # The loader's one read-ahead counts every step it handed out: 4 through
    # to_grain, the same 4 through iterate.
    counted = {n: 2 * int((rows == c).sum()) * seq_len for c, n in enumerate(chosen)}
    assert loader.stats()["source_tokens"] == counted


def brute_per_source(
    values: np.ndarray, source: np.ndarray, weights: np.ndarray, num_sources: int
) -> tuple[list[float], list[float]]:
    sums, counts = [0.0] * num_sources, [0.0] * num_sources
    for i in range(values.shape[0]):
        for j in range(values.shape[1]):
            if 0 <= source[i] < num_sources:
                sums[source[i]] += float(values[i, j]) * float(weights[i, j])
                counts[source[i]] += float(weights[i, j])
    return sums, counts


@settings(max_examples=40)
@given(data=st.data())
def test_per_source_equals_a_loop_over_rows_and_tokens(data: st.DataObject) -> None:
    b, length, n = (
        data.draw(st.integers(1, 6)),
        data.draw(st.integers(1, 5)),
        data.draw(st.integers(1, 4)),
    )
    source = np.array(data.draw(st.lists(st.integers(-1, n - 1), min_size=b, max_size=b)), np.int32)
    # Small integers: every sum is exact in float32, whatever its order.
    ints = st.lists(st.integers(-50, 50), min_size=b * length, max_size=b * length)
    values = np.array(data.draw(ints), np.float32).reshape(b, length)
    bools = st.lists(st.booleans(), min_size=b * length, max_size=b * length)
    mask = np.array(data.draw(bools)).reshape(b, length)
    want_sums, want_counts = brute_per_source(values, source, mask, n)
    run = jax.jit(ftj.per_source, static_argnums=2)
    sums, counts = run(values, {"source": source, "loss_mask": mask}, n)
    assert sums.dtype == jnp.float32 and counts.dtype == jnp.int32
    assert sums.shape == counts.shape == (n,)
    assert sums.tolist() == want_sums and counts.tolist() == want_counts
    # MaxText's layout: a token counts where targets_segmentation is not 0.
    segments = mask * np.array(data.draw(ints), np.int32).reshape(b, length).clip(1, None)
    maxtext = {"source": source, "targets_segmentation": segments}
    sums, counts = run(values, maxtext, n)
    assert sums.tolist() == want_sums and counts.tolist() == want_counts
    weights = np.array(data.draw(ints), np.float32).reshape(b, length) / 4
    want_sums, want_counts = brute_per_source(values, source, weights, n)
    sums, counts = ftj.per_source(values, {"source": source}, n, weights=weights)
    assert counts.dtype == jnp.float32
    assert sums.tolist() == want_sums and counts.tolist() == want_counts


def test_per_source_refuses_a_concrete_source_it_has_no_bucket_for() -> None:
    """A loader's batch of three sources summed into two would drop the third's
    rows (issue 46): refused, naming the largest source id and the
    num_sources that holds it, for the batch as numpy and as a jax.Array."""
    cfg = ftj.LoaderConfig(32, L, source_field=True, seed=2)
    loader = ftj.Loader(mixture({"a": 1, "b": 1, "c": 2}), cfg)
    host = loader.host_batch(0)
    largest = int(np.max(wanted(loader.provenance(0), ("a", "b", "c"))))
    assert largest == 2  # the seed's batch holds the third source
    for batch in (host, loader.batch(0)):
        for n in (1, 2):
            with pytest.raises(
                ValueError,
                match=rf"^batch\['source'\] holds source 2, but num_sources is {n}: .* "
                r"num_sources=len\(loader.source_names\) \(at least 3\)$",
            ):
                ftj.per_source(np.ones((32, L)), batch, n)
    with pytest.raises(ValueError, match=r"^batch\['source'\] holds -2, which is no source: "):
        ftj.per_source(
            np.ones((2, L)), {"source": np.array([0, -2]), "loss_mask": host["loss_mask"][:2]}, 3
        )


@settings(max_examples=40)
@given(data=st.data())
def test_per_source_sums_are_nan_under_jit_where_a_row_has_no_bucket(data: st.DataObject) -> None:
    """Under jax.jit the ids are known only when the step runs: any row whose
    source is below -1 or num_sources and above makes every sum NaN, and the
    counts are the loop's over the other rows; eagerly the same batch is refused."""
    b, length, n = (
        data.draw(st.integers(1, 6)),
        data.draw(st.integers(1, 5)),
        data.draw(st.integers(1, 4)),
    )
    source = np.array(data.draw(st.lists(st.integers(-3, n + 2), min_size=b, max_size=b)), np.int32)
    ints = st.lists(st.integers(-50, 50), min_size=b * length, max_size=b * length)
    values = np.array(data.draw(ints), np.float32).reshape(b, length)
    bools = st.lists(st.booleans(), min_size=b * length, max_size=b * length)
    mask = np.array(data.draw(bools)).reshape(b, length)
    batch = {"source": source, "loss_mask": mask}
    want_sums, want_counts = brute_per_source(values, source, mask, n)
    stray = any(not -1 <= int(s) < n for s in source)
    sums, counts = jax.jit(ftj.per_source, static_argnums=2)(values, batch, n)
    assert sums.shape == counts.shape == (n,)
    assert counts.tolist() == want_counts
    if stray:
        assert all(np.isnan(x) for x in sums.tolist())
        with pytest.raises(ValueError, match=r"^batch\['source'\] holds "):
            ftj.per_source(values, batch, n)
    else:
        assert sums.tolist() == want_sums
        assert ftj.per_source(values, batch, n)[0].tolist() == want_sums


def test_per_source_under_jit_with_debug_nans_raises_the_refusal() -> None:
    """jax_debug_nans reruns a step whose output holds a NaN without jit,
    where the ids are concrete: the refusal names the id and the fix."""
    step = jax.jit(ftj.per_source, static_argnums=2)
    batch = {"source": np.array([0, 2, -1]), "loss_mask": np.ones((3, 2), bool)}
    with jax.debug_nans(True):
        assert step(np.ones((3, 2)), batch, 3)[1].tolist() == [2, 0, 2]
        with pytest.raises(ValueError, match=r"holds source 2, but num_sources is 2: .*at least 3"):
            step(np.ones((3, 2)), batch, 2)


def test_per_source_of_a_sharded_batch_in_a_training_step() -> None:
    """Per-source sums of a loss-like value over a batch sharded on 8
    devices, inside the jitted step, equal the loop over the host batch."""
    sharding = NamedSharding(mesh("data4_fsdp2"), P(("data", "fsdp")))
    cfg = ftj.LoaderConfig(16, L, source_field=True, seed=5)
    loader = ftj.Loader(mixture({"a": 1, "b": 1, "c": 2}), cfg, sharding)
    n = len(loader.source_names)

    @jax.jit
    def step(batch: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
        loss = (batch["targets"] % 7).astype(jnp.float32)  # a stand-in for a per-token loss
        return ftj.per_source(loss, batch, n)

    for s, batch in loader.iterate(0, 3):
        host = loader.host_batch(s)
        want = brute_per_source(host["targets"] % 7, host["source"], host["loss_mask"], n)
        sums, counts = step(batch)
        assert (sums.tolist(), counts.tolist()) == want


def test_per_source_refuses_a_batch_it_cannot_read() -> None:
    values = np.zeros((2, 3), np.float32)
    mask = np.ones((2, 3), bool)
    with pytest.raises(ValueError, match=r"holds no source .* LoaderConfig\(source_field=True\)"):
        ftj.per_source(values, {"loss_mask": mask}, 2)
    with pytest.raises(ValueError, match=r"neither loss_mask nor targets_segmentation .* weights="):
        ftj.per_source(values, {"source": np.zeros(2, np.int32)}, 2)
    with pytest.raises(ValueError, match=r"values \(2, 3\), weights \(2, 3\), source \(3,\)"):
        ftj.per_source(values, {"source": np.zeros(3, np.int32), "loss_mask": mask}, 2)
    with pytest.raises(ValueError, match=r"^num_sources must be an int >= 1, got 0"):
        ftj.per_source(values, {"source": np.zeros(2, np.int32), "loss_mask": mask}, 0)


@pytest.mark.parametrize("decode", ["host", "device"])
def test_the_field_changes_no_other_array_nor_the_state(decode: str) -> None:
    mix = mixture({"a": 1, "b": 1})
    kw: dict[str, Any] = dict(batch_size=8, seq_len=L, decode=decode, layout="tokens")
    off = ftj.Loader(mix, ftj.LoaderConfig(**kw))
    on = ftj.Loader(mix, ftj.LoaderConfig(**kw, source_field=True))
    for s in range(3):
        for a, b in ((off.batch(s), on.batch(s)), (off.host_batch(s), on.host_batch(s))):
            assert set(b) == {*a, "source"}
            for key in a:
                np.testing.assert_array_equal(np.asarray(a[key]), np.asarray(b[key]), key)
    if decode == "device":
        a, b = off.encoded_batch(1), on.encoded_batch(1)
        assert set(b) == {*a, "source"}
        for key in a:
            np.testing.assert_array_equal(np.asarray(a[key]), np.asarray(b[key]), key)
    assert on.fingerprint() == off.fingerprint()
    assert on.state(3) == off.state(3)
    saved = json.loads(json.dumps(off.state(3)))  # a run saved without the field
    assert on.restore(saved) == 3
    run_off, run_on = ftj.PhasedLoader(phases(field=False)), ftj.PhasedLoader(phases())
    assert run_on.fingerprint() == run_off.fingerprint()
    assert run_on.state(5) == run_off.state(5)
    assert run_on.restore(json.loads(json.dumps(run_off.state(5)))) == 5


@pytest.mark.parametrize("bad", ["yes", 1, 0, None])
def test_a_bad_source_field_is_refused_naming_it(bad: Any, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"^LoaderConfig.source_field must be True or False"):
        ftj.LoaderConfig(4, L, source_field=bad)
    with pytest.raises(
        ValueError, match=rf"^loader.source_field must be True or False, got {bad!r}"
    ):
        ftj.LoaderConfig.from_dict({"batch_size": 4, "seq_len": L, "source_field": bad}, "loader")
    with pytest.raises(ValueError, match=rf"^source_field must be True or False, got {bad!r}"):
        FlatTokensSource(splits()["a"], L, source_field=bad)


def test_yaml_turns_the_field_on_and_refuses_a_number(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("loader:\n  batch_size: 4\n  seq_len: 8\n  source_field: true\n")
    assert ftj.LoaderConfig.from_yaml(path).source_field is True
    path.write_text("loader:\n  batch_size: 4\n  seq_len: 8\n  source_field: 1\n")
    with pytest.raises(ValueError, match=r"run.yaml: loader.source_field must be True or False"):
        ftj.LoaderConfig.from_yaml(path)


@pytest.mark.parametrize("door", ["iterate", "device", "grain"])
def test_stats_count_each_sources_tokens_handed_out(door: str) -> None:
    """Counted whether or not batches hold the field, decoded anywhere;
    padding rows count nowhere and ``host_batch`` is not counted."""
    mix = mixture({"a": 1, "b": 3})
    decode = "device" if door == "device" else "host"
    loader = ftj.Loader(mix, ftj.LoaderConfig(8, L, decode=decode, prefetch=2))
    if door == "grain":
        for _ in zip(range(5), loader.to_grain(), strict=False):
            pass
    else:
        for _ in loader.iterate(0, 5):
            pass
    loader.host_batch(7)
    rows = np.concatenate([wanted(loader.provenance(s), ("a", "b")) for s in range(5)])
    stats = loader.stats()
    assert stats["source_tokens"] == {
        "a": int((rows == 0).sum()) * L,
        "b": int((rows == 1).sum()) * L,
    }
    assert sum(stats["source_tokens"].values()) == stats["tokens"] == 5 * 8 * L
    split = splits()["a"]
    once = ftj.Loader(split, ftj.LoaderConfig(8, L, num_epochs=1, shuffle=False, decode=decode))
    for _ in once.iterate():
        pass
    real = sum(
        int((wanted(once.provenance(s), ("0",)) == 0).sum()) for s in range(once.num_batches)
    )
    assert real < once.num_batches * 8  # the last step is padded
    assert once.stats()["source_tokens"] == {"0": real * L}


def test_flat_tokens_source_of_a_split_holds_source_zero() -> None:
    src = FlatTokensSource(splits()["a"], L, source_field=True, layout="maxtext")
    assert src.source_names == ("0",)
    check_source(src.read_batch([3, 0, 1])["source"], np.zeros(3, np.int32))
    assert src[2]["source"] == 0 and src[2]["inputs"].shape == (L,)
    assert "source_field=True" in repr(src)
    cfg = ftj.LoaderConfig(4, L, shuffle=False, source_field=True, layout="maxtext")
    loader = ftj.Loader(splits()["a"], cfg)
    for s in range(len(src) // 4):
        want, got = loader.host_batch(s), src.read_batch(np.arange(4 * s, 4 * s + 4))
        assert set(got) == set(want)
        for key in want:
            np.testing.assert_array_equal(got[key], want[key], key)
