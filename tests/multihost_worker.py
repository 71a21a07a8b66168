"""One process of a multi-host run on CPU: builds global batches, checks them with collectives.

Started by ``tests/test_multihost.py`` as ``python multihost_worker.py CONFIG_JSON
PROCESS_ID``. ``CONFIG["jobs"]`` names the runs this process takes part in, one
after another in the same ``jax.distributed`` session (the same order on every
process), each with a dataset opened and a loader made of its own; the reports,
by job name, go to ``CONFIG["out"] + f".{process_id}.json"``.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from typing import Any


def digest(arrays: dict) -> str:
    h = hashlib.sha256()
    for key in sorted(arrays):
        h.update(key.encode())
        h.update(arrays[key].astype("int64").tobytes())
    return h.hexdigest()


def run(config: dict[str, Any], job: dict[str, Any], pid: int) -> dict[str, Any]:
    """One job: its loader's first ``num_steps`` steps from where it starts, gathered."""
    import jax
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import flat_tokens_jax as ftj

    # config["options"]: StoreOptions fields, for a dataset on an object store;
    # config["endpoints"]: each process's endpoint (a proxy of its own) among them.
    options = dict(config.get("options", {}))
    if "endpoints" in config:
        options["endpoint"] = config["endpoints"][pid]
    ft = ftj.open_dataset(config["dataset"], ftj.StoreOptions(**options))["train"]
    devices = np.array(jax.devices()).reshape(job["mesh_shape"])
    mesh = Mesh(devices, tuple(job["mesh_axes"]))
    spec = P(*[tuple(a) if isinstance(a, list) else a for a in job["spec"]])
    sharding = NamedSharding(mesh, spec)
    if job.get("phases"):  # [[start_step, loader fields], ...]: a run in phases
        phases = [ftj.Phase(s, ft, ftj.LoaderConfig(**fields)) for s, fields in job["phases"]]
        loader = ftj.PhasedLoader(phases, sharding=sharding)
        first = loader
    else:
        source = ft
        if job.get("mixture"):  # {name: weight}: the split blended with itself
            source = ftj.Mixture({name: (ft, w) for name, w in job["mixture"].items()})
        cfg = ftj.LoaderConfig(**job["loader"])
        loader = first = ftj.Loader(source, cfg, sharding=sharding)
    if job.get("restore_from"):
        with open(job["restore_from"]) as f:
            loader.restore(json.load(f))
    if job.get("to_grain"):  # this process's elements of loader.to_grain()
        steps = range(loader.next_step, loader.next_step + job["num_steps"])
        report_grain = {
            step: {
                "rows": loader.host_rows_at(step).tolist(),
                "target_row_sums": local["targets"].astype(np.int64).sum(1).tolist(),
            }
            for step, local in zip(steps, loader.to_grain(), strict=False)
        }
    row_sums = jax.jit(lambda x: x.sum(axis=1))  # int32: ids < 2**15, at most 64 columns
    report: dict = {
        "rows": first.host_rows.tolist(),
        "steps": {},
        "blocks": [[list(b.rows), list(b.cols)] for b in first.host_blocks.blocks],
    }
    start = loader.next_step
    tokens = ft.checked[ft.tokens_name]  # not seq_starts, which sequence shards also read
    before = tokens.data_bytes
    # XLA:CPU runs each of a process's 2 devices on its own: without a wait for
    # each program's outputs, one device can start the next program's gloo
    # collectives while the other still runs this one's, and the peers see
    # the two programs' messages mixed (jax 0.6: "op.preamble.length <=
    # op.nbytes" aborts, or a hang).
    jax.block_until_ready(loader.batch(start))
    report["token_bytes_one_step"] = tokens.data_bytes - before
    for step, batch in loader.iterate():
        jax.block_until_ready(batch)
        gathered = {
            k: np.asarray(multihost_utils.process_allgather(v, tiled=True))
            for k, v in batch.items()
        }
        sums = np.asarray(multihost_utils.process_allgather(row_sums(batch["targets"]), tiled=True))
        report["steps"][step] = {"digest": digest(gathered), "target_row_sums": sums.tolist()}
        report.setdefault("rows_at", {})[step] = loader.host_rows_at(step).tolist()
        # job["steer"]: [[after_step, "skip" | "set_weights", step, value], ...],
        # each made once after_step is handed out, with later steps in flight.
        for after, call, at, value in job.get("steer", []):
            if after == step:
                getattr(loader, call)(at, value)
        if step + 1 == start + job["num_steps"]:
            break
    if job.get("to_grain"):
        report["grain"] = report_grain
    if pid == 0 and job.get("save_state"):
        with open(job["save_state"], "w") as f:
            json.dump(loader.state(), f)
    return report


def main() -> None:
    config = json.loads(sys.argv[1])
    pid = int(sys.argv[2])
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={config['devices']}"
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{config['port']}",
        num_processes=config["processes"],
        process_id=pid,
    )
    reports = {name: run(config, job, pid) for name, job in config["jobs"].items()}
    with open(f"{config['out']}.{pid}.json", "w") as f:
        json.dump(reports, f)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
