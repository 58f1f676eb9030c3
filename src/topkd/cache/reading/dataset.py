"""TopKDataset and EpochSampler: topkd's training samples of a cache as a map-style torch Dataset, for any trainer.

    from topkd import EpochSampler, TopKDataset, collate     # (homes: topkd.cache.reading.dataset, topkd.data.samples)

    data = TopKDataset("runs/cache", seq_len=2048, seed=0)        # a path or a TopKCache; temperature=T: tempered KD
    sampler = EpochSampler(data)                                              # sampler.set_epoch(e) per epoch
    loader = torch.utils.data.DataLoader(data, batch_size=8, sampler=sampler, collate_fn=collate, num_workers=4)

data[i] is exactly sample i of `topkd train` with the same cache, seq_len, packing and seed (SampleStream:
seeded order, re-slicing, positions restarting at documents, no loss across documents). len(data) is one
epoch; an index beyond it addresses a later epoch (its own seeded order), as topkd train's counter does.
Read it in order (the order is already the seeded one: a shuffling sampler would only repeat that work):
EpochSampler yields epoch e's indices. Each item is a dict of tensors over its L rows (L <= seq_len):

    input_ids [L], position_ids [L]       the student's inputs (positions restart at every document)
    labels [L]                            next-token ids for cross entropy, -100 where none is taken
    kd_mask [L]                           True where the KD loss counts the row
    teacher_ids [L, K], teacher_logprobs [L, K]    the teacher's top-K
    teacher_logz [L]                      c_T for temperature T (only when built with temperature=T)

collate(items) pads them to the longest (labels -100, kd_mask False, positions continuing) and stacks.
The source is read lazily and is fork-safe (a TopKCache reopens its files per process), so DataLoader
workers each decode their own samples.
"""

from __future__ import annotations

import os

import torch

from topkd.cache.reading.reader import TopKCache
from topkd.data.samples import SampleStream, SequenceSource, logz_column, missing_members

__all__ = ["EpochSampler", "TopKDataset"]


class TopKDataset(torch.utils.data.Dataset):
    """Samples of a top-K cache (or any SequenceSource), as `topkd train` forms them; see the module docstring."""

    def __init__(
        self,
        cache: SequenceSource | str,
        seq_len: int | None = None,
        packing: str = "documents",
        seed: int = 0,
        temperature: float | None = None,
    ):
        cache = _source(cache)
        lengths = cache.sequence_lengths()
        if not lengths:
            raise ValueError(
                "TopKDataset: expected a cache with sequences, got an empty one; build it first"
            )
        seq_len = max(lengths) if seq_len is None else seq_len
        if not isinstance(seq_len, int) or seq_len < 2:
            raise ValueError(
                f"TopKDataset seq_len: expected an int >= 2 (or None: the cache's), got {seq_len!r}"
            )
        self.stream = SampleStream(cache, seq_len, seed, logz_column(cache, temperature), packing)
        self.vocab_size: int = cache.vocab_size  # the teacher's (student rows beyond it: padding)
        self.temperature = temperature  # the T whose c_T the items carry (teacher_logz); KDTrainer takes it from here

    def __len__(self) -> int:
        return self.stream.per_epoch

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if index < 0:
            raise IndexError(
                f"TopKDataset: expected an index >= 0 (index // len is the epoch), got {index}"
            )
        return self.stream.item(int(index))


def _source(cache) -> SequenceSource:
    """A cache directory's path becomes its TopKCache; a TopKCache or other sequence source is taken as it is."""
    if isinstance(cache, (str, os.PathLike)):
        return TopKCache(os.fspath(cache))
    missing = missing_members(cache)
    if missing:
        lacks = ", ".join(missing[:3]) + (", ..." if len(missing) > 3 else "")
        raise TypeError(
            "TopKDataset: expected a cache directory's path, a TopKCache or another SequenceSource, "
            f"got {type(cache).__name__} (without {lacks}); pass TopKDataset('runs/cache') or "
            "TopKDataset(TopKCache(path))"
        )
    return cache


class EpochSampler(torch.utils.data.Sampler):
    """The indices of one epoch of a TopKDataset, in order; set_epoch(e) moves to epoch e (transformers.Trainer
    calls it). With num_replicas > 1 each process takes every num_replicas-th index from rank on."""

    def __init__(self, dataset: TopKDataset, num_replicas: int = 1, rank: int = 0):
        self.per_epoch, self.num_replicas, self.rank, self.epoch = (
            len(dataset),
            num_replicas,
            rank,
            0,
        )

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __iter__(self):
        first = self.epoch * self.per_epoch
        return iter(range(first + self.rank, first + self.per_epoch, self.num_replicas))

    def __len__(self) -> int:
        return len(range(self.rank, self.per_epoch, self.num_replicas))
