"""The teacher top-K cache: build once (`build`), read anywhere (`TopKCache`). Format: docs/cache-format.md."""

from topkd.cache.building.build import build
from topkd.cache.building.build_config import CacheBuildConfig
from topkd.cache.format.manifest import CacheError
from topkd.cache.reading.dataset import EpochSampler, TopKDataset
from topkd.cache.reading.inspect import inspect_cache, verify_cache
from topkd.cache.reading.reader import TopKCache

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
