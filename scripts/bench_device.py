"""Benchmark: decoding on the host against decoding on the accelerator.

Writes a synthetic dataset (as ``bench_loader.py``) to local disk, then makes
the same shuffled packed batches three ways, on whatever backend jax finds:

* ``decode="host"``: ``Loader.batch``: numpy decode on the host, five fields
  copied to the device (17 bytes a token);
* ``decode="device"``: ``Loader.batch``: the encoded tokens go to the device
  (4 bytes a token) and are decoded there inside ``jax.jit``;
* ``encoded_batch`` + ``decoder`` in the user's jitted step: the decode fused
  into the step (here a step that sums the fields).

Reports host-to-device bytes per token, steps/s and tokens/s over consecutive
steps (``batch`` reads ahead ``prefetch`` steps), and CPU seconds per million
tokens. On the CPU backend "device" is the host itself: the numbers show what
the decode costs in XLA on CPU, not what an accelerator gains.

Run: ``python scripts/bench_device.py [--tokens 50_000_000] [--steps 20]``
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

import flat_tokens_jax as ftj

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_loader import synthetic


def run(fn: Callable[[int], Any], steps: list[int]) -> tuple[float, float]:
    """(wall, cpu) seconds for ``fn`` over consecutive ``steps``, after one warm-up step."""
    jax.block_until_ready(fn(steps[0] - 1))
    wall, cpu = time.perf_counter(), time.process_time()
    for s in steps:
        jax.block_until_ready(fn(s))
    return time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=50_000_000)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--dir", type=Path, default=None)
    args = parser.parse_args()
    root = args.dir or Path(tempfile.mkdtemp(prefix="ftj-bench-device-"))
    B, L = args.batch, args.seq_len
    try:
        path = root / "ds"
        with ftj.DatasetWriter(path, overwrite=True) as w:
            w.extend("train", synthetic(args.tokens))
        ft = ftj.open_dataset(path)["train"]
        host_cfg = ftj.LoaderConfig(batch_size=B, seq_len=L, seed=1, prefetch=2)
        device_cfg = dataclasses.replace(host_cfg, decode="device")
        host, device = ftj.Loader(ft, host_cfg), ftj.Loader(ft, device_cfg)
        fused = ftj.Loader(ft, device_cfg)
        decode = fused.decoder()

        @jax.jit
        def train_step(encoded: dict[str, jax.Array]) -> jax.Array:
            fields = decode(encoded)
            return sum(jnp.sum(v, dtype=jnp.int32) for v in fields.values())

        tokens = B * L
        rows = []
        for label, fn, sent in (
            ('decode="host": batch', host.batch, host.host_batch(0)),
            ('decode="device": batch', device.batch, device.encoded_batch(0)),
            (
                "encoded_batch + decoder in the jitted step (no read-ahead)",
                lambda s: train_step(fused.encoded_batch(s)),
                fused.encoded_batch(0),
            ),
        ):
            bytes_per_token = sum(v.nbytes for v in sent.values()) / tokens
            steps = list(range(1000, 1000 + args.steps))
            wall, cpu = run(fn, steps)
            rows.append((label, bytes_per_token, len(steps) / wall, tokens * len(steps), wall, cpu))
        print(
            f"\nbackend {jax.default_backend()} ({jax.devices()[0].device_kind}), B={B}, L={L}, "
            f"{args.steps} consecutive steps, page cache warm\n"
        )
        print("| path | host→device bytes/token | steps/s | M tokens/s | CPU s / M tokens |")
        print("| --- | ---: | ---: | ---: | ---: |")
        for label, per_token, rate, n, wall, cpu in rows:
            print(
                f"| {label} | {per_token:.2f} | {rate:.1f} | {n / wall / 1e6:.0f} "
                f"| {cpu / n * 1e6:.4f} |"
            )
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
