"""A cost model of the loss: trace one call of each impl, price every op on a named device.

    topkd bench model --device h200 --vocab 201088 --hidden 2880 --dtype bfloat16    # predictions (meta tensors)
    topkd bench model --calibrate --out benchmarks/results/model-cpu-calibration     # vs `bench loss` here

Each impl runs forward+backward once under topkd.trace.OpTrace: on meta tensors (shapes only, any
size, instant; the driver takes its GPU branches) for predictions, or on real CPU tensors for the
calibration. Every op is priced as a roofline: a GEMM takes max(FLOPs / GEMM rate, bytes / bandwidth),
any other op max(bytes / bandwidth, elements x its per-element cost), plus a fixed cost per op (a
kernel launch on a GPU, hidden under any longer kernel; dispatch on a CPU, added). The H200 figures are
assumptions (what such machines measure), so its numbers are PREDICTIONS; the CPU profile is measured
by microbenchmarks in the same run, and `--calibrate` shows how far the model is from `topkd bench loss`
on this machine for every impl. Reported per point: predicted time, TFLOP/s at 6NVH, ratio to the
three-GEMM floor (6NVH at the GEMM rate), and the peak memory of the trace at full N.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import statistics
import time
from dataclasses import dataclass, field

import torch

import topkd
from topkd.loss.api import KERNELS_ENV
from topkd.trace import Op, OpTrace


@dataclass
class DeviceProfile:
    """What a device does per second. gemm_rate may be refined per GEMM shape (measured CPU profiles)."""

    name: str
    gemm_flops: dict[str, float]  # input dtype -> FLOP/s
    bandwidth: float  # DRAM bytes/s
    op_overhead_s: float  # fixed cost per op
    element_s: dict[str, float] = field(default_factory=dict)  # op kind -> seconds per element (CPU engines)
    cache_bytes: int = 0  # footprints below this never reach DRAM
    launch_overlaps: bool = True  # GPU: launches run ahead, so an op costs max(launch, work); CPU: launch + work
    gemm_shapes: dict = field(default_factory=dict)  # (m, k, n, dtype) -> measured FLOP/s (CPU)
    fault_s_per_byte: float = 0.0  # first touch of freshly mapped memory (CPU; a GPU's caching allocator: 0)
    memory_bytes: float = float("inf")
    note: str = ""

    def gemm_rate(self, op: Op) -> float:
        return self.gemm_shapes.get(op.shape, self.gemm_flops[op.dtype])


H200 = DeviceProfile(
    name="h200", gemm_flops={"bfloat16": 790e12, "float16": 790e12, "float32": 395e12, "float64": 60e12},
    bandwidth=4.3e12, op_overhead_s=4e-6, cache_bytes=50 * 2**20, memory_bytes=139 * 2**30,
    note="assumed: bf16 dense GEMM 790 TFLOP/s and 4.3 TB/s as measured on such machines; fp32 GEMMs at TF32 "
         "(half the bf16 rate); 4 us per kernel launch, hidden under longer kernels")


def op_seconds(op: Op, profile: DeviceProfile) -> float:
    """Roofline time of one op on the profile."""
    moved = op.read + op.written
    dram = moved / profile.bandwidth if moved > profile.cache_bytes else 0.0
    if op.kind == "gemm":
        work = max(op.flops / profile.gemm_rate(op), dram)
    else:
        work = max(dram, op.elements * profile.element_s.get(op.kind, 0.0))
    if op.kind == "alloc":  # an empty(): no work, but its pages fault on first use
        return op.fresh * profile.fault_s_per_byte
    work += op.fresh * profile.fault_s_per_byte
    if profile.launch_overlaps:
        return max(profile.op_overhead_s, work)
    return profile.op_overhead_s + work


def predict(ops: list[Op], profile: DeviceProfile) -> dict:
    """Predicted seconds in total and per op kind."""
    by_kind: dict[str, float] = {}
    for op in ops:
        by_kind[op.kind] = by_kind.get(op.kind, 0.0) + op_seconds(op, profile)
    return {"seconds": sum(by_kind.values()), "by_kind": by_kind, "ops": len(ops)}


def make_inputs(n: int, vocab: int, hidden: int, k: int, dtype: torch.dtype, device: str) -> dict:
    """Loss inputs; on meta only their shapes exist. Real ones come from topkd.bench.point (same as bench loss)."""
    if device != "meta":
        from topkd.bench.point import make_inputs as real

        return real("fused", n, vocab, hidden, k, dtype, torch.device(device))
    x = torch.empty(n, hidden, dtype=dtype, device="meta", requires_grad=True)
    w = torch.empty(vocab, hidden, dtype=dtype, device="meta", requires_grad=True)
    ids = torch.empty(n, k, dtype=torch.int32, device="meta")
    return {"x": x, "w": w, "ids": ids, "logprobs": torch.empty(n, k, dtype=torch.float32, device="meta")}


def trace_impl(impl: str, n: int, vocab: int, hidden: int, k: int, dtype: torch.dtype, device: str = "meta"):
    """(ops, peak bytes including the inputs) of one forward+backward of impl at these shapes.
    "fused:torch" is impl="fused" with its torch kernels (the reference) where it would pick Triton."""
    with fused_kernels(impl) as impl:
        return _trace(impl, n, vocab, hidden, k, dtype, device)


def _trace(impl: str, n: int, vocab: int, hidden: int, k: int, dtype: torch.dtype, device: str):
    inputs = make_inputs(n, vocab, hidden, k, dtype, device)
    input_bytes = sum(t.numel() * t.element_size() for t in inputs.values())
    call = lambda: topkd.fused_linear_kd(inputs["x"], inputs["w"], inputs["ids"], inputs["logprobs"],  # noqa: E731
                                         impl=impl).backward()
    if device != "meta":  # steady state, as bench loss times it: the CPU chunk workspace already exists
        call()
        inputs["x"].grad = inputs["w"].grad = None
    with OpTrace() as trace:
        call()
    return trace.ops, trace.peak_bytes + input_bytes


def point(impl: str, n: int, vocab: int, hidden: int, k: int, dtype: torch.dtype, profile: DeviceProfile,
          ops: list[Op] | None = None, peak: int | None = None) -> dict:
    """One predicted point: time, TFLOP/s at 6NVH, ratio to the three-GEMM floor, peak memory."""
    if ops is None:
        ops, peak = trace_impl(impl, n, vocab, hidden, k, dtype)
    flops = 6 * n * vocab * hidden
    pred = predict(ops, profile)
    floor = flops / profile.gemm_flops[str(dtype).replace("torch.", "")]
    return {"impl": impl, "tokens": n, "predicted_s": pred["seconds"], "tflops": flops / pred["seconds"] / 1e12,
            "over_floor": pred["seconds"] / floor, "peak_bytes": peak, "fits": peak <= profile.memory_bytes,
            "by_kind": pred["by_kind"], "ops": pred["ops"]}


@contextlib.contextmanager
def fused_kernels(impl: str):
    """Benchmarks name "fused:torch" for impl="fused" forced to its torch kernels (TOPKD_FUSED_KERNELS=torch):
    sets that for the block and yields the impl to call ("fused"); a plain name passes through."""
    name, _, kernels = impl.partition(":")
    old = os.environ.get(KERNELS_ENV)
    if kernels:
        os.environ[KERNELS_ENV] = kernels
    try:
        yield name
    finally:
        os.environ.pop(KERNELS_ENV, None) if old is None else os.environ.__setitem__(KERNELS_ENV, old)


def timed_median(fn, repeats: int = 3) -> float:
    fn()  # warm
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@dataclass
class ModelBenchConfig:
    lengths: list[int] = field(default_factory=list)
    impls: list[str] = field(default_factory=list)
    vocab: int = 0
    hidden: int = 0
    k: int = 100
    dtype: str = ""
    device: str = "h200"
    gemm_tflops: float = 0.0
    bandwidth_tbs: float = 0.0
    calibrate: bool = False
    out: str = ""


MODEL_BENCH_HELP = {
    "lengths": "token counts (default: 8K..256K; with --calibrate 1K..8K)",
    "impls": "impls to model (default: fused,fused:torch,chunked,dense; fused:torch = fused with its torch "
             "kernels where it would pick Triton; with --calibrate fused,chunked,dense)",
    "vocab": "vocabulary size (default: 201088; with --calibrate 32768, as bench loss on CPU)",
    "hidden": "hidden size (default: 2880; with --calibrate 512)",
    "k": "teacher top-K",
    "dtype": "input dtype (default: bfloat16; with --calibrate float32)",
    "device": "device profile to predict for: h200 (or any name, with --gemm-tflops and --bandwidth-tbs)",
    "gemm_tflops": "another device: its dense bf16 GEMM rate in TFLOP/s (fp32 GEMMs at half); 0: the profile's",
    "bandwidth_tbs": "another device: its memory bandwidth in TB/s; 0: the profile's",
    "calibrate": "measure this CPU's profile and compare the model with `bench loss` here, every impl",
    "out": "output directory (default: benchmarks/results/model-DEVICE or model-cpu-calibration)",
}
PREDICT_DEFAULTS = dict(lengths=[8192, 32768, 131072, 262144], impls=["fused", "fused:torch", "chunked", "dense"],
                        vocab=201088, hidden=2880, dtype="bfloat16")
CALIBRATE_DEFAULTS = dict(lengths=[1024, 2048, 4096, 8192], impls=["fused", "chunked", "dense"], vocab=32768,
                          hidden=512, dtype="float32", out="benchmarks/results/model-cpu-calibration")
PROFILES = {"h200": H200}


def with_defaults(cfg: ModelBenchConfig) -> ModelBenchConfig:
    predict_out = f"benchmarks/results/model-{cfg.device}"
    base = CALIBRATE_DEFAULTS if cfg.calibrate else {**PREDICT_DEFAULTS, "out": predict_out}
    values = {k: v for k, v in vars(cfg).items() if v not in ([], 0, "")}
    if not cfg.calibrate and cfg.device not in PROFILES and not (cfg.gemm_tflops > 0 and cfg.bandwidth_tbs > 0):
        raise ValueError(f"--device: expected one of {sorted(PROFILES)}, got {cfg.device!r}; for another machine "
                         "pass its --gemm-tflops and --bandwidth-tbs too (or add a DeviceProfile to PROFILES)")
    return ModelBenchConfig(**{**base, **values})


def profile_for(cfg: ModelBenchConfig) -> DeviceProfile:
    """The named profile, with the rates given on the command line in place of its own (an unnamed device
    starts from the H200's launch cost and cache size)."""
    base = PROFILES.get(cfg.device, H200)
    if not (cfg.gemm_tflops or cfg.bandwidth_tbs):
        return base
    bf16 = cfg.gemm_tflops * 1e12 if cfg.gemm_tflops else base.gemm_flops["bfloat16"]
    return dataclasses.replace(base, name=cfg.device, bandwidth=cfg.bandwidth_tbs * 1e12 or base.bandwidth,
                               gemm_flops={"bfloat16": bf16, "float16": bf16, "float32": bf16 / 2,
                                           "float64": base.gemm_flops["float64"]},
                               note=f"given on the command line: {bf16 / 1e12:g} TFLOP/s bf16, "
                                    f"{(cfg.bandwidth_tbs * 1e12 or base.bandwidth) / 1e12:g} TB/s")


def predict_points(cfg: ModelBenchConfig) -> list[dict]:
    """Every (impl, length) traced on meta tensors and priced on the profile; a refused impl is a row."""
    rows = []
    for n in cfg.lengths:
        for impl in cfg.impls:
            try:
                rows.append(point(impl, n, cfg.vocab, cfg.hidden, cfg.k, getattr(torch, cfg.dtype),
                                  profile_for(cfg)))
            except (ValueError, ImportError) as e:
                rows.append({"impl": impl, "tokens": n, "error": str(e)[:200]})
    return rows


def table(rows: list[dict]) -> str:
    head = f"{'impl':<12} {'tokens':>7} {'predicted s':>11} {'TFLOP/s':>8} {'/floor':>7} {'peak GiB':>9}  slowest"
    lines = [head, "-" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['impl']:<12} {r['tokens']:>7}  error: {r['error'][:80]}")
            continue
        kind = max(r["by_kind"], key=r["by_kind"].get)
        fit = "" if r["fits"] else " (does not fit)"
        lines.append(f"{r['impl']:<12} {r['tokens']:>7} {r['predicted_s']:>11.4f} {r['tflops']:>8.1f} "
                     f"{r['over_floor']:>7.2f} {r['peak_bytes'] / 2**30:>9.2f}  {kind}{fit}")
    return "\n".join(lines)


def run_model_bench(cfg: ModelBenchConfig) -> dict:
    """Predict (default) or calibrate; write model.json / calibration.json and a plot under cfg.out."""
    import json
    import os

    from topkd.progress import wrote
    from topkd.stamp import stamp

    cfg = with_defaults(cfg)
    os.makedirs(cfg.out, exist_ok=True)
    if cfg.calibrate:
        summary = _calibration(cfg)
        name = "calibration"
    else:
        rows = predict_points(cfg)
        print(table(rows))
        summary = {"bench": "model", "config": vars(cfg), "profile": {**vars(profile_for(cfg))},
                   "points": rows}
        name = "model"
        _plot_predictions(rows, cfg, os.path.join(cfg.out, "model.png"))
    summary["stamp"] = stamp("cpu")
    with open(os.path.join(cfg.out, f"{name}.json"), "w") as f:
        json.dump(summary, f, indent=1, default=str)
    print(json.dumps({"bench": "model", "out": cfg.out, "calibrate": cfg.calibrate}, default=str))
    wrote("bench model", f"{name}.json and {name}.png in {cfg.out}")
    return summary


def _calibration(cfg: ModelBenchConfig) -> dict:
    import os

    from topkd.bench.calibrate import calibrate, calibration_table, plot_calibration
    from topkd.bench.loss import LossBenchConfig, run_point

    # five timed runs per point (median): on 2 shared cores one run of a GiB-sized baseline can be 30% off
    bench = LossBenchConfig(vocab=cfg.vocab, hidden=cfg.hidden, k=cfg.k, dtype=cfg.dtype, no_huge_pages=True,
                            repeats=5)
    summary = calibrate(cfg.lengths, cfg.impls, cfg.vocab, cfg.hidden, cfg.k,
                        lambda impl, n: run_point(bench, impl, n))
    summary["config"] = vars(cfg)
    print(calibration_table(summary["points"]))
    plot_calibration(summary["points"], os.path.join(cfg.out, "calibration.png"))
    return summary


def _plot_predictions(rows: list[dict], cfg: ModelBenchConfig, path: str) -> None:
    from topkd.bench.common import plot_vs_length

    series = {}
    for impl in cfg.impls:
        ok = [r for r in rows if r["impl"] == impl and "error" not in r]
        series[impl] = ([r["tokens"] for r in ok], [r["peak_bytes"] / 2**30 for r in ok],
                        [r["predicted_s"] for r in ok])
    plot_vs_length(series, {}, ("predicted peak memory (GiB)", "predicted forward+backward (s)"),
                   f"PREDICTED by the cost model for {cfg.device}: V={cfg.vocab} H={cfg.hidden} {cfg.dtype}", path)
