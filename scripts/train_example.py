"""Train a small decoder-only language model on a flat-tokens store, and resume it after a crash.

The model is plain JAX: token and learned position embeddings (indexed by the
batch's ``positions``), pre-norm attention blocks masked causally and by
``segment_ids`` (a token attends only to earlier tokens of its own sequence),
and a cross-entropy loss weighted by ``loss_mask``. Batches come from
``ftj.Loader`` laid out over a ``("data", "model")`` mesh of every device;
attention heads and the MLP's hidden units are split over ``"model"``.

Every ``checkpoint_every`` steps orbax saves the model, the optimizer state and
``loader.state()`` together. On start the newest checkpoint is restored: the
loader state first, so a checkpoint of other data or another loader config is
refused before anything is trained, then the model, laid out for this run's mesh,
which may differ from the one that saved it. The loader's ``batch_size`` may be
a schedule ``[[start_step, size], ...]``; a run resumed with a schedule that
changes the batch size from its checkpoint's step on continues at exactly the
next unseen sample. ``data`` is a dataset URL, or a mixture of several (a
``data`` section as in ``configs/mixture.yaml``). A YAML with a ``phases``
section instead of ``data`` and ``loader`` trains a run in phases
(``ftj.PhasedLoader``; see ``configs/phases.yaml``), which may gain phases
from its checkpoint's step on.
Usage::

    python scripts/train_example.py --config configs/train_example.yaml \\
        --data data/small --checkpoint-dir /tmp/ckpt --steps 200 --mesh 4x2

Needs the ``example`` extra: ``pip install -e '.[example]'``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import time
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from itertools import islice
from pathlib import Path
from typing import Any, TextIO

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import flat_tokens_jax as ftj
from flat_tokens_jax.core.yamlfile import read_yaml

PyTree = Any
State = dict[str, PyTree]  # {"params": ..., "opt": ...}
Feed = ftj.Loader | ftj.PhasedLoader  # a run's batches: one config, or phases


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Sizes of the decoder.

    Attributes:
        vocab_size: rows of the embedding; ``None``: the dataset's ``max_token_id + 1``.
        d_model: width of the residual stream.
        num_layers: attention + MLP blocks.
        num_heads: attention heads; ``d_model`` must be a multiple of it.
        mlp_dim: hidden units of each MLP.
        max_seq_len: rows of the position table; ``None``: the run's longest
            ``seq_len``. Set it when later phases may bring longer rows.
    """

    vocab_size: int | None = None
    d_model: int = 32
    num_layers: int = 2
    num_heads: int = 4
    mlp_dim: int = 128
    max_seq_len: int | None = None

    def __post_init__(self) -> None:
        for name in ("d_model", "num_layers", "num_heads", "mlp_dim"):
            _check_positive(f"model.{name}", getattr(self, name))
        for name in ("vocab_size", "max_seq_len"):
            if getattr(self, name) is not None:
                _check_positive(f"model.{name}", getattr(self, name))
        if self.d_model % self.num_heads:
            raise ValueError(
                f"model.d_model {self.d_model} is not a multiple of model.num_heads "
                f"{self.num_heads}: choose num_heads among the divisors of d_model"
            )


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """One training run; the YAML file's top-level keys."""

    data: str | Mapping[str, Any] | None  # a dataset URL, or a mixture (configs/mixture.yaml)
    checkpoint_dir: str
    loader: ftj.LoaderConfig | None
    model: ModelConfig
    phases: list[Any] | None = None  # a run in phases: its YAML section, instead of data, loader
    steps: int = 100
    checkpoint_every: int = 10
    keep_checkpoints: int = 3
    mesh: str | None = None  # "DATA" or "DATAxMODEL"; None: every device on "data"
    log_jsonl: str | None = None
    seed: int = 0
    learning_rate: float = 3e-3
    warmup_steps: int = 10

    def __post_init__(self) -> None:
        for name in ("steps", "checkpoint_every", "keep_checkpoints"):
            _check_positive(name, getattr(self, name))
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be an int >= 0, got {self.seed!r}")
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be an int >= 0, got {self.warmup_steps!r}")
        if not isinstance(self.learning_rate, int | float) or not self.learning_rate > 0:
            raise ValueError(f"learning_rate must be a number > 0, got {self.learning_rate!r}")

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> TrainConfig:
        """Builds a config from the YAML mapping, refusing keys it does not know."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown config key(s) {unknown}; known: {sorted(known)}")
        phased = values.get("phases") is not None
        if phased and (values.get("data") or values.get("loader")):
            raise ValueError("a run in phases says data and loader in each phase: drop them")
        for name in ("checkpoint_dir",) if phased else ("data", "checkpoint_dir"):
            if not values.get(name):
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{name} is not set: give it in the config or with {flag}")
        model = ModelConfig(**(values.get("model") or {}))
        loader = None
        if not phased:
            loader = ftj.LoaderConfig.from_dict(values.get("loader") or {}, "loader")
        return cls(**{**values, "model": model, "loader": loader, "data": values.get("data")})


def _check_positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def parse_args(argv: list[str] | None) -> TrainConfig:
    """The config file with the command line's overrides applied."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/train_example.yaml", help="YAML file")
    parser.add_argument("--data", help="dataset URL")
    parser.add_argument("--checkpoint-dir", help="where checkpoints are saved and restored")
    parser.add_argument("--steps", type=int, help="train until this many steps are done")
    parser.add_argument("--checkpoint-every", type=int, help="save after every this many steps")
    parser.add_argument("--mesh", help='"DATA" or "DATAxMODEL" devices, e.g. 8 or 4x2')
    parser.add_argument("--log-jsonl", help="append one JSON line per step to this file")
    args = parser.parse_args(argv)
    values = read_yaml(args.config) or {}
    if not isinstance(values, dict):
        raise ValueError(f"{args.config} is not a mapping of config keys")
    for key in ("data", "checkpoint_dir", "steps", "checkpoint_every", "mesh", "log_jsonl"):
        if getattr(args, key) is not None:
            values[key] = getattr(args, key)
    return TrainConfig.from_dict(values)


def make_mesh(text: str | None) -> jax.sharding.Mesh:
    """A ``("data", "model")`` mesh over every device, from ``"8"`` or ``"4x2"``."""
    count = jax.device_count()
    try:
        shape = [int(n) for n in (text or str(count)).split("x")]
    except ValueError:
        shape = []
    if len(shape) == 1:
        shape.append(1)
    if len(shape) != 2 or min(shape) < 1:
        raise ValueError(f'mesh must look like "8" or "4x2", got {text!r}')
    if shape[0] * shape[1] != count:
        raise ValueError(
            f"mesh {text} needs {shape[0] * shape[1]} devices but there are {count}: choose a "
            "mesh of that many, or on CPU set XLA_FLAGS=--xla_force_host_platform_device_count=N"
        )
    # Auto axes: XLA places the sums of the matmuls that contract a sharded dimension
    # (Explicit axes, jax.make_mesh's default, would need an out_sharding on each).
    return jax.make_mesh(tuple(shape), ("data", "model"), axis_types=(AxisType.Auto,) * 2)


def init_params(seed: int, cfg: ModelConfig, vocab: int, seq_len: int) -> PyTree:
    """Parameters, float32 numpy arrays; d = d_model, h = num_heads, e = d // h, f = mlp_dim.

    Drawn on the host with numpy: nothing to compile, and the same values for any mesh.
    """
    d, h, f = cfg.d_model, cfg.num_heads, cfg.mlp_dim
    rng = np.random.default_rng(seed)

    def normal(shape: tuple[int, ...], fan_in: int) -> np.ndarray:
        return (rng.standard_normal(shape) / np.sqrt(fan_in)).astype(np.float32)

    def ones() -> np.ndarray:
        return np.ones(d, np.float32)

    layers = [
        {
            "attn_norm": ones(),
            "qkv": normal((d, 3, h, d // h), d),  # [d, q/k/v, h, e]
            "attn_out": normal((h, d // h, d), d),  # [h, e, d]
            "mlp_norm": ones(),
            "mlp_in": normal((d, f), d),  # [d, f]
            "mlp_out": normal((f, d), f),  # [f, d]
        }
        for _ in range(cfg.num_layers)
    ]
    return {
        "embed": normal((vocab, d), 1),  # [vocab, d]
        "position": normal((seq_len, d), 1),  # [seq_len, d], indexed by `positions`
        "layers": layers,
        "final_norm": ones(),
        "unembed": normal((d, vocab), d),  # [d, vocab]
    }


def partition_spec(path: tuple[Any, ...], leaf: Any) -> P:
    """Heads and MLP hidden units over ``"model"`` (Megatron style); the rest replicated.

    Keyed by the leaf's name, so Adam's moments, which mirror the parameters, get
    the same layout as their parameter.
    """
    names = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
    name = names[-1] if names else ""
    specs = {
        "qkv": P(None, None, "model", None),
        "attn_out": P("model", None, None),
        "mlp_in": P(None, "model"),
        "mlp_out": P("model", None),
    }
    return specs.get(name, P()) if getattr(leaf, "ndim", 0) else P()


def rms_norm(x: jax.Array, scale: jax.Array) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * scale


def forward(params: PyTree, batch: Mapping[str, jax.Array]) -> jax.Array:
    """Logits ``[batch, seq_len, vocab] float32`` from the loader's fields."""
    segments = batch["segment_ids"]  # [b, t] int32; 0 is padding
    length = segments.shape[1]
    causal = jnp.tril(jnp.ones((length, length), bool))
    # [b, t, t]: earlier tokens of the same sequence. A padding query gets no key;
    # its softmax is then uniform over the masked scores, and loss_mask drops it.
    mask = causal & (segments[:, :, None] == segments[:, None, :]) & (segments[:, :, None] > 0)
    x = params["embed"][batch["inputs"]] + params["position"][batch["positions"]]
    for layer in params["layers"]:
        y = rms_norm(x, layer["attn_norm"])
        q, k, v = jnp.einsum("btd,dzhe->zbthe", y, layer["qkv"])
        scores = jnp.einsum("bqhe,bkhe->bhqk", q, k) / jnp.sqrt(q.shape[-1])
        scores = jnp.where(mask[:, None], scores, jnp.finfo(scores.dtype).min)
        attended = jnp.einsum("bhqk,bkhe->bqhe", jax.nn.softmax(scores, axis=-1), v)
        x = x + jnp.einsum("bqhe,hed->bqd", attended, layer["attn_out"])
        y = rms_norm(x, layer["mlp_norm"])
        x = x + jax.nn.gelu(y @ layer["mlp_in"]) @ layer["mlp_out"]
    return rms_norm(x, params["final_norm"]) @ params["unembed"]


def loss_fn(params: PyTree, batch: Mapping[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
    """Mean cross-entropy of ``targets`` over the tokens where ``loss_mask`` is
    set, and each token's ``[batch, seq_len] float32`` (for a loss per source)."""
    logits = forward(params, batch)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    mask = batch["loss_mask"].astype(jnp.float32)
    return jnp.sum(losses * mask) / jnp.maximum(jnp.sum(mask), 1.0), losses


class Trainer:
    """The optimizer, the state's layout over the mesh, and the jitted train step."""

    def __init__(self, cfg: TrainConfig, mesh: jax.sharding.Mesh, vocab: int, seq_len: int) -> None:
        model_shards = mesh.shape["model"]
        for name in ("num_heads", "mlp_dim"):
            if getattr(cfg.model, name) % model_shards:
                raise ValueError(
                    f"model.{name} {getattr(cfg.model, name)} does not divide over the "
                    f"{model_shards} devices of the mesh's model axis: choose another --mesh"
                )
        schedule = optax.linear_schedule(0.0, cfg.learning_rate, cfg.warmup_steps)
        self.optimizer = optax.adam(schedule)
        self.batch_sharding = NamedSharding(mesh, P("data"))
        self.initial_params = functools.partial(
            init_params, cfg.seed, cfg.model, vocab, cfg.model.max_seq_len or seq_len
        )
        shapes = jax.eval_shape(
            lambda p: {"params": p, "opt": self.optimizer.init(p)}, self.initial_params()
        )
        self.shardings = jax.tree_util.tree_map_with_path(
            lambda path, leaf: NamedSharding(mesh, partition_spec(path, leaf)), shapes
        )
        self.abstract = jax.tree.map(
            lambda s, sharding: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding),
            shapes,
            self.shardings,
        )
        self._init_opt = jax.jit(self.optimizer.init, out_shardings=self.shardings["opt"])
        self.step: Callable[[State, dict[str, jax.Array]], tuple[State, jax.Array]] = jax.jit(
            self._step,
            in_shardings=(self.shardings, self.batch_sharding),
            out_shardings=(self.shardings, NamedSharding(mesh, P())),
            donate_argnums=0,
        )

    def init(self) -> State:
        """A fresh state, laid out over the mesh."""
        params = jax.device_put(self.initial_params(), self.shardings["params"])
        return {"params": params, "opt": self._init_opt(params)}

    def _step(self, state: State, batch: dict[str, jax.Array]) -> tuple[State, jax.Array]:
        (loss, _), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"], batch)
        return self.apply(state, grads), loss

    def apply(self, state: State, grads: PyTree) -> State:
        """The state after one optimizer step on ``grads`` (inside the jitted step)."""
        updates, opt = self.optimizer.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}


def restore(manager: ocp.CheckpointManager, loader: Feed, trainer: Trainer) -> tuple[int, State]:
    """The step to start at and the state to start from: the newest checkpoint's, or fresh.

    Raises:
        ftj.StateMismatch: the checkpoint's data or loader config is not this run's.
    """
    step = manager.latest_step()
    if step is None:
        return 0, trainer.init()
    saved = manager.restore(step, args=ocp.args.Composite(loader=ocp.args.JsonRestore()))
    start = loader.restore(saved["loader"])
    if start != step:
        raise ftj.StateMismatch(f"checkpoint {step} holds a loader state for step {start}")
    loader.start(start)  # input is read while the model state is restored
    state = ocp.args.StandardRestore(trainer.abstract)
    return start, manager.restore(step, args=ocp.args.Composite(state=state))["state"]


def save(manager: ocp.CheckpointManager, step: int, state: State, loader: Feed) -> None:
    """Saves the state and the loader's position together, as checkpoint ``step``.

    Training blocks only while the arrays are copied to host memory; orbax writes
    them in the background and makes the checkpoint visible, whole, when done.
    """
    began = time.perf_counter()
    manager.save(
        step,
        args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), loader=ocp.args.JsonSave(loader.state())
        ),
        force=True,
    )
    print(f"checkpoint {step}: saving, blocked {time.perf_counter() - began:.2f} s", flush=True)


def log_step(out: TextIO | None, step: int, loss: float, tokens_per_s: float, loader: Feed) -> None:
    """Prints the step; appends its JSON line to ``out``, with the global samples
    of this host's rows (from ``loader.provenance``; padding rows left out)."""
    wait = loader.wait_seconds
    print(
        f"step {step}: loss {loss:.4f}, {tokens_per_s:,.0f} tokens/s, "
        f"waited {wait * 1e3:.2f} ms for data",
        flush=True,
    )
    if out is not None:
        samples = [row["sample"] for row in loader.provenance(step) if "sample" in row]
        record = {
            "step": step,
            "loss": loss,
            "tokens_per_s": tokens_per_s,
            "wait_s": wait,
            "samples": samples,
            "input": loader.stats(),
        }
        out.write(json.dumps(record) + "\n")
        out.flush()


def build(cfg: TrainConfig, trainer_type: type[Trainer] = Trainer) -> tuple[Trainer, Feed]:
    """The trainer (a ``trainer_type``) and the loader for this run's mesh and data."""
    mesh = make_mesh(cfg.mesh)
    if cfg.phases is not None:
        phases = ftj.phases_from_config(cfg.phases)
        splits = [s for p in phases for s in _splits(p.source)]
        vocab = cfg.model.vocab_size or max(s.max_token_id for s in splits) + 1
        trainer = trainer_type(cfg, mesh, vocab, max(p.config.seq_len for p in phases))
        phases = [
            dataclasses.replace(p, config=dataclasses.replace(p.config, vocab_size=vocab))
            for p in phases
        ]
        return trainer, ftj.PhasedLoader(phases, sharding=trainer.batch_sharding)
    assert cfg.data is not None and cfg.loader is not None  # checked by from_dict
    if isinstance(cfg.data, str):
        source: ftj.FlatTokens | ftj.Mixture = ftj.open_dataset(cfg.data)["train"]
    else:
        source = ftj.mixture_from_config(cfg.data, "train")
    vocab = cfg.model.vocab_size or max(s.max_token_id for s in _splits(source)) + 1
    trainer = trainer_type(cfg, mesh, vocab, cfg.loader.seq_len)
    loader_cfg = dataclasses.replace(cfg.loader, vocab_size=vocab)
    return trainer, ftj.Loader(source, loader_cfg, sharding=trainer.batch_sharding)


def _splits(source: Any) -> list[ftj.FlatTokens]:
    return list(source.sources) if isinstance(source, ftj.Mixture) else [source]


def tokens_at(loader: Feed, step: int) -> int:
    """Tokens of the batch at ``step`` (rows times the step's ``seq_len``)."""
    if isinstance(loader, ftj.PhasedLoader):
        phase, local = loader.locate(step)
        return phase.config.batch_size_at(local) * phase.config.seq_len
    return loader.config.batch_size_at(step) * loader.config.seq_len


def train(cfg: TrainConfig, trainer: Trainer, loader: Feed) -> int:
    """Runs (or resumes) training up to ``cfg.steps``; returns the exit status."""
    options = ocp.CheckpointManagerOptions(max_to_keep=cfg.keep_checkpoints)
    directory = Path(cfg.checkpoint_dir).absolute()
    # Leaving the block waits for the last save to be written.
    with ocp.CheckpointManager(directory, options=options) as manager, ExitStack() as stack:
        try:
            start, state = restore(manager, loader, trainer)
        except ftj.StateMismatch as e:
            print(f"error: cannot resume from {directory}: {e}", file=sys.stderr)
            return 2
        verb = "resuming" if start else "starting"
        print(f"{verb} at step {start} of {cfg.steps}", flush=True)
        log = None
        if cfg.log_jsonl:
            log = stack.enter_context(open(cfg.log_jsonl, "a", encoding="utf-8"))
        began = time.perf_counter()
        for step, batch in islice(loader.iterate(start), max(cfg.steps - start, 0)):
            state, loss = trainer.step(state, batch)
            value = float(loss)  # waits for the step
            seconds = time.perf_counter() - began  # waiting for data and computing
            tokens = tokens_at(loader, step)
            log_step(log, step, value, tokens / seconds, loader)
            if (step + 1) % cfg.checkpoint_every == 0 or step + 1 == cfg.steps:
                save(manager, step + 1, state, loader)
            began = time.perf_counter()
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = parse_args(argv)
        trainer, loader = build(cfg)
    except ValueError as e:  # bad config, mesh or data, with what to change
        print(f"error: {e}", file=sys.stderr)
        return 2
    return train(cfg, trainer, loader)


if __name__ == "__main__":
    sys.exit(main())
