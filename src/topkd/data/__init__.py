"""topkd.data: documents and samples, the data concerns every layer shares (cache build, training, evaluation).

    topkd.data.documents   text / .jsonl / token-id files -> documents -> packed sequences, position ids
    topkd.data.samples     SampleStream: seeded samples of any length over a sequence source (a TopKCache,
                           or a teacher run on the fly), with document masks and restarting positions
    topkd.data.dataset     TopKDataset and collate: those samples as a torch Dataset, for any trainer

It imports nothing from the other topkd layers: a sequence source is anything with the methods
SampleStream reads (topkd.data.samples.SequenceSource).
"""

from topkd.data.dataset import EpochSampler, TopKDataset, collate

__all__ = ["EpochSampler", "TopKDataset", "collate"]
