"""`flat-tokens show` rebuilds any run and prints exactly what its Loader gives."""

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from commands import run_main
from hypothesis import given, settings
from hypothesis import strategies as st
from memurls import memory_url

import flat_tokens_jax as ftj


def dataset(base: int, n: int) -> str:
    url = memory_url()
    rng = np.random.default_rng(base)
    seqs = [rng.integers(base, base + 50, int(k)) for k in rng.integers(1, 9, n)]
    ftj.write_dataset(
        url, {"train": seqs}, storage_format=ftj.StorageFormat(shard_tokens=256, chunk_tokens=16)
    )
    return url


URLS = {"web": dataset(1, 60), "code": dataset(100, 40), "books": dataset(300, 25)}


def expected(loader: ftj.Loader, step: int) -> list[dict[str, Any]]:
    """The rows as the Python API gives them, field by field."""
    batch, prov = loader.host_batch(step), loader.provenance(step)
    return [
        {**p, **{k: batch[k][i].astype(int).tolist() for k in batch}} for i, p in enumerate(prov)
    ]


schedules = st.lists(st.tuples(st.integers(1, 4), st.integers(1, 6)), min_size=1, max_size=3).map(
    lambda gaps: [[sum(g for g, _ in gaps[:i]) if i else 0, n] for i, (_, n) in enumerate(gaps)]
)


def flag_value(value: Any) -> str:
    """A field's value as its flag takes it: a schedule as ``0:2,3:4``."""
    if isinstance(value, list):
        return ",".join(f"{step}:{size}" for step, size in value)
    return str(value)


runs = st.fixed_dictionaries(
    {
        "batch_size": st.integers(1, 6) | schedules,
        "seq_len": st.integers(1, 7),
        "packing": st.sampled_from([True, False, "bins"]),
        "shuffle": st.booleans(),
        "seed": st.integers(0, 2**32),
        "pad_id": st.integers(0, 5),
        "start_token_id": st.none() | st.integers(0, 5),
    }
)


@settings(max_examples=25)
@given(
    loader_fields=runs,
    weights=st.lists(st.integers(1, 5), min_size=1, max_size=3),
    change=st.none() | st.tuples(st.integers(1, 6), st.lists(st.integers(0, 5), min_size=3)),
    step=st.integers(0, 40),
    how=st.sampled_from(["config", "state"]),
)
def test_show_json_equals_the_loader_for_any_mixture(
    tmp_path_factory: pytest.TempPathFactory,
    loader_fields: dict[str, Any],
    weights: list[int],
    change: tuple[int, list[int]] | None,
    step: int,
    how: str,
) -> None:
    names = list(URLS)[: len(weights)]
    schedule = []
    if change is not None and sum(change[1][: len(names)]) > 0:
        schedule = [{"step": change[0], "weights": dict(zip(names, change[1], strict=False))}]
    data = {
        "datasets": {n: {"url": URLS[n], "weight": w} for n, w in zip(names, weights, strict=True)},
        "seed": 3,
        "schedule": schedule,
    }
    loader_config = {k: v for k, v in loader_fields.items() if v is not None}
    loader = ftj.Loader(ftj.mixture_from_config(data), ftj.LoaderConfig(**loader_config))
    tmp = tmp_path_factory.mktemp("run")
    if how == "config":
        (tmp / "run.yaml").write_text(
            yaml.safe_dump({"loader": loader_config, "data": data}, sort_keys=False)
        )
        code, out, err = run_main(
            "show", "--config", str(tmp / "run.yaml"), "--step", str(step), "--json"
        )
    else:
        (tmp / "state.json").write_text(json.dumps(loader.state()))
        code, out, err = run_main(
            "show", "--state", str(tmp / "state.json"), "--step", str(step), "--json"
        )
    assert code == 0, err
    shown = json.loads(out)
    assert shown["rows"] == expected(loader, step)
    assert shown["config"] == loader.fingerprint()["config"]


@settings(max_examples=25)
@given(
    loader_fields=runs,
    num_epochs=st.none() | st.integers(1, 3),
    view=st.none() | st.tuples(st.integers(0, 20), st.integers(21, 59)),
    data=st.data(),
)
def test_show_json_equals_the_loader_for_a_split(
    tmp_path_factory: pytest.TempPathFactory,
    loader_fields: dict[str, Any],
    num_epochs: int | None,
    view: tuple[int, int] | None,
    data: st.DataObject,
) -> None:
    ft = ftj.open_dataset(URLS["web"])["train"]
    source = ft if view is None else ft.view(*view)
    fields = {k: v for k, v in loader_fields.items() if v is not None}
    cfg = ftj.LoaderConfig(**fields, num_epochs=num_epochs)
    try:
        loader = ftj.Loader(source, cfg)
    except ValueError:
        return  # no records at this seq_len: refused alike by show (tested below)
    end = loader.num_batches
    step = data.draw(st.integers(0, (end or 50) - 1))
    flags = [
        f"--{k.replace('_', '-')}={flag_value(v)}"
        for k, v in fields.items()
        if not isinstance(v, bool) and k != "packing"
    ]
    flags += ["--bins"] if fields["packing"] == "bins" else []
    flags += [f"--{'' if v else 'no-'}{k}" for k, v in fields.items() if isinstance(v, bool)]
    if num_epochs is not None:
        flags.append(f"--num-epochs={num_epochs}")
    state = tmp_path_factory.mktemp("state") / "state.json"
    state.write_text(json.dumps(loader.state()))
    ways = [["--state", str(state)]]
    if view is None:
        ways.append([URLS["web"], *flags])
    for way in ways:
        code, out, err = run_main("show", *way, "--step", str(step), "--json")
        assert code == 0, err
        assert json.loads(out)["rows"] == expected(loader, step)


def test_flags_override_a_state_and_rows_select(tmp_path: Path) -> None:
    loader = ftj.Loader(ftj.open_dataset(URLS["code"])["train"], ftj.LoaderConfig(4, 3, seed=1))
    (tmp_path / "s.json").write_text(json.dumps(loader.state()))
    code, out, err = run_main(
        "show",
        "--state",
        str(tmp_path / "s.json"),
        "--step",
        "2",
        "--seed",
        "2",
        "--rows",
        "0,2-3",
        "--json",
    )
    # The state's data fingerprint holds, so another seed is a new run over the same data.
    assert code == 1 and "config.seed: saved 1, now 2" in err
    code, out, err = run_main(
        "show", "--state", str(tmp_path / "s.json"), "--step", "2", "--rows", "0,2-3", "--json"
    )
    assert code == 0, err
    want = expected(loader, 2)
    assert json.loads(out)["rows"] == [want[0], want[2], want[3]]


def test_show_says_which_component_a_row_came_from(tmp_path: Path) -> None:
    mix = ftj.Mixture(
        {
            "web": (ftj.open_dataset(URLS["web"])["train"], 1),
            "code": (ftj.open_dataset(URLS["code"])["train"], 1),
        }
    )
    loader = ftj.Loader(mix, ftj.LoaderConfig(4, 3))
    (tmp_path / "s.json").write_text(json.dumps(loader.state()))
    code, out, err = run_main("show", "--state", str(tmp_path / "s.json"), "--step", "5")
    assert code == 0, err
    names = [p["component_name"] for p in loader.provenance(5)]
    lines = [ln for ln in out.splitlines() if ln.startswith("row ")]
    assert [ln.split("(")[1].split(")")[0] for ln in lines] == names


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--seq-len", "0", "--batch-size", "2"],
            "--seq-len must be an int >= 1, got 0",
        ),
        (["--seq-len", "2", "--batch-size", "0"], "--batch-size must be an int >= 1"),
        (["--seq-len", "2", "--batch-size", "2", "--seed", "-1"], "--seed must be"),
        (["--seq-len", "2", "--batch-size", "2", "--num-epochs", "0"], "--num-epochs must be"),
        (
            ["--seq-len", "2"],
            "batch_size is not known: pass --batch-size, or --config with a loader section "
            "that sets it, or the run's saved --state",
        ),
        ([], "batch_size and seq_len are not known: pass --batch-size and --seq-len, or --config"),
        (["--seq-len", "2", "--batch-size", "4", "--step", "10000000000000000000"], "too large"),
        (["--seq-len", "2", "--batch-size", "4", "--step", "4611686018427387904"], "too large"),
        (["--seq-len", "2", "--batch-size", "4", "--rows", "3-9"], "3-9 is outside rows 0-3"),
        (["--seq-len", "9999", "--batch-size", "4"], "has no records"),
        (
            ["--seq-len", "2", "--batch-size", "0:2,0:4"],
            "--batch-size '0:2,0:4': batch_size entry 1 (0, 4) starts at step 0, not after",
        ),
        (["--seq-len", "2", "--batch-size", "0:2,x"], "expected a size such as 256 or a schedule"),
        (["--seq-len", "2", "--batch-size", "0:2,4:4", "--step", "4", "--rows", "4"], "0-3"),
    ],
)
def test_bad_flags_end_in_one_line(args: list[str], message: str) -> None:
    if "--step" not in args:
        args = [*args, "--step", "0"]
    code, _, err = run_main("show", URLS["web"], *args)
    assert code == 1 and message in err and len(err.strip().splitlines()) == 1, err


def test_run_said_twice_or_not_at_all(tmp_path: Path) -> None:
    (tmp_path / "c.yaml").write_text(
        yaml.safe_dump(
            {"loader": {"batch_size": 2, "seq_len": 2}, "data": {"datasets": {URLS["web"]: 1}}}
        )
    )
    code, _, err = run_main(
        "show", URLS["web"], "--config", str(tmp_path / "c.yaml"), "--step", "0"
    )
    assert code == 1 and "the data is given twice" in err
    code, _, err = run_main("show", "--batch-size", "2", "--seq-len", "2", "--step", "0")
    assert code == 1 and "say where the data is" in err


@pytest.fixture(scope="module")
def gpt2(eos_tokenizer: Path) -> Any:
    """A byte-level BPE tokenizer (trained in the tests, so CI needs no files)."""
    tokenizers = pytest.importorskip("tokenizers")
    return tokenizers.Tokenizer.from_file(str(eos_tokenizer))


def test_tokenizer_renders_segments_untrained_tokens_and_padding(
    tmp_path: Path, gpt2: Any, eos_tokenizer: Path
) -> None:
    prompts = ["Question: what is up?", "Say hi.\nNow."]
    answers = [" Not much.", " Hi there"]
    seqs, masks = [], []
    for p, a in zip(prompts, answers, strict=True):
        ids_p, ids_a = gpt2.encode(p).ids, gpt2.encode(a).ids
        seqs.append(ids_p + ids_a)
        masks.append([0] * len(ids_p) + [1] * len(ids_a))
    ftj.write_dataset(tmp_path / "d", {"train": seqs}, loss_masks={"train": masks})
    common = ["show", str(tmp_path / "d"), "--step", "0", "--batch-size", "2", "--no-shuffle"]
    width = max(len(s) for s in seqs) + 3
    code, out, err = run_main(
        *common, "--seq-len", str(width), "--padded", "--tokenizer", str(eos_tokenizer)
    )
    assert code == 0, err
    pad = [width - len(s) for s in seqs]
    assert f"  [1] ⟦{prompts[0]}⟧{answers[0]}\n  (+{pad[0]} padding)" in out
    assert f"  [1] ⟦Say hi.\n      Now.⟧{answers[1]}\n  (+{pad[1]} padding)" in out
    total = sum(len(s) for s in seqs)
    code, out, err = run_main(
        *common[:-3],
        "--batch-size",
        "1",
        "--seq-len",
        str(total),
        "--no-shuffle",
        "--tokenizer",
        str(eos_tokenizer),
    )
    assert code == 0, err
    assert f"[1] ⟦{prompts[0]}⟧{answers[0]}\n  [2] ⟦Say hi.\n      Now.⟧{answers[1]}" in out
    assert "padding" not in out.split("\n", 2)[2]


def test_a_tokenizer_the_data_was_not_made_with_is_refused(
    tmp_path: Path, eos_tokenizer: Path
) -> None:
    other = ftj.TokenizerInfo("other.json", "sha256:0000000000000000", 50257)
    ftj.write_dataset(tmp_path / "d", {"train": [[1, 2, 3]]}, info=ftj.DatasetInfo(tokenizer=other))
    code, _, err = run_main(
        "show",
        str(tmp_path / "d"),
        "--step",
        "0",
        "--batch-size",
        "1",
        "--seq-len",
        "2",
        "--tokenizer",
        str(eos_tokenizer),
    )
    assert code == 1 and "was made with other.json" in err


def test_show_takes_a_state_with_a_batch_size_changed_from_the_saved_step(
    tmp_path: Path,
) -> None:
    loader = ftj.Loader(
        ftj.open_dataset(URLS["web"])["train"], ftj.LoaderConfig(batch_size=3, seq_len=4)
    )
    loader.next_step = 2
    (tmp_path / "old.json").write_text(json.dumps(loader.state()))
    code, out, err = run_main(
        "show", "--state", str(tmp_path / "old.json"), "--step", "2", "--json"
    )
    assert code == 0, err
    assert json.loads(out)["rows"] == expected(loader, 2)
    code, out, err = run_main(
        "show", "--state", str(tmp_path / "old.json"), "--step", "2", "--batch-size", "0:3,2:5"
    )
    assert code == 0, err
    assert "batch_size [[0, 3], [2, 5]]" in out
    assert sum(line.startswith("row ") for line in out.splitlines()) == 5
    code, _, err = run_main(
        "show", "--state", str(tmp_path / "old.json"), "--step", "2", "--batch-size", "0:3,1:5"
    )
    assert code == 1
    assert "step 1 had 3 rows, now 5" in err and "batch_size [[0, 3], [2, 5]]" in err
