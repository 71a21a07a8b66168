"""A grain recipe of nanodo's shape: dict batches into a ``get_in_out`` split; a resume check.

nanodo's config is Python (``get_config()``); its train loop takes each batch
from a grain iterator, splits it with ``data.get_in_out`` into inputs, targets
and weights, and orbax saves the iterator (``train_iter``) with grain's handler
beside the train state. Here the iterator is ``Loader(...).to_grain()``'s in the
``"tokens"`` layout (``tokens`` ``[batch, seq_len + 1]`` int32, ``loss_mask``
``[batch, seq_len]`` bool), so the checkpointed state is the loader's (step,
samples, fingerprint) and a restore with another seed is refused.
``get_in_out`` shifts the tokens and weights by ``loss_mask``, not by
``targets != pad_id`` as nanodo's does: id 0 is a real token here (and ``"!"`` in
GPT-2's vocabulary), and padding and untrained chat turns have ``loss_mask``
False. It ends with the resume check of ``recipecheck.py``::

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python scripts/recipe_nanodo.py /tmp/rn
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping
from pathlib import Path

import grain
import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from jax.sharding import AxisType, NamedSharding, PartitionSpec

import flat_tokens_jax as ftj

sys.path.insert(0, str(Path(__file__).resolve().parent))
from recipecheck import Run, init_params, main, sgd_step


@dataclasses.dataclass(frozen=True)
class Config:
    """The fields of nanodo's ``get_config()`` that its data path reads."""

    batch_size: int = 16  # global rows a step, over every process
    seq_len: int = 32  # tokens a row the model reads (tokens holds one more)
    seed: int = 0  # the loader's: a checkpoint of another seed is refused


def get_in_out(batch: Mapping[str, jax.Array]) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Inputs and targets ``[batch, seq_len]`` int32, weights ``[batch, seq_len]`` float32."""
    tokens = batch["tokens"]
    return tokens[:, :-1], tokens[:, 1:], batch["loss_mask"].astype(jnp.float32)


def train(run: Run) -> None:
    c = Config(seed=run.seed)
    mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(AxisType.Auto,))
    sharding = NamedSharding(mesh, PartitionSpec("data"))  # rows over every device
    split = ftj.open_dataset(run.data)["train"]
    config = ftj.LoaderConfig(c.batch_size, c.seq_len, seed=c.seed, layout="tokens")
    train_iter = iter(ftj.Loader(split, config, sharding).to_grain())
    state = jax.device_put(
        init_params(split.max_token_id + 1), NamedSharding(mesh, PartitionSpec())
    )
    options = ocp.CheckpointManagerOptions(save_interval_steps=run.every)
    ckpt_mngr = ocp.CheckpointManager(run.ckpt.absolute(), options=options)
    start = ckpt_mngr.latest_step()
    if start is not None:  # StateMismatch here: a checkpoint of another seed or other data
        ckpt = ocp.args.Composite(
            state=ocp.args.StandardRestore(state),
            train_iter=grain.checkpoint.CheckpointRestore(train_iter),
        )
        state = ckpt_mngr.restore(start, args=ckpt)["state"]
    for step in range(start or 0, run.steps):
        local = next(train_iter)  # this process's rows of the step
        batch = {k: jax.make_array_from_process_local_data(sharding, v) for k, v in local.items()}
        state, loss = sgd_step(state, *get_in_out(batch))
        save = {"state": ocp.args.StandardSave(state)}
        save["train_iter"] = grain.checkpoint.CheckpointSave(train_iter)
        ckpt_mngr.save(step + 1, args=ocp.args.Composite(**save))
        run.record(step, loss, local)
    ckpt_mngr.close()


if __name__ == "__main__":
    main(train, __doc__)
