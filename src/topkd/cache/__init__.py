"""The teacher top-K cache: build once (`build`), read anywhere (`TopKCache`). Format: docs/cache-format.md."""

from topkd.cache.build import build
from topkd.cache.build_config import CacheBuildConfig
from topkd.cache.dataset import EpochSampler, TopKDataset
from topkd.cache.inspect import inspect_cache, verify_cache
from topkd.cache.manifest import CacheError
from topkd.cache.reader import TopKCache

__all__ = [
    "CacheBuildConfig",
    "CacheError",
    "EpochSampler",
    "TopKCache",
    "TopKDataset",
    "build",
    "inspect_cache",
    "verify_cache",
]
