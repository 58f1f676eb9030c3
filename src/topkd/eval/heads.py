"""Per-token statistics of a model's next-token distribution, computed over row chunks: [N, V] never exists.

    stats = head_stats(hidden, weight, bias, targets=next_ids, teacher_ids=ids)
    stats["target_logprob"], stats["argmax"]            # [N]
    stats["logprobs_at_teacher_ids"]                     # [N, K]: the model's log-probs of the teacher's ids

The chunk's logits are fp32 (any hidden dtype), with Gemma-style soft-capping when the model
has it, so the numbers are those of the model's own softmax.
"""
from __future__ import annotations

import torch
from torch import Tensor

from topkd.models import logit_chunks

CHUNK_BYTES = 128 * 2**20


@torch.no_grad()
def head_stats(hidden: Tensor, weight: Tensor, bias: Tensor | None = None, *, targets: Tensor | None = None,
               teacher_ids: Tensor | None = None, softcap: float | None = None,
               chunk_bytes: int = CHUNK_BYTES) -> dict[str, Tensor]:
    """hidden [N, H]; targets [N] (ids, any value where unused); teacher_ids [N, K]."""
    vocab = weight.shape[0]
    out: dict[str, list[Tensor]] = {"argmax": []}
    if targets is not None:
        out["target_logprob"] = []
    if teacher_ids is not None:
        out["logprobs_at_teacher_ids"] = []
    for a, z in logit_chunks(hidden, weight, bias, softcap, chunk_bytes):
        rows = z.shape[0]
        logp = torch.log_softmax(z, dim=-1)
        out["argmax"].append(logp.argmax(dim=-1))
        if targets is not None:
            out["target_logprob"].append(logp.gather(1, targets[a:a + rows, None].clamp(0, vocab - 1)).squeeze(1))
        if teacher_ids is not None:
            out["logprobs_at_teacher_ids"].append(logp.gather(1, teacher_ids[a:a + rows].long()))
    return {name: torch.cat(parts) if parts else torch.zeros(0) for name, parts in out.items()}
