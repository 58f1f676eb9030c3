"""One benchmark point, meant to run in a fresh process: peak memory, median time, GEMM floor.

    python -m topkd.bench.point --impl fused --tokens 4096 --vocab 32768 --hidden 512

Prints one JSON line. Peak memory on CPU is VmHWM after writing 5 to /proc/self/clear_refs,
minus the process's RSS before any input existed (so inputs, gradients and temporaries
count, the Python runtime does not); on CUDA, max_memory_allocated, and beside it
max_memory_reserved (what the caching allocator held: that, not the allocated peak, decides an
OOM near the device's capacity). The first (measured)
run also warms up; then --repeats pairs of (three-GEMM floor, impl) runs are timed,
interleaved so both see the same machine, and each time is the median of its runs. The
floor is logits, dX and dW over the same chunk rows, into reused buffers.
An allocation failure is a result ("oom"), not a crash: on CPU the address space is capped
with RLIMIT_AS so the allocator fails cleanly instead of waking the OOM killer.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import statistics
import time

import torch

import topkd
from topkd.base.memory import reserved_peak_bytes, status_kib
from topkd.bench.common import measured
from topkd.loss import chunk_rows

KD_IMPLS = ("fused", "chunked", "dense")
# Triton kernels (CUDA), and fused forced to its torch kernels where it would pick Triton: never in a CPU
# sweep's defaults
GPU_IMPLS = ("triton", "fused:torch")
PEERS = ("liger_jsd", "torch_lce")


class PeakMemory:
    """Peak bytes above a baseline taken at construction (CPU: VmHWM; CUDA: allocator peak)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.base = torch.cuda.memory_allocated() if self.cuda else status_kib("VmRSS") * 1024

    def reset(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        else:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")

    def peak(self) -> int:
        if self.cuda:
            return torch.cuda.max_memory_allocated() - self.base
        return status_kib("VmHWM") * 1024 - self.base

    def reserved(self) -> dict:
        """{"peak_reserved_bytes": the allocator's reserved peak since reset()} on CUDA (absolute: the process's
        whole pool), {} elsewhere."""
        reserved = reserved_peak_bytes(torch.device("cuda")) if self.cuda else None
        return {} if reserved is None else {"peak_reserved_bytes": int(reserved)}


def peer_problem(impl: str) -> str | None:
    """Why a peer cannot run in this environment (None: it can), found without importing it."""
    if impl == "liger_jsd" and importlib.util.find_spec("liger_kernel") is None:
        return "liger-kernel is not installed (on the GPU machine: carry its wheel in .whl/)"
    if impl == "torch_lce" and not hasattr(torch.nn.functional, "linear_cross_entropy"):
        return f"torch {torch.__version__} has no torch.nn.functional.linear_cross_entropy (torch >= 2.12)"
    return None


def teacher_rows(n: int, vocab: int, k: int, device, seed: int = 0):
    """Synthetic top-K rows (ids int32, log-probs fp32, sorted), built a block at a time on the device
    (on a GPU, drawing 256K x 201K normals on the CPU would take minutes)."""
    device = torch.device(device)
    g = torch.Generator(device=device).manual_seed(seed)
    ids = torch.empty(n, k, dtype=torch.int32, device=device)
    logprobs = torch.empty(n, k, dtype=torch.float32, device=device)
    block = 512 if device.type == "cpu" else 8192
    for start in range(0, n, block):
        end = min(start + block, n)
        logits = torch.randn(end - start, vocab, generator=g, device=device) * 3
        top = torch.log_softmax(logits, -1).topk(k, dim=-1)
        ids[start:end], logprobs[start:end] = top.indices.to(torch.int32), top.values
    return ids, logprobs


def make_inputs(impl: str, n: int, vocab: int, hidden: int, k: int, dtype, device) -> dict:
    """Inputs drawn on the device itself (a CPU draw of 256K x 2,880 normals takes ~10 s per process)."""
    device = torch.device(device)
    g = torch.Generator(device=device).manual_seed(1)

    def draw(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device=device) * scale).to(dtype)

    x = draw(n, hidden).requires_grad_()
    w = draw(vocab, hidden, scale=hidden**-0.5).requires_grad_()
    inputs = {"x": x, "w": w}
    if impl.split(":")[0] in KD_IMPLS + GPU_IMPLS:
        inputs["ids"], inputs["logprobs"] = teacher_rows(n, vocab, k, device)
    elif impl == "liger_jsd":
        inputs["xt"] = draw(n, hidden)
        inputs["wt"] = draw(vocab, hidden, scale=3 * hidden**-0.5)
    if impl in PEERS:
        inputs["labels"] = torch.randint(0, vocab, (n,), generator=g, device=device)
    return inputs


def floor_bytes(inputs: dict) -> int:
    """Memory floor: X, W, dX, dW and the teacher rows (or the peer's teacher/labels)."""
    total = 0
    for name, t in inputs.items():
        total += t.numel() * t.element_size() * (2 if name in ("x", "w") else 1)
    return total


def step_fn(impl: str, inputs: dict):
    """A closure running one forward+backward."""
    x, w = inputs["x"], inputs["w"]
    # "fused:torch": main() set TOPKD_FUSED_KERNELS=torch
    if impl.split(":")[0] in KD_IMPLS + GPU_IMPLS:
        return lambda: topkd.fused_linear_kd(
            x, w, inputs["ids"], inputs["logprobs"], impl=impl.split(":")[0]
        ).backward()
    if impl == "liger_jsd":
        from liger_kernel.chunked_loss import LigerFusedLinearJSDLoss

        peer = LigerFusedLinearJSDLoss(
            weight_hard_loss=0.0, weight_soft_loss=1.0, beta=0.0, compiled=False
        )
        return lambda: peer(x, w, inputs["xt"], inputs["wt"], inputs["labels"]).backward()
    if impl == "torch_lce":
        problem = peer_problem(impl)
        if problem:  # recorded as "unavailable"
            raise ImportError(problem)
        return lambda: torch.nn.functional.linear_cross_entropy(x, w, inputs["labels"]).backward()
    raise ValueError(f"impl: expected one of {KD_IMPLS + GPU_IMPLS + PEERS}, got {impl!r}")


def three_gemm_step(x: torch.Tensor, w: torch.Tensor, chunk: int):
    """Logits, dX and dW over chunks of `chunk` rows into reused buffers: the 6NVH floor."""
    x, w = x.detach(), w.detach()
    buf = torch.empty(min(chunk, x.shape[0]), w.shape[0], dtype=x.dtype, device=x.device)
    dx, dw = torch.empty_like(x), torch.zeros_like(w)

    def step():
        for start in range(0, x.shape[0], chunk):
            end = min(start + chunk, x.shape[0])
            z = buf[: end - start]
            torch.mm(x[start:end], w.t(), out=z)
            torch.mm(z, w, out=dx[start:end])
            dw.addmm_(z.t(), x[start:end])

    return step


def timed(fn, device) -> float:
    """Seconds for one call of fn (device-synchronised)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def measure(
    impl: str,
    n: int,
    vocab: int,
    hidden: int,
    k: int,
    dtype_name: str,
    device_name: str,
    repeats: int,
    phase: str = "both",
) -> dict:
    device, dtype = torch.device(device_name), getattr(torch, dtype_name)
    # A tiny run of the same code first: thread pools, lazy inits and library code pages
    # touched on first use must not count as the loss's memory.
    warm = make_inputs(impl, 64, vocab, hidden, k, dtype, device)
    step_fn(impl, warm)()
    three_gemm_step(warm["x"], warm["w"], 32)()
    del warm
    topkd.loss.release_workspace()  # the warm-up's cached chunk buffer must not sit in the baseline
    memory = PeakMemory(device)
    inputs = make_inputs(impl, n, vocab, hidden, k, dtype, device)
    step = step_fn(impl, inputs)
    row = {
        "impl": impl,
        "tokens": n,
        "vocab": vocab,
        "hidden": hidden,
        "k": k,
        "dtype": dtype_name,
        "floor_bytes": floor_bytes(inputs),
        "flops": 6 * n * vocab * hidden,
    }
    memory.reset()
    step()  # measured (phase memory/both) or only a warm-up (phase time)
    if phase != "time":
        row.update(peak_bytes=memory.peak(), **memory.reserved())
    inputs["x"].grad = inputs["w"].grad = None
    if phase == "memory":
        return row
    chunk = chunk_rows(vocab, dtype, device_type=device.type)
    floor = three_gemm_step(inputs["x"], inputs["w"], chunk)
    pairs = [
        (timed(floor, device), timed(lambda: _fresh_grads(step, inputs), device))
        for _ in range(repeats)
    ]
    # interleaved: both see the same drift
    row["floor_time_s"] = statistics.median(p[0] for p in pairs)
    row["time_s"] = statistics.median(p[1] for p in pairs)
    row["chunk_rows"] = chunk
    return row


def _fresh_grads(step, inputs) -> None:
    inputs["x"].grad = inputs["w"].grad = None
    step()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--impl", required=True, choices=KD_IMPLS + GPU_IMPLS + PEERS)
    p.add_argument("--tokens", type=int, help="one point")
    p.add_argument(
        "--lengths",
        default="",
        help="comma-separated: several points in this process, one JSON "
        "line each, shortest first (GPU sweeps); after an OOM the longer ones are not run",
    )
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--k", type=int, default=100)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument(
        "--mem-limit-gib", type=float, default=0.0, help="CPU address-space cap (0: none)"
    )
    p.add_argument(
        "--phase", default="both", choices=["both", "memory", "time"], help="what to measure"
    )
    a = p.parse_args(argv)
    if a.mem_limit_gib > 0 and a.device == "cpu":
        cap = int(a.mem_limit_gib * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    if ":" in a.impl:
        os.environ["TOPKD_FUSED_KERNELS"] = a.impl.partition(":")[2]
    for n in [int(v) for v in a.lengths.split(",") if v] or [a.tokens]:
        row = one_point(a, n)
        print(json.dumps(row), flush=True)
        if row["status"] == "oom":
            break
        if a.device.startswith("cuda"):
            torch.cuda.empty_cache()


def one_point(a, n: int) -> dict:
    """measure() as a result row: a missing peer is "unavailable", an allocation failure "oom"."""
    try:
        row = measured(
            lambda: measure(
                a.impl, n, a.vocab, a.hidden, a.k, a.dtype, a.device, a.repeats, a.phase
            )
        )
    except ImportError as e:  # a peer that is not installed
        return {"impl": a.impl, "tokens": n, "status": "unavailable", "error": str(e)[:200]}
    return {"impl": a.impl, "tokens": n, **row}


if __name__ == "__main__":
    main()
