"""topkd.base.trace: what each aten op moves and computes, and the live-memory peak, on real and meta tensors."""

import pytest
import torch

from topkd.base import trace
from topkd.base.trace import OpTrace


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_gemm_flops_and_bytes(device):
    a, b = torch.ones(6, 5, device=device), torch.ones(5, 7, device=device)
    acc = torch.zeros(6, 7, device=device)
    with OpTrace() as t:
        torch.mm(a, b)
        acc.addmm_(a, b, beta=0.0)
        acc.addmm_(a, b)
    mm, first, second = t.ops
    assert (mm.kind, mm.flops, mm.read, mm.written) == (
        "gemm",
        2 * 6 * 5 * 7,
        (30 + 35) * 4,
        42 * 4,
    )
    assert mm.shape == ("mm", 6, 5, 7, "float32")
    assert first.read == (30 + 35) * 4, "beta=0: the accumulator is not read"
    assert second.read == (30 + 35 + 42) * 4


def test_gathers_and_in_place_scatters_move_only_their_elements():
    z = torch.zeros(8, 1000)
    ids = torch.randint(0, 1000, (8, 3))
    with OpTrace() as t:
        z.gather(1, ids)
        z.scatter_(1, ids, 0.0)
        z.exp_()
    gather, scatter, exp = t.ops
    assert gather.written == 24 * 4 and gather.read == 24 * 8 + 24 * 4
    assert scatter.written == 24 * 4, "an in-place scatter touches [C, K], not [C, V]"
    assert (exp.kind, exp.read, exp.written, exp.elements) == (
        "transcendental",
        8000 * 4,
        8000 * 4,
        8000,
    )


def test_views_and_allocations_move_nothing():
    x = torch.ones(4, 4)
    with OpTrace() as t:
        x.t()
        x[1:]
        x.view(16)
        torch.empty(3)
    assert [op.kind for op in t.ops] == ["alloc"]  # the empty() is priced as fresh pages only
    assert t.ops[0].fresh == 12


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_peak_counts_live_storages_and_frees(device):
    with OpTrace() as t:
        a = torch.ones(1000, device=device)
        b = a * 2  # 2 x 4000 bytes alive
        del a, b
        c = torch.ones(500, device=device)  # after the frees: the peak stays at 8000
        c.view(50, 10).add_(1)  # a view of c and an in-place op: no new storage
    assert t.peak_bytes == 8000
    assert t.live_bytes == 2000


def test_declared_kernels_and_meta_launch_guard():
    z, cpu = torch.empty(2, 3, device="meta"), torch.empty(1)
    assert not trace.tracing_meta(z)
    trace.declare("outside", 1, 1, 1)  # no trace: nothing happens
    with OpTrace() as t:
        assert trace.tracing_meta(z) and not trace.tracing_meta(cpu)
        trace.declare("kernel", 10, 20, 5)
    assert [(o.name, o.kind, o.read, o.written) for o in t.ops] == [("kernel", "kernel", 10, 20)]
    assert trace.active() is None


def test_fp32_output_addmm_on_meta_is_traced_on_every_torch():
    """bf16 operands into an fp32 accumulator, as the loss's dW on a GPU. torch 2.11's meta kernel of
    addmm(out_dtype=...) raises (make test-compat runs this there); the trace stands in for it."""
    a = torch.empty(6, 5, device="meta", dtype=torch.bfloat16)
    b = torch.empty(5, 7, device="meta", dtype=torch.bfloat16)
    acc = torch.empty(6, 7, device="meta")
    with OpTrace() as t:
        torch.addmm(acc, a, b, out_dtype=torch.float32, beta=0.0, out=acc)
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
        fresh = torch.addmm(acc, a, b, out_dtype=torch.float32)
    first, second, third = t.ops
    assert (fresh.shape, fresh.dtype) == ((6, 7), torch.float32)
    # beta=0 reads no accumulator
    assert first.read == (30 + 35) * 2 and second.read == (30 + 35) * 2 + 42 * 4
    assert first.written == second.written == third.written == 42 * 4 and first.dtype == "bfloat16"
    with pytest.raises(TypeError):  # anything else still raises
        with OpTrace():
            torch.addmm(acc, a, b, beta="x")
