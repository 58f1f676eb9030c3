"""topkd.loss.gemm: fp32-output GEMMs where the device has them, the same results through the fallback."""

import pytest
import torch

from topkd.loss import gemm


def test_probe_answers_per_device():
    assert gemm.fp32_out(torch.device("meta")) is True
    assert gemm.fp32_out(torch.device("cpu")) is False  # no out_dtype kernels on CPU: the fallback


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_project_and_accumulate_match_float64(dtype):
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(37, 16, generator=g).to(dtype), torch.randn(20000, 16, generator=g).to(dtype)
    bias = torch.randn(20000, generator=g).to(dtype)
    out = torch.empty(37, 20000)
    gemm.project(x, w, bias, out)  # > one vocabulary block of 8192 on a CPU
    want = x.double() @ w.double().t() + bias.double()
    # the CPU fallback rounds to bf16
    torch.testing.assert_close(
        out.double(),
        want,
        rtol=2e-2 if dtype == torch.bfloat16 else 1e-5,
        atol=5e-2 if dtype == torch.bfloat16 else 1e-5,
    )
    acc = torch.full((20000, 16), float("nan"))  # beta=0 on the first call: never read
    dz = torch.randn(37, 20000, generator=g).to(dtype)
    gemm.accumulate(acc, dz.t(), x, first=True)
    gemm.accumulate(acc, dz.t(), x, first=False)
    # the CPU fallback rounds each product to bf16 before accumulating
    low = dtype == torch.bfloat16
    torch.testing.assert_close(
        acc.double(),
        2 * dz.double().t() @ x.double(),
        rtol=2e-2 if low else 1e-4,
        atol=2e-1 if low else 1e-3,
    )
