"""`topkd bench loss`: projection-only KD benchmark over sequence lengths, like the paper's.

    topkd bench loss --lengths 1024,4096,16384,65536 --out benchmarks/results/loss-cpu
    topkd bench loss --vocab 201088 --hidden 2880 --device cuda --dtype bfloat16   # paper shapes

Each (impl, length) point runs forward+backward in a fresh subprocess (topkd.bench.point),
so peak memory is that point's alone. Reported per point: peak / memory floor, time /
three-GEMM floor (same process), GFLOP/s at 6NVH, and each impl's ratios to fused.
Out of memory is recorded as a result. Outputs: a table, loss.csv (one stamped row per
point), loss.json, loss.png (memory and time vs length, log scales), and a JSON last line.
"""

from __future__ import annotations

import csv
import json
import os
import sys
from dataclasses import asdict, dataclass, field

from topkd.base.progress import track, wrote
from topkd.base.stamp import stamp
from topkd.bench.common import (
    Column,
    plot_vs_length,
    results_table,
    run_json_process,
    series_by_impl,
    skipped_after_oom,
)
from topkd.bench.point import KD_IMPLS, PEERS
from topkd.loss import DEFAULT_CHUNK_BYTES


@dataclass
class LossBenchConfig:
    lengths: list[int] = field(
        default_factory=lambda: [1024, 2048, 4096, 8192, 16384, 32768, 65536]
    )
    impls: list[str] = field(default_factory=lambda: list(KD_IMPLS + PEERS))
    vocab: int = 32768
    hidden: int = 512
    k: int = 100
    dtype: str = "float32"
    device: str = "cpu"
    repeats: int = 3
    mem_limit_gib: float = 20.0
    timeout_s: int = 1800
    out: str = "benchmarks/results/loss-cpu"
    no_huge_pages: bool = False
    report_only: bool = False


LOSS_BENCH_HELP = {
    "lengths": "comma-separated token counts (sequence lengths) to sweep",
    "impls": "comma-separated impls: fused, chunked, dense, liger_jsd, torch_lce",
    "vocab": "vocabulary size V (paper: 201088)",
    "hidden": "hidden size H (paper: 2880)",
    "k": "teacher top-K per token",
    "dtype": "float32 | bfloat16 | float16",
    "device": "cpu | cuda",
    "repeats": "timed runs per point (median), after one measured warm run",
    "mem_limit_gib": "CPU address-space cap per point, so OOM is a clean result (0: none)",
    "timeout_s": "seconds before a point is recorded as a timeout",
    "out": "output directory for loss.csv, loss.json, loss.png",
    "no_huge_pages": "time without THP_MEM_ALLOC_ENABLE=1 (torch huge-page CPU allocator; memory never uses it)",
    "report_only": "re-print the table of the run stored in --out, measuring nothing",
}


def run_point(cfg: LossBenchConfig, impl: str, tokens: int) -> dict:
    """One point. With huge pages (default on CPU) memory and time come from two fresh processes:
    memory with the default 4 KiB pages (exact bytes), time with THP_MEM_ALLOC_ENABLE=1, so a
    fresh [C, V] chunk buffer page-faults 512x less (most of a call's fixed cost at 1K-4K tokens),
    at the price of rounding each large tensor's resident size up to 2 MiB."""
    if cfg.no_huge_pages or cfg.device != "cpu":
        return _run_phase(cfg, impl, tokens, "both", huge_pages=False)
    row = _run_phase(cfg, impl, tokens, "memory", huge_pages=False)
    if row["status"] != "ok":
        return row
    timed = _run_phase(cfg, impl, tokens, "time", huge_pages=True)
    if timed["status"] != "ok":
        return timed
    return {**timed, "peak_bytes": row["peak_bytes"]}


def _run_phase(cfg: LossBenchConfig, impl: str, tokens: int, phase: str, huge_pages: bool) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "topkd.bench.point",
        "--impl",
        impl,
        "--tokens",
        str(tokens),
        "--vocab",
        str(cfg.vocab),
        "--hidden",
        str(cfg.hidden),
        "--k",
        str(cfg.k),
        "--dtype",
        cfg.dtype,
        "--device",
        cfg.device,
        "--repeats",
        str(cfg.repeats),
        "--mem-limit-gib",
        str(cfg.mem_limit_gib),
        "--phase",
        phase,
    ]
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    if huge_pages:
        env["THP_MEM_ALLOC_ENABLE"] = "1"
    return {"impl": impl, "tokens": tokens, **run_json_process(cmd, cfg.timeout_s, env)}


def add_ratios(rows: list[dict], chunk_budget_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
    """Per point: peak / floor, time / GEMM floor, GFLOP/s, and ratios to fused at the same length."""
    ok = [r for r in rows if r["status"] == "ok"]
    for r in ok:
        r["mem_over_floor"] = r["peak_bytes"] / r["floor_bytes"]
        # the fused driver's working set beside the floor
        r["chunk_budget_bytes"] = chunk_budget_bytes
        r["time_over_floor"] = r["time_s"] / r["floor_time_s"]
        r["gflops"] = r["flops"] / r["time_s"] / 1e9
    fused = {r["tokens"]: r for r in ok if r["impl"] == "fused"}
    for r in ok:
        f = fused.get(r["tokens"])
        if f is not None:
            # impls run in separate processes, so the machine may have drifted between them: compare each
            # time to the GEMM floor measured beside it, then those ratios (the raw seconds ratio is kept too)
            r["time_vs_fused"] = r["time_over_floor"] / f["time_over_floor"]
            r["raw_time_vs_fused"] = r["time_s"] / f["time_s"]
            # a toy point can peak within pages already resident: no ratio then
            if f["peak_bytes"] > 0:
                r["mem_vs_fused"] = r["peak_bytes"] / f["peak_bytes"]


NAN = float("nan")
LOSS_COLUMNS = [
    Column("impl", 10, lambda r: r["impl"]),
    Column("tokens", 7, lambda r: r["tokens"]),
    Column("peak GiB", 9, lambda r: r["peak_bytes"] / 2**30, ".3f"),
    Column("/floor", 7, lambda r: r["mem_over_floor"], ".2f"),
    Column("time s", 8, lambda r: r["time_s"], ".2f"),
    Column("/gemm", 6, lambda r: r["time_over_floor"], ".2f"),
    Column("GFLOP/s", 8, lambda r: r["gflops"], ".1f"),
    Column("mem/fused", 9, lambda r: r.get("mem_vs_fused", NAN), ".2f"),
    Column("time/fused", 10, lambda r: r.get("time_vs_fused", NAN), ".2f"),
]


def table(rows: list[dict]) -> str:
    return results_table(sorted(rows, key=lambda r: (r["tokens"], r["impl"])), LOSS_COLUMNS)


def write_outputs(rows: list[dict], cfg: LossBenchConfig, meta: dict) -> dict:
    os.makedirs(cfg.out, exist_ok=True)
    keys = sorted({k for r in rows for k in r} | set(meta))
    with open(os.path.join(cfg.out, "loss.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        for r in rows:
            writer.writerow(
                {**meta, **{k: (json.dumps(v) if isinstance(v, list) else v) for k, v in r.items()}}
            )
    summary = {"bench": "loss", "config": asdict(cfg), "stamp": meta, "points": rows}
    with open(os.path.join(cfg.out, "loss.json"), "w") as f:
        json.dump(summary, f, indent=1)
    plot(rows, cfg, meta, os.path.join(cfg.out, "loss.png"))
    return summary


def plot(rows: list[dict], cfg: LossBenchConfig, meta: dict, path: str) -> None:
    series, failed = series_by_impl(rows, cfg.impls, lambda r: r["peak_bytes"] / 2**30, "time_s")
    plot_vs_length(
        series,
        failed,
        ("peak memory (GiB)", "forward+backward (s)"),
        f"KD loss, V={cfg.vocab} H={cfg.hidden} K={cfg.k} {cfg.dtype} on {meta['machine']} "
        f"({meta['commit']}); dotted: OOM",
        path,
    )


def report(cfg: LossBenchConfig) -> dict:
    """Re-print the table of a stored run (cfg.out/loss.json) without measuring again."""
    with open(os.path.join(cfg.out, "loss.json")) as f:
        summary = json.load(f)
    rows = summary["points"]
    add_ratios(rows)
    stored = LossBenchConfig(**{**summary["config"], "out": cfg.out, "report_only": False})
    # derived ratios, CSV and plot follow this code
    summary = write_outputs(rows, stored, summary["stamp"])
    print(table(rows))
    return summary


def run_loss_bench(cfg: LossBenchConfig) -> dict:
    if cfg.report_only:
        return report(cfg)
    meta = {
        **stamp(cfg.device),
        "huge_pages": "time only" if not cfg.no_huge_pages and cfg.device == "cpu" else "off",
    }
    points = [(impl, n) for n in cfg.lengths for impl in cfg.impls]
    rows = []
    for impl, n in track(points, desc="bench loss", unit="point"):
        skipped = skipped_after_oom(rows, impl, n)
        rows.append({"impl": impl, "tokens": n, **skipped} if skipped else run_point(cfg, impl, n))
    add_ratios(rows)
    print(table(rows))
    summary = write_outputs(rows, cfg, meta)
    print(json.dumps({"bench": "loss", "out": cfg.out, "commit": meta["commit"], "points": rows}))
    wrote("bench loss", f"loss.csv, loss.json and loss.png in {cfg.out}")
    return summary
