"""Training samples from the cache: every row once per epoch, document-aware positions, masks, labels."""
import pytest
import torch

from topkd.cache import TopKCache
from topkd.train.batches import SampleStream, logz_column


@pytest.mark.parametrize("seq_len", [48, 20, 100])  # the cache's, shorter (split), longer (concatenated)
def test_an_epoch_covers_every_cached_row_once(built_cache, seq_len):
    cache = TopKCache(built_cache)
    stream = SampleStream(cache, seq_len, seed=3)
    rows = sum(len(cache[i]["input_ids"]) for i in range(len(cache)))
    pieces = [p for s in stream.plan(0) for p in s]
    assert sum(e - a for _, a, e in pieces) == rows == cache.tokens
    assert all(sum(e - a for _, a, e in s) == seq_len for s in stream.plan(0)[:-1])
    assert sorted({i for i, _, _ in pieces}) == list(range(len(cache)))
    assert stream.plan(0) != SampleStream(cache, seq_len, seed=4).plan(0)  # the seed decides the order


def test_positions_restart_and_boundaries_carry_no_loss(built_cache):
    cache = TopKCache(built_cache)
    stream = SampleStream(cache, 100, seed=0)
    sample, pieces = stream.sample(0), stream.locate(0)
    first_len = pieces[0][2] - pieces[0][1]
    assert sample["position_ids"][first_len] == 0  # a new cached sequence starts a fresh context
    sep = cache.manifest["build"]["separator"]
    assert not sample["mask"][sample["input_ids"] == sep].any()  # the separator row predicts another document
    assert sample["labels"][first_len - 1] == -100  # the next token of a piece is unknown
    inside = torch.arange(first_len - 1)
    expected = torch.where(sample["mask"][inside], sample["input_ids"][inside + 1], -100)
    assert torch.equal(sample["labels"][inside], expected)


def test_short_last_sample_is_padded_and_masked(built_cache):
    cache = TopKCache(built_cache)
    stream = SampleStream(cache, 1000, seed=0)
    last = stream.sample(len(stream.plan(0)) - 1)
    real = cache.tokens % 1000
    assert last["input_ids"].shape == (1000,) and not last["mask"][real:].any() and last["mask"][:real].any()
    assert (last["labels"][real:] == -100).all()


def test_tempered_bucket_needs_the_stored_normaliser(built_cache):
    cache = TopKCache(built_cache)
    assert logz_column(cache, 2.0, "bucket") == 0 and logz_column(cache, 3.0, "renorm") is None
    with pytest.raises(ValueError, match="rebuild the cache with --temperatures 3"):
        logz_column(cache, 3.0, "bucket")
