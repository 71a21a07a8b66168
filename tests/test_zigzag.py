"""The zigzag order of context parallelism (issue 48, item 1).

``LoaderConfig(context_parallel=C)`` lays every ``[B, L]`` field out in
``ftj.zigzag_order``: checked here against a brute-force construction of the
order, and each batch against the same loader's with ``context_parallel=1``,
its ``[B, L]`` fields taken in the order built here (per-row fields equal), for
every packing, layout, decode path, ``to_grain()``, phases and a sharding
that splits the sequence axis; then the refusals, the fingerprint and restore.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
from typing import Any

import jax
import numpy as np
import pytest
from commands import run_main
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from memurls import memory_url

import flat_tokens_jax as ftj
from flat_tokens_jax.grain.grain import FlatTokensSource

PER_ROW = ("segment_lengths", "source")
PACKINGS = (True, False, "bins")


def brute_order(seq_len: int, c: int) -> list[int]:
    """Columns ``0..seq_len-1`` cut into ``2c`` chunks, taken as chunk 0,
    chunk ``2c-1``, chunk 1, chunk ``2c-2``, ... (rank ``i``: chunks ``i`` and ``2c-1-i``)."""
    width = seq_len // (2 * c)
    chunks = [list(range(k * width, (k + 1) * width)) for k in range(2 * c)]
    out: list[int] = []
    for rank in range(c):
        out += chunks[rank] + chunks[2 * c - 1 - rank]
    return out


@settings(max_examples=60)
@given(c=st.integers(1, 8), width=st.integers(1, 12))
def test_the_order_is_chunk_i_then_chunk_2c_minus_1_minus_i_for_each_rank(
    c: int, width: int
) -> None:
    seq_len = 2 * c * width
    order = ftj.zigzag_order(seq_len, c)
    assert order.dtype == np.int64 and order.shape == (seq_len,)
    assert order.tolist() == brute_order(seq_len, c)
    for rank, part in enumerate(np.split(order, c)):  # a contiguous split over c ranks
        assert sorted(part.tolist()) == [
            *range(rank * width, (rank + 1) * width),
            *range((2 * c - 1 - rank) * width, (2 * c - rank) * width),
        ]


@settings(max_examples=30)
@given(c=st.integers(2, 8), seq_len=st.integers(1, 200))
def test_an_order_of_unequal_chunks_is_refused_naming_both(c: int, seq_len: int) -> None:
    if seq_len % (2 * c) == 0:
        assert len(ftj.zigzag_order(seq_len, c)) == seq_len
        return
    with pytest.raises(ValueError, match=rf"is {c}: it splits a row into {2 * c} equal chunks, "):
        ftj.zigzag_order(seq_len, c)
    with pytest.raises(ValueError, match=rf"but seq_len {seq_len} is not a multiple of {2 * c}"):
        ftj.LoaderConfig(4, seq_len, context_parallel=c)


@given(seq_len=st.integers(1, 200))
def test_one_rank_keeps_the_order_of_any_row_and_a_loader_of_odd_rows_reads(seq_len: int) -> None:
    assert ftj.zigzag_order(seq_len, 1).tolist() == list(range(seq_len))
    if seq_len % 2:
        loader = ftj.Loader(split(), ftj.LoaderConfig(2, seq_len, packing=False))
        batch = loader.host_batch(0)
        assert batch["targets"].shape == (2, seq_len)


@functools.cache
def split(name: str = "a") -> ftj.FlatTokens:
    rng = np.random.default_rng(48 + ord(name))
    seqs = [rng.integers(1, 999, int(rng.integers(1, 30))).tolist() for _ in range(60)]
    url = memory_url(f"zigzag-{name}")
    fmt = ftj.StorageFormat(shard_tokens=256, chunk_tokens=16)
    ftj.write_dataset(url, {"train": seqs}, storage_format=fmt)
    return ftj.open_dataset(url)["train"]


def numpy(batch: dict[str, Any]) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in batch.items()}


def check_zigzagged(cp: dict[str, Any], plain: dict[str, Any], order: list[int]) -> None:
    """Every field of ``cp`` is ``plain``'s, ``[B, L]`` ones in ``order``."""
    cp, plain = numpy(cp), numpy(plain)
    assert set(cp) == set(plain)
    for key, value in plain.items():
        want = value if key in PER_ROW else value[:, order]
        assert cp[key].dtype == want.dtype, key
        np.testing.assert_array_equal(cp[key], want, key)


def loaders(c: int, **kw: Any) -> tuple[ftj.Loader, ftj.Loader]:
    """The same run with ``context_parallel=c`` and without."""
    cfg = ftj.LoaderConfig(context_parallel=c, **kw)
    plain = dataclasses.replace(cfg, context_parallel=1)
    return ftj.Loader(split(), cfg), ftj.Loader(split(), plain)


@pytest.mark.parametrize("layout", ["fields", "segments", "maxtext"])
@pytest.mark.parametrize("packing", PACKINGS)
def test_every_field_moves_with_its_token_on_every_path(packing: Any, layout: str) -> None:
    c, seq_len = 2, 12
    order = brute_order(seq_len, c)
    kw = dict(batch_size=8, seq_len=seq_len, packing=packing, layout=layout, seed=4, prefetch=1)
    cp, plain = loaders(c, **kw)
    moved = 0
    for s in range(3):
        want = plain.host_batch(s)
        check_zigzagged(cp.host_batch(s), want, order)
        targets = want["targets"]
        moved += int((targets[:, order] != targets).any())
    assert moved  # the order changed some row: the test can fail
    for s, (a, b) in enumerate(zip(cp.to_grain(), plain.to_grain(), strict=False)):
        check_zigzagged(a, b, order)
        if s == 2:
            break
    for decode in ("host", "device"):
        cp, plain = loaders(c, decode=decode, **kw)
        for (s, a), (t, b) in zip(cp.iterate(0, 3), plain.iterate(0, 3), strict=True):
            assert s == t
            check_zigzagged(a, b, order)
        if decode == "device":
            decoded = jax.jit(cp.decoder(1))(cp.encoded_batch(1))
            check_zigzagged(decoded, plain.host_batch(1), order)


@pytest.mark.parametrize("decode", ["host", "device"])
def test_per_row_fields_stay_and_three_ranks_hold(decode: str) -> None:
    c, seq_len = 3, 12
    order = brute_order(seq_len, c)
    kw = dict(batch_size=6, seq_len=seq_len, max_segments=seq_len, source_field=True)
    cp, plain = loaders(c, packing="bins", sequence_start=True, decode=decode, **kw)
    for s in range(3):
        a, b = cp.batch(s), plain.batch(s)
        assert set(a) >= {"segment_lengths", "source", "sequence_start"}
        check_zigzagged(a, b, order)


def test_a_source_of_records_follows() -> None:
    c, seq_len = 2, 8
    order = brute_order(seq_len, c)
    kw: dict[str, Any] = dict(seq_len=seq_len, packing=True, layout="segments", max_segments=8)
    cp = FlatTokensSource(split(), context_parallel=c, **kw)
    plain = FlatTokensSource(split(), **kw)
    assert "context_parallel=2" in repr(cp) and "context_parallel" not in repr(plain)
    for i in range(5):
        a, b = cp[i], plain[i]
        for key, value in b.items():
            np.testing.assert_array_equal(a[key], value if key in PER_ROW else value[order], key)
    with pytest.raises(ValueError, match=r"^context_parallel is 3: .*seq_len 8 is not a multiple"):
        FlatTokensSource(split(), context_parallel=3, **kw)


def phases(c: int, decode: str = "host") -> list[ftj.Phase]:
    cfg = ftj.LoaderConfig(8, 8, seed=2, context_parallel=c, decode=decode, prefetch=1)
    bins = dataclasses.replace(cfg, packing="bins", layout="maxtext")
    mix = ftj.Mixture({"a": (split("a"), 1), "b": (split("b"), 2)})
    return [ftj.Phase(0, split("a"), cfg), ftj.Phase(2, mix, bins)]


@pytest.mark.parametrize("decode", ["host", "device"])
def test_a_run_in_two_phases(decode: str) -> None:
    order = brute_order(8, 2)
    cp, plain = ftj.PhasedLoader(phases(2, decode)), ftj.PhasedLoader(phases(1, decode))
    for s in range(4):
        check_zigzagged(cp.host_batch(s), plain.host_batch(s), order)
        check_zigzagged(cp.batch(s), plain.batch(s), order)
    for s, (a, b) in enumerate(zip(cp.to_grain(), plain.to_grain(), strict=False)):
        check_zigzagged(a, b, order)
        if s == 3:
            break


@pytest.mark.parametrize("auto", [False, True])
@pytest.mark.parametrize("decode", ["host", "device"])
@pytest.mark.parametrize("packing", PACKINGS)
def test_sequence_sharded_global_arrays_are_the_zigzagged_host_batch(
    packing: Any, decode: str, auto: bool
) -> None:
    kind = jax.sharding.AxisType.Auto if auto else jax.sharding.AxisType.Explicit
    mesh = jax.make_mesh((2, 4), ("data", "context"), axis_types=(kind, kind))
    sharding = NamedSharding(mesh, P("data", "context"))
    c, seq_len = 4, 16
    order = brute_order(seq_len, c)
    cfg = ftj.LoaderConfig(
        8, seq_len, packing, context_parallel=c, decode=decode, layout="segments", max_segments=16
    )
    loader = ftj.Loader(split(), cfg, sharding)
    plain = ftj.Loader(split(), dataclasses.replace(cfg, context_parallel=1))
    for s, batch in loader.iterate(0, 3):
        host = loader.host_batch(s)
        check_zigzagged(host, plain.host_batch(s), order)
        assert set(batch) == set(host)
        for key, value in batch.items():
            np.testing.assert_array_equal(np.asarray(value), host[key], key)
        assert batch["positions"].sharding.is_equivalent_to(sharding, 2)


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (0, r"^LoaderConfig.context_parallel must be an int >= 1, got 0"),
        (True, r"^LoaderConfig.context_parallel must be an int"),
        ("2", r"^LoaderConfig.context_parallel must be an int"),
        (2.0, r"^LoaderConfig.context_parallel must be an int"),
    ],
)
def test_a_bad_context_parallel_is_refused_naming_it(bad: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ftj.LoaderConfig(4, 16, context_parallel=bad)


def test_refusals_name_both_values() -> None:
    with pytest.raises(
        ValueError,
        match=r"^LoaderConfig.context_parallel is 3: it splits a row into 6 equal chunks, "
        r"but seq_len 1000 is not a multiple of 6; set seq_len to a multiple of 6$",
    ):
        ftj.LoaderConfig(4, 1000, context_parallel=3)
    with pytest.raises(
        ValueError, match=r"^LoaderConfig.context_parallel is 2, but layout is 'tokens': "
    ):
        ftj.LoaderConfig(4, 16, context_parallel=2, layout="tokens")
    assert ftj.LoaderConfig(4, 1000, layout="tokens", context_parallel=1).context_parallel == 1
    with pytest.raises(ValueError, match=r"^loader.context_parallel is 3: .* seq_len 8 "):
        ftj.LoaderConfig.from_dict({"batch_size": 4, "seq_len": 8, "context_parallel": 3}, "loader")


def test_the_fingerprint_holds_it_only_when_on_and_a_restore_under_another_is_refused() -> None:
    kw = dict(batch_size=8, seq_len=8, seed=1)
    on, off = loaders(2, **kw)
    assert "context_parallel" not in off.fingerprint()["config"]
    assert ftj.LoaderConfig(**kw).batch_defining() == off.config.batch_defining()
    assert on.fingerprint()["config"]["context_parallel"] == 2
    other = ftj.Loader(split(), ftj.LoaderConfig(context_parallel=4, **kw))
    for saved, loader, was, now in (
        (off.state(3), on, 1, 2),
        (on.state(3), off, 2, 1),
        (on.state(3), other, 2, 4),
    ):
        with pytest.raises(ftj.StateMismatch) as refused:
            loader.restore(json.loads(json.dumps(saved)))
        assert f"fingerprint.config.context_parallel: saved {was}, now {now}" in str(refused.value)
    same = ftj.Loader(split(), ftj.LoaderConfig(context_parallel=2, **kw))
    assert same.restore(json.loads(json.dumps(on.state(3)))) == 3
    check_zigzagged(same.host_batch(3), off.host_batch(3), brute_order(8, 2))
    run_on, run_off = ftj.PhasedLoader(phases(2)), ftj.PhasedLoader(phases(1))
    with pytest.raises(ftj.StateMismatch, match=r"context_parallel: saved 1, now 2"):
        run_on.restore(json.loads(json.dumps(run_off.state(3))))
    assert run_on.restore(json.loads(json.dumps(run_on.state(3)))) == 3


def test_a_saved_state_with_a_bad_value_is_refused_naming_its_path() -> None:
    on, _ = loaders(2, batch_size=8, seq_len=8)
    saved = json.loads(json.dumps(on.state(1)))
    saved["fingerprint"]["config"]["context_parallel"] = 0
    with pytest.raises(ftj.StateMismatch, match=r"fingerprint.config.context_parallel"):
        on.restore(saved)


def test_positions_and_segments_still_say_which_tokens_attend() -> None:
    """A segment-and-position mask over the zigzag batch picks the same
    (query, key) token pairs as the causal same-segment mask of the plain one."""
    order = np.array(brute_order(16, 2))
    cp, plain = loaders(2, batch_size=4, seq_len=16, packing=True, seed=9)
    a, b = cp.host_batch(0), plain.host_batch(0)
    for row in range(4):
        seg, pos = a["segment_ids"][row], a["positions"][row]
        mask = (seg[:, None] == seg[None, :]) & (seg[:, None] != 0) & (pos[None] <= pos[:, None])
        pairs = {(int(order[q]), int(order[k])) for q, k in itertools.product(range(16), repeat=2)}
        got = {p for p in pairs if mask[list(order).index(p[0]), list(order).index(p[1])]}
        s = b["segment_ids"][row]
        want = {(q, k) for q, k in pairs if s[q] == s[k] != 0 and k <= q}
        assert got == want


def test_show_prints_the_stored_order_and_the_filter_reads_it(tmp_path: Any) -> None:
    """``flat-tokens show`` of a run with ``context_parallel`` prints its rows
    as the plain run's (text reads as written), and the instance filter's
    rejections it reports are the plain run's."""
    url = memory_url("zigzag-show")
    rng = np.random.default_rng(5)
    seqs = [[7] * 40, *(rng.integers(1, 99, 20).tolist() for _ in range(6)), [9] * 30]
    ftj.write_dataset(url, {"train": seqs})
    rule = ftj.InstanceFilter(max_period=3, max_count=4)
    shown = []
    for c in (1, 2):
        cfg = ftj.LoaderConfig(4, 16, shuffle=False, instance_filter=rule, context_parallel=c)
        loader = ftj.Loader(ftj.open_dataset(url)["train"], cfg)
        (tmp_path / f"{c}.json").write_text(json.dumps(loader.state()))
        code, out, err = run_main(
            "show", "--state", str(tmp_path / f"{c}.json"), "--step", "0", "--json"
        )
        assert code == 0, err
        shown.append(json.loads(out))
    assert shown[1]["config"]["context_parallel"] == 2
    assert shown[1]["rows"] == shown[0]["rows"]
    assert any(r.get("filtered") for r in shown[0]["rows"])
    assert not all(r.get("filtered") for r in shown[0]["rows"])
