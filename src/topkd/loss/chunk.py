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
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from topkd.base.tiles import row_blocks
from topkd.loss.divergences import DIVERGENCES, make_buckets, teacher_buckets
from topkd.loss.options import LossOptions


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
    # [n, K] bool: entries with log-prob -inf (variable K); their ids alias the row's first real id, so every
    # pass over ids stays a plain gather/scatter
    padding: Tensor | None = None

    def __len__(self) -> int:
        return self.ids.shape[0]

    def map(self, fn: Callable[[Tensor], Tensor]) -> "TeacherRows":
        """fn applied to every tensor present (None stays None): a slice, a row selection."""
        return TeacherRows(
            *(
                None if t is None else fn(t)
                for t in (self.ids, self.logprobs, self.logz, self.labels, self.padding)
            )
        )

    def slice(self, start: int, end: int) -> "TeacherRows":
        return self.map(lambda t: t[start:end])


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


class LocalVocab:
    """The whole vocabulary in this process (the default, and the reference): each reduction is the plain op.
    VocabShard is its tensor-parallel counterpart, with the same methods; the chunk math calls only these."""

    def gather(self, z: Tensor, ids: Tensor) -> Tensor:
        """z at ids ([C, K])."""
        return z.gather(1, ids)

    def put(self, z: Tensor, ids: Tensor, values: Tensor | float, accumulate: bool = False) -> None:
        """z[r, ids[r, k]] = values[r, k] (a Tensor [C, K], or a number), or += (a Tensor) with accumulate."""
        if accumulate:
            z.scatter_add_(1, ids, values)
        else:
            z.scatter_(1, ids, values)

    def row_max(self, z: Tensor, out: Tensor | None = None) -> Tensor:
        return torch.amax(z, dim=1, keepdim=True, out=out)

    def row_sum(self, t: Tensor, out: Tensor | None = None) -> Tensor:
        return torch.sum(t, dim=1, out=out)

    def all_reduce(self, t: Tensor, op: str) -> Tensor:
        return t

    def blocks(self, z: Tensor) -> list[tuple[int, int]]:
        """Row blocks of the full-width passes: each block's max, exp and sum passes hit cache, not DRAM."""
        return row_blocks(z)


LOCAL = LocalVocab()


@dataclass(frozen=True)
class VocabShard(LocalVocab):
    """This process holds vocabulary rows [start, start + size) of `vocab`, split across `group`: the row max,
    the logits at ids and the sums span every process's columns (an all_reduce each)."""

    start: int
    size: int
    vocab: int
    group: object = None

    def held(self, ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(row, local column, position in ids) of every id in this shard; ids: [C, K]."""
        local = ids - self.start
        row, k = ((local >= 0) & (local < self.size)).nonzero(as_tuple=True)
        return row, local[row, k], k

    def gather(self, z: Tensor, ids: Tensor) -> Tensor:
        """Each id's logit comes from the process holding it."""
        row, col, k = self.held(ids)
        out = torch.zeros(ids.shape, dtype=z.dtype, device=z.device)
        out[row, k] = z[row, col]
        return self.all_reduce(out, "sum")

    def put(self, z: Tensor, ids: Tensor, values: Tensor | float, accumulate: bool = False) -> None:
        row, col, k = self.held(ids)
        src = (
            values[row, k]
            if isinstance(values, Tensor)
            else torch.tensor(values, dtype=z.dtype, device=z.device)
        )
        z.index_put_((row, col), src, accumulate=accumulate)

    def row_max(self, z: Tensor, out: Tensor | None = None) -> Tensor:
        return self.all_reduce(super().row_max(z, out), "max")

    def row_sum(self, t: Tensor, out: Tensor | None = None) -> Tensor:
        return self.all_reduce(super().row_sum(t, out), "sum")

    def all_reduce(self, t: Tensor, op: str) -> Tensor:
        import torch.distributed as dist

        dist.all_reduce(
            t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=self.group
        )
        return t

    def blocks(self, z: Tensor) -> list[tuple[int, int]]:
        """One block: every reduction is a collective, and the group must make the same calls."""
        return [(0, z.shape[0])]


Vocab = LocalVocab  # LOCAL, or a VocabShard


def _softmax_stats(z: Tensor, ids: Tensor, temperature: float, vocab: Vocab = LOCAL):
    """In place: z <- exp((z - max) / T) with zeros at ids. Returns (max, shifted id logits, tail sum, total)."""
    z_ids = vocab.gather(z, ids)
    m = torch.empty(z.shape[0], 1, dtype=z.dtype, device=z.device)
    tail_sum = torch.empty(z.shape[0], dtype=z.dtype, device=z.device)
    for a, b in vocab.blocks(z):
        block = z[a:b]
        vocab.row_max(block, out=m[a:b])
        block.sub_(m[a:b])
        if temperature != 1.0:
            block.mul_(1.0 / temperature)
        block.exp_()
        vocab.put(block, ids[a:b], 0.0)
        vocab.row_sum(block, out=tail_sum[a:b])
    z_ids = (z_ids - m) / temperature
    return m.squeeze(1), z_ids, tail_sum, tail_sum + z_ids.exp().sum(dim=1)


def chunk_step(
    z: Tensor,
    rows: TeacherRows,
    spec: LossSpec,
    kd_weight: Tensor | None = None,
    ce_weight: Tensor | None = None,
    vocab: Vocab = LOCAL,
    grad_out: Tensor | None = None,
    kernels: "Kernels | None" = None,
) -> tuple[Tensor, Tensor | None]:
    """Per-token (kd, ce) losses for one chunk; with kd_weight, dL/dz is written to grad_out (default: z).

    z: [C, V] logits in the compute dtype (overwritten); with a VocabShard, [C, shard.size] columns.
    kd_weight / ce_weight: [C] weights of each token's kd and ce terms in the total loss
    (ce_weight already includes spec.ce_weight and zeros for ignored labels). kd is returned
    already scaled by T^2. grad_out: a [C, V] buffer in the GEMMs' dtype (bf16), so dL/dz is cast
    in the same pass that writes it. kernels: the two full-width passes (default TORCH_KERNELS).
    """
    kernels, temp, ids = kernels or TORCH_KERNELS, spec.temperature, rows.ids.long()
    label = _label_terms(z, rows.labels, temp, vocab)  # before the tempered pass overwrites z
    student = _student_buckets(z, ids, rows.padding, temp, vocab, kernels)
    ce = None if label is None else _cross_entropy(label, rows.labels, student)
    p, log_p = teacher_buckets(
        rows.logprobs.to(z.dtype),
        None if rows.logz is None else rows.logz.to(z.dtype),
        spec.tail,
        temp,
        spec.full_support,
    )
    divergence, scale = DIVERGENCES[spec.divergence], temp * temp
    if kd_weight is None:
        return divergence(make_buckets(p, log_p, student.log_q), spec.beta) * scale, ce
    log_q = student.log_q.detach().requires_grad_(True)
    with torch.enable_grad():
        kd = divergence(make_buckets(p, log_p, log_q), spec.beta)
        (u,) = torch.autograd.grad((kd * kd_weight.to(z.dtype)).sum() * scale, log_q)
    out = z if grad_out is None else grad_out
    shared_ce = ce_weight.to(z.dtype) if label is not None and label.untempered is None else None
    dense, at_ids = _grad_coefficients(u, student, temp, shared_ce, rows.padding)
    kernels.write_grad(z, student.max, dense, ids, at_ids, temp, out, vocab)
    if label is not None:
        _write_label_grad(out, label, ce_weight.to(z.dtype), vocab)
    return kd.detach() * scale, ce


@dataclass
class _LabelTerms:
    """What hard-label CE needs from a chunk's logits, read before the tempered pass overwrites them."""

    index: Tensor  # [C, 1] label ids, ignored ones (-100) clamped to 0
    logit: Tensor  # [C] z at the label
    untempered: Tensor | None = None  # T != 1: exp(z - max) over the row, a second [C, V] buffer
    # [C] the untempered softmax's denominator (at T == 1: the student's own)
    total: Tensor | None = None
    lse: Tensor | None = None  # [C] its logsumexp


def _label_terms(z: Tensor, labels: Tensor | None, temp: float, vocab: Vocab) -> _LabelTerms | None:
    if labels is None:
        return None
    index = labels.clamp_min(0).unsqueeze(1)
    terms = _LabelTerms(index, vocab.gather(z, index).squeeze(1))
    if temp != 1.0:  # CE needs the untempered softmax: a second buffer
        m = vocab.row_max(z)
        terms.untempered = torch.sub(z, m).exp_()
        terms.total = vocab.row_sum(terms.untempered)
        terms.lse = m.squeeze(1) + terms.total.log()
    return terms


def _cross_entropy(label: _LabelTerms, labels: Tensor, student: "_Student") -> Tensor:
    """Per-token CE (0 where ignored); at T == 1 the student's softmax is the untempered one."""
    if label.untempered is None:
        label.total, label.lse = student.total, student.max + student.total.log()
    return torch.where(labels >= 0, label.lse - label.logit, torch.zeros_like(label.lse))


def _write_label_grad(out: Tensor, label: _LabelTerms, w: Tensor, vocab: Vocab) -> None:
    """CE's dL/dz = w (softmax(z) - onehot(label)); at T == 1 the softmax part is already in (shared_ce)."""
    if label.untempered is not None:  # T != 1: add w * softmax(z) from the untempered buffer
        out.add_(label.untempered.mul_((w / label.total).unsqueeze(1)))
    vocab.put(out, label.index, -w.unsqueeze(1).to(out.dtype), accumulate=True)


@dataclass(frozen=True)
class _Student:
    """The student's K+1 bucket log-masses of one chunk, and the softmax statistics dL/dz is written from."""

    max: Tensor  # [C] row max of the tempered logits
    tail_sum: Tensor  # [C] sum of exp(z/T - max) off the teacher ids
    total: Tensor  # [C] the same over the whole row (padding aliases excluded)
    log_q: Tensor  # [C, K+1] log q at the ids, then the tail


def _student_buckets(
    z: Tensor, ids: Tensor, padding: Tensor | None, temp: float, vocab: Vocab, kernels: "Kernels"
) -> _Student:
    m, z_ids, tail_sum, total = kernels.softmax_stats(z, ids, temp, vocab)
    # an alias of a real id is no outcome of the student: no mass, no share of the total
    if padding is not None:
        z_ids = z_ids.masked_fill(padding, -math.inf)
        total = tail_sum + z_ids.exp().sum(dim=1)
    log_total = total.log()
    tiny = math.log(torch.finfo(z.dtype).tiny)
    log_q_tail = (tail_sum.log() - log_total).clamp_min(tiny)
    log_q_ids = z_ids - log_total.unsqueeze(1)
    if padding is not None:  # finite, as every bucket log-prob is: q = tiny there, and p = 0
        log_q_ids = log_q_ids.masked_fill(padding, tiny)
    return _Student(m, tail_sum, total, torch.cat([log_q_ids, log_q_tail.unsqueeze(1)], 1))


def _grad_coefficients(
    u: Tensor, student: _Student, temp: float, shared_ce: Tensor | None, padding: Tensor | None
) -> tuple[Tensor, Tensor]:
    """(dense [C, 1], at_ids [C, K]): dL/dz = dense * exp(z/T - m) off the ids, at_ids at them
    (plus w * softmax if shared_ce, T == 1)."""
    tail_sum, total, q_ids = student.tail_sum, student.total, student.log_q[:, :-1].exp()
    u_sum = u.sum(dim=1)
    safe_tail = torch.where(tail_sum > 0, tail_sum, torch.ones_like(tail_sum))
    tail_ratio = torch.where(tail_sum > 0, u[:, -1] / safe_tail, torch.zeros_like(tail_sum))
    dense = (tail_ratio - u_sum / total) / temp
    at_ids = (u[:, :-1] - u_sum.unsqueeze(1) * q_ids) / temp
    if shared_ce is not None:  # T == 1: softmax(z) = q, so CE's w * q folds into the same terms
        dense = dense + shared_ce / total
        at_ids = at_ids + shared_ce.unsqueeze(1) * q_ids
    # an alias writes the real id's own gradient: the duplicate scatter is then harmless
    if padding is not None:
        at_ids = torch.where(padding, at_ids.gather(1, _first_real(padding)), at_ids)
    return dense.unsqueeze(1), at_ids


def _write_grad(
    z: Tensor,
    m: Tensor,
    dense: Tensor,
    ids: Tensor,
    at_ids: Tensor,
    temp: float,
    out: Tensor,
    vocab: Vocab = LOCAL,
) -> None:
    """z holds exp(z/T - m) with zeros at ids (from _softmax_stats): out <- dense * z, then at_ids at the ids.
    out may be z itself, or a low-precision buffer (the cast happens in the same pass)."""
    at_ids = at_ids.to(out.dtype)
    for a, b in vocab.blocks(z):
        torch.mul(z[a:b], dense[a:b], out=out[a:b])
        vocab.put(out[a:b], ids[a:b], at_ids[a:b])


@dataclass(frozen=True)
class Kernels:
    """The two full-width passes over a chunk's [C, V] logits; the rest of chunk_step is [C] or [C, K] math.
    softmax_stats(z, ids, T, vocab) -> (max, shifted id logits, tail sum, total), leaving z for write_grad;
    write_grad(z, max, dense, ids, at_ids, T, out, vocab) writes dL/dz into out."""

    name: str
    softmax_stats: object
    write_grad: object


TORCH_KERNELS = Kernels("torch", _softmax_stats, _write_grad)
