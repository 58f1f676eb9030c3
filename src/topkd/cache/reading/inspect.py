"""`topkd cache verify` and `topkd cache inspect`: is the cache whole, and what is in it, for every target kind.

topkd cache verify runs/cache               # exit 0 when every shard matches its checksum
topkd cache inspect runs/cache --plot m.png # fingerprint, totals, bytes/token, then per target kind:
                                            #   top-K / top-p: the teacher mass each row keeps, ids per row
                                            #   sampled (and --head hybrids): draws, distinct ids per token
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np

from topkd.base.progress import track, wrote
from topkd.cache.format import manifest as mf
from topkd.cache.reading.reader import TopKCache

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
    "plot": "also write the histograms (kept mass, ids per token) as a PNG here",
}


def verify_cache(path: str) -> int:
    """Print one line per problem (BAD ...) and a verdict; 0 when every shard and the tokenizer are intact."""
    try:
        cache = TopKCache(path)
        manifest, problems = cache.manifest, cache.verify(progress=True)
    except mf.CacheError as refused:
        # a shard refused at open: still list every shard whose bytes differ from its sidecar
        manifest = mf.load_manifest(path)
        problems = [p for s in manifest["shards"] if (p := mf.check_shard(path, s))]
        problems = problems or [" ".join(str(refused).split())]
    for p in problems:
        print(f"BAD   {p}")
    shards = len(manifest["shards"])
    print(
        f"{'FAILED' if problems else 'OK'}: {shards - len(problems)}/{shards} shards verified ({path})"
    )
    return 1 if problems else 0


@dataclass
class RowStats:
    """Per counted row (the rows a loss reads; a chat cache's prompt rows are not among them)."""

    mass: np.ndarray  # the teacher probability the row holds: exact top-K mass, 1 for sampled rows
    width: (
        np.ndarray
    )  # the distinct ids it stores (K for top-K; variable for top-p and sampled rows)


def row_stats(cache: TopKCache) -> RowStats:
    """Mass and width of every counted row, from the decoded sequences (every target kind and format)."""
    mass, width = [], []
    for i in track(range(len(cache)), desc="cache inspect", unit="seq"):
        j, local = cache.locate(i)
        seq = cache.shard(j).sequence(local)
        keep = slice(None) if seq.row_mask is None else seq.row_mask
        mass.append(np.exp(seq.log_mass.astype(np.float64))[keep])
        width.append(np.isfinite(seq.logprobs).sum(axis=1)[keep])
    if not mass:
        return RowStats(np.zeros(0), np.zeros(0, np.int64))
    return RowStats(np.concatenate(mass), np.concatenate(width))


def describe_targets(cache: TopKCache) -> str:
    """One line saying what a row holds, from the build's target settings."""
    return cache.target_kind.describe(cache.manifest["build"].get("targets") or {}, cache.k)


def width_bins(cap: int) -> np.ndarray:
    """Histogram edges for ids per row: 1, 2-3, 4-7, ... up to cap (the last bin closed at cap)."""
    edges = [1]
    while edges[-1] <= cap:
        edges.append(edges[-1] * 2)
    return np.array(edges[:-1] + [cap + 1])


def _histogram_lines(counts: np.ndarray, labels: list[str]) -> list[str]:
    top = max(int(counts.max()) if len(counts) else 0, 1)
    return [f"  {label:<16} {c:>10}  {'#' * int(40 * c / top)}" for label, c in zip(labels, counts)]


def inspect_cache(path: str, plot: str | None = None) -> dict:
    cache = TopKCache(path)
    m, fp, totals = cache.manifest, cache.fingerprint, cache.manifest["totals"]
    stats = row_stats(cache)
    print(f"cache      {path}")
    for key in ("teacher", "engine", "dtype", "vocab_size", "k", "temperatures", "alignment"):
        print(f"{key:<10} {fp[key]}")
    print(
        f"codec      {m['build']['codec']}   seq_len {m['build']['seq_len']}   format v{m['format_version']}"
    )
    print(describe_targets(cache))
    print(
        f"counted    {cache.counted_tokens} of {totals['tokens']} rows count for KD/CE "
        f"({cache.counted_tokens / max(totals['tokens'], 1):.1%}; chat data: assistant turns only)"
    )
    print(
        f"totals     {totals['sequences']} sequences, {totals['tokens']} tokens, {totals['shards']} shards, "
        f"{totals['bytes'] / 1e6:.2f} MB, {totals['bytes_per_token']:.1f} bytes/token"
    )
    summary = {"path": path, "fingerprint": fp, "totals": totals, "targets": cache.targets}
    if len(stats.mass) == 0:
        print("no counted rows: nothing to histogram")
    else:
        summary.update(_print_histograms(cache, stats))
    if plot and len(stats.mass):
        _plot(stats, cache, plot)
        wrote("cache inspect", f"the histograms (kept mass, ids per token) to {plot}")
    keys = ("tokens", "bytes_per_token")
    line = {"cache": path, "targets": cache.targets, "counted_tokens": cache.counted_tokens}
    line.update({k: totals[k] for k in keys})
    line.update({k: summary.get(k) for k in ("mass_mean", "width_mean")})
    print(json.dumps(line))
    return summary


def _print_histograms(cache: TopKCache, stats: RowStats) -> dict:
    """The kept-mass histogram (top-K and top-p rows; sampled rows always hold all of it) and ids per row."""
    out = {"mass_mean": float(stats.mass.mean()), "width_mean": float(stats.width.mean())}
    kind = cache.target_kind
    if not kind.holds_all_mass:
        counts, _ = np.histogram(stats.mass, bins=MASS_BINS)
        print(
            f"kept mass  mean {stats.mass.mean():.4f}, median {np.median(stats.mass):.4f}, "
            f"min {stats.mass.min():.4f} (teacher probability in the stored ids, per counted token)"
        )
        labels = [
            f"[{lo:5.3f}, {hi:5.3f}{']' if hi == 1 else ')'}"
            for lo, hi in zip(MASS_BINS, MASS_BINS[1:])
        ]
        print("\n".join(_histogram_lines(counts, labels)))
        out["mass_hist"] = {"bins": MASS_BINS.tolist(), "counts": counts.tolist()}
    bins = width_bins(max(cache.k, int(stats.width.max())))
    counts, _ = np.histogram(stats.width, bins=bins)
    print(
        f"width      {kind.width_label} per counted token: mean {stats.width.mean():.1f}, median "
        f"{np.median(stats.width):.0f}, min {stats.width.min()}, max {stats.width.max()} (K = {cache.k})"
    )
    labels = [str(lo) if hi - lo == 1 else f"{lo}-{hi - 1}" for lo, hi in zip(bins, bins[1:])]
    if kind.variable_k:  # rows all K wide: one line says it
        print("\n".join(_histogram_lines(counts, labels)))
    out["width_hist"] = {"bins": bins.tolist(), "counts": counts.tolist()}
    return out


def _plot(stats: RowStats, cache: TopKCache, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fp = cache.fingerprint
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    if cache.target_kind.holds_all_mass:
        left.text(
            0.5, 0.5, f"{cache.targets} rows hold all the mass\n(count / N sums to 1)", ha="center"
        )
        left.set_axis_off()
    else:
        left.hist(stats.mass, bins=50, range=(0, 1))
        left.set_xlabel("teacher probability mass in the stored ids")
        left.set_ylabel("counted tokens")
        left.set_yscale("log")
    right.hist(stats.width, bins=np.arange(0.5, max(cache.k, int(stats.width.max())) + 1.5))
    right.set_xlabel(f"{cache.target_kind.width_label} per token")
    right.set_ylabel("counted tokens")
    fig.suptitle(
        f"{cache.targets} targets, {fp['teacher'].split('/')[-1]} (V={fp['vocab_size']}, K={fp['k']})",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
