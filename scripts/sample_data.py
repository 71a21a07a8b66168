"""The sample data that the examples of the README's guides (``docs/``) read.

Run from a checkout, it writes into FOLDER (default: the current one)::

    python scripts/sample_data.py [FOLDER]

- ``corpus.jsonl``: 40 text documents, ``{"text": ...}`` a line: the sections
  of this repository's own README and ``docs/`` pages, cut to 1,500 characters
  (text shipped with the code, so nothing is downloaded);
- ``tokenizer.json``: a byte-level BPE of 500 ids trained on those documents,
  with ``<|endoftext|>`` (its end of sequence) and the ChatML tokens
  ``<|im_start|>`` and ``<|im_end|>`` as added tokens;
- ``chats.jsonl``: one conversation, in the ShareGPT shape;
- the datasets ``data/corpus``, ``data/web``, ``data/books`` and ``data/code``
  (the ones ``configs/`` name too): ``train`` (280 sequences) and
  ``validation`` (20), random ids in ``[1, 500)``, so the tokenizer decodes
  them (each replaces one there before).

Offline and the same on every run. Needs the ``convert`` extra (tokenizers).
The tests run the docs' examples in a folder made by :func:`make`.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import flat_tokens_jax as ftj

ROOT = Path(__file__).resolve().parents[1]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT = {
    "system": "Be brief.",
    "conversations": [
        {"from": "human", "value": "What is up?"},
        {"from": "gpt", "value": "Hello!"},
    ],
}
DOCUMENTS, CHARS = 40, 1500
DATASETS = ("corpus", "web", "books", "code")


def documents() -> list[str]:
    """The sections (``## `` headings) of the README and the docs pages, in path order."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    sections = []
    for page in pages:
        text = page.read_text(encoding="utf-8")
        sections += [s.strip() for s in re.split(r"^## ", text, flags=re.M) if s.strip()]
    return sections


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


def make(folder: str | Path) -> Path:
    """Writes the sample data into ``folder`` (made if missing); returns it."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    texts = documents()
    train_tokenizer(texts).save(str(out / "tokenizer.json"))
    corpus = [t[:CHARS] for t in texts[:DOCUMENTS]]
    (out / "corpus.jsonl").write_text(
        "".join(json.dumps({"text": t}) + "\n" for t in corpus), encoding="utf-8"
    )
    (out / "chats.jsonl").write_text(json.dumps(CHAT) + "\n", encoding="utf-8")
    rng = np.random.default_rng(0)
    for name in DATASETS:
        docs = [rng.integers(1, 500, n) for n in rng.integers(20, 400, 300)]
        split = {"train": docs[:280], "validation": docs[280:]}
        ftj.write_dataset(out / "data" / name, split, overwrite=True)
    return out


def main() -> None:
    folder = make(sys.argv[1] if len(sys.argv) > 1 else ".")
    names = ["corpus.jsonl", "tokenizer.json", "chats.jsonl", *(f"data/{n}" for n in DATASETS)]
    print(f"wrote {', '.join(names[:-1])} and {names[-1]} in {folder}")


if __name__ == "__main__":
    main()
