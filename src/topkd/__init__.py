"""topkd: memory-efficient LLM knowledge distillation from an offline top-K teacher cache.

from topkd import TopKDataset, EpochSampler, collate, fused_linear_kd   # the cache's samples, the fused loss
"""

from topkd.base.version import __version__
from topkd.cache.reading.dataset import EpochSampler, TopKDataset
from topkd.data.samples import collate
from topkd.loss import KDLoss, LossOptions, fused_linear_kd, kd_loss

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
