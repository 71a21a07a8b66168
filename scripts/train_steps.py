"""A step-indexed trainer (seqax's shape) on ``flat_tokens_jax.trainers.seqax``; a resume check.

seqax's ``get_loader(split, config, token_batch_params)`` (its
``FlatTokensParams`` and ``TokenBatchParams``, here as seqax defines them)
gives ``loader.load(step)``, a pure function of the step, so a resume needs only
the saved step. An embedding and a linear read-out, trained by plain SGD
(``jax.grad``), see batches sharded over a ``"d"`` mesh of every device. A first
run trains ``--steps`` steps and saves ``{step, params, loader.state(step)}``
with numpy at step ``--save-at``; a second run, with a new loader, restores it
and trains the rest. Prints ``resume: identical`` (exit 0) when its losses and
batches equal the first run's bit for bit, else ``resume: DIFFERENT`` (exit 1)::

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python scripts/train_steps.py /tmp/ts
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import flat_tokens_jax as ftj
from flat_tokens_jax.trainers import seqax


@dataclasses.dataclass(frozen=True)
class FlatTokensParams:
    """seqax's (``input_loader.py``): the store, its shuffle, and packing."""

    filespec: str
    streams: int  # not used: each host reads its own rows
    read_blocks_per_shuffle_buffer: int  # blocks shuffled together
    sequences_per_read_block: int  # records read as one request
    seed: int
    sequence_packing: bool


@dataclasses.dataclass(frozen=True)
class TokenBatchParams:
    """seqax's: the shape of a batch."""

    len: int
    batch: int


def loss_fn(params: dict[str, jax.Array], batch: dict[str, jax.Array]) -> jax.Array:
    """Mean cross-entropy over the targets whose ``loss_mask`` is set."""
    logits = params["embed"][batch["inputs"]] @ params["out"]  # [batch, seq_len, vocab]
    logp = jax.nn.log_softmax(logits)
    nll = -jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1)[..., 0]
    return (nll * batch["loss_mask"]).sum() / batch["loss_mask"].sum()


def train(args: argparse.Namespace, start: int) -> list[tuple[float, str]]:
    """(loss, batch digest) of steps ``[start, args.steps)``, restored if ``start > 0``."""
    mesh = jax.make_mesh((jax.device_count(),), ("d",), axis_types=(AxisType.Auto,))
    params = FlatTokensParams(str(args.data), 1, 4, 8, seed=0, sequence_packing=True)
    batch_params = TokenBatchParams(len=args.seq_len, batch=args.batch_size)
    loader = seqax.get_loader("train", params, batch_params, NamedSharding(mesh, P("d")))
    w = np.random.default_rng(0).normal(0, 0.1, (2, loader.max_token_id + 1, 16)).astype("f4")
    params = {"embed": w[0], "out": w[1].T}
    if start:
        saved = np.load(args.dir / "checkpoint.npz")
        at = loader.restore(json.loads(str(saved["loader"])))  # StateMismatch: other data
        if at != start or int(saved["step"]) != start:
            sys.exit(f"checkpoint at step {int(saved['step'])}, loader at {at}, not {start}")
        params = {name: saved[name] for name in params}
    params = jax.device_put(params, NamedSharding(mesh, P()))  # replicated

    @jax.jit
    def sgd_step(params: dict, batch: dict) -> tuple[dict, jax.Array]:
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        return jax.tree.map(lambda w, dw: w - args.lr * dw, params, grads), loss

    out = []
    for step in range(start, args.steps):
        batch = loader.load(step)  # [batch_size, seq_len] arrays sharded over "d"
        params, loss = sgd_step(params, batch)
        digest = hashlib.sha256(b"".join(np.asarray(batch[k]).tobytes() for k in sorted(batch)))
        out.append((float(loss), digest.hexdigest()))
        print(f"step {step} loss {float(loss):.6f}")
        if start == 0 and step + 1 == args.save_at:
            arrays = {k: np.asarray(v) for k, v in params.items()}
            state = json.dumps(loader.state(step + 1))  # restores to resume at step + 1
            np.savez(args.dir / "checkpoint.npz", step=step + 1, loader=state, **arrays)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dir", type=Path, help="the checkpoint's folder")
    parser.add_argument("--data", type=Path, help="a local store (default: DIR/data, made)")
    for flag, default in {"steps": 12, "save-at": 5, "batch-size": 16, "seq-len": 32}.items():
        parser.add_argument(f"--{flag}", type=int, default=default)
    parser.add_argument("--lr", type=float, default=10.0)
    args = parser.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    args.data = args.data or args.dir / "data"
    if not args.data.exists():  # 400 sequences counting up from a random id, mod 63
        r = np.random.default_rng(0)
        seqs = [(r.integers(63) + np.arange(n)) % 63 + 1 for n in r.integers(8, 99, 400)]
        ftj.write_dataset(args.data, {"train": seqs})
    whole, resumed = train(args, 0), train(args, args.save_at)
    same = resumed == whole[args.save_at :]
    print(f"resume: {'identical' if same else 'DIFFERENT'}, steps {args.save_at}-{args.steps - 1}")
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
