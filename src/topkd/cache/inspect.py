"""`topkd cache verify` and `topkd cache inspect`: is the cache whole, and what is in it.

topkd cache verify runs/cache               # exit 0 when every shard matches its checksum
topkd cache inspect runs/cache --plot m.png # fingerprint, totals, bytes/token, retained-mass histogram
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np

from topkd.cache.reader import TopKCache
from topkd.progress import wrote

MASS_BINS = np.array([0.0, 0.5, 0.8, 0.9, 0.95, 0.99, 0.999, 1.0])


@dataclass
class VerifyConfig:
    path: str = field(default="", metadata={"positional": True})


VERIFY_HELP = {"path": "cache directory (its manifest.json and shards)"}


@dataclass
class InspectConfig:
    path: str = field(default="", metadata={"positional": True})
    plot: str = ""


INSPECT_HELP = {
    "path": "cache directory (its manifest.json and shards)",
    "plot": "also write the retained-mass histogram as a PNG here",
}


def verify_cache(path: str) -> int:
    cache = TopKCache(path)
    problems = cache.verify(progress=True)
    for p in problems:
        print(f"BAD   {p}")
    shards = len(cache.manifest["shards"])
    print(
        f"{'FAILED' if problems else 'OK'}: {shards - len(problems)}/{shards} shards verified ({path})"
    )
    return 1 if problems else 0


def retained_mass(cache: TopKCache) -> np.ndarray:
    """Per-token top-K probability mass over the rows that train (exact, from the stored log mass): a chat cache's
    masked rows (its repeated system prompt) would show as spikes of rows no loss ever reads."""
    parts = []
    for j in range(len(cache.manifest["shards"])):
        shard = cache.shard(j)
        mass = np.exp(shard.tensor("log_mass").astype(np.float64))
        parts.append(
            mass[shard.tensor("row_mask").astype(bool)] if "row_mask" in shard.names else mass
        )
    return np.concatenate(parts) if parts else np.zeros(0)


def inspect_cache(path: str, plot: str | None = None) -> dict:
    cache = TopKCache(path)
    m, fp, totals = cache.manifest, cache.fingerprint, cache.manifest["totals"]
    mass = retained_mass(cache)
    counts, _ = np.histogram(mass, bins=MASS_BINS)
    print(f"cache      {path}")
    for key in ("teacher", "engine", "dtype", "vocab_size", "k", "temperatures", "alignment"):
        print(f"{key:<10} {fp[key]}")
    print(
        f"codec      {m['build']['codec']}   seq_len {m['build']['seq_len']}   format v{m['format_version']}"
    )
    print(
        f"counted    {cache.counted_tokens} of {totals['tokens']} rows count for KD/CE "
        f"({cache.counted_tokens / max(totals['tokens'], 1):.1%}; chat data: assistant turns only)"
    )
    print(
        f"totals     {totals['sequences']} sequences, {totals['tokens']} tokens, {totals['shards']} shards, "
        f"{totals['bytes'] / 1e6:.2f} MB, {totals['bytes_per_token']:.1f} bytes/token"
    )
    print(f"top-K mass mean {mass.mean():.4f}, median {np.median(mass):.4f}, min {mass.min():.4f}")
    width = max(counts.max(), 1)
    for lo, hi, c in zip(MASS_BINS, MASS_BINS[1:], counts):
        print(
            f"  [{lo:5.3f}, {hi:5.3f}{']' if hi == 1 else ')'} {c:>10}  {'#' * int(40 * c / width)}"
        )
    summary = {
        "path": path,
        "fingerprint": fp,
        "totals": totals,
        "mass_mean": float(mass.mean()),
        "mass_hist": {"bins": MASS_BINS.tolist(), "counts": counts.tolist()},
    }
    if plot:
        _plot(mass, fp, plot)
        wrote("cache inspect", f"the retained-mass histogram to {plot}")
    print(
        json.dumps(
            {
                "cache": path,
                "tokens": totals["tokens"],
                "counted_tokens": cache.counted_tokens,
                "bytes_per_token": totals["bytes_per_token"],
                "mass_mean": summary["mass_mean"],
            }
        )
    )
    return summary


def _plot(mass: np.ndarray, fp: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.hist(mass, bins=50, range=(0, 1))
    ax.set_xlabel(f"teacher probability mass in the top-{fp['k']}")
    ax.set_ylabel("counted tokens")
    ax.set_yscale("log")
    ax.set_title(
        f"top-K coverage, {fp['teacher'].split('/')[-1]} (V={fp['vocab_size']})", fontsize=9
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
