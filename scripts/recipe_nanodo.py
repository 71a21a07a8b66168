"""A grain recipe of nanodo's shape, through ``flat_tokens_jax.trainers.nanodo``; a resume check.

nanodo's config is Python (``get_config()``); its train loop takes each batch
from the grain pipeline ``data.py_batched_tfds(...)`` returns, splits it with
``data.get_in_out`` into inputs, targets and weights, and orbax saves the
iterator (``train_iter``) with grain's handler beside the train state. Here
``data`` is the package's adapter: ``py_batched_tfds`` with nanodo's signature
(``tfds_name`` a flat-tokens store) is ``Loader(...).to_grain()`` in the
``"tokens"`` layout (``tokens`` ``[batch, context_size + 1]`` int32,
``loss_mask`` ``[batch, context_size]`` bool), so the checkpointed state is the
loader's (step, samples, fingerprint) and a restore with another seed is
refused. Its ``get_in_out`` weights the targets by ``loss_mask``, not by
``targets != pad_id`` as nanodo's does: id 0 is a real token here (and ``"!"``
in GPT-2's vocabulary), and padding and untrained chat turns have
``loss_mask`` False. It ends with the resume check of ``recipecheck.py``::

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python scripts/recipe_nanodo.py /tmp/rn
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import grain
import jax
import orbax.checkpoint as ocp
from jax.sharding import AxisType, NamedSharding, PartitionSpec

import flat_tokens_jax as ftj
from flat_tokens_jax.trainers import nanodo as data

sys.path.insert(0, str(Path(__file__).resolve().parent))
from recipecheck import Run, init_params, main, sgd_step


@dataclasses.dataclass(frozen=True)
class Config:
    """The fields of nanodo's ``get_config()`` that its data path reads."""

    ds_name: str  # nanodo's tfds name; here a flat-tokens store
    batch_size: int = 16  # global rows a step
    context_length: int = 32  # tokens a row the model reads (tokens holds one more)
    seed: int = 0  # the loader's: a checkpoint of another seed is refused
    pygrain_worker_count: int = 0  # not used: the loader reads ahead on threads


def train(run: Run) -> None:
    c = Config(str(run.data), seed=run.seed)
    mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(AxisType.Auto,))
    train_ds = data.py_batched_tfds(
        tfds_name=c.ds_name,
        split="train",
        context_size=c.context_length,
        worker_count=c.pygrain_worker_count,
        vocab_path="",
        batch_size=c.batch_size,
        seed=c.seed,
    )
    train_iter = iter(train_ds)
    vocab_size = ftj.open_dataset(c.ds_name)["train"].max_token_id + 1  # no recorded tokenizer
    state = jax.device_put(init_params(vocab_size), NamedSharding(mesh, PartitionSpec()))
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
        in_BxL = next(train_iter)  # every row of the step, as nanodo's
        state, loss = sgd_step(state, *data.get_in_out(in_BxL))
        save = {"state": ocp.args.StandardSave(state)}
        save["train_iter"] = grain.checkpoint.CheckpointSave(train_iter)
        ckpt_mngr.save(step + 1, args=ocp.args.Composite(**save))
        run.record(step, loss, in_BxL)
    ckpt_mngr.close()


if __name__ == "__main__":
    main(train, __doc__)
