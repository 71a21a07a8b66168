"""A grain recipe of MaxText's shape: its grain iterator on ``Loader.to_grain()``; a resume check.

MaxText's ``make_grain_train_iterator`` returns a ``MultiHostDataLoadIterator``:
each step it takes this host's rows from a grain iterator (``local_iterator``)
and makes every field a global ``jax.Array`` ``[global_batch,
max_target_length] int32`` (``inputs``, ``inputs_position``,
``inputs_segmentation``, ``targets``, ``targets_position``,
``targets_segmentation``); orbax saves ``local_iterator`` with grain's handler
beside the train state. Here that grain iterator is
``Loader(...).to_grain()``'s in the ``"maxtext"`` layout, configured by
MaxText's own keys (``configs/recipe_maxtext.yaml``): its checkpointed state is
the loader's (step, samples, fingerprint), so a restore with another
``data_shuffle_seed`` is refused. The toy model weights its loss by
``targets_segmentation != 0``, as MaxText does (0 on padding and on tokens the
loss mask leaves out). It ends with the resume check of ``recipecheck.py``::

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python scripts/recipe_maxtext.py /tmp/rm
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import grain
import jax
import orbax.checkpoint as ocp
import yaml
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

import flat_tokens_jax as ftj

sys.path.insert(0, str(Path(__file__).resolve().parent))
from recipecheck import Run, init_params, main, sgd_step

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "recipe_maxtext.yaml"


class MultiHostDataLoadIterator:
    """MaxText's: this host's rows of each step from ``local_iterator``, as global arrays."""

    def __init__(self, dataset: grain.IterDataset, sharding: NamedSharding) -> None:
        self.local_iterator, self.sharding = iter(dataset), sharding

    def __iter__(self) -> MultiHostDataLoadIterator:
        return self

    def __next__(self) -> dict[str, jax.Array]:
        local = next(self.local_iterator)  # {field: [rows of this host, max_target_length]}
        return {
            k: jax.make_array_from_process_local_data(self.sharding, v) for k, v in local.items()
        }


def make_grain_train_iterator(config: dict[str, Any], mesh: Mesh) -> MultiHostDataLoadIterator:
    """MaxText's grain train iterator, reading the flat-tokens store ``dataset_path``."""
    sharding = NamedSharding(mesh, PartitionSpec("data"))
    loader_config = ftj.LoaderConfig(
        batch_size=config["per_device_batch_size"] * mesh.devices.size,
        seq_len=config["max_target_length"],
        packing=config["packing"],
        seed=config["data_shuffle_seed"],
        layout="maxtext",
    )
    train = ftj.open_dataset(config["dataset_path"])["train"]
    return MultiHostDataLoadIterator(
        ftj.Loader(train, loader_config, sharding).to_grain(), sharding
    )


def train(run: Run) -> None:
    config = {**yaml.safe_load(CONFIG.read_text()), "dataset_path": str(run.data)}
    config["data_shuffle_seed"] = run.seed
    mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(AxisType.Auto,))
    data_iterator = make_grain_train_iterator(config, mesh)
    vocab = ftj.open_dataset(run.data)["train"].max_token_id + 1
    state = jax.device_put(init_params(vocab), NamedSharding(mesh, PartitionSpec()))
    options = ocp.CheckpointManagerOptions(save_interval_steps=run.every)
    with ocp.CheckpointManager(run.ckpt.absolute(), options=options) as manager:
        start = manager.latest_step() or 0
        if start:  # the train state and the data iterator's state, saved together
            restored = manager.restore(
                start,
                args=ocp.args.Composite(
                    items=ocp.args.StandardRestore(state),
                    iter=grain.checkpoint.CheckpointRestore(data_iterator.local_iterator),
                ),  # StateMismatch: another data_shuffle_seed, other data
            )
            state = restored["items"]
        for step in range(start, run.steps):
            batch = next(data_iterator)
            weights = batch["targets_segmentation"] != 0
            state, loss = sgd_step(state, batch["inputs"], batch["targets"], weights)
            manager.save(
                step + 1,
                args=ocp.args.Composite(
                    items=ocp.args.StandardSave(state),
                    iter=grain.checkpoint.CheckpointSave(data_iterator.local_iterator),
                ),
            )
            run.record(step, loss, batch)


if __name__ == "__main__":
    main(train, __doc__)
