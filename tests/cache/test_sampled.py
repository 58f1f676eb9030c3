"""Sampled targets (`--targets sampled --samples N`): the distinct drawn ids with count / N (cache format 5,
stored as counts), unbiased (their mean is the teacher's softmax), seeded per shard (a redone shard writes the
same bytes), trained on as they are, refused where they make no sense."""

import hashlib

import numpy as np
import pytest
import torch

from tests.conftest import cache_config
from topkd.cache import TopKCache, build
from topkd.cache.format.engine_rows import EngineRows
from topkd.cache.format.sampled import distinct_counts, head_sampled


def test_distinct_counts_by_hand():
    draws = torch.tensor([[5, 3, 5, 9, 5, 3]])
    ids, logprobs = distinct_counts(draws, 6)
    # count descending, then id; padding takes the first id
    assert ids.tolist() == [[5, 3, 9, 5, 5, 5]]
    assert (
        np.allclose(np.exp(logprobs[0, :3].numpy()), [3 / 6, 2 / 6, 1 / 6])
        and np.isneginf(logprobs[0, 3:]).all()
    )


def test_the_targets_are_an_unbiased_estimate_of_the_teachers_softmax():
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(1, 8, generator=g).expand(4000, 8), torch.randn(30, 8, generator=g)
    rows = head_sampled(hidden, weight, None, 20, torch.Generator().manual_seed(1))
    estimate = np.zeros(30)
    for ids, lp in zip(rows.ids, rows.logprobs):
        real = np.isfinite(lp)
        np.add.at(estimate, ids[real], np.exp(lp[real]))
    exact = torch.softmax(hidden[0] @ weight.T, -1).numpy()
    # 4000 x 20 draws: the standard error is ~0.002
    assert np.abs(estimate / 4000 - exact).max() < 0.01
    assert np.allclose(
        np.exp(np.where(np.isfinite(rows.logprobs), rows.logprobs, -np.inf)).sum(1), 1.0
    )


def test_the_hybrid_keeps_the_head_exact_and_the_rest_unbiased():
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(1, 8, generator=g).expand(4000, 8), torch.randn(30, 8, generator=g)
    rows = head_sampled(hidden, weight, None, 20, torch.Generator().manual_seed(1), head=3)
    exact = torch.softmax(hidden[0] @ weight.T, -1).numpy()
    head = np.argsort(-exact)[:3]
    assert (rows.ids[:, :3] == head).all() and np.allclose(
        np.exp(rows.logprobs[:, :3]), exact[head]
    )
    estimate = np.zeros(30)
    for ids, lp in zip(rows.ids, rows.logprobs):
        real = np.isfinite(lp)
        # no id twice: the head is not drawn again
        assert len(set(ids[real].tolist())) == real.sum()
        np.add.at(estimate, ids[real], np.exp(lp[real]))
    assert np.abs(estimate / 4000 - exact).max() < 0.01 and np.allclose(rows.log_mass, 0, atol=1e-6)


def test_the_hybrid_row_whose_head_holds_all_the_mass_keeps_only_the_head():
    weight = torch.zeros(10, 2)
    weight[4, 0] = 1000.0  # p(4) = 1 in fp32: nothing left to draw from
    rows = head_sampled(torch.ones(2, 2), weight, None, 5, torch.Generator().manual_seed(0), head=2)
    assert rows.ids[:, 0].tolist() == [4, 4] and (rows.logprobs[:, 0] == 0).all()
    assert np.isneginf(rows.logprobs[:, 2:]).all()


def _digests(root):
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted((root / "shards").glob("*"))
    }


def test_a_sampled_cache_builds_reads_resumes_and_trains(teacher_dir, text_file, tmp_path):
    import os

    from tests.train.runs import config, losses
    from topkd.train import train

    cfg = cache_config(
        teacher_dir,
        text_file,
        tmp_path / "c",
        targets="sampled",
        samples=16,
        temperatures=[],
        max_sequences=12,
    )
    build(cfg)
    cache = TopKCache(str(tmp_path / "c"))
    assert cache.targets == "sampled" and cache.k == 16 and _layout(cache) == (6, "5")
    row = cache[0]
    real = torch.isfinite(row["teacher_logprobs"])
    assert (real.sum(1) >= 1).all() and (real.sum(1) < 16).any()  # rows of variable K
    assert torch.allclose(
        row["teacher_logprobs"].masked_fill(~real, -torch.inf).exp().sum(1),
        torch.ones(1),
        atol=1e-5,
    )
    before = _digests(tmp_path / "c")
    # a lost shard, redone on rerun
    os.remove(tmp_path / "c" / "shards" / "shard-00001.safetensors")
    build(cfg)
    # the shard's own seed: the same draws, the same bytes
    assert _digests(tmp_path / "c") == before
    train(config(str(tmp_path / "c"), tmp_path / "run", steps=3, seq_len=24))
    assert np.isfinite(losses(tmp_path / "run")).all()
    with pytest.raises(
        ValueError,
        match=r"sampled targets .* expected divergence kl\|jsd\|tvd, temperature 1 .*"
        r"got divergence=reverse_kl.*; pass --divergence kl",
    ):
        train(config(str(tmp_path / "c"), tmp_path / "rkl", steps=1, divergence="reverse_kl"))
    with pytest.raises(
        ValueError, match="--targets sampled: expected --engine hf and no --temperatures"
    ):
        build(
            cache_config(
                teacher_dir, text_file, tmp_path / "t", targets="sampled", temperatures=[2.0]
            )
        )
    with pytest.raises(ValueError, match="--head: expected only with --targets sampled"):
        build(cache_config(teacher_dir, text_file, tmp_path / "t", head=4))


def test_a_hybrid_cache_builds_and_trains(teacher_dir, text_file, tmp_path):
    from tests.train.runs import config, losses
    from topkd.train import train

    build(
        cache_config(
            teacher_dir,
            text_file,
            tmp_path / "c",
            targets="sampled",
            samples=12,
            head=4,
            temperatures=[],
            max_sequences=6,
        )
    )
    cache = TopKCache(str(tmp_path / "c"))
    assert (
        cache.targets == "sampled"
        and cache.k == 16
        and cache.manifest["build"]["targets"]["head"] == 4
    )
    assert _layout(cache) == (6, "5") and cache.verify() == []
    row = cache[0]
    real = torch.isfinite(row["teacher_logprobs"])
    assert (real.sum(1) >= 4).all()  # the head, then the distinct draws
    mass = row["teacher_logprobs"].masked_fill(~real, -torch.inf).exp().sum(1)
    assert torch.allclose(mass, torch.ones(1), atol=1e-4)
    train(config(str(tmp_path / "c"), tmp_path / "run", steps=2, seq_len=24))
    assert np.isfinite(losses(tmp_path / "run")).all()


def test_adaptive_rows_keep_the_fewest_entries_reaching_the_mass_by_hand():
    from topkd.cache.format.adaptive import adaptive_rows

    p = np.array([[0.6, 0.3, 0.05, 0.03]])
    rows = EngineRows(
        ids=np.array([[4, 9, 1, 7]]),
        logprobs=np.log(p).astype(np.float32),
        log_mass=np.log(p.sum(1)).astype(np.float32),
        log_tail=np.log([0.02]).astype(np.float32),
        logz=np.zeros((1, 0), np.float32),
        log_mass_t=np.zeros((1, 0), np.float32),
    )
    cut = adaptive_rows(rows, top_p=0.85, min_k=1)  # 0.6 < 0.85 <= 0.6 + 0.3: two entries
    assert cut.ids.tolist() == [[4, 9, 4, 4]] and np.isneginf(cut.logprobs[0, 2:]).all()
    # 0.02 + the dropped 0.05 + 0.03
    assert np.exp(cut.log_tail[0]) == pytest.approx(0.10, rel=1e-6)
    assert np.exp(cut.log_mass[0]) == pytest.approx(0.90, rel=1e-6)
    # at least M kept
    assert np.isfinite(adaptive_rows(rows, top_p=0.85, min_k=3).logprobs[0, :3]).all()


def test_an_adaptive_cache_keeps_the_tail_exact_and_trains_tempered(
    teacher_dir, text_file, tmp_path
):
    from tests.train.runs import config, losses
    from topkd.train import train

    build(
        cache_config(
            teacher_dir,
            text_file,
            tmp_path / "c",
            targets="topp",
            top_p=0.9,
            min_k=2,
            k=16,
            max_sequences=8,
        )
    )
    cache = TopKCache(str(tmp_path / "c"))
    assert cache.targets == "topp" and _layout(cache) == (6, "5")
    row = cache[1]
    real = torch.isfinite(row["teacher_logprobs"])
    assert (real.sum(1) >= 2).all() and (real.sum(1) < 16).any()
    head = row["teacher_logprobs"].double().masked_fill(~real, -torch.inf).exp().sum(1)
    # kept mass + the stored tail: the whole distribution
    assert torch.allclose(
        head + row["log_tail"].double().exp(), torch.ones(len(head), dtype=torch.float64), atol=1e-5
    )
    train(
        config(
            str(tmp_path / "c"),
            tmp_path / "run",
            steps=2,
            seq_len=24,
            temperature=2.0,
            tail="bucket",
        )
    )
    assert np.isfinite(losses(tmp_path / "run")).all()


def _layout(cache) -> tuple[int, str]:
    """A built cache's format version (6: text recorded) and the layout its rows use."""
    return cache.manifest["format_version"], cache.shard(0).meta["layout_version"]
