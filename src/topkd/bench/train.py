"""`topkd bench train`: a whole training step (SmolLM2-shaped student) with each loss impl, and cache loading.

    topkd bench train --lengths 4096,16384,32768 --out benchmarks/results/train-cpu

Each measurement runs in a fresh process (topkd.bench.train_point): peak memory of one step
per (impl, length) under an address-space cap (an allocation failure is recorded as OOM, and
longer lengths of that impl are skipped); step times of all impls that fit, interleaved in
one process per length; and a step whose batch is decoded from a real rice-zstd cache against
the same step on a batch held in memory. Outputs: a table, train.json, train.csv,
train.png (memory and time vs length), and a JSON last line.
"""

from __future__ import annotations

import csv
import json
import os
import sys
from dataclasses import asdict, dataclass, field

from topkd.base.progress import progress, wrote
from topkd.base.stamp import stamp
from topkd.bench.common import (
    Column,
    plot_vs_length,
    results_table,
    run_json_process,
    series_by_impl,
    skipped_after_oom,
)
from topkd.bench.train_point import SHAPES


@dataclass
class TrainBenchConfig:
    lengths: list[int] = field(default_factory=lambda: [4096, 16384, 32768])
    impls: list[str] = field(default_factory=lambda: ["fused", "chunked", "dense"])
    shape: str = "smollm2"
    layers: int = 2
    repeats: int = 2
    loading_tokens: int = 2048
    loading_batch: int = 4
    loading_repeats: int = 4
    mem_limit_gib: float = 22.0
    timeout_s: int = 3600
    out: str = "benchmarks/results/train-cpu"


TRAIN_BENCH_HELP = {
    "lengths": "tokens per training sample (one sample per step)",
    "impls": "loss implementations: fused, chunked, dense",
    "shape": "student shape: smollm2 (V=49,152, H=576) | gemma3-270m (V=262,144, H=640)",
    "layers": "decoder blocks of the student",
    "repeats": "timed steps per impl and length (interleaved; the median is reported)",
    "loading_tokens": "sample length of the cache-loading comparison",
    "loading_batch": "samples per step of the cache-loading comparison",
    "loading_repeats": "rounds of the cache-loading comparison (median)",
    "mem_limit_gib": "address-space cap per measurement process (the machine has 24 GiB)",
    "timeout_s": "seconds before a measurement process is abandoned",
    "out": "output directory (train.json, train.csv, train.png)",
}


def _point(cfg: TrainBenchConfig, *args: str) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "topkd.bench.train_point",
        "--shape",
        cfg.shape,
        "--layers",
        str(cfg.layers),
        "--repeats",
        str(cfg.repeats),
        "--mem-limit-gib",
        str(cfg.mem_limit_gib),
        *args,
    ]
    return run_json_process(cmd, cfg.timeout_s, {**os.environ, "THP_MEM_ALLOC_ENABLE": "0"})


def measure(cfg: TrainBenchConfig) -> dict:
    memory, times = [], []
    bar = progress(
        total=len(cfg.lengths) * (len(cfg.impls) + 1) + 1, desc="bench train", unit="run"
    )
    for n in cfg.lengths:
        for impl in cfg.impls:
            row = skipped_after_oom(memory, impl, n) or _point(
                cfg, "--phase", "memory", "--impls", impl, "--tokens", str(n)
            )
            memory.append({**row, "impl": impl, "tokens": n})
            bar.update(1)
        fits = [r["impl"] for r in memory if r["tokens"] == n and r["status"] == "ok"]
        if fits:
            times.append(
                {
                    **_point(cfg, "--phase", "time", "--impls", ",".join(fits), "--tokens", str(n)),
                    "tokens": n,
                }
            )
        bar.update(1)
    loading = _point(
        cfg,
        "--phase",
        "loading",
        "--tokens",
        str(cfg.loading_tokens),
        "--batch",
        str(cfg.loading_batch),
        "--repeats",
        str(cfg.loading_repeats),
    )
    bar.update(1)
    bar.close()
    return {"memory": memory, "time": times, "loading": loading}


def rows_by_point(result: dict) -> list[dict]:
    """One row per (impl, length): peak memory, median step time, ratios to fused."""
    rows = []
    for m in result["memory"]:
        row = {"impl": m["impl"], "tokens": m["tokens"], "status": m["status"]}
        if m["status"] == "ok":
            row.update(
                process_peak_gib=m["process_peak_bytes"] / 2**30,
                step_peak_gib=m["step_peak_bytes"] / 2**30,
            )
            timed = next(
                (t for t in result["time"] if t["tokens"] == m["tokens"] and t["status"] == "ok"),
                None,
            )
            if timed and m["impl"] in timed["median_s"]:
                row["step_s"] = timed["median_s"][m["impl"]]
                row["tokens_per_s"] = m["tokens"] / row["step_s"]
        rows.append(row)
    for r in rows:
        f = next((x for x in rows if x["tokens"] == r["tokens"] and x["impl"] == "fused"), None)
        if f and f["status"] == "ok" and r["status"] == "ok":
            r["mem_vs_fused"] = r["process_peak_gib"] / f["process_peak_gib"]
            if "step_s" in r and "step_s" in f:
                r["time_vs_fused"] = r["step_s"] / f["step_s"]
    return rows


NAN = float("nan")
TRAIN_COLUMNS = [
    Column("impl", 8, lambda r: r["impl"]),
    Column("tokens", 7, lambda r: r["tokens"]),
    Column("peak GiB", 9, lambda r: r["process_peak_gib"], ".2f"),
    Column("step GiB", 9, lambda r: r["step_peak_gib"], ".2f"),
    Column("step s", 8, lambda r: r.get("step_s", NAN), ".1f"),
    Column("tok/s", 7, lambda r: r.get("tokens_per_s", NAN), ".0f"),
    Column("mem/fused", 9, lambda r: r.get("mem_vs_fused", NAN), ".2f"),
    Column("time/fused", 10, lambda r: r.get("time_vs_fused", NAN), ".3f"),
]


def table(rows: list[dict]) -> str:
    return results_table(sorted(rows, key=lambda r: (r["tokens"], r["impl"])), TRAIN_COLUMNS)


def write_outputs(cfg: TrainBenchConfig, result: dict, rows: list[dict], meta: dict) -> None:
    os.makedirs(cfg.out, exist_ok=True)
    with open(os.path.join(cfg.out, "train.json"), "w") as f:
        json.dump(
            {"bench": "train", "config": asdict(cfg), "stamp": meta, "points": rows, "raw": result},
            f,
            indent=1,
        )
    keys = sorted({k for r in rows for k in r} | set(meta))
    with open(os.path.join(cfg.out, "train.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows({**meta, **r} for r in rows)
    if rows:  # a loading-only run has no memory or time points to draw
        plot(cfg, rows, meta, os.path.join(cfg.out, "train.png"))


def plot(cfg: TrainBenchConfig, rows: list[dict], meta: dict, path: str) -> None:
    series, failed = series_by_impl(rows, cfg.impls, lambda r: r["process_peak_gib"], "step_s")
    plot_vs_length(
        series,
        failed,
        ("peak process memory (GiB); x: OOM", "training step (s)"),
        f"training step, {cfg.shape}-shaped student ({cfg.layers} layers, "
        f"V={SHAPES[cfg.shape][2]['vocab_size']:,}), {meta['machine']} ({meta['commit']})",
        path,
        oom_level=cfg.mem_limit_gib,
    )


def run_train_bench(cfg: TrainBenchConfig) -> dict:
    meta = stamp("cpu")
    result = measure(cfg)
    rows = rows_by_point(result)
    loading = {**result["loading"], "tokens": cfg.loading_tokens, "batch": cfg.loading_batch}
    print(table(rows))
    if loading.get("status") == "ok":
        print(f"cache-loading step / in-memory step: {loading['cached_over_in_memory']:.3f}")
    write_outputs(cfg, result, rows, meta)
    summary = {
        "bench": "train",
        "out": cfg.out,
        "commit": meta["commit"],
        "points": rows,
        "loading": loading,
    }
    print(json.dumps(summary))
    wrote("bench train", f"its tables, JSON and plots in {cfg.out}")
    return summary
