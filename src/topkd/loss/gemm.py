"""The loss's GEMMs in the precision it needs: low-precision operands, fp32 outputs and accumulators.

    project(x, weight, bias, out)          # out [C, V] (fp32) = x @ weight.T (+ bias), written by the GEMM
    accumulate(dw, dz.t(), x, first)       # dw (fp32) = / += dz.T @ x, accumulated inside the GEMM

On CUDA the GEMMs take bf16/fp16 operands and write fp32 directly (`out_dtype`, torch >= 2.8): the
logits never pass through a bf16 temporary and dW never through a [V, H] product. Whether this torch
and device support it is probed once per device on a tiny problem; where it does not, a warning says
so and the loss falls back to a low-precision product and a copy (same results, more memory traffic).
On a CPU (no `out_dtype` kernels) the same fallback is used, and the logits GEMM runs in vocabulary
blocks (MKL allocates ~20 MB of packing space for one GEMM over all of V; 8K columns need ~9 MB).
"""

from __future__ import annotations

import functools
import warnings

import torch
from torch import Tensor

PROJECT_VOCAB_BLOCK = 8192


@functools.cache
def fp32_out(device: torch.device) -> bool:
    """Whether mm/addmm with out_dtype=float32 from bf16 operands work here (meta: yes, CPU: no)."""
    if device.type == "meta":
        return True
    if device.type != "cuda":
        return False
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(64, 40, device=device, generator=g).to(torch.bfloat16)
    b = torch.randn(40, 48, device=device, generator=g).to(torch.bfloat16)
    acc = torch.randn(64, 48, device=device, generator=g)
    want = acc + a.float() @ b.float()
    try:
        z = torch.mm(a, b, out_dtype=torch.float32)
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    except (RuntimeError, TypeError) as e:
        warnings.warn(
            f"topkd loss: this torch ({torch.__version__}) has no fp32-output bf16 GEMMs on {device} "
            f"({str(e).splitlines()[0][:120]}); falling back to bf16 products and copies (slower, more "
            "memory traffic). torch >= 2.8 has them.",
            stacklevel=2,
        )
        return False
    ok = torch.allclose(z, a.float() @ b.float(), atol=1e-3) and torch.allclose(
        acc, want, atol=1e-3
    )
    if not ok:
        warnings.warn(
            f"topkd loss: fp32-output GEMMs on {device} gave wrong results in a self-test; falling "
            "back to bf16 products and copies",
            stacklevel=2,
        )
    return ok


def project(x: Tensor, weight: Tensor, bias: Tensor | None, out: Tensor) -> Tensor:
    """out = x @ weight.T (+ bias), out in the compute dtype (fp32/fp64), x and weight in theirs."""
    if x.dtype != out.dtype and fp32_out(x.device):
        torch.mm(x, weight.t(), out_dtype=out.dtype, out=out)
    elif x.dtype != out.dtype:
        out.copy_(x @ weight.t())
    elif x.device.type != "cpu":
        torch.mm(x, weight.t(), out=out)
    else:
        for a in range(0, weight.shape[0], PROJECT_VOCAB_BLOCK):
            torch.mm(
                x, weight[a : a + PROJECT_VOCAB_BLOCK].t(), out=out[:, a : a + PROJECT_VOCAB_BLOCK]
            )
    if bias is not None:
        out.add_(bias)
    return out


def accumulate(acc: Tensor, a: Tensor, b: Tensor, first: bool) -> None:
    """acc = a @ b (first) or acc += a @ b, accumulating in acc's dtype. beta=0 on the first call: the
    uninitialised buffer is never read."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b, beta=0.0 if first else 1.0)
    elif fp32_out(acc.device):
        torch.addmm(acc, a, b, out_dtype=acc.dtype, beta=0.0 if first else 1.0, out=acc)
    else:
        product = a @ b
        acc.copy_(product) if first else acc.add_(product)
