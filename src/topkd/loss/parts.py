"""loss_parts: the KD and CE parts of the losses computed inside a `with` block, for logging.

    with loss_parts() as parts:
        loss = fused_linear_kd(hidden, weight, ids, logprobs, labels=labels, ce_weight=0.1, reduction="sum")
    parts["kd"], parts["ce"]     # detached tensors: the KD term, and the (unweighted) CE term, reduced as the loss

loss == parts["kd"] + ce_weight * parts["ce"]. Every impl reduces through one function
(topkd.loss.fused.reduce_per_token), which adds its terms here when a block is open: no extra pass over the
vocabulary and no host sync. Outside a block nothing is recorded. reduction="none" records nothing.
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar

import torch

_OPEN: ContextVar[dict | None] = ContextVar("topkd_loss_parts", default=None)


@contextlib.contextmanager
def loss_parts():
    parts = {"kd": torch.zeros(()), "ce": torch.zeros(())}
    token = _OPEN.set(parts)
    try:
        yield parts
    finally:
        _OPEN.reset(token)


def record(kd: torch.Tensor, ce: torch.Tensor | None) -> None:
    """Called by the reduction with the KD term and the unweighted CE term (None without labels)."""
    parts = _OPEN.get()
    if parts is None:
        return
    parts["kd"] = parts["kd"].to(kd.device) + kd.detach().float()
    if ce is not None:
        parts["ce"] = parts["ce"].to(ce.device) + ce.detach().float()
