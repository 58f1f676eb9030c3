"""topkd.loss: the fused top-K distillation loss and its two baselines (see docs/loss.md)."""

from topkd.loss.api import KERNELS_ENV, KDLoss, fused_linear_kd, kd_loss
from topkd.loss.divergences import DIVERGENCES, Buckets
from topkd.loss.fused import DEFAULT_CHUNK_BYTES, chunk_rows, release_workspace
from topkd.loss.options import LossOptions
from topkd.loss.parts import loss_parts
from topkd.loss.vocab_parallel import VocabParallel

__all__ = [
    "fused_linear_kd",
    "kd_loss",
    "KDLoss",
    "LossOptions",
    "loss_parts",
    "VocabParallel",
    "DIVERGENCES",
    "Buckets",
    "release_workspace",
    "DEFAULT_CHUNK_BYTES",
    "KERNELS_ENV",
    "chunk_rows",
]
