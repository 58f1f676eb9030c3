"""Divergences between teacher and student bucket distributions over K+1 outcomes.

Bucket j < K is the teacher's j-th top-K token; bucket K is "every other token" (the tail).
A divergence is a small pure function of a `Buckets` record ([N, K+1] tensors) returning a
per-token loss [N]; the chunk driver differentiates it with autograd, so adding one means
writing one function here and registering it in `DIVERGENCES`. Nothing else changes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor


@dataclass(frozen=True)
class Buckets:
    """Teacher P and student Q over K+1 buckets; all tensors are [N, K+1]."""

    p: Tensor  # teacher probabilities (constant); zero where a bucket is empty
    log_p: Tensor  # log p, clamped to log(finfo.tiny) where p == 0, so p * log_p == 0
    q: Tensor  # student probabilities, exp(log_q)
    log_q: Tensor  # student log-probabilities, finite (tail clamped like log_p)


def _log_clamped(x: Tensor) -> Tensor:
    return x.clamp_min(torch.finfo(x.dtype).tiny).log()


def kl(b: Buckets, beta: float) -> Tensor:
    """Forward KL(P || Q) = sum P log(P / Q)."""
    return (b.p * (b.log_p - b.log_q)).sum(-1)


def reverse_kl(b: Buckets, beta: float) -> Tensor:
    """Reverse KL(Q || P) = sum Q log(Q / P); needs a teacher tail (tail="bucket")."""
    return (b.q * (b.log_q - b.log_p)).sum(-1)


def jsd(b: Buckets, beta: float) -> Tensor:
    """Generalised JSD: M = beta P + (1 - beta) Q; beta KL(P || M) + (1 - beta) KL(Q || M).

    Clamped at 0: near beta = 0 or 1 (or P = Q) the two terms cancel to rounding, which could go negative."""
    log_m = _log_clamped(beta * b.p + (1.0 - beta) * b.q)
    to_teacher = (b.p * (b.log_p - log_m)).sum(-1)
    to_student = (b.q * (b.log_q - log_m)).sum(-1)
    return (beta * to_teacher + (1.0 - beta) * to_student).clamp_min(0.0)


def tvd(b: Buckets, beta: float) -> Tensor:
    """Total variation distance 1/2 sum |P - Q|."""
    return 0.5 * (b.p - b.q).abs().sum(-1)


Divergence = Callable[[Buckets, float], Tensor]
DIVERGENCES: dict[str, Divergence] = {"kl": kl, "reverse_kl": reverse_kl, "jsd": jsd, "tvd": tvd}
TAILS = ("bucket", "renorm")


def teacher_buckets(
    logprobs: Tensor, logz: Tensor | None, tail: str, temperature: float, full_support: bool
) -> tuple[Tensor, Tensor]:
    """Teacher (p, log_p) over K+1 buckets, tempered exactly where the inputs allow.

    logprobs [N, K] are log p(id) at T=1 over the full vocabulary; logz [N] is
    c_T = log sum_v exp(a_v / T). "renorm" renormalises p^(1/T) on the support (exact
    without c_T); "bucket" keeps the leftover mass as bucket K (needs c_T when T != 1).
    With full_support (K == V) the tail is zero by construction, not by rounding.
    """
    a = logprobs / temperature if temperature != 1.0 else logprobs
    if tail == "renorm":
        log_p_top = torch.log_softmax(a, dim=-1)
        p_top = log_p_top.exp()
        p_tail = torch.zeros_like(p_top[:, :1])
    else:
        if logz is not None:
            a = a - logz.unsqueeze(-1)
        p_top = a.exp()
        p_tail = (1.0 - p_top.sum(-1, keepdim=True)).clamp_min(0.0)
        if full_support:
            p_tail = torch.zeros_like(p_tail)
        log_p_top = a
    p = torch.cat([p_top, p_tail], dim=-1)
    # entries of variable-K rows that carry nothing: finite, so p log p = 0
    padding = log_p_top == -math.inf
    log_p_top = log_p_top.masked_fill(padding, math.log(torch.finfo(log_p_top.dtype).tiny))
    log_p = torch.cat([log_p_top, _log_clamped(p_tail)], dim=-1)
    return p, log_p


def make_buckets(p: Tensor, log_p: Tensor, log_q: Tensor) -> Buckets:
    """Bucket record from the teacher pair and the student log-probabilities [N, K+1]."""
    return Buckets(p=p, log_p=log_p, q=log_q.exp(), log_q=log_q)
