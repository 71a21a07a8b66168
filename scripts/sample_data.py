"""The sample data that the examples of the README's guides (``docs/``) read.

Run from a checkout, it writes into FOLDER (default: the current one)::

    python scripts/sample_data.py [FOLDER]

The text is what ships with Python itself, so nothing is downloaded: the
documentation topics of ``pydoc_data.topics`` (what ``help("assert")`` prints),
in the order of their names, and the source of the standard library modules in
:data:`MODULES`.

- ``tokenizer.json``: a byte-level BPE of 500 ids trained on that text, with
  ``<|endoftext|>`` (id 0, its end of sequence) and the ChatML tokens
  ``<|im_start|>`` and ``<|im_end|>`` as added tokens;
- ``corpus.jsonl``: 40 text documents, ``{"text": ...}`` a line: the first 40
  topics, cut to 1,500 characters;
- ``chats.jsonl``: one conversation, in the ShareGPT shape;
- the datasets ``data/corpus``, ``data/web``, ``data/books`` (the topics,
  in turn) and ``data/code`` (the modules' source), the ones
  ``configs/`` name too: ``train`` (280 sequences) and ``validation`` (20) of
  20 to 399 tokens (about 59,000 and 4,000 tokens a dataset), cut in turn from
  the tokenized text with lengths drawn from ``numpy.random.default_rng(0)``,
  so a sequence may start or end mid-sentence, as chunks of a longer text do.
  Each records the tokenizer as ``convert`` does (``tokenizer.json``), so
  ``flat-tokens show data/web --tokenizer tokenizer.json`` prints the text.

Offline, in about a second, and byte for byte the same on every run with the
same Python version (its topics and sources are the text), ``tokenizers``
version (the ``convert`` extra; it trains the BPE) and flat_tokens_jax version
(recorded in each dataset). The tests run the docs' examples in a folder made
by :func:`make`.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import pydoc_data.topics
import sys
from importlib import import_module
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import flat_tokens_jax as ftj
from flat_tokens_jax.convert.tokenizer import identity, load_tokenizer

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT = {
    "system": "Be brief.",
    "conversations": [
        {"from": "human", "value": "What is up?"},
        {"from": "gpt", "value": "Hello!"},
    ],
}
DOCUMENTS, CHARS = 40, 1500
TEXT_DATASETS = ("corpus", "web", "books")  # cut from the topics, in turn
DATASETS = (*TEXT_DATASETS, "code")
SEQUENCES, VALIDATION = 300, 20  # a dataset's sequences; the last VALIDATION are validation's
MODULES = ("textwrap", "heapq", "bisect", "fractions", "shlex", "string", "statistics", "difflib")


def topics() -> list[str]:
    """The ``pydoc_data`` documentation topics, in the order of their names."""
    found: dict[str, str] = pydoc_data.topics.topics
    return [found[name] for name in sorted(found)]


def sources() -> list[str]:
    """The source of each module in :data:`MODULES`, in that order."""
    return [inspect.getsource(import_module(name)) for name in MODULES]


def train_tokenizer(texts: list[str]) -> Tokenizer:
    """A byte-level BPE of 500 ids, with :data:`SPECIALS` as added tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return tok


def chunks(tok: Tokenizer, texts: list[str], lengths: np.ndarray) -> list[np.ndarray]:
    """``texts`` tokenized one after another, cut in turn into sequences of
    ``lengths`` tokens ``[len(lengths)]`` (refused if the text is too short)."""
    ids = np.concatenate([e.ids for e in tok.encode_batch(texts)]).astype(np.int32)
    if ids.size < lengths.sum():
        raise ValueError(f"the text has {ids.size} tokens; the sequences need {lengths.sum()}")
    return np.split(ids, np.cumsum(lengths))[: len(lengths)]


def make(folder: str | Path) -> Path:
    """Writes the sample data into ``folder`` (made if missing); returns it."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    text, code = topics(), sources()
    train_tokenizer(text + code).save(str(out / "tokenizer.json"))
    tok = load_tokenizer(out / "tokenizer.json")
    info = ftj.DatasetInfo(tokenizer=dataclasses.replace(identity(tok), name="tokenizer.json"))
    corpus = [t[:CHARS] for t in text[:DOCUMENTS]]
    (out / "corpus.jsonl").write_text(
        "".join(json.dumps({"text": t}) + "\n" for t in corpus), encoding="utf-8"
    )
    (out / "chats.jsonl").write_text(json.dumps(CHAT) + "\n", encoding="utf-8")
    rng = np.random.default_rng(0)
    lengths = rng.integers(20, 400, (len(DATASETS), SEQUENCES))
    texts = len(TEXT_DATASETS)
    seqs = chunks(tok.tokenizer, text, lengths[:texts].ravel()) + chunks(
        tok.tokenizer, code, lengths[texts:].ravel()
    )
    for i, name in enumerate(DATASETS):
        mine = seqs[i * SEQUENCES : (i + 1) * SEQUENCES]
        split = {"train": mine[:-VALIDATION], "validation": mine[-VALIDATION:]}
        ftj.write_dataset(out / "data" / name, split, overwrite=True, info=info)
    return out


def main() -> None:
    folder = make(sys.argv[1] if len(sys.argv) > 1 else ".")
    names = ["corpus.jsonl", "tokenizer.json", "chats.jsonl", *(f"data/{n}" for n in DATASETS)]
    print(f"wrote {', '.join(names[:-1])} and {names[-1]} in {folder}")


if __name__ == "__main__":
    main()
