"""topkd.loss: the fused top-K distillation loss and its two baselines (see docs/loss.md)."""
from topkd.loss.api import KDLoss, fused_linear_kd
from topkd.loss.divergences import DIVERGENCES, Buckets
from topkd.loss.fused import release_workspace
from topkd.loss.options import LossOptions
from topkd.loss.vocab_parallel import VocabParallel

__all__ = ["fused_linear_kd", "KDLoss", "LossOptions", "VocabParallel", "DIVERGENCES", "Buckets",
           "release_workspace"]
