"""topkd.loss: the fused top-K distillation loss and its two baselines (see docs/loss.md)."""
from topkd.loss.api import KDLoss, fused_linear_kd
from topkd.loss.divergences import DIVERGENCES, Buckets
from topkd.loss.fused import release_workspace

__all__ = ["fused_linear_kd", "KDLoss", "DIVERGENCES", "Buckets", "release_workspace"]
