#!/usr/bin/env bash
# The tests that touch jax, numpy, tensorstore, grain and numba (the fast
# extra), run against the lowest versions pyproject.toml declares
# (scripts/floors.py: jax and jaxlib 0.6.0 among them; sharding, loader and
# multihost tests cover meshes, explicit axes, make_array_from_callback and
# jax.distributed there), with the zarr-python 3 the tests write stores with at
# the test extra's floor, in a second virtual environment, .venv-floors (no
# tests that start a GCS or S3 server: its servers are test extras; of the two
# plain scripts that start grain's worker processes, the one that parses absl
# flags), filled by the uv of .venv that the README's command installs, and
# run on three workers as there, in the same order (the longest files first:
# conftest.py).
# Part of the README's test command.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv-floors
mapfile -t pins < <(python3 scripts/floors.py)
.venv/bin/uv pip install -q -p .venv-floors/bin/python "${pins[@]}" \
  'pytest>=8' 'pytest-xdist>=3.8' 'hypothesis>=6.100' -e .
.venv/bin/uv pip list -p .venv-floors/bin/python 2>/dev/null | grep -E '^(jax|jaxlib|numpy|zarr|numcodecs|tensorstore|grain|google-crc32c|numba) '
.venv-floors/bin/python -m pytest -q -p no:cacheprovider -o addopts="" -n 3 --dist loadfile --no-loadscope-reorder \
  -m "not remote" --deselect "tests/test_grain.py::test_worker_processes_from_a_plain_script_exit_cleanly[unparsed]" \
  tests/test_multihost.py tests/test_grain.py \
  tests/test_format.py tests/test_dataset.py tests/test_store.py tests/test_localshards.py \
  tests/test_writer.py tests/test_integrity.py tests/test_validation.py tests/test_batch.py \
  tests/test_sharding.py tests/test_loader.py tests/test_sampling.py tests/test_mixture.py \
  tests/test_kernels.py tests/test_numbacache.py tests/test_hostdecode.py tests/test_prefetch.py \
  tests/test_schedule.py tests/test_tograin.py tests/test_decodethreads.py tests/test_savedstate_golden.py
