"""topkd.cache.reading.dataset: TopKDataset and EpochSampler (with collate): topkd train's samples, in its order,
through a plain DataLoader (workers included); padding, the temperature column, epochs and refusals."""

import pytest
import torch

from topkd import EpochSampler, TopKDataset, collate
from topkd.cache import TopKCache
from topkd.data.samples import SampleStream

KEYS = {"input_ids", "position_ids", "labels", "kd_mask", "teacher_ids", "teacher_logprobs"}


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("packing", ["documents", "none"])
def test_items_are_topkd_trains_samples_in_its_order(built_cache, packing):
    cache = TopKCache(built_cache)
    data = TopKDataset(cache, seq_len=20, packing=packing, seed=3)
    stream = SampleStream(TopKCache(built_cache), 20, 3, packing=packing)  # what topkd train reads
    assert len(data) == stream.per_epoch and set(data[0]) == KEYS
    for first in (0, 4, len(data) - 2, len(data) + 1):  # the last one is in the second epoch
        assert _equal(collate([data[i] for i in range(first, first + 3)]), stream.batch(first, 3))
    item = data[1]
    n = len(item["input_ids"])
    assert item["teacher_ids"].shape == (n, cache.k) and item["kd_mask"].dtype == torch.bool


def test_a_dataloader_with_workers_gives_the_same_batches(built_cache):
    data = TopKDataset(TopKCache(built_cache), seq_len=17, seed=1)
    sampler = EpochSampler(data)
    sampler.set_epoch(1)
    plain = list(
        torch.utils.data.DataLoader(data, batch_size=3, sampler=sampler, collate_fn=collate)
    )
    forked = list(
        torch.utils.data.DataLoader(
            data, batch_size=3, sampler=sampler, collate_fn=collate, num_workers=2
        )
    )
    assert len(plain) == len(forked) == -(-len(data) // 3)
    assert all(_equal(a, b) for a, b in zip(plain, forked))
    stream = SampleStream(TopKCache(built_cache), 17, 1)
    assert _equal(plain[0], stream.batch(len(data), 3))  # epoch 1 starts at global sample len(data)


def test_collate_pads_to_the_longest_with_nothing_counted():
    def item(n):
        return {
            "input_ids": torch.arange(n),
            "position_ids": torch.arange(n),
            "labels": torch.arange(n),
            "kd_mask": torch.ones(n, dtype=torch.bool),
            "teacher_ids": torch.zeros(n, 4, dtype=torch.long),
            "teacher_logprobs": torch.zeros(n, 4),
        }

    batch = collate([item(3), item(5)])
    assert batch["input_ids"].shape == (2, 5) and batch["teacher_ids"].shape == (2, 5, 4)
    assert batch["labels"][0, 3:].tolist() == [-100, -100] and not batch["kd_mask"][0, 3:].any()
    # positions continue: padding is well-formed
    assert batch["position_ids"][0].tolist() == [0, 1, 2, 3, 4]
    assert batch["teacher_ids"][0, 3].tolist() == [0, 1, 2, 3]  # distinct ids on padded rows
    with pytest.raises(ValueError, match="collate: expected at least one sample"):
        collate([])
    # a dataset of lists (e.g. read back from JSON)
    as_lists = {k: v.tolist() for k, v in item(3).items()}
    with pytest.raises(
        ValueError, match="sample 1: expected torch tensors, got input_ids: list.*TopKDataset"
    ):
        collate([item(3), as_lists])
    # would attend across documents
    no_positions = {k: v for k, v in item(3).items() if k != "position_ids"}
    with pytest.raises(
        ValueError, match=r"got none of \['position_ids'\].*keeping attention inside it"
    ):
        collate([no_positions])
    with pytest.raises(ValueError, match="expected a dict of tensors .*got list"):
        collate([[1, 2, 3]])


def test_teacher_logz_only_for_a_stored_temperature(built_cache):
    cache = TopKCache(built_cache)  # built with --temperatures 2
    assert "teacher_logz" not in TopKDataset(cache, seq_len=20)[0]
    item = TopKDataset(cache, seq_len=20, temperature=2.0)[0]
    assert item["teacher_logz"].shape == item["input_ids"].shape
    with pytest.raises(ValueError, match=r"temperature 3.0 .* temperatures \[2.0\]; rebuild"):
        TopKDataset(cache, temperature=3.0)


def test_refusals(built_cache):
    cache = TopKCache(built_cache)
    assert len(TopKDataset(built_cache)) == len(TopKDataset(cache))  # a path is opened as its cache
    with pytest.raises(
        TypeError,
        match="expected a cache directory's path, a TopKCache or another SequenceSource, got dict \\(without path",
    ):
        TopKDataset({"input_ids": [1, 2]})
    assert len(TopKDataset(cache)) == len(TopKDataset(cache, seq_len=max(cache.sequence_lengths())))
    with pytest.raises(ValueError, match="seq_len: expected an int >= 2"):
        TopKDataset(cache, seq_len=1)
    with pytest.raises(ValueError, match="packing: expected one of"):
        TopKDataset(cache, packing="zip")
    with pytest.raises(IndexError, match="expected an index >= 0"):
        TopKDataset(cache)[-1]
