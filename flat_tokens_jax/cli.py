"""flat-tokens: write, check, inspect and convert flat-tokens datasets, and
show or preview what a run's loader reads at any step."""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import signal
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from flat_tokens_jax.convert import chat, corpora, megatron, merge, text
from flat_tokens_jax.convert.commands import (
    add_store_flags,
    at_least,
    between,
    fail,
    path_error,
    positive_seconds,
    refuse_memory_output,
    store_options,
)
from flat_tokens_jax.core.format import FormatError
from flat_tokens_jax.core.urls import redact_text
from flat_tokens_jax.core.values import integer
from flat_tokens_jax.core.yamlfile import read_yaml
from flat_tokens_jax.data.plans import pack_dataset, plan_group
from flat_tokens_jax.data.validation import summary, validate
from flat_tokens_jax.loader.loader import Loader
from flat_tokens_jax.loader.phasedloader import PhasedLoader
from flat_tokens_jax.loader.steered import apply_skips
from flat_tokens_jax.store.identity import library_version
from flat_tokens_jax.store.options import StoreError
from flat_tokens_jax.tools import phaseshow, runview, savedstate, show
from flat_tokens_jax.tools.runview import MAX_SAMPLE_STEPS, preview_requests


def _store_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("url", help="dataset path or URL (file://, memory://, gs://, s3://)")
    add_store_flags(parser)


def _cmd_validate(args: argparse.Namespace) -> int:
    try:
        validate(args.url, store_options(args), quick=args.quick)
    except FormatError as e:
        print(f"{args.url}: INVALID, {len(e.problems)} problem(s):", file=sys.stderr)
        for p in e.problems:
            print(f"  {p}", file=sys.stderr)
        return 1
    except (StoreError, ValueError) as e:
        return fail("validate", e)
    print(f"{args.url}: valid" + (" (sampled: --quick)" if args.quick else ""))
    return 0


_EIGHTHS = " ▏▎▍▌▋▊▉█"
_BAR_WIDTH = 40


def _bar(count: int, largest: int, unicode: bool) -> str:
    """A bar of ``count``, ``largest`` filling :data:`_BAR_WIDTH` (a sliver at least above 0)."""
    if not count:
        return ""
    eighths = max(1, round(count / largest * _BAR_WIDTH * 8))
    if not unicode:
        return "#" * max(1, round(eighths / 8))
    full, part = divmod(eighths, 8)
    return "█" * full + (_EIGHTHS[part] if part else "")


def _format_histogram(hist: dict[str, list[int]], unicode: bool) -> list[str]:
    edges, counts = hist["edges"], hist["counts"]
    largest = max(counts)
    spans = [f"{lo}-{hi - 1}" if hi - 1 > lo else f"{lo}" for lo, hi in itertools.pairwise(edges)]
    width = max(len(x) for x in spans)
    return [
        f"      {span:>{width}} | {_bar(c, largest, unicode):<{_BAR_WIDTH}} {c:,}"
        for span, c in zip(spans, counts, strict=True)
    ]


def _format_made_by(made: dict[str, Any] | None) -> list[str]:
    if made is None:
        return ["  made by: not recorded"]
    lines = [f"  made by: flat_tokens_jax {made.get('library_version', '?')}"]
    tok = made.get("tokenizer")
    if tok is None:
        lines.append("    tokenizer: not recorded")
    else:
        ids = ", ".join(
            f"{k.removesuffix('_id')} {'-' if tok.get(k) is None else tok[k]}"
            for k in ("bos_id", "eos_id", "pad_id")
        )
        lines.append(
            f"    tokenizer: {tok['name']} ({tok['vocab_hash']}), "
            f"vocab_size {tok['vocab_size']:,}, {ids}"
        )
    start = made.get("start_token_id")
    lines.append(f"    start_token_id: {'not recorded (0)' if start is None else start}")
    flags = made.get("flags") or {}
    if flags:
        lines.append("    flags: " + ", ".join(f"{k}={json.dumps(v)}" for k, v in flags.items()))
    inputs = made.get("inputs") or {}
    if inputs:
        hashed = inputs.get("sha256", "not hashed")
        names = inputs.get("names", [])
        shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
        lines.append(f"    inputs: {inputs.get('count', len(names))} ({shown}), {hashed}")
    return lines


def _format_info(info: dict[str, Any], unicode: bool = True) -> str:
    lines = [f"{info['url']} (zarr v{info['zarr_format']})"]
    lines += _format_made_by(info.get("info"))
    for name, s in info["splits"].items():
        lines.append(
            f"  {name}: {s['num_tokens']:,} tokens, {s['num_sequences']:,} sequences, "
            f"max_token_id {s['max_token_id']}" + (", with loss_mask" if s["loss_mask"] else "")
        )
        if "lengths" in s:
            ln = s["lengths"]
            approx = " (sampled)" if s["lengths_sampled"] else ""
            lines.append(
                f"    lengths{approx}: mean {ln['mean']:.1f}, min {ln['min']}, "
                f"median {ln['median']:g}, p90 {ln['p90']:g}, p99 {ln['p99']:g}, "
                f"max {ln['max']}"
            )
            lines.append(f"    length histogram{approx} (sequences per length range):")
            lines += _format_histogram(s["histogram"], unicode)
        for seq_len, plan in s.get("packing_plans", {}).items():
            if not isinstance(plan, dict):
                lines.append(f"    packing plan seq_len {seq_len}: malformed (run validate)")
                continue
            filled = plan.get("filled")
            about = "~" if plan.get("filled_sampled") else ""
            fill = "" if filled is None else f" ({about}{filled:.1%} filled)"
            lines.append(
                f"    packing plan seq_len {seq_len}: {plan.get('num_bins', 0):,} bins"
                f"{fill}, {plan.get('algorithm')}, digest {plan.get('digest')}"
            )
        for array, lay in s["layout"].items():
            shard = f", shard {lay['shard']}" if lay["shard"] else ""
            filters = f", filters {lay['filters']}" if lay["filters"] else ""
            checksum = ", crc32c checksums" if lay.get("checksum") else ""
            lines.append(
                f"    {array}: chunk {lay['chunk']}{shard}, "
                f"compression {lay['compression'] or 'none'}{filters}{checksum}"
            )
    return "\n".join(lines)


def _cmd_info(args: argparse.Namespace) -> int:
    try:
        info = summary(args.url, store_options(args))
    except (StoreError, ValueError) as e:
        return fail("info", e)
    unicode = "utf" in (sys.stdout.encoding or "").lower()
    print(json.dumps(info, indent=2) if args.json else _format_info(info, unicode))
    return 0


def _cmd_pack(args: argparse.Namespace) -> int:
    try:
        plans = pack_dataset(
            args.url, args.seq_len, splits=args.split or None, options=store_options(args)
        )
    except (StoreError, ValueError, KeyError) as e:
        return fail("pack", e)
    for split, plan in plans.items():
        print(
            f"{args.url}/{plan_group(split, args.seq_len)}: {plan.num_bins:,} bins of "
            f"{plan.source['num_sequences']:,} sequences ({plan.algorithm}, digest {plan.digest})"
        )
    return 0


def _cmd_show(args: argparse.Namespace) -> int:
    try:
        config = None if args.config is None else read_yaml(args.config)
        if args.config is not None and config is None:
            raise ValueError(
                f"{args.config} is empty: --config reads a 'loader' section and optionally "
                "a 'data' section, or a 'phases' section"
            )
        state = None if args.state is None else savedstate.load_state(args.state)
        if config is not None and state is not None:
            raise ValueError("give the run as --config or as --state, not both")
        added = [show.parse_skip(text) for text in args.skip or ()]
        build: Callable[..., Loader] = functools.partial(show.build_loader, url=args.url)
        if (isinstance(config, Mapping) and "phases" in config) or (state and state.phased):
            build = phaseshow.build_run
        loader = build(
            config=config,
            state=state,
            split=args.split,
            options=store_options(args),
            fields=show.config_fields(args),
            config_name=args.config or "--config",
            state_name=args.state or "--state",
        )
        _add_skips(loader, config, args.config, added)
        step = args.step
        size = loader.batch_size_at(step)
        show.check_show_memory(loader.config, size, size if args.rows is None else 0)
        rows = show.parse_rows(args.rows, size)
        show.check_show_memory(loader.config, size, len(rows))
        decode = None if args.tokenizer is None else show.decoder(args.tokenizer, loader)
        shown = show.run_json(loader, step, rows)
        if isinstance(loader, PhasedLoader):
            k = loader.phase_at(step)
            shown["phase"] = {
                "index": k,
                "name": loader.phases[k].name,
                "start_step": loader.starts[k],
                "step": step - loader.firsts[k],
            }
        steered = loader.saved_state()
        steering = show.steering_lines(steered, step)
        if steering:
            shown["steering"] = show.steering_json(steered, step)
    except (StoreError, IndexError, KeyError, ValueError, OSError) as e:
        return fail("show", e)
    if args.json:
        print(json.dumps(shown))
        return 0
    where = [(str(s["name"]), s.get("url", s.get("repr"))) for s in shown["sources"]]
    # A single dataset is named "0": its URL says it; a mixture's components by name.
    names = where[0][1] if len(where) == 1 else ", ".join(f"{n} = {u}" for n, u in where)
    phase = shown.get("phase")
    if phase is not None:
        label = "" if phase["name"] is None else f" {phase['name']!r}"
        print(
            f"step {args.step} is in phase {phase['index']}{label} (from step "
            f"{phase['start_step']}; its step {phase['step']})"
        )
    print(f"step {args.step}, batch_size {shown['batch_size']}, data {names}: {shown['config']}")
    for line in steering:
        print(line)
    if decode is not None:
        print(f"[n]: segment n; {show.UNTRAINED[0]}...{show.UNTRAINED[1]}: loss_mask 0")
    for row in shown["rows"]:
        print(show.where(row))
        if row.get("padding"):
            continue
        if decode is None:
            for key in show.FIELDS:
                print(f"  {key:<12}{row[key]}")
        else:
            print("  " + show.row_text(row, decode).replace("\n", "\n  "))
    return 0


def _add_skips(run: Loader, config: Any, name: str, added: list[tuple[int, int]]) -> None:
    """Skips of ``show`` and ``preview``: the YAML's ``skip`` list, then ``--skip``'s."""
    if isinstance(config, Mapping) and "skip" in config:
        try:
            apply_skips(run, config["skip"])
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
    for at, count in added:
        run.skip(at, count)


_SAMPLE_STEPS = 8  # --sample-steps when not given


def _cmd_preview(args: argparse.Namespace) -> int:
    name = args.run_yaml
    _check_preview_flags(args)
    doc = read_yaml(name)
    run = phaseshow.run_from_yaml(doc, name, split=args.split, options=store_options(args))
    _add_skips(run, doc, name, [])
    if args.state is not None:
        state = savedstate.load_state(args.state)
        try:
            run.restore(state)
        except ValueError as e:
            raise ValueError(f"--state {args.state}: {e}") from None
    end = _run_end(args, doc)
    if args.requests:
        steps = _SAMPLE_STEPS if args.sample_steps is None else args.sample_steps
        lines = preview_requests(run, args.hosts, args.step_seconds, steps, name, end)
        print("\n".join(lines))
        return 0
    if end is None:
        raise ValueError(f"{name}: say where the run ends: --steps N (or a top-level 'steps: N')")
    try:
        rows = runview.run_rows(run, end)
    except ValueError as e:
        raise ValueError(f"{name}: --steps {end}: {e}") from None
    warnings = runview.repeat_warnings(run, rows)
    if args.picture is not None:
        try:
            runview.draw_shares(run, end, args.picture)
        except OSError as e:
            raise path_error("--picture", args.picture, e, "a .png or .svg file") from None
    steered = runview.steering_rows(run)
    if args.json:
        print(json.dumps({"rows": rows, "steering": steered} if steered else rows))
    else:
        print("\n".join(runview.run_table(rows) + runview.steering_table(steered)))
    for line in warnings:
        print(f"preview: warning: {line}", file=sys.stderr)
    if args.picture is not None and not args.json:
        print(f"wrote {args.picture}")
    return 0


def _check_preview_flags(args: argparse.Namespace) -> None:
    """Refuses ``preview`` flags that the command given would not read."""
    if args.requests:
        unread = [f for f, v in (("--picture", args.picture), ("--json", args.json)) if v]
        if unread:
            flags = " and ".join(unread)
            raise ValueError(f"--requests prints its table only, not {flags}: drop {flags}")
        missing = [f for f in ("hosts", "step_seconds") if getattr(args, f) is None]
        if missing:
            flags = " and ".join("--" + f.replace("_", "-") for f in missing)
            raise ValueError(
                f"preview --requests: give {flags} (the pod's hosts and its step time)"
            )
        return
    given = [
        "--" + f.replace("_", "-")
        for f in ("hosts", "step_seconds", "sample_steps")
        if getattr(args, f)
    ]
    if given:
        flags = " and ".join(given)
        verb = "applies" if len(given) == 1 else "apply"
        raise ValueError(
            f"{flags} {verb} to preview --requests only: add --requests, or drop {flags}"
        )


def _run_end(args: argparse.Namespace, doc: Mapping[str, Any]) -> int | None:
    """``--steps``, else the YAML's top-level ``steps``, else ``None``."""
    if args.steps is not None or doc.get("steps") is None:
        return args.steps
    try:
        return integer(doc["steps"], "steps", low=1)
    except ValueError as e:
        raise ValueError(f"{args.run_yaml}: {e}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flat-tokens", description=__doc__)
    parser.add_argument(
        "--version", action="version", version=f"flat-tokens-jax {library_version()}"
    )
    parser.add_argument(
        "--traceback",
        action="store_true",
        help="on an unexpected error, show Python's traceback (to report a bug) "
        "instead of a one-line message",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("validate", help="check every invariant of a dataset")
    _store_args(p)
    p.add_argument(
        "--quick",
        action="store_true",
        help="check the metadata and a sample of sequences (their bounds, start bits and "
        "first tokens) instead of reading everything, for stores too big to scan",
    )
    p.set_defaults(run=_cmd_validate)
    p = sub.add_parser("info", help="counts, length statistics and layout per split")
    _store_args(p)
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(run=_cmd_info)
    p = sub.add_parser(
        "show",
        help="print the batch of a step and where each row came from",
        description="The rows a run fed its model at --step, exactly as Loader.host_batch "
        "and Loader.provenance give them. The run comes from URL, --config or --state; "
        "flags set or override LoaderConfig fields.",
    )
    p.add_argument("url", nargs="?", help="the dataset (not needed with --config data or --state)")
    add_store_flags(p)
    p.add_argument(
        "--step",
        type=at_least(0),
        required=True,
        help="the training step to show, counted from 0 (in a run in phases, the run's step)",
    )
    p.add_argument("--config", help="YAML with a loader section and optionally a data section")
    p.add_argument("--state", help="a saved loader.state() as JSON")
    p.add_argument("--split", default="train", help="split of URL, or part of a data split cut")
    show.add_config_flags(p)
    p.add_argument(
        "--skip",
        action="append",
        metavar="STEP:COUNT",
        help="a skip to try: COUNT batches skipped at STEP, after the run's own (repeatable)",
    )
    p.add_argument("--rows", help="rows to print, e.g. 0,5-7 (default: all)")
    p.add_argument("--tokenizer", help="render rows as text with this tokenizer")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(run=_cmd_show)
    p = sub.add_parser(
        "preview",
        help="what each phase of a run reads: steps, samples, tokens, epochs",
        description="Per phase and component of a run YAML's phases section: steps, "
        "samples, tokens (rows x seq_len, padding included) and epochs consumed, by the "
        "loader's own arithmetic.",
    )
    p.add_argument("run_yaml", metavar="RUN", help="a run YAML with a phases section")
    add_store_flags(p)
    p.add_argument("--steps", type=at_least(1), help="where the run ends (default: its 'steps')")
    p.add_argument("--state", help="a saved state of the run: its weight changes and skips")
    p.add_argument("--split", default="train", help="the split (or part of a split cut) read")
    p.add_argument(
        "--picture",
        help="also draw each component's share of tokens over steps (.png or .svg), with "
        "phases, and the --state's weight changes and skips, marked",
    )
    p.add_argument(
        "--requests",
        action="store_true",
        help="print the requests/s and bytes/s the run asks of its store on --hosts hosts at "
        "--step-seconds a step, and how long a fresh GCS bucket would throttle them",
    )
    p.add_argument("--hosts", type=at_least(1), help="hosts of the pod (with --requests)")
    p.add_argument("--step-seconds", type=positive_seconds, help="seconds a step (with --requests)")
    p.add_argument(
        "--sample-steps",
        type=between(1, MAX_SAMPLE_STEPS),
        help="steps of each phase the sampler is run for, at most "
        f"{MAX_SAMPLE_STEPS:,} and no more than the phase has (with --requests; default "
        f"{_SAMPLE_STEPS})",
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(run=_cmd_preview)
    p = sub.add_parser(
        "pack",
        help="store the packing plan of whole sequences into rows of --seq-len",
        description="Builds the packing plan that LoaderConfig(packing='bins') uses and "
        "stores it in the dataset (group <split>/bins_<seq_len>), so loaders need not build "
        "it. Replaces a packing plan stored before for the same --seq-len.",
    )
    _store_args(p)
    p.add_argument("--seq-len", type=at_least(1), required=True, help="tokens per row")
    p.add_argument("--split", action="append", help="a split to pack (repeatable; default: all)")
    p.set_defaults(run=_cmd_pack)
    text.add_commands(sub)
    chat.add_commands(sub)
    merge.add_commands(sub)
    megatron.add_commands(sub)
    corpora.add_commands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    # Words after "--" are options of another program (Beam's, for convert --runner beam).
    cut = words.index("--") if "--" in words else len(words)
    parser = build_parser()
    args = parser.parse_args(words[:cut])
    args.pipeline_args = words[cut + 1 :]
    if args.pipeline_args and not getattr(args, "takes_pipeline_args", False):
        parser.error(f"{args.command} takes no options after '--'")
    refused = refuse_memory_output(args.command, getattr(args, "output", None))
    if refused is not None:
        return refused
    try:
        code: int = args.run(args)
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader of our output went away (`flat-tokens info --json | head`): stop
        # quietly, as Unix tools do. Python's recipe: point stdout at devnull so
        # the flush at exit does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except KeyboardInterrupt:
        print(f"{args.command}: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT
    except (ValueError, OSError, StoreError, FormatError, ImportError) as e:
        # Errors a user can meet and fix: their message says what and where.
        return fail(args.command, e)
    except Exception as e:
        if args.traceback:
            raise
        first = redact_text((str(e).splitlines() or [""])[0])
        print(
            f"{args.command}: unexpected {type(e).__name__}: {first} (a bug: run "
            f"'flat-tokens --traceback {args.command} ...' to see where, and report it)",
            file=sys.stderr,
        )
        return 70  # EX_SOFTWARE: an internal error
    return code


if __name__ == "__main__":
    sys.exit(main())
