"""A cost model of the loss: trace one call of each impl, price every op on a named device.

    predict_point("fused", 32768, 201088, 2880, 100, torch.bfloat16, H200)   # predicted time, TFLOP/s, peak of one call

`topkd bench model` (topkd/bench/model_command.py) runs it for predictions, and against this machine's
`bench loss` with --calibrate (topkd/bench/calibrate.py).

Each impl runs forward+backward once under topkd.base.trace.OpTrace: on meta tensors (shapes only, any
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
import os
import statistics
import time
from dataclasses import dataclass, field

import torch

import topkd
from topkd.base.trace import Op, OpTrace
from topkd.loss import KERNELS_ENV


@dataclass
class DeviceProfile:
    """What a device does per second. gemm_rate may be refined per GEMM shape (measured CPU profiles)."""

    name: str
    gemm_flops: dict[str, float]  # input dtype -> FLOP/s
    bandwidth: float  # DRAM bytes/s
    op_overhead_s: float  # fixed cost per op
    # op kind -> seconds per element (CPU engines)
    element_s: dict[str, float] = field(default_factory=dict)
    cache_bytes: int = 0  # footprints below this never reach DRAM
    # GPU: launches run ahead, so an op costs max(launch, work); CPU: launch + work
    launch_overlaps: bool = True
    gemm_shapes: dict = field(default_factory=dict)  # (m, k, n, dtype) -> measured FLOP/s (CPU)
    # first touch of freshly mapped memory (CPU; a GPU's caching allocator: 0)
    fault_s_per_byte: float = 0.0
    memory_bytes: float = float("inf")
    note: str = ""

    def gemm_rate(self, op: Op) -> float:
        return self.gemm_shapes.get(op.shape, self.gemm_flops[op.dtype])


H200 = DeviceProfile(
    name="h200",
    gemm_flops={"bfloat16": 790e12, "float16": 790e12, "float32": 395e12, "float64": 60e12},
    bandwidth=4.3e12,
    op_overhead_s=4e-6,
    cache_bytes=50 * 2**20,
    memory_bytes=139 * 2**30,
    note="assumed: bf16 dense GEMM 790 TFLOP/s and 4.3 TB/s as measured on such machines; fp32 GEMMs at TF32 "
    "(half the bf16 rate); 4 us per kernel launch, hidden under longer kernels",
)


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
    return {
        "x": x,
        "w": w,
        "ids": ids,
        "logprobs": torch.empty(n, k, dtype=torch.float32, device="meta"),
    }


def trace_impl(
    impl: str, n: int, vocab: int, hidden: int, k: int, dtype: torch.dtype, device: str = "meta"
):
    """(ops, peak bytes including the inputs) of one forward+backward of impl at these shapes.
    "fused:torch" is impl="fused" with its torch kernels (the reference) where it would pick Triton."""
    with fused_kernels(impl) as impl:
        return _trace(impl, n, vocab, hidden, k, dtype, device)


def _trace(impl: str, n: int, vocab: int, hidden: int, k: int, dtype: torch.dtype, device: str):
    inputs = make_inputs(n, vocab, hidden, k, dtype, device)
    input_bytes = sum(t.numel() * t.element_size() for t in inputs.values())

    def call() -> None:
        topkd.fused_linear_kd(
            inputs["x"], inputs["w"], inputs["ids"], inputs["logprobs"], impl=impl
        ).backward()

    # steady state, as bench loss times it: the CPU chunk workspace already exists
    if device != "meta":
        call()
        inputs["x"].grad = inputs["w"].grad = None
    with OpTrace() as trace:
        call()
    return trace.ops, trace.peak_bytes + input_bytes


def predict_point(
    impl: str,
    n: int,
    vocab: int,
    hidden: int,
    k: int,
    dtype: torch.dtype,
    profile: DeviceProfile,
    ops: list[Op] | None = None,
    peak: int | None = None,
) -> dict:
    """One predicted point: time, TFLOP/s at 6NVH, ratio to the three-GEMM floor, peak memory."""
    if ops is None:
        ops, peak = trace_impl(impl, n, vocab, hidden, k, dtype)
    flops = 6 * n * vocab * hidden
    pred = predict(ops, profile)
    floor = flops / profile.gemm_flops[str(dtype).replace("torch.", "")]
    return {
        "impl": impl,
        "tokens": n,
        "predicted_s": pred["seconds"],
        "tflops": flops / pred["seconds"] / 1e12,
        "over_floor": pred["seconds"] / floor,
        "peak_bytes": peak,
        "fits": peak <= profile.memory_bytes,
        "by_kind": pred["by_kind"],
        "ops": pred["ops"],
    }


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
        os.environ.pop(KERNELS_ENV, None) if old is None else os.environ.__setitem__(
            KERNELS_ENV, old
        )


def timed_median(fn, repeats: int = 3) -> float:
    fn()  # warm
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
