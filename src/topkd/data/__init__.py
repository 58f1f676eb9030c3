"""topkd.data: documents and samples, the data concerns every layer shares (cache build, training, evaluation).

    topkd.data.documents   text / .jsonl / token-id files -> documents -> packed sequences, position ids
    topkd.data.samples     SampleStream: seeded samples of any length over a sequence source (a TopKCache,
                           or a teacher run on the fly), with document masks and restarting positions
                           and collate, which pads a list of them into a batch

It imports nothing from the other topkd layers: a sequence source is anything with the methods
SampleStream reads (topkd.data.samples.SequenceSource). Those samples of a cache as a torch Dataset are
topkd.cache.reading.dataset's TopKDataset (it opens a path as a TopKCache, so it sits in the cache layer).
"""

from topkd.data.samples import collate

__all__ = ["collate"]


def __getattr__(name: str):
    if name in ("TopKDataset", "EpochSampler"):  # their home until 0.1.0's layering pass
        raise AttributeError(
            f"topkd.data.{name}: expected it in topkd.cache (it opens a cache's path), got the old "
            f"spelling; use `from topkd import {name}` (or `from topkd.cache import {name}`)"
        )
    raise AttributeError(f"module 'topkd.data' has no attribute {name!r}")
