"""`topkd bench cache`: bytes/token, decode fidelity and build overhead of the top-K cache on a real teacher.

    topkd bench cache --teacher SmolLM2-135M-Instruct.Q4_1.gguf --data hamlet.txt --out benchmarks/results/cache-cpu

In one process, over the same sequences: (1) build overhead: the teacher's plain forward
(`model(ids).logits`) against the cache path (body + chunked fp32 top-K head + encode + write),
timed interleaved per batch; (2) size: each codec's shard bytes per token, by part, against the
naive layout (int32 ids + fp16 log-probs = 6K bytes) and the empirical entropy of the id gaps;
(3) fidelity: KL(exact || decoded) per token for the bucket (K+1) and renormalised teacher.
"""
from __future__ import annotations

import itertools
import json
import os
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
from tqdm import tqdm

from topkd.bench.stamp import stamp
from topkd.cache import codec
from topkd.cache.build import _teacher_sequence
from topkd.cache.data import iter_documents, pack_sequences
from topkd.cache.shard import CODECS, ShardReader, encode_shard, write_shard
from topkd.cache.teacher import load_teacher


@dataclass
class CacheBenchConfig:
    teacher: str = ""
    data: list[str] = field(default_factory=list)
    out: str = "benchmarks/results/cache-cpu"
    seq_len: int = 512
    k: int = 100
    sequences: int = 16
    batch_size: int = 4
    temperatures: list[float] = field(default_factory=lambda: [2.0])
    dtype: str = "float32"


CACHE_BENCH_HELP = {
    "teacher": "teacher model directory or .gguf file", "data": "text/jsonl/npy files",
    "out": "output directory (cache.json, report.txt)", "seq_len": "tokens per sequence",
    "k": "top-K", "sequences": "sequences measured", "batch_size": "sequences per teacher forward",
    "temperatures": "c_T stored for these T (part of the measured bytes)", "dtype": "teacher dtype",
}


def run_cache_bench(cfg: CacheBenchConfig) -> dict:
    teacher = load_teacher(cfg.teacher, cfg.dtype)
    seqs = list(itertools.islice(pack_sequences(iter_documents(cfg.data, teacher.tokenizer), cfg.seq_len,
                                                teacher.tokenizer.eos_token_id), cfg.sequences))
    os.makedirs(cfg.out, exist_ok=True)
    timing, rows = _time_build(teacher, seqs, cfg)
    tokens = sum(len(s.tokens) for s in seqs)
    result = {"bench": "cache", "config": asdict(cfg), "stamp": stamp("cpu"), "tokens": tokens,
              "vocab": teacher.vocab, "timing": timing, "codecs": {}}
    exact = [_teacher_sequence(s, r) for s, r in zip(seqs, rows)]
    for name in CODECS:
        result["codecs"][name] = _size_and_fidelity(exact, teacher.vocab, name, cfg.out)
    result["id_gap_entropy_bits"] = _gap_entropy(exact)
    result["naive_bytes_per_token"] = 6 * cfg.k
    result["targets"] = _targets(result)
    report = _report(result)
    print(report)
    with open(os.path.join(cfg.out, "report.txt"), "w") as f:
        f.write(report + "\n")
    with open(os.path.join(cfg.out, "cache.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({"bench": "cache", "out": cfg.out, "targets": result["targets"]}))
    return result


def _time_build(teacher, seqs, cfg) -> tuple[dict, list[dict]]:
    """Interleaved per batch: plain forward, then the cache path (rows, encode, write)."""
    forward_s = cache_s = 0.0
    rows: list[dict] = []
    batches = [seqs[i:i + cfg.batch_size] for i in range(0, len(seqs), cfg.batch_size)]
    warm = torch.from_numpy(np.stack([s.tokens for s in batches[0]]))[:, :16]
    with torch.inference_mode():
        teacher.model(warm)  # first-call costs count for neither side
        teacher.topk_rows(warm, cfg.k, tuple(cfg.temperatures))
    for batch in tqdm(batches, desc="bench cache", unit="batch"):
        by_len = [s for s in batch if len(s.tokens) == len(batch[0].tokens)]
        ids = torch.from_numpy(np.stack([s.tokens for s in by_len]))
        t0 = time.perf_counter()
        with torch.inference_mode():
            teacher.model(ids, use_cache=False).logits.sum()
        t1 = time.perf_counter()
        flat = teacher.topk_rows(ids, cfg.k, tuple(cfg.temperatures))
        per_seq = [{n: v[i * ids.shape[1]:(i + 1) * ids.shape[1]] for n, v in flat.items()} for i in range(len(by_len))]
        arrays, meta = encode_shard([_teacher_sequence(s, r) for s, r in zip(by_len, per_seq)], vocab=teacher.vocab)
        write_shard(os.path.join(cfg.out, "timing.safetensors"), arrays, meta)
        t2 = time.perf_counter()
        forward_s, cache_s = forward_s + t1 - t0, cache_s + t2 - t1
        rows.extend(per_seq)
        batch[:] = by_len  # a shorter last sequence is left out of both sides alike
    os.remove(os.path.join(cfg.out, "timing.safetensors"))
    kept = [s for b in batches for s in b]
    seqs[:] = kept
    return {"forward_s": forward_s, "cache_path_s": cache_s, "overhead": cache_s / forward_s - 1}, rows


def _size_and_fidelity(exact, vocab: int, name: str, out: str) -> dict:
    arrays, meta = encode_shard(exact, vocab=vocab, codec_name=name)
    path = os.path.join(out, f"sample-{name}.safetensors")
    nbytes = write_shard(path, arrays, meta)
    reader = ShardReader(path)
    kl_bucket, kl_renorm = [], []
    for j, seq in enumerate(exact):
        got = reader.sequence(j)
        a, b = _by_id(seq.ids, seq.logprobs), _by_id(got.ids, got.logprobs)
        if not np.array_equal(a[0], b[0]):
            raise AssertionError(f"codec {name}: decoded ids differ from the teacher's in sequence {j}")
        kl_bucket.append(_kl(a[1], b[1]))
        kl_renorm.append(_kl(a[1] - _lse(a[1]), b[1] - _lse(b[1])))
    os.remove(path)
    tokens = sum(len(s) for s in exact)
    parts = {n: int(v.nbytes) for n, v in arrays.items()}
    kb, kr = np.concatenate(kl_bucket), np.concatenate(kl_renorm)
    return {"bytes": nbytes, "bytes_per_token": nbytes / tokens, "rice_b": meta.get("rice_b"),
            "part_bytes_per_token": {n: v / tokens for n, v in parts.items()},
            "kl_bucket_mean": float(kb.mean()), "kl_bucket_max": float(kb.max()),
            "kl_renorm_mean": float(kr.mean()), "kl_renorm_max": float(kr.max())}


def _by_id(ids: np.ndarray, logprobs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    order = np.argsort(ids, axis=1)
    return np.take_along_axis(ids, order, 1), np.take_along_axis(logprobs, order, 1).astype(np.float64)


def _lse(x: np.ndarray) -> np.ndarray:
    m = x.max(axis=1, keepdims=True)
    return m + np.log(np.exp(x - m).sum(axis=1, keepdims=True))


def _kl(exact: np.ndarray, decoded: np.ndarray) -> np.ndarray:
    """Per token sum_k p_k (log p_k - log p^_k); the tail bucket is stored exactly, so it adds nothing."""
    return (np.exp(exact) * (exact - decoded)).sum(axis=1)


def _gap_entropy(exact) -> float:
    """Empirical entropy (bits per id) of the sorted-id gaps: a floor for any gap coder of one distribution."""
    gaps = np.concatenate([codec.id_gaps(np.sort(s.ids.astype(np.int64), axis=1)).ravel() for s in exact])
    counts = np.bincount(gaps)
    p = counts[counts > 0] / gaps.size
    return float(-(p * np.log2(p)).sum())


def _targets(r: dict) -> list[dict]:
    rice = r["codecs"]["rice"]
    return [{"target": "bytes/token <= 250 at K=100 (rice)", "value": rice["bytes_per_token"], "limit": 250,
             "pass": rice["bytes_per_token"] <= 250},
            {"target": "mean decode KL < 1e-3 nats", "value": rice["kl_bucket_mean"], "limit": 1e-3,
             "pass": rice["kl_bucket_mean"] < 1e-3},
            {"target": "build overhead <= 10% of teacher forward", "value": r["timing"]["overhead"], "limit": 0.10,
             "pass": r["timing"]["overhead"] <= 0.10}]


def _report(r: dict) -> str:
    s, t = r["stamp"], r["timing"]
    lines = [f"cache bench: {r['config']['teacher']} V={r['vocab']} K={r['config']['k']} {r['tokens']} tokens",
             f"stamp: {s['machine']}, torch {s['torch']}, topkd {s['topkd']}, commit {s['commit']}, {s['date']}",
             f"build: teacher forward {t['forward_s']:.2f}s, cache path {t['cache_path_s']:.2f}s "
             f"-> overhead {100 * t['overhead']:.1f}%",
             f"naive int32 ids + fp16 log-probs: {r['naive_bytes_per_token']} B/token; "
             f"id gap entropy {r['id_gap_entropy_bits']:.2f} bits/id"]
    for name, c in r["codecs"].items():
        parts = ", ".join(f"{n} {v:.1f}" for n, v in sorted(c["part_bytes_per_token"].items(), key=lambda kv: -kv[1]))
        lines.append(f"{name:<7} {c['bytes_per_token']:7.1f} B/token (b={c['rice_b']})  KL bucket mean "
                     f"{c['kl_bucket_mean']:.2e} max {c['kl_bucket_max']:.2e}, renorm mean {c['kl_renorm_mean']:.2e} "
                     f"max {c['kl_renorm_max']:.2e}\n        parts B/token: {parts}")
    lines += [f"{'PASS' if x['pass'] else 'FAIL'}  {x['target']:<45} {x['value']:.4g} (limit {x['limit']})"
              for x in r["targets"]]
    return "\n".join(lines)
