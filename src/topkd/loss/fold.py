"""Teacher ids a smaller student head cannot represent, folded into the tail bucket (--fold-beyond-vocab).

    weight, bias, ids, logprobs = fold_beyond(weight, bias, ids, logprobs)   # then any top-K loss or metric

Training (topkd/train/student.py:batch_loss) and evaluation against a cache (topkd/eval/vs_cache.py) both fold
the same way, so a student trained with --fold-beyond-vocab is scored on the distribution it learned.
"""

from __future__ import annotations

import torch

FOLDED_LOGIT = -1e4  # exp underflows to exactly 0 in fp32, while its log stays finite (no 0 * inf)


def fold_beyond(
    weight: torch.Tensor, bias: torch.Tensor | None, ids: torch.Tensor, logprobs: torch.Tensor
):
    """Teacher ids beyond the student's vocabulary folded into the tail bucket, exactly: each such entry points
    to a phantom head row whose logit is FOLDED_LOGIT (student probability 0) and gets teacher probability 0, so
    its teacher mass lands in the tail (1 - the kept mass) and no student mass moves. Costs a copy of the head
    weight with up to K extra rows, only in batches that hold such ids."""
    vocab = weight.shape[0]
    beyond = ids >= vocab
    if not bool(beyond.any()):
        return weight, bias, ids, logprobs
    extra = int(beyond.sum(-1).max())
    ids = torch.where(beyond, vocab + beyond.cumsum(-1) - 1, ids)  # distinct phantom rows per token
    logprobs = torch.where(beyond, torch.full_like(logprobs, FOLDED_LOGIT), logprobs)
    weight = torch.cat([weight, weight.new_zeros(extra, weight.shape[1])])
    base = bias if bias is not None else weight.new_zeros(vocab)
    return weight, torch.cat([base, base.new_full((extra,), FOLDED_LOGIT)]), ids, logprobs
