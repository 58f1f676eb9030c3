"""topkd: memory-efficient LLM knowledge distillation from an offline top-K teacher cache.

from topkd import TopKDataset, EpochSampler, collate, fused_linear_kd   # the cache's samples, the fused loss
"""

from topkd.cache.dataset import EpochSampler, TopKDataset
from topkd.data.samples import collate
from topkd.loss import KDLoss, LossOptions, fused_linear_kd, kd_loss
from topkd.version import __version__

__all__ = [
    "EpochSampler",
    "KDLoss",
    "LossOptions",
    "TopKDataset",
    "__version__",
    "collate",
    "fused_linear_kd",
    "kd_loss",
]
