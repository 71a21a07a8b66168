"""A grain-pipeline trainer (nanodo's, MaxText's shape) on ``Loader.to_grain``; a resume check.

It iterates ``Loader(...).to_grain()`` (this host's rows of each step, under
``mp_prefetch`` with ``--workers``) in the ``"tokens"`` layout and
shifts the tokens itself: an embedding and a linear read-out (plain SGD) predict
``tokens[:, 1:]`` from ``tokens[:, :-1]``, the loss weighted by ``loss_mask``, not
by ``token != 0`` (id 0 is a real token in most vocabularies). A first run saves
the grain iterator's ``get_state()`` and the params at step ``--save-at``; a
second run, with a new pipeline, restores them. Prints ``resume: identical``
(exit 0) when its losses and batches equal the first run's bit for bit, else
``resume: DIFFERENT`` (exit 1)::

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python scripts/train_grain.py /tmp/tg
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import grain
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec

import flat_tokens_jax as ftj


def loss_fn(params: dict[str, jax.Array], batch: dict[str, jax.Array]) -> jax.Array:
    """Mean cross-entropy of ``tokens[:, 1:]`` given ``tokens[:, :-1]``, over ``loss_mask``."""
    x, y = batch["tokens"][:, :-1], batch["tokens"][:, 1:]  # [batch, seq_len] each
    logp = jax.nn.log_softmax(params["embed"][x] @ params["out"])  # [batch, seq_len, vocab]
    nll = -jnp.take_along_axis(logp, y[..., None], axis=-1)[..., 0]
    return (nll * batch["loss_mask"]).sum() / batch["loss_mask"].sum()


def train(args: argparse.Namespace, start: int) -> list[tuple[float, str]]:
    """(loss, batch digest) of steps ``[start, args.steps)``, restored if ``start > 0``."""
    mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(AxisType.Auto,))
    sharding = NamedSharding(mesh, PartitionSpec("data"))  # rows over every device
    split = ftj.open_dataset(args.data)["train"]
    config = ftj.LoaderConfig(args.batch_size, args.seq_len, layout="tokens", seed=0)
    ds = ftj.Loader(split, config, sharding).to_grain()
    if args.workers:
        ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=args.workers))
    iterator = iter(ds)
    w = np.random.default_rng(0).normal(0, 0.1, (2, split.max_token_id + 1, 16)).astype("f4")
    params = {"embed": w[0], "out": w[1].T}
    if start:
        saved = np.load(args.dir / "checkpoint.npz")
        if int(saved["step"]) != start:
            sys.exit(f"checkpoint at step {int(saved['step'])}, not {start}")
        iterator.set_state(json.loads(str(saved["data"])))
        for _ in range(args.skip_on_restore):
            next(iterator)
        params = {name: saved[name] for name in params}
    params = jax.device_put(params, NamedSharding(mesh, PartitionSpec()))

    @jax.jit
    def sgd_step(params: dict, batch: dict) -> tuple[dict, jax.Array]:
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        return jax.tree.map(lambda w, dw: w - args.lr * dw, params, grads), loss

    out = []
    for step in range(start, args.steps):
        local = next(iterator)  # this host's rows: tokens [rows, L + 1], the rest [rows, L]
        digest = hashlib.sha256(b"".join(local[k].tobytes() for k in sorted(local)))
        batch = {k: jax.make_array_from_process_local_data(sharding, v) for k, v in local.items()}
        params, loss = sgd_step(params, batch)
        out.append((float(loss), digest.hexdigest()))
        print(f"step {step} loss {float(loss):.6f}")
        if start == 0 and step + 1 == args.save_at:
            arrays = {k: np.asarray(v) for k, v in params.items()}
            state = json.dumps(iterator.get_state())  # the next element is step + 1's
            np.savez(args.dir / "checkpoint.npz", step=step + 1, data=state, **arrays)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dir", type=Path, help="the checkpoint's folder")
    parser.add_argument("--data", type=Path, help="a local store (default: DIR/data, made)")
    for flag, default in {"steps": 12, "save-at": 5, "batch-size": 16, "seq-len": 32}.items():
        parser.add_argument(f"--{flag}", type=int, default=default)
    parser.add_argument("--lr", type=float, default=10.0)
    parser.add_argument("--workers", type=int, default=0, help="grain worker processes")
    wrong = "batches dropped after the restore: a wrong resume, which the check must catch"
    parser.add_argument("--skip-on-restore", type=int, default=0, help=wrong)
    args = parser.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    args.data = args.data or args.dir / "data"
    if not args.data.exists():  # 400 sequences counting up from a random id, mod 64: id 0
        r = np.random.default_rng(0)  # is a token here, as "!" is in GPT-2's vocabulary
        seqs = [(r.integers(64) + np.arange(n)) % 64 for n in r.integers(8, 99, 400)]
        ftj.write_dataset(args.data, {"train": seqs})
    whole, resumed = train(args, 0), train(args, args.save_at)
    same = resumed == whole[args.save_at :]
    print(f"resume: {'identical' if same else 'DIFFERENT'}, steps {args.save_at}-{args.steps - 1}")
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
