"""The project's own promises: CI runs the README's test command, and that command
tests the dependency floors pyproject.toml declares."""

import builtins
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"


def readme_test_command() -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Two commands", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)\n```", section, re.S)
    assert len(blocks) == 2, blocks
    return blocks[1]


def test_ci_runs_exactly_the_readme_test_command() -> None:
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert lines[-1] == readme_test_command()
    assert readme_test_command().endswith(" && scripts/test_floors.sh")


def test_floors_are_the_declared_lower_bounds() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "floors.py")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    tools = [d for d in extras["test"] if d.startswith(("zarr>=", "numcodecs>="))]
    declared = project["dependencies"] + extras["fast"] + tools
    assert sorted(p.split("==")[0] for p in out if p.split("==")[0] != "jaxlib") == sorted(
        d.split(">=")[0] for d in declared
    )
    for dep in declared:
        assert dep.replace(">=", "==") in out, dep
    jax = next(p for p in out if p.startswith("jax=="))
    assert f"jaxlib=={jax.split('==')[1]}" in out
    readme = (ROOT / "README.md").read_text()
    for pin in out:
        if not pin.startswith("jaxlib"):
            assert pin.replace("==", " ") in readme, f"README names another floor than {pin}"


def test_zarr_python_is_an_extra_that_admits_zarr_2() -> None:
    """A trainer pinned to zarr 2 installs the package: zarr-python is not a core
    dependency, and the ``zarr`` extra (the fallback reader) takes zarr 2 or 3."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = [re.split(r"[<>=!~ \[]", d, maxsplit=1)[0] for d in project["dependencies"]]
    assert "zarr" not in core and "numcodecs" not in core
    assert project["optional-dependencies"]["zarr"] == ["zarr>=2.18.7"]


def test_importing_the_package_imports_no_heavy_library() -> None:
    """``import flat_tokens_jax`` stays cheap: its names load on first use."""
    heavy = ("jax", "tensorstore", "zarr", "numcodecs", "numba", "grain", "tokenizers", "yaml")
    code = (
        "import sys, flat_tokens_jax as ftj; "
        f"print([m for m in {heavy!r} if m in sys.modules]); "
        "ftj.open_dataset; ftj.Loader; "
        f"print([m for m in {heavy!r} if m in sys.modules])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert out[0] == "[]"
    assert out[1] == "['jax', 'tensorstore']"


def docs_text() -> str:
    """README.md and every page of docs/, one after the other."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    return "\n".join(p.read_text() for p in pages)


def test_every_ftj_name_the_docs_use_exists() -> None:
    import flat_tokens_jax as ftj

    readme = docs_text()
    names = set(re.findall(r"\bftj\.([A-Za-z_]\w*)", readme))
    # the errors a user catches, named as `StoreError` or `ftj.StoreError`
    names |= set(re.findall(r"`(?:ftj\.)?([A-Z]\w*(?:Error|Mismatch|Exhausted|Needed))\b", readme))
    assert "StoreError" in names
    missing = sorted(n for n in names if not hasattr(ftj, n) and not hasattr(builtins, n))
    assert not missing, f"README or docs/ use ftj names the package lacks: {missing}"


def test_readme_is_a_front_door_under_300_lines() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) < 300, f"README.md has {len(lines)} lines: move text to docs/"


def test_api_reference_documents_every_public_name() -> None:
    import flat_tokens_jax as ftj

    api = (ROOT / "docs" / "api.md").read_text()
    documented = re.findall(r"^::: flat_tokens_jax\.(\w+)$", api, re.M)
    assert sorted(documented) == sorted(ftj.__all__), "docs/api.md: one ::: entry per __all__ name"


def test_every_docs_page_is_in_the_mkdocs_nav() -> None:
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = sorted(str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md"))
    assert pages and all(f": {page}" in nav for page in pages), pages


def test_api_reference_renders_sphinx_roles_as_code_links(tmp_path: Path) -> None:
    """Issue 49: the built API page showed ":class:`FlatTokens`" as raw text."""
    role = re.compile(r":(?:class|func|meth|data|attr|mod|obj|exc):`")
    written = sum(
        len(role.findall(p.read_text())) for p in (ROOT / "flat_tokens_jax").rglob("*.py")
    )
    assert written > 100, "the docstrings no longer use Sphinx roles: this test checks nothing"
    site = tmp_path / "site"
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert built.returncode == 0, built.stderr[-3000:]
    pages = {p.relative_to(site): p.read_text() for p in site.rglob("*.html")}
    raw = {str(p): len(role.findall(text)) for p, text in pages.items() if role.search(text)}
    assert raw == {}, f"built pages show Sphinx roles as raw text: {raw}"
    api = pages[Path("api/index.html")]
    title = "FlatTokens (flat_tokens_jax.data.dataset.FlatTokens)"
    link = (
        f'<a class="autorefs autorefs-internal" title="{title}" href="#flat_tokens_jax.FlatTokens">'
    )
    assert f"{link}<code>FlatTokens</code></a>" in api


def test_every_code_block_is_run_or_is_data() -> None:
    """pytest-codeblocks runs ``python``, ``bash`` and ``sh`` blocks; any other
    language of code (``py``, ``shell``, ``console``) would go unrun, unnoticed."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    data = {"python", "bash", "sh", "yaml", "json", "text", ""}
    for page in pages:
        fences = re.findall(r"^ *```(\S*)", page.read_text(), re.M)[::2]
        odd = sorted(set(fences) - data)
        assert not odd, f"{page.relative_to(ROOT)}: code blocks in {odd}: use python or bash"
        skips = re.findall(r"<!--\s*pytest\.mark\.skip(.*?)-->", page.read_text())
        assert all("reason=" in s for s in skips), f"{page.relative_to(ROOT)}: skip without reason"


def make_sample_data(folder: Path) -> None:
    """Runs ``scripts/sample_data.py FOLDER`` as a reader does."""
    made = subprocess.run(
        [sys.executable, str(SCRIPTS / "sample_data.py"), str(folder)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert made.returncode == 0, made.stderr


def test_one_command_makes_the_sample_data_the_guides_read(tmp_path: Path) -> None:
    """Issue 35: the guides read ``data/corpus``, ``data/books`` and
    ``tokenizer.json``, which only the tests' set-up made."""
    from tokenizers import Tokenizer

    import flat_tokens_jax as ftj

    make_sample_data(tmp_path)
    guides = "\n".join(p.read_text() for p in sorted((ROOT / "docs" / "guide").glob("*.md")))
    configs = "\n".join(p.read_text() for p in sorted((ROOT / "configs").glob("*.yaml")))
    read = set(re.findall(r"(?:open_dataset|FlatTokensSource)\(\"(data/[\w-]+)\"", guides))
    read |= set(re.findall(r"flat-tokens (?:show|info|validate) (data/[\w-]+)", guides))
    read |= set(re.findall(r"url: (data/[\w-]+)", configs))
    written = set(re.findall(r"(?:write_dataset|DatasetWriter)\(['\"](data/[\w-]+)", guides))
    written |= set(re.findall(r"flat-tokens convert(?:-chat)? \S+ (data/[\w-]+)", guides))
    assert {"data/corpus", "data/web", "data/books", "data/code"} <= read - written
    tokenizer = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    for name in sorted(read - written):
        for split in ftj.open_dataset(tmp_path / name).values():
            assert 0 < split.max_token_id < tokenizer.get_vocab_size() == 500, name
    for token in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        assert tokenizer.token_to_id(token) is not None
    for text in ("corpus.jsonl", "tokenizer.json", "chats.jsonl"):
        assert re.search(rf"\b{re.escape(text)}\b", guides), text
    docs = [json.loads(line)["text"] for line in (tmp_path / "corpus.jsonl").open()]
    assert len(docs) == 40 and all(docs)
    chat = json.loads((tmp_path / "chats.jsonl").read_text())
    assert [t["from"] for t in chat["conversations"]] == ["human", "gpt"]


def test_the_sample_data_is_pythons_own_text_and_records_its_tokenizer(tmp_path: Path) -> None:
    """Issue 49: the sample datasets held random ids, so ``show --tokenizer``
    printed gibberish and a model trained on them did not learn. Their ids
    decode, in turn, to the ``pydoc_data`` topics and the listed modules'
    source; each records ``tokenizer.json``; a second run writes the same bytes."""
    import inspect
    import pydoc_data.topics

    from test_identity import expected_vocab_hash
    from tokenizers import Tokenizer

    import flat_tokens_jax as ftj

    runs = [tmp_path / "a", tmp_path / "b"]
    for folder in runs:
        make_sample_data(folder)
    files = [sorted(p.relative_to(f) for p in f.rglob("*") if p.is_file()) for f in runs]
    assert files[0] == files[1]
    for name in files[0]:
        assert (runs[0] / name).read_bytes() == (runs[1] / name).read_bytes(), name
    tokenizer = Tokenizer.from_file(str(runs[0] / "tokenizer.json"))
    texts = {}
    for name in ("corpus", "web", "books", "code"):
        ds = ftj.open_dataset(runs[0] / "data" / name)
        assert ds.info.tokenizer is not None, name
        assert ds.info.tokenizer.name == "tokenizer.json"
        assert ds.info.tokenizer.vocab_hash == expected_vocab_hash(runs[0] / "tokenizer.json")
        assert (ds["train"].num_sequences, ds["validation"].num_sequences) == (280, 20)
        ids = [
            q for s in ("train", "validation") for q in ds[s].sequences(range(ds[s].num_sequences))
        ]
        assert min(map(len, ids)) >= 20 and max(map(len, ids)) < 400, name
        texts[name] = tokenizer.decode(np.concatenate(ids).tolist(), skip_special_tokens=False)
    spec = importlib.util.spec_from_file_location("sample_data", SCRIPTS / "sample_data.py")
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    topics = "".join(t for _, t in sorted(pydoc_data.topics.topics.items()))
    code = "".join(inspect.getsource(importlib.import_module(m)) for m in script.MODULES)
    prose = texts["corpus"] + texts["web"] + texts["books"]
    assert len(prose) > 300_000 and topics.startswith(prose)
    assert len(texts["code"]) > 100_000 and code.startswith(texts["code"])


def test_what_the_docs_examples_write_in_a_checkout_is_ignored_by_git(tmp_path: Path) -> None:
    """Issue 35: the sample data and the examples' outputs (``data/``,
    ``ckpt-example/``, ``log.jsonl``) were not in ``.gitignore``."""
    written = ["data/corpus/zarr.json", "tokenizer.json", "corpus.jsonl", "chats.jsonl"]
    written += ["ckpt/loader_state.json", "ckpt-example/0/x", "log.jsonl"]
    shutil.copy(ROOT / ".gitignore", tmp_path / ".gitignore")
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    for path in written:
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("x")
    status = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=all"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    )
    assert status.stdout.split() == ["??", ".gitignore"]


def test_readme_links_to_docs_pages_that_exist() -> None:
    links = re.findall(r"\]\((docs/[^)#]+)(?:#[^)]*)?\)", (ROOT / "README.md").read_text())
    pages = {str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md")}
    assert links and set(links) <= pages, sorted(set(links) - pages)


def test_a_trainers_first_use_imports_no_library_but_jax_and_tensorstore() -> None:
    """``ftj.Loader`` and ``ftj.open_dataset`` import, beyond what ``import jax``
    does, only tensorstore and its crc32c: none of the installed optional or
    heavy libraries (zarr-python, numba, grain, tokenizers, yaml, Beam, ...)."""
    heavy = (
        "zarr", "numcodecs", "numba", "llvmlite", "grain", "absl", "tokenizers", "transformers",
        "datasets", "pyarrow", "pandas", "apache_beam", "yaml", "scipy", "optax", "orbax",
        "matplotlib", "boto3", "fsspec",
    )  # fmt: skip
    code = (
        "import sys, jax; top = lambda: {m.split('.')[0] for m in sys.modules}; jax_top = top(); "
        "import flat_tokens_jax as ftj; ftj.Loader; ftj.open_dataset; "
        "print(sorted(top() - jax_top - set(sys.stdlib_module_names) - {'flat_tokens_jax'})); "
        f"print(sum(m not in sys.modules for m in {heavy!r}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert out[0] == "['google_crc32c', 'tensorstore']"
    assert int(out[1]) == len(heavy)


def test_bench_import_times_imports_not_the_compiler(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """scripts/bench_import.py times interpreters that read the package's
    bytecode, written by its untimed first run, even under
    ``PYTHONDONTWRITEBYTECODE=1``: a timed run compiles none of its modules."""
    spec = importlib.util.spec_from_file_location("bench_import", SCRIPTS / "bench_import.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # this checkout's package
    env = bench.bytecode_env(str(tmp_path))
    statement = (
        "import flat_tokens_jax.core.format, flat_tokens_jax.core.urls, "
        "flat_tokens_jax.store.options"
    )
    bench.wall(statement, env)
    err = subprocess.run(
        [sys.executable, "-v", "-c", statement], env=env, capture_output=True, text=True, check=True
    ).stderr
    ours = re.findall(r"^# code object from '?(\S*flat_tokens_jax\S*?)'?$", err, re.M)
    assert len(ours) >= 4
    assert [path for path in ours if path.endswith(".py")] == []
