"""flat_tokens_jax.convert.assemble: parts joined shard by shard equal one streamed write."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rawstore import stored

import flat_tokens_jax as ftj
from flat_tokens_jax.convert.assemble import (
    PartInfo,
    SplitCounts,
    Task,
    assemble_shard,
    create_arrays,
    finish,
    part_url,
    place_parts,
)
from flat_tokens_jax.core.format import SPLITS
from flat_tokens_jax.store.location import STAGING
from flat_tokens_jax.store.store import Store

_counter = itertools.count()

Split = list[tuple[list[int], list[int] | None]]  # (sequence, loss mask or None)


def write_parts(
    output: str, parts: list[dict[str, Split]], storage_format: ftj.StorageFormat
) -> list[PartInfo]:
    infos = []
    for index, splits in enumerate(parts):
        url = part_url(output, index, "t")
        with ftj.DatasetWriter(url, storage_format=storage_format) as w:
            for name, seqs in splits.items():
                for seq, mask in seqs:
                    w.append(name, seq, mask)
        infos.append(PartInfo.read(index, url))
    return infos


def assemble_all(
    output: str, infos: list[PartInfo], storage_format: ftj.StorageFormat, seed: int
) -> None:
    """What the Beam pipeline does, tasks in a shuffled order, parts given shuffled."""
    store = Store(output)
    shuffled = list(infos)
    random.Random(seed).shuffle(shuffled)
    placement = place_parts(output, storage_format, shuffled)
    create_arrays(placement, store)
    tasks = placement.tasks()
    random.Random(seed + 1).shuffle(tasks)
    for task in tasks:
        assemble_shard(placement, task, store, ftj.open_dataset)
    finish(placement, store)


def reference(url: str, parts: list[dict[str, Split]], storage_format: ftj.StorageFormat) -> None:
    with ftj.DatasetWriter(url, storage_format=storage_format) as w:
        for name in SPLITS:
            for splits in parts:
                for seq, mask in splits.get(name, []):
                    w.append(name, seq, mask)


def _split(masked: bool) -> st.SearchStrategy[Split]:
    seq = st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=40)
    if not masked:
        return st.lists(st.tuples(seq, st.none()), max_size=5)
    return st.lists(
        seq.flatmap(
            lambda s: st.tuples(
                st.just(s), st.lists(st.integers(0, 1), min_size=len(s), max_size=len(s))
            )
        ),
        max_size=5,
    )


@st.composite
def cases(draw: st.DrawFn) -> tuple[list[dict[str, Split]], ftj.StorageFormat]:
    masked = draw(st.booleans())
    parts = draw(
        st.lists(
            st.fixed_dictionaries({"train": _split(masked), "validation": _split(False)}),
            min_size=1,
            max_size=6,
        )
    )
    chunk = draw(st.sampled_from([2, 4, 8]))
    storage_format = ftj.StorageFormat(
        zarr_format=draw(st.sampled_from([2, 3])),
        chunk_tokens=chunk,
        shard_tokens=chunk * draw(st.sampled_from([1, 2, 4])),
        compression=draw(st.sampled_from([None, "zstd"])),
    )
    return parts, storage_format


# Each example writes its parts, assembles them and validates the result: 25 cover
# the zarr versions, chunks, shards and compressions in a fraction of the time.
@settings(max_examples=25, deadline=None)
@given(cases(), st.integers(0, 1000))
def test_assembled_parts_are_byte_identical_to_one_streamed_write(
    case: tuple[list[dict[str, Split]], ftj.StorageFormat], seed: int
) -> None:
    parts, storage_format = case
    n = next(_counter)
    output, expected = f"memory://assemble/{n}/out", f"memory://assemble/{n}/ref"
    infos = write_parts(output, parts, storage_format)
    assemble_all(output, infos, storage_format, seed)
    reference(expected, parts, storage_format)
    got = stored(output)
    assert not any(k.startswith(STAGING) for k in got)
    assert got == stored(expected)
    ftj.validate(output)


def test_a_sequence_longer_than_several_shards() -> None:
    storage_format = ftj.StorageFormat(shard_tokens=8, chunk_tokens=4)
    long = list(range(1, 30))
    parts: list[dict[str, Split]] = [
        {"train": [([5, 6], None)], "validation": []},
        {"train": [(long, None)], "validation": []},
        {"train": [], "validation": []},
        {"train": [([7], None)], "validation": [([1, 2, 3], None)]},
    ]
    output, expected = "memory://assemble/long/out", "memory://assemble/long/ref"
    infos = write_parts(output, parts, storage_format)
    placement = place_parts(output, storage_format, infos)
    # 32 tokens in 8-token shards, and 5 starts in 4-entry shards.
    tokens_tasks = [t for t in placement.tasks() if t.split == "train" and t.array != "seq_starts"]
    assert len(tokens_tasks) == 4 and placement.num_tokens("train") == 32
    assemble_all(output, infos, storage_format, 0)
    reference(expected, parts, storage_format)
    assert stored(output) == stored(expected)
    ft = ftj.open_dataset(output)["train"]
    assert [s.tolist() for s in ft.sequences(range(3))] == [[5, 6], long, [7]]


def test_plan_refusals() -> None:
    storage_format = ftj.StorageFormat()
    a = PartInfo(0, "a", {"train": SplitCounts(1, 2, 3, False)})
    b = PartInfo(0, "b", {"train": SplitCounts(1, 2, 3, False)})
    c = PartInfo(1, "c", {"train": SplitCounts(1, 2, 3, True)})
    d = PartInfo(2, "d", {"validation": SplitCounts(1, 2, 3, False)})
    with pytest.raises(ValueError, match="no parts"):
        place_parts("o", storage_format, [])
    with pytest.raises(ValueError, match="repeat an index"):
        place_parts("o", storage_format, [a, b])
    with pytest.raises(ValueError, match="loss mask"):
        place_parts("o", storage_format, [a, c])
    with pytest.raises(ValueError, match="has splits"):
        place_parts("o", storage_format, [a, d])


def test_a_part_that_lies_about_its_size_fails_its_shard() -> None:
    storage_format = ftj.StorageFormat(shard_tokens=8, chunk_tokens=4)
    output = "memory://assemble/lie/out"
    infos = write_parts(output, [{"train": [([1, 2, 3], None)], "validation": []}], storage_format)
    lie = PartInfo(0, infos[0].url, {**infos[0].splits, "train": SplitCounts(1, 5, 3, False)})
    placement = place_parts(output, storage_format, [lie])
    create_arrays(placement, Store(output))
    with pytest.raises(IndexError, match="outside"):
        assemble_shard(
            placement, Task("train", "encoded_tokens", 0), Store(output), ftj.open_dataset
        )
