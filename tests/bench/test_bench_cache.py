"""`topkd bench cache` on the tiny teacher: the codec study and the target arms (topk, sampled, topp) run end to
end, report what they measured, and clean up after themselves."""

import json
import os

import pytest

from topkd.bench.cache import CacheBenchConfig, run_cache_bench


def test_bench_cache_measures_every_codec_and_target_arm(teacher_dir, text_file, tmp_path):
    cfg = CacheBenchConfig(
        teacher=teacher_dir,
        data=[text_file],
        out=str(tmp_path / "b"),
        seq_len=32,
        k=8,
        sequences=6,
        batch_size=3,
        samples=16,
        top_p=0.9,
        min_k=2,
    )
    result = run_cache_bench(cfg)
    assert set(result["codecs"]) == {"rice-zstd", "rice", "packed"}
    arms = result["targets"]
    assert set(arms) == {"top-8", "sampled N=16", "top-p 0.9"}
    # every arm's cache is built from text: version 6 (the text recorded) over its own layout
    assert arms["top-8"]["format_version"] == arms["sampled N=16"]["format_version"] == 6
    assert (
        arms["top-8"]["real_entries_per_token"] == 8
        and 1 <= arms["sampled N=16"]["real_entries_per_token"] <= 16
    )
    assert 2 <= arms["top-p 0.9"]["real_entries_per_token"] <= 8
    assert all(
        a["tokens"] == result["tokens"] and a["decode_tokens_per_s"] > 0 for a in arms.values()
    )
    report = open(tmp_path / "b" / "report.txt").read()
    assert (
        "targets sampled N=16" in report
        and json.load(open(tmp_path / "b" / "cache.json"))["targets"] == arms
    )
    # the arms' caches removed
    assert sorted(os.listdir(tmp_path / "b")) == ["cache.json", "report.txt"]


def test_an_unknown_target_arm_is_refused(teacher_dir, text_file, tmp_path):
    cfg = CacheBenchConfig(
        teacher=teacher_dir,
        data=[text_file],
        out=str(tmp_path / "b"),
        seq_len=32,
        k=8,
        sequences=3,
        targets=["sampled", "bogus"],
        samples=16,
    )
    with pytest.raises(
        ValueError, match=r"targets: expected some of .* \(or none\), got \['bogus'\]"
    ):
        run_cache_bench(cfg)
