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

With a VocabShard, z holds only this process's columns of the vocabulary (a tensor-parallel
lm_head): the row max, the id and label logits and the sums are combined across the group
(all_reduce), so every process sees the same buckets, and each writes dL/dz for its columns.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from topkd.loss.divergences import DIVERGENCES, make_buckets, teacher_buckets
from topkd.loss.options import LossOptions
from topkd.tiles import row_blocks


@dataclass(frozen=True)
class LossSpec(LossOptions):
    """The options as the chunk math sees them: LossOptions plus what the call's tensors decide."""

    full_support: bool = False  # K == V: the teacher tail is exactly zero


@dataclass(frozen=True)
class TeacherRows:
    """Teacher data for counted tokens only, in their stored dtypes; sliced per chunk."""

    ids: Tensor  # [n, K] integer
    logprobs: Tensor  # [n, K] float, log p at T=1
    logz: Tensor | None  # [n] c_T, or None
    labels: Tensor | None  # [n] int64 with -100 ignored, or None when CE is off
    padding: Tensor | None = None  # [n, K] bool: entries with log-prob -inf (variable K); their ids alias the
    #                                row's first real id, so every pass over ids stays a plain gather/scatter

    def __len__(self) -> int:
        return self.ids.shape[0]

    def slice(self, start: int, end: int) -> "TeacherRows":
        pick = lambda t: None if t is None else t[start:end]  # noqa: E731
        return TeacherRows(pick(self.ids), pick(self.logprobs), pick(self.logz), pick(self.labels),
                           pick(self.padding))


def with_padding(rows: TeacherRows) -> TeacherRows:
    """Rows of variable K: entries with log-prob -inf become padding (no mass, no gradient), their ids replaced by
    the row's first real id. The aliasing keeps every kernel as it is: zeroing the ids and scattering the id
    gradients write the same place with the same value twice; chunk_step then removes the aliases' share from
    the student's sums and gives them the real id's gradient. Rows with no padding are returned as they are."""
    if rows.ids.device.type == "meta":  # cost-model traces carry no values
        return rows
    padding = rows.logprobs == -math.inf
    if not bool(padding.any()):
        return rows
    ids = torch.where(padding, rows.ids.gather(1, _first_real(padding)), rows.ids)
    return TeacherRows(ids, rows.logprobs, rows.logz, rows.labels, padding)


def _first_real(padding: Tensor) -> Tensor:
    """[n, 1] position of each row's first real (non-padding) entry."""
    return (~padding).to(torch.uint8).argmax(dim=1, keepdim=True)


@dataclass(frozen=True)
class VocabShard:
    """This process holds vocabulary rows [start, start + size) of `vocab`, split across `group`."""

    start: int
    size: int
    vocab: int
    group: object = None

    def held(self, ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(row, local column, position in ids) of every id in this shard; ids: [C, K]."""
        local = ids - self.start
        row, k = ((local >= 0) & (local < self.size)).nonzero(as_tuple=True)
        return row, local[row, k], k

    def all_reduce(self, t: Tensor, op: str) -> Tensor:
        import torch.distributed as dist

        dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=self.group)
        return t


def _gather(z: Tensor, ids: Tensor, shard: VocabShard | None) -> Tensor:
    """z at ids ([C, K]); across a shard group, each id's logit comes from the process holding it."""
    if shard is None:
        return z.gather(1, ids)
    row, col, k = shard.held(ids)
    out = torch.zeros(ids.shape, dtype=z.dtype, device=z.device)
    out[row, k] = z[row, col]
    return shard.all_reduce(out, "sum")


def _put(z: Tensor, ids: Tensor, values, shard: VocabShard | None, accumulate: bool = False) -> None:
    """z[r, ids[r, k]] = values[r, k] (a Tensor [C, K] or a number), or += with accumulate."""
    if shard is None:
        src = values if isinstance(values, Tensor) else torch.full(ids.shape, values, dtype=z.dtype, device=z.device)
        z.scatter_add_(1, ids, src) if accumulate else z.scatter_(1, ids, src)
        return
    row, col, k = shard.held(ids)
    src = values[row, k] if isinstance(values, Tensor) else torch.full(row.shape, values, dtype=z.dtype,
                                                                        device=z.device)
    z.index_put_((row, col), src, accumulate=accumulate)


def _row_max(z: Tensor, shard: VocabShard | None) -> Tensor:
    m = z.amax(dim=1, keepdim=True)
    return m if shard is None else shard.all_reduce(m, "max")


def _row_sum(t: Tensor, shard: VocabShard | None) -> Tensor:
    s = t.sum(dim=1)
    return s if shard is None else shard.all_reduce(s, "sum")


def _softmax_stats(z: Tensor, ids: Tensor, temperature: float, shard: VocabShard | None = None):
    """In place: z <- exp((z - max) / T) with zeros at ids. Returns (max, shifted id logits, tail sum, total)."""
    z_ids = _gather(z, ids, shard)
    if shard is not None:  # the max and the tail sum span every process's columns
        m = _row_max(z, shard)
        z.sub_(m).mul_(1.0 / temperature).exp_()
        _put(z, ids, 0.0, shard)
        tail_sum = _row_sum(z, shard)
        z_ids = (z_ids - m) / temperature
        return m.squeeze(1), z_ids, tail_sum, tail_sum + z_ids.exp().sum(dim=1)
    m = torch.empty(z.shape[0], 1, dtype=z.dtype, device=z.device)
    tail_sum = torch.empty(z.shape[0], dtype=z.dtype, device=z.device)
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
    shard: VocabShard | None = None,
    grad_out: Tensor | None = None,
    kernels: "Kernels | None" = None,
) -> tuple[Tensor, Tensor | None]:
    """Per-token (kd, ce) losses for one chunk; with kd_weight, dL/dz is written to grad_out (default: z).

    z: [C, V] logits in the compute dtype (overwritten); with a shard, [C, shard.size] columns.
    kd_weight / ce_weight: [C] weights of each token's kd and ce terms in the total loss
    (ce_weight already includes spec.ce_weight and zeros for ignored labels). kd is returned
    already scaled by T^2. grad_out: a [C, V] buffer in the GEMMs' dtype (bf16), so dL/dz is cast
    in the same pass that writes it. kernels: the two full-width passes (default TORCH_KERNELS).
    """
    kernels = kernels or TORCH_KERNELS
    out = z if grad_out is None else grad_out
    temp, cdt = spec.temperature, z.dtype
    ids = rows.ids.long()
    labels = None if rows.labels is None else rows.labels.clamp_min(0).unsqueeze(1)
    z_label = None if labels is None else _gather(z, labels, shard).squeeze(1)
    untempered = None
    if labels is not None and temp != 1.0:  # CE needs the untempered softmax: a second buffer
        m1 = _row_max(z, shard)
        untempered = torch.sub(z, m1).exp_()
        total1 = _row_sum(untempered, shard)
        lse1 = m1.squeeze(1) + total1.log()
    m, z_ids, tail_sum, total = kernels.softmax_stats(z, ids, temp, shard)
    pad = rows.padding
    if pad is not None:  # an alias of a real id is no outcome of the student: no mass, no share of the total
        z_ids = z_ids.masked_fill(pad, -math.inf)
        total = tail_sum + z_ids.exp().sum(dim=1)
    if untempered is None and labels is not None:
        total1, lse1 = total, m + total.log()
    log_total = total.log()
    log_q_tail = (tail_sum.log() - log_total).clamp_min(math.log(torch.finfo(cdt).tiny))
    log_q_ids = z_ids - log_total.unsqueeze(1)
    if pad is not None:  # finite, as every bucket log-prob is: q = tiny there, and p = 0
        log_q_ids = log_q_ids.masked_fill(pad, math.log(torch.finfo(cdt).tiny))
    log_q = torch.cat([log_q_ids, log_q_tail.unsqueeze(1)], 1)
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
    dense, at_ids = _grad_coefficients(u, log_q.detach()[:, :-1].exp(), tail_sum, total, temp, shared_ce)
    if pad is not None:  # an alias writes the real id's own gradient: the duplicate scatter is then harmless
        at_ids = torch.where(pad, at_ids.gather(1, _first_real(pad)), at_ids)
    kernels.write_grad(z, m, dense, ids, at_ids, temp, out, shard)
    if labels is not None:
        w = ce_weight.to(cdt)
        if untempered is not None:  # T != 1: add w * softmax(z) from the untempered buffer
            out.add_(untempered.mul_((w / total1).unsqueeze(1)))
        _put(out, labels, -w.unsqueeze(1).to(out.dtype), shard, accumulate=True)
    return kd.detach() * scale, ce


def _grad_coefficients(u: Tensor, q_ids: Tensor, tail_sum: Tensor, total: Tensor, temp: float,
                       shared_ce: Tensor | None) -> tuple[Tensor, Tensor]:
    """(dense [C, 1], at_ids [C, K]): dL/dz = dense * exp(z/T - m) off the ids, at_ids at them
    (plus w * softmax if shared_ce, T == 1)."""
    u_sum = u.sum(dim=1)
    safe_tail = torch.where(tail_sum > 0, tail_sum, torch.ones_like(tail_sum))
    tail_ratio = torch.where(tail_sum > 0, u[:, -1] / safe_tail, torch.zeros_like(tail_sum))
    dense = (tail_ratio - u_sum / total) / temp
    at_ids = (u[:, :-1] - u_sum.unsqueeze(1) * q_ids) / temp
    if shared_ce is not None:  # T == 1: softmax(z) = q, so CE's w * q folds into the same terms
        dense = dense + shared_ce / total
        at_ids = at_ids + shared_ce.unsqueeze(1) * q_ids
    return dense.unsqueeze(1), at_ids


def _write_grad(z: Tensor, m: Tensor, dense: Tensor, ids: Tensor, at_ids: Tensor, temp: float, out: Tensor,
                shard: VocabShard | None = None) -> None:
    """z holds exp(z/T - m) with zeros at ids (from _softmax_stats): out <- dense * z, then at_ids at the ids.
    out may be z itself, or a low-precision buffer (the cast happens in the same pass)."""
    if shard is not None:
        torch.mul(z, dense, out=out)
        _put(out, ids, at_ids.to(out.dtype), shard)
        return
    at_ids = at_ids.to(out.dtype)
    for a, b in row_blocks(z):
        torch.mul(z[a:b], dense[a:b], out=out[a:b]).scatter_(1, ids[a:b], at_ids[a:b])


@dataclass(frozen=True)
class Kernels:
    """The two full-width passes over a chunk's [C, V] logits; the rest of chunk_step is [C] or [C, K] math.
    softmax_stats(z, ids, T, shard) -> (max, shifted id logits, tail sum, total), leaving z for write_grad;
    write_grad(z, max, dense, ids, at_ids, T, out, shard) writes dL/dz into out."""

    name: str
    softmax_stats: object
    write_grad: object


TORCH_KERNELS = Kernels("torch", _softmax_stats, _write_grad)
