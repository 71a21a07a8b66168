"""A grain recipe of MaxText's shape, through ``flat_tokens_jax.trainers.maxtext``; a resume check.

MaxText's ``make_grain_train_iterator(config, mesh, process_indices)`` returns a
``MultiHostDataLoadIterator``: each step it takes this host's rows from a grain
iterator (``local_iterator``) and makes every field a global ``jax.Array``
``[global_batch, max_target_length] int32`` (``inputs``, ``inputs_position``,
``inputs_segmentation``, ``targets``, ``targets_position``,
``targets_segmentation``); orbax saves ``local_iterator`` with grain's handler
beside the train state. The package's ``make_grain_train_iterator`` has that
signature and shape, reading MaxText's own keys (``configs/recipe_maxtext.yaml``,
``grain_train_files`` a flat-tokens store): its checkpointed state is the
loader's (step, samples, fingerprint), so a restore with another
``data_shuffle_seed`` is refused. The toy model weights its loss by
``targets_segmentation != 0``, as MaxText does (0 on padding and on tokens the
loss mask leaves out). It ends with the resume check of ``recipecheck.py``::

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python scripts/recipe_maxtext.py /tmp/rm
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import grain
import jax
import orbax.checkpoint as ocp
import yaml
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from flat_tokens_jax.trainers import maxtext

sys.path.insert(0, str(Path(__file__).resolve().parent))
from recipecheck import Run, init_params, main, sgd_step

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "recipe_maxtext.yaml"


def train(run: Run) -> None:
    config = SimpleNamespace(**yaml.safe_load(CONFIG.read_text()))  # MaxText's pyconfig
    config.grain_train_files, config.data_shuffle_seed = str(run.data), run.seed
    mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(AxisType.Auto,))
    data_iterator = maxtext.make_grain_train_iterator(config, mesh, [jax.process_index()])
    state = jax.device_put(init_params(config.vocab_size), NamedSharding(mesh, PartitionSpec()))
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
