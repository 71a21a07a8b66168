"""Balanced rows (``LoaderConfig.balance_groups``): a row's segments from
sequence boundaries alone, equal to the runs of its decoded segment ids; the
order of a step's rows, a permutation under which no swap lowers the costliest
group; balanced batches hold the plain batch's rows in that order; the refusals."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import flat_tokens_jax as ftj
from flat_tokens_jax.data.records import Windows
from flat_tokens_jax.decoding.batch import window_fields
from flat_tokens_jax.sampling.balance import TOLERANCE, balanced_rows


def run_costs(segment_ids: np.ndarray) -> np.ndarray:
    """Each row's sum of squared run lengths of one nonzero segment id, by a loop."""
    out = []
    for row in segment_ids.tolist():
        total = 0
        for value, run in itertools.groupby(row):
            if value:
                total += len(list(run)) ** 2
        out.append(total)
    return np.array(out, np.int64)


def lognormal_store(path: Path, tokens: int, mean: int, seed: int = 0) -> ftj.FlatTokens:
    rng = np.random.default_rng(seed)
    lengths = np.maximum(1, rng.lognormal(np.log(mean) - 0.5, 1.0, 4 * tokens // mean))
    lengths = lengths.astype(np.int64)[: int(np.searchsorted(np.cumsum(lengths), tokens)) + 1]
    ftj.write_dataset(path, {"train": [rng.integers(1, 50_000, n) for n in lengths]})
    return ftj.open_dataset(path)["train"]


@pytest.fixture(scope="module")
def split(tmp_path_factory: pytest.TempPathFactory) -> ftj.FlatTokens:
    return lognormal_store(tmp_path_factory.mktemp("balance") / "ds", 300_000, 300)


def test_starts_inside_are_the_seq_starts_strictly_inside_each_range(
    split: ftj.FlatTokens,
) -> None:
    starts = np.asarray(
        ftj.open_dataset(split.url)["train"]
        .checked["seq_starts"]
        .reader.read_ranges(np.array([0]), np.array([split.num_sequences + 1]))[0],
        np.int64,
    )
    rng = np.random.default_rng(1)
    for ft, offsets in ((split, starts), (split.view(40, 700), starts[40:701] - starts[40])):
        lo = rng.integers(0, ft.num_tokens, 400)
        hi = np.minimum(lo + rng.integers(1, 3000, 400), ft.num_tokens)
        row, found = ft.starts_inside(lo, hi)
        for i in range(lo.size):
            inside = offsets[(offsets > lo[i]) & (offsets < hi[i])]
            assert found[row == i].tolist() == inside.tolist()


@pytest.mark.parametrize("packing", ["windows", "padded", "bins"])
def test_segments_are_the_runs_of_the_decoded_segment_ids(
    split: ftj.FlatTokens, packing: str
) -> None:
    value = {"windows": True, "padded": False, "bins": "bins"}[packing]
    loader = ftj.Loader(split, ftj.LoaderConfig(batch_size=32, seq_len=512, packing=value))
    records = loader.components[0]
    indices = np.arange(0, len(records), max(1, len(records) // 64))
    row, length = records.segments(indices)
    costs = np.zeros(indices.size, np.int64)
    np.add.at(costs, row, length**2)
    windows = records.read(indices)
    fields = window_fields(windows, records.packing)
    assert costs.tolist() == run_costs(fields["segment_ids"]).tolist()


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(0, 10**6), min_size=1, max_size=48),
    st.integers(1, 8),
)
def test_balanced_rows_are_a_permutation_no_swap_lowers_the_costliest_group(
    values: list[int], groups: int
) -> None:
    n = len(values) - len(values) % groups
    if n == 0:
        return
    costs = np.array(values[:n], np.int64)
    order = balanced_rows(costs, groups)
    assert sorted(order.tolist()) == list(range(n))
    loads = costs[order].reshape(groups, -1).sum(axis=1)
    in_order = costs.reshape(groups, -1).sum(axis=1)
    assert loads.max() <= in_order.max(), "never worse than the rows' own order"
    for part in order.reshape(groups, -1):
        assert part.tolist() == sorted(part.tolist())
    if np.array_equal(order, np.arange(n)) or loads.max() <= loads.sum() / groups * (1 + TOLERANCE):
        return
    top = int(np.argmax(loads))
    mine = costs[order.reshape(groups, -1)[top]]
    for g in range(groups):
        if g == top:
            continue
        theirs = costs[order.reshape(groups, -1)[g]]
        for a, b in itertools.product(mine.tolist(), theirs.tolist()):
            d = a - b
            assert max(loads[top] - d, loads[g] + d) >= loads[top], "a swap would lower it"


@pytest.mark.parametrize("packing", [True, False, "bins"])
def test_balanced_batches_are_the_plain_rows_in_balanced_order(
    split: ftj.FlatTokens, packing: bool | str
) -> None:
    plain = ftj.LoaderConfig(batch_size=16, seq_len=512, packing=packing, seed=4)
    balanced = ftj.LoaderConfig(**{**plain.__dict__, "balance_groups": 4})
    a, b = ftj.Loader(split, plain), ftj.Loader(split, balanced)
    moved = 0
    for step in range(4):
        x, y = a.host_batch(step), b.host_batch(step)
        order = balanced_rows(run_costs(x["segment_ids"]), 4)
        moved += not np.array_equal(order, np.arange(16))
        for key in x:
            np.testing.assert_array_equal(y[key], x[key][order], err_msg=f"{key} at {step}")
        before = run_costs(x["segment_ids"]).reshape(4, -1).sum(axis=1)
        after = run_costs(y["segment_ids"]).reshape(4, -1).sum(axis=1)
        assert after.max() <= before.max()
    assert moved, "some step's rows were reordered"
    got = next(iter(b.to_grain().batch(1)))
    np.testing.assert_array_equal(got["inputs"][0], b.host_batch(0)["inputs"])


def test_a_mixture_balances_the_rows_of_both_components(split: ftj.FlatTokens) -> None:
    halves = split.split("1,1")
    mix = ftj.Mixture({"a": (halves[0], 1.0), "b": (halves[1], 1.0)})
    plain = ftj.LoaderConfig(batch_size=16, seq_len=256, seed=2, source_field=True)
    balanced = ftj.LoaderConfig(**{**plain.__dict__, "balance_groups": 8})
    x = ftj.Loader(mix, plain).host_batch(1)
    y = ftj.Loader(mix, balanced).host_batch(1)
    order = balanced_rows(run_costs(x["segment_ids"]), 8)
    assert set(x["source"].tolist()) == {0, 1}
    for key in x:
        np.testing.assert_array_equal(y[key], x[key][order])


def test_the_costliest_group_is_within_five_percent_of_the_mean(tmp_path: Path) -> None:
    """Lognormal documents of mean 3,000 tokens, seq_len 8,192, batch 64, 8 groups."""
    ft = lognormal_store(tmp_path / "ds", 1_600_000, 3000, seed=5)
    for packing in (True, "bins"):
        config = ftj.LoaderConfig(batch_size=64, seq_len=8192, packing=packing, balance_groups=8)
        loader = ftj.Loader(ft, config)
        for step in range(2):
            costs = run_costs(loader.host_batch(step)["segment_ids"])
            loads = costs.reshape(8, -1).sum(axis=1)
            assert loads.max() <= 1.05 * loads.mean(), (packing, step, loads.max() / loads.mean())


def test_balanced_runs_restore_and_keep_their_fingerprint_apart(split: ftj.FlatTokens) -> None:
    config = ftj.LoaderConfig(batch_size=16, seq_len=256, balance_groups=4)
    loader = ftj.Loader(split, config)
    want = [loader.host_batch(step)["inputs"] for step in range(3)]
    it = loader.iterate(0)
    next(it)
    state = loader.state()
    assert json.loads(json.dumps(state))["fingerprint"]["config"]["balance_groups"] == 4
    plain = ftj.Loader(split, ftj.LoaderConfig(batch_size=16, seq_len=256))
    assert "balance_groups" not in plain.state()["fingerprint"]["config"]
    again = ftj.Loader(split, config)
    again.restore(state)
    step, batch = next(again.iterate())
    assert step == 1
    np.testing.assert_array_equal(np.asarray(batch["inputs"]), want[1])
    other = ftj.Loader(split, ftj.LoaderConfig(batch_size=16, seq_len=256, balance_groups=2))
    with pytest.raises(ValueError, match=r"fingerprint.config.balance_groups: saved 4, now 2"):
        other.restore(state)


def test_refusals_name_the_fields(split: ftj.FlatTokens) -> None:
    with pytest.raises(ValueError, match=r"balance_groups is 3, but batch_size 16 does not"):
        ftj.LoaderConfig(batch_size=16, seq_len=8, balance_groups=3)
    with pytest.raises(ValueError, match=r"batch_size 24 \(from step 5\)"):
        ftj.LoaderConfig(batch_size=[(0, 16), (5, 24)], seq_len=8, balance_groups=16)
    with pytest.raises(ValueError, match=r"balance_groups is 2, but shuffle is 'blocks'"):
        ftj.LoaderConfig(batch_size=16, seq_len=8, shuffle="blocks", balance_groups=2)

    class Plain:
        """Records with no segments()."""

        packing = ftj.Packing.WINDOWS
        seq_len = 8

        def __len__(self) -> int:
            return 100

        def read(self, indices: np.ndarray, columns: object = None) -> Windows:
            return Windows(np.zeros((len(indices), 9), np.uint32))

        def token_ranges(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            return indices * 8, indices * 8 + 8

        def fingerprint(self) -> dict[str, object]:
            return {"records": "plain"}

    with pytest.raises(TypeError, match=r"'0'.*has no segments\(indices\)"):
        ftj.Loader(Plain(), ftj.LoaderConfig(batch_size=4, seq_len=8, balance_groups=2))


@pytest.mark.parametrize("decode", ["host", "device"])
def test_sharded_balanced_batches_equal_the_host_batch(split: ftj.FlatTokens, decode: str) -> None:
    """Rows and the sequence sharded over 8 devices: each block read for its
    balanced rows, decoded on the host or the devices."""
    mesh = jax.make_mesh((4, 2), ("data", "seq"), axis_types=(AxisType.Explicit,) * 2)
    config = ftj.LoaderConfig(batch_size=16, seq_len=256, balance_groups=4, decode=decode)
    for spec in (P("data"), P("data", "seq")):
        loader = ftj.Loader(split, config, sharding=NamedSharding(mesh, spec))
        want = loader.host_batch(2)
        got = loader.batch(2)
        for key in want:
            np.testing.assert_array_equal(np.asarray(got[key]), want[key], err_msg=key)


def test_a_saved_balance_groups_out_of_range_is_named(split: ftj.FlatTokens) -> None:
    config = ftj.LoaderConfig(batch_size=16, seq_len=256, balance_groups=4)
    state = ftj.Loader(split, config).state()
    state["fingerprint"]["config"]["balance_groups"] = 0
    with pytest.raises(ValueError, match=r"fingerprint\.config\.balance_groups.*0"):
        ftj.Loader(split, config).restore(state)


def test_the_last_batch_of_a_bounded_run_keeps_its_padding_rows(split: ftj.FlatTokens) -> None:
    """Padding rows past the last epoch cost nothing; balanced, the last
    batch holds the same rows, padding included."""
    plain = ftj.LoaderConfig(batch_size=16, seq_len=2048, num_epochs=1, seed=1)
    balanced = ftj.LoaderConfig(**{**plain.__dict__, "balance_groups": 4})
    a, b = ftj.Loader(split, plain), ftj.Loader(split, balanced)
    last = a.num_batches - 1
    x, y = a.host_batch(last), b.host_batch(last)
    assert 0 < int((~x["loss_mask"].any(axis=1)).sum()) < 16, "the last batch is partly padding"
    order = balanced_rows(run_costs(x["segment_ids"]), 4)
    for key in x:
        np.testing.assert_array_equal(y[key], x[key][order])
