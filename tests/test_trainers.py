"""flat_tokens_jax.trainers: each adapter called as its trainer calls it.

MaxText, nanodo and seqax do not install in the test environment, so the calls
are the recorded call shapes of the revisions read: MaxText e591f30
(``src/maxtext/input_pipeline/grain_data_processing.py``, the keys of
``src/maxtext/configs/base.yml``, ``src/maxtext/common/grain_utility.py``), nanodo
8fd56f3 (``nanodo/data.py``) with ``nanodo/train.py`` db1d750, seqax 42cf9af
(``input_loader.py``, ``train.py``). grain and orbax are the real ones.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grain
import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import flat_tokens_jax as ftj
from flat_tokens_jax.trainers import maxtext, nanodo, seqax


def sequences(seed: int) -> dict[str, list[np.ndarray]]:
    """60 train and 13 validation sequences of ids in [1, 64)."""
    r = np.random.default_rng(seed)
    sizes = {"train": 60, "validation": 13}
    return {
        s: [r.integers(1, 64, int(r.integers(4, 40))) for _ in range(n)] for s, n in sizes.items()
    }


def store(tmp_path: Path, name: str, seed: int) -> str:
    """A store on disk of ``sequences(seed)``."""
    ftj.write_dataset(tmp_path / name, sequences(seed))
    return str(tmp_path / name)


def maxtext_config(**keys: Any) -> SimpleNamespace:
    """MaxText's base.yml data keys at e591f30, as its pyconfig gives them (attributes)."""
    base = {
        "grain_train_files": "",
        "grain_eval_files": "",
        "grain_train_mixture_config_path": "",
        "grain_file_type": "arrayrecord",
        "grain_packing_type": "first_fit",
        "grain_worker_count": 1,
        "grain_per_worker_buffer_size": 1,
        "grain_num_threads": 16,
        "grain_prefetch_buffer_size": 500,
        "grain_worker_count_eval": 1,
        "grain_per_worker_buffer_size_eval": 1,
        "grain_num_threads_eval": 16,
        "grain_prefetch_buffer_size_eval": 500,
        "grain_data_source_max_workers": 16,
        "grain_shuffle_buffer_size": 100,
        "grain_use_elastic_iterator": False,
        "colocated_python_data_input": False,
        "expansion_factor_real_data": -1.0,
        "packing": True,
        "num_epoch": 1,
        "generate_padding_batch_train": False,
        "generate_padding_batch_eval": False,
        "max_target_length": 16,
        "enable_data_shuffling": True,
        "data_shuffle_seed": 0,
        "global_batch_size_to_load": 8,
        "global_batch_size_to_load_eval": 8,
        "vocab_size": 64,
        "use_dpo": False,
        "use_sft": False,
    }
    return SimpleNamespace(**{**base, **keys})


def by_hand(**kw: Any) -> ftj.LoaderConfig:
    """The LoaderConfig a MaxText config of ``maxtext_config`` means, written out."""
    fields = {"batch_size": 8, "seq_len": 16, "packing": "bins", "seed": 0, "num_epochs": 1}
    return ftj.LoaderConfig(**{**fields, "vocab_size": 64, "layout": "maxtext", **kw})


def mesh() -> jax.sharding.Mesh:
    return jax.make_mesh((4, 2), ("data", "fsdp"))


def assert_batches(got: dict[str, jax.Array], want: dict[str, np.ndarray]) -> None:
    assert sorted(got) == sorted(want)
    for key in want:
        np.testing.assert_array_equal(np.asarray(got[key]), want[key], err_msg=key)


def test_maxtexts_train_iterator_is_the_loader_of_its_keys(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Each ``next()`` is the loader's batch of MaxText's keys as global arrays
    sharded by ``data_sharding``; ``local_iterator``'s state is the loader's; the
    unused worker settings are named with their values in one log line."""
    url = store(tmp_path, "a", 0)
    config = maxtext_config(grain_train_files=url, data_sharding=[["data", "fsdp"]])
    with caplog.at_level("INFO", logger="flat_tokens_jax.trainers.maxtext"):
        it = maxtext.make_grain_train_iterator(config, mesh(), [0])
    (line,) = [r.getMessage() for r in caplog.records]
    assert "grain_worker_count=1" in line and "grain_num_threads=16" in line
    want = ftj.Loader(ftj.open_dataset(url)["train"], by_hand())
    for step in range(3):
        batch = next(it)
        assert_batches(batch, want.host_batch(step))
        assert batch["inputs"].sharding.spec == P(("data", "fsdp"))
    assert it.local_iterator.get_state() == want.state(3)
    other = maxtext_config(grain_train_files=url, grain_packing_type="concat_then_split")
    windows = ftj.Loader(ftj.open_dataset(url)["train"], by_hand(packing=True))
    assert_batches(
        next(maxtext.make_grain_train_iterator(other, mesh(), [0])), windows.host_batch(0)
    )


def test_maxtexts_mixture_syntax_and_json_are_a_mixture(tmp_path: Path) -> None:
    """``"path,weight;path,weight"`` is a Mixture named by path, the JSON of
    ``grain_train_mixture_config_path`` one named as it names them; each
    for num_epoch epochs (ended by the first component to finish them); a
    malformed part is refused."""
    a, b = store(tmp_path, "a", 0), store(tmp_path, "b", 1)
    splits = {a: ftj.open_dataset(a)["train"], b: ftj.open_dataset(b)["train"]}
    mix = ftj.Mixture({a: (splits[a], 0.7), b: (splits[b], 0.3)})
    want = ftj.Loader(mix, by_hand(num_epochs=1))
    it = maxtext.make_grain_train_iterator(
        maxtext_config(grain_train_files=f"{a},0.7;{b},0.3"), mesh(), [0]
    )
    assert it.loader.source_names == (a, b)
    assert it.loader.num_batches == want.num_batches is not None
    assert_batches(next(it), want.host_batch(0))
    named = tmp_path / "mixture.json"
    named.write_text(
        json.dumps({"web": {"path": a, "weight": 7}, "code": {"path": b, "weight": 3}})
    )
    config = maxtext_config(grain_train_mixture_config_path=str(named))
    it = maxtext.make_grain_train_iterator(config, mesh(), [0])
    named_mix = ftj.Mixture({"web": (splits[a], 7), "code": (splits[b], 3)})
    assert_batches(next(it), ftj.Loader(named_mix, by_hand(num_epochs=1)).host_batch(0))
    with pytest.raises(
        ValueError, match=r"grain_train_files must be 'path,weight;path,weight', got part 1 "
    ):
        maxtext.make_grain_train_iterator(
            maxtext_config(grain_train_files=f"{a},1;{b}"), mesh(), [0]
        )


def test_maxtexts_eval_iterator_reads_every_validation_record_once(tmp_path: Path) -> None:
    """In order, once, the last batch completed with rows whose
    ``targets_segmentation`` is 0; then the end, or zeros with
    ``generate_padding_batch_eval``; ``iter()`` starts again from the first step."""
    url = store(tmp_path, "a", 0)
    config = maxtext_config(grain_eval_files=url, packing=False)
    seqs = sequences(0)["validation"]
    it = maxtext.make_grain_eval_iterator(config, mesh(), [0])
    batches = [{k: np.asarray(v) for k, v in b.items()} for b in it]
    assert len(batches) == 2  # 13 records in rows of 8
    rows = np.concatenate([b["targets"] for b in batches])
    mask = np.concatenate([b["targets_segmentation"] for b in batches]) != 0
    for i, seq in enumerate(seqs):  # a row a sequence, in order, cut at 16 tokens
        assert rows[i][mask[i]].tolist() == seq[:16].tolist(), i
    assert not mask[13:].any()
    padded = maxtext.make_grain_eval_iterator(
        maxtext_config(grain_eval_files=url, packing=False, generate_padding_batch_eval=True),
        mesh(),
        [0],
    )
    after = [next(padded) for _ in range(3)][2]
    assert all(not np.asarray(v).any() for v in after.values())
    assert_batches(next(iter(padded)), batches[0])


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("colocated_python_data_input", True),
        ("grain_use_elastic_iterator", True),
        ("use_sft", True),
        ("expansion_factor_real_data", 2),
        ("grain_packing_type", "greedy"),
    ],
)
def test_maxtext_keys_the_adapter_cannot_honour_are_refused(
    tmp_path: Path, key: str, value: Any
) -> None:
    config = maxtext_config(grain_train_files=store(tmp_path, "a", 0), **{key: value})
    with pytest.raises(ValueError, match=f"^{key} must be"):
        maxtext.make_grain_train_iterator(config, mesh(), [0])


class GrainCheckpointable:
    """MaxText's ``GrainCheckpointable_v1`` (grain_utility.py) for one iterator: an
    orbax v1 ``StatefulCheckpointable`` that hands save and load to the iterator's own."""

    def __init__(self, item: Any) -> None:
        self._item = item

    async def save(self, directory: Any) -> Any:
        return await self._item.save(directory)

    async def load(self, directory: Any) -> Any:
        return await self._item.load(directory)


@pytest.mark.parametrize("orbax_api", ["CheckpointManager", "v1"])
def test_a_foreign_resume_through_orbax_ends_on_state_mismatch(
    tmp_path: Path, orbax_api: str
) -> None:
    """MaxText's restore of its iterator's checkpoint, by orbax's
    ``CheckpointManager`` with grain's handler and by orbax v1 through
    ``GrainCheckpointable_v1``: another ``data_shuffle_seed`` raises
    ``StateMismatch`` naming the seed out of the call, the last error a user reads."""
    ocp = pytest.importorskip("orbax.checkpoint")
    url = store(tmp_path, "a", 0)
    it = maxtext.make_grain_train_iterator(maxtext_config(grain_train_files=url), mesh(), [0])
    next(it)
    other = maxtext.make_grain_train_iterator(
        maxtext_config(grain_train_files=url, data_shuffle_seed=1), mesh(), [0]
    )
    with pytest.raises(Exception) as raised:
        if orbax_api == "v1":
            v1 = pytest.importorskip("orbax.checkpoint.experimental.v1")
            v1.save_checkpointables(
                tmp_path / "c", {"iter": GrainCheckpointable(it.local_iterator)}
            )
            v1.load_checkpointables(
                tmp_path / "c", {"iter": GrainCheckpointable(other.local_iterator)}
            )
        else:
            with ocp.CheckpointManager(tmp_path / "c") as manager:
                save = grain.checkpoint.CheckpointSave(it.local_iterator)
                manager.save(1, args=ocp.args.Composite(iter=save))
                manager.wait_until_finished()
                restore = grain.checkpoint.CheckpointRestore(other.local_iterator)
                manager.restore(1, args=ocp.args.Composite(iter=restore))
    assert type(raised.value) is ftj.StateMismatch, repr(raised.value)
    assert "fingerprint.config.seed: saved 0, now 1" in str(raised.value)


def test_nanodos_py_batched_tfds_is_the_loader_in_the_tokens_layout(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Called with the keywords nanodo's train.py passes: every row of each step
    on this host, nanodo's default seed 1234; ``PADDED`` one sequence a row; the
    unused settings named in one log line; ``num_records`` refused."""
    url = store(tmp_path, "a", 0)
    c = SimpleNamespace(
        ds_name=url,
        context_length=16,
        pygrain_worker_count=4,
        vocab_path="spm.model",
        train_epochs=None,
        pygrain_worker_buffer_size=2,
    )
    with caplog.at_level("INFO", logger="flat_tokens_jax.trainers.nanodo"):
        ds = nanodo.py_batched_tfds(
            tfds_name=c.ds_name,
            split="train",
            context_size=c.context_length,
            worker_count=c.pygrain_worker_count,
            vocab_path=c.vocab_path,
            batch_size=8,
            num_epochs=c.train_epochs,
            preprocessing=nanodo.Preprocess.NOAM_PACKED,
            worker_buffer_size=c.pygrain_worker_buffer_size,
        )
    (line,) = [r.getMessage() for r in caplog.records]
    assert "worker_count=4" in line and "vocab_path='spm.model'" in line
    split = ftj.open_dataset(url)["train"]
    want = ftj.Loader(split, ftj.LoaderConfig(8, 16, seed=1234, layout="tokens"))
    train_iter = iter(ds)
    for step in range(2):
        assert_batches(next(train_iter), want.host_batch(step))
    padded = nanodo.py_batched_tfds(
        tfds_name=url,
        split="train",
        context_size=16,
        worker_count=0,
        vocab_path="",
        batch_size=8,
        preprocessing="PADDED",
        seed=3,
    )
    rows = ftj.Loader(split, ftj.LoaderConfig(8, 16, packing=False, seed=3, layout="tokens"))
    assert_batches(next(iter(padded)), rows.host_batch(0))
    with pytest.raises(ValueError, match=r"^num_records must be None"):
        nanodo.py_batched_tfds(
            tfds_name=url,
            split="train",
            context_size=16,
            worker_count=0,
            vocab_path="",
            batch_size=8,
            num_records=10,
        )
    with pytest.raises(ValueError, match=r"^preprocessing must be"):
        nanodo.py_batched_tfds(
            tfds_name=url,
            split="train",
            context_size=16,
            worker_count=0,
            vocab_path="",
            batch_size=8,
            preprocessing="NOAM",
        )


def test_seqaxs_get_loader_loads_by_step_and_restores(tmp_path: Path) -> None:
    """``get_loader(split, FlatTokensParams, TokenBatchParams)``: ``load(step)`` is
    the block-shuffled loader's batch (a read block of ``sequences_per_read_block``
    records, ``read_blocks_per_shuffle_buffer`` blocks shuffled together), with
    ``sequence_start`` where seqax has ``is_seq_start``; its state restores."""
    url = store(tmp_path, "a", 0)
    params = SimpleNamespace(
        filespec=url,
        streams=1,
        read_blocks_per_shuffle_buffer=4,
        sequences_per_read_block=8,
        seed=5,
        sequence_packing=True,
    )
    sharding = NamedSharding(jax.make_mesh((8, 1), ("d", "t")), P("d"))
    loader = seqax.get_loader("train", params, SimpleNamespace(len=16, batch=8), sharding)
    split = ftj.open_dataset(url)["train"]
    config = ftj.LoaderConfig(
        8, 16, shuffle="blocks", seed=5, shuffle_block=8, shuffle_window=4, sequence_start=True
    )
    want = ftj.Loader(split, config)
    assert loader.max_token_id == split.max_token_id
    for step in (3, 0, 7):
        assert_batches(loader.load(step), want.host_batch(step))
    again = seqax.get_loader("train", params, SimpleNamespace(len=16, batch=8), sharding)
    assert again.restore(loader.state(4)) == 4
    with pytest.raises(ftj.StateMismatch, match=r"fingerprint\.config\.seed"):
        seqax.get_loader(
            "train",
            SimpleNamespace(**{**vars(params), "seed": 6}),
            SimpleNamespace(len=16, batch=8),
        ).restore(loader.state(4))


def test_the_signatures_are_the_trainers_own() -> None:
    """Parameter names and kinds as the revisions read define them (an adapter
    adds only a trailing ``sharding``)."""

    def shape(f: Any) -> list[tuple[str, Any]]:
        return [(p.name, p.kind) for p in inspect.signature(f).parameters.values()]

    positional = inspect.Parameter.POSITIONAL_OR_KEYWORD
    for f in (maxtext.make_grain_train_iterator, maxtext.make_grain_eval_iterator):
        assert shape(f) == [(n, positional) for n in ("config", "global_mesh", "process_indices")]
    nanodos = "tfds_name split context_size worker_count vocab_path batch_size seed num_epochs"
    nanodos += " num_records preprocessing worker_buffer_size shuffle sharding"
    assert shape(nanodo.py_batched_tfds) == [
        (n, inspect.Parameter.KEYWORD_ONLY) for n in nanodos.split()
    ]
    seqaxs = ("split", "config", "token_batch_params", "sharding")
    assert shape(seqax.get_loader) == [(n, positional) for n in seqaxs]
