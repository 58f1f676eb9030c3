"""Per-chunk KD math on one [C, V] block of student logits: loss, and dL/dz in place.

This is the small pure function every driver shares (fused, forward-chunked). It takes a
float32/float64 logits buffer, computes the tempered log-probs at the teacher ids and the
exact student tail mass, evaluates the divergence on K+1 buckets, and, when token weights
are given, overwrites the buffer with the weighted gradient dL/dz.

Gradient (docs/loss.md): with l_j = log Q_j the bucket log-masses and u = dL/dl,
    dL/dz_v = ( u_{b(v)} q_v / Q_{b(v)} - (sum_j u_j) q_v ) / T,
so ids get u_k - U q_k (written, never formed as a difference of large terms) and every
other token gets q_v (u_tail / Q_tail - U). The tail mass is summed over non-teacher tokens
directly, never as 1 - sum q, so it stays accurate when the teacher covers nearly all mass.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from topkd.loss.divergences import DIVERGENCES, make_buckets, teacher_buckets


@dataclass(frozen=True)
class LossSpec:
    """Everything about the loss that is not a tensor."""

    divergence: str = "kl"
    tail: str = "bucket"
    temperature: float = 1.0
    beta: float = 0.5
    ce_weight: float = 0.0
    full_support: bool = False  # K == V: the teacher tail is exactly zero


@dataclass(frozen=True)
class TeacherRows:
    """Teacher data for counted tokens only, in their stored dtypes; sliced per chunk."""

    ids: Tensor  # [n, K] integer
    logprobs: Tensor  # [n, K] float, log p at T=1
    logz: Tensor | None  # [n] c_T, or None
    labels: Tensor | None  # [n] int64 with -100 ignored, or None when CE is off

    def __len__(self) -> int:
        return self.ids.shape[0]

    def slice(self, start: int, end: int) -> "TeacherRows":
        pick = lambda t: None if t is None else t[start:end]  # noqa: E731
        return TeacherRows(pick(self.ids), pick(self.logprobs), pick(self.logz), pick(self.labels))


BLOCK_BYTES = 2**20  # elementwise passes walk the chunk in row blocks this size, so they stay in L2


def row_blocks(z: Tensor) -> list[tuple[int, int]]:
    """(start, end) row ranges of about BLOCK_BYTES each: elementwise passes per block stay in L2."""
    rows = max(1, BLOCK_BYTES // (z.shape[1] * z.element_size()))
    return [(r, min(r + rows, z.shape[0])) for r in range(0, z.shape[0], rows)]


def _softmax_stats(z: Tensor, ids: Tensor, temperature: float):
    """In place: z <- exp((z - max) / T) with zeros at ids. Returns (max, shifted id logits, tail sum, total)."""
    m = torch.empty(z.shape[0], 1, dtype=z.dtype, device=z.device)
    tail_sum = torch.empty(z.shape[0], dtype=z.dtype, device=z.device)
    z_ids = z.gather(1, ids)
    for a, b in row_blocks(z):  # each block's max, exp and sum passes hit cache, not DRAM
        block = z[a:b]
        torch.amax(block, dim=1, keepdim=True, out=m[a:b])
        block.sub_(m[a:b])
        if temperature != 1.0:
            block.mul_(1.0 / temperature)
        block.exp_()
        block.scatter_(1, ids[a:b], 0.0)
        torch.sum(block, dim=1, out=tail_sum[a:b])
    z_ids = (z_ids - m) / temperature
    total = tail_sum + z_ids.exp().sum(dim=1)
    return m.squeeze(1), z_ids, tail_sum, total


def chunk_step(
    z: Tensor,
    rows: TeacherRows,
    spec: LossSpec,
    kd_weight: Tensor | None = None,
    ce_weight: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Per-token (kd, ce) losses for one chunk; with kd_weight, z becomes dL/dz.

    z: [C, V] logits in the compute dtype (overwritten). kd_weight / ce_weight: [C] weights
    of each token's kd and ce terms in the total loss (ce_weight already includes
    spec.ce_weight and zeros for ignored labels). kd is returned already scaled by T^2.
    """
    temp, cdt = spec.temperature, z.dtype
    ids = rows.ids.long()
    labels = None if rows.labels is None else rows.labels.clamp_min(0).unsqueeze(1)
    z_label = None if labels is None else z.gather(1, labels).squeeze(1)
    untempered = None
    if labels is not None and temp != 1.0:  # CE needs the untempered softmax: a second buffer
        m1 = z.amax(dim=1, keepdim=True)
        untempered = torch.sub(z, m1).exp_()
        total1 = untempered.sum(dim=1)
        lse1 = m1.squeeze(1) + total1.log()
    m, z_ids, tail_sum, total = _softmax_stats(z, ids, temp)
    if untempered is None and labels is not None:
        total1, lse1 = total, m + total.log()
    log_total = total.log()
    log_q_tail = (tail_sum.log() - log_total).clamp_min(math.log(torch.finfo(cdt).tiny))
    log_q = torch.cat([z_ids - log_total.unsqueeze(1), log_q_tail.unsqueeze(1)], 1)
    p, log_p = teacher_buckets(rows.logprobs.to(cdt), None if rows.logz is None else rows.logz.to(cdt),
                               spec.tail, temp, spec.full_support)
    divergence = DIVERGENCES[spec.divergence]
    scale = temp * temp
    ce = None
    if labels is not None:
        ce = torch.where(rows.labels >= 0, lse1 - z_label, torch.zeros_like(lse1))
    if kd_weight is None:
        return divergence(make_buckets(p, log_p, log_q), spec.beta) * scale, ce
    log_q.requires_grad_(True)
    with torch.enable_grad():
        kd = divergence(make_buckets(p, log_p, log_q), spec.beta)
        (u,) = torch.autograd.grad((kd * kd_weight.to(cdt)).sum() * scale, log_q)
    shared_ce = ce_weight.to(cdt) if labels is not None and untempered is None else None
    _write_grad(z, ids, u, log_q.detach()[:, :-1].exp(), tail_sum, total, temp, shared_ce)
    if labels is not None:
        w = ce_weight.to(cdt)
        if untempered is not None:  # T != 1: add w * softmax(z) from the untempered buffer
            z.add_(untempered.mul_((w / total1).unsqueeze(1)))
        z.scatter_add_(1, labels, -w.unsqueeze(1))
    return kd.detach() * scale, ce


def _write_grad(z: Tensor, ids: Tensor, u: Tensor, q_ids: Tensor, tail_sum: Tensor, total: Tensor,
                temp: float, shared_ce: Tensor | None) -> None:
    """z holds exp(zT - m) with zeros at ids; turn it into dL/dz (plus w * softmax if shared_ce)."""
    u_sum = u.sum(dim=1)
    safe_tail = torch.where(tail_sum > 0, tail_sum, torch.ones_like(tail_sum))
    tail_ratio = torch.where(tail_sum > 0, u[:, -1] / safe_tail, torch.zeros_like(tail_sum))
    dense = (tail_ratio - u_sum / total) / temp
    at_ids = (u[:, :-1] - u_sum.unsqueeze(1) * q_ids) / temp
    if shared_ce is not None:  # T == 1: softmax(z) = q, so CE's w * q folds into the same terms
        dense = dense + shared_ce / total
        at_ids = at_ids + shared_ce.unsqueeze(1) * q_ids
    dense = dense.unsqueeze(1)
    for a, b in row_blocks(z):
        z[a:b].mul_(dense[a:b]).scatter_(1, ids[a:b], at_ids[a:b])
