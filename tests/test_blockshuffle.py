"""``LoaderConfig(shuffle="blocks")``: the block sampler against a brute-force
reference built from the design, every record once per epoch, the lanes of a
step's rows and what each host's rows read, and every path that takes a
sampler (schedules, mixtures, bins, phases, restore, the grain path)."""

from __future__ import annotations

import collections
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from memurls import memory_url

import flat_tokens_jax as ftj
from flat_tokens_jax.cli import build_parser
from flat_tokens_jax.loader.state import StateMismatch
from flat_tokens_jax.sampling.blocks import BlockSampler, default_block
from flat_tokens_jax.sampling.sampling import MAX_N, EpochsExhausted, permute
from flat_tokens_jax.tools import show

pytestmark = pytest.mark.filterwarnings("error")


def key(seed: int, domain: str) -> int:
    """The design's keys: the seed under a domain of the block shuffle's own."""
    return int.from_bytes(
        hashlib.sha256(f"flat-tokens/{domain}/{seed}".encode()).digest()[:8], "little"
    )


def epoch_order(n: int, block: int, window: int, seed: int, epoch: int) -> list[int]:
    """``R_e`` as a list: full blocks in keyed order, the partial one last,
    windows of ``window`` blocks, each window's records permuted."""
    full = n // block
    order = [int(permute(i, full, seed=key(seed, "blocks"), epoch=epoch)) for i in range(full)]
    blocks = [list(range(b * block, (b + 1) * block)) for b in order]
    if n % block:
        blocks.append(list(range(full * block, n)))
    windows = [blocks[i : i + window] for i in range(0, len(blocks), window)]
    out: list[int] = []
    for w, held in enumerate(windows):
        records = [r for b in held for r in b]
        at = epoch * len(windows) + w
        out += [
            records[int(permute(p, len(records), seed=key(seed, "window"), epoch=at))]
            for p in range(len(records))
        ]
    return out


def reference(n: int, block: int, window: int, lanes: int, seed: int, samples: range) -> list[int]:
    """Each stream sample's record: lane by lane, each lane's samples in order
    reading the next records of ``R_e``."""
    record: dict[int, int] = {}
    for epoch in range(samples.start // n, (samples.stop - 1) // n + 1):
        in_epoch = range(epoch * n, (epoch + 1) * n)
        sequence = [t for lane in range(lanes) for t in in_epoch if t % lanes == lane]
        record |= zip(sequence, epoch_order(n, block, window, seed, epoch), strict=True)
    return [record[s] for s in samples]


@settings(max_examples=150, deadline=None)
@given(
    n=st.integers(1, 40),
    block=st.integers(1, 12),
    window=st.integers(1, 4),
    lanes=st.integers(1, 10),
    seed=st.integers(0, 2**64 - 1),
    offset=st.integers(0, 90),
)
def test_the_sampler_is_the_reference(
    n: int, block: int, window: int, lanes: int, seed: int, offset: int
) -> None:
    """Partial last blocks, ``n < block``, ``n < lanes`` and streams continued
    at an offset included; each epoch holds every record once."""
    sampler = BlockSampler(n, block, window, lanes, seed, offset=offset)
    g = np.arange(3 * n)
    got = sampler.records(g)
    assert got.tolist() == reference(n, block, window, lanes, seed, range(offset, offset + 3 * n))
    stream = BlockSampler(n, block, window, lanes, seed).records(np.arange(offset, offset + 3 * n))
    assert got.tolist() == stream.tolist()
    for e in range(3):
        epoch = BlockSampler(n, block, window, lanes, seed).records(np.arange(e * n, (e + 1) * n))
        assert sorted(epoch.tolist()) == list(range(n))
    assert sampler.lane(g).tolist() == ((g + offset) % lanes).tolist()
    assert sampler.block_of(got).tolist() == (got // block).tolist()


def test_epochs_bound_and_no_overflow_near_the_largest_index() -> None:
    bounded = BlockSampler(10, 3, 1, 4, num_epochs=2)
    assert bounded.num_samples == 20 and bounded.epochs([0, 19]).tolist() == [0, 1]
    with pytest.raises(EpochsExhausted, match="past the end"):
        bounded.records([20])
    n, lanes = 2**62 + 3, 7
    big = BlockSampler(n, 1000, 2, lanes, seed=1)
    g = np.array([MAX_N - 1, MAX_N, n - 1, n + 5, 1], np.int64)
    epoch, j = big.positions(g)
    # The position in R_e from the counts on Python ints: samples of lanes
    # below the lane in the epoch, plus the lane's samples before g.
    for s, e, got in zip(g.tolist(), epoch.tolist(), j.tolist(), strict=True):
        lane, first = s % lanes, e * n
        below = sum(1 for t in range(first, first + lanes) if t % lanes < lane)
        whole = ((first + n) - (first + lanes)) // lanes
        tail = sum(1 for t in range(first + lanes + whole * lanes, first + n) if t % lanes < lane)
        mine = (s - first) // lanes
        assert got == below + whole * lane + tail + mine
    records = big.records(g)
    assert ((records >= 0) & (records < n)).all()


def test_the_order_is_frozen() -> None:
    """A new version must not change the block shuffle's order silently."""
    sampler = BlockSampler(50, 4, 2, 3, seed=7)
    assert sampler.records(np.arange(16)).tolist() == GOLDEN_RECORDS
    assert sampler.records(np.arange(50, 56)).tolist() == GOLDEN_EPOCH_1


GOLDEN_RECORDS = [39, 25, 11, 31, 27, 12, 36, 0, 14, 30, 26, 10, 28, 3, 15, 29]
GOLDEN_EPOCH_1 = [30, 15, 44, 6, 12, 46]


def split(count: int, seed: int = 0, **fmt: int) -> ftj.FlatTokens:
    rng = np.random.default_rng(seed)
    url = memory_url("blocks")
    seqs = [rng.integers(1, 900, rng.integers(1, 30)) for _ in range(count)]
    storage = ftj.StorageFormat(**(fmt or {"shard_tokens": 256, "chunk_tokens": 32}))
    ftj.write_dataset(url, {"train": seqs}, storage_format=storage)
    return ftj.open_dataset(url)["train"]


def blocks_config(**fields: object) -> ftj.LoaderConfig:
    values = {"batch_size": 8, "seq_len": 8, "shuffle": "blocks", "shuffle_block": 3, "prefetch": 0}
    return ftj.LoaderConfig(**{**values, **fields})  # type: ignore[arg-type]


@pytest.mark.parametrize("window", [1, 2])
@pytest.mark.parametrize("batch_size", [8, [[0, 8], [3, 16]]])
def test_rows_hold_lanes_and_hosts_share_only_boundary_blocks(
    window: int, batch_size: object
) -> None:
    """Row ``r`` of a step of ``bs`` rows is in lane ``r // (bs / L)``; the
    rows of host ``h`` of ``H`` (``H`` dividing ``L = 8``) read blocks of its
    lanes only, but for at most ``H - 1`` blocks per epoch (windows of
    ``window`` blocks: ``(H - 1) * window``) shared by two hosts."""
    ft = split(120)
    loader = ftj.Loader(ft, blocks_config(batch_size=batch_size, shuffle_window=window))
    sampler = loader.sampler
    assert isinstance(sampler, BlockSampler) and sampler.lanes == 8
    n = len(loader.components[0])
    steps = range(loader.schedule.step_of(3 * n) + 1)
    readers: dict[int, dict[int, dict[int, set[int]]]] = {h: {} for h in (1, 2, 4)}
    per_epoch: dict[int, list[int]] = collections.defaultdict(list)
    for step in steps:
        size = loader.batch_size_at(step)
        for row in loader.provenance(step):
            r, g, epoch, record = (int(row[k]) for k in ("row", "sample", "epoch", "record"))
            assert sampler.lane(g) == r // (size // 8)
            per_epoch[epoch].append(record)
            for hosts, found in readers.items():
                host = r * hosts // size
                found.setdefault(epoch, {}).setdefault(record // 3, set()).add(host)
    for epoch in range(3):
        assert sorted(per_epoch[epoch]) == list(range(n)), f"epoch {epoch}: every record once"
    for hosts, epochs in readers.items():
        for epoch in range(3):
            shared = [b for b, h in epochs[epoch].items() if len(h) > 1]
            assert all(len(epochs[epoch][b]) == 2 for b in shared)
            assert len(shared) <= (hosts - 1) * window, (hosts, epoch, shared)


def test_a_full_shuffle_is_unchanged_and_its_fingerprint_holds_no_block() -> None:
    cfg = ftj.LoaderConfig(batch_size=4, seq_len=8)
    assert "shuffle_block" not in cfg.batch_defining()
    assert "shuffle_window" not in cfg.batch_defining()
    ft = split(60)
    full = ftj.Loader(ft, ftj.LoaderConfig(batch_size=4, seq_len=8, seed=3, prefetch=0))
    want = permute(np.arange(4), len(full.components[0]), seed=3, epoch=0)
    assert [r["record"] for r in full.provenance(0)] == want.tolist()


def test_the_resolved_block_and_window_are_in_the_fingerprint_and_restore_is_exact() -> None:
    ft = split(100)
    cfg = blocks_config(shuffle_block=None, shuffle_window=2, seed=4)
    loader = ftj.Loader(ft, cfg)
    block = default_block(loader.components, 8)
    # 2**18 tokens of about 8 a window
    assert block == -(-(2**18) // (ft.num_tokens // len(loader.components[0])))
    config = loader.fingerprint()["config"]
    assert (config["shuffle"], config["shuffle_block"], config["shuffle_window"]) == (
        "blocks",
        block,
        2,
    )
    rng = np.random.default_rng(0)
    stop = int(rng.integers(1, 20))
    for step, _ in loader.iterate(0):
        if step + 1 == stop:
            break
    state = loader.state()
    assert json.loads(json.dumps(state)) == state
    again = ftj.Loader(ft, cfg)
    assert again.restore(state) == stop
    for step in range(stop, stop + 3):
        assert again.provenance(step) == loader.provenance(step)
        for name, value in loader.host_batch(step).items():
            np.testing.assert_array_equal(again.host_batch(step)[name], value)
    with pytest.raises(StateMismatch, match="shuffle_block"):
        ftj.Loader(ft, blocks_config(shuffle_block=5, shuffle_window=2, seed=4)).restore(state)
    with pytest.raises(StateMismatch, match="shuffle_window"):
        ftj.Loader(ft, blocks_config(shuffle_block=None, seed=4)).restore(state)
    with pytest.raises(StateMismatch, match=r"lanes \(the gcd of the batch sizes\)"):
        grown = blocks_config(
            batch_size=[[0, 8], [stop, 12]], shuffle_block=None, shuffle_window=2, seed=4
        )
        ftj.Loader(ft, grown).restore(state)
    doubled = blocks_config(
        batch_size=[[0, 8], [stop, 16]], shuffle_block=None, shuffle_window=2, seed=4
    )
    assert ftj.Loader(ft, doubled).restore(state) == stop


def test_a_mixture_reads_each_component_once_per_epoch() -> None:
    a, b = split(40, seed=1), split(70, seed=2)
    mix = ftj.Mixture({"a": (a, 1.0), "b": (b, 2.0)}, seed=5)
    loader = ftj.Loader(mix, blocks_config(shuffle_block=2))
    sizes = [len(c) for c in loader.components]
    seen: dict[tuple[int, int], list[int]] = collections.defaultdict(list)
    for step in range(40):
        for row in loader.provenance(step):
            seen[row["component"], row["epoch"]].append(row["record"])
    for c, size in enumerate(sizes):
        assert sorted(seen[c, 0]) == list(range(size))
        assert len(set(seen[c, 1])) == len(seen[c, 1])
    for c, sampler in enumerate(loader.samplers):
        assert isinstance(sampler, BlockSampler)
        assert (sampler.seed, sampler.lanes) == (mix.component_seed(0, c), 8)


def test_a_steered_mixture_skips_and_reweights_its_block_streams() -> None:
    """A skip reads the data step it skips to; a weight change continues
    each component's block stream, each epoch reading every record once."""
    a, b = split(40, seed=1), split(70, seed=2)
    mix = ftj.Mixture({"a": (a, 1.0), "b": (b, 1.0)}, seed=5)
    plain = ftj.Loader(mix, blocks_config(shuffle_block=2))
    steered = ftj.Loader(mix, blocks_config(shuffle_block=2))
    steered.skip(2, 3)
    assert steered.provenance(2) == plain.provenance(5)
    assert steered.provenance(1) == plain.provenance(1)
    steered = ftj.Loader(mix, blocks_config(shuffle_block=2))
    steered.set_weights(4, [1.0, 3.0])
    seen: dict[tuple[int, int], list[int]] = collections.defaultdict(list)
    for step in range(40):
        for row in steered.provenance(step):
            seen[row["component"], row["epoch"]].append(row["record"])
    assert seen[1, 1], "component b is read past its first epoch"
    for (c, epoch), records in seen.items():
        assert len(set(records)) == len(records), (c, epoch)
        if (c, epoch + 1) in seen:
            assert sorted(records) == list(range(len(steered.components[c])))


def test_bins_are_each_read_once_per_epoch() -> None:
    ft = split(150)
    loader = ftj.Loader(ft, blocks_config(packing="bins", seq_len=32, num_epochs=1))
    n = len(loader.components[0])
    records = [
        r["record"]
        for s in range(loader.num_batches)
        for r in loader.provenance(s)
        if not r.get("padding")
    ]
    assert sorted(records) == list(range(n))


def test_phases_continue_a_stream_under_the_same_lanes() -> None:
    """A phase of the same data, block, window and lanes continues the stream
    (the run's first epoch is still a permutation); one that changes the
    lanes reads another stream."""
    ft = split(80)
    cfg = blocks_config()
    run = ftj.PhasedLoader([ftj.Phase(0, ft, cfg), ftj.Phase(2, ft, blocks_config(seq_len=8))])
    one = ftj.Loader(ft, cfg)
    for step in range(6):
        assert [r["record"] for r in run.provenance(step)] == [
            r["record"] for r in one.provenance(step)
        ]
    changed = ftj.PhasedLoader(
        [ftj.Phase(0, ft, cfg), ftj.Phase(2, ft, blocks_config(batch_size=4))]
    )
    assert changed.streams[0] != changed.streams[1]


def test_the_grain_path_is_host_batch() -> None:
    cfg = blocks_config(batch_size=[[0, 8], [2, 16]], seed=3, shuffle_window=2, num_epochs=1)
    loader = ftj.Loader(split(90), cfg)
    steps = list(loader.to_grain())
    assert len(steps) == loader.num_batches
    for step, got in enumerate(steps):
        for name, value in loader.host_batch(step).items():
            np.testing.assert_array_equal(got[name], value, err_msg=f"{step} {name}")


def test_bad_block_fields_are_refused_naming_them() -> None:
    with pytest.raises(
        ValueError,
        match=r"^LoaderConfig.shuffle is True, but shuffle_block=4 and shuffle_window=1 "
        r"are set: they apply to shuffle='blocks' only",
    ):
        ftj.LoaderConfig(batch_size=4, seq_len=8, shuffle_block=4)
    with pytest.raises(
        ValueError, match=r"shuffle is False, but shuffle_block=None and shuffle_window=2"
    ):
        ftj.LoaderConfig(batch_size=4, seq_len=8, shuffle=False, shuffle_window=2)
    with pytest.raises(
        ValueError,
        match=r"^loader.shuffle must be True or False, got 'Blocks'; "
        r"or 'blocks' for the block shuffle",
    ):
        ftj.LoaderConfig.from_dict({"batch_size": 4, "seq_len": 8, "shuffle": "Blocks"}, "loader")
    with pytest.raises(
        ValueError, match=r"^loader.shuffle_block must be an int >= 1 or null/None, got 0"
    ):
        ftj.LoaderConfig.from_dict(
            {"batch_size": 4, "seq_len": 8, "shuffle": "blocks", "shuffle_block": 0}, "loader"
        )
    with pytest.raises(ValueError, match=r"^loader.shuffle_window must be an int >= 1, got 0"):
        ftj.LoaderConfig.from_dict(
            {"batch_size": 4, "seq_len": 8, "shuffle": "blocks", "shuffle_window": 0}, "loader"
        )
    cfg = ftj.LoaderConfig(batch_size=np.int64(4), seq_len=8, shuffle=np.bool_(True))
    assert cfg.shuffle is True


def test_yaml_and_show_flags_take_the_block_shuffle(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    fields = ["batch_size: 8", "seq_len: 8", "shuffle: blocks", "shuffle_block: 3"]
    path.write_text("loader:\n" + "".join(f"  {f}\n" for f in [*fields, "shuffle_window: 2"]))
    cfg = ftj.LoaderConfig.from_yaml(path)
    assert (cfg.shuffle, cfg.shuffle_block, cfg.shuffle_window, cfg.lanes) == ("blocks", 3, 2, 8)
    args = build_parser().parse_args(
        [
            "show",
            "memory://x",
            "--step",
            "0",
            "--blocks",
            "--shuffle-block",
            "3",
            "--shuffle-window",
            "2",
        ]
    )
    fields = show.config_fields(args)
    assert (fields["shuffle"], fields["shuffle_block"], fields["shuffle_window"]) == (
        "blocks",
        3,
        2,
    )
