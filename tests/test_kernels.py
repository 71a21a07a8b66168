"""flat_tokens_jax.core.kernels: the compiled decode equals the numpy decode on random
batches (packed windows, padded rows, bins; with and without a stored loss
mask; any row block), and the compiled copy equals a copy element by element."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numba
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import flat_tokens_jax as ftj
from flat_tokens_jax.core import compiled
from flat_tokens_jax.core.fields import Packing
from flat_tokens_jax.data.records import Windows
from flat_tokens_jax.decoding.batch import FIELDS, checked_windows, empty_fields, window_fields
from flat_tokens_jax.decoding.hostdecode import BlockDecoder

kernels = compiled.kernels()
ROOT = Path(__file__).resolve().parents[1]


def test_the_test_environment_has_the_kernels() -> None:
    # The test extra installs numba: without it every test here would pass vacuously.
    assert kernels is not None


@st.composite
def batches(draw: st.DrawFn) -> tuple[Windows, Packing, int, int]:
    packing = draw(st.sampled_from(Packing))
    rows = draw(st.integers(1, 12))
    # Short rows, and rows of many of the kernels' 32-token scan blocks.
    seq_len = draw(st.one_of(st.integers(1, 70), st.integers(70, 400)))
    cols = seq_len + (packing is not Packing.PADDED)
    # Starts anywhere from never to every token, ids up to the largest encodable.
    start_rate = draw(st.sampled_from([0.0, 0.003, 0.02, 0.1, 0.3, 1.0]))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 2**31, (rows, cols), dtype=np.uint32)
    encoded = ids * np.uint32(2) + (rng.random((rows, cols)) < start_rate)
    lengths = None if packing is Packing.WINDOWS else rng.integers(0, seq_len + 1, rows)
    mask = None
    kind = draw(st.sampled_from([None, np.uint8, np.bool_, np.int32, "view"]))
    if kind == "view":  # a non-contiguous view, as bins store their mask
        mask = rng.integers(0, 3, (rows, seq_len + 1)).astype(np.uint8)[:, 1:]
    elif kind is not None:
        mask = rng.integers(0, 3, (rows, seq_len)).astype(kind)
    start_token_id = draw(st.sampled_from([0, 1, 2**31 - 1]))
    pad_id = draw(st.sampled_from([0, 7, 2**31 - 1]))
    return Windows(encoded, lengths=lengths, stored_mask=mask), packing, start_token_id, pad_id


@settings(max_examples=300, deadline=None)
@given(case=batches(), data=st.data())
def test_decode_rows_equals_the_numpy_decode(
    case: tuple[Windows, Packing, int, int], data: st.DataObject
) -> None:
    windows, packing, start, pad = case
    rows = windows.encoded.shape[0]
    seq_len = windows.encoded.shape[1] - (packing is not Packing.PADDED)
    expected = window_fields(windows, packing, start_token_id=start, pad_id=pad)
    checked = checked_windows(windows, packing, seq_len, start_token_id=start, pad_id=pad)
    out = empty_fields(rows, seq_len)
    for v in out.values():
        v.view(np.uint8)[...] = 0xAB  # garbage a kernel must overwrite
    a = data.draw(st.integers(0, rows))
    b = data.draw(st.integers(a, rows))
    for block in ((0, a), (a, b), (b, rows)):
        assert kernels is not None
        kernels.decode_rows(
            checked.encoded,
            checked.lengths,
            checked.stored_mask,
            packing,
            block,
            start_token_id=start,
            pad_id=pad,
            out=out,
        )
    for key in FIELDS:
        assert out[key].tolist() == expected[key].tolist(), key


@settings(max_examples=100, deadline=None)
@given(case=batches(), threads=st.integers(1, 4), min_rows=st.integers(1, 4))
def test_block_decoders_equal_the_numpy_decode(
    case: tuple[Windows, Packing, int, int], threads: int, min_rows: int
) -> None:
    windows, packing, start, pad = case
    seq_len = windows.encoded.shape[1] - (packing is not Packing.PADDED)
    expected = window_fields(windows, packing, start_token_id=start, pad_id=pad)
    for kernel in ("numba", "numpy"):
        decoder = BlockDecoder(threads, min_block_rows=min_rows, kernel=kernel)
        got = decoder.decode(windows, packing, seq_len, start_token_id=start, pad_id=pad)
        for key in FIELDS:
            assert got[key].tolist() == expected[key].tolist(), (kernel, key)
        decoder.close()


def copy_by_element(
    words: np.ndarray,
    pos: list[int],
    count: list[int],
    dest: list[int],
    before: list[int],
    chunk: int,
    gap: int,
    flat: np.ndarray,
) -> None:
    """The brute-force reference of ``kernels.gather``: element ``j`` of a range
    lies ``gap`` further on for every chunk boundary crossed before it."""
    for p, n, d, m in zip(pos, count, dest, before, strict=True):
        for j in range(n):
            crossed = 0 if j < m else 1 + (j - m) // chunk
            flat[d + j] = words[p + j + gap * crossed]


@settings(max_examples=200, deadline=None)
@given(
    chunk=st.integers(1, 9),
    gap=st.integers(0, 2),
    dtype=st.sampled_from([np.uint32, np.uint8]),
    data=st.data(),
)
def test_gather_equals_a_copy_by_element(
    chunk: int, gap: int, dtype: type, data: st.DataObject
) -> None:
    chunks = data.draw(st.integers(1, 8))
    words = np.arange(chunks * (chunk + gap), dtype=np.int64).astype(dtype)
    k = data.draw(st.integers(0, 6))
    pos, count, before = [], [], []
    for _ in range(k):
        c = data.draw(st.integers(0, chunks - 1))
        off = data.draw(st.integers(0, chunk - 1))
        left = (chunks - c) * chunk - off  # elements from there to the end
        pos.append(c * (chunk + gap) + off)
        count.append(data.draw(st.integers(0, left)))
        before.append(chunk - off if gap else count[-1])
    width = max(count, default=0) + data.draw(st.integers(0, 3))
    dest = [r * width for r in range(k)]
    expected = np.zeros(k * width, dtype)
    copy_by_element(words, pos, count, dest, before, chunk, gap, expected)
    got = np.zeros(k * width, dtype)
    assert kernels is not None
    args = [np.array(v, np.int64) for v in (pos, count, dest, before)]
    kernels.gather(words, *args, chunk, gap, got)
    assert got.tolist() == expected.tolist()


def test_checked_windows_refuses_what_window_fields_refuses() -> None:
    w = np.zeros((2, 5), np.uint32)
    with pytest.raises(ValueError, match="rows of 6"):
        checked_windows(Windows(w), Packing.WINDOWS, 6)
    with pytest.raises(ValueError, match="uint32"):
        checked_windows(Windows(w.astype(np.int64)), Packing.WINDOWS, 4)
    with pytest.raises(TypeError, match="lengths"):
        checked_windows(Windows(w), Packing.BINS, 4)
    with pytest.raises(ValueError, match=r"\[0, 4\]"):
        checked_windows(Windows(w, lengths=np.array([1, 5])), Packing.BINS, 4)
    with pytest.raises(ValueError, match="stored_mask"):
        checked_windows(Windows(w, stored_mask=np.ones((2, 5), np.uint8)), Packing.WINDOWS, 4)
    with pytest.raises(ValueError, match="start_token_id"):
        checked_windows(Windows(w), Packing.WINDOWS, 4, start_token_id=2**31)
    with pytest.raises(ValueError, match="kernel"):
        BlockDecoder(2, kernel="cuda")


def test_without_numba_everything_decodes_with_numpy(tmp_path: Path) -> None:
    """In a process where numba cannot be imported: numpy decodes and copies, the
    batches equal those decoded here, and asking for numba says what to install."""
    script = f"""
import sys
sys.modules["numba"] = None  # import numba raises ImportError
import numpy as np
import flat_tokens_jax as ftj
from flat_tokens_jax.decoding.hostdecode import BlockDecoder
ft = ftj.open_dataset({str(tmp_path)!r})["train"]
loader = ftj.Loader(ft, ftj.LoaderConfig(batch_size=4, seq_len=8, seed=3))
assert loader.engine.block_decoder.kernel == "numpy", loader.engine.block_decoder
assert ft.encoded.local.kernels is None
try:
    BlockDecoder(2, kernel="numba")
except ValueError as e:
    assert "flat-tokens-jax[fast]" in str(e), e
else:
    raise AssertionError("kernel='numba' without numba was accepted")
np.save(sys.argv[1], np.stack([list(loader.host_batch(s).values()) for s in range(5)]))
"""
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, 1000, rng.integers(1, 20)).tolist() for _ in range(30)]
    ftj.write_dataset(tmp_path, {"train": seqs}, storage_format=ftj.StorageFormat(chunk_tokens=16))
    out = tmp_path / "batches.npy"
    subprocess.run([sys.executable, "-c", script, str(out)], check=True, cwd=ROOT)
    ft = ftj.open_dataset(tmp_path)["train"]
    loader = ftj.Loader(ft, ftj.LoaderConfig(batch_size=4, seq_len=8, seed=3))
    assert loader.engine.block_decoder.kernel == "numba"
    here = np.stack([list(loader.host_batch(s).values()) for s in range(5)])
    assert np.load(out).tolist() == here.tolist()


_FIRST_BATCHES = """
import json, sys
import numba
import flat_tokens_jax as ftj
from flat_tokens_jax.core import compiled
from flat_tokens_jax.core.fields import Packing
kernels = compiled.kernels()
root = sys.argv[1]
for name, packing in (("plain", True), ("plain", False), ("plain", "bins"), ("masked", True)):
    ft = ftj.open_dataset(f"{root}/{name}")["train"]
    cfg = ftj.LoaderConfig(batch_size=4, seq_len=8, packing=packing, seed=3, prefetch=0)
    ftj.Loader(ft, cfg).host_batch(0)
found = {
    name: {"hits": sum(fn.stats.cache_hits.values()), "misses": sum(fn.stats.cache_misses.values())}
    for name, fn in vars(kernels).items()
    if isinstance(fn, numba.core.registry.CPUDispatcher)
}
print(json.dumps(found))
"""


def test_a_new_process_takes_the_kernels_from_the_disk_cache(tmp_path: Path) -> None:
    """The first process compiles every kernel the loader uses and caches it; a
    second process loads them all from the cache and compiles none before its
    first batches (packed, padded, bins, a stored loss mask; memory-mapped copies)."""
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, 1000, rng.integers(1, 20)).tolist() for _ in range(30)]
    storage_format = ftj.StorageFormat(chunk_tokens=16)
    ftj.write_dataset(tmp_path / "plain", {"train": seqs}, storage_format=storage_format)
    with ftj.DatasetWriter(tmp_path / "masked", storage_format=storage_format) as w:
        for s in seqs:
            w.append("train", s, loss_mask=[i % 2 == 0 for i in range(len(s))])
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba-cache")}
    runs = [
        json.loads(
            subprocess.run(
                [sys.executable, "-c", _FIRST_BATCHES, str(tmp_path)],
                check=True,
                cwd=ROOT,
                env=env,
                capture_output=True,
                text=True,
            ).stdout
        )
        for _ in range(2)
    ]
    first, second = runs
    # The loader's kernels: decode (packed, padded) and the copy; _pad, which
    # they call, is compiled into their cached code.
    called = {"_packed_rows", "_padded_rows", "gather"}
    assert {name for name, stats in first.items() if stats["misses"]} == {*called, "_pad"}
    assert all(stats["misses"] == 0 for stats in second.values()), second
    assert all(second[name]["hits"] >= 1 for name in called), second
    # Every kernel compiled, in the folder of this numba's version alone.
    cached = {(p.parent.name, p.name.split("-")[0]) for p in tmp_path.rglob("*.nb[ic]")}
    assert cached == {(f"numba-{numba.__version__}", f"kernels.{n}") for n in (*called, "_pad")}


_WARMED = """
import json, sys
import flat_tokens_jax as ftj
from flat_tokens_jax.core import compiled
kernels = compiled.kernels()
names = ("gather", "_packed_rows")
compiled.warm()
warmed = {n: len(getattr(kernels, n).signatures) for n in names}
ft = ftj.open_dataset(sys.argv[1])["train"]
ftj.Loader(ft, ftj.LoaderConfig(batch_size=4, seq_len=8, prefetch=0)).host_batch(0)
print(json.dumps([warmed, {n: len(getattr(kernels, n).signatures) for n in names}]))
"""


def test_the_warm_up_loads_the_kernels_a_packed_step_of_a_local_split_calls(
    tmp_path: Path,
) -> None:
    """In a new process, after ``compiled.warm()`` the first packed batch of a
    memory-mapped split loads no further version of the copy or the decode:
    the warm-up called them with the types a step does."""
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, 1000, rng.integers(1, 20)).tolist() for _ in range(30)]
    ftj.write_dataset(tmp_path, {"train": seqs}, storage_format=ftj.StorageFormat(chunk_tokens=16))
    out = subprocess.run(
        [sys.executable, "-c", _WARMED, str(tmp_path)],
        check=True,
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    warmed, after = json.loads(out.stdout)
    assert warmed == after == {"gather": 1, "_packed_rows": 1}
