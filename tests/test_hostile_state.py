"""Issue 27, finding 1 (and the ``--state`` parts of 9 and 10): a saved state
restores only onto the data and config it was saved from."""

from __future__ import annotations

import copy
import functools
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from commands import run_main
from hypothesis import given, settings
from hypothesis import strategies as st
from memurls import memory_url

import flat_tokens_jax as ftj

SEQS = [[i % 7 + 1] * (i % 5 + 1) for i in range(120)]
CFG = ftj.LoaderConfig(batch_size=4, seq_len=8, seed=3)


def split(seqs: list[list[int]] = SEQS, info: ftj.DatasetInfo | None = None) -> ftj.FlatTokens:
    url = memory_url()
    storage_format = ftj.StorageFormat(shard_tokens=64, chunk_tokens=8)
    ftj.write_dataset(url, {"train": seqs}, storage_format=storage_format, info=info)
    return ftj.open_dataset(url)["train"]


def tokenizer(name: str, vocab_hash: str) -> ftj.DatasetInfo:
    return ftj.DatasetInfo(tokenizer=ftj.TokenizerInfo(name, vocab_hash, 64))


def saved(source: Any, cfg: ftj.LoaderConfig = CFG, step: int = 5, **kw: Any) -> dict[str, Any]:
    loader = ftj.Loader(source, cfg, **kw)
    loader.next_step = step
    state: dict[str, Any] = json.loads(json.dumps(loader.state()))
    return state


def mixture(a: ftj.FlatTokens, b: ftj.FlatTokens) -> ftj.Mixture:
    return ftj.Mixture({"web": (a, 1), "code": (b, 3)}, schedule=[(4, {"web": 1, "code": 1})])


def refusal(loader: ftj.Loader, state: Any) -> str:
    with pytest.raises(ftj.StateMismatch) as e:
        loader.restore(state)
    return str(e.value)


# ----------------------------------------------------------- other data


def test_a_mixture_state_does_not_restore_into_a_single_split() -> None:
    web, code = split(), split([[9, 8]] * 50)
    state = saved(mixture(web, code))
    for other in (web, split([[5] * 3] * 70)):
        text = refusal(ftj.Loader(other, CFG), state)
        assert (
            "fingerprint.data: saved a Mixture of components ['web', 'code'], now a single" in text
        )
    # and the other way round: a split's state into a mixture that holds that split
    text = refusal(ftj.Loader(mixture(web, code), CFG), saved(web))
    assert "fingerprint.data: saved a single split (packed records), now a Mixture" in text


def test_a_state_of_data_of_the_same_shape_but_another_tokenizer_or_contents_is_refused() -> None:
    gpt2 = split(info=tokenizer("gpt2.json", "sha256:" + "a" * 16))
    phi3 = split(info=tokenizer("phi3.json", "sha256:" + "b" * 16))
    plain = split()
    state = saved(gpt2)
    assert state["fingerprint"]["data"]["tokenizer"] == "sha256:" + "a" * 16
    text = refusal(ftj.Loader(phi3, CFG), state)
    assert "fingerprint.data.tokenizer: saved 'sha256:aaaa" in text
    assert text.count("\n") == 1, "the tokens are the same: only the tokenizer differs"
    refusal(ftj.Loader(plain, CFG), state)
    # the same tokenizer under another name is the same vocabulary
    same = split(info=tokenizer("elsewhere/gpt2.json", "sha256:" + "a" * 16))
    assert ftj.Loader(same, CFG).restore(state) == 5
    # in a mixture, the component is named
    state = saved(mixture(gpt2, plain))
    text = refusal(ftj.Loader(mixture(phi3, plain), CFG), state)
    assert "fingerprint.data.components[0].tokenizer: saved 'sha256:aaaa" in text
    # other tokens, the same counts and largest id
    a = split()
    b = split([[8 - (i % 7 + 1)] * (i % 5 + 1) for i in range(120)])  # ids 1..7 mirrored
    fa, fb = (ftj.Loader(x, CFG).fingerprint()["data"] for x in (a, b))
    same_shape = ("num_tokens", "num_sequences", "max_token_id", "seq_len", "records")
    assert all(fa[k] == fb[k] for k in same_shape)
    assert "fingerprint.data.sample_digest" in refusal(ftj.Loader(b, CFG), saved(a))
    assert "fingerprint.data.components[1].sample_digest" in refusal(
        ftj.Loader(mixture(a, a), CFG), saved(mixture(a, b))
    )
    # components in another order are other data
    text = refusal(ftj.Loader(mixture(b, a), CFG), saved(mixture(a, b)))
    assert "fingerprint.data.components[0].sample_digest" in text


def test_data_that_differs_in_one_value_no_sample_reads_is_refused() -> None:
    """The sampled digest reads 64 tokens; the recorded content digest covers
    every value, so one token changed anywhere else is other data."""
    flat = [t for seq in SEQS for t in seq]
    sampled = set(np.unique(np.linspace(0, len(flat) - 1, 64).astype(np.int64)).tolist())
    unsampled = [i for i in range(len(flat)) if i not in sampled]
    for at in unsampled[:: len(unsampled) // 5]:
        seqs = [list(seq) for seq in SEQS]
        lengths = np.cumsum([len(seq) for seq in seqs])
        j = int(np.searchsorted(lengths, at, side="right"))
        k = at - (int(lengths[j - 1]) if j else 0)
        seqs[j][k] = seqs[j][k] % 7 + 1  # another id in 1..7: the same largest id
        a, b = split(), split(seqs)
        fa, fb = (ftj.Loader(x, CFG).fingerprint()["data"] for x in (a, b))
        assert fa["sample_digest"] == fb["sample_digest"]
        text = refusal(ftj.Loader(b, CFG), saved(a))
        assert "fingerprint.data.content" in text
        assert text.count("\n") == 1, "only the whole contents differ"
        assert ftj.Loader(split(), CFG).restore(saved(a)) == 5  # a rewrite of the same data


def test_a_forged_minimal_state_is_refused(tmp_path: Path) -> None:
    forged = {"step": 100, "fingerprint": {"batch_size": 4}}
    for source in (split(), mixture(split(), split())):
        text = refusal(ftj.Loader(source, CFG), forged)
        assert "fingerprint.data: missing from the saved state" in text
        assert "fingerprint.config: missing from the saved state" in text
    (tmp_path / "forged.json").write_text(json.dumps(forged))
    code, _, err = run_show("--state", str(tmp_path / "forged.json"), "--step", "0")
    assert code == 1 and err.count("\n") == 1 and "fingerprint.config" in err


def test_a_phased_state_given_to_a_loader_says_to_restore_it_into_a_phased_loader() -> None:
    """Issue 35: ``Loader.restore(phased_loader.state())`` said ``fingerprint:
    expected a mapping, got None``."""
    a, b = split(), split([[5, 6]] * 40)
    run = ftj.PhasedLoader([ftj.Phase(0, a, CFG), ftj.Phase(3, b, CFG)])
    run.next_step = 5
    state = json.loads(json.dumps(run.state()))
    loader = ftj.Loader(a, CFG)
    message = refusal(loader, state)
    assert "a PhasedLoader's state (a run in 2 phases)" in message
    assert "ftj.PhasedLoader(phases).restore(state)" in message
    assert "fingerprint: expected a mapping" not in message
    assert loader.state_differences(state) == [
        "phases: a PhasedLoader's state (a run in 2 phases): build the saved run's phases "
        "and restore it with ftj.PhasedLoader(phases).restore(state)"
    ]
    # The reverse is a run of one phase, which a PhasedLoader continues.
    assert ftj.PhasedLoader([ftj.Phase(0, a, CFG), ftj.Phase(9, b, CFG)]).restore(saved(a)) == 5


# ------------------------------------------------ fields removed one at a time


def removals(value: Any, path: str) -> Iterator[tuple[str, str, Any]]:
    """``(removed path, path the refusal names, state without it)`` for every
    key and list entry under ``value`` (whose own path is ``path``)."""
    if isinstance(value, dict):
        for key in list(value):
            here = f"{path}.{key}" if path else key
            yield here, here, {k: v for k, v in value.items() if k != key}
            for inner, named, changed in removals(value[key], here):
                yield inner, named, {**value, key: changed}
    elif isinstance(value, list):
        for i, item in enumerate(value):
            here = f"{path}[{i}]"
            yield here, path, value[:i] + value[i + 1 :]
            for inner, named, changed in removals(item, here):
                yield inner, named, [*value[:i], changed, *value[i + 1 :]]


def pattern(path: str) -> str:
    return re.sub(r"\[\d+\]", "[]", path)


@pytest.mark.parametrize("kind", ["packed", "padded", "bins", "mixture"])
def test_every_field_removed_one_at_a_time(kind: str, tmp_path: Path) -> None:
    """The format is the state as saved now: every field is needed, and a
    refusal names the one removed (or the list it was removed from)."""
    ft = split()
    if kind == "mixture":
        source: Any = mixture(ft, split([[9, 8, 7]] * 40))
    else:
        source = ft
    packing = {"packed": True, "padded": False, "bins": "bins", "mixture": True}[kind]
    cfg = ftj.LoaderConfig(batch_size=[(0, 2), (3, 4)], seq_len=8, seed=3, packing=packing)
    loader = ftj.Loader(source, cfg, plan_cache=tmp_path)
    state = saved(source, cfg, plan_cache=tmp_path)
    wrong = []
    checked = 0
    for removed, named, changed in removals({k: v for k, v in state.items()}, ""):
        if named.startswith("fingerprint.batch_size"):
            named = "fingerprint.batch_size"  # a schedule is named whole
        if re.fullmatch(r"sources\[\d+\]\.url", removed):
            # Without its url a source reads as custom records: the refusal
            # names what that form lacks, in the same source.
            named = removed.removesuffix(".url")
        checked += 1
        try:
            loader.restore(changed)
        except ftj.StateMismatch as e:
            if named not in str(e):
                wrong.append(f"{removed}: refused without naming {named}: {e}")
            continue
        wrong.append(f"{removed}: accepted")
    assert checked > 20
    assert wrong == []


def test_states_of_earlier_shapes_are_refused_naming_each_field() -> None:
    """The shapes of states before ``loss_mask``, component names, ``samples``,
    ``sources``, the top-level ``batch_size`` and the tokenizer existed are
    not this version's format: each is refused, naming what is missing or
    unknown, not resumed with a guess."""
    ft, other = split(), split([[9, 8, 7]] * 40)
    now = saved(ft)["fingerprint"]
    first = {
        "step": 5,
        "fingerprint": {
            "data": {k: v for k, v in now["data"].items() if k not in ("loss_mask", "tokenizer")},
            "config": {**now["config"], "batch_size": 4, "vocab_size": None},
        },
    }
    loader = ftj.Loader(ft, CFG)
    text = refusal(loader, first)
    assert text.startswith("not a loader state this version reads:")
    for line in (
        "samples: missing from the saved state",
        "sources: missing from the saved state",
        "fingerprint.batch_size: missing from the saved state",
        "fingerprint.config.batch_size: saved 4, a field this version's states do not hold",
        "fingerprint.config.vocab_size: saved None, a field this version's states do not hold",
    ):
        assert f"\n  {line}" in text, line
    assert loader.state_differences(first) == [line.strip() for line in text.splitlines()[1:]]
    # The same state in today's shape but for the data's recorded fields:
    # compared with the data, each is named.
    state = saved(ft)
    for key in ("loss_mask", "tokenizer"):
        del state["fingerprint"]["data"][key]
    text = refusal(loader, state)
    assert "fingerprint.data.loss_mask: missing from the saved state, now False" in text
    assert "fingerprint.data.tokenizer: missing from the saved state, now None" in text
    mix = ftj.Mixture({"web": (ft, 1), "code": (other, 3)})
    state = saved(mix)
    for c in state["fingerprint"]["data"]["components"]:
        del c["name"]
    text = refusal(ftj.Loader(mix, CFG), state)
    assert "fingerprint.data.components[1].name: missing from the saved state, now 'code'" in text


# ----------------------------------------------------------- wrong types


def nodes(value: Any, path: str) -> Iterator[tuple[str, Any]]:
    """Every ``(path, value)`` under ``value``, mappings and lists included."""
    if path:
        yield path, value
    if isinstance(value, dict):
        for key, item in value.items():
            yield from nodes(item, f"{path}.{key}" if path else key)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from nodes(item, f"{path}[{i}]")


def same_value_other_type(value: Any) -> list[Any]:
    """Values a loose comparison takes for ``value``: ``True`` for 1, ``5.0`` for 5, ..."""
    if isinstance(value, bool):
        return [int(value), float(value)]
    if isinstance(value, int):
        return [float(value)] + ([bool(value)] if value in (0, 1) else [])
    if isinstance(value, float) and value.is_integer():
        return [int(value)]
    return []


def other_types(value: Any) -> list[Any]:
    """Values of another JSON type than ``value``'s."""
    shapes = [str(value), [value], {"0": value}, None, 1.5, True]
    out = same_value_other_type(value)
    for v in shapes:
        if type(v) is not type(value) and not (isinstance(value, dict) and isinstance(v, dict)):
            out.append(v)
    return out


def put(state: Any, path: str, value: Any) -> Any:
    out = copy.deepcopy(state)
    keys = re.findall(r"[^.\[\]]+", path)
    at = out
    for key in keys[:-1]:
        at = at[int(key)] if isinstance(at, list) else at[key]
    last = keys[-1]
    at[int(last) if isinstance(at, list) else last] = value
    return out


@functools.cache
def mixed() -> tuple[ftj.Loader, dict[str, Any], ftj.Loader]:
    """A mixture's loader and its state, and a loader of its first component alone."""
    web = split()
    source = mixture(web, split([[9, 8, 7]] * 40))
    return ftj.Loader(source, CFG), saved(source), ftj.Loader(web, CFG)


@settings(max_examples=150)
@given(data=st.data())
def test_a_value_of_another_type_is_named_never_a_traceback(data: st.DataObject) -> None:
    """Anywhere in a state: ``True`` for 1, ``5.0`` for 5 (a loose comparison
    took them), a string, list, mapping or null for anything."""
    loader, state, alone = mixed()
    found = [(p, v) for p, v in nodes(state, "") if not p.startswith("sources")]
    path, value = data.draw(st.sampled_from(found))
    forged = data.draw(st.sampled_from(other_types(value)))
    refusal(alone, put(state, path, forged))
    text = refusal(loader, put(state, path, forged))
    assert (path if "batch_size" not in path else "fingerprint.batch_size") in text


def test_config_values_equal_in_python_but_not_in_type_are_refused() -> None:
    ft = split()
    state = saved(ft)
    loader = ftj.Loader(ft, CFG)
    for key, value, form in (
        ("shuffle", 1, "True or False"),
        ("seed", 3.0, "an int in [0, 2**64 - 1]"),
        ("num_epochs", False, "an int >= 1 or null/None"),
    ):
        forged = put(state, f"fingerprint.config.{key}", value)
        assert f"fingerprint.config.{key} must be {form}, got {value!r}" in refusal(loader, forged)
    assert "samples must be an int" in refusal(loader, put(state, "samples", 20.0))
    # A field this version does not write may change batches in the version that wrote it.
    extra = put(state, "fingerprint.config.phases", [[0, "other"]])
    assert (
        "fingerprint.config.phases: saved [[0, 'other']], a field this version's states do "
        "not hold (a state of another version?)"
    ) in refusal(loader, extra)
    # An entry of the data's identity this loader lacks: compared, and named.
    extra = put(state, "fingerprint.data.phases", 2)
    assert "fingerprint.data.phases: saved 2, which this loader does not have" in refusal(
        loader, extra
    )


# ----------------------------------------------------------- show --state


def run_show(*args: str) -> tuple[int, str, str]:
    return run_main("show", *args)


def on_disk(tmp_path: Path) -> dict[str, Any]:
    """A mixture over datasets in files, so that ``show --state`` can open them."""
    urls = []
    for name, seqs in (("web", SEQS), ("code", [[9, 8, 7]] * 40)):
        url = str(tmp_path / name)
        ftj.write_dataset(
            url, {"train": seqs}, storage_format=ftj.StorageFormat(shard_tokens=64, chunk_tokens=8)
        )
        urls.append(url)
    web, code = (ftj.open_dataset(u)["train"] for u in urls)
    return saved(mixture(web, code))


def drop(path: str) -> Any:
    def change(state: Any) -> Any:
        keys = re.findall(r"[^.\[\]]+", path)
        out = copy.deepcopy(state)
        at = out
        for key in keys[:-1]:
            at = at[int(key)] if isinstance(at, list) else at[key]
        del at[keys[-1]]
        return out

    return change


def setting(path: str, value: Any) -> Any:
    return lambda state: put(state, path, value)


MALFORMED = [
    (drop("sources[0].split"), "sources[0].split: missing"),
    (drop("sources[1].url"), "sources[1].repr: missing"),
    (drop("sources[0].sequences"), "sources[0].sequences: missing"),
    (setting("sources[0]", "web"), "sources[0]: expected a mapping"),
    (setting("sources", "web"), "sources: expected a non-empty list"),
    (setting("sources[0].sequences", [1]), "sources[0].sequences: expected [first, stop]"),
    (setting("sources[0].sequences", ["0", 3]), "sources[0].sequences: expected [first, stop]"),
    (setting("sources[0].split", 0), "sources[0].split: expected the split's name"),
    (setting("sources[0].url", None), "sources[0].url: expected the dataset URL"),
    (
        setting("sources", [{"name": "web", "url": "x", "split": "train", "sequences": [0, 1]}]),
        "sources: 1 entries, but fingerprint.data.components has 2",
    ),
    (setting("fingerprint.config.seed", "x"), "fingerprint.config.seed must be an int"),
    (setting("fingerprint.config.packing", "yes"), "fingerprint.config.packing must be"),
    (setting("fingerprint.batch_size", "4"), "fingerprint.batch_size must be an int or a sched"),
    (drop("fingerprint.data.steps"), "fingerprint.data.steps: missing"),
    (setting("fingerprint.data.steps", "x"), "fingerprint.data.steps: expected a list"),
    (setting("fingerprint.data.steps", [0]), "fingerprint.data.steps: expected 2 ints"),
    (setting("fingerprint.data.weights", [[1]]), "fingerprint.data.weights[0]: expected 2 numbers"),
    (setting("fingerprint.data.weights", [[1, "x"], [1, 1]]), "fingerprint.data.weights[0]"),
    (setting("fingerprint.data.periods", [None, 4]), "fingerprint.data.periods[0] must be an int"),
    (setting("fingerprint.data.periods", [4]), "fingerprint.data.periods: expected 2 ints >= 1"),
    (setting("fingerprint.data.seed", "x"), "fingerprint.data.seed must be an int in [0, 2**64"),
    (setting("fingerprint.data.seed", -1), "fingerprint.data.seed must be an int in [0, 2**64"),
    (setting("fingerprint.data.components", "x"), "fingerprint.data.components: expected a list"),
    (setting("fingerprint.data", [1]), "fingerprint.data: expected a mapping"),
    (setting("fingerprint", "x"), "fingerprint: expected a mapping"),
    (drop("fingerprint"), "fingerprint: missing"),
    (setting("step", "4"), "step must be an int in [0, 2**63 - 1], got '4' (a string"),
    (setting("fingerprint.config.seed", 1.5), "fingerprint.config.seed must be an int"),
    (setting("fingerprint.config.web", 1), "fingerprint.config.web: saved 1, a field this"),
    (setting("format", 2), "format: saved 2, a field this version's states do not hold"),
    (drop("step"), "step: missing"),
    (lambda state: [state], "expected the mapping loader.state() saves"),
]


def test_show_state_on_malformed_files_names_the_field_in_one_line(tmp_path: Path) -> None:
    state = on_disk(tmp_path)
    good = tmp_path / "state.json"
    good.write_text(json.dumps(state))
    code, _, err = run_show("--state", str(good), "--step", "5", "--json")
    assert code == 0, err
    wrong = []
    for change, named in MALFORMED:
        bad = tmp_path / "bad.json"
        bad.write_text(json.dumps(change(state)))
        try:
            code, _, err = run_show("--state", str(bad), "--step", "5")
        except Exception as e:
            wrong.append(f"{named}: raised {type(e).__name__}: {e}")
            continue
        if code != 1 or err.count("\n") != 1 or named not in err or str(bad) not in err:
            wrong.append(f"{named}: exit {code}, {err!r}")
    for text in ("{not json", "\ufeff\x00", "", "[" * 100_000 + "]" * 100_000):
        bad.write_text(text)
        code, _, err = run_show("--state", str(bad), "--step", "5")
        if code != 1 or err.count("\n") != 1 or f"--state {bad}: not JSON" not in err:
            wrong.append(f"{text!r}: exit {code}, {err!r}")
    assert wrong == []


def test_restore_and_show_refuse_a_malformed_state_with_the_same_lines(tmp_path: Path) -> None:
    """One schema: ``Loader.restore``, ``PhasedLoader.restore`` (of several
    phases, given a Loader's state) and ``show --state`` name the same fields."""
    state = on_disk(tmp_path)
    web, code = (ftj.open_dataset(tmp_path / name)["train"] for name in ("web", "code"))
    loader = ftj.Loader(mixture(web, code), CFG)
    run = ftj.PhasedLoader(
        [ftj.Phase(0, mixture(web, code), CFG), ftj.Phase(9, split([[5, 6]] * 40), CFG)]
    )
    assert loader.state_differences(state) == run.state_differences(state) == []
    bad = tmp_path / "bad.json"
    for change, named in MALFORMED[:-1]:  # the last is no mapping: restore's TypeError
        changed = change(state)
        lines = loader.state_differences(changed)
        assert any(named in line for line in lines), (named, lines)
        assert run.state_differences(changed) == lines
        for restore in (loader.restore, run.restore):
            assert refusal_of(restore, changed) == "\n  ".join(
                ["not a loader state this version reads:", *lines]
            )
        bad.write_text(json.dumps(changed))
        exit_code, _, err = run_show("--state", str(bad), "--step", "5")
        assert exit_code == 1
        assert err == f"show: --state {bad}: not a loader state this version reads: " + (
            "; ".join(lines) + "\n"
        )


def refusal_of(restore: Any, state: Any) -> str:
    with pytest.raises(ftj.StateMismatch) as e:
        restore(state)
    return str(e.value)


def test_show_state_of_an_earlier_shape_names_what_it_lacks(tmp_path: Path) -> None:
    state = on_disk(tmp_path)
    del state["samples"]
    (tmp_path / "old.json").write_text(json.dumps(state))
    code, _, err = run_show("--state", str(tmp_path / "old.json"), "--step", "5", "--json")
    assert code == 1 and err.count("\n") == 1
    assert "not a loader state this version reads: samples: missing from the saved state" in err
    for c in state["fingerprint"]["data"]["components"]:
        del c["loss_mask"]
    state["samples"] = 20
    (tmp_path / "old.json").write_text(json.dumps(state))
    code, _, err = run_show("--state", str(tmp_path / "old.json"), "--step", "5")
    assert code == 1 and "the data found is not what the saved run read" in err
    assert "fingerprint.data.components[1].loss_mask: missing from the saved state" in err


def without(state: Any, path: str) -> Any:
    keys = re.findall(r"[^.\[\]]+", path)
    out = copy.deepcopy(state)
    at = out
    for key in keys[:-1]:
        at = at[int(key)] if isinstance(at, list) else at[key]
    del at[int(keys[-1]) if isinstance(at, list) else keys[-1]]
    return out


@settings(max_examples=100)
@given(data=st.data())
def test_show_state_never_raises_on_a_changed_field(
    data: st.DataObject, disk_state: tuple[dict[str, Any], Path]
) -> None:
    """Any field of a state file (sources included) removed or given another
    type: ``show`` shows the run or exits 1 with a message, never a traceback."""
    state, folder = disk_state
    path, value = data.draw(st.sampled_from(list(nodes(state, ""))))
    if data.draw(st.booleans()):
        changed = without(state, path)
    else:
        changed = put(state, path, data.draw(st.sampled_from(other_types(value))))
    bad = folder / "changed.json"
    bad.write_text(json.dumps(changed))
    code, _, err = run_show("--state", str(bad), "--step", "5")
    assert code in (0, 1) and (code == 0 or err.startswith("show: "))


@pytest.fixture(scope="module")
def disk_state(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    folder = tmp_path_factory.mktemp("state-on-disk")
    return on_disk(folder), folder


def test_show_state_of_a_phase_whose_data_now_holds_fewer_sequences_names_the_phase(
    tmp_path: Path,
) -> None:
    """Issue 35: a phase whose URL now holds other data reported a sequence
    range instead of saying that the phase's data is not what the run read."""
    urls = [str(tmp_path / name) for name in ("a", "b")]
    for url, seqs in zip(urls, (SEQS, [[9, 8, 7]] * 40), strict=True):
        ftj.write_dataset(url, {"train": seqs})
    a, b = (ftj.open_dataset(u)["train"] for u in urls)
    run = ftj.PhasedLoader([ftj.Phase(0, a, CFG), ftj.Phase(3, b.split("1,1")[1], CFG)])
    run.next_step = 5
    path = tmp_path / "state.json"
    path.write_text(json.dumps(run.state()))
    ftj.write_dataset(urls[1], {"train": [[9, 8, 7]] * 10}, overwrite=True)
    code, _, err = run_show("--state", str(path), "--step", "4")
    assert code == 1
    assert err.startswith(f"show: {path}: phase 1 (from step 3): its data is not what the saved")
    assert "sequence range [20, 40) is outside [0, 10]" in err
