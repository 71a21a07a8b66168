"""Measured: what the block shuffle costs a batch's mix of sources, beside a full shuffle.

Writes a store sorted by source: ``--sources`` sources of unequal sizes
(source ``k`` holds ``k + 1`` shares of ``--tokens`` tokens), each a
contiguous run of sequences whose tokens are drawn from a distribution of
its own over a shared vocabulary of ``VOCAB`` tokens, so a few tokens tell
the sources apart, not for certain. Then, for each order, over ``--steps``
steps of ``--batch`` windows of ``--seq-len`` tokens:

* **TV, a batch**: the mean total-variation distance between each batch's
  histogram of labels and the global one (the labels of every record);
* **TV, a run**: the same for the histogram of each run of ``--run``
  consecutive batches (the block shuffle's cost is correlation across steps);
* **held-out loss**: a multinomial logistic model predicting the source from
  a row's first ``FEATURES`` tokens, trained by SGD on the order's batches
  for those steps, its cross-entropy on fresh samples drawn in the global
  proportions (the mean, and its standard deviation over the seeds; the
  global proportions alone score their entropy, printed above the table).

A row's label is the source holding its first target token: from
``loader.provenance`` (record -> token range -> source), not from the
sampler. The orders: the full shuffle; ``shuffle="blocks"`` at the default
block (``shuffle_block=None``) and at other blocks and windows; and, as a
warning, a single-window shuffle, a reference order written here (not a
product feature): the epoch's blocks in a random order cut into windows of
``SINGLE_WINDOW`` blocks, each window's records shuffled, and batches taken
in turn, so each batch comes from one window of blocks, as a coarse "era"
shuffle's does. Each number is the mean over ``--seeds`` seeds.

Counts and losses, not times. Run: ``python -u scripts/shuffle_quality.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
from pathlib import Path

import numpy as np

import flat_tokens_jax as ftj

VOCAB = 64  # token ids 1..VOCAB, shared by every source
FEATURES = 4  # tokens of a row the model sees
SINGLE_WINDOW = 8  # default blocks in the single-window shuffle's window
# (shuffle_block, shuffle_window) of the block rows; None: the store's default block.
BLOCKS: tuple[tuple[int | None, int], ...] = ((None, 1), (None, 2), (32, 1), (32, 4), (8, 1))


@dataclasses.dataclass(frozen=True)
class SortedStore:
    """A split sorted by source.

    Attributes:
        ft: the split.
        tokens: ``[N] uint8`` its tokens, in memory (what the model reads).
        bounds: ``[S + 1] int64`` the first token of each source, then ``N``.
        dists: ``[S, VOCAB]`` each source's token distribution (ids 1..VOCAB).
    """

    ft: ftj.FlatTokens
    tokens: np.ndarray
    bounds: np.ndarray
    dists: np.ndarray


def write_sorted(path: Path, tokens: int, sources: int, seed: int = 0) -> SortedStore:
    """A store of about ``tokens`` tokens at ``path``: source ``k`` holds
    ``k + 1`` shares of them, in sequences of 100 to 4,000 tokens."""
    rng = np.random.default_rng(seed)
    dists = rng.dirichlet(np.full(VOCAB, 0.5), sources)
    shares = np.arange(1, sources + 1)
    sizes = tokens * shares // shares.sum()
    parts, seqs = [], []
    for k, size in enumerate(sizes.tolist()):
        flat = (rng.choice(VOCAB, size, p=dists[k]) + 1).astype(np.uint8)
        cuts = np.cumsum(rng.integers(100, 4000, size // 100 + 1))
        seqs += np.split(flat, cuts[cuts < size])
        parts.append(flat)
    ftj.write_dataset(path, {"train": seqs})
    bounds = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    return SortedStore(ftj.open_dataset(path)["train"], np.concatenate(parts), bounds, dists)


def labels(bounds: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """``[k] int64``: the source holding each token ``starts`` ``[k]``."""
    return np.searchsorted(bounds, starts, side="right").astype(np.int64) - 1


def tv(counts: np.ndarray, p: np.ndarray) -> np.ndarray:
    """Total-variation distance of each histogram (last axis of ``counts``,
    ``[..., S]``) normalised, to the distribution ``p`` ``[S]``: ``[...]``."""
    freq = counts / counts.sum(axis=-1, keepdims=True)
    return 0.5 * np.abs(freq - p).sum(axis=-1)


def histograms(rows: np.ndarray, sources: int) -> np.ndarray:
    """``[steps, S]`` label counts of each step's rows ``[steps, batch]``."""
    out = np.zeros((rows.shape[0], sources), np.int64)
    np.add.at(out, (np.repeat(np.arange(rows.shape[0]), rows.shape[1]), rows.ravel()), 1)
    return out


def tv_means(hist: np.ndarray, p: np.ndarray, run: int) -> tuple[float, float]:
    """Mean TV of each step's histogram ``hist`` ``[steps, S]`` and of each
    run of ``run`` consecutive steps (whole runs only)."""
    runs = hist[: hist.shape[0] // run * run].reshape(-1, run, hist.shape[1]).sum(axis=1)
    return float(tv(hist, p).mean()), float(tv(runs, p).mean())


def loader_starts(loader: ftj.Loader, steps: int) -> np.ndarray:
    """``[steps, batch]`` the first target token of each row, from ``provenance``."""
    return np.array([[row["tokens"][0] for row in loader.provenance(s)] for s in range(steps)])


def single_window(n: int, block: int, window: int, seed: int, count: int) -> np.ndarray:
    """The single-window reference order's first ``count`` records ``[count]``:
    blocks of ``block`` records in a random order, cut into windows of
    ``window`` blocks, each window's records shuffled, windows in turn."""
    rng = np.random.default_rng(seed)
    order = rng.permutation(-(-n // block))
    out: list[np.ndarray] = []
    taken = 0
    for w in range(0, order.size, window):
        records = np.concatenate(
            [np.arange(b * block, min((b + 1) * block, n)) for b in order[w : w + window]]
        )
        out.append(rng.permutation(records))
        taken += records.size
        if taken >= count:
            break
    return np.concatenate(out)[:count]


def features(tokens: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """``[k, VOCAB]`` counts of each of the ``FEATURES`` tokens from ``starts`` ``[k]``."""
    picked = tokens[starts[:, None] + np.arange(FEATURES)].astype(np.int64) - 1
    out = np.zeros((starts.size, VOCAB))
    np.add.at(out, (np.repeat(np.arange(starts.size), FEATURES), picked.ravel()), 1.0)
    return out


def cross_entropy(
    w: np.ndarray, b: np.ndarray, x: np.ndarray, y: np.ndarray
) -> tuple[float, np.ndarray]:
    """Mean cross-entropy of the model ``(w, b)`` on ``x`` ``[k, VOCAB]``, ``y``
    ``[k]``, and ``softmax - onehot`` ``[k, S]`` (its gradient in the logits, times ``k``)."""
    logits = x @ w + b
    logits -= logits.max(axis=1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    grad = np.exp(logp)
    grad[np.arange(y.size), y] -= 1
    return float(-logp[np.arange(y.size), y].mean()), grad


def train(store: SortedStore, starts: np.ndarray, lr: float) -> tuple[np.ndarray, np.ndarray]:
    """The model after SGD on each step's rows in turn (``starts`` ``[steps, batch]``)."""
    sources = store.dists.shape[0]
    w, b = np.zeros((VOCAB, sources)), np.zeros(sources)
    for step in starts:
        x, y = features(store.tokens, step), labels(store.bounds, step)
        _, grad = cross_entropy(w, b, x, y)
        w -= lr * x.T @ grad / y.size
        b -= lr * grad.mean(axis=0)
    return w, b


def held_out(
    store: SortedStore, p: np.ndarray, count: int, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """``count`` fresh samples in the proportions ``p``: ``(x, y)``."""
    rng = np.random.default_rng(seed)
    y = rng.choice(p.size, count, p=p)
    picked = np.stack([rng.choice(VOCAB, FEATURES, p=store.dists[k]) for k in y])
    x = np.zeros((count, VOCAB))
    np.add.at(x, (np.repeat(np.arange(count), FEATURES), picked.ravel()), 1.0)
    return x, y


def orders(
    store: SortedStore, batch: int, seq_len: int, steps: int, seed: int
) -> dict[str, np.ndarray]:
    """``name -> [steps, batch]`` the first target token of each row, per order."""

    def loader(**fields: object) -> ftj.Loader:
        cfg = ftj.LoaderConfig(batch_size=batch, seq_len=seq_len, seed=seed, prefetch=0, **fields)
        return ftj.Loader(store.ft, cfg)

    default = int(loader(shuffle="blocks").fingerprint()["config"]["shuffle_block"])
    out = {"full": loader_starts(loader(shuffle=True), steps)}
    for block, window in BLOCKS:
        made = loader(shuffle="blocks", shuffle_block=block, shuffle_window=window)
        shown = f"{default} (default)" if block is None else str(block)
        out[f"blocks B={shown} w={window}"] = loader_starts(made, steps)
    records = loader(shuffle=True).components[0]
    picked = single_window(len(records), default, SINGLE_WINDOW, seed, steps * batch)
    name = f"single window: {SINGLE_WINDOW} blocks of {default}"
    out[name] = records.token_ranges(picked)[0].reshape(steps, batch)
    return out


def global_p(store: SortedStore, seq_len: int) -> np.ndarray:
    """``[S]`` the share of each source's label among every record of the split."""
    records = ftj.Loader(store.ft, ftj.LoaderConfig(batch_size=1, seq_len=seq_len)).components[0]
    found = labels(store.bounds, records.token_ranges(np.arange(len(records)))[0])
    counts = np.bincount(found, minlength=store.dists.shape[0])
    return counts / counts.sum()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=1 << 27)
    parser.add_argument("--sources", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--run", type=int, default=16)
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--held-out", type=int, default=20_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        store = write_sorted(Path(tmp) / "sorted", args.tokens, args.sources)
        p = global_p(store, args.seq_len)
        x, y = held_out(store, p, args.held_out, seed=12345)
        results: dict[str, list[tuple[float, float, float]]] = {}
        for seed in range(args.seeds):
            for name, starts in orders(store, args.batch, args.seq_len, args.steps, seed).items():
                hist = histograms(labels(store.bounds, starts), args.sources)
                w, b = train(store, starts, args.lr)
                loss = cross_entropy(w, b, x, y)[0]
                results.setdefault(name, []).append((*tv_means(hist, p, args.run), loss))
    prior = float(-(p * np.log(p)).sum())
    print(
        f"{args.tokens:,} tokens sorted by source ({args.sources} sources, shares "
        f"{np.round(p, 3).tolist()}), batch {args.batch} x {args.seq_len}, {args.steps} "
        f"steps, runs of {args.run} steps, mean of {args.seeds} seeds; the prior alone "
        f"scores {prior:.3f}"
    )
    head = ("order", "TV, a batch", f"TV, {args.run} steps", "held-out loss (sd)")
    print(" | ".join(head))
    for name, rows in results.items():
        tv_step, tv_run, loss = np.mean(rows, axis=0)
        sd = np.std([r[2] for r in rows])
        print(f"{name} | {tv_step:.3f} | {tv_run:.3f} | {loss:.3f} ({sd:.3f})")


if __name__ == "__main__":
    main()
