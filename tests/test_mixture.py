import dataclasses
import time
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from memurls import memory_url

import flat_tokens_jax as ftj
from flat_tokens_jax.data.dataset import split_boundaries
from flat_tokens_jax.sampling.mixconfig import mixture_from_config
from flat_tokens_jax.sampling.mixture import Mixture, Period, period_counts
from flat_tokens_jax.sampling.schedule import BatchSchedule
from flat_tokens_jax.sampling.steering import Steering


def make_split(num_seqs: int, length: int = 4, base: int = 1) -> ftj.FlatTokens:
    url = memory_url()
    seqs = [[base + i] * length for i in range(num_seqs)]
    ftj.write_dataset(
        url, {"train": seqs}, storage_format=ftj.StorageFormat(shard_tokens=256, chunk_tokens=16)
    )
    return ftj.open_dataset(url)["train"]


def route(mix: Mixture, samples: np.ndarray, batch_size: object) -> tuple[np.ndarray, np.ndarray]:
    """Global samples to (component, component sample), as a loader routes them."""
    return Steering(mix, BatchSchedule.of(batch_size)).route(samples)


def reference_counts(weights: list[float], period: int) -> list[int]:
    """Largest remainder with exact fractions of the weights' decimal values."""
    total = sum(Fraction(str(w)) for w in weights)
    shares = [Fraction(str(w)) / total * period for w in weights]
    counts = [int(s) for s in shares]
    by_remainder = sorted(range(len(weights)), key=lambda i: (-(shares[i] - counts[i]), i))
    for i in by_remainder[: period - sum(counts)]:
        counts[i] += 1
    return counts


def reference_schedule(
    weights_by_segment: list[list[float]], starts: list[int], period: int, total: int
) -> tuple[list[int], list[int]]:
    """Materialises (component, component sample) for samples 0..total-1, one at a time."""
    drawn = [0] * len(weights_by_segment[0])
    comps, samples = [], []
    for g in range(total):
        seg = max(j for j, s in enumerate(starts) if s <= g)
        counts = reference_counts(weights_by_segment[seg], period)
        slots = sorted(
            (Fraction(2 * k + 1, 2 * n), c) for c, n in enumerate(counts) for k in range(n)
        )
        c = slots[(g - starts[seg]) % period][1]
        comps.append(c)
        samples.append(drawn[c])
        drawn[c] += 1
    return comps, samples


weight_lists = st.lists(st.sampled_from([0, 0.5, 1, 2, 3, 7, 0.1]), min_size=1, max_size=4).filter(
    lambda w: sum(w) > 0
)


def test_remainders_that_tie_in_decimal_tie_in_the_period() -> None:
    # 0.1, 0.1, 0.7 over 3 slots: shares 1/3, 1/3, 7/3, remainders all 1/3, so the
    # spare slot goes to the lowest index; float shares alone would give it to 2.
    assert Period.of_counts(period_counts([0.1, 0.1, 0.7], 3)).counts.tolist() == [1, 0, 2]
    assert reference_counts([0.1, 0.1, 0.7], 3) == [1, 0, 2]


@settings(max_examples=30)
@given(weights=weight_lists, period=st.integers(1, 23), data=st.data())
def test_route_equals_materialised_reference(
    weights: list[float], period: int, data: st.DataObject
) -> None:
    k = len(weights)
    later = data.draw(st.lists(weight_lists.filter(lambda w: len(w) == k), max_size=2))
    steps = sorted(data.draw(st.sets(st.integers(1, 12), min_size=len(later), max_size=len(later))))
    batch = data.draw(st.integers(1, 5))
    positive = [w for w in [weights, *later]]
    if any(
        c == 0 and w > 0
        for ws in positive
        for c, w in zip(reference_counts(ws, period), ws, strict=True)
    ):
        return  # a positive weight that gets no slot is refused; tested below
    comps = [make_split(3)] * k
    mix = Mixture(
        list(zip(comps, weights, strict=True)),
        period=period,
        schedule=list(zip(steps, later, strict=True)),
    )
    total = 15 * batch + 7
    want = reference_schedule([weights, *later], [0, *(s * batch for s in steps)], period, total)
    comp, sample = route(mix, np.arange(total), batch)
    assert (comp.tolist(), sample.tolist()) == want


def test_whole_periods_are_exact_and_long_runs_track_weights() -> None:
    weights = [0.5, 0.3, 0.15, 0.05]
    mix = Mixture([(make_split(5), w) for w in weights], period=997)
    comp, _ = route(mix, np.arange(997 * 13), 1)
    assert np.bincount(comp).tolist() == [13 * c for c in reference_counts(weights, 997)]
    n = 10**6
    comp, sample = route(mix, np.arange(n), 7)
    share = np.bincount(comp, minlength=4) / n
    assert np.all(np.abs(share - weights) <= 1 / 997 + 1 / n)
    for c in range(4):  # every component draws its samples 0, 1, 2, ... in order
        assert np.array_equal(sample[comp == c], np.arange((comp == c).sum()))


def test_tiny_weights_are_drawn_at_their_rate() -> None:
    mix = Mixture([(make_split(5), 1.0), (make_split(5), 1e-4)])
    comp, _ = route(mix, np.arange(2 * 10**6), 1)
    drawn = int((comp == 1).sum())
    assert abs(drawn - 2 * 10**6 * 1e-4 / (1 + 1e-4)) <= 2 * 10**6 / mix.periods[0].period + 1


def test_bad_weights_are_refused() -> None:
    ft = make_split(3)
    with pytest.raises(ValueError, match="non-negative"):
        Mixture([(ft, 1.0), (ft, -0.5)])
    with pytest.raises(ValueError, match="all zero"):
        Mixture([(ft, 0.0), (ft, 0.0)])
    with pytest.raises(ValueError, match=r"component\(s\) \['1'\] get no sample in a period of 10"):
        Mixture([(ft, 1.0), (ft, 0.001)], period=10)
    with pytest.raises(ValueError, match="expected 2 weights"):
        Mixture([(ft, 1.0), (ft, 1.0)], schedule=[(5, [1.0])])
    with pytest.raises(ValueError, match="strictly increasing"):
        Mixture([(ft, 1.0)], schedule=[(5, [1.0]), (5, [2.0])])
    assert route(Mixture([(ft, 0.0), (ft, 1.0)]), np.arange(50), 1)[0].tolist() == ([1] * 50)


def test_small_component_repeats_and_reshuffles() -> None:
    small, big = make_split(10, length=2, base=1), make_split(100, length=2, base=100)
    mix = Mixture([(small, 0.5), (big, 0.5)])
    loader = ftj.Loader(mix, ftj.LoaderConfig(batch_size=100, seq_len=2, seed=3))
    rows = loader.provenance(0)
    mine = [r for r in rows if r["component"] == 0]
    assert len(mine) == 50
    assert np.bincount([r["record"] for r in mine]).tolist() == [5] * 10
    epochs = [[r["record"] for r in mine if r["epoch"] == e] for e in range(5)]
    assert all(sorted(e) == list(range(10)) for e in epochs)
    assert len({tuple(e) for e in epochs}) == 5, "each epoch has its own order"
    targets = loader.host_batch(0)["targets"]
    for r in rows:
        assert targets[r["row"], 0] == (1 if r["component"] == 0 else 100) + r["record"]


def test_unshuffled_components_stay_in_order_but_interleave() -> None:
    a, b = make_split(50, length=2, base=1), make_split(50, length=2, base=1000)
    loader = ftj.Loader(
        Mixture([(a, 3), (b, 1)]),
        ftj.LoaderConfig(batch_size=40, seq_len=2, shuffle=False),
    )
    first = loader.host_batch(0)["targets"][:, 0]
    from_a = first[first < 1000]
    assert from_a.tolist() == list(range(1, 31))
    assert (first >= 1000).sum() == 10
    assert first[:4].tolist().count(1000) == 1


def test_any_step_is_cheap() -> None:
    mix = Mixture(
        [(make_split(40), 0.7), (make_split(30), 0.3)],
        schedule=[(10, [0.2, 0.8]), (1000, [0.5, 0.5])],
    )
    loader = ftj.Loader(mix, ftj.LoaderConfig(batch_size=8, seq_len=2))

    def took(step: int) -> float:
        began = time.perf_counter()
        loader.host_batch(step)
        return time.perf_counter() - began

    took(0)
    assert min(took(10**9) for _ in range(3)) < 10 * min(took(0) for _ in range(3)) + 0.01


def test_schedule_change_keeps_earlier_steps_and_follows_new_weights() -> None:
    a, b = make_split(20), make_split(20, base=500)
    plain = Mixture([(a, 1), (b, 1)], period=4)
    changed = Mixture([(a, 1), (b, 1)], period=4, schedule=[(6, [3, 1])])
    batch = 4
    before = np.arange(6 * batch)
    assert all(
        np.array_equal(x, y)
        for x, y in zip(route(plain, before, batch), route(changed, before, batch), strict=True)
    )
    after = np.arange(6 * batch, 6 * batch + 40)
    comp, sample = route(changed, after, batch)
    assert np.bincount(comp).tolist() == [30, 10]
    drawn_before = np.bincount(route(plain, before, batch)[0])
    assert sample[comp == 0][0] == drawn_before[0]
    cfg = ftj.LoaderConfig(batch_size=batch, seq_len=2, seed=1, prefetch=2)
    straight = [
        np.asarray(b["targets"])
        for _, (_, b) in zip(range(12), ftj.Loader(changed, cfg).iterate(0), strict=False)
    ]
    for k in (3, 6, 9):
        it = ftj.Loader(changed, cfg).iterate(k)
        for step, batch_k in it:
            assert np.array_equal(np.asarray(batch_k["targets"]), straight[step])
            if step == 11:
                break
        it.close()


def test_records_components_must_agree_with_the_config() -> None:
    a = ftj.PackedRecords(make_split(10, length=5), 4)
    b = ftj.PaddedRecords(make_split(10, length=3, base=50), 4)
    with pytest.raises(ValueError, match=r"records disagree on packing: '0': True, '1': False"):
        Mixture([(a, 1), (b, 1)])
    with pytest.raises(ValueError, match=r"records disagree on seq_len: '0': 4, '1': 3"):
        Mixture([(a, 1), (ftj.PackedRecords(make_split(10, base=50), 3), 1)])
    mix = Mixture([("a", a, 1), ("b", ftj.PackedRecords(make_split(10, base=50), 4), 1)])
    with pytest.raises(
        ValueError,
        match=r"component 'a' is PackedRecords.* with seq_len 4 and packing True, but "
        r"seq_len 4 and packing False were asked for: pass the FlatTokens split and let the "
        r"LoaderConfig make its records",
    ):
        ftj.Loader(mix, ftj.LoaderConfig(batch_size=8, seq_len=4, packing=False))
    with pytest.raises(ValueError, match=r"with seq_len 4 .* but seq_len 2 and packing True"):
        ftj.Loader(mix, ftj.LoaderConfig(batch_size=8, seq_len=2))


@pytest.mark.parametrize("packing", [True, False])
def test_the_config_decides_what_a_record_is(packing: bool) -> None:
    # Sequences of 3 tokens with seq_len 4: packed rows cross sequences, padded rows do not.
    a, b = make_split(12, length=3), make_split(12, length=3, base=100)
    cfg = ftj.LoaderConfig(batch_size=8, seq_len=4, packing=packing, shuffle=False)
    loader = ftj.Loader(Mixture({"a": (a, 1), "b": (b, 1)}), cfg)
    batch = loader.host_batch(0)
    one = dataclasses.replace(cfg, batch_size=1)
    for row in loader.provenance(0):
        alone = ftj.Loader(a if row["component_name"] == "a" else b, one)
        want = alone.host_batch(row["record"])  # unshuffled: step r of batch 1 is record r
        for key, value in batch.items():
            assert np.array_equal(value[row["row"]], want[key][0]), key
    assert loader.fingerprint()["config"]["packing"] is packing
    rows = ftj.Packing.WINDOWS if packing else ftj.Packing.PADDED
    assert [r.packing for r in loader.components] == [rows, rows]
    assert bool(batch["loss_mask"].all()) == packing  # padded rows of 3 tokens hold padding


def test_names_in_every_form_reach_provenance_and_fingerprint() -> None:
    a, b = make_split(20), make_split(20, base=500)
    forms = [
        Mixture({"web": (a, 3), "code": (b, 1)}, period=4),
        Mixture([("web", a, 3), ("code", b, 1)], period=4),
    ]
    cfg = ftj.LoaderConfig(batch_size=8, seq_len=2, shuffle=False)
    rows = [ftj.Loader(m, cfg).provenance(0) for m in forms]
    assert rows[0] == rows[1]
    assert [r["component_name"] for r in rows[0]] == ["web", "web", "code", "web"] * 2
    assert [r["component"] for r in rows[0]] == [0, 0, 1, 0] * 2
    fp = ftj.Loader(forms[0], cfg).fingerprint()["data"]
    assert [c["name"] for c in fp["components"]] == ["web", "code"]
    unnamed = Mixture([(a, 3), (b, 1)], period=4)
    assert unnamed.names == ("0", "1")
    by_name = Mixture(
        {"web": (a, 3), "code": (b, 1)}, period=4, schedule=[(1, {"code": 3, "web": 1})]
    )
    by_list = Mixture({"web": (a, 3), "code": (b, 1)}, period=4, schedule=[(1, [1, 3])])
    g = np.arange(40)
    assert all(
        np.array_equal(x, y)
        for x, y in zip(route(by_name, g, 4), route(by_list, g, 4), strict=True)
    )
    with pytest.raises(ValueError, match=r"name every component \['web', 'code'\]"):
        Mixture({"web": (a, 3), "code": (b, 1)}, schedule=[(1, {"web": 1})])
    with pytest.raises(ValueError, match="unique"):
        Mixture([("x", a, 1), ("x", b, 1)])


def test_common_mistakes_name_the_fix() -> None:
    url = memory_url()
    ftj.write_dataset(url, {"train": [[1, 2, 3]] * 4})
    ds = ftj.open_dataset(url)
    inner = Mixture([(ds["train"], 1)])
    cases = [
        (ds, r"pick a split: ds\['train'\]"),
        (url, r"open a split: ftj.open_dataset\("),
        (inner, "cannot hold a Mixture"),
        (None, r"expected a FlatTokens split \(ds\['train'\]\) or Records, got NoneType"),
    ]
    for source, fix in cases:
        with pytest.raises(TypeError, match=fix):
            Mixture([("x", source, 1)])
    with pytest.raises(TypeError, match="cannot hold a Mixture"):
        Mixture(inner)  # type: ignore[arg-type]


def megatron_split(weights: list[float], n: int) -> list[int]:
    """Megatron-LM's split indices, as its dataset builder computes them."""
    weights = [w / sum(weights) for w in weights]
    idx = [0]
    for i, w in enumerate(weights):
        idx.append(idx[i] + int(round(w * float(n))))  # noqa: RUF046 (as Megatron writes it)
    return [idx[0], *[i - (idx[-1] - n) for i in idx[1:]]]


@given(
    weights=st.lists(st.integers(0, 1000), min_size=1, max_size=4).filter(sum),
    n=st.integers(0, 10000),
)
def test_split_boundaries_follow_megatron(weights: list[int], n: int) -> None:
    assert split_boundaries(",".join(map(str, weights)), n) == megatron_split(weights, n)


def test_split_views_are_exact_sequence_ranges() -> None:
    ft = make_split(1000, length=3)
    train, valid, test = ft.split("949,50,1")
    assert (train.num_sequences, valid.num_sequences, test.num_sequences) == (949, 50, 1)
    assert valid.sequences([0])[0].tolist() == [1 + 949] * 3
    assert valid.tokens(0, 3).tolist() == [950] * 3
    assert test.num_tokens == 3 and valid.num_tokens == 150
    assert [v.num_sequences for v in ft.split([0.5, 0.5])] == [500, 500]
    with pytest.raises(IndexError, match="token range"):
        valid.tokens(0, 151)
    with pytest.raises(ValueError, match=r"weight 0 \('a'\) is not a finite non-negative number"):
        ft.split("a,b")


@settings(max_examples=30)
@given(
    lengths=st.lists(st.integers(1, 9), min_size=3, max_size=40),
    seq_len=st.integers(1, 6),
    cut=st.floats(0.1, 0.9),
)
def test_packed_records_never_cross_a_view(lengths: list[int], seq_len: int, cut: float) -> None:
    url = memory_url()
    seqs = [[i + 1] * n for i, n in enumerate(lengths)]
    ftj.write_dataset(
        url, {"train": seqs}, storage_format=ftj.StorageFormat(shard_tokens=64, chunk_tokens=8)
    )
    first, second = ftj.open_dataset(url)["train"].split([cut, 1 - cut])
    for view in (first, second):
        records = ftj.PackedRecords(view, seq_len)
        expected = [t for s in seqs[view.seq_range[0] : view.seq_range[1]] for t in s]
        assert len(records) == len(expected) // seq_len
        if len(records):
            windows = records.read(np.arange(len(records))).encoded[:, 1:] >> 1
            assert windows.reshape(-1).tolist() == expected[: len(records) * seq_len]


def test_mixture_from_yaml_config(tmp_path: Path) -> None:
    for name, base in (("web", 1), ("books", 100)):
        ftj.write_dataset(tmp_path / name, {"train": [[base + i] * 4 for i in range(100)]})
    web, books = str(tmp_path / "web"), str(tmp_path / "books")
    config = {"datasets": {web: 0.8, books: 0.2}, "split": "90,10", "seed": 5}
    train = mixture_from_config(config, "train")
    valid = mixture_from_config(config, "valid")
    assert [c.num_sequences for c in train.sources] == [90, 90]  # type: ignore[union-attr]
    assert [c.num_sequences for c in valid.sources] == [10, 10]  # type: ignore[union-attr]
    listed = mixture_from_config({**config, "split": [90, 10]}, "valid")
    assert [c.num_sequences for c in listed.sources] == [10, 10]  # type: ignore[union-attr]
    assert train.names == (web, books)
    loader = ftj.Loader(train, ftj.LoaderConfig(batch_size=10, seq_len=4))
    assert sorted(r["component"] for r in loader.provenance(0)) == [0] * 8 + [1] * 2
    with pytest.raises(ValueError, match="data has unknown key 'weights'; known: allow_mixed"):
        mixture_from_config({**config, "weights": 1})
    with pytest.raises(ValueError, match="use valid"):
        mixture_from_config(config, "validation")
    repo = Path(__file__).parent.parent / "configs" / "mixture.yaml"
    assert "datasets" in repo.read_text()


def test_mixture_config_takes_what_the_python_api_takes(tmp_path: Path) -> None:
    for name, base in (("web", 1), ("books", 100)):
        ftj.write_dataset(tmp_path / name, {"train": [[base + i] * 4 for i in range(100)]})
    web, books = str(tmp_path / "web"), str(tmp_path / "books")
    schedule = [{"step": 3, "weights": {"web": 1, "books": 3}}]
    config = {
        "datasets": {"web": {"url": web, "weight": 3}, "books": {"url": books, "weight": 1}},
        "seed": 7,
        "period": 8,
        "schedule": schedule,
    }
    listed = {
        **config,
        "datasets": [
            {"name": "web", "url": web, "weight": 3},
            {"name": "books", "url": books, "weight": 1},
        ],
    }
    by_hand = Mixture(
        {
            "web": (ftj.open_dataset(web)["train"], 3),
            "books": (ftj.open_dataset(books)["train"], 1),
        },
        seed=7,
        period=8,
        schedule=[(3, [1, 3])],
    )
    cfg = ftj.LoaderConfig(batch_size=8, seq_len=4, seed=1)
    want = [ftj.Loader(by_hand, cfg).host_batch(s)["targets"] for s in range(6)]
    for c in (config, listed):
        loader = ftj.Loader(mixture_from_config(c), cfg)
        assert loader.fingerprint() == ftj.Loader(by_hand, cfg).fingerprint()
        for s in range(6):
            assert np.array_equal(loader.host_batch(s)["targets"], want[s])
    with pytest.raises(ValueError, match="data has unknown key 'seq_len'; known: allow_mixed"):
        mixture_from_config({**config, "seq_len": 4})
    with pytest.raises(ValueError, match=r"data.schedule\[0\] has unknown key 'at'; known: step"):
        mixture_from_config({**config, "schedule": [{"at": 3}]})
    with pytest.raises(ValueError, match=r"data.schedule\[0\] must be \{step: N, weights"):
        mixture_from_config({**config, "schedule": [{"step": 3}]})


def test_datasets_of_different_tokenizers_do_not_mix_unless_asked() -> None:
    def split(name: str, hashed: str | None) -> ftj.FlatTokens:
        url = memory_url()
        tok = None if hashed is None else ftj.TokenizerInfo(name, hashed, 100)
        info = None if tok is None else ftj.DatasetInfo(tokenizer=tok)
        ftj.write_dataset(url, {"train": [[1, 2, 3]] * 4}, info=info)
        return ftj.open_dataset(url)["train"]

    gpt2, llama = (
        split("gpt2.json", "sha256:aaaaaaaaaaaaaaaa"),
        split("llama", "sha256:bbbbbbbbbbbbbbbb"),
    )
    copy, old = split("copy.json", "sha256:aaaaaaaaaaaaaaaa"), split("", None)
    with pytest.raises(
        ValueError, match=r"'web' was made with tokenizer gpt2.json .* but 'code' with llama"
    ):
        Mixture({"web": (gpt2, 1), "code": (llama, 1)})
    with pytest.raises(ValueError, match="allow_mixed_tokenizers=True"):
        Mixture([(gpt2, 1), (ftj.PackedRecords(llama, 2), 1)])
    Mixture({"web": (gpt2, 1), "code": (llama, 1)}, allow_mixed_tokenizers=True)
    Mixture({"web": (gpt2, 1), "same": (copy, 1), "old": (old, 1)})


def test_split_names_used_inconsistently_name_the_fix() -> None:
    url = memory_url()
    ftj.write_dataset(url, {"train": [[1, 2]], "validation": [[3]]})
    with pytest.raises(KeyError, match=r"has no split 'valid'.*: use 'validation'"):
        ftj.open_dataset(url)["valid"]


@settings(max_examples=25, deadline=None)
@given(weights=weight_lists, period=st.integers(1, 9), data=st.data())
def test_a_mixture_of_num_epochs_ends_where_a_component_would_begin_another(
    weights: list[float], period: int, data: st.DataObject
) -> None:
    k = len(weights)
    later = data.draw(st.lists(weight_lists.filter(lambda w: len(w) == k), max_size=2))
    steps = sorted(data.draw(st.sets(st.integers(1, 6), min_size=len(later), max_size=len(later))))
    if any(
        c == 0 and w > 0
        for ws in [weights, *later]
        for c, w in zip(reference_counts(ws, period), ws, strict=True)
    ):
        return  # a positive weight that gets no slot is refused
    sizes = data.draw(st.lists(st.integers(1, 5), min_size=k, max_size=k))
    batch, epochs = data.draw(st.integers(1, 4)), data.draw(st.integers(1, 2))
    comps = [make_split(n, base=1 + 10 * c) for c, n in enumerate(sizes)]
    mix = Mixture(
        list(zip(comps, weights, strict=True)),
        period=period,
        schedule=list(zip(steps, later, strict=True)),
    )
    config = ftj.LoaderConfig(batch_size=batch, seq_len=4, num_epochs=epochs, seed=2)
    loader = ftj.Loader(mix, config)
    starts = [0, *(s * batch for s in steps)]
    comp, sample = reference_schedule([weights, *later], starts, period, 40 * batch * 5)
    pairs = enumerate(zip(comp, sample, strict=True))
    end = next(g for g, (c, j) in pairs if j >= epochs * sizes[c])
    assert loader.num_batches == -(-end // batch)
    read: list[list[int]] = [[] for _ in range(k)]
    for step in range(loader.num_batches):
        for r in loader.provenance(step):
            g = step * batch + r["row"]
            assert r.get("padding", False) == (g >= end)
            if g < end:
                assert (r["component"], r["epoch"]) == (comp[g], sample[g] // sizes[comp[g]])
                read[comp[g]].append(r["record"])
    for c, records in enumerate(read):  # each epoch of a component reads each record once
        counts = np.bincount(records, minlength=sizes[c])
        assert counts.max() - counts.min() <= 1
    with pytest.raises(IndexError, match="a mixture ends where a component would begin"):
        loader.provenance(loader.num_batches)


def test_a_weight_change_moves_the_end_of_a_mixture_of_num_epochs() -> None:
    small, big = make_split(3, base=1), make_split(40, base=100)
    config = ftj.LoaderConfig(batch_size=2, seq_len=4, num_epochs=1, shuffle=False)
    steered = ftj.Loader(Mixture([(small, 1), (big, 1)], period=2), config)
    assert steered.num_batches == 3  # small's 4th sample would be global sample 6
    steered.set_weights(2, [0, 1])  # from step 2 small is not read: big's 40 end it
    declared = ftj.Loader(Mixture([(small, 1), (big, 1)], period=2, schedule=[(2, [0, 1])]), config)
    assert steered.num_batches == declared.num_batches == 2 + (40 - 2) // 2
    last = steered.num_batches - 1
    assert steered.provenance(last) == declared.provenance(last)
    assert [r["record"] for r in steered.provenance(last)] == [38, 39]
