"""The two plain baselines: impl="chunked" (forward-chunked) and impl="dense" (textbook).

- chunked: the paper's forward-chunked KD. Full student logits [N, V] are materialised by
  one GEMM, the loss and dL/dz are computed per slice of rows (same `chunk_step` as fused),
  dL/dz overwriting the logits slice by slice (the linear's backward needs X and W, not its
  output), and autograd's linear backward spends dL/dz. Memory: one N x V tensor; 6NVH FLOPs.
- dense: the teacher grid is rebuilt densely [N, V], the student log-softmax is taken over
  the full vocabulary, the K+1 buckets are summed out of the dense grids, and plain autograd
  does the rest. No gradient identity, no exact-tail trick: it is the reference the fused
  path is tested against, and the memory baseline.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from topkd.loss.chunk import LossSpec, TeacherRows, chunk_step
from topkd.loss.divergences import DIVERGENCES, make_buckets, teacher_buckets
from topkd.loss.fused import compute_dtype, is_one, reduce_per_token, token_weights


class _ChunkedOnLogits(torch.autograd.Function):
    """Loss over materialised logits, per slice; dL/dlogits is formed in the forward."""

    @staticmethod
    def forward(ctx, logits, rows, spec, reduction, chunk):
        kd_w, ce_w = (
            token_weights(rows, spec, reduction, compute_dtype(logits.dtype))
            if reduction != "none"
            else (None, None)
        )
        want = ctx.needs_input_grad[0]
        kd_tok, ce_tok, dlogits = _slices(
            logits, rows, spec, kd_w if want else None, ce_w, chunk, in_place=reduction != "none"
        )
        ctx.reduction, ctx.rows, ctx.spec, ctx.chunk = reduction, rows, spec, chunk
        if reduction == "none":
            ctx.save_for_backward(logits)
        else:
            ctx.dlogits = dlogits
        return reduce_per_token(kd_tok, ce_tok, rows, spec, reduction)

    @staticmethod
    def backward(ctx, go):
        if ctx.reduction == "none":
            (logits,) = ctx.saved_tensors
            kd_w, ce_w = token_weights(ctx.rows, ctx.spec, "none", compute_dtype(logits.dtype), go)
            return (
                _slices(logits, ctx.rows, ctx.spec, kd_w, ce_w, ctx.chunk, in_place=True)[2],
                None,
                None,
                None,
                None,
            )
        dlogits, ctx.dlogits = ctx.dlogits, None
        if dlogits is None:
            raise RuntimeError(
                "fused_linear_kd(impl='chunked') computes dL/dlogits during forward and hands it to the "
                "first backward, so a second backward through the same loss (retain_graph=True) has "
                "none left; compute the loss again, or use impl='dense'"
            )
        # in place: no second [N, V]
        grad = dlogits if is_one(go) else dlogits.mul_(go.to(dlogits.dtype))
        return grad, None, None, None, None


def _slices(
    logits: Tensor,
    rows: TeacherRows,
    spec: LossSpec,
    kd_w,
    ce_w,
    chunk: int,
    in_place: bool = False,
):
    """Per-token KD (and CE) of each row slice; dL/dlogits too when kd_w is given, written over the logits
    themselves when in_place (nothing else reads them afterwards: no second [N, V] tensor)."""
    n, cdt = logits.shape[0], compute_dtype(logits.dtype)
    kd_tok = torch.empty(n, dtype=cdt, device=logits.device)
    ce_tok = torch.empty(n, dtype=cdt, device=logits.device) if rows.labels is not None else None
    dlogits = None
    if kd_w is not None:
        dlogits = logits if in_place else torch.empty_like(logits)
    # in place and already in the compute dtype, a slice of the logits is itself the chunk's buffer (chunk_step
    # overwrites z with dL/dz): copying it cost a second [chunk, V] on top of the chunk's own work
    alias = in_place and logits.dtype == cdt
    for start in range(0, n, chunk):
        end = min(start + chunk, n)
        z = logits[start:end] if alias else logits[start:end].to(cdt, copy=True)
        # cast when written
        kd, ce = chunk_step(
            z,
            rows.slice(start, end),
            spec,
            None if kd_w is None else kd_w[start:end],
            None if ce_w is None or kd_w is None else ce_w[start:end],
            grad_out=None if dlogits is None or alias else dlogits[start:end],
        )
        kd_tok[start:end] = kd
        if ce_tok is not None:
            ce_tok[start:end] = ce
    return kd_tok, ce_tok, dlogits


def chunked_linear_kd(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    rows: TeacherRows,
    spec: LossSpec,
    reduction: str,
    chunk: int,
) -> Tensor:
    """x: counted rows [n, H]. Materialises logits [n, V] in the input dtype."""
    logits = _capped(F.linear(x, weight, bias), spec.softcap)
    return _ChunkedOnLogits.apply(logits, rows, spec, reduction, chunk)


def _capped(logits: Tensor, softcap: float | None) -> Tensor:
    """The baselines' soft-capping, by autograd: softcap * tanh(logits / softcap)."""
    return logits if not softcap else torch.tanh(logits / softcap) * softcap


def dense_linear_kd(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    rows: TeacherRows,
    spec: LossSpec,
    reduction: str,
) -> Tensor:
    """Textbook dense KD: [n, V] teacher grid and student log-softmax, plain autograd."""
    cdt = compute_dtype(x.dtype)
    logits = _capped(F.linear(x, weight, bias).to(cdt), spec.softcap)
    n, vocab = logits.shape
    ids = rows.ids.long()
    log_q_full = torch.log_softmax(logits / spec.temperature, dim=-1)
    p, log_p = teacher_buckets(
        rows.logprobs.to(cdt),
        None if rows.logz is None else rows.logz.to(cdt),
        spec.tail,
        spec.temperature,
        spec.full_support,
    )
    # scatter_add: a padding entry (variable K) aliases a real id and adds its p = 0
    teacher_grid = torch.zeros(n, vocab, dtype=cdt, device=x.device).scatter_add_(1, ids, p[:, :-1])
    on_support = torch.zeros(n, vocab, dtype=torch.bool, device=x.device).scatter_(1, ids, True)
    q_tail = log_q_full.exp().masked_fill(on_support, 0.0).sum(-1, keepdim=True)
    p_top = teacher_grid.gather(1, ids)  # round trip through the dense grid, as dense tools do
    tiny = torch.finfo(cdt).tiny
    log_q_ids = log_q_full.gather(1, ids)
    if rows.padding is not None:  # the aliases are no outcomes: p = 0, q = tiny
        p_top = p_top.masked_fill(rows.padding, 0.0)
        log_q_ids = log_q_ids.masked_fill(rows.padding, math.log(tiny))
    p = torch.cat([p_top, p[:, -1:]], dim=-1)
    log_q = torch.cat([log_q_ids, q_tail.clamp_min(tiny).log()], dim=-1)
    kd = (
        DIVERGENCES[spec.divergence](make_buckets(p, log_p, log_q), spec.beta) * spec.temperature**2
    )
    ce = None
    if rows.labels is not None:
        ce = F.cross_entropy(logits, rows.labels.long(), ignore_index=-100, reduction="none")
    return reduce_per_token(kd, ce, rows, spec, reduction)
