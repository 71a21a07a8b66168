import dataclasses

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from memurls import memory_url

import flat_tokens_jax as ftj
from flat_tokens_jax.decoding.sharding import HostBlocks

MESHES = {
    "data8": ((8,), ("data",)),
    "data4_fsdp2": ((4, 2), ("data", "fsdp")),
    "data2_seq4": ((2, 4), ("data", "seq")),
    "data2_model2_seq2": ((2, 2, 2), ("data", "model", "seq")),
}
CASES = [
    ("data8", P("data")),
    ("data4_fsdp2", P(("data", "fsdp"))),
    ("data4_fsdp2", P("data")),  # replicated over fsdp
    ("data4_fsdp2", P("fsdp", "data")),
    ("data2_seq4", P("data", "seq")),
    ("data2_seq4", P(None, "seq")),
    ("data2_model2_seq2", P("data", "seq")),  # replicated over model
    ("data2_model2_seq2", P(("data", "model"), "seq")),
    ("data2_model2_seq2", P()),  # fully replicated
]


def mesh(name: str, auto: bool = False) -> jax.sharding.Mesh:
    shape, axes = MESHES[name]
    types = (jax.sharding.AxisType.Auto if auto else jax.sharding.AxisType.Explicit,) * len(axes)
    return jax.make_mesh(shape, axes, axis_types=types)


@pytest.fixture(scope="module")
def split() -> ftj.FlatTokens:
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, 5000, rng.integers(1, 40)) for _ in range(400)]
    url = memory_url()
    ftj.write_dataset(
        url, {"train": seqs}, storage_format=ftj.StorageFormat(shard_tokens=512, chunk_tokens=64)
    )
    return ftj.open_dataset(url)["train"]


def test_eight_devices_are_there() -> None:
    assert jax.device_count() == 8


@pytest.mark.parametrize("auto", [False, True], ids=["explicit", "auto"])
@pytest.mark.parametrize("packing", [True, False, "bins"], ids=["packed", "padded", "bins"])
@pytest.mark.parametrize(("mesh_name", "spec"), CASES)
def test_global_batch_equals_single_device_batch(
    split: ftj.FlatTokens, mesh_name: str, spec: P, packing: bool | str, auto: bool
) -> None:
    cfg = ftj.LoaderConfig(
        batch_size=16, seq_len=24, packing=packing, seed=4, num_epochs=3, pad_id=7
    )
    single = ftj.Loader(split, cfg)
    sharding = NamedSharding(mesh(mesh_name, auto), spec)
    sharded = ftj.Loader(split, cfg, sharding=sharding)
    last = sharded.num_batches - 1
    for step in (0, 5, last):
        want = single.batch(step)
        got = sharded.batch(step)
        for key in want:
            assert got[key].sharding == sharding, key
            assert got[key].dtype == want[key].dtype, key
            np.testing.assert_array_equal(
                np.asarray(got[key]), np.asarray(want[key]), err_msg=f"{key} at step {step}"
            )


def test_host_blocks_read_each_block_once() -> None:
    held = HostBlocks(NamedSharding(mesh("data2_model2_seq2"), P("data", "seq")), 8, 16)
    assert [(b.rows, b.cols) for b in held.blocks] == [
        ((0, 4), (0, 8)),
        ((0, 4), (8, 16)),
        ((4, 8), (0, 8)),
        ((4, 8), (8, 16)),
    ]
    assert held.columns_sharded
    assert held.rows.tolist() == list(range(8))
    rows_only = HostBlocks(NamedSharding(mesh("data4_fsdp2"), P(("data", "fsdp"))), 16, 4)
    assert len(rows_only.blocks) == 8 and not rows_only.columns_sharded


def test_uneven_batches_are_refused(split: ftj.FlatTokens) -> None:
    sharding = NamedSharding(mesh("data4_fsdp2"), P(("data", "fsdp")))
    with pytest.raises(
        ValueError,
        match=r"global batch 12 does not divide over 8 shards "
        r"\(mesh axes \('data', 'fsdp'\) of sizes \(4, 2\)\)",
    ):
        ftj.Loader(split, ftj.LoaderConfig(batch_size=12, seq_len=8), sharding=sharding)
    seq = NamedSharding(mesh("data2_seq4"), P("data", "seq"))
    with pytest.raises(ValueError, match="seq_len 10 does not divide over 4 shards"):
        ftj.Loader(split, ftj.LoaderConfig(batch_size=4, seq_len=10), sharding=seq)


def test_iterate_yields_sharded_global_arrays(split: ftj.FlatTokens) -> None:
    sharding = NamedSharding(mesh("data2_seq4"), P("data", "seq"))
    cfg = ftj.LoaderConfig(batch_size=4, seq_len=16, prefetch=2)
    single = ftj.Loader(split, cfg)
    for step, batch in ftj.Loader(split, cfg, sharding=sharding).iterate(3):
        np.testing.assert_array_equal(
            np.asarray(batch["positions"]), np.asarray(single.batch(step)["positions"])
        )
        if step == 5:
            break


@pytest.mark.parametrize("packing", [True, False, "bins"], ids=["packed", "padded", "bins"])
@pytest.mark.parametrize(("mesh_name", "spec"), CASES)
def test_device_decode_equals_host_decode(
    split: ftj.FlatTokens, mesh_name: str, spec: P, packing: bool | str
) -> None:
    """decode='device' ships encoded tokens and decodes under every mesh and spec."""
    cfg = ftj.LoaderConfig(
        batch_size=16, seq_len=24, packing=packing, seed=4, num_epochs=3, pad_id=7
    )
    host = ftj.Loader(split, cfg)
    sharding = NamedSharding(mesh(mesh_name), spec)
    device = ftj.Loader(split, dataclasses.replace(cfg, decode="device"), sharding)
    decode = jax.jit(device.decoder())
    for step in (0, device.num_batches - 1):
        want = host.host_batch(step)
        got = device.batch(step)
        encoded = device.encoded_batch(step)
        assert encoded["encoded"].dtype == np.uint32 and "stored_mask" not in encoded
        from_encoded = decode(encoded)
        for key in want:
            assert got[key].sharding.is_equivalent_to(sharding, 2), key
            assert from_encoded[key].sharding.is_equivalent_to(sharding, 2), key
            np.testing.assert_array_equal(np.asarray(got[key]), want[key], err_msg=key)
            np.testing.assert_array_equal(np.asarray(from_encoded[key]), want[key], err_msg=key)


@pytest.mark.parametrize("context_parallel", [1, 2, 4])
@pytest.mark.parametrize("packing", [True, False, "bins"])
def test_sequence_shards_decoded_from_their_columns_alone_equal_host_batch(
    split: ftj.FlatTokens, packing: object, context_parallel: int
) -> None:
    """Each block of a sequence-sharded batch is decoded on the host from its
    columns (its runs of the rows' own columns under the zigzag order) and the
    rows' sequence boundaries; every layout's fields equal the whole rows'."""
    sharding = NamedSharding(mesh("data2_seq4"), P("data", "seq"))
    for layout in ("fields", "segments", "maxtext"):
        config = ftj.LoaderConfig(
            batch_size=8,
            seq_len=64,
            packing=packing,
            layout=layout,
            source_field=True,
            context_parallel=context_parallel,
        )
        loader = ftj.Loader(split, config, sharding=sharding)
        for step in range(2):
            want, got = loader.host_batch(step), loader.batch(step)
            assert set(got) == set(want)
            for key in want:
                np.testing.assert_array_equal(np.asarray(got[key]), want[key], err_msg=key)
