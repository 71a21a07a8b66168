"""Quickstart: write a small flat-tokens dataset, check it, and read it back.

Runs offline on local storage. Token ids here are UTF-8 bytes, so no tokenizer
is needed; real data comes from ``flat-tokens convert`` or ``DatasetWriter``.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import flat_tokens_jax as ftj
from flat_tokens_jax.tools.show import row_text, where

TEXTS = [
    "It was the best of times, it was the worst of times.",
    "Call me Ishmael.",
    "All happy families are alike; each unhappy family is unhappy in its own way.",
    "Happy families are all alike.",
]


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp()) / "quickstart"
    sequences = [list(t.encode()) for t in TEXTS]
    ftj.write_dataset(
        out, {"train": sequences[:3] * 100, "validation": sequences[3:]}, overwrite=True
    )
    ftj.validate(out)
    ds = ftj.open_dataset(out)
    train = ds["train"]
    print(f"wrote {out}")
    print(
        f"train: {train.num_sequences} sequences, {train.num_tokens} tokens, "
        f"max_token_id {train.max_token_id}"
    )
    first, second = train.sequences([0, 1])
    print("sequence 0:", bytes(first.astype("uint8")).decode())
    print("sequence 1:", bytes(second.astype("uint8")).decode())
    print("tokens [0, 12):", train.tokens(0, 12).tolist())

    loader = ftj.Loader(train, ftj.LoaderConfig(batch_size=4, seq_len=32, seed=0))
    for step, batch in loader.iterate(0):
        shapes = {k: (tuple(v.shape), str(v.dtype)) for k, v in batch.items()}
        row = batch["targets"][0].tolist()
        print(f"step {step}: {shapes}")
        print(f"  row 0 targets as text: {bytes(row).decode(errors='replace')!r}")
        print(f"  row 0 came from: {loader.provenance(step)[0]}")
        if step == 1:
            break

    # What `flat-tokens show OUT --step 1 --batch-size 4 --seq-len 32 --rows 0 --tokenizer T`
    # prints; here the "tokenizer" is UTF-8: one line per segment, padding counted, not shown.
    row = {k: v[0] for k, v in loader.host_batch(1).items()}
    print(f"step 1, {where(loader.provenance(1)[0])}, as text:")
    print(row_text(row, lambda ids: bytes(ids).decode(errors="replace")))


if __name__ == "__main__":
    main()
