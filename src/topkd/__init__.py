"""topkd: memory-efficient LLM knowledge distillation from an offline top-K teacher cache."""

import topkd.cache.reader  # noqa: F401  (it teaches TopKDataset to open a cache's path)
from topkd.loss import KDLoss, LossOptions, fused_linear_kd, kd_loss
from topkd.version import __version__

__all__ = ["fused_linear_kd", "kd_loss", "KDLoss", "LossOptions", "__version__"]
