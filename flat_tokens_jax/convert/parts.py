"""The conversion core: input files tokenized, in order, into a flat-tokens dataset.

:func:`write_documents` is run by the local converter over every input file into
the final dataset, and by Beam over one file into a *part*
(:mod:`~flat_tokens_jax.convert.assemble` joins them): the same tokens in the same order.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from flat_tokens_jax.convert.inputs import (
    DocumentReader,
    InputPath,
    Opener,
    Patterns,
    check_splits,
    expand_inputs,
    hash_inputs,
    open_local,
)
from flat_tokens_jax.convert.tokenizer import (
    BOS_CANDIDATES,
    EOS_CANDIDATES,
    Batch,
    BatchTokenizer,
    LoadedTokenizer,
    Packed,
    batch_encoder,
    identity,
    load_tokenizer,
    resolve_start_token_id,
    validation_mask,
)
from flat_tokens_jax.core.format import SPLITS, encode_concatenated
from flat_tokens_jax.data.writer import DatasetWriter
from flat_tokens_jax.store.identity import DatasetInfo, inputs_field
from flat_tokens_jax.store.location import refuse_overlap

# One pass over input files: (files, validation fraction, every document to validation).
Pass = tuple[Sequence[InputPath], float, bool]


# A tokenization batch ends at BATCH_DOCS documents or BATCH_CHARS characters
# (tokens, for pre-tokenized input): enough work for the tokenizer's threads,
# little memory per task. Batches never depend on `workers`, so neither does the output.
BATCH_DOCS = 1024
BATCH_CHARS = 1 << 20


def batches(docs: Iterable[str | np.ndarray], fraction: float) -> Iterator[Batch]:
    batch: list[Any] = []
    size = 0
    for doc in docs:
        batch.append(doc)
        size += len(doc)
        if len(batch) >= BATCH_DOCS or size >= BATCH_CHARS:
            yield batch, validation_mask(batch, fraction)
            batch, size = [], 0
    if batch:
        yield batch, validation_mask(batch, fraction)


@dataclasses.dataclass(frozen=True)
class ConvertOptions:
    """What :func:`convert` does besides where it reads and writes; see there."""

    tokenizer: str | None = None
    text_key: str = "text"
    tokens_key: str | None = None
    validation_fraction: float = 0.0
    workers: int = 1
    append_eos: bool = False
    prepend_bos: bool = False
    add_special_tokens: bool = False
    max_tokens: int | None = None
    skip_bad: bool = False
    start_token_id: int | str | None = None

    def __post_init__(self) -> None:
        if self.tokenizer is None and self.tokens_key is None:
            raise ValueError(
                "pass tokenizer= (a tokenizers JSON file or a transformers tokenizer "
                "directory), or tokens_key= to read token ids that are already there"
            )
        if self.tokenizer is None and (self.append_eos or self.prepend_bos):
            raise ValueError("append_eos and prepend_bos need tokenizer= to find the ids")
        if self.workers < 1:
            raise ValueError(f"workers must be at least 1, got {self.workers}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be positive or None, got {self.max_tokens}")

    def flags(self) -> dict[str, Any]:
        """What shapes the tokens, as a dataset records it (see :class:`DatasetInfo`)."""
        source = {"tokens_key": self.tokens_key} if self.tokens_key else {"text_key": self.text_key}
        return {
            "converter": "convert",
            **source,
            "append_eos": self.append_eos,
            "prepend_bos": self.prepend_bos,
            "add_special_tokens": self.add_special_tokens,
            "validation_fraction": self.validation_fraction,
            "max_tokens": self.max_tokens,
        }


@dataclasses.dataclass(frozen=True)
class Conversion:
    """A conversion checked before anything is written: options, the input files
    (``validation``: those whose documents all go to "validation"), the tokenizer
    (``None`` for token ids read as they are) and the start id (bos/eos resolved)."""

    opts: ConvertOptions
    train: Sequence[InputPath]
    validation: Sequence[InputPath]
    tokenizer: LoadedTokenizer | None
    tokenize: BatchTokenizer
    start_token_id: int | None = None

    @classmethod
    def start(
        cls,
        opts: ConvertOptions,
        inputs: Patterns,
        validation_inputs: Patterns,
        output: str | os.PathLike[str],
        match: Callable[[str], list[str]] | None = None,
    ) -> Conversion:
        """Expands and checks the inputs (:func:`expand_inputs`; ``output`` must not
        overlap them) and loads the tokenizer."""
        train, validation = expand_inputs(inputs, match), expand_inputs(validation_inputs, match)
        check_splits(train, validation, opts.validation_fraction)
        refuse_overlap([*train, *validation], [output])
        tok = load_tokenizer(opts.tokenizer) if opts.tokenizer else None
        bos = tok.bos_id if tok and opts.prepend_bos else None
        eos = tok.eos_id if tok and opts.append_eos else None
        for asked, found, what, names in (
            (opts.prepend_bos, bos, "prepend_bos: no beginning-of-sequence", BOS_CANDIDATES),
            (opts.append_eos, eos, "append_eos: no end-of-sequence", EOS_CANDIDATES),
        ):
            if asked and found is None:
                raise ValueError(
                    f"{what} token in {tok.name if tok else '?'} (looked for {', '.join(names)}); "
                    "use a transformers tokenizer directory whose config names it"
                )
        text_tokenizer = None if tok is None or opts.tokens_key else tok.tokenizer
        tokenize = BatchTokenizer(text_tokenizer, bos, eos, opts.add_special_tokens)
        start = resolve_start_token_id(opts.start_token_id, tok)
        return cls(opts, train, validation, tok, tokenize, start)

    def info(self, digests: Sequence[str] | None) -> DatasetInfo:
        """What the output records: the tokenizer, flags and the inputs with their
        ``digests`` (one per file, train then validation; ``None``: not hashed)."""
        validation = {"validation_files": len(self.validation)} if self.validation else {}
        return DatasetInfo(
            tokenizer=identity(self.tokenizer) if self.tokenizer else None,
            start_token_id=self.start_token_id,
            flags={**self.opts.flags(), **validation},
            inputs=inputs_field(self.input_names, digests),
        )

    @property
    def input_names(self) -> list[str]:
        """The input files as given (globs expanded), train then validation."""
        return [str(p) for p in [*self.train, *self.validation]]

    @property
    def passes(self) -> list[Pass]:
        """The training files, then the validation files, if any."""
        passes: list[Pass] = [(self.train, self.opts.validation_fraction, False)]
        if self.validation:
            passes.append((self.validation, 0.0, True))
        return passes

    def summary(
        self, output: str, totals: Totals, seconds: float, **settings: Any
    ) -> dict[str, Any]:
        """The JSON-ready summary of the finished conversion."""
        tokens = sum(totals.tokens.values())
        return {
            "output": output,
            "input_files": len(self.train),
            "validation_files": len(self.validation),
            "tokenizer": self.tokenizer.name if self.tokenizer else None,
            "documents": sum(totals.documents.values()),
            "tokens": tokens,
            "skipped_empty": totals.skipped_empty,
            "skipped_bad": totals.skipped_bad,
            "splits": {
                s: {"documents": n, "tokens": totals.tokens[s]} for s, n in totals.documents.items()
            },
            "stopped_early": totals.stopped_early,
            "max_tokens": self.opts.max_tokens,
            **settings,
            "seconds": round(seconds, 3),
            "tokens_per_s": round(tokens / seconds, 1),
        }


@dataclasses.dataclass
class Totals:
    """Running counts of one conversion (or one part), and the writing of each tokenized
    batch; ``trained``: per split, the tokens whose loss mask is 1."""

    max_tokens: int | None = None
    documents: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(SPLITS, 0))
    tokens: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(SPLITS, 0))
    trained: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(SPLITS, 0))
    skipped_empty: int = 0
    skipped_bad: int = 0
    stopped_early: bool = False
    # SHA-256 hex digests of the input files, in order; None until all are hashed.
    digests: list[str] | None = None

    def write(
        self,
        writer: DatasetWriter,
        packed: Packed,
        validation: np.ndarray,
        loss_mask: np.ndarray | None = None,
    ) -> int:
        """Writes one batch (with its ``[num_tokens] uint8`` loss mask, if any), cut at
        the token budget; returns the tokens written."""
        ids, lengths = packed
        if self.max_tokens is not None:
            room = self.max_tokens - sum(self.tokens.values())
            over = np.flatnonzero(np.cumsum(lengths) > room)
            if over.size:
                self.stopped_early = True
                lengths, validation = lengths[: over[0]], validation[: over[0]]
                ids = ids[: int(lengths.sum())]
                loss_mask = None if loss_mask is None else loss_mask[: ids.size]
        nonempty = lengths > 0
        self.skipped_empty += int(lengths.size - np.count_nonzero(nonempty))
        for split, chosen in (
            ("train", nonempty & ~validation),
            ("validation", nonempty & validation),
        ):
            if not chosen.any():
                continue
            sizes = lengths[chosen]
            keep = slice(None) if chosen.all() else np.repeat(chosen, lengths)
            part = ids[keep]
            mask = None if loss_mask is None else loss_mask[keep]
            encoded = encode_concatenated(part, np.cumsum(sizes) - sizes)
            writer.extend_encoded(split, encoded, sizes, loss_mask=mask)
            self.documents[split] += int(sizes.size)
            self.tokens[split] += int(part.size)
            self.trained[split] += 0 if mask is None else int(mask.sum())
        return int(ids.size)


def write_documents(
    writer: DatasetWriter,
    passes: Sequence[Pass],
    tokenize: BatchTokenizer,
    opts: ConvertOptions,
    totals: Totals,
    bar: Any = None,
    opener: Opener = open_local,
) -> None:
    """Reads, tokenizes and appends to ``writer`` each pass's documents, in order.

    Each pass is files, their validation fraction, and whether all their
    documents go to "validation". ``bar``: a tqdm bar of the tokens written.
    Sets ``totals.digests`` to the inputs' SHA-256 digests, computed on a
    thread beside the conversion (not with ``opts.max_tokens``, which may read
    only a prefix of the inputs).
    """
    files = [path for paths, _, _ in passes for path in paths]
    key = opts.tokens_key or opts.text_key
    with contextlib.ExitStack() as stack:
        if bar is not None:
            stack.callback(bar.close)
        digests = (
            None if opts.max_tokens is not None else stack.enter_context(hash_inputs(files, opener))
        )
        encode = stack.enter_context(batch_encoder(tokenize, opts.workers))
        for paths, fraction, all_validation in passes:
            reader = DocumentReader(
                paths,
                key,
                tokens=opts.tokens_key is not None,
                skip_bad=opts.skip_bad,
                opener=opener,
            )
            try:
                with contextlib.closing(encode(batches(reader, fraction))) as results:
                    for mask, packed in results:
                        written = totals.write(writer, packed, mask | all_validation)
                        if bar is not None:
                            bar.update(written)
                            bar.set_postfix(docs=sum(totals.documents.values()))
                        if totals.stopped_early:
                            return
            finally:
                totals.skipped_bad += reader.skipped_bad
                totals.skipped_empty += reader.skipped_empty
        if digests is not None:
            totals.digests = digests()
