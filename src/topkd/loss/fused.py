"""impl="fused": the lm_head projection fused into a chunked KD loss; [N, V] never exists.

One driver owns chunks, gradients and normalisation. For each chunk of counted tokens it
forms the [C, V] logits, calls `chunk_step` (loss and dL/dz in place while the logits are
live), and immediately spends dL/dz on dX and dW: 6NVH FLOPs in total, and backward only
scales the stored gradients by grad_output. reduction="none" cannot know its token
weights until backward, so there the forward computes losses only and backward recomputes
(8NVH). Without gradients (no_grad, or nothing requires grad) the forward is 2NVH.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
from torch import Tensor

from topkd.loss import gemm, parts
from topkd.loss.chunk import LOCAL, TORCH_KERNELS, Kernels, LossSpec, TeacherRows, Vocab, chunk_step

# CPU: the chunk's buffers fit in L3-ish sizes; GEMMs are efficient at 2K rows
DEFAULT_CHUNK_BYTES = 256 * 2**20
# GPU: rows enough that W and dW traffic hides under the GEMMs (~800 rows at V=201K)
GPU_CHUNK_BYTES = 2**30
GPU_ROW_MULTIPLE = 128  # tensor-core tile


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Logsumexp, softmax and dW accumulate in fp32 (fp64 stays fp64)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def chunk_rows(
    vocab: int,
    dtype: torch.dtype,
    spec: LossSpec | None = None,
    has_labels: bool = False,
    device_type: str = "cpu",
    budget_bytes: int | None = None,
) -> int:
    """Rows per chunk so the chunk's [C, V] buffers fit the device's budget (CPU 256 MiB, GPU 1 GiB): the fp32
    logits (two with CE at T != 1) and, for bf16/fp16 inputs, the low-precision dL/dz the GEMMs read (plus,
    on a CPU, the GEMM's low-precision output). On a GPU rows are a multiple of 128."""
    spec = spec or LossSpec()  # the plain loss: no CE term, T = 1, no softcap
    cdt, cpu = compute_dtype(dtype), device_type == "cpu"
    buffers = (2 if (has_labels and spec.temperature != 1.0) else 1) + (1 if spec.softcap else 0)
    per_row = vocab * buffers * torch.finfo(cdt).bits // 8
    if dtype != cdt:
        per_row += (2 if cpu else 1) * vocab * torch.finfo(dtype).bits // 8
    rows = max(1, (budget_bytes or (DEFAULT_CHUNK_BYTES if cpu else GPU_CHUNK_BYTES)) // per_row)
    return rows if cpu or rows < GPU_ROW_MULTIPLE else rows - rows % GPU_ROW_MULTIPLE


_WORKSPACE = threading.local()


def chunk_buffer(rows: int, vocab: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """The [rows, V] chunk buffer. On CPU one buffer per thread is kept between calls: freshly mapped pages
    cost a page fault each (~5% of a call at 1K tokens). It never exceeds the chunk budget; on CUDA the
    caching allocator already reuses memory. release_workspace() frees it."""
    if device.type != "cpu":
        return torch.empty((rows, vocab), dtype=dtype, device=device)
    buf = getattr(_WORKSPACE, "buffer", None)
    if buf is None or buf.dtype != dtype or buf.numel() < rows * vocab:
        _WORKSPACE.buffer = None  # drop the old one first, so two never coexist
        _WORKSPACE.buffer = buf = torch.empty(rows * vocab, dtype=dtype)
    return buf[: rows * vocab].view(rows, vocab)


def release_workspace() -> None:
    """Free this thread's cached CPU chunk buffer."""
    _WORKSPACE.buffer = None


@dataclass(frozen=True)
class Plan:
    """One loss call as the driver runs it (made by topkd.loss.api.build_plan only): all but the three differentiable
    tensors."""

    row_index: Tensor | None  # the counted rows of the 2-D hidden; None when every row counts
    rows: TeacherRows  # the counted rows' teacher data
    spec: LossSpec  # spec.reduction: mean | sum | none
    chunk: int  # rows per chunk
    vocab: Vocab = LOCAL  # a VocabShard when the lm_head is split by vocabulary rows
    kernels: Kernels = TORCH_KERNELS  # the two full-width passes
    grad_wanted: bool = False  # autograd will ask for gradients


@dataclass
class _Grads:
    hidden: Tensor | None
    weight: Tensor | None
    bias: Tensor | None


def token_weights(
    rows: TeacherRows, spec: LossSpec, reduction: str, dtype: torch.dtype, go: Tensor | None = None
):
    """(kd_w, ce_w) per counted token: 1/n for "mean", 1 for "sum", grad_output for "none"."""
    n = len(rows)
    if reduction == "none":
        kd_w = go.to(dtype)
    else:
        kd_w = torch.full(
            (n,),
            1.0 / max(n, 1) if reduction == "mean" else 1.0,
            dtype=dtype,
            device=rows.ids.device,
        )
    if rows.labels is None:
        return kd_w, None
    valid = (rows.labels >= 0).to(kd_w.dtype)
    if reduction == "mean":
        ce_w = valid * (spec.ce_weight / valid.sum().clamp_min(1.0))
    else:
        ce_w = valid * spec.ce_weight * (1.0 if reduction == "sum" else kd_w)
    return kd_w, ce_w


def run_chunks(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    plan: Plan,
    kd_w: Tensor | None,
    ce_w: Tensor | None,
    needs: tuple[bool, bool, bool],
):
    """The driver: per-token (kd, ce) losses, and gradients for the inputs flagged in needs.
    With a VocabShard, weight and bias are this process's rows and dX is summed over the group.
    No host syncs inside the loop: a GPU runs ahead of Python for the whole call."""
    rows, spec, chunk, row_index = plan.rows, plan.spec, plan.chunk, plan.row_index
    n, cdt = len(rows), compute_dtype(hidden.dtype)
    grads = _gradient_buffers(hidden, weight, needs, n, cdt, scattered=row_index is not None)
    kd_tok = torch.empty(n, dtype=cdt, device=hidden.device)
    ce_tok = torch.empty(n, dtype=cdt, device=hidden.device) if rows.labels is not None else None
    buf = chunk_buffer(min(chunk, n), weight.shape[0], cdt, hidden.device)
    want_grad = any(needs)
    # bf16/fp16 inputs: dL/dz is written (cast in the same pass) into a buffer in the GEMMs' dtype
    low = torch.empty_like(buf, dtype=hidden.dtype) if want_grad and hidden.dtype != cdt else None
    cap_buf = torch.empty_like(buf) if spec.softcap else None
    for start in range(0, n, chunk):
        end = min(start + chunk, n)
        x = hidden[start:end] if row_index is None else hidden.index_select(0, row_index[start:end])
        z = gemm.project(x, weight, bias, buf[: end - start])
        cap = None if cap_buf is None else soft_cap(z, spec.softcap, cap_buf[: end - start])
        dz = z if low is None else low[: end - start]
        kd, ce = chunk_step(
            z,
            rows.slice(start, end),
            spec,
            kd_w[start:end] if want_grad else None,
            None if ce_w is None or not want_grad else ce_w[start:end],
            plan.vocab,
            dz if cap is None else z,
            plan.kernels,
        )
        # dL/dz = dL/dz' (1 - tanh^2), in fp32, then cast as it is written
        if cap is not None and want_grad:
            torch.mul(z, cap.square_().neg_().add_(1.0), out=dz)
        kd_tok[start:end] = kd
        if ce_tok is not None:
            ce_tok[start:end] = ce
        if want_grad:
            _spend_grad(dz, x, weight, grads, row_index, start, end, first=start == 0)
    if grads.hidden is not None:  # a VocabShard: each process's columns contribute to every dX row
        plan.vocab.all_reduce(grads.hidden, "sum")
    return kd_tok, ce_tok, grads


def _gradient_buffers(
    hidden: Tensor, weight: Tensor, needs, n: int, cdt, scattered: bool
) -> _Grads:
    """dX, dW, db for the inputs that need one. dX is zero-filled only when counted rows are scattered (the others
    get no write); dW is written by the first chunk's GEMM, so zero-filled only when there is no chunk (n == 0)."""
    dx = dw = db = None
    if needs[0]:
        dx = torch.zeros_like(hidden) if scattered else torch.empty_like(hidden)
    if needs[1]:
        dw = (torch.empty if n else torch.zeros)(weight.shape, dtype=cdt, device=weight.device)
    if needs[2]:
        db = torch.zeros(weight.shape[0], dtype=cdt, device=weight.device)
    return _Grads(hidden=dx, weight=dw, bias=db)


def soft_cap(z: Tensor, cap: float, tanh_out: Tensor) -> Tensor:
    """In place z <- cap tanh(z / cap); returns tanh(z / cap) in tanh_out (the gradient's factor needs it)."""
    torch.div(z, cap, out=tanh_out).tanh_()
    torch.mul(tanh_out, cap, out=z)
    return tanh_out


def _spend_grad(
    dz: Tensor,
    x: Tensor,
    weight: Tensor,
    grads: _Grads,
    row_index,
    start: int,
    end: int,
    first: bool,
) -> None:
    """dX rows = dz W; dW (=, then +=) dz^T x; db += sum dz. dz is in x's dtype; dW and db accumulate in fp32."""
    if grads.hidden is not None:
        if row_index is None:
            torch.mm(dz, weight, out=grads.hidden[start:end])
        else:
            grads.hidden.index_copy_(0, row_index[start:end], dz @ weight)
    if grads.weight is not None:
        gemm.accumulate(grads.weight, dz.t(), x, first)
    if grads.bias is not None:
        grads.bias.add_(dz.sum(dim=0, dtype=grads.bias.dtype))


def reduce_per_token(
    kd_tok: Tensor, ce_tok: Tensor | None, rows: TeacherRows, spec: LossSpec, reduction: str
) -> Tensor:
    """Per-token KD (and CE) losses to the loss the caller asked for: mean over counted tokens, sum, or none."""
    if reduction == "none":
        return kd_tok if ce_tok is None else kd_tok + spec.ce_weight * ce_tok
    kd_w, ce_w = token_weights(rows, spec, reduction, kd_tok.dtype)
    kd = (kd_tok * kd_w.to(kd_tok.dtype)).sum()
    ce = None if ce_tok is None else (ce_tok * ce_w.to(ce_tok.dtype)).sum()  # ce_w holds ce_weight
    parts.record(kd, ce / spec.ce_weight if ce is not None and spec.ce_weight else None)
    return kd if ce is None else kd + ce


class FusedLinearKD(torch.autograd.Function):
    """autograd wrapper; inputs are the 2-D hidden [N, H] (all rows), weight, bias and the call's Plan."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, bias: Tensor | None, plan: Plan) -> Tensor:
        reduction = plan.spec.reduction
        needs = tuple(bool(f) and plan.grad_wanted for f in ctx.needs_input_grad[:3])
        grad_now = any(needs) and reduction != "none"
        kd_w, ce_w = (
            token_weights(plan.rows, plan.spec, reduction, compute_dtype(hidden.dtype))
            if grad_now
            else (None, None)
        )
        kd_tok, ce_tok, grads = run_chunks(
            hidden, weight, bias, plan, kd_w, ce_w, needs if grad_now else (False, False, False)
        )
        ctx.plan, ctx.needs = plan, needs
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        if reduction == "none" and any(needs):
            ctx.save_for_backward(hidden, weight, bias)
        elif grad_now:
            ctx.grads = grads
        return reduce_per_token(kd_tok, ce_tok, plan.rows, plan.spec, reduction)

    @staticmethod
    def backward(ctx, go):
        plan = ctx.plan
        if plan.spec.reduction == "none":
            hidden, weight, bias = ctx.saved_tensors
            kd_w, ce_w = token_weights(
                plan.rows, plan.spec, "none", compute_dtype(hidden.dtype), go
            )
            grads, scale = run_chunks(hidden, weight, bias, plan, kd_w, ce_w, ctx.needs)[2], None
        else:
            grads, scale = ctx.grads, go
            if grads is None:
                raise RuntimeError(
                    "fused_linear_kd(impl='fused'/'triton') computes its gradients during forward and "
                    "hands them to the first backward, so a second backward through the same loss "
                    "(retain_graph=True) has none left; compute the loss again, or use impl='dense'"
                )
            ctx.grads = None  # drop our reference so autograd can adopt the buffers without a copy
        out = [
            _finish(g, dt, scale)
            for g, dt in zip((grads.hidden, grads.weight, grads.bias), ctx.dtypes)
        ]
        return (*out, None)


def is_one(scale: Tensor) -> bool:
    """grad_output == 1, asked only where asking is free: on a GPU (or meta) the answer is a host sync, so
    there the scaling is simply done."""
    return scale.device.type == "cpu" and bool(scale == 1)


def _finish(grad: Tensor | None, dtype: torch.dtype, scale: Tensor | None) -> Tensor | None:
    """Scale by grad_output and return in the input's dtype: one pass over the gradient (none when neither)."""
    if grad is None:
        return None
    if scale is None or is_one(scale):
        return grad.to(dtype)
    if grad.dtype == dtype:
        return grad.mul_(scale.to(dtype))
    return torch.mul(
        grad, scale.to(grad.dtype), out=torch.empty(grad.shape, dtype=dtype, device=grad.device)
    )
