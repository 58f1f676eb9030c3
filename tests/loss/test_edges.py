"""Edge cases: all-masked batches, grad modes (no_grad, frozen hidden), the nn.Module, output dtypes."""

import pytest
import torch

import topkd
from tests.loss.oracle import make_problem, oracle


@pytest.mark.parametrize("impl", ["fused", "chunked", "dense"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_masked_gives_zero_loss_and_zero_grads(impl, reduction):
    pb = make_problem(n=10, seed=4)
    x, w, b = (pb[k].clone().requires_grad_() for k in ("x", "w", "b"))
    loss = topkd.fused_linear_kd(
        x,
        w,
        pb["ids"],
        pb["logprobs"],
        bias=b,
        mask=torch.zeros(10, dtype=torch.bool),
        labels=pb["labels"],
        ce_weight=0.5,
        impl=impl,
        reduction=reduction,
    )
    loss.sum().backward()
    assert torch.all(loss == 0)
    for g in (x.grad, w.grad, b.grad):
        assert g is not None and torch.all(g == 0)


def test_no_grad_forward_matches_and_builds_no_graph():
    pb = make_problem(seed=5)
    x, w = pb["x"].clone().requires_grad_(), pb["w"].clone().requires_grad_()
    with torch.no_grad():
        loss = topkd.fused_linear_kd(x, w, pb["ids"], pb["logprobs"], chunk_size=8)
    assert not loss.requires_grad
    torch.testing.assert_close(
        loss, oracle(pb["x"], pb["w"], None, pb["ids"], pb["logprobs"]), atol=1e-12, rtol=0
    )


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_frozen_hidden_gets_no_grad_and_weight_grad_is_right(reduction):
    pb = make_problem(seed=6)
    w1, w2 = pb["w"].clone().requires_grad_(), pb["w"].clone().requires_grad_()
    x = pb["x"]  # frozen backbone: no grad wanted for hidden
    topkd.fused_linear_kd(
        x, w1, pb["ids"], pb["logprobs"], chunk_size=8, reduction=reduction
    ).sum().backward()
    oracle(x, w2, None, pb["ids"], pb["logprobs"], reduction=reduction).sum().backward()
    assert x.grad is None
    torch.testing.assert_close(w1.grad, w2.grad, atol=1e-10, rtol=1e-8)


def test_kdloss_module_matches_function():
    pb = make_problem(seed=7)
    module = topkd.KDLoss(divergence="jsd", beta=0.3, chunk_size=5)
    assert "jsd" in repr(module)
    got = module(pb["x"], pb["w"], pb["ids"], pb["logprobs"], mask=pb["mask"], bias=pb["b"])
    want = topkd.fused_linear_kd(
        pb["x"],
        pb["w"],
        pb["ids"],
        pb["logprobs"],
        mask=pb["mask"],
        bias=pb["b"],
        divergence="jsd",
        beta=0.3,
    )
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dtypes_of_loss_and_grads(dtype):
    pb = make_problem(seed=8, dtype=dtype)
    x, w, b = (pb[k].clone().requires_grad_() for k in ("x", "w", "b"))
    loss = topkd.fused_linear_kd(x, w, pb["ids"], pb["logprobs"].float(), bias=b, chunk_size=8)
    loss.backward()
    assert loss.dtype == torch.float32
    assert (x.grad.dtype, w.grad.dtype, b.grad.dtype) == (dtype, dtype, dtype)


def test_default_chunk_comes_from_a_byte_budget():
    from topkd.loss.chunk import LossSpec
    from topkd.loss.fused import chunk_rows

    assert chunk_rows(32768, torch.float32, LossSpec(), False) == 2048  # 256 MiB / (32768 x 4 B)
    assert chunk_rows(201088, torch.bfloat16, LossSpec(), False) == 2**28 // (201088 * 8)
    # two fp32 buffers
    assert chunk_rows(32768, torch.float32, LossSpec(temperature=2.0), True) == 1024


def test_cpu_chunk_buffer_is_reused_across_calls_and_can_be_released():
    from topkd.loss import fused
    from topkd.loss.fused import chunk_buffer

    fused.release_workspace()
    a = chunk_buffer(8, 100, torch.float32, torch.device("cpu"))
    b = chunk_buffer(4, 150, torch.float32, torch.device("cpu"))  # fits in the first: same memory
    assert b.data_ptr() == a.data_ptr() and b.shape == (4, 150)
    c = chunk_buffer(8, 101, torch.float32, torch.device("cpu"))  # larger: a new one replaces it
    assert c.numel() == 808 and fused._WORKSPACE.buffer.numel() == 808
    fused.release_workspace()
    assert fused._WORKSPACE.buffer is None


@pytest.mark.parametrize("impl", ["fused", "chunked", "dense"])
def test_a_second_backward_works_or_is_refused_clearly(impl):
    """fused and chunked refuse (before: an AttributeError, and for chunked a silent zero gradient)."""
    pb = make_problem(n=12, seed=6)
    x = pb["x"].clone().requires_grad_()
    loss = topkd.fused_linear_kd(x, pb["w"], pb["ids"], pb["logprobs"], impl=impl)
    loss.backward(retain_graph=True)
    first = x.grad.clone()
    if impl != "dense":  # gradients were made in forward and handed over: there is no second set
        with pytest.raises(RuntimeError, match="second backward through the same loss"):
            loss.backward()
    else:
        loss.backward()
        torch.testing.assert_close(x.grad, 2 * first)


@pytest.mark.parametrize("beta", [1e-9, 1e-6, 1 - 1e-6, 1 - 1e-9])
@pytest.mark.parametrize("tail", ["bucket", "renorm"])
def test_jsd_near_the_ends_of_beta_is_never_negative(beta, tail):
    for seed in range(10):
        pb = make_problem(n=16, seed=seed)
        for impl in ("fused", "chunked", "dense"):
            loss = topkd.fused_linear_kd(
                pb["x"],
                pb["w"],
                pb["ids"],
                pb["logprobs"],
                divergence="jsd",
                beta=beta,
                tail=tail,
                reduction="none",
                impl=impl,
            )
            assert loss.min() >= 0, (seed, impl, float(loss.min()))
    # the student equal to the teacher: JSD is 0 up to rounding, and rounding must not make it negative
    logits = pb["x"] @ pb["w"].T
    top = torch.log_softmax(logits.double(), -1).float().topk(5, -1)
    same = topkd.fused_linear_kd(
        pb["x"],
        pb["w"],
        top.indices,
        top.values,
        divergence="jsd",
        beta=beta,
        tail=tail,
        reduction="none",
    )
    assert same.min() >= 0 and same.max() < 1e-5


@pytest.mark.parametrize("impl", ["fused", "chunked", "dense"])
def test_autocast_leaves_the_loss_in_its_inputs_precision(impl):
    """Under bf16 autocast the fused path crashed on the first masked token (a bf16 product copied into fp32 dX)."""
    pb = make_problem(n=20, seed=8, dtype=torch.float32)
    mask = torch.ones(20, dtype=torch.bool)
    mask[3] = False
    x = pb["x"].float().requires_grad_()
    w = pb["w"].float()
    ref = topkd.fused_linear_kd(x, w, pb["ids"], pb["logprobs"], mask=mask, impl=impl)
    (gref,) = torch.autograd.grad(ref, x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = topkd.fused_linear_kd(x, w, pb["ids"], pb["logprobs"], mask=mask, impl=impl)
    (grad,) = torch.autograd.grad(loss, x)
    assert loss.dtype == torch.float32 and torch.equal(loss, ref) and torch.equal(grad, gref)
