"""What a run fed its model at a step (``flat-tokens show``): the run rebuilt from
a YAML config, a saved state or a dataset URL, and its rows, as
:meth:`Loader.host_batch` and :meth:`Loader.provenance` give them, as text."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from flat_tokens_jax.convert.tokenizer import load_tokenizer
from flat_tokens_jax.core.limits import (
    ROW_BYTES_PER_TOKEN,
    STEP_BYTES,
    check_memory,
    largest,
    memory_bytes,
)
from flat_tokens_jax.core.values import BadValue, known_keys
from flat_tokens_jax.data.dataset import FlatTokens, open_dataset
from flat_tokens_jax.data.records import recorded_info
from flat_tokens_jax.decoding.batch import FIELDS
from flat_tokens_jax.decoding.layouts import zigzag_order
from flat_tokens_jax.loader.config import LoaderConfig
from flat_tokens_jax.loader.loader import Loader
from flat_tokens_jax.loader.state import SavedState
from flat_tokens_jax.sampling.mixconfig import mixture_from_config
from flat_tokens_jax.sampling.mixture import Mixture
from flat_tokens_jax.sampling.schedule import BatchSchedule
from flat_tokens_jax.store.identity import tokenizer_info
from flat_tokens_jax.store.options import StoreOptions
from flat_tokens_jax.tools.savedstate import saved_source

UNTRAINED = ("⟦", "⟧")  # around tokens whose loss_mask is 0
ROW_BYTES = 1024  # per row of a step, besides its tokens: sample indices, provenance
PRINTED_BYTES_PER_TOKEN = 200  # a printed row's five fields as Python lists, then text


def build_loader(
    *,
    url: str | None = None,
    split: str = "train",
    config: Mapping[str, Any] | None = None,
    state: SavedState | None = None,
    fields: Mapping[str, Any] | None = None,
    options: StoreOptions | None = None,
    config_name: str = "--config",
    state_name: str = "--state",
) -> Loader:
    """The loader of a run. Its data: ``url``'s ``split``, else ``config``'s ``data``
    section (``split`` the part it reads), else ``state``'s ``sources``; a ``state``
    must match the data found. Its config: ``state``'s fingerprint, overridden by
    ``config``'s ``loader`` section, then by ``fields``. ``config_name`` and
    ``state_name`` name a bad value in errors (``c.yaml: loader.seed``)."""
    values: dict[str, Any] = {}
    origin: dict[str, str] = {}  # where each field was given, to name a bad value
    data: Mapping[str, Any] | None = None
    if state is not None:
        values.update(state.phases[0].config)
        origin.update({k: f"{state_name}: fingerprint.config" for k in values})
        origin["batch_size"] = f"{state_name}: fingerprint"
    if config is not None:
        if not isinstance(config, Mapping):
            raise ValueError(f"{config_name} is not a mapping with a 'loader' section")
        unknown = sorted(map(str, set(config) - {"loader", "data"}))
        loader_section = config.get("loader") or {}
        if not isinstance(loader_section, Mapping):
            raise ValueError(f"{config_name}: the 'loader' section is not a mapping")
        known = (f.name for f in dataclasses.fields(LoaderConfig))
        known_keys(loader_section, f"{config_name}: loader", known, "field")
        values.update(loader_section)
        origin.update({k: f"{config_name}: loader" for k in loader_section})
        data = config.get("data")
        if unknown and not values:
            raise ValueError(f"{config_name} has no 'loader' section (found {unknown})")
    given = {k: v for k, v in (fields or {}).items() if v is not None}
    values.update(given)
    origin.update({k: "LoaderConfig" for k in given})
    missing = [k for k in ("batch_size", "seq_len") if k not in values]
    if missing:
        flags = " and ".join("--" + k.replace("_", "-") for k in missing)
        are, them = ("are", "them") if len(missing) > 1 else ("is", "it")
        raise ValueError(
            f"the run's {' and '.join(missing)} {are} not known: pass {flags}, or --config "
            f"with a loader section that sets {them}, or the run's saved --state"
        )
    try:
        # show prints the five fields, whatever layout the run's trainer takes.
        cfg = LoaderConfig.from_dict({**values, "prefetch": 0, "layout": "fields"})
    except BadValue as e:
        field = re.split(r"[ .\[]", e.path.removeprefix("LoaderConfig."))[0]
        raise e.moved("LoaderConfig", origin.get(field, "LoaderConfig")) from None
    check_show_memory(cfg, max(size for _, size in cfg.schedule.entries), 0)
    if url is not None and data is not None:
        raise ValueError("the data is given twice: as URL and as the --config 'data' section")
    if url is not None:
        source: FlatTokens | Mixture = open_dataset(url, options)[split]
    elif data is not None:
        try:
            source = mixture_from_config(data, split, options)
        except BadValue as e:
            raise e.moved("data", f"{config_name}: data") from None
    elif state is not None:
        source = saved_source(state, options)
    else:
        lacking = "" if config is None else f"{config_name} has no 'data' section: "
        raise ValueError(
            f"{lacking}say where the data is: a URL, --config with a 'data' section, or --state"
        )
    loader = Loader(source, cfg)
    if state is not None:
        # Refuses (StateMismatch) what restore refuses.
        state.check(
            loader.fingerprint(), loader.schedule, "the data found is not what the saved run read"
        )
        loader.restore(state)  # its skips and weight changes
    return loader


def parse_skip(text: str) -> tuple[int, int]:
    """A skip to try from ``--skip``: ``"5:3"``, 3 batches skipped at step 5.

    Example:
        >>> parse_skip("5:3")
        (5, 3)
    """
    step, sep, count = text.partition(":")
    try:
        if not sep:
            raise ValueError
        return int(step), int(count)  # Loader.skip checks them
    except ValueError:
        raise ValueError(
            f"--skip {text!r}: expected STEP:COUNT, e.g. 5:3 (3 batches skipped at step 5)"
        ) from None


def steering_lines(state: SavedState, step: int) -> list[str]:
    """What ``show`` prints of a steered run: the changes, the data step that
    ``step`` reads and the weights in effect there (none for another run)."""
    if not (state.weights or state.skips):
        return []
    lines = []
    if state.skips:
        listed = ", ".join(f"{n} at step {s}" for s, n in state.skips)
        lines.append(f"skipped batches: {listed}")
    if state.weights:
        listed = "; ".join(f"from step {t}: {list(counts)}" for t, counts in state.weights)
        lines.append(f"weight changes (samples of each component per period): {listed}")
    at = state.steering_at(step)
    if at.data_step != step:
        (first, n), *rest = at.skipped
        more = "".join(f", {m} at step {s}" for s, m in rest)
        lines.append(
            f"step {step} reads the data of step {at.data_step}: "
            f"{n} batches skipped at step {first}{more}"
        )
    if at.counts is not None and at.shares is not None:
        period = sum(at.counts)
        shares = ", ".join(f"{n} {share:.4g}" for n, share in at.shares.items())
        how = "set at step" if at.changed else "declared, from step"
        lines.append(
            f"weights at step {step}: {shares} ({list(at.counts)} samples per period of "
            f"{period}; {how} {at.since})"
        )
    return lines


def steering_json(state: SavedState, step: int) -> dict[str, Any]:
    """``show --json``'s ``steering`` of ``step``: ``data_step``, ``skipped``
    (``[[step, count], ...]``), ``weights`` (``{name: samples per period}``),
    ``since`` and ``changed``."""
    at = state.steering_at(step)
    counts = None if at.counts is None else dict(zip(at.names, at.counts, strict=True))
    return {
        "data_step": at.data_step,
        "skipped": [list(pair) for pair in at.skipped],
        "weights": counts,
        "since": at.since,
        "changed": at.changed,
    }


def check_show_memory(cfg: LoaderConfig, rows: int, printed: int) -> None:
    """Refuses a step of ``rows`` rows, ``printed`` of them printed, that this
    machine's memory cannot hold (naming the largest batch size, row count or
    ``--seq-len`` that fits), before anything is allocated."""

    def need(rows: int, printed: int, seq_len: int) -> int:
        per_row = seq_len * ROW_BYTES_PER_TOKEN + ROW_BYTES
        return rows * per_row + STEP_BYTES + printed * seq_len * PRINTED_BYTES_PER_TOKEN

    memory = memory_bytes()
    if not memory or need(rows, printed, cfg.seq_len) <= memory:
        return
    fits = largest(lambda n: need(n, min(printed, n), cfg.seq_len) <= memory, 1, rows)
    if fits is not None:
        fix = f"pass a --batch-size of at most {fits:,}"
        fewer = largest(lambda n: need(rows, n, cfg.seq_len) <= memory, 1, printed)
        if fewer is not None:
            fix += f" or print at most {fewer:,} --rows"
    else:
        one = largest(lambda n: need(1, 1, n) <= memory, 1, cfg.seq_len)  # and printed
        fix = "not one row fits: " + (
            "free memory" if one is None else f"pass a --seq-len of at most {one:,}"
        )
    check_memory(
        need(rows, printed, cfg.seq_len),
        f"a step of batch size {rows:,} at seq_len {cfg.seq_len:,}"
        + (f" with {printed:,} rows printed" if printed else ""),
        fix,
    )


def parse_batch_size(text: str) -> int | list[tuple[int, int]]:
    """A batch size from ``--batch-size``: ``"256"``, or a schedule ``"0:256,2000:512"``.

    Example:
        >>> parse_batch_size("0:256,2000:512")
        [(0, 256), (2000, 512)]
    """
    try:
        if ":" not in text:
            return int(text)  # LoaderConfig checks it
        pairs = []
        for part in text.split(","):
            step, _, size = part.strip().partition(":")
            pairs.append((int(step), int(size)))
        BatchSchedule.of(pairs)
    except ValueError as e:
        why = "" if str(e).startswith("invalid literal") else f": {e}"
        raise ValueError(
            f"--batch-size {text!r}{why}; expected a size such as 256 or a schedule "
            "START_STEP:SIZE,... such as 0:256,2000:512"
        ) from None
    return pairs


def parse_rows(text: str | None, batch_size: int) -> list[int]:
    """Row numbers from ``"0,5-7"`` (all rows for ``None``), each checked.

    Example:
        >>> parse_rows("0,5-7", 8)
        [0, 5, 6, 7]
    """
    if text is None:
        return list(range(batch_size))
    rows: list[int] = []
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        try:
            first, last = int(lo), int(hi if sep else lo)
        except ValueError:
            raise ValueError(
                f"--rows {text!r}: expected numbers and ranges such as 0,5-7"
            ) from None
        if not 0 <= first <= last < batch_size:
            raise ValueError(f"--rows {text!r}: {part.strip()} is outside rows 0-{batch_size - 1}")
        rows.extend(range(first, last + 1))
    return sorted(set(rows))


def rows_of(loader: Loader, step: int, rows: Sequence[int]) -> list[dict[str, Any]]:
    """Provenance and the five fields of ``rows`` of ``step``, JSON-ready (a row
    the ``instance_filter`` rejected holds ``"filtered": True``), in the stored
    column order whatever ``context_parallel``, so that text reads as written."""
    batch = loader.host_batch(step)
    config = loader.locate(step)[0].config
    if config.context_parallel > 1:
        back = np.argsort(zigzag_order(config.seq_len, config.context_parallel))
        batch = {k: batch[k][:, back] for k in FIELDS}
    provenance = loader.provenance(step)
    at = {int(r): i for i, r in enumerate(loader.host_rows_at(step))}
    rule = loader.config.instance_filter
    rejected = None if rule is None else rule.rejected(batch["targets"], batch["segment_ids"])
    return [
        {
            **provenance[at[r]],
            **({"filtered": True} if rejected is not None and rejected[at[r]] else {}),
            **{k: batch[k][at[r]].astype(int).tolist() for k in FIELDS},
        }
        for r in rows
        if r in at
    ]


def run_json(loader: Loader, step: int, rows: Sequence[int]) -> dict[str, Any]:
    """What ``show --json`` prints: the step, its phase's config and batch size, and the rows."""
    engine, _ = loader.locate(step)
    fingerprint = engine.sources.fingerprint()
    return {
        "step": step,
        "config": fingerprint["config"],
        "batch_size": fingerprint["batch_size"],
        "sources": loader.sources(loader.phase_at(step)),
        "rows": rows_of(loader, step, rows),
    }


def where(row: Mapping[str, Any]) -> str:
    """One line saying where a row came from."""
    if row.get("padding"):
        return f"row {row['row']}: padding"
    name = f" ({row['component_name']})" if "component_name" in row else ""
    members = f", sequences {row['sequences']}" if "sequences" in row else ""
    filtered = ", filtered (instance_filter: loss_mask 0)" if row.get("filtered") else ""
    return (
        f"row {row['row']}{name}: sample {row['sample']}, epoch {row['epoch']}, "
        f"record {row['record']}, tokens [{row['tokens'][0]}, {row['tokens'][1]})"
        f"{members}{filtered}"
    )


def row_text(row: Mapping[str, Any], decode: Callable[[list[int]], str]) -> str:
    """A row's targets (``[seq_len]`` fields of one row) as text, by ``decode``:
    one line per segment, ``[n]`` its segment id, untrained tokens (``loss_mask``
    0) between ⟦ ⟧, padding counted, not shown.

    Example:
        >>> row = {"targets": [72, 105, 33, 0], "segment_ids": [1, 1, 2, 0],
        ...        "loss_mask": [0, 1, 1, 0]}
        >>> print(row_text(row, lambda ids: bytes(ids).decode()))
        [1] ⟦H⟧i
        [2] !
        (+1 padding)
    """
    targets = np.asarray(row["targets"])
    segments = np.asarray(row["segment_ids"])
    trained = np.asarray(row["loss_mask"]).astype(bool)
    lines = []
    for seg in _runs(segments):
        if segments[seg.start] == 0:
            continue
        pieces = []
        for run in _runs(trained[seg], seg.start):
            text = decode(targets[run].tolist())
            pieces.append(text if trained[run.start] else UNTRAINED[0] + text + UNTRAINED[1])
        lines.append(f"[{segments[seg.start]}] " + "".join(pieces).replace("\n", "\n    "))
    padding = int((segments == 0).sum())
    if padding:
        lines.append(f"(+{padding} padding)")
    return "\n".join(lines)


def _runs(values: np.ndarray, offset: int = 0) -> list[slice]:
    """Slices (plus ``offset``) of the runs of equal consecutive ``values``."""
    cuts = np.flatnonzero(np.diff(values)) + 1
    bounds = [0, *cuts.tolist(), values.size]
    return [slice(offset + a, offset + b) for a, b in itertools.pairwise(bounds)]


def config_fields(args: Any) -> dict[str, Any]:
    """The :class:`LoaderConfig` fields given as flags (``None`` where not given)."""
    values = {
        f.name: getattr(args, f.name, None)
        for f in dataclasses.fields(LoaderConfig)
        if f.name != "prefetch"
    }
    if isinstance(values["batch_size"], str):
        values["batch_size"] = parse_batch_size(values["batch_size"])
    return values


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """``flat-tokens show``'s :class:`LoaderConfig` flags, read by :func:`config_fields`."""
    parser.add_argument(
        "--batch-size",
        help="global batch size, or a schedule START_STEP:SIZE,... e.g. 0:256,2000:512",
    )
    parser.add_argument("--seq-len", type=int, help="tokens per row")
    parser.add_argument(
        "--packing",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="rows are consecutive windows of the concatenated tokens (packing: true)",
    )
    parser.add_argument(
        "--padded", dest="packing", action="store_false", help="one sequence per row, padded"
    )
    parser.add_argument(
        "--bins",
        dest="packing",
        action="store_const",
        const="bins",
        help="whole sequences packed into rows by the packing plan (packing: bins)",
    )
    parser.add_argument(
        "--shuffle",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="records in a fresh shuffled order each epoch (--no-shuffle: in order)",
    )
    parser.add_argument(
        "--blocks",
        dest="shuffle",
        action="store_const",
        const="blocks",
        help="the block shuffle: records read in blocks of consecutive ones (shuffle: blocks)",
    )
    for flag, text in (
        ("--shuffle-block", "with --blocks, records per block (default: about 2**18 tokens)"),
        ("--shuffle-window", "with --blocks, blocks shuffled together (default 1)"),
        ("--seed", "the shuffle's seed (LoaderConfig.seed)"),
        ("--num-epochs", "passes over the records (default: unbounded)"),
        ("--start-token-id", "the input token at a sequence's start (default: the recorded one)"),
        ("--pad-id", "input and target id of padding (default 0)"),
        ("--vocab-size", "check that the data's token ids fit below it"),
    ):
        parser.add_argument(flag, type=int, help=text)


def decoder(path: str, loader: Loader) -> Any:
    """A decode function of the tokenizer at ``path``; refuses one the data was not made with."""
    loaded = load_tokenizer(path)
    for name, records in zip(loader.names, loader.components, strict=True):
        info = recorded_info(records)
        tok = None if info is None else info.tokenizer
        if tok is not None and tok.vocab_hash != tokenizer_info(loaded.tokenizer, path).vocab_hash:
            raise ValueError(
                f"the data of {name!r} was made with {tok.name} ({tok.vocab_hash}), not "
                f"{path}: pass that tokenizer"
            )
    return lambda ids: loaded.tokenizer.decode(ids, skip_special_tokens=False)
