"""Issue 27, findings 2, 9 and 10: one strict parser for every config surface.

Finding 2: YAML strings are not booleans, fractions are not ints, weights are
numbers, seeds and periods are in range, in Python and in a ``data`` section.
Finding 9: ``show --config`` with malformed YAML, ``!!python`` tags or wrong
types answers one line naming the file and the value's path; no traceback
reaches a CLI user. Finding 10: extreme weights work or say what to change.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from commands import run_main
from hypothesis import example, given
from hypothesis import strategies as st
from memurls import memory_url

import flat_tokens_jax as ftj
from flat_tokens_jax.core.yamlfile import read_yaml
from flat_tokens_jax.loader.phaseconfig import phases_from_yaml
from flat_tokens_jax.sampling.mixture import Period, period_counts
from flat_tokens_jax.sampling.schedule import BatchSchedule
from flat_tokens_jax.sampling.steering import Steering


def dataset(token: int, tokenizer: tuple[str, str] | None = None) -> str:
    url = memory_url()
    info = None
    if tokenizer is not None:
        info = ftj.DatasetInfo(tokenizer=ftj.TokenizerInfo(tokenizer[0], tokenizer[1], 100))
    ftj.write_dataset(url, {"train": [[token] * 3] * 12}, info=info)
    return url


WEB, CODE = dataset(1), dataset(2)
GPT2 = dataset(3, ("gpt2", "sha256:aaaaaaaaaaaaaaaa"))
PHI3 = dataset(4, ("phi-3", "sha256:bbbbbbbbbbbbbbbb"))


def data(**changes: Any) -> dict[str, Any]:
    return {
        "datasets": {"web": {"url": WEB, "weight": 1}, "code": {"url": CODE, "weight": 1}},
        **changes,
    }


def with_weight(weight: Any) -> dict[str, Any]:
    return {"datasets": {"web": {"url": WEB, "weight": weight}, "code": {"url": CODE, "weight": 1}}}


MIXED_TOKENIZERS = {"datasets": {GPT2: 1, PHI3: 1}}

# (data section, the path its error must name)
BAD_DATA = [
    ({**MIXED_TOKENIZERS, "allow_mixed_tokenizers": "false"}, "data.allow_mixed_tokenizers"),
    ({**MIXED_TOKENIZERS, "allow_mixed_tokenizers": "no"}, "data.allow_mixed_tokenizers"),
    ({**MIXED_TOKENIZERS, "allow_mixed_tokenizers": 0}, "data.allow_mixed_tokenizers"),
    (data(seed=1.9), "data.seed"),
    (data(seed=2.0), "data.seed"),
    (data(seed=-1), "data.seed"),
    (data(seed="abc"), "data.seed"),
    (data(seed=[1]), "data.seed"),
    (data(seed=True), "data.seed"),
    (data(period=0), "data.period"),
    (data(period="x"), "data.period"),
    (data(period=2.5), "data.period"),
    (data(schedule=[{"step": 2.5, "weights": [1, 2]}]), "data.schedule[0].step"),
    (data(schedule=[{"step": [1], "weights": [1, 2]}]), "data.schedule[0].step"),
    (data(schedule=[{"step": "7", "weights": [1, 2]}]), "data.schedule[0].step"),
    (data(schedule=[{"step": 3, "weights": [True, 2]}]), "data.schedule[0].weights[0]"),
    (data(schedule=[{"step": 3, "weights": {"web": None, "code": 1}}]), "weights.web"),
    (with_weight(True), "data.datasets.web.weight"),
    (with_weight([1]), "data.datasets.web.weight"),
    (with_weight(None), "data.datasets.web.weight"),
    (with_weight("1"), "data.datasets.web.weight"),
    (with_weight(-1), "data.datasets.web.weight"),
    (with_weight(math.inf), "data.datasets.web.weight"),
    (
        {"datasets": [{"url": WEB, "weight": 1}, {"url": CODE, "weight": True}]},
        "data.datasets[1].weight",
    ),
    ({"datasets": {WEB: None}}, f"data.datasets[{WEB!r}]"),
    ({"datasets": 3}, "data.datasets"),
]


# ids without the random memory:// names, the same in every xdist worker
@pytest.mark.parametrize(
    ("section", "path"), BAD_DATA, ids=[path.replace(WEB, "WEB") for _, path in BAD_DATA]
)
def test_a_bad_data_value_is_refused_by_its_path(section: dict[str, Any], path: str) -> None:
    with pytest.raises(ValueError) as e:
        ftj.mixture_from_config(section)
    assert path in str(e.value) and "must" in str(e.value), str(e.value)


def splits() -> tuple[ftj.FlatTokens, ftj.FlatTokens]:
    return ftj.open_dataset(WEB)["train"], ftj.open_dataset(CODE)["train"]


@pytest.mark.parametrize(
    ("arguments", "path"),
    [
        ({"seed": -1}, "Mixture.seed"),
        ({"seed": "abc"}, "Mixture.seed"),
        ({"seed": 1.9}, "Mixture.seed"),
        ({"seed": 2**64}, "Mixture.seed"),
        ({"period": 0}, "Mixture.period"),
        ({"period": 2.5}, "Mixture.period"),
        ({"period": True}, "Mixture.period"),
        ({"period": 2**40}, "Mixture.period"),
        ({"schedule": [(2.5, [1, 2])]}, "Mixture.schedule[0] step"),
        ({"schedule": [("3", [1, 2])]}, "Mixture.schedule[0] step"),
        ({"schedule": [(3, [1, "2"])]}, "Mixture weight of '1' from step 3"),
        ({"allow_mixed_tokenizers": "false"}, "Mixture.allow_mixed_tokenizers"),
        ({"weights": [True, 1]}, "Mixture weight of '0'"),
        ({"weights": [None, 1]}, "Mixture weight of '0'"),
    ],
)
def test_mixture_arguments_are_checked(arguments: dict[str, Any], path: str) -> None:
    web, code = splits()
    weights = arguments.pop("weights", [1, 1])
    with pytest.raises(ValueError) as e:
        ftj.Mixture([(web, weights[0]), (code, weights[1])], **arguments)
    assert path in str(e.value) and "must be" in str(e.value), str(e.value)


@pytest.mark.parametrize(
    ("weights", "same_as"),
    [([1e308, 1e308], [1, 1]), ([1e308, 1e308, 1e308], [1, 1, 1]), ([1.5e308, 5e307], [3, 1])],
)
def test_huge_weights_blend_as_their_ratio(weights: list[float], same_as: list[float]) -> None:
    web, code = splits()
    sources = [web, code, web][: len(weights)]
    huge = ftj.Mixture(
        [(f"{i}", s, w) for i, (s, w) in enumerate(zip(sources, weights, strict=True))]
    )
    small = ftj.Mixture(
        [(f"{i}", s, w) for i, (s, w) in enumerate(zip(sources, same_as, strict=True))]
    )
    assert huge.periods[0].period == small.periods[0].period
    np.testing.assert_array_equal(huge.periods[0].counts, small.periods[0].counts)
    four = BatchSchedule.of(4)
    np.testing.assert_array_equal(
        Steering(huge, four).route(np.arange(50))[0], Steering(small, four).route(np.arange(50))[0]
    )


@given(
    weights=st.lists(st.integers(0, 1000), min_size=1, max_size=5).filter(any),
    exponent=st.sampled_from([-300, -100, 0, 100, 300, 305]),
)
def test_weights_blend_the_same_at_any_scale(weights: list[int], exponent: int) -> None:
    scaled = [w * 10.0**exponent for w in weights]
    assert all(math.isfinite(w) for w in scaled)
    want = Period.of_counts(period_counts(weights, 1000))
    got = Period.of_counts(period_counts(scaled, 1000))
    np.testing.assert_array_equal(got.counts, want.counts)
    np.testing.assert_array_equal(got.component, want.component)


@pytest.mark.parametrize("weights", [[1, 1e-320], [1e308, 1e-308], [1e308, 5e-324]])
def test_a_share_too_small_for_any_period_says_to_raise_the_weight(weights: list[float]) -> None:
    web, code = splits()
    with pytest.raises(ValueError, match=r"component\(s\) \['1'\] get no sample .* raise their"):
        ftj.Mixture([(web, weights[0]), (code, weights[1])])


def test_a_small_share_names_the_period_it_needs() -> None:
    web, code = splits()
    with pytest.raises(ValueError, match="pass a period of at least 10000001"):
        ftj.Mixture([(web, 1), (code, 1e-7)])
    assert ftj.Mixture([(web, 1), (code, 1e-7)], period=10000001).periods[0].counts[1] == 1


# --- the run YAML, through `flat-tokens show --config` and LoaderConfig.from_yaml


def yaml_of(section: dict[str, Any]) -> str:
    return yaml.safe_dump({"loader": {"batch_size": 2, "seq_len": 4}, "data": section})


BAD_RUNS = [
    ("loader: {batch_size: 2, seq_len: 4\n", ["line 2", "not valid YAML"]),
    ("loader: !!python/object/apply:os.system ['echo hi']\n", ["python/object", "no !!python"]),
    ("loader: !!python/name:os.system\n", ["python/name"]),
    ("loader: [1, 2]\n", ["'loader' section is not a mapping"]),
    ("- 1\n", ["not a mapping"]),
    ("loader: {batch_size: 2, seq_len: 4, seed: 1.9}\n", ["loader.seed must be an int"]),
    ("loader: {batch_size: 2, seq_len: 4, shuffle: 'no'}\n", ["loader.shuffle"]),
    ("loader: {batch_size: [[0, 2], [2.5, 4]], seq_len: 4}\n", ["loader.batch_size entry 1"]),
    ("loader: {batch_size: 2, seq_len: 4, sead: 1}\n", ["loader has unknown field 'sead' (did"]),
    ("loader:\n  batch_size: 2\n  seq_len: 4\n  seed: 1\n  seed: 2\n", ["line 5", "'seed'"]),
    (yaml_of(with_weight([1])), ["data.datasets.web.weight"]),
    (yaml_of(with_weight(None)), ["data.datasets.web.weight"]),
    ("loader: {batch_size: 2, seq_len: 4}\ndata: {datasets: {" + WEB + ": 1e308}}\n", ["1.0e+308"]),
    (yaml_of(data(seed=[1])), ["data.seed"]),
    (yaml_of(data(schedule=[{"step": [3], "weights": [1, 1]}])), ["data.schedule[0].step"]),
    (yaml_of(data(period="x")), ["data.period"]),
    (yaml_of(data(period=0)), ["data.period"]),
    (yaml_of({**MIXED_TOKENIZERS, "allow_mixed_tokenizers": "false"}), ["allow_mixed_tokenizers"]),
]


@pytest.mark.parametrize(("text", "fragments"), BAD_RUNS)
def test_show_config_errors_are_one_line_naming_file_and_path(
    tmp_path: Path, text: str, fragments: list[str]
) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    code, out, err = run_main("show", "--config", str(path), "--step", "0")
    assert code == 1 and out == "", (out, err)
    assert err.startswith(f"show: {path}") and len(err.strip().splitlines()) == 1, err
    for fragment in fragments:
        assert fragment in err, (fragment, err)


def test_show_config_with_huge_weights_runs(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(yaml_of({"datasets": {WEB: 1.5e308, CODE: 1.5e308}}))
    assert "1.5e+308" in path.read_text()  # a float to YAML, not text
    code, out, err = run_main("show", "--config", str(path), "--step", "0", "--json")
    assert code == 0, err
    rows = json.loads(out)["rows"]
    assert sorted(row["component_name"] for row in rows) == sorted([WEB, CODE])


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("loader: {batch_size: 2, seq_len: 4, seed: 1.9}\n", "loader.seed must be an int"),
        ("loader: {batch_size: 2, seq_len: 4, seed: 2.0}\n", "(write 2, without the fraction)"),
        ("loader: {batch_size: 2, seq_len: 4\n", "line 2: not valid YAML"),
        ("loader: !!python/object/apply:os.system ['echo hi']\n", "no !!python tags"),
        ("loader: {batch_size: 2}\n", "loader: the field(s) ['seq_len'] are required"),
        ("loader: {batch_size: 2, seq_len: 4}\nloader: {}\n", "the key 'loader' is given twice"),
    ],
)
def test_loader_config_from_yaml_names_file_and_field(
    tmp_path: Path, text: str, fragment: str
) -> None:
    path = tmp_path / "loader.yaml"
    path.write_text(text)
    with pytest.raises(ValueError) as e:
        ftj.LoaderConfig.from_yaml(path)
    assert str(e.value).startswith(f"{path}: ") and fragment in str(e.value), str(e.value)


def test_an_unexpected_error_is_one_line_with_the_way_to_its_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("loader: {batch_size: 2, seq_len: 4}\n")

    def broken(self: Any, node: Any) -> Any:
        raise RuntimeError("the YAML library broke\nsecond line")

    monkeypatch.setattr(yaml.SafeLoader, "construct_document", broken)
    code, _, err = run_main("show", WEB, "--config", str(path), "--step", "0")
    assert code == 70
    assert err.startswith("show: unexpected RuntimeError: the YAML library broke (a bug: run")
    assert "flat-tokens --traceback show" in err and len(err.strip().splitlines()) == 1
    with pytest.raises(RuntimeError, match="the YAML library broke"):
        run_main("--traceback", "show", WEB, "--config", str(path), "--step", "0")


# --- every value of every field: the exact value, or an error naming its path

leaves = (
    st.none()
    | st.booleans()
    | st.integers(-10, 3000)
    | st.sampled_from([2**24 + 1, 2**63, 2**64 - 1, 2**64, -(2**63), 10**400])
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.sampled_from([1e308, 1e-320, -0.0, 2.0, "false", "no", "1", "2.0", "1e3", "bins", ""])
    | st.text(max_size=4)
)
json_values = st.recursive(
    leaves,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=2)
    ),
    max_leaves=6,
)
LOADER_FIELDS = [
    "batch_size",
    "seq_len",
    "packing",
    "shuffle",
    "seed",
    "num_epochs",
    "prefetch",
    "start_token_id",
    "pad_id",
    "vocab_size",
    "decode_threads",
    "decode",
]


@pytest.fixture(scope="module")
def yaml_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("yaml")


@given(field=st.sampled_from(LOADER_FIELDS), value=json_values)
@example(field="packing", value=False)
@example(field="packing", value="bins")
def test_any_loader_value_in_yaml_is_kept_exactly_or_refused_by_path(
    yaml_dir: Path, field: str, value: Any
) -> None:
    path = yaml_dir / "run.yaml"
    path.write_text(yaml.safe_dump({"loader": {"batch_size": 2, "seq_len": 4, field: value}}))
    given = yaml.safe_load(path.read_text())["loader"][field]  # the value as YAML gives it
    try:
        cfg = ftj.LoaderConfig.from_yaml(path)
    except ValueError as e:
        assert str(e).startswith(f"{path}: loader.{field} "), str(e)
        return
    if field == "packing":  # read into its closed type, whose value is what was written
        got = cfg.packing.value
        assert type(got) is type(given) and got == given, (field, given, got)
    elif field != "batch_size":
        got = getattr(cfg, field)
        assert type(got) is type(given) and got == given, (field, given, got)
    elif isinstance(given, int):
        assert type(given) is int and cfg.batch_size == given
    else:  # a schedule: every pair given is a pair of ints the config keeps
        pairs = list(given.items()) if isinstance(given, dict) else given
        for step, size in pairs:
            assert type(step) is int and type(size) is int
            assert cfg.batch_size_at(step) == size
        assert cfg.schedule == BatchSchedule.of(given)


MIXTURE_FIELDS = {
    "seed": ("data.seed", lambda v: data(seed=v), lambda m: m.seed),
    "period": ("data.period", lambda v: data(period=v), lambda m: m.periods[0].period),
    "allow_mixed_tokenizers": (
        "data.allow_mixed_tokenizers",
        lambda v: data(allow_mixed_tokenizers=v),
        lambda m: m.allow_mixed_tokenizers,
    ),
    "weight": ("data.datasets.web.weight", with_weight, lambda m: m.weights[0][0]),
    "step": (
        "data.schedule[0].step",
        lambda v: data(schedule=[{"step": v, "weights": [1, 2]}]),
        lambda m: int(m.steps[1]),
    ),
}


@given(field=st.sampled_from(sorted(MIXTURE_FIELDS)), value=json_values)
def test_any_data_value_is_kept_exactly_or_refused_by_path(field: str, value: Any) -> None:
    path, section, read = MIXTURE_FIELDS[field]
    try:
        mix = ftj.mixture_from_config(section(value))
    except ValueError as e:
        text = str(e)
        # Weights so unequal that one gets no sample name that component.
        assert path in text or (field == "weight" and "'] get no sample in a period" in text), text
        return
    got = read(mix)
    if field == "period" and value is None:
        assert got >= 1000
    elif field == "weight":
        assert not isinstance(value, bool) and isinstance(value, int | float) and got == value
    else:
        assert type(value) is type(got) and got == value, (field, value, got)


# --- issue 35, finding 4: values that YAML 1.1 and YAML 1.2 read differently

# (the loader section's seed as written, what the message must say)
YAML_11_SEEDS = [
    ("017", "loader.seed: 017 is 15 in YAML 1.1 (octal) and 17 in YAML 1.2: write 15 or 17"),
    ("-017", "loader.seed: -017 is -15 in YAML 1.1 (octal)"),
    ("0_17", "loader.seed: 0_17 is 15 in YAML 1.1 (octal)"),
    ("1:30", "loader.seed: 1:30 is 90 in YAML 1.1 (base 60) and text in YAML 1.2: write 90"),
    ("08", "loader.seed: 08 is text in YAML 1.1 and 8 in YAML 1.2: write 8"),
    ("0o17", "loader.seed: 0o17 is text in YAML 1.1 and 15 in YAML 1.2: write 15"),
]


@pytest.mark.parametrize(("written", "message"), YAML_11_SEEDS)
def test_a_number_yaml_versions_read_apart_is_refused_with_the_form_to_write(
    tmp_path: Path, written: str, message: str
) -> None:
    path = tmp_path / "loader.yaml"
    path.write_text(f"loader:\n  batch_size: 2\n  seq_len: 4\n  seed: {written}\n")
    with pytest.raises(ValueError) as e:
        ftj.LoaderConfig.from_yaml(path)
    assert str(e.value).startswith(f"{path}: line 4: {message}"), str(e.value)
    assert f"'{written}' in quotes for text" in str(e.value)


@pytest.mark.parametrize(
    ("section", "message"),
    [
        (
            "shuffle: yes",
            "loader.shuffle: yes is true in YAML 1.1 and text in YAML 1.2: write true",
        ),
        ("shuffle: Off", "loader.shuffle: Off is false in YAML 1.1"),
        ("seed: 1:30.5", "loader.seed: 1:30.5 is 90.5 in YAML 1.1 (base 60)"),
        ("seed: " + "9" * 5000, "loader.seed: a number of 5,000 digits"),
    ],
)
def test_yaml_11_booleans_and_base_60_are_refused(
    tmp_path: Path, section: str, message: str
) -> None:
    path = tmp_path / "loader.yaml"
    path.write_text(f"loader:\n  batch_size: 2\n  seq_len: 4\n  {section}\n")
    with pytest.raises(ValueError, match="^" + re.escape(f"{path}: line 4: {message}")):
        ftj.LoaderConfig.from_yaml(path)


def test_a_phase_start_step_in_base_60_is_refused_naming_the_phase_path(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(
        "phases:\n"
        "  - start_step: 0\n"
        f"    data: {{datasets: {{web: {{url: '{WEB}', weight: 1}}}}}}\n"
        "    loader: {batch_size: 2, seq_len: 4}\n"
        "  - start_step: 12:00\n"
    )
    with pytest.raises(ValueError) as e:
        phases_from_yaml(path)
    assert str(e.value) == (
        f"{path}: line 5: phases[1].start_step: 12:00 is 720 in YAML 1.1 (base 60) and text "
        "in YAML 1.2: write 720 ('12:00' in quotes for text)"
    )


def test_a_key_yaml_11_reads_as_a_boolean_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(f"data:\n  datasets:\n    no: {{url: '{WEB}', weight: 1}}\n")
    with pytest.raises(ValueError, match=re.escape("line 3: data.datasets: the key no is false")):
        read_yaml(path)


@pytest.mark.parametrize(
    ("written", "value"),
    [("0x1F", 31), ("0b101", 5), ("1_000", 1000), ("07", 7), ("00", 0), ("'017'", "017")],
)
def test_numbers_every_yaml_reads_alike_are_kept(tmp_path: Path, written: str, value: Any) -> None:
    path = tmp_path / "v.yaml"
    path.write_text(f"v: {written}\n")
    assert read_yaml(path) == {"v": value}


def nested(depth: int) -> str:
    return "a: " + "[" * depth + "]" * depth + "\n"


ALIAS_BOMB = "a: &a [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]\n" + "".join(
    f"{b}: &{b} [{', '.join([f'*{a}'] * 10)}]\n" for a, b in zip("abcde", "bcdef", strict=True)
)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (nested(2000), "nested more than 100 levels deep"),
        (nested(150), "nested more than 100 levels deep"),
        (ALIAS_BOMB, "holds 1,234,573 values once its aliases expand, more than 1,000,000"),
        ("a: &x [1, *x]\n", "line 1: an alias inside the value it names (a cycle)"),
        ("loader: {seed: 1}\x00\n", "not valid YAML: unacceptable character #x0000"),
        ("\x00", "not valid YAML: unacceptable character #x0000"),
    ],
)
def test_documents_no_config_needs_are_refused_in_one_line(
    tmp_path: Path, text: str, message: str
) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    for read in (read_yaml, phases_from_yaml, ftj.LoaderConfig.from_yaml):
        with pytest.raises(ValueError) as e:
            read(path)
        assert str(e.value).startswith(f"{path}: ") and message in str(e.value), str(e.value)


def test_a_config_nested_to_the_limit_is_read(tmp_path: Path) -> None:
    """The mapping, its key's 99 lists: 100 levels; one list more is refused."""
    path = tmp_path / "run.yaml"
    path.write_text(nested(99))
    value = read_yaml(path)["a"]
    for _ in range(98):
        value = value[0]
    assert value == []
    path.write_text(nested(100))
    with pytest.raises(ValueError, match="nested more than 100 levels deep"):
        read_yaml(path)


# --- issue 35: unknown keys named as written, with the close match


def test_a_misspelt_dataset_key_is_named_with_the_key_it_is_close_to() -> None:
    with pytest.raises(ValueError) as e:
        ftj.mixture_from_config({"datasets": {"web": {"url": WEB, "wieght": 1}}})
    assert str(e.value) == (
        "data.datasets.web has unknown key 'wieght' (did you mean 'weight'?); "
        "known: name, split, url, weight"
    )
    with pytest.raises(ValueError) as e:
        ftj.mixture_from_config({"datasets": {"web": {"url": WEB}}})
    assert "'name'" not in str(e.value) and str(e.value).startswith(
        "data.datasets.web must say weight"
    ), str(e.value)


def test_a_pad_id_inputs_cannot_hold_is_refused_by_its_field() -> None:
    top = int(np.iinfo(np.int32).max)
    for pad_id in (top + 1, -top - 2, 2**40):
        with pytest.raises(
            ValueError, match=r"LoaderConfig.pad_id must be an int in \[-2147483648"
        ):
            ftj.LoaderConfig(batch_size=1, seq_len=2, pad_id=pad_id)
    for start in (top + 1, 2**40):
        with pytest.raises(
            ValueError, match=r"LoaderConfig.start_token_id must be an int in \[0, "
        ):
            ftj.LoaderConfig(batch_size=1, seq_len=2, start_token_id=start)
    assert ftj.LoaderConfig(batch_size=1, seq_len=2, pad_id=-top - 1).pad_id == -top - 1
    assert ftj.LoaderConfig(batch_size=1, seq_len=2, start_token_id=top).start_token_id == top


# --- issue 35: no input of a user's ends the CLI in "unexpected ... (a bug)"


def two_phases(first: str = "", second: str = "") -> str:
    """A run YAML of two phases on WEB, with lines added to each phase's mapping."""
    return (
        "phases:\n"
        "  - name: pretrain\n"
        "    start_step: 0\n"
        f"    data: {{datasets: {{web: {{url: '{WEB}', weight: 1}}}}}}\n"
        "    loader: {batch_size: 2, seq_len: 4}\n"
        f"{first}"
        "  - name: anneal\n"
        "    start_step: 3\n"
        f"{second}"
    )


HOSTILE_YAML = {
    "loader-only": "loader: {batch_size: 2, seq_len: 4}\n",
    "typo": "phase:\n  - start_step: 0\n",
    "list": "- 1\n- 2\n",
    "empty": "",
    "nul": "loader: {seed: 1}\x00\n",
    "pad-id": two_phases(second="    loader: {pad_id: 1099511627776}\n"),
    "missing-split": two_phases(
        second=f"    data: {{datasets: {{web: {{url: '{WEB}', weight: 1, split: test}}}}}}\n"
    ),
    "deep": nested(2000),
    "base-60": two_phases().replace("start_step: 3", "start_step: 12:00"),
    "octal": two_phases(second="    loader: {seed: 017}\n"),
    "unknown-field": two_phases(second="    loader: {sead: 1}\n"),
    "zero-weights": two_phases(
        second=f"    data: {{datasets: {{web: {{url: '{WEB}', weight: 0}}}}}}\n"
    ),
    "weights-count": two_phases(
        second=f"    data: {{datasets: {{web: {{url: '{WEB}', weight: 1}}}}, "
        "schedule: [{step: 1, weights: [1, 2]}]}\n"
    ),
    "misspelt": two_phases(
        second=f"    data: {{datasets: {{web: {{url: '{WEB}', wieght: 1}}}}}}\n"
    ),
}
# Read by preview only (show takes its step as a flag).
PLAN_ONLY = {"top-steps": "steps: many\n" + two_phases()}


def saved_phased_state() -> dict[str, Any]:
    run = ftj.PhasedLoader(
        [
            ftj.Phase(0, ftj.open_dataset(WEB)["train"], ftj.LoaderConfig(batch_size=2, seq_len=4)),
            ftj.Phase(3, ftj.open_dataset(WEB)["train"], ftj.LoaderConfig(batch_size=2, seq_len=2)),
        ]
    )
    run.next_step = 5
    return run.state()


def changed(path: str, value: Any) -> str:
    """A saved phased state as JSON with the value at ``path`` (``phases.1.start_step``) set."""
    state = saved_phased_state()
    *parents, last = path.split(".")
    here: Any = state
    for key in parents:
        here = here[int(key)] if isinstance(here, list) else here[key]
    here[int(last) if isinstance(here, list) else last] = value
    return json.dumps(state)


HOSTILE_STATES = {
    "start-step-text": changed("phases.1.start_step", "x"),
    "start-step-float": changed("phases.1.start_step", 3.0),
    "step-text": changed("step", "x"),
    "phase-int": changed("phases.1", 5),
    "long-int": '{"step": ' + "9" * 5000 + ', "phases": []}',
}


def corpus(tmp_path: Path) -> list[tuple[list[str], Path]]:
    """(CLI words, the file they read) of every hostile input."""
    runs = []
    for name, text in HOSTILE_YAML.items():
        path = tmp_path / f"{name}.yaml"
        path.write_text(text)
        runs += [(["preview", str(path), "--steps", "10"], path)]
        runs += [(["show", "--config", str(path), "--step", "4"], path)]
    for name, text in HOSTILE_STATES.items():
        path = tmp_path / f"{name}.json"
        path.write_text(text)
        runs += [(["show", "--state", str(path), "--step", "4"], path)]
    return runs


def test_hostile_inputs_end_in_one_line_naming_the_file(tmp_path: Path) -> None:
    for words, path in corpus(tmp_path):
        code, out, err = run_main(*words)
        assert code in (1, 2) and out == "", (words, code, err)
        assert len(err.strip().splitlines()) == 1 and str(path) in err, (words, err)
        assert "unexpected" not in err and "Traceback" not in err, (words, err)


@pytest.mark.parametrize(
    ("name", "fragments"),
    [
        ("pad-id", ["phase 1 'anneal' (from step 3): phases[1].loader.pad_id must be an int in"]),
        ("missing-split", ["phases[1].data.datasets.web.split reads a split its dataset lacks"]),
        ("unknown-field", ["phase 1 'anneal' (from step 3): phases[1].loader has unknown field"]),
        ("zero-weights", ["phases[1].data does not make a mixture: weights are all zero"]),
        ("weights-count", ["phases[1].data does not make a mixture: weights from step 1:"]),
        ("misspelt", ["phases[1].data.datasets.web has unknown key 'wieght' (did you mean"]),
        ("typo", ["found 'phase' (did you mean 'phases'?)"]),
        ("loader-only", ["it has 'loader' but no 'data'"]),
        ("top-steps", ["steps must be an int >= 1, got 'many'"]),
        ("empty", ["is empty: preview reads a 'phases' section, or 'data' and 'loader'"]),
        ("list", ["holds a list, not a mapping: preview reads a 'phases' section"]),
    ],
)
def test_preview_errors_name_the_file_the_phase_and_the_path(
    tmp_path: Path, name: str, fragments: list[str]
) -> None:
    path = tmp_path / f"{name}.yaml"
    path.write_text({**HOSTILE_YAML, **PLAN_ONLY}[name])
    steps = [] if name in PLAN_ONLY else ["--steps", "10"]
    code, _, err = run_main("preview", str(path), *steps)
    assert code == 1 and err.startswith(f"preview: {path}"), err
    assert "--state" not in err, "a flag preview does not have"
    for fragment in fragments:
        assert fragment in err, (fragment, err)


def test_a_saved_state_is_blamed_where_it_is_wrong(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    path.write_text(HOSTILE_STATES["start-step-float"])
    code, _, err = run_main("show", "--state", str(path), "--step", "4")
    assert code == 1 and "phases[1].start_step must be an int" in err, err
    assert "phases[0]" not in err and "(write 3, without the fraction)" in err, err
    path.write_text(HOSTILE_STATES["long-int"])
    code, _, err = run_main("show", "--state", str(path), "--step", "4")
    assert "it holds a number of 5,000 digits" in err and "sys.set_int_max_str_digits" not in err


def test_a_store_error_of_a_phase_names_the_file_and_the_phase(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def unreachable(url: str, *args: Any, **kwargs: Any) -> Any:
        raise ftj.StoreError(f"{url}: the server failed 3 attempts: is it reachable?")

    monkeypatch.setattr("flat_tokens_jax.sampling.mixconfig.open_dataset", unreachable)
    path = tmp_path / "run.yaml"
    path.write_text(two_phases())
    for words in (
        ["preview", str(path), "--steps", "4"],
        ["show", "--config", str(path), "--step", "4"],
    ):
        code, _, err = run_main(*words)
        assert code == 1 and err.startswith(
            f"{words[0]}: {path}: phase 0 'pretrain' (from step 0): {WEB}: the server failed"
        ), err
