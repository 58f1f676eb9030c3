"""Reading a cache: decoded rows, DataLoader workers, and every refusal (corrupt, truncated, mixed, mismatched)."""

import json
import os
import shutil

import pytest
import torch

from tests.conftest import cache_config
from topkd.cache import CacheError, TopKCache, build
from topkd.cli import main


@pytest.fixture
def cache_copy(built_cache, tmp_path):
    return shutil.copytree(built_cache, tmp_path / "copy")


def shard_file(root, j=1):
    return os.path.join(root, "shards", f"shard-{j:05d}.safetensors")


def test_rows_have_the_documented_shapes_and_dtypes(built_cache):
    cache = TopKCache(built_cache)
    row = cache[-1]
    n, k = row["input_ids"].shape[0], cache.k
    assert 0 < n <= 48 and k == 16 and len(cache) == cache.manifest["totals"]["sequences"]
    assert row["teacher_ids"].shape == (n, k) and row["teacher_ids"].dtype == torch.int64
    assert (
        row["teacher_logprobs"].shape == (n, k) and row["teacher_logprobs"].dtype == torch.float32
    )
    assert (
        row["logz"].shape == (n, 1)
        and row["log_tail"].shape == (n,)
        and row["doc_starts"].dtype == torch.int64
    )
    assert int(row["doc_starts"][0]) == 0 and row["source_index"] == len(cache) - 1
    assert sum(cache[i]["input_ids"].numel() for i in range(len(cache))) == cache.tokens
    with pytest.raises(IndexError, match="out of range"):
        cache[len(cache)]


def test_rows_feed_the_loss_directly(built_cache):
    import topkd

    cache = TopKCache(built_cache)
    row = cache[0]
    n = row["input_ids"].shape[0]
    hidden, weight = torch.randn(n, 8, requires_grad=True), torch.randn(cache.vocab_size, 8)
    loss = topkd.fused_linear_kd(
        hidden,
        weight,
        row["teacher_ids"],
        row["teacher_logprobs"],
        temperature=2.0,
        teacher_logz=row["logz"][:, 0],
    )
    loss.backward()
    assert torch.isfinite(loss) and hidden.grad.abs().sum() > 0


def test_dataloader_workers_read_the_same_rows(built_cache):
    cache = TopKCache(built_cache)
    cache[0]  # open handles in the parent first: workers must re-open their own
    loader = torch.utils.data.DataLoader(
        cache, batch_size=None, num_workers=2, multiprocessing_context="fork"
    )
    for i, row in enumerate(loader):
        assert torch.equal(row["teacher_ids"], cache[i]["teacher_ids"])
        assert torch.equal(row["teacher_logprobs"], cache[i]["teacher_logprobs"])


def test_missing_manifest_is_refused_with_the_remedy(cache_copy):
    os.remove(os.path.join(cache_copy, "manifest.json"))
    with pytest.raises(CacheError, match="rerun `topkd cache build` with the same arguments"):
        TopKCache(str(cache_copy))


def test_not_a_directory_is_refused(tmp_path):
    with pytest.raises(CacheError, match="not a directory"):
        TopKCache(str(tmp_path / "nothing"))


def test_truncated_shard_is_refused_on_open(cache_copy):
    path = shard_file(cache_copy)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 10)
    with pytest.raises(CacheError, match="truncated"):
        TopKCache(str(cache_copy))


def test_corrupted_byte_is_found_by_verify(cache_copy, capsys):
    path = shard_file(cache_copy)
    data = bytearray(open(path, "rb").read())
    header_len = int.from_bytes(data[:8], "little")
    start = json.loads(data[8 : 8 + header_len])["log_mass"]["data_offsets"][0]
    data[8 + header_len + start] ^= 0x01  # one bit of a stored mass: the file still parses
    open(path, "wb").write(bytes(data))
    cache = TopKCache(str(cache_copy))  # opening checks sizes and headers only
    problems = cache.verify()
    assert len(problems) == 1 and "sha256 mismatch" in problems[0]
    cache[0]  # shard 0 is intact
    with pytest.raises(CacheError, match="sha256 mismatch"):
        cache[cache.manifest["shards"][1]["sequences"][0]]  # the first read of shard 1 checks it
    assert TopKCache(str(cache_copy), verify_reads=False)[4]["teacher_ids"].shape[1] == 16
    assert main(["cache", "verify", str(cache_copy)]) == 1
    assert "FAILED" in capsys.readouterr().out


def test_corrupted_header_is_refused_on_open(cache_copy):
    path = shard_file(cache_copy)
    data = bytearray(open(path, "rb").read())
    data[9:13] = b"@@@@"  # inside the JSON header, size unchanged
    open(path, "wb").write(bytes(data))
    with pytest.raises(CacheError, match="unreadable header"):
        TopKCache(str(cache_copy))


def test_mixed_fingerprints_are_refused(cache_copy):
    path = os.path.join(cache_copy, "manifest.json")
    manifest = json.load(open(path))
    manifest["shards"][1]["build_hash"] = "0" * 64
    json.dump(manifest, open(path, "w"))
    with pytest.raises(CacheError, match="different builds"):
        TopKCache(str(cache_copy))


def test_manifest_of_another_format_is_refused(cache_copy):
    path = os.path.join(cache_copy, "manifest.json")
    manifest = json.load(open(path))
    manifest["format_version"] = 99
    json.dump(manifest, open(path, "w"))
    with pytest.raises(CacheError, match="v99"):
        TopKCache(str(cache_copy))


def test_verify_and_inspect_commands(built_cache, tmp_path, capsys):
    assert main(["cache", "verify", built_cache]) == 0
    assert main(["cache", "inspect", built_cache, "--plot", str(tmp_path / "m.png")]) == 0
    captured = capsys.readouterr()
    out = captured.out
    last = json.loads(out.strip().splitlines()[-1])
    assert last["tokens"] == TopKCache(built_cache).tokens and 0 < last["mass_mean"] <= 1
    assert (
        "bytes/token" in out
        and "[0.990, 0.999)" in out
        and (tmp_path / "m.png").stat().st_size > 5000
    )
    assert (
        f"topkd cache inspect: wrote the histograms (kept mass, ids per token) to {tmp_path / 'm.png'}"
        in captured.err
    )


def test_the_histograms_count_the_rows_that_train(built_cache, monkeypatch):
    """A chat cache's masked rows (its repeated system prompt) showed as spikes of rows no loss reads."""
    import dataclasses

    import numpy as np

    from topkd.cache.format.shard import ShardReader
    from topkd.cache.reading.inspect import row_stats

    cache = TopKCache(built_cache)
    everything = row_stats(cache)
    real = ShardReader.sequence

    def masked(self, j):  # every other row of every sequence masked, as if prompts
        seq = real(self, j)
        return dataclasses.replace(seq, row_mask=np.arange(len(seq)) % 2 == 1)

    expected = np.concatenate(
        [
            np.exp(cache.shard(j).tensor("log_mass").astype(np.float64))
            for j in range(len(cache.manifest["shards"]))
        ]
    )
    monkeypatch.setattr(ShardReader, "sequence", masked)
    kept = row_stats(cache)
    assert np.allclose(everything.mass, expected) and (everything.width == cache.k).all()
    starts = np.cumsum([0] + cache.sequence_lengths()[:-1])
    odd = np.concatenate([s + np.arange(1, n, 2) for s, n in zip(starts, cache.sequence_lengths())])
    assert np.array_equal(kept.mass, everything.mass[odd]) and len(kept.width) == len(odd)


def test_cli_prints_a_refusal_without_a_traceback(tmp_path, capsys):
    assert main(["cache", "inspect", str(tmp_path)]) == 2
    assert "manifest.json is missing" in capsys.readouterr().err


def test_corrupted_zstd_frame_fails_loudly_even_unverified(cache_copy):
    path = shard_file(cache_copy)
    data = bytearray(open(path, "rb").read())
    header_len = int.from_bytes(data[:8], "little")
    start, end = json.loads(data[8 : 8 + header_len])["zstd_frames"]["data_offsets"]
    data[8 + header_len + (start + end) // 2] ^= 0x10
    open(path, "wb").write(bytes(data))
    cache = TopKCache(str(cache_copy), verify_reads=False)
    first = cache.manifest["shards"][1]["sequences"][0]
    with pytest.raises(ValueError, match="corrupt"):
        # frames carry a checksum: a flipped bit never decodes silently
        for i in range(first, first + 4):
            cache[i]


def test_shard_rows_that_disagree_with_the_manifest_are_refused(cache_copy):
    path = os.path.join(cache_copy, "manifest.json")
    manifest = json.load(open(path))
    manifest["shards"][0]["tokens"] += 1
    manifest["totals"]["tokens"] += 1  # consistent totals: only the shard's own rows can tell
    json.dump(manifest, open(path, "w"))
    with pytest.raises(CacheError, match="do not match the sidecar's"):
        TopKCache(str(cache_copy))


def test_only_a_bounded_number_of_shards_stay_open(built_cache, monkeypatch):
    from topkd.cache.reading import reader

    monkeypatch.setattr(reader, "OPEN_SHARDS", 2)
    cache = TopKCache(built_cache)
    rows = [cache[i]["teacher_ids"] for i in range(len(cache))]
    assert len(cache._readers) == 2 and len(cache.manifest["shards"]) > 2
    assert all(torch.equal(cache[i]["teacher_ids"], rows[i]) for i in range(len(cache)))


def test_a_teacher_overwritten_after_the_build_is_refused_by_load_teacher(
    teacher_dir, text_file, tmp_path
):
    """A re-download of another checkpoint into the teacher's folder: same architecture and tokenizer, other
    weights. --init-from-teacher used to cut the student from it (step-2 loss 11.9 instead of 0.47)."""
    from tests.cache.tiny import make_teacher
    from tests.train.runs import config
    from topkd.train import train

    teacher = shutil.copytree(teacher_dir, tmp_path / "teacher")
    build(cache_config(str(teacher), text_file, tmp_path / "c", max_sequences=4))
    cache = TopKCache(str(tmp_path / "c"))
    assert cache.load_teacher().vocab == cache.vocab_size  # the same teacher loads
    make_teacher(str(teacher), seed=1)
    with pytest.raises(
        CacheError, match=r"teacher at .* is not the one that built it \(its weights sha256"
    ):
        cache.load_teacher()
    with pytest.raises(CacheError, match="restore that checkpoint there, or rebuild the cache"):
        train(config(str(tmp_path / "c"), tmp_path / "run", steps=1))
