"""The cross-tokenizer loss: exact KD where the vocabularies map one to one, ULD (sorted L1) where they do not.

    loss, parts = cross_tokenizer_kd(hidden, weight, targets, ce_weight=0.0)   # targets: CrossTargets

A student whose tokenizer is not the teacher's is aligned to the teacher's rows by character spans
(topkd.data.align). Two kinds of student row take a loss:
- exact rows (a group of one token each side, the same string): the teacher's top-K ids mapped into the
  student's vocabulary (ids without a same-string student token go to the tail bucket), and the usual
  bucket KL of topkd.loss (fused_linear_kd), so these rows are plain topkd KD;
- ULD rows (any other group): the L1 distance between the two next-token distributions sorted by probability
  (universal logit distillation, Boizard et al. 2024), over the teacher row's w real entries and one rest
  bucket: sum_r |p_(r) - q_(r)| + |P_rest - Q_rest|. A group of several tokens is one event: its first token's
  probability is multiplied by the chain rule's probabilities of the group's later tokens (the teacher's
  from its cached rows, the student's from its own rows, with gradient), as GOLD does; a distribution so
  scaled has mass below 1, and the rest bucket is what it has left beyond its top w.
The loss is the sum over both kinds of row, plus ce_weight times the sum of the student's own next-token CE
(topkd train divides by the batch's counted student tokens, as for every loss).
Every student pass walks rows in chunks under activation checkpointing, so no [N, V] tensor is held: one
[C, V] logits block lives at a time, forward and backward (recomputed there). The plain float64 reference is
tests/loss/test_cross.py's oracle.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from topkd.loss.api import fused_linear_kd
from topkd.loss.fused import chunk_rows
from topkd.loss.parts import record


@dataclass
class CrossTargets:
    """What the teacher says at the student's rows (rows index the flattened [N, H] hidden states)."""

    exact_rows: Tensor  # [M] int64
    exact_ids: Tensor  # [M, K] student ids, real entries first (padding after: -inf log-prob)
    exact_logprobs: (
        Tensor  # [M, K] float32 teacher log-probs (normalised over the teacher's vocabulary)
    )
    uld_rows: Tensor  # [G] int64
    uld_first: Tensor  # [G] the student token whose probability the group's chain scales
    uld_teacher: Tensor  # [G, W] the teacher's chain-scaled probabilities, sorted descending, 0 past its width
    uld_width: Tensor  # [G] real entries of the teacher row (ranks compared)
    uld_rest: Tensor  # [G] the teacher's rest bucket (its tail mass)
    chain_rows: Tensor  # [P] student rows whose realised next token is in a group's chain
    chain_tokens: Tensor  # [P] those next tokens
    chain_group: Tensor  # [P] the group (index into uld_*) each belongs to
    ce_rows: Tensor  # [R] rows with a student next-token label (CE)
    ce_labels: Tensor  # [R]

    @property
    def rows(self) -> int:
        return int(self.exact_rows.numel() + self.uld_rows.numel())


def cross_tokenizer_kd(
    hidden: Tensor,
    weight: Tensor,
    targets: CrossTargets,
    *,
    ce_weight: float = 0.0,
    chunk_size: int | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """The summed exact-KD and ULD loss of the aligned rows (+ ce_weight x summed CE); per-row means for logging."""
    h = hidden.reshape(-1, hidden.shape[-1])
    # keeps the graph (and zero gradients) when a batch has no aligned row
    zero = h.sum() * 0.0 + weight.sum() * 0.0
    exact = zero
    if targets.exact_rows.numel():
        exact = fused_linear_kd(
            h[targets.exact_rows],
            weight,
            # real entries come first and map one to one: at most V of them
            targets.exact_ids[:, : weight.shape[0]],
            targets.exact_logprobs[:, : weight.shape[0]],
            reduction="sum",
            chunk_size=chunk_size,
        )
    uld = _uld(h, weight, targets, chunk_size) if targets.uld_rows.numel() else zero
    loss, ce = exact + uld, zero
    if ce_weight and targets.ce_rows.numel():
        ce = -_token_logprobs(h, weight, targets.ce_rows, targets.ce_labels, chunk_size).sum()
        loss = loss + ce_weight * ce
    # for loss_parts' logging: the exact rows' KL recorded itself inside fused_linear_kd
    record(uld.detach(), ce.detach() if ce_weight else None)
    parts = {
        "exact_kl": float(exact.detach()) / max(int(targets.exact_rows.numel()), 1),
        "uld": float(uld.detach()) / max(int(targets.uld_rows.numel()), 1),
        "exact_fraction": int(targets.exact_rows.numel()) / max(targets.rows, 1),
        "ce": float(ce.detach()) / max(int(targets.ce_rows.numel()), 1),
    }
    return loss, parts


def _uld(h: Tensor, weight: Tensor, t: CrossTargets, chunk_size: int | None) -> Tensor:
    """Sum over ULD rows of the sorted-L1 distance, the student's chain log-probs added to its first token."""
    chain = torch.zeros(t.uld_rows.numel(), dtype=torch.float32, device=h.device)
    if t.chain_rows.numel():
        token_lp = _token_logprobs(h, weight, t.chain_rows, t.chain_tokens, chunk_size)
        chain = chain.index_add(0, t.chain_group, token_lp)
    total = h.new_zeros((), dtype=torch.float32)
    step = _rows_per_chunk(h, weight, chunk_size)
    for a in range(0, t.uld_rows.numel(), step):
        sl = slice(a, a + step)
        total = total + checkpoint(
            uld_chunk,
            h[t.uld_rows[sl]],
            weight,
            t.uld_first[sl],
            chain[sl],
            t.uld_teacher[sl],
            t.uld_width[sl],
            t.uld_rest[sl],
            use_reentrant=False,
        )
    return total


def uld_chunk(
    h: Tensor,
    weight: Tensor,
    first: Tensor,
    chain: Tensor,
    teacher: Tensor,
    width: Tensor,
    rest: Tensor,
) -> Tensor:
    """Sum over a chunk of rows of sum_r<w |p_(r) - q_(r)| + |P_rest - Q_rest| (the module docstring)."""
    logp = torch.log_softmax((h @ weight.T).float(), dim=-1)
    # the group as one event: its first token's probability times its chain's
    logp = logp.scatter_add(1, first[:, None], chain[:, None].to(logp.dtype))
    top = logp.topk(min(teacher.shape[1], logp.shape[1]), dim=1).values.exp()
    # a teacher row wider than the student's vocabulary: its extra ranks meet zeros, as ULD pads
    top = torch.nn.functional.pad(top, (0, teacher.shape[1] - top.shape[1]))
    ranks = torch.arange(top.shape[1], device=h.device)[None, :] < width[:, None]
    top = torch.where(ranks, top, 0.0)
    student_rest = (torch.logsumexp(logp, dim=1).exp() - top.sum(1)).clamp_min(0.0)
    q = torch.where(ranks, teacher.to(top.dtype), 0.0)
    return (top - q).abs().sum() + (student_rest - rest.to(top.dtype)).abs().sum()


def _token_logprobs(
    h: Tensor, weight: Tensor, rows: Tensor, tokens: Tensor, chunk_size: int | None
) -> Tensor:
    """log p_student(token | row) for each (row, token), in checkpointed chunks of rows."""
    step = _rows_per_chunk(h, weight, chunk_size)
    parts = [
        checkpoint(
            token_logprob_chunk,
            h[rows[a : a + step]],
            weight,
            tokens[a : a + step],
            use_reentrant=False,
        )
        for a in range(0, rows.numel(), step)
    ]
    return torch.cat(parts)


def token_logprob_chunk(h: Tensor, weight: Tensor, tokens: Tensor) -> Tensor:
    logits = (h @ weight.T).float()
    return logits.gather(1, tokens[:, None])[:, 0] - torch.logsumexp(logits, dim=1)


def _rows_per_chunk(h: Tensor, weight: Tensor, chunk_size: int | None) -> int:
    """The fused loss's chunk, a quarter of it: a ULD chunk holds about four [C, V] blocks (logits, log-probs,
    the scaled copy, their gradient) where the fused chunk holds one."""
    if chunk_size:
        return chunk_size
    return max(1, chunk_rows(weight.shape[0], h.dtype, device_type=h.device.type) // 4)
