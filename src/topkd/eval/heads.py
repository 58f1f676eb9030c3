"""Per-token statistics of a model's next-token distribution, and of two models' (a student and its teacher), computed
over row chunks: [N, V] never exists.

    stats = head_stats(hidden, weight, bias, targets=next_ids, teacher_ids=ids)
    stats["target_logprob"], stats["argmax"], stats["max_logprob"]   # [N]: top-1 and its log-prob
    stats["logprobs_at_teacher_ids"]                     # [N, K]: the model's log-probs of the teacher's ids
    pair = paired_divergences(h_student, head_student, h_teacher, head_teacher)   # full-vocabulary KL, TVD [N]

The chunk's logits are fp32 (any hidden dtype), with Gemma-style soft-capping when the model
has it, so the numbers are those of the model's own softmax.
"""

from __future__ import annotations

import torch
from torch import Tensor

from topkd.models import logit_chunks

CHUNK_BYTES = 128 * 2**20


@torch.no_grad()
def head_stats(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    *,
    targets: Tensor | None = None,
    teacher_ids: Tensor | None = None,
    softcap: float | None = None,
    chunk_bytes: int = CHUNK_BYTES,
) -> dict[str, Tensor]:
    """hidden [N, H]; targets [N] (ids, any value where unused); teacher_ids [N, K]."""
    vocab = weight.shape[0]
    out: dict[str, list[Tensor]] = {"argmax": [], "max_logprob": []}
    if targets is not None:
        out["target_logprob"] = []
    if teacher_ids is not None:
        out["logprobs_at_teacher_ids"] = []
    for a, z in logit_chunks(hidden, weight, bias, softcap, chunk_bytes):
        rows = z.shape[0]
        logp = torch.log_softmax(z, dim=-1)
        top = logp.max(dim=-1)
        out["argmax"].append(top.indices)
        out["max_logprob"].append(top.values)
        if targets is not None:
            out["target_logprob"].append(
                logp.gather(1, targets[a : a + rows, None].clamp(0, vocab - 1)).squeeze(1)
            )
        if teacher_ids is not None:
            out["logprobs_at_teacher_ids"].append(logp.gather(1, teacher_ids[a : a + rows].long()))
    return {name: torch.cat(parts) if parts else torch.zeros(0) for name, parts in out.items()}


@torch.no_grad()
def paired_divergences(
    student_hidden: Tensor,
    student_head: tuple,
    teacher_hidden: Tensor,
    teacher_head: tuple,
    chunk_bytes: int = CHUNK_BYTES,
) -> dict[str, Tensor]:
    """Per row, over the whole vocabulary (fp32 logits of both models, row chunks; [N, V] never exists):
    kl = KL(teacher || student) and tvd = 1/2 sum_v |p_v - q_v| (acceptance of speculative decoding: 1 - tvd).
    A head is (weight [V, H], bias or None, softcap or None); both heads have the teacher's V rows."""
    if student_head[0].shape[0] != teacher_head[0].shape[0]:
        raise ValueError(
            f"paired_divergences: expected heads of one vocabulary, got {student_head[0].shape[0]} "
            f"and {teacher_head[0].shape[0]} rows"
        )
    kl, tvd = [], []
    pairs = zip(
        # same V: the same row chunks
        logit_chunks(student_hidden, *student_head, chunk_bytes // 2),
        logit_chunks(teacher_hidden, *teacher_head, chunk_bytes // 2),
    )
    for (_, zs), (_, zt) in pairs:
        logq, logp = torch.log_softmax(zs, dim=-1), torch.log_softmax(zt, dim=-1)
        p = logp.exp()
        kl.append((p * (logp - logq)).sum(dim=-1).clamp_min(0))  # p = 0 entries add exactly 0
        tvd.append(0.5 * (p - logq.exp()).abs().sum(dim=-1))
    empty = torch.zeros(0)
    return {"kl": torch.cat(kl) if kl else empty, "tvd": torch.cat(tvd) if tvd else empty}
