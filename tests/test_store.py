import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import zarr
from rawstore import BLOSC, DELTA, SPEC_STARTS, SPEC_TOKENS, flat_split, write_raw

import flat_tokens_jax as ftj
from flat_tokens_jax.store.arrays import TensorStoreArray, ZarrPythonArray
from flat_tokens_jax.store.options import CONCURRENCY_CEILING, StoreOptions, context_spec
from flat_tokens_jax.store.store import kvstore_spec

EMPTY = flat_split([], [0], 0)


def spec_dataset(**kwargs: object) -> dict[str, dict[str, object]]:
    return {"train": flat_split(SPEC_TOKENS, SPEC_STARTS, 8, **kwargs), "validation": EMPTY}


def check_spec_train(url: Path) -> ftj.FlatTokens:
    ft = ftj.open_dataset(url)["train"]
    assert [s.tolist() for s in ft.sequences([0, 1, 2])] == [[1, 2], [3, 4, 5], [6, 7, 8]]
    assert ft.max_token_id == 8
    ftj.validate(url)
    return ft


def test_reads_zarr_v2_with_blosc(tmp_path: Path) -> None:
    write_raw(tmp_path, spec_dataset(tokens_kwargs=BLOSC, starts_kwargs=BLOSC), zarr_format=2)
    ft = check_spec_train(tmp_path)
    assert isinstance(ft.encoded, TensorStoreArray)
    assert ft.storage_formats()["encoded_tokens"]["compression"] == "blosc"


def test_reads_delta_filtered_seq_starts_through_zarr_python(tmp_path: Path) -> None:
    write_raw(tmp_path, spec_dataset(starts_kwargs=DELTA), zarr_format=2)
    stored = zarr.open_array(str(tmp_path / "train" / "seq_starts"), mode="r")
    assert stored.filters, "the fixture must really use a filter"
    ft = check_spec_train(tmp_path)
    assert isinstance(ft.starts, ZarrPythonArray)
    assert isinstance(ft.encoded, TensorStoreArray)
    assert ft.storage_formats()["seq_starts"]["filters"] == ["delta"]


def test_reads_zarr_v3_written_by_zarr_python(tmp_path: Path) -> None:
    zstd = {"compressors": zarr.codecs.ZstdCodec(level=5)}
    write_raw(tmp_path, spec_dataset(tokens_kwargs=zstd), zarr_format=3)
    ft = check_spec_train(tmp_path)
    assert ft.storage_formats()["encoded_tokens"]["compression"] == "zstd"


def test_accepts_the_legacy_tokens_name(tmp_path: Path) -> None:
    write_raw(
        tmp_path,
        {
            "train": flat_split(SPEC_TOKENS, SPEC_STARTS, 8, tokens_name="tokens"),
            "validation": EMPTY,
        },
    )
    ft = check_spec_train(tmp_path)
    assert ft.tokens_name == "tokens"


def test_kvstore_specs() -> None:
    opts = StoreOptions()
    assert kvstore_spec("/a/b", opts) == {"driver": "file", "path": "/a/b/"}
    assert kvstore_spec("file:///a/b/", opts) == {"driver": "file", "path": "/a/b/"}
    assert kvstore_spec("memory://x/y", opts) == {"driver": "memory", "path": "x/y/"}
    assert kvstore_spec("gs://bucket/p/q", opts) == {
        "driver": "gcs",
        "bucket": "bucket",
        "path": "p/q/",
    }
    s3 = StoreOptions(
        endpoint="http://127.0.0.1:9000",
        region="us-east-1",
        credentials={"type": "profile", "profile": "test"},
    )
    assert kvstore_spec("s3://bucket/p", s3) == {
        "driver": "s3",
        "bucket": "bucket",
        "path": "p/",
        "endpoint": "http://127.0.0.1:9000",
        "aws_region": "us-east-1",
        "aws_credentials": {"type": "profile", "profile": "test"},
    }
    assert kvstore_spec("s3://bucket", StoreOptions(credentials="anonymous"))[
        "aws_credentials"
    ] == {"type": "anonymous"}


def test_bad_urls_and_options_are_refused() -> None:
    with pytest.raises(ValueError, match="unsupported URL scheme 'ftp'"):
        kvstore_spec("ftp://host/x", StoreOptions())
    with pytest.raises(ValueError, match="names no bucket"):
        kvstore_spec("gs:///x", StoreOptions())
    with pytest.raises(ValueError, match="endpoint must be an http"):
        StoreOptions(endpoint="127.0.0.1:9000")
    with pytest.raises(ValueError, match="not a credentials type") as refused:
        StoreOptions(credentials="static")
    assert "static" not in str(refused.value)
    with pytest.raises(ValueError, match="either options"):
        ftj.open_dataset("/x", StoreOptions(), region="r")


def test_retries_have_a_maximum() -> None:
    """Issue 35: ``--retries 1000000000`` was accepted: a server that stays down
    would have been retried for centuries."""
    most = StoreOptions(retries=100)
    assert context_spec(most)["s3_request_retries"]["max_retries"] == 99
    assert StoreOptions(retries=np.int64(3)).retries == 3
    for bad in (101, 10**9, 0, 2.0, True):
        with pytest.raises(
            ValueError, match=rf"^StoreOptions.retries must be an int in \[1, 100\], got {bad!r}"
        ):
            StoreOptions(retries=bad)  # type: ignore[arg-type]


def test_plain_paths_and_file_urls_open_the_same(tmp_path: Path) -> None:
    ftj.write_dataset(tmp_path / "ds", {"train": [[5, 6]]})
    a = ftj.open_dataset(tmp_path / "ds")["train"].tokens(0, 2)
    b = ftj.open_dataset(f"file://{tmp_path}/ds")["train"].tokens(0, 2)
    assert a.tolist() == b.tolist() == [5, 6]


def _url_taking_calls(tmp_path: Path) -> dict[str, Callable[..., object]]:
    """Every public function that takes a store URL, called with ``**fields``."""
    from flat_tokens_jax.convert.chat import convert_chat
    from flat_tokens_jax.convert.megatron import export_megatron, import_megatron
    from flat_tokens_jax.convert.merge import merge
    from flat_tokens_jax.convert.text import convert
    from flat_tokens_jax.grain.grain import FlatTokensSource

    url = tmp_path / "ds"
    if not url.exists():
        ftj.write_dataset(url, {"train": [[1, 2, 3]]})
    src = tmp_path / "in.jsonl"
    src.write_text('{"tokens": [1, 2]}\n')
    out = tmp_path / "out"
    return {
        "open_dataset": lambda **kw: ftj.open_dataset(url, **kw),
        "validate": lambda **kw: ftj.validate(url, **kw),
        "summary": lambda **kw: ftj.summary(url, **kw),
        "DatasetWriter": lambda **kw: ftj.DatasetWriter(out, **kw),
        "write_dataset": lambda **kw: ftj.write_dataset(out, {"train": [[1]]}, **kw),
        "merge": lambda **kw: merge([url], out, **kw),
        "convert": lambda **kw: convert(src, out, tokens_key="tokens", **kw),
        "convert_chat": lambda **kw: convert_chat(src, out, tokenizer="no-such", **kw),
        "import_megatron": lambda **kw: import_megatron(["no-such"], out, **kw),
        "export_megatron": lambda **kw: export_megatron(url, tmp_path / "p", **kw),
        "FlatTokensSource": lambda **kw: FlatTokensSource(url, seq_len=2, **kw),
    }


def test_every_url_taking_function_takes_the_store_options_as_keywords(tmp_path: Path) -> None:
    calls = _url_taking_calls(tmp_path)
    try:
        from flat_tokens_jax.convert.beam import convert_beam
    except ImportError:
        pass
    else:
        calls["convert_beam"] = lambda **kw: convert_beam(tmp_path / "in.jsonl", "o", **kw)
    for name, call in calls.items():
        # write_dataset hands its keywords to DatasetWriter, which names itself.
        name = "DatasetWriter" if name == "write_dataset" else name
        # The keywords reach StoreOptions, which checks them, before any work.
        with pytest.raises(ValueError, match=r"StoreOptions.retries must be an int in \[1, 100\]"):
            call(retries=0)
        with pytest.raises(
            TypeError, match=rf"{name} got unexpected keyword arguments \['bogus'\]"
        ):
            call(bogus=1)
        with pytest.raises(ValueError, match=f"{name}: pass either options=.* not both"):
            call(options=StoreOptions(), region="r")
        with pytest.raises(TypeError, match="options must be a StoreOptions, got dict"):
            call(options={"region": "r"})
    assert not (tmp_path / "out").exists()


def test_store_option_keywords_are_the_options_used(tmp_path: Path) -> None:
    url = tmp_path / "ds"
    ftj.write_dataset(url, {"train": [[1, 2, 3]]}, cache_bytes=1 << 20)
    assert ftj.open_dataset(url, cache_bytes=123).store.options.cache_bytes == 123
    with ftj.DatasetWriter(tmp_path / "w", concurrency=3) as w:
        assert w.store.options == StoreOptions(concurrency=3)


def test_request_concurrency_follows_the_reads_in_flight_unless_pinned() -> None:
    # Read-ahead bounds the requests in flight; the limit is only a ceiling.
    assert StoreOptions().concurrency is None
    for scheme in ("gcs", "s3"):
        limit = context_spec(StoreOptions())[f"{scheme}_request_concurrency"]["limit"]
        assert limit == CONCURRENCY_CEILING == 1024
        assert context_spec(StoreOptions(concurrency=3))[f"{scheme}_request_concurrency"] == {
            "limit": 3
        }
    with pytest.raises(ValueError, match=r"concurrency must be at least 1, or None to follow"):
        StoreOptions(concurrency=0)


def test_the_zarr_python_fallback_names_the_extra_when_zarr_is_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_raw(tmp_path, spec_dataset(starts_kwargs=DELTA), zarr_format=2)
    ftj.validate(tmp_path)  # readable while zarr-python is installed
    monkeypatch.setitem(sys.modules, "zarr", None)  # as if not installed
    with pytest.raises(ftj.FormatError, match=r"seq_starts.*needs zarr-python.*\[zarr\]"):
        ftj.open_dataset(tmp_path)
