"""impl="triton": the two full-width passes of the per-chunk math as Triton kernels (GPU; CPU tests interpret).

The torch path (topkd.loss.chunk) walks the [C, V] logits block about seven times (max, subtract,
scale, exp, zero the ids, sum; then scale and scatter for dL/dz). Here the teacher ids are first
set to -inf (a [C, K] scatter), then
  tail_stats: one read of the block -> per row the max m' and sum exp((z - m')/T) of the tail
              (online softmax over vocabulary tiles; the ids, at -inf, add nothing, so the tail
              is summed directly, never as total minus ids, exactly as the torch path does);
  tail_grad:  one read + one write -> z <- exp((z - m)/T) * coef[row] (0 at the ids, which the
              caller then overwrites with their own gradient, a [C, K] scatter).
Everything of size [C] or [C, K] stays in torch and is shared with the torch path, which is the
reference (tests/loss/test_triton.py compares them under TRITON_INTERPRET=1, on CPU).
Not covered (refused in validation, with the remedy): hard-label CE at T != 1 (it needs a second,
untempered softmax) and vocab-parallel shards.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

# PEP 440 comparisons of any version string (not only torch's)
from torch.torch_version import TorchVersion

from topkd.base import trace
from topkd.loss.chunk import Kernels

try:
    import triton
    import triton.language as tl
except ImportError:  # the error for users comes from available()
    triton = None

BLOCK_V = 4096  # vocabulary tile per loop step (one config: the interpreter cannot autotune)


def available() -> str | None:
    """None when impl="triton" can run here, else why not (with the remedy)."""
    if triton is None:
        return (
            "Triton is not installed; pip install the triton your torch pairs with (CUDA machines), or use "
            "impl='fused'"
        )
    return interpreter_problem()


def check_inputs(dtype: torch.dtype, ce_weight: float, temperature: float) -> None:
    """impl="triton" covers what its kernels compute; everything else is refused with the remedy."""
    problem = available()
    if not problem and dtype == torch.float64:
        problem = "expected fp32/bf16/fp16 inputs (the kernels compute in fp32), got float64; use impl='fused'"
    if not problem and ce_weight > 0 and temperature != 1.0:
        problem = (
            f"hard-label CE at temperature={temperature} needs a second, untempered softmax the kernels "
            "do not compute; use impl='fused', or ce_weight=0"
        )
    if problem:
        raise ValueError(f"impl='triton': {problem}")


def interpreter_problem() -> str | None:
    """Triton before 3.7 interprets kernels (TRITON_INTERPRET=1, on a CPU) with numpy calls that numpy 2.4 made
    errors ("only 0-dimensional arrays can be converted to Python scalars"): say so instead of failing inside."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return None
    import numpy

    if TorchVersion(triton.__version__) < (3, 7) and TorchVersion(numpy.__version__) >= (2, 4):
        return (
            f"Triton {triton.__version__}'s interpreter (TRITON_INTERPRET=1) fails with numpy {numpy.__version__}"
            " (>= 2.4); to run the kernels on a CPU use numpy < 2.4 or triton >= 3.7 (a GPU needs neither)"
        )
    return None


def check_device(z: Tensor) -> None:
    if (
        z.device.type != "cuda"
        and os.environ.get("TRITON_INTERPRET") != "1"
        and not trace.tracing_meta(z)
    ):
        raise ValueError(
            f"impl='triton': expected CUDA tensors, got {z.device}; use impl='fused' on CPU "
            "(TRITON_INTERPRET=1 runs the kernels on CPU for tests only)"
        )


if triton is not None:

    @triton.jit
    def _tail_stats_kernel(z_ptr, max_ptr, sum_ptr, stride, vocab, inv_t, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        base = z_ptr + row.to(tl.int64) * stride
        run_max = tl.full([BLOCK], float("-inf"), tl.float32)
        run_sum = tl.zeros([BLOCK], tl.float32)
        for start in range(0, vocab, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            z = tl.load(base + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
            new_max = tl.maximum(run_max, z)
            # a lane with only ids so far: sums stay 0
            safe = tl.where(new_max == float("-inf"), 0.0, new_max)
            run_sum = run_sum * tl.exp((run_max - safe) * inv_t) + tl.exp((z - safe) * inv_t)
            run_max = new_max
        row_max = tl.max(run_max, 0)
        safe_row = tl.where(row_max == float("-inf"), 0.0, row_max)
        lane = tl.exp((run_max - safe_row) * inv_t)
        tl.store(max_ptr + row, row_max)
        tl.store(sum_ptr + row, tl.sum(run_sum * lane, 0))

    @triton.jit
    def _tail_grad_kernel(
        z_ptr, out_ptr, max_ptr, coef_ptr, stride, out_stride, vocab, inv_t, BLOCK: tl.constexpr
    ):
        row = tl.program_id(0)
        base = z_ptr + row.to(tl.int64) * stride
        out_base = out_ptr + row.to(tl.int64) * out_stride
        row_max = tl.load(max_ptr + row)
        coef = tl.load(coef_ptr + row)
        for start in range(0, vocab, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < vocab
            z = tl.load(base + cols, mask=mask, other=float("-inf")).to(tl.float32)
            grad = tl.exp((z - row_max) * inv_t) * coef
            tl.store(out_base + cols, grad.to(out_ptr.dtype.element_ty), mask=mask)


def _block(vocab: int) -> int:
    return min(BLOCK_V, triton.next_power_of_2(vocab))


def softmax_stats(z: Tensor, ids: Tensor, temperature: float, vocab=None):
    """As topkd.loss.chunk._softmax_stats (the whole vocabulary only), but z is left as raw logits with -inf at
    the ids (see grad_write)."""
    check_device(z)
    z_ids = z.gather(1, ids)
    z.scatter_(1, ids, float("-inf"))
    n = z.shape[0]
    tail_max = torch.empty(n, dtype=z.dtype, device=z.device)
    tail_sum = torch.empty(n, dtype=z.dtype, device=z.device)
    trace.declare("triton_tail_stats", z.numel() * z.element_size(), 2 * n * 4, z.numel())
    if n and not trace.tracing_meta(z):
        _tail_stats_kernel[(n,)](
            z,
            tail_max,
            tail_sum,
            z.stride(0),
            z.shape[1],
            1.0 / temperature,
            BLOCK=_block(z.shape[1]),
        )
    m = torch.maximum(tail_max, z_ids.amax(dim=1))
    tail_sum = torch.where(
        tail_sum > 0, tail_sum * torch.exp((tail_max - m) / temperature), tail_sum
    )
    z_ids = (z_ids - m.unsqueeze(1)) / temperature
    return m, z_ids, tail_sum, tail_sum + z_ids.exp().sum(dim=1)


def grad_write(
    z: Tensor,
    m: Tensor,
    dense: Tensor,
    ids: Tensor,
    at_ids: Tensor,
    temperature: float,
    out: Tensor,
    vocab=None,
) -> None:
    """out <- exp((z - m)/T) * dense per row (z: raw logits, -inf at ids; out may be z or a bf16 buffer, cast in
    the same pass), then the ids' own gradients."""
    n = z.shape[0]
    trace.declare(
        "triton_tail_grad",
        z.numel() * z.element_size(),
        out.numel() * out.element_size(),
        z.numel(),
    )
    if n and not trace.tracing_meta(z):
        _tail_grad_kernel[(n,)](
            z,
            out,
            m.contiguous(),
            dense.reshape(-1).contiguous(),
            z.stride(0),
            out.stride(0),
            z.shape[1],
            1.0 / temperature,
            BLOCK=_block(z.shape[1]),
        )
    out.scatter_(1, ids, at_ids.to(out.dtype))


TRITON_KERNELS = Kernels("triton", softmax_stats, grad_write)
