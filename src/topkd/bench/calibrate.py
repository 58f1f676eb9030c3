"""The cost model against this machine: measure a CPU profile, predict every impl, measure it with `bench loss`.

    topkd bench model --calibrate --lengths 1024,2048,4096,8192 --out benchmarks/results/model-cpu-calibration

The profile is measured here by microbenchmarks, in a fresh process with the allocator settings of
`bench loss --no-huge-pages` (4 KiB pages, whose first-touch cost is steady): DRAM bandwidth (a warm
256 MiB copy), the per-element cost of each op kind on a cache-resident 1 MiB block, the fixed cost
of one op, the first-touch cost of fresh memory, and the GEMM rate of every GEMM shape (and variant:
mm, or addmm into a warm accumulator) the traces issue. Each impl is traced once on real CPU tensors (the
ops the CPU driver really runs), priced, and compared with the time `topkd bench loss` measures for the
same point in its own fresh process. PASS when predicted / measured is within 1 +- 0.25.
"""

from __future__ import annotations

import gc
import json
import os
import sys

import torch

import topkd
from topkd.bench.common import run_json_process
from topkd.bench.model import DeviceProfile, predict, timed_median, trace_impl

TOLERANCE = 0.25
BLOCK = (8, 32768)  # 1 MiB of fp32: the row blocks the CPU driver's elementwise passes walk


def _per_element(fn, elements: int, overhead: float) -> float:
    return max(timed_median(fn, 20) - overhead, 0.0) / elements


def measure_profile(gemm_shapes: list[tuple]) -> DeviceProfile:
    """This CPU, measured now (call in a process started like bench loss's timing runs)."""
    one = torch.zeros(1)
    overhead = timed_median(lambda: [one.add_(1) for _ in range(1000)], 5) / 1000
    bandwidth, fault = _memory_rates()
    z, other = torch.randn(*BLOCK), torch.randn(*BLOCK)
    ids = torch.randint(0, BLOCK[1], (BLOCK[0], 100))
    n = z.numel()
    element_s = {
        "transcendental": _per_element(lambda: torch.exp(other, out=z), n, overhead),
        "reduction": _per_element(lambda: z.amax(dim=1), n, overhead),
        "elementwise": _per_element(lambda: z.mul_(1.0), n, overhead),
        "copy": _per_element(lambda: z.copy_(other), n, overhead),
        "index": _per_element(lambda: z.scatter_(1, ids, 0.0), ids.numel(), overhead),
    }
    element_s["kernel"] = element_s["elementwise"]
    shapes = {s: _gemm_rate(*s) for s in gemm_shapes}
    return DeviceProfile(
        name="cpu (measured)",
        gemm_flops={"float32": _best_rate(shapes)},
        bandwidth=bandwidth,
        op_overhead_s=overhead,
        element_s=element_s,
        cache_bytes=4 * 2**20,
        launch_overlaps=False,
        gemm_shapes=shapes,
        fault_s_per_byte=fault,
        note="measured here: bandwidth, per-element costs, op overhead, page faults, GEMM "
        "rate per traced shape",
    )


def _memory_rates() -> tuple[float, float]:
    """(DRAM bytes/s of a warm 256 MiB copy, seconds per byte of first touch of freshly mapped memory)."""
    big, dst = torch.ones(64 * 2**20), torch.empty(64 * 2**20)
    dst.copy_(big)  # touched first: bandwidth, not page faults
    bandwidth = 2 * big.numel() * 4 / timed_median(lambda: dst.copy_(big), 5)
    # 256 MiB: always freshly mapped
    fresh = timed_median(lambda: torch.empty(big.numel()).fill_(1), 5)
    warm_fill = timed_median(lambda: dst.fill_(1), 5)
    return bandwidth, max(fresh - warm_fill, 0.0) / (big.numel() * 4)


def _best_rate(shapes: dict) -> float:
    """The profile's fallback GEMM rate: the best measured shape's (1e11 when none was traced)."""
    return max(shapes.values()) if shapes else 1e11


def _gemm_rate(name: str, m: int, k: int, n: int, dtype: str) -> float:
    """FLOP/s of this GEMM here; an addmm accumulates into a warm [m, n] buffer, as the dW GEMM does."""
    kind = getattr(torch, dtype)
    a, b, out = (
        torch.randn(m, k, dtype=kind),
        torch.randn(k, n, dtype=kind),
        torch.zeros(m, n, dtype=kind),
    )
    run = (
        (lambda: out.addmm_(a, b))
        if name.startswith("addmm")
        else (lambda: torch.mm(a, b, out=out))
    )
    return 2 * m * k * n / timed_median(run, 3)


def profile_process(gemm_shapes: list[tuple]) -> dict:
    """measure_profile in a fresh process with 4 KiB pages, as `bench loss --no-huge-pages` runs (with huge
    pages the cost of freshly mapped memory swings 10x with the kernel's compaction state)."""
    cmd = [sys.executable, "-m", "topkd.bench.calibrate", json.dumps(gemm_shapes)]
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    got = run_json_process(cmd, 1800, env)
    if "bandwidth" not in got:
        raise RuntimeError(f"profile measurement failed: {got}")
    got["gemm_shapes"] = {tuple(s): r for s, r in got["gemm_shapes"]}
    return got


def calibrate(
    lengths: list[int], impls: list[str], vocab: int, hidden: int, k: int, measure_point
) -> dict:
    """Predicted vs measured per (impl, length); measure_point(impl, tokens) -> a bench loss row."""
    traces = {
        (impl, n): trace_impl(impl, n, vocab, hidden, k, torch.float32, "cpu")[0]
        for n in lengths
        for impl in impls
    }
    topkd.loss.release_workspace()  # the traced runs' chunk buffer must not sit beside the measured points
    gc.collect()
    shapes = sorted({op.shape for ops in traces.values() for op in ops if op.kind == "gemm"})
    profile = DeviceProfile(**profile_process(shapes))
    rows = []
    for (impl, n), ops in traces.items():
        pred = predict(ops, profile)
        measured = measure_point(impl, n)
        row = {
            "impl": impl,
            "tokens": n,
            "predicted_s": pred["seconds"],
            "by_kind": pred["by_kind"],
            "status": measured["status"],
            "measured_s": measured.get("time_s"),
        }
        if row["measured_s"]:
            row["ratio"] = row["predicted_s"] / row["measured_s"]
            row["pass"] = abs(row["ratio"] - 1) <= TOLERANCE
        rows.append(row)
    return {"profile": _profile_json(profile), "points": rows, "tolerance": TOLERANCE}


def _profile_json(p: DeviceProfile) -> dict:
    d = dict(vars(p))
    d["gemm_shapes"] = [[list(s), r] for s, r in p.gemm_shapes.items()]
    return d


def main() -> None:
    shapes = [tuple(s) for s in json.loads(sys.argv[1])]
    print(json.dumps(_profile_json(measure_profile(shapes))), flush=True)


if __name__ == "__main__":
    main()


def calibration_table(rows: list[dict]) -> str:
    head = f"{'impl':<8} {'tokens':>7} {'predicted s':>11} {'measured s':>10} {'ratio':>6}"
    lines = [head, "-" * len(head)]
    for r in rows:
        if r.get("measured_s") is None:
            lines.append(
                f"{r['impl']:<8} {r['tokens']:>7} {r['predicted_s']:>11.3f} {r['status']:>10}"
            )
            continue
        lines.append(
            f"{r['impl']:<8} {r['tokens']:>7} {r['predicted_s']:>11.3f} {r['measured_s']:>10.3f} "
            f"{r['ratio']:>6.2f}  {'PASS' if r['pass'] else 'FAIL'} (within +-{TOLERANCE:.0%})"
        )
    return "\n".join(lines)


def plot_calibration(rows: list[dict], path: str) -> None:
    """Measured (solid) and predicted (dashed) time against tokens, one colour per impl."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for i, impl in enumerate(dict.fromkeys(r["impl"] for r in rows)):
        ok = sorted(
            (r for r in rows if r["impl"] == impl and r.get("measured_s")),
            key=lambda r: r["tokens"],
        )
        tokens = [r["tokens"] for r in ok]
        ax.plot(
            tokens, [r["measured_s"] for r in ok], "o-", color=f"C{i}", label=f"{impl} measured"
        )
        ax.plot(
            tokens, [r["predicted_s"] for r in ok], "x--", color=f"C{i}", label=f"{impl} predicted"
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens")
    ax.set_ylabel("forward+backward (s)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title(f"cost model vs bench loss on this CPU (band: +-{TOLERANCE:.0%})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
