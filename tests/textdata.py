"""Test inputs for the converters: corpus text, a small trained tokenizer, input files."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

CORPUS = Path(__file__).resolve().parents[2] / "shared" / "data" / "corpus.jsonl"
EOS = "<|endoftext|>"
SPECIALS = [EOS, "<|im_start|>", "<|im_end|>", "<s>", "</s>"]
"""The added tokens of the ``tok_file`` fixture: GPT-2's end of sequence,
ChatML's turn markers, and Llama's beginning and end of sequence."""


def corpus_texts(n: int, chars: int) -> list[str]:
    """The first ``n`` documents of the shared corpus cut to ``chars``, or made-up text."""
    if not CORPUS.is_file():
        words = ["the", "of", "and", "a", "to", "in", "he", "was", "that", "it", "his", "her"]
        rng = np.random.default_rng(0)
        return [" ".join(rng.choice(words, chars // 4)) + f" ({i}) “é”\n" for i in range(n)]
    texts = []
    with CORPUS.open("rb") as f:
        for line in f:
            texts.append(json.loads(line)["text"][:chars])
            if len(texts) == n:
                break
    return texts


def train_tokenizer(special: list[str]) -> Tokenizer:
    """A byte-level BPE tokenizer of 500 ids, trained on :func:`corpus_texts`."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_texts(300, 2000), trainer)
    return tok


def write_jsonl(path: Path, records: list[Any]) -> Path:
    """Writes ``records`` (objects, or lines as they are) to ``path``, one per line."""
    lines = [r if isinstance(r, str) else json.dumps(r) for r in records]
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def files(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` and its bytes."""
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def write_format(kind: str, path: Path, records: list[dict[str, Any]]) -> Path:
    """Writes ``records`` as ``kind`` (gz, zst, parquet, hf) beside ``path``; returns the file."""
    lines = "".join(json.dumps(r) + "\n" for r in records).encode()
    if kind == "gz":
        path = path.with_suffix(".jsonl.gz")
        path.write_bytes(gzip.compress(lines))
    elif kind == "zst":
        import zstandard

        path = path.with_suffix(".jsonl.zst")
        path.write_bytes(zstandard.ZstdCompressor().compress(lines))
    elif kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = path.with_suffix(".parquet")
        pq.write_table(pa.Table.from_pylist(records), path, row_group_size=7)
    else:
        import datasets

        datasets.Dataset.from_list(records).save_to_disk(str(path), max_shard_size="20KB")
    return path
