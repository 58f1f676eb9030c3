"""bf16 / fp16 / fp32 inputs: error vs float64 no worse than naive same-dtype PyTorch + a per-dtype tolerance.

The float64 oracle sees the same low-precision-rounded inputs, so only arithmetic error is measured.
"""

import pytest
import torch

import topkd
from tests.loss.oracle import make_problem, oracle

TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 2e-3, torch.float32: 1e-5}


def loss_and_grads(fn, pb, dtype):
    # fresh leaves per call
    x, w = (pb[k].to(dtype, copy=True).requires_grad_() for k in ("x", "w"))
    loss = fn(x, w)
    loss.backward()
    return [loss.detach().double(), x.grad.double(), w.grad.double()]


def rel_err(got, want):
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


@pytest.mark.parametrize(
    "divergence,tail",
    [
        ("kl", "bucket"),
        ("kl", "renorm"),
        ("jsd", "bucket"),
        ("reverse_kl", "bucket"),
        ("tvd", "bucket"),
    ],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_low_precision_no_worse_than_naive(dtype, divergence, tail):
    pb = make_problem(n=64, vocab=300, hidden=32, k=10, seed=11, dtype=dtype)
    lp = pb["logprobs"].float()
    kw = dict(mask=pb["mask"], divergence=divergence, tail=tail, labels=pb["labels"], ce_weight=0.2)
    exact = loss_and_grads(lambda x, w: oracle(x, w, None, pb["ids"], lp, **kw), pb, torch.float64)
    naive = loss_and_grads(
        lambda x, w: oracle(x, w, None, pb["ids"], lp, dtype=dtype, **kw), pb, dtype
    )
    for impl in ("fused", "chunked", "dense"):
        got = loss_and_grads(
            lambda x, w: topkd.fused_linear_kd(x, w, pb["ids"], lp, impl=impl, chunk_size=24, **kw),
            pb,
            dtype,
        )
        for name, g, n, e in zip(("loss", "d_hidden", "d_weight"), got, naive, exact):
            assert rel_err(g, e) <= rel_err(n, e) + TOLERANCE[dtype], (
                impl,
                name,
                rel_err(g, e),
                rel_err(n, e),
            )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_soft_capped_low_precision_no_worse_than_naive(dtype):
    """The capped path multiplies dL/dz' by 1 - tanh^2 in fp32 before the cast to the GEMMs' dtype."""
    pb = make_problem(n=64, vocab=300, hidden=32, k=10, seed=12, dtype=dtype)
    lp = pb["logprobs"].float()
    kw = dict(mask=pb["mask"], softcap=3.0, labels=pb["labels"], ce_weight=0.2)
    exact = loss_and_grads(lambda x, w: oracle(x, w, None, pb["ids"], lp, **kw), pb, torch.float64)
    naive = loss_and_grads(
        lambda x, w: oracle(x, w, None, pb["ids"], lp, dtype=dtype, **kw), pb, dtype
    )
    got = loss_and_grads(
        lambda x, w: topkd.fused_linear_kd(x, w, pb["ids"], lp, chunk_size=24, **kw), pb, dtype
    )
    for name, g, n, e in zip(("loss", "d_hidden", "d_weight"), got, naive, exact):
        assert rel_err(g, e) <= rel_err(n, e) + TOLERANCE[dtype], (
            name,
            rel_err(g, e),
            rel_err(n, e),
        )
