"""impl="triton" on this CPU through Triton's interpreter (TRITON_INTERPRET=1, set in tests/conftest.py).

Its reference is impl="fused" (the torch per-chunk math, itself tested against the float64 oracle):
same loss and gradients in fp32 across divergences, tails, temperatures, reductions, CE, K=1, K=V,
masks and an all-masked batch, on N=37, V=101 with chunks of 8 (odd on purpose); then bf16 inputs.
"""

import pytest
import torch

import topkd
from tests.loss.oracle import make_problem
from tests.loss.test_agreement import assert_all_close, run, topkd_fn
from topkd.loss import triton_chunk

pytestmark = pytest.mark.skipif(
    triton_chunk.available() is not None, reason=str(triton_chunk.available())
)

CASES = [  # (divergence, tail, temperature, reduction, ce_weight)
    ("kl", "bucket", 1.0, "mean", 0.0),
    ("kl", "bucket", 1.0, "sum", 0.3),
    ("kl", "renorm", 2.0, "none", 0.0),
    ("reverse_kl", "bucket", 2.0, "mean", 0.0),
    ("jsd", "bucket", 0.5, "none", 0.0),
    ("tvd", "renorm", 1.0, "mean", 0.5),
]


def kwargs(pb, tail, temperature, ce_weight, mask=True):
    kw = dict(ids=pb["ids"], logprobs=pb["logprobs"].float(), tail=tail, temperature=temperature)
    if mask:
        kw["mask"] = pb["mask"]
    if tail == "bucket" and temperature != 1.0:
        kw["teacher_logz"] = pb["logz"][temperature].float()
    if ce_weight:
        kw.update(labels=pb["labels"], ce_weight=ce_weight)
    return kw


@pytest.mark.parametrize("divergence,tail,temperature,reduction,ce_weight", CASES)
def test_triton_matches_the_torch_path(divergence, tail, temperature, reduction, ce_weight):
    pb = make_problem(dtype=torch.float32)
    kw = dict(kwargs(pb, tail, temperature, ce_weight), divergence=divergence)
    assert_all_close(
        run(topkd_fn("triton"), pb, reduction, **kw),
        run(topkd_fn("fused"), pb, reduction, **kw),
        atol=2e-6,
        rtol=2e-5,
    )


@pytest.mark.parametrize("k", [1, 101])
def test_triton_k_extremes_and_all_masked(k):
    pb = make_problem(k=k, dtype=torch.float32)
    kw = kwargs(pb, "bucket", 1.0, 0.0)
    assert_all_close(
        run(topkd_fn("triton"), pb, "mean", **kw),
        run(topkd_fn("fused"), pb, "mean", **kw),
        atol=2e-6,
        rtol=2e-5,
    )
    kw["mask"] = torch.zeros_like(pb["mask"])
    loss, dx, dw, db = run(topkd_fn("triton"), pb, "mean", **kw)
    assert float(loss) == 0.0 and not dx.any() and not dw.any() and not db.any()


def test_triton_bf16_matches_fused_bf16():
    pb = make_problem(dtype=torch.bfloat16, bias=False)
    kw = kwargs(pb, "bucket", 1.0, 0.2)
    got, want = run(topkd_fn("triton"), pb, "mean", **kw), run(topkd_fn("fused"), pb, "mean", **kw)
    for g, w in zip(got[:3], want[:3]):
        torch.testing.assert_close(g.float(), w.float(), atol=1e-2, rtol=1e-2)


def test_triton_refuses_what_its_kernels_do_not_compute(monkeypatch):
    pb = make_problem()

    def call(**kw):
        return topkd.fused_linear_kd(
            pb["x"].float(), pb["w"].float(), pb["ids"], pb["logprobs"].float(), impl="triton", **kw
        )

    with pytest.raises(ValueError, match="untempered softmax"):
        call(labels=pb["labels"], ce_weight=0.1, temperature=2.0, tail="renorm")
    with pytest.raises(ValueError, match="got float64; use impl='fused'"):
        topkd.fused_linear_kd(pb["x"], pb["w"], pb["ids"], pb["logprobs"], impl="triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="expected CUDA tensors, got cpu"):
        call()
