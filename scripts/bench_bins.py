"""Benchmark: bins of whole sequences (``packing="bins"``) against padded rows and FFD.

Measures, side by side in one run:

* packing efficiency (non-padding tokens / all tokens) of padded rows (one
  sequence per row), our bins (:data:`flat_tokens_jax.data.binpack.ALGORITHM`), and
  a reference first-fit-decreasing over the whole split (exact FFD with a
  segment tree over the bins' free space), on (a) chat conversations made
  with ``convert-chat`` from the paragraphs of ``../shared/data/corpus.jsonl``
  and (b) synthetic log-normal lengths (median 300, sigma 1) at L = 2048 and
  8192;
* plan build time and peak memory (peak RSS above the RSS holding the lengths,
  in a fresh process; Linux) for 10M sequences;
* step cost at step 10**9 against step 1 (``Loader.host_batch``, fresh loader);
* loader throughput in real (non-padding) tokens per second, bins against
  padded rows, over the same steps of the chat dataset.

Run: ``python scripts/bench_bins.py [--sequences 1_000_000] [--plan-sequences 10_000_000]``
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import flat_tokens_jax as ftj
from flat_tokens_jax.convert.chat import ChatTemplate, convert_chat
from flat_tokens_jax.data.binpack import ALGORITHM, build_plan

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
PHI3 = {
    "eos": "<|endoftext|>",
    "end_of_turn": "<|end|>",
    "special_tokens": ["<|user|>", "<|assistant|>", "<|end|>", "<|endoftext|>"],
    "roles": {
        "user": {"prefix": "<|user|>\n", "suffix": "<|end|>\n"},
        "assistant": {"prefix": "<|assistant|>\n", "suffix": "<|end|>\n"},
    },
}


def ffd_bins(lengths: np.ndarray, seq_len: int) -> int:
    """Bins of an exact first-fit decreasing over all ``lengths`` (truncated to ``seq_len``).

    Leaves of a segment tree hold each bin's free space (unopened bins: all of
    it), inner nodes the maximum below: first fit is the leftmost leaf with
    room. Equal sizes go into one bin while they fit (what FFD does too).
    """
    sizes = np.sort(np.minimum(lengths, seq_len))[::-1]
    leaves = 1 << max(int(sizes.size - 1).bit_length(), 0)
    tree = [seq_len] * (2 * leaves)
    used = 0
    edges = np.flatnonzero(np.diff(sizes)) + 1
    for lo, hi in zip([0, *edges.tolist()], [*edges.tolist(), sizes.size], strict=True):
        size, left = int(sizes[lo]), hi - lo
        while left:
            node = 1
            while node < leaves:
                node = 2 * node if tree[2 * node] >= size else 2 * node + 1
            take = min(left, tree[node] // size)
            left -= take
            used = max(used, node - leaves + 1)
            tree[node] -= take * size
            node //= 2
            while node:
                tree[node] = max(tree[2 * node], tree[2 * node + 1])
                node //= 2
    return used


def efficiencies(lengths: np.ndarray, seq_len: int) -> dict[str, float]:
    kept = float(np.minimum(lengths, seq_len).sum())
    began = time.perf_counter()
    starts, _ = build_plan(lengths, seq_len)
    ours_s = time.perf_counter() - began
    began = time.perf_counter()
    ffd = ffd_bins(lengths, seq_len)
    ffd_s = time.perf_counter() - began
    return {
        "sequences": int(lengths.size),
        "seq_len": seq_len,
        "padded": kept / (lengths.size * seq_len),
        "bins": kept / ((starts.size - 1) * seq_len),
        "ffd": kept / (ffd * seq_len),
        "bins_s": ours_s,
        "ffd_s": ffd_s,
    }


def chat_dataset(out: Path) -> Path:
    """Conversations of 1-4 (user, assistant) turns over consecutive corpus paragraphs."""
    paragraphs = [
        p.strip()
        for line in (DATA / "corpus.jsonl").read_text(encoding="utf-8").splitlines()
        for p in json.loads(line)["text"].split("\n\n")
        if p.strip()
    ]
    convs, i, k = [], 0, 0
    while i + 2 <= len(paragraphs):
        turns = min(1 + k % 4, (len(paragraphs) - i) // 2)
        messages = [
            {"role": "user" if j % 2 == 0 else "assistant", "content": paragraphs[i + j]}
            for j in range(2 * turns)
        ]
        convs.append({"messages": messages})
        i, k = i + 2 * turns, k + 1
    src = out / "chat.jsonl"
    src.write_text("\n".join(json.dumps(c) for c in convs) + "\n", encoding="utf-8")
    convert_chat(
        src,
        out / "chat",
        tokenizer=DATA / "tokenizer-phi3-mini.json",
        template=ChatTemplate.from_dict(PHI3),
        progress=False,
    )
    return out / "chat"


_PLAN_COST = """
import json, sys, time
import numpy as np
from flat_tokens_jax.data.binpack import build_plan
n, seq_len = int(sys.argv[1]), int(sys.argv[2])
rng = np.random.default_rng(1)
lengths = np.empty(n, np.int64)
for lo in range(0, n, 1 << 20):
    part = lengths[lo : lo + (1 << 20)]
    part[:] = np.maximum(rng.lognormal(np.log(300), 1.0, part.size), 1)
def high_water():
    with open("/proc/self/status") as f:
        return next(int(x.split()[1]) * 1024 for x in f if x.startswith("VmHWM:"))
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak RSS restarts from the current RSS (ru_maxrss would not)
base = high_water()
began = time.perf_counter()
starts, order = build_plan(lengths, seq_len)
seconds = time.perf_counter() - began
peak = high_water()
print(json.dumps({"seconds": seconds, "peak_extra": peak - base,
                  "plan_bytes": starts.nbytes + order.nbytes, "bins": starts.size - 1}))
"""


def plan_cost(n: int, seq_len: int) -> dict[str, float]:
    """Build time and peak RSS above the lengths, in a fresh process."""
    done = subprocess.run(
        [sys.executable, "-c", _PLAN_COST, str(n), str(seq_len)],
        capture_output=True,
        text=True,
        check=True,
    )
    result: dict[str, float] = json.loads(done.stdout)
    return result


def split_lengths(ft: ftj.FlatTokens) -> np.ndarray:
    starts = ft.starts.read_ranges(np.array([0]), np.array([ft.num_sequences + 1]))[0]
    return np.diff(starts.astype(np.int64))


def step_costs(ft: ftj.FlatTokens, cache: Path, batch: int, seq_len: int) -> dict[str, float]:
    out = {}
    for step in (1, 10**9):
        best = float("inf")
        for _ in range(5):
            loader = ftj.Loader(
                ft,
                ftj.LoaderConfig(batch_size=batch, seq_len=seq_len, packing="bins"),
                plan_cache=cache,
            )
            began = time.perf_counter()
            loader.host_batch(step)
            best = min(best, time.perf_counter() - began)
        out[f"step_{step}_ms"] = best * 1e3
    out["ratio"] = out[f"step_{10**9}_ms"] / out["step_1_ms"]
    return out


def throughput(
    ft: ftj.FlatTokens, cache: Path, batch: int, seq_len: int, steps: int
) -> dict[str, dict[str, float]]:
    """Real tokens per second of each packing, interleaved pass by pass, best of three."""
    loaders = {
        name: ftj.Loader(
            ft,
            ftj.LoaderConfig(batch_size=batch, seq_len=seq_len, packing=packing),
            plan_cache=cache,
        )
        for name, packing in (("padded", False), ("bins", "bins"), ("packed", True))
    }
    best = dict.fromkeys(loaders, float("inf"))
    real = dict.fromkeys(loaders, 0)
    for _ in range(3):
        for name, loader in loaders.items():
            real[name] = 0
            began = time.perf_counter()
            for step in range(100, 100 + steps):
                real[name] += int(np.count_nonzero(loader.host_batch(step)["segment_ids"]))
            best[name] = min(best[name], time.perf_counter() - began)
    return {
        name: {
            "real_tokens_per_s": real[name] / best[name],
            "real_fraction": real[name] / (steps * batch * seq_len),
        }
        for name in loaders
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sequences", type=int, default=1_000_000)
    parser.add_argument("--plan-sequences", type=int, default=10_000_000)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    print(f"algorithm: {ALGORITHM}")
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        ft = ftj.open_dataset(chat_dataset(root))["train"]
        lengths = split_lengths(ft)
        print(
            f"chat: {lengths.size} conversations, median {np.median(lengths):.0f} tokens, "
            f"max {lengths.max()}"
        )
        rows = [efficiencies(lengths, 2048)]
        synthetic = np.maximum(rng.lognormal(np.log(300), 1.0, args.sequences), 1).astype(np.int64)
        rows += [efficiencies(synthetic, L) for L in (2048, 8192)]
        print("| data | seq_len | padded rows | bins (ours) | whole-split FFD | ours - FFD |")
        print("|---|---|---|---|---|---|")
        for name, r in zip(("chat", "log-normal", "log-normal"), rows, strict=True):
            print(
                f"| {name} ({r['sequences']:,} seqs) | {r['seq_len']} | {r['padded']:.2%} | "
                f"{r['bins']:.2%} | {r['ffd']:.2%} | {100 * (r['bins'] - r['ffd']):+.3f} pp |"
            )
        for L in (2048, 8192):
            cost = plan_cost(args.plan_sequences, L)
            print(
                f"plan of {args.plan_sequences:,} sequences, L={L}: {cost['seconds']:.1f} s, "
                f"peak RSS +{cost['peak_extra'] / 2**20:.0f} MiB over the lengths "
                f"({cost['peak_extra'] / cost['plan_bytes']:.2f}x the plan's "
                f"{cost['plan_bytes'] / 2**20:.0f} MiB), {cost['bins']:,} bins"
            )
        cache = root / "cache"
        print("step cost (batch 32, L 2048):", step_costs(ft, cache, 32, 2048))
        print(f"throughput (batch 32, L 2048, {args.steps} steps):")
        for name, r in throughput(ft, cache, 32, 2048, args.steps).items():
            print(
                f"  {name}: {r['real_tokens_per_s'] / 1e6:.2f} M real tokens/s, "
                f"{r['real_fraction']:.1%} of row tokens real"
            )


if __name__ == "__main__":
    main()
