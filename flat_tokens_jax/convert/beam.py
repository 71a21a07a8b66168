"""Conversion at corpus scale on Apache Beam (the ``beam`` extra), byte for byte the
local converter's output whatever the runner: each input file is tokenized into a
*part* in parallel, the parts are placed, every output shard is assembled whole by
one worker, then the dataset is finished (:mod:`~flat_tokens_jax.convert.assemble`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import IO, Any

import apache_beam as beam
import tensorstore as ts
from apache_beam.io.filesystem import CompressionTypes
from apache_beam.io.filesystems import FileSystems
from apache_beam.metrics.metric import Metrics, MetricsFilter
from apache_beam.options.pipeline_options import PipelineOptions, StandardOptions
from apache_beam.runners.runner import PipelineState

from flat_tokens_jax.convert.assemble import (
    PartInfo,
    Placement,
    Task,
    assemble_shard,
    create_arrays,
    finish,
    part_url,
    place_parts,
)
from flat_tokens_jax.convert.importer import TokenFile, blob_opener, import_files
from flat_tokens_jax.convert.inputs import InputPath, hash_inputs, require
from flat_tokens_jax.convert.parts import Conversion, ConvertOptions, Totals, write_documents
from flat_tokens_jax.convert.tokenizer import BatchTokenizer
from flat_tokens_jax.data.dataset import open_dataset
from flat_tokens_jax.data.writer import DatasetWriter, StorageFormat
from flat_tokens_jax.store.identity import DatasetInfo, inputs_field
from flat_tokens_jax.store.location import STAGING, Claim, claim_location, refuse_overlap
from flat_tokens_jax.store.options import StoreOptions, context_spec, resolve_options
from flat_tokens_jax.store.store import Store

log = logging.getLogger(__name__)

NAMESPACE = "flat_tokens"
TOKENIZER_KEY = f"{STAGING}/tokenizer.json"
# Parts are read once, in long slices: large chunks, no compression.
PART_STORAGE_FORMAT = StorageFormat(shard_tokens=1 << 22, chunk_tokens=1 << 16)
# Runners that run where the launcher runs, and so can read its local files.
LOCAL_RUNNERS = frozenset(r.lower() for r in StandardOptions.LOCAL_RUNNERS)
# Without --runner: FnApiRunner, one worker process per CPU (0). Flags given win.
DEFAULT_RUNNER = [
    "--runner=FnApiRunner",
    "--direct_running_mode=multi_processing",
    "--direct_num_workers=0",
]
# Opened parts kept per worker while it assembles shards: neighbouring shards
# read the same parts. Their reads share one cache of this size.
_OPEN_PARTS = 16
_PART_CACHE_BYTES = 64 << 20


@dataclasses.dataclass(frozen=True)
class _Job:
    """What every stage needs; pickled into the pipeline."""

    output: str
    storage_format: StorageFormat
    options: StoreOptions
    info: DatasetInfo
    input_names: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class _Conversion:
    """What the tokenizing stage of a conversion needs besides the :class:`_Job`."""

    convert: ConvertOptions
    tokenize: BatchTokenizer  # its tokenizer (if any) is read from TOKENIZER_KEY
    text_tokenizer: bool
    opener: UrlOpener


@dataclasses.dataclass(frozen=True)
class UrlOpener:
    """Opens files that Beam's file systems reach (``gs://``, ``s3://``), set up
    with the pipeline's options (``--s3_endpoint_url`` and the like).

    The options travel with the opener because not every runner hands them to
    the workers it starts (the FnApiRunner, named directly, does not).
    """

    pipeline_args: tuple[str, ...] = ()

    def filesystem(self, url: str) -> Any:
        """The Beam ``FileSystem`` of ``url``'s scheme, with these options."""
        kind = type(FileSystems.get_filesystem(url))
        return kind(pipeline_options=PipelineOptions(list(self.pipeline_args)))

    def __call__(self, url: str) -> IO[bytes]:
        """The raw (still compressed) bytes of ``url``."""
        file: IO[bytes] = self.filesystem(url).open(
            url, compression_type=CompressionTypes.UNCOMPRESSED
        )
        return file

    def match(self, pattern: str) -> list[str]:
        """The files ``pattern`` matches, sorted."""
        return sorted(m.path for m in self.filesystem(pattern).match([pattern])[0].metadata_list)


class _Tokenize(beam.DoFn):
    """(index, input file, all to validation) -> the :class:`PartInfo` of its part."""

    def __init__(self, job: _Job, conversion: _Conversion) -> None:
        self.job, self.conversion = job, conversion
        self.tokenize: BatchTokenizer | None = None
        self.tokens = Metrics.counter(NAMESPACE, "tokens_tokenized")

    def setup(self) -> None:
        job = self.job
        tokenizer = None
        if self.conversion.text_tokenizer:
            store = Store(job.output, job.options)
            got = store.wait(store.kv.read(TOKENIZER_KEY))
            if got.state != "value":
                raise FileNotFoundError(f"{job.output}/{TOKENIZER_KEY}: the tokenizer is missing")
            tokenizers = require("tokenizers", "convert")
            tokenizer = tokenizers.Tokenizer.from_str(bytes(got.value).decode("utf-8"))
        self.tokenize = dataclasses.replace(self.conversion.tokenize, tokenizer=tokenizer)

    def process(self, element: tuple[int, InputPath, bool]) -> Iterator[PartInfo]:
        index, path, all_validation = element
        job, conversion = self.job, self.conversion
        if self.tokenize is None:
            raise RuntimeError("_Tokenize.process ran before setup")
        # A fresh name per attempt: a retried or duplicated attempt never meets
        # another's files; the info names the part that finished.
        url = part_url(job.output, index, uuid.uuid4().hex[:12])
        fraction = 0.0 if all_validation else conversion.convert.validation_fraction
        totals = Totals()
        started = time.perf_counter()
        with DatasetWriter(url, storage_format=PART_STORAGE_FORMAT, options=job.options) as writer:
            write_documents(
                writer,
                [([path], fraction, all_validation)],
                self.tokenize,
                conversion.convert,
                totals,
                opener=conversion.opener,
            )
        tokens = sum(totals.tokens.values())
        self.tokens.inc(tokens)
        log.info(
            "input %d (%s): %d documents, %d tokens in %.1fs",
            index,
            path,
            sum(totals.documents.values()),
            tokens,
            time.perf_counter() - started,
        )
        yield PartInfo.read(
            index,
            url,
            job.options,
            skipped_empty=totals.skipped_empty,
            skipped_bad=totals.skipped_bad,
            digests=None if totals.digests is None else tuple(totals.digests),
        )


class _Import(beam.DoFn):
    """(index, a :class:`TokenFile`'s opener, its files to hash) -> its part's :class:`PartInfo`."""

    def __init__(self, job: _Job, split: str, chunk_tokens: int) -> None:
        self.job, self.split, self.chunk_tokens = job, split, chunk_tokens
        self.tokens = Metrics.counter(NAMESPACE, "tokens_imported")

    def process(
        self, element: tuple[int, Callable[[], TokenFile], Sequence[str]]
    ) -> Iterator[PartInfo]:
        index, open_file, hashed = element
        job = self.job
        url = part_url(job.output, index, uuid.uuid4().hex[:12])  # as in _Tokenize
        with hash_inputs(hashed, blob_opener(job.options)) as digests:
            summary = import_files(
                [open_file],
                url,
                hashed=[],
                info=DatasetInfo(),
                names=[],
                split=self.split,
                storage_format=PART_STORAGE_FORMAT,
                options=job.options,
                chunk_tokens=self.chunk_tokens,
            )
            found = tuple(digests())
        self.tokens.inc(summary["tokens"])
        skipped = summary["skipped_empty"]
        yield PartInfo.read(index, url, job.options, skipped_empty=skipped, digests=found)


def _place(parts: list[PartInfo], job: _Job) -> Placement:
    placement = place_parts(job.output, job.storage_format, parts)
    create_arrays(placement, Store(job.output, job.options))
    return placement


class _Assemble(beam.DoFn):
    """A :class:`Task` -> the number of elements it wrote."""

    def __init__(self, job: _Job) -> None:
        self.job = job
        self.shards = Metrics.counter(NAMESPACE, "shards_written")

    def setup(self) -> None:
        job = self.job
        self.store = Store(job.output, job.options)
        small = dataclasses.replace(job.options, cache_bytes=_PART_CACHE_BYTES)
        shared = dataclasses.replace(job.options, context=ts.Context(context_spec(small)))
        self.open_part = functools.lru_cache(maxsize=_OPEN_PARTS)(
            functools.partial(open_dataset, options=shared)
        )

    def process(self, task: Task, placement: Placement) -> Iterator[int]:
        yield assemble_shard(placement, task, self.store, self.open_part)
        self.shards.inc()


def _finish(shards: int, job: _Job, placement: Placement) -> None:
    expected = len(placement.tasks())
    if shards != expected:
        raise RuntimeError(f"{job.output}: {shards} shards were written, expected {expected}")
    found = [p.digests for p in placement.parts]
    hashed = None if None in found else [d for digests in found for d in digests or ()]
    info = dataclasses.replace(job.info, inputs=inputs_field(job.input_names, hashed))
    finish(placement, Store(job.output, job.options), info=info)
    for name in ("skipped_empty", "skipped_bad"):
        Metrics.counter(NAMESPACE, name).inc(sum(getattr(p, name) for p in placement.parts))


def build_pipeline(
    pipeline: beam.Pipeline, job: _Job, inputs: Sequence[Any], make_part: beam.DoFn
) -> None:
    """Adds the four stages to ``pipeline``: each of ``inputs`` made a part by
    ``make_part`` (which yields its :class:`PartInfo`), then placed, assembled, finished."""
    parts = (
        pipeline
        | "Inputs" >> beam.Create(list(inputs))
        | "Spread inputs" >> beam.Reshuffle()
        | "Make parts" >> beam.ParDo(make_part)
    )
    placement = parts | "Gather parts" >> beam.combiners.ToList() | "Place" >> beam.Map(_place, job)
    placement_view = beam.pvalue.AsSingleton(placement)
    written = (
        placement
        | "Tasks" >> beam.FlatMap(Placement.tasks)
        | "Spread shards" >> beam.Reshuffle()
        | "Assemble" >> beam.ParDo(_Assemble(job), placement_view)
    )
    _ = (
        written
        | "Count shards" >> beam.combiners.Count.Globally()
        | "Finish" >> beam.Map(_finish, job, placement_view)
    )


def pipeline_options(args: Sequence[str]) -> PipelineOptions:
    """Beam options from command-line flags; with no ``--runner``, Beam's local
    FnApiRunner in worker processes, one per CPU unless ``--direct_num_workers``."""
    options = PipelineOptions(list(args))
    if options.view_as(StandardOptions).runner is None:
        options = PipelineOptions([*DEFAULT_RUNNER, *args])
    return options


def _counters(result: Any) -> dict[str, int]:
    """This job's counters, as committed (attempted where a runner has no committed)."""
    found = result.metrics().query(MetricsFilter().with_namespace(NAMESPACE))["counters"]
    out: dict[str, int] = {}
    for m in found:
        value = m.committed if m.committed is not None else m.attempted
        out[m.key.metric.name] = out.get(m.key.metric.name, 0) + int(value or 0)
    return out


def _run(pipeline: beam.Pipeline, claim: Claim) -> Any:
    """Runs ``pipeline`` to the end; on any failure or interrupt, cancels it and
    deletes everything it wrote (nothing at the claimed output is left)."""
    result = None
    try:
        result = pipeline.run()
        result.wait_until_finish()
        if result.state != PipelineState.DONE:
            raise RuntimeError(f"the Beam pipeline ended in state {result.state}")
        return result
    except BaseException:
        if result is not None and not PipelineState.is_terminal(result.state):
            try:
                result.cancel()
            except Exception as e:
                log.error(
                    "could not cancel the Beam job (%s): it may still write to %s, which is "
                    "left as it is; cancel the job, then convert again with --overwrite",
                    e,
                    claim.store.url,
                )
                raise
        claim.discard()
        raise


def _runner(out: str, pipeline_args: Sequence[str]) -> tuple[PipelineOptions, str]:
    """Beam's options from ``pipeline_args`` and the runner's name; refuses an
    output in ``memory://``, which Beam's worker processes cannot see."""
    if out.startswith("memory://"):
        raise ValueError(
            f"{out}: Beam workers are other processes, which cannot see this one's "
            "memory:// stores; write to a path, gs:// or s3://"
        )
    beam_options = pipeline_options(pipeline_args)
    runner = beam_options.view_as(StandardOptions).runner
    return beam_options, runner if isinstance(runner, str) else type(runner).__name__


def _reachable(runner: str, inputs: Sequence[str], out: str) -> None:
    """Refuses local inputs or output for a runner whose workers run elsewhere."""
    local = [p for p in inputs if "://" not in p]
    if runner.lower() not in LOCAL_RUNNERS and (local or "://" not in out):
        raise ValueError(
            f"{runner} runs workers on other machines, which cannot reach "
            f"{local[0] if local else out}: give inputs and output as gs:// or s3:// URLs"
        )


def convert_beam(
    inputs: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    output: str | os.PathLike[str],
    *,
    tokenizer: str | os.PathLike[str] | None = None,
    text_key: str = "text",
    tokens_key: str | None = None,
    validation_fraction: float = 0.0,
    validation_inputs: str | os.PathLike[str] | Sequence[str | os.PathLike[str]] = (),
    append_eos: bool = False,
    prepend_bos: bool = False,
    add_special_tokens: bool = False,
    skip_bad: bool = False,
    storage_format: StorageFormat | None = None,
    overwrite: bool = False,
    options: StoreOptions | None = None,
    pipeline_args: Sequence[str] = (),
    start_token_id: int | str | None = None,
    **option_fields: Any,
) -> dict[str, Any]:
    """:func:`~flat_tokens_jax.convert.text.convert`, run on Apache Beam.

    The output is byte for byte what ``convert`` writes from the same inputs
    and arguments. It becomes valid only when the pipeline's last step ends;
    if the pipeline fails or is interrupted, the job is cancelled and the
    output location emptied, so a new run starts clean.

    Args:
        inputs: files or globs: local paths, or ``gs://`` / ``s3://`` URLs that
            Beam's file systems reach (``apache-beam[gcp]`` / ``[aws]``). Each
            input file is one unit of parallel work.
        output: the new dataset: a path, or a ``gs://`` / ``s3://`` URL that
            every worker can write (not ``memory://``).
        tokenizer: a ``tokenizers`` JSON file or ``transformers`` tokenizer
            directory on this machine; it reaches the workers through the
            output's staging prefix.
        pipeline_args: Beam pipeline options (``--runner=DataflowRunner``,
            ``--project``, ...). Without ``--runner``: Beam's FnApiRunner on
            this machine, one worker process per CPU (``--direct_num_workers``).

    Other arguments are ``convert``'s. ``max_tokens`` and ``workers`` have no
    equivalent here.

    Returns:
        ``convert``'s summary, with ``runner``.

    Raises:
        ValueError: bad arguments, an output overlapping an input, or local
            files for a runner whose workers run elsewhere.
        InputError, FileNotFoundError: bad inputs found before the pipeline runs.
        FileExistsError: ``output`` exists and ``overwrite`` is off, or holds
            files that are not a flat-tokens dataset.
        Exception: whatever the runner raises when the pipeline fails (a bad
            document, named by file and line, among its messages).
    """
    options = resolve_options(options, option_fields, "convert_beam")
    opts = ConvertOptions(
        tokenizer=None if tokenizer is None else os.fspath(tokenizer),
        text_key=text_key,
        tokens_key=tokens_key,
        validation_fraction=validation_fraction,
        append_eos=append_eos,
        prepend_bos=prepend_bos,
        add_special_tokens=add_special_tokens,
        skip_bad=skip_bad,
        start_token_id=start_token_id,
    )
    started = time.perf_counter()
    out = os.fspath(output)
    beam_options, runner = _runner(out, pipeline_args)
    opener = UrlOpener(tuple(pipeline_args))
    conv = Conversion.start(opts, inputs, validation_inputs, out, opener.match)
    _reachable(runner, [str(p) for p in [*conv.train, *conv.validation]], out)
    tokenize = conv.tokenize
    store = Store(out, options)
    job = _Job(
        out,
        storage_format or StorageFormat(),
        store.options,
        conv.info(None),
        tuple(conv.input_names),
    )
    tokenizing = _Conversion(
        opts, dataclasses.replace(tokenize, tokenizer=None), tokenize.tokenizer is not None, opener
    )
    files = [(path, everything) for paths, _, everything in conv.passes for path in paths]
    pipeline = beam.Pipeline(options=beam_options)
    elements = [(i, p, v) for i, (p, v) in enumerate(files)]
    build_pipeline(pipeline, job, elements, _Tokenize(job, tokenizing))
    claim = claim_location(store, overwrite)
    if tokenize.tokenizer is not None:
        text = tokenize.tokenizer.to_str().encode("utf-8")
        try:
            store.wait(store.kv.write(TOKENIZER_KEY, text))
        except BaseException:
            claim.discard()
            raise
    counters = _counters(_run(pipeline, claim))
    written = open_dataset(out, options)
    totals = Totals(
        documents={n: ft.num_sequences for n, ft in written.items()},
        tokens={n: ft.num_tokens for n, ft in written.items()},
        skipped_empty=counters.get("skipped_empty", 0),
        skipped_bad=counters.get("skipped_bad", 0),
    )
    return conv.summary(out, totals, time.perf_counter() - started, runner=runner)


def import_beam(
    files: Sequence[Callable[[], TokenFile]],
    hashed: Sequence[Sequence[str]],
    output: str | os.PathLike[str],
    *,
    info: DatasetInfo,
    names: Sequence[str],
    split: str,
    storage_format: StorageFormat | None,
    overwrite: bool,
    options: StoreOptions,
    chunk_tokens: int,
    pipeline_args: Sequence[str] = (),
) -> dict[str, Any]:
    """:func:`import_files` on Apache Beam, into the same bytes: each of ``files`` (its own
    files to hash in ``hashed``) a part made in parallel; the summary has ``runner``."""
    started = time.perf_counter()
    out = os.fspath(output)
    beam_options, runner = _runner(out, pipeline_args)
    _reachable(runner, list(names), out)
    refuse_overlap([f for own in hashed for f in own], [out])
    store = Store(out, options)
    job = _Job(out, storage_format or StorageFormat(), store.options, info, tuple(names))
    pipeline = beam.Pipeline(options=beam_options)
    elements = [(i, f, list(h)) for i, (f, h) in enumerate(zip(files, hashed, strict=True))]
    build_pipeline(pipeline, job, elements, _Import(job, split, chunk_tokens))
    counters = _counters(_run(pipeline, claim_location(store, overwrite)))
    ft = open_dataset(out, options)[split]
    return {
        "output": out,
        "split": split,
        "inputs": len(files),
        "sequences_written": ft.num_sequences,
        "tokens": ft.num_tokens,
        "skipped_empty": counters.get("skipped_empty", 0),
        "runner": runner,
        "seconds": round(time.perf_counter() - started, 3),
    }
