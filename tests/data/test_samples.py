"""Training samples from the cache: every row once per epoch, document-aware positions, masks, labels."""

import numpy as np
import pytest
import torch

from topkd.cache import TopKCache
from topkd.data.samples import SampleStream, logz_column
from topkd.loss.options import LossOptions


# the cache's, shorter (split), longer (concatenated)
@pytest.mark.parametrize("seq_len", [48, 20, 100])
def test_an_epoch_covers_every_cached_row_once(built_cache, seq_len):
    cache = TopKCache(built_cache)
    stream = SampleStream(cache, seq_len, seed=3)
    rows = sum(len(cache[i]["input_ids"]) for i in range(len(cache)))
    pieces = [p for s in stream.plan(0) for p in s]
    assert sum(e - a for _, a, e in pieces) == rows == cache.tokens
    assert all(sum(e - a for _, a, e in s) == seq_len for s in stream.plan(0)[:-1])
    assert sorted({i for i, _, _ in pieces}) == list(range(len(cache)))
    # the seed decides the order
    assert stream.plan(0) != SampleStream(cache, seq_len, seed=4).plan(0)


def test_positions_restart_and_boundaries_carry_no_loss(built_cache):
    cache = TopKCache(built_cache)
    stream = SampleStream(cache, 100, seed=0)
    sample, pieces = stream.sample(0), stream.locate(0)
    first_len = pieces[0][2] - pieces[0][1]
    assert sample["position_ids"][first_len] == 0  # a new cached sequence starts a fresh context
    sep = cache.manifest["build"]["separator"]
    # the separator row predicts another document
    assert not sample["kd_mask"][sample["input_ids"] == sep].any()
    assert sample["labels"][first_len - 1] == -100  # the next token of a piece is unknown
    inside = torch.arange(first_len - 1)
    expected = torch.where(sample["kd_mask"][inside], sample["input_ids"][inside + 1], -100)
    assert torch.equal(sample["labels"][inside], expected)


def test_short_last_sample_is_padded_and_masked(built_cache):
    cache = TopKCache(built_cache)
    stream = SampleStream(cache, 1000, seed=0)
    last = stream.sample(len(stream.plan(0)) - 1)
    real = cache.tokens % 1000
    assert (
        last["input_ids"].shape == (1000,)
        and not last["kd_mask"][real:].any()
        and last["kd_mask"][:real].any()
    )
    assert (last["labels"][real:] == -100).all()


def test_tempered_bucket_needs_the_stored_normaliser(built_cache):
    cache = TopKCache(built_cache)
    assert logz_column(cache, LossOptions(temperature=2.0).logz_temperature) == 0
    assert logz_column(cache, LossOptions(temperature=3.0, tail="renorm").logz_temperature) is None
    with pytest.raises(ValueError, match="rebuild the cache with --temperatures 3"):
        logz_column(cache, LossOptions(temperature=3.0).logz_temperature)


def test_document_starts_come_from_the_headers_as_decoding_finds_them(documents_cache):
    starts = documents_cache.document_starts()
    assert len(starts) == len(documents_cache) and sum(len(s) for s in starts) > len(
        documents_cache
    )
    for i, s in enumerate(starts):
        assert s[0] == 0 and np.array_equal(s, documents_cache[i]["doc_starts"].numpy())


def test_unpacked_samples_hold_one_document_each_padded_to_the_batch(documents_cache):
    stream = SampleStream(documents_cache, 30, seed=1, packing="none")
    pieces = [p for sample in stream.plan(0) for p in sample]
    assert all(
        len(sample) == 1 and 0 < e - a <= 30 for sample in stream.plan(0) for _, a, e in sample
    )
    # every row once, nothing dropped
    assert sum(e - a for _, a, e in pieces) == documents_cache.tokens
    starts = documents_cache.document_starts()
    for i, a, e in pieces:  # a piece never crosses a document start
        assert not ((starts[i] > a) & (starts[i] < e)).any()
    batch = stream.batch(0, 4)
    lengths = [e - a for i in range(4) for _, a, e in stream.locate(i)]
    assert batch["input_ids"].shape == (4, max(lengths))  # padded to the longest, not to seq_len
    for row, n in enumerate(lengths):
        assert batch["position_ids"][row, 0] == 0 and not batch["kd_mask"][row, n:].any()
        # one document: no restart
        assert torch.equal(batch["position_ids"][row, :n], torch.arange(n))


def test_cross_packing_keeps_samples_and_masks_but_attends_across_documents(documents_cache):
    packed, cross = (
        SampleStream(documents_cache, 100, 0),
        SampleStream(documents_cache, 100, 0, packing="cross"),
    )
    a, b = packed.batch(0, 2), cross.batch(0, 2)
    for name in ("input_ids", "kd_mask", "labels", "teacher_ids", "teacher_logprobs"):
        assert torch.equal(a[name], b[name])
    assert torch.equal(b["position_ids"], torch.arange(100).expand(2, -1))
    # the documents packing restarts somewhere in these samples
    assert (a["position_ids"][:, 1:] == 0).any()
    with pytest.raises(ValueError, match="packing: expected one of"):
        SampleStream(documents_cache, 100, 0, packing="padded")


def test_short_samples_are_padded_to_the_batch_longest_not_to_seq_len(built_cache):
    # 1,774 tokens: the 18th sample has 74
    stream = SampleStream(TopKCache(built_cache), seq_len=100, seed=0)
    assert stream.per_epoch == 18
    last = stream.batch(17, 1)
    assert last["input_ids"].shape == (1, 74) and bool(last["kd_mask"].any())
    assert stream.batch(16, 2)["input_ids"].shape == (2, 100)


def test_the_protocol_lists_every_member_and_both_sources_have_them(
    built_cache, teacher_dir, text_file
):
    from topkd.cache.building.teacher import load_teacher
    from topkd.data.samples import SOURCE_MEMBERS, SequenceSource, missing_members
    from topkd.train.online import OnlineTeacher

    declared = set(SequenceSource.__annotations__) | {
        name
        for name, v in vars(SequenceSource).items()
        if callable(v)
        and name in ("__len__", "__getitem__")
        or callable(v)
        and not name.startswith("_")
    }
    assert set(SOURCE_MEMBERS) == declared
    online = OnlineTeacher(load_teacher(teacher_dir), [text_file], seq_len=32, k=4, temperatures=[])
    assert missing_members(TopKCache(built_cache)) == [] and missing_members(online) == []
    assert online.targets == "topk" and online.tokens == online.counted_tokens == sum(
        online.sequence_lengths()
    )
    assert missing_members(object())[:2] == ["path", "vocab_size"]
