"""Runs in phases said in YAML, and `flat-tokens show` of a phased run's steps."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from commands import run_main
from memurls import memory_url

import flat_tokens_jax as ftj
from flat_tokens_jax.loader.phaseconfig import phases_from_config, phases_from_yaml


def dataset(base: int, n: int) -> str:
    url = memory_url()
    rng = np.random.default_rng(base)
    seqs = [rng.integers(base, base + 50, int(k)) for k in rng.integers(1, 9, n)]
    ftj.write_dataset(url, {"train": seqs})
    return url


URLS = {"web": dataset(1, 30), "code": dataset(100, 20), "books": dataset(300, 15)}

RUN: dict[str, Any] = {
    "phases": [
        {
            "name": "pretrain",
            "start_step": 0,
            "data": {
                "datasets": {
                    n: {"url": URLS[n], "weight": w} for n, w in [("web", 3), ("code", 1)]
                },
                "seed": 5,
            },
            "loader": {"batch_size": [[0, 2], [3, 4]], "seq_len": 6, "seed": 1, "prefetch": 0},
        },
        {
            "name": "anneal",
            "start_step": 5,
            "data": {
                "datasets": {
                    n: {"url": URLS[n], "weight": w}
                    for n, w in [("web", 1), ("code", 1), ("books", 2)]
                },
                "seed": 5,
            },
        },
        {
            "name": "long",
            "start_step": 9,
            "loader": {"batch_size": 2, "seq_len": 12, "packing": "bins"},
        },
    ]
}


def by_hand() -> list[ftj.Phase]:
    """The same run declared in Python."""
    split = {n: ftj.open_dataset(u)["train"] for n, u in URLS.items()}
    first = ftj.LoaderConfig(batch_size=[(0, 2), (3, 4)], seq_len=6, seed=1, prefetch=0)
    long = ftj.LoaderConfig(batch_size=2, seq_len=12, packing="bins", seed=1, prefetch=0)
    anneal = ftj.Mixture(
        {"web": (split["web"], 1), "code": (split["code"], 1), "books": (split["books"], 2)}, seed=5
    )
    return [
        ftj.Phase(
            0, ftj.Mixture({"web": (split["web"], 3), "code": (split["code"], 1)}, seed=5), first
        ),
        ftj.Phase(5, anneal, first),
        ftj.Phase(9, anneal, long),
    ]


def test_yaml_phases_are_the_python_phases(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(RUN, sort_keys=False))
    from_yaml = ftj.PhasedLoader(phases_from_yaml(path))
    python = ftj.PhasedLoader(by_hand())
    assert [p.name for p in from_yaml.phases] == ["pretrain", "anneal", "long"]
    for step in range(14):
        for field, want in python.host_batch(step).items():
            np.testing.assert_array_equal(from_yaml.host_batch(step)[field], want)
    assert from_yaml.phases[2].config.seq_len == 12 and from_yaml.phases[2].config.seed == 1


def test_a_bad_phase_value_is_named_by_its_path() -> None:
    bad = json.loads(json.dumps(RUN))
    bad["phases"][2]["loader"]["seq_len"] = 1.5
    with pytest.raises(ValueError, match=r"phases\[2\].loader.seq_len must be an int"):
        phases_from_config(bad["phases"])
    bad["phases"][1]["steps"] = 3
    with pytest.raises(ValueError, match=r"phases\[1\] has unknown key 'steps'; known: data,"):
        phases_from_config(bad["phases"])
    with pytest.raises(ValueError, match=r"phases\[0\] must say 'loader'"):
        phases_from_config([{"start_step": 0, "data": RUN["phases"][0]["data"]}])


def test_show_says_the_phase_and_prints_the_runs_rows(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(RUN, sort_keys=False))
    run = ftj.PhasedLoader(by_hand())
    code, out, err = run_main("show", "--config", str(path), "--step", "7")
    assert code == 0, err
    assert out.splitlines()[0] == "step 7 is in phase 1 'anneal' (from step 5; its step 2)"
    code, out, err = run_main("show", "--config", str(path), "--step", "10", "--json")
    assert code == 0, err
    shown = json.loads(out)
    assert shown["phase"] == {"index": 2, "name": "long", "start_step": 9, "step": 1}
    batch, provenance = run.host_batch(10), run.provenance(10)
    assert [r["targets"] for r in shown["rows"]] == batch["targets"].tolist()
    assert [r["sample"] for r in shown["rows"]] == [p["sample"] for p in provenance]
    # From a saved state of the run, the same rows.
    run.next_step = 11
    state = tmp_path / "state.json"
    state.write_text(json.dumps(run.state()))
    code, out, err = run_main("show", "--state", str(state), "--step", "10", "--json")
    assert code == 0, err
    assert json.loads(out)["rows"] == shown["rows"]
    code, _, err = run_main("show", "--config", str(path), "--step", "3", "--seq-len", "8")
    assert code != 0 and "says its LoaderConfig fields per phase" in err


def brute_force_counts(run: ftj.PhasedLoader, end: int) -> dict[tuple[int, str], int]:
    """Samples of each (phase, component), counted row by row from provenance."""
    counts: dict[tuple[int, str], int] = {}
    for step in range(end):
        for row in run.provenance(step):
            key = (row.get("phase", 0), row.get("component_name", "0"))
            counts[key] = counts.get(key, 0) + 1
    return counts


def test_preview_counts_what_the_steps_read(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({**RUN, "steps": 13}, sort_keys=False))
    run = ftj.PhasedLoader(by_hand())
    code, out, err = run_main("preview", str(path), "--json")
    assert code == 0, err
    rows = json.loads(out)
    counted = brute_force_counts(run, 13)
    assert {(r["phase"], r["component"]): r["samples"] for r in rows if r["samples"]} == counted
    long = [r for r in rows if r["phase"] == 2]
    assert sum(r["samples"] for r in long) == 4 * 2 and all(r["seq_len"] == 12 for r in long)
    web = [r for r in rows if r["component"] == "web"]
    assert [r["stream"] for r in web] == ["new", "continued", "new"]
    records = len(run.engines[0].components[0])
    assert web[1]["stream_epochs"] == (web[0]["samples"] + web[1]["samples"]) / records
    code, out, err = run_main("preview", str(path))
    assert code == 0, err
    assert "phase 1 'anneal': steps [5, 9) (4 steps), seq_len 6, packing True" in out
    path.write_text(yaml.safe_dump(RUN, sort_keys=False))
    code, _, err = run_main("preview", str(path))
    assert code != 0 and "say where the run ends: --steps N" in err


def test_preview_picture_needs_the_plot_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(RUN, sort_keys=False))
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    code, _, err = run_main(
        "preview", str(path), "--steps", "12", "--picture", str(tmp_path / "p.png")
    )
    assert code != 0 and "pip install 'flat-tokens-jax[plot]'" in err
    code, _, err = run_main(
        "preview", str(path), "--steps", "12", "--picture", str(tmp_path / "p.gif")
    )
    assert code != 0 and "name a .png or .svg file" in err


@pytest.mark.parametrize("suffix", ["png", "svg"])
def test_preview_draws_the_shares_with_phase_boundaries(tmp_path: Path, suffix: str) -> None:
    pytest.importorskip("matplotlib")
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(RUN, sort_keys=False))
    picture = tmp_path / f"p.{suffix}"
    code, _, err = run_main("preview", str(path), "--steps", "12", "--picture", str(picture))
    assert code == 0, err
    head = picture.read_bytes()[:200]
    assert head.startswith(b"\x89PNG") if suffix == "png" else b"<svg" in picture.read_bytes()
    if suffix == "svg":
        text = picture.read_text()
        assert all(name in text for name in ("pretrain", "anneal", "long"))
        assert "<!-- step -->" in text and "skip" not in text  # a run without skips


def test_the_example_run_yaml_builds(tmp_path: Path) -> None:
    """configs/phases.yaml, its data here and its rows shorter."""
    doc = yaml.safe_load((Path(__file__).parents[1] / "configs" / "phases.yaml").read_text())
    for phase in doc["phases"]:
        for name, entry in phase.get("data", {}).get("datasets", {}).items():
            entry["url"] = URLS[name]
        loader = phase.get("loader", {})
        for key, scale in (("seq_len", 512), ("batch_size", 32)):
            if key in loader:
                loader[key] //= scale
    phases = phases_from_config(doc["phases"])
    assert [(p.name, p.start_step) for p in phases] == [
        ("pretrain", 0),
        ("anneal", 90000),
        ("long-context", 100000),
    ]
    assert phases[1].config == phases[0].config, "the anneal phase keeps the loader"
    assert phases[2].config.packing is ftj.Packing.BINS and phases[2].config.seq_len == 64
    run = ftj.PhasedLoader(phases)
    assert run.offsets[1] == [576000, 144000, 0], "web and code continue, books is new"
    assert run.offsets[2] == [0], "bins of 64 are a new stream of books"
    assert run.host_batch(100_000)["targets"].shape == (1, 64)
    written = tmp_path / "phases.yaml"
    written.write_text(yaml.safe_dump(doc, sort_keys=False))
    comments = (Path(__file__).parents[1] / "configs" / "phases.yaml").read_text()
    commands = re.findall(r"`flat-tokens ([^`]*)`", comments.replace("\n# ", " "))
    assert [c.split()[0] for c in commands] == ["preview", "show"], commands
    for command in commands:
        args = command.replace("configs/phases.yaml", str(written)).replace("--step N", "--step 3")
        code, out, err = run_main(*args.split())
        assert code == 0 and out, f"{command}: {err}"


def test_preview_of_a_data_and_loader_yaml_is_one_phase(tmp_path: Path) -> None:
    """configs/mixture.yaml's shape: the counts of the Loader that show rebuilds from it."""
    data = {"datasets": {n: {"url": URLS[n], "weight": w} for n, w in [("web", 3), ("code", 1)]}}
    loader = {"batch_size": [[0, 2], [3, 4]], "seq_len": 6, "seed": 1}
    path = tmp_path / "mixture.yaml"
    path.write_text(yaml.safe_dump({"data": data, "loader": loader}, sort_keys=False))
    code, out, err = run_main("preview", str(path), "--steps", "7", "--json")
    assert code == 0, err
    rows = json.loads(out)
    run = ftj.PhasedLoader(
        [ftj.Phase(0, ftj.mixture_from_config(data), ftj.LoaderConfig.from_dict(loader))]
    )
    assert {(r["phase"], r["component"]): r["samples"] for r in rows} == brute_force_counts(run, 7)
    assert [r["stream"] for r in rows] == ["new", "new"]


def test_preview_refuses_steps_the_loader_refuses(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(RUN, sort_keys=False))
    run = ftj.PhasedLoader(by_hand())
    # The last phase reads 2 rows a step: its last step's samples end at 2**63 - 1.
    last = 9 + (2**63 - 2) // 2
    run.engines[2].steps.samples(last - 9, np.zeros(0, np.int64))  # the loader takes it
    with pytest.raises(ValueError, match="too large"):
        run.engines[2].steps.samples(last - 9 + 1, np.zeros(0, np.int64))
    code, out, err = run_main("preview", str(path), "--steps", str(last + 1), "--json")
    assert code == 0, err
    assert max(r["samples"] for r in json.loads(out)) < 2**63
    for steps in (last + 2, 10**30):
        code, out, err = run_main("preview", str(path), "--steps", str(steps))
        assert code == 1 and out == "", err
        assert err.startswith(
            f"preview: {path}: --steps {steps}: the run's step {steps - 1} is step"
        )
        assert "of phase 2 'long' (from step 9), and its loader refuses it" in err
        assert f"the last step is {last - 9}" in err, err


def test_preview_columns_fit_their_widest_value_and_heavy_repeats_warn(tmp_path: Path) -> None:
    small = memory_url()
    ftj.write_dataset(small, {"train": [[1, 2, 3]] * 13})
    datasets = {"tiny": {"url": small, "weight": 1}, "web": {"url": URLS["web"], "weight": 1}}
    phase = {
        "start_step": 0,
        "data": {"datasets": datasets},
        "loader": {"batch_size": 4, "seq_len": 3, "packing": False},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"phases": [phase]}, sort_keys=False))
    steps = 10**12
    code, out, err = run_main("preview", str(path), "--steps", str(steps), "--json")
    assert code == 0, err
    rows = json.loads(out)
    code, text, err = run_main("preview", str(path), "--steps", str(steps))
    assert code == 0, err
    lines = text.splitlines()
    assert lines[1].split() == [
        "component",
        "stream",
        "samples",
        "tokens",
        "epochs",
        "stream",
        "epochs",
    ]
    for line, r in zip(lines[2:], rows, strict=True):
        assert line.split() == [
            r["component"],
            "new",
            f"{r['samples']:,}",
            f"{r['tokens']:,}",
            f"{r['epochs']:,.3f}",
            f"{r['stream_epochs']:,.3f}",
        ], line
    # Each component draws half of the 4 * 10**12 samples: tiny's 13 records repeat.
    assert [r["samples"] for r in rows] == [2 * 10**12, 2 * 10**12]
    warned = err.strip().splitlines()
    assert len(warned) == 2 and all(w.startswith("preview: warning: component '") for w in warned)
    assert f"'tiny' (13 records) is read {2 * 10**12 / 13:,.1f} epochs by step {steps}" in err
    # Warned: exactly the streams read more than 100 epochs (web's 30 records
    # about 93 and 107 times).
    for step_count, web_warned in ((1400, False), (1600, True)):
        code, out, _ = run_main("preview", str(path), "--steps", str(step_count), "--json")
        web = next(r for r in json.loads(out) if r["component"] == "web")
        assert (web["stream_epochs"] > 100) == web_warned, web
        code, _, err = run_main("preview", str(path), "--steps", str(step_count))
        assert code == 0 and ("'web' (30 records)" in err) == web_warned, err
        assert "'tiny' (13 records)" in err
